"""watch's global patches, installed while any thread watches (refcounted): the roots of
torch.autograd.backward and torch.autograd.grad (the loss) are sinks, optimizer.step() is a phase
of its own (optimizer_step.py), F.scaled_dot_product_attention's output is checked for NaN from
masked-out keys (sdpa.py), and CUDA graph capture
is refused inside a block (``torch.cuda.graph``'s ``__enter__`` before it switches streams,
``CUDAGraph.capture_begin``). Each patch checks that the calling thread watches."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

# session.py loads the library and installs the native module (or its stand-in under the
# stable core) before it imports this one.
_native = sys.modules[__package__ + ".session"]._native
from . import optimizer_step as _optimizer_step  # noqa: E402  (needs the native module above)
from . import sdpa as _sdpa  # noqa: E402  (needs the native module above)

_patch_lock = threading.Lock()
_patch_users = 0
_originals: dict[str, Any] = {}


def _roots(tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for t in (tensors or ()) if isinstance(t, torch.Tensor)]


def _patched_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
    roots = _roots(tensors)
    if roots and _native._watch_active():
        _native._watch_reached(roots, ["the loss (a root of backward)"] * len(roots))
        _optimizer_step.loss_passed(roots)
    return _originals["backward"](tensors, *args, **kwargs)


def _patched_grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
    roots = _roots(outputs)
    if roots and _native._watch_active():
        _native._watch_reached(roots, ["an output torch.autograd.grad differentiates"] * len(roots))
    return _originals["grad"](outputs, *args, **kwargs)


def _patched_sdpa(*args: Any, **kwargs: Any) -> Any:
    """sdpa.py: NaN/Inf only at masked-out key positions named at the attention."""
    return _sdpa.check(_originals["sdpa"], args, kwargs)


def _patched_matmul(*args: Any, **kwargs: Any) -> Any:
    """sdpa.py: eager attention's product with a value cache's masked-out NaN."""
    return _sdpa.check_matmul(_originals["matmul"], args, kwargs)


def _patched_tensor_matmul(self: Any, other: Any) -> Any:
    if not isinstance(other, torch.Tensor):
        return torch._C.TensorBase.__matmul__(self, other)
    return _sdpa.check_matmul(torch._C.TensorBase.matmul, (self, other), {})


def _patched_bmm(*args: Any, **kwargs: Any) -> Any:
    return _sdpa.check_matmul(_originals["bmm"], args, kwargs)


_matmul_users = 0


def install_matmul() -> None:
    """While a block holds a buffer non-finite on entry: eager attention's products are checked
    (sdpa.check_matmul). Refcounted apart from install(): no block without one pays for it."""
    global _matmul_users
    with _patch_lock:
        _matmul_users += 1
        if _matmul_users > 1:
            return
        _originals["matmul"] = torch.matmul
        _originals["bmm"] = torch.bmm
        torch.matmul = _patched_matmul
        torch.bmm = _patched_bmm
        torch.Tensor.__matmul__ = _patched_tensor_matmul  # type: ignore[method-assign]
        torch.Tensor.matmul = _patched_tensor_matmul  # type: ignore[method-assign]


def remove_matmul() -> None:
    global _matmul_users
    with _patch_lock:
        _matmul_users -= 1
        if _matmul_users > 0:
            return
        torch.matmul = _originals.pop("matmul")
        torch.bmm = _originals.pop("bmm")
        del torch.Tensor.__matmul__, torch.Tensor.matmul  # back to TensorBase's (Tensor has none)


def _refuse_capture() -> None:
    from ..errors import WatchCaptureError

    raise WatchCaptureError(when="begun inside a watch block (torch.cuda.graph / CUDAGraph.capture_begin)")


def _patched_capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
    if _native._watch_active():
        _refuse_capture()
    return _originals["capture_begin"](self, *args, **kwargs)


def _patched_graph_enter(self: Any) -> Any:
    # Refused before torch.cuda.graph.__enter__ synchronizes and makes its side stream
    # current: a refusal from capture_begin would leave that stream current (the context's
    # __exit__ never runs when __enter__ raises).
    if _native._watch_active():
        _refuse_capture()
    return _originals["graph_enter"](self)


def install() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users > 1:
            return
        _originals["backward"] = torch.autograd.backward
        _originals["grad"] = torch.autograd.grad
        torch.autograd.backward = _patched_backward
        torch.autograd.grad = _patched_grad
        _optimizer_step.install()
        _originals["sdpa"] = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = _patched_sdpa
        graph_cls = getattr(torch.cuda, "CUDAGraph", None)
        if graph_cls is not None and "capture_begin" in graph_cls.__dict__:
            _originals["capture_begin"] = graph_cls.__dict__["capture_begin"]
            graph_cls.capture_begin = _patched_capture_begin
        graph_ctx = getattr(torch.cuda, "graph", None)
        if isinstance(graph_ctx, type) and "__enter__" in graph_ctx.__dict__:
            _originals["graph_enter"] = graph_ctx.__dict__["__enter__"]
            graph_ctx.__enter__ = _patched_graph_enter


def remove() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users > 0:
            return
        torch.autograd.backward = _originals.pop("backward")
        torch.autograd.grad = _originals.pop("grad")
        torch.nn.functional.scaled_dot_product_attention = _originals.pop("sdpa")
        if "capture_begin" in _originals:
            torch.cuda.CUDAGraph.capture_begin = _originals.pop("capture_begin")
        if "graph_enter" in _originals:
            torch.cuda.graph.__enter__ = _originals.pop("graph_enter")
