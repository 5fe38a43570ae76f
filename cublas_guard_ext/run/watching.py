"""``run --watch``: watch blocks nobody wrote, over every forward and backward of the run.

A block (the public :class:`cublas_guard_ext.watch`, judging by consequence) opens on the
first outermost module call of a thread: that module is the model. It stays open through the
rest of that forward, the loss, the backward and the optimizer step, and closes

* after each ``optimizer.step()`` (the step's writes to the parameters are watched too);
* when the same model's next outermost call begins (a loop without an optimizer: each forward
  and whatever follows it is one block); another module called at the top (a loss module)
  is watched inside the open block, as code outside the model, except that a block begun at a
  module without parameters gives way to the first module with parameters (the model);
* when an exception leaves the outermost call, at the process's exit, and in a forked child
  (a DataLoader worker) that inherited an open block.

Outermost calls are seen by wrapping ``nn.Module.__call__`` (only with ``--watch``; a plain
counter per thread). Not a global forward pre-hook: a block opened from inside one would see
the model's own call end without its start. Compiled code runs eagerly under ``--watch``
(``torch.compiler.set_stance("force_eager")``): watch names the ops the eager code runs.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ..training.state import _unwrap
from ..watching.session import watch
from . import steps

_local = threading.local()
_original_call: list[Any] = []
_mode = ["sync"]
_registered: list[bool] = []  # the atexit and fork handlers (they cannot be unregistered)


def _state() -> Any:
    st = _local
    if not hasattr(st, "depth"):
        st.depth = 0
        st.block = None
        st.root = None
        st.opener = None
        st.root_has_parameters = False
    return st


def current_root() -> nn.Module | None:
    """The model of this thread's open block (or of the last one), for the report's tree."""
    st = _state()
    return st.root() if st.root is not None else None


def close(exc: BaseException | None = None) -> None:
    """End this thread's block, if one is open (with the exception in flight, if any)."""
    st = _state()
    block, st.block = st.block, None
    if block is not None:
        if exc is None:
            block.__exit__(None, None, None)
        else:
            block.__exit__(type(exc), exc, exc.__traceback__)


def _open(module: nn.Module) -> None:
    """A block over ``module`` (looked through DDP / compile wrappers: watch names the modules
    inside them as the model's own)."""
    st = _state()
    model = _unwrap(module)
    block = watch(model, mode=_mode[0])
    block.__enter__()
    st.block = block
    st.root = weakref.ref(model)
    st.opener = weakref.ref(module)
    st.root_has_parameters = _has_parameters(model)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _watched_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    st = _state()
    depth = st.depth
    if depth == 0:
        if st.block is not None and st.opener is not None and st.opener() is self:
            close()  # the model's next forward: the last one's block is done
        elif st.block is not None and not st.root_has_parameters and _has_parameters(self):
            close()  # the block began at a module without parameters (a loss): this is the model
        if st.block is None:
            _open(self)
    st.depth = depth + 1
    try:
        return _original_call[0](self, *args, **kwargs)
    except BaseException as exc:
        if depth == 0:
            close(exc)
        raise
    finally:
        st.depth = depth


def _after_step(_optimizer: Any) -> None:
    close()


def _close_at_exit() -> None:
    try:
        close()
    except Exception as err:  # a finding at exit: said, not raised into interpreter shutdown
        print(f"cublas_guard_ext run: at exit, watch reported: {err}", flush=True)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) does not watch the parent's model."""
    st = _state()
    block, st.block, st.depth = st.block, None, 0
    if block is not None:
        try:
            block.__exit__(None, None, None)
        except Exception:
            pass


def uninstall() -> None:
    """Undo :func:`install` (a failed install; the atexit and fork handlers find nothing open)."""
    if _original_call:
        nn.Module.__call__ = _original_call.pop()  # type: ignore[method-assign]
        torch.compiler.set_stance("default")


def install(mode: str) -> None:
    if _original_call:
        return
    _mode[0] = "async" if mode == "async" else "sync"
    _original_call.append(nn.Module.__call__)
    nn.Module.__call__ = _watched_call  # type: ignore[method-assign]
    torch.compiler.set_stance("force_eager")
    steps.on_step(_after_step)
    if not _registered:
        _registered.append(True)
        atexit.register(_close_at_exit)
        os.register_at_fork(after_in_child=_forget_in_child)
