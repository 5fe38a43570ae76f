"""``watch``: the op and module that first produced NaN/Inf, forward and backward.

>>> with cublas_guard_ext.watch(model, mode="async"):
...     loss = model(batch).loss
...     loss.backward()

Every op the block runs (forward, backward, composite ops and what they
decompose into) is observed from C++ (``csrc/watch/``): a dispatcher
fallback scans each floating output once, in place, and only when an output is
not all finite looks at the op's inputs. An op whose output is non-finite
while its tensor inputs and scalar arguments were finite is a *producer*: the
value is born there, and carries that origin (op, module, phase, the Python
stack) as it propagates; ops that only pass a non-finite input on (an ``-inf``
attention mask, ``masked_fill(..., -inf)``, the softmax after it) are never
blamed.

``report="consequence"`` (the default with a model) judges a non-finite value
by what it reaches: a finding is made only when it reaches the model's
outputs, a loss (a root of backward), a parameter's or argument's gradient, a
parameter or buffer written in the block, or state written outside the
model's forward and backward (an optimizer's); a value the model clamps,
masks, casts to an index or softmaxes away is never reported (T5's ``log(0)``
buckets, a causal ``-inf`` mask passed as an argument). A value born in
backward from finite values (the gradient of ``sqrt`` at 0) is a finding at
once. ``report="birth"`` (the default without a model) reports every producer
at once. Parameters and buffers that are non-finite on entry are reported
before the block starts; a non-finite argument is an origin like an op
(``NonFiniteEntryError`` when it reaches a sink). docs/watch-design.md has the
protocol.

``mode="sync"`` raises at the op; ``"async"`` keeps the first finding and raises
it at the next watched op, at :func:`cublas_guard_ext.check` or at the end of
the block; ``None`` follows :mod:`cublas_guard_ext.modes` (``"off"``: the block
watches nothing). ``allow=`` names ops (``"aten.log"``, ``"aten.log.default"``,
``torch.ops.aten.log``) or module-name patterns (``"encoder.*.attn"``; a module
allowed covers its submodules) where non-finite results are intended.

Any error an op raises inside the block whose message carries a
``CUBLAS_STATUS_*`` or a CUDA error is re-raised as :class:`CublasError`,
:class:`CublasOutOfMemoryError` or :class:`PendingCudaError` naming the op, the
module and the inputs, with the original as ``__cause__``.

``verify_inputs=True`` scans again every input watch already knows finite:
one that is non-finite now was written by no op (a write outside stream order,
through numpy or ``.data``) and raises :class:`NonFiniteFromNowhereError`.
CUDA graph capture is refused inside a block (:class:`WatchCaptureError`,
before anything is captured): watch reads its findings on the host.

The findings are per thread: a block watches the thread that entered it (and
the autograd work that thread's backward starts). Nothing stays registered
after the block: the module hooks are removed and the dispatch key is turned
off again, also when the block raised.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from . import errors, modes
from ._native import loader as _loader
from ._native.codes import MODE_CODES

_loader.load()
torch.ops.cublas_guard_internal.watch_install.default()
_native = sys.modules["cublas_guard_ext._watch_native"]
from . import _watch_patches  # noqa: E402  (needs the native module above)

__all__ = ["watch", "check_pending", "WatchCaptureError", "NonFiniteFromNowhereError"]

_MODE_CODES = {mode: code for mode, code in MODE_CODES.items() if mode != "off"}
_REPORT_CODES = {"consequence": 0, "birth": 1}
_OP_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?")
_OP_NAMESPACES = {"aten", "prims", "quantized", "cublas_guard", "_c10d_functional", "c10d"}

# Parameters/buffers found finite at their current version: not scanned again.
# Keyed by id() with a weak reference to check identity (tensors compare elementwise,
# so a WeakKeyDictionary cannot hold them).
_clean_versions: dict[int, tuple[weakref.ref, int]] = {}
_local = threading.local()


def _op_name(item: Any) -> str | None:
    """'aten::log' / 'aten::log.default' for an op given as an object or a string, else None."""
    if isinstance(item, torch._ops.OpOverload):
        schema = item._schema
        return f"{schema.name}.{schema.overload_name or 'default'}"
    if isinstance(item, torch._ops.OpOverloadPacket):
        return item._qualified_op_name
    if not isinstance(item, str):
        raise TypeError(f"cublas_guard_ext.watch: allow= takes op names or module patterns, got {item!r}")
    if "::" in item:
        return item
    match = _OP_RE.fullmatch(item)
    if match and match.group(1) in _OP_NAMESPACES:
        ns, name, overload = match.groups()
        return f"{ns}::{name}" + (f".{overload}" if overload else "")
    return None


def _split_allow(allow: Iterable[Any]) -> tuple[list[str], list[str]]:
    if isinstance(allow, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        allow = [allow]
    ops, patterns = [], []
    for item in allow:
        name = _op_name(item)
        if name is None:
            patterns.append(item)
        else:
            ops.append(name)
    return ops, patterns


def _name_allowed(name: str, patterns: list[str]) -> bool:
    """A module (or parameter) name matches a pattern, itself or through an ancestor."""
    parts = name.split(".") if name else []
    candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)] or [""]
    return any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns)


def _typed(message: str) -> errors.GuardError:
    """The typed finding for a native message; where it arrived and the birth stack are added."""
    payload = errors.parse_payload(message)
    if payload is not None and payload.get("kind") == NonFiniteFromNowhereError.kind:
        fields = {k: v for k, v in payload.items() if k != "kind"}
        if "dtype" in fields:
            fields["dtype"] = errors._dtype(fields["dtype"])
        return NonFiniteFromNowhereError(**fields)
    err = errors._typed_from_native_message(message)
    if err is None:
        return errors.GuardError(message)
    extra = []
    if err.fields.get("reached"):
        extra.append(f"  reached: {err.fields['reached']}")
    if err.fields.get("birth_stack"):
        frames = str(err.fields["birth_stack"]).splitlines()
        extra.append("  born at (innermost Python frame first): " + frames[0])
        extra += [f"    {f}" for f in frames[1:]]
    if extra:
        err.args = (str(err) + "\n" + "\n".join(extra),)
    return err


def check_pending() -> None:
    """Raise this thread's pending async watch finding, if any (``check()`` calls it)."""
    message = _native.take_pending()
    if message is not None:
        raise _typed(message)


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of these tensors (one device, one dtype) is finite: one multi-tensor
    pass and one host read. The largest magnitude of each (no sum that could overflow; a NaN
    propagates through max), then one isfinite over those."""
    with torch.no_grad():
        largest = torch._foreach_norm([t.detach() for t in tensors], float("inf"))
        return bool(torch.isfinite(torch.stack(largest)).all())


def _entry_error(
    role: str, name: str, tensor: torch.Tensor, counts: tuple[int, int, int, int]
) -> errors.GuardError:
    nan, posinf, neginf, first = counts
    return errors.NonFiniteEntryError(
        role=role,
        name=name,
        nan_count=nan,
        posinf_count=posinf,
        neginf_count=neginf,
        first_bad_index=first,
        shape=list(tensor.shape),
        dtype=str(tensor.dtype),
    )


def _tensors_in(value: Any, path: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors_in(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors_in(v, f"{path}[{k!r}]")


def _op_failure(payload: str, original: Any, message: str) -> BaseException:
    """Called by csrc/watch/watch_reraise.cpp: the typed error for an op that failed with a cuBLAS/CUDA error."""
    fields = json.loads(payload)
    fields.pop("kind", None)
    for key, value in list(fields.items()):
        if key.endswith("_dtype"):
            fields[key] = errors._dtype(value)
    errors._fold_inputs(fields)
    fields["original_error"] = message.strip().splitlines()[0][:400] if message.strip() else message
    status = re.search(r"CUBLAS_STATUS_[A-Z_]+", message)
    cls: type[errors.GuardError]
    if status:
        by_name = {entry[0]: code for code, entry in errors.CUBLAS_STATUS.items()}
        fields["status_name"] = status.group(0)
        fields["status"] = by_name.get(status.group(0), -1)
        cls = errors.CublasOutOfMemoryError if fields["status"] == 3 else errors.CublasError
    else:
        detail = re.search(r"CUDA error: ([^\n]*)", message)
        fields["cuda_error_string"] = detail.group(1).strip() if detail else message.strip()[:200]
        fields["cuda_error"] = "cudaError"
        fields["stage"] = f"when {fields.get('op')} ran"
        fields["launch_blocking"] = __import__("os").environ.get("CUDA_LAUNCH_BLOCKING") == "1"
        cls = errors.PendingCudaError
    err = cls(**fields)
    err.__cause__ = original if isinstance(original, BaseException) else RuntimeError(message)
    return errors.attach_capsule(err)


class WatchCaptureError(errors.GuardError, RuntimeError):
    """CUDA graph capture was asked for inside a ``watch`` block (or a block was entered during one).

    watch reads what its scans found on the host, which a capture forbids; it refuses before
    anything is captured, so the capture can be retried outside the block."""

    kind = "watch_graph_capture"

    def _headline(self) -> str:
        return (
            f"watch: CUDA graph capture {self.fields.get('when', 'inside a watch block')}: watch reads "
            "its scan results on the host, which a capture forbids; nothing was captured"
        )

    def _details(self) -> list[str]:
        return []

    def _next_steps(self) -> list[str]:
        return [
            "capture outside the watch block (watch an eager run of the same step to find a NaN's "
            "origin), or guard the captured step with cublas_guard_ext.guard('async')"
        ]


class NonFiniteFromNowhereError(errors.GuardError, ValueError):
    """``watch(..., verify_inputs=True)``: an op read NaN/Inf from a tensor watch saw produced
    finite, at the same version: no op made it. A write outside stream order (a stream race,
    memory freed too early, another process, a write through a numpy view or ``.data``)."""

    kind = "watch_from_nowhere"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"watch: {f.get('reader')} read {f.get('nan_count')} NaN, {f.get('posinf_count')} +Inf, "
            f"{f.get('neginf_count')} -Inf from its argument '{f.get('argument')}', which "
            f"{f.get('producer')} had produced finite (same version): no op made these values"
        )

    def _details(self) -> list[str]:
        f = self.fields
        return [
            f"argument: shape {list(f.get('shape') or [])} {f.get('dtype')} on {f.get('device')}, "
            f"first bad element at flat index {f.get('first_bad_index')}",
            f"read in {f.get('phase', 'forward')}"
            + (f" in module '{f['module']}'" if f.get("module") else ""),
        ]

    def _next_steps(self) -> list[str]:
        return [
            "a write outside stream order: a tensor used on another stream without "
            "record_stream/wait_stream, memory freed too early, or written behind torch's back "
            "(a numpy view, .data, a raw pointer)",
            "on CUDA, CUDA_LAUNCH_BLOCKING=1 serializes the streams: if it then passes, it is a race",
        ]


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured (a seam the CPU tests replace)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class watch:
    """Context manager: see the module docstring. Reusable; not re-entrant per instance."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        mode: str | None = None,
        allow: Iterable[Any] = (),
        *,
        check_parameters: bool = True,
        report: str | None = None,
        verify_inputs: bool = False,
    ) -> None:
        if mode is not None and mode != "off":
            if mode not in _MODE_CODES:
                raise ValueError(
                    f"cublas_guard_ext.watch: mode must be 'sync', 'async' or None, got {mode!r}"
                )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"cublas_guard_ext.watch: model must be an nn.Module or None, got {type(model).__name__}"
            )
        if report is not None and report not in _REPORT_CODES:
            raise ValueError(
                f"cublas_guard_ext.watch: report must be 'consequence', 'birth' or None, got {report!r}"
            )
        if report == "consequence" and model is None:
            raise ValueError(
                "cublas_guard_ext.watch: report='consequence' needs the model (its outputs, parameters "
                "and gradients are where a non-finite value matters); without one watch reports at birth"
            )
        self.verify_inputs = bool(verify_inputs)
        self.model = model
        self.mode = mode
        # Judged by consequence when there is a model, else at birth (nothing to reach).
        self.report = report if report is not None else ("birth" if model is None else "consequence")
        self.allow_ops, self.allow_patterns = _split_allow(allow)
        self.check_parameters = check_parameters
        self._handles: list[Any] = []
        self._grad_hooked: set[int] = set()
        self._patched = False
        self._active = False

    # -- entry checks -------------------------------------------------------------------
    def _allowed_name(self, name: str) -> bool:
        return bool(self.allow_patterns) and _name_allowed(name, self.allow_patterns)

    def _state_tensors(self) -> Iterable[tuple[str, str, torch.Tensor]]:
        assert self.model is not None
        for role, items in (
            ("parameter", self.model.named_parameters()),
            ("buffer", self.model.named_buffers()),
        ):
            for name, t in items:
                if t.is_floating_point() and t.numel() > 0:
                    yield role, name, t

    def _check_state(self) -> list[torch.Tensor]:
        """Scan the parameters and buffers not known finite at their version; the finite ones."""
        clean = []
        todo = []
        for role, name, t in self._state_tensors():
            known = _clean_versions.get(id(t))
            if known is not None and known[0]() is t and known[1] == t._version:
                clean.append(t)
            else:
                todo.append((role, name, t))
        # Off the CPU a scan's result is a host read each: one fused check per device and dtype
        # first (one read for the lot), the per-tensor scans only where it found something.
        on_devices = [item for item in todo if item[2].device.type != "cpu"]
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, str, torch.Tensor]]] = {}
        for item in on_devices:
            groups.setdefault((item[2].device, item[2].dtype), []).append(item)
        finite = {
            id(t) for items in groups.values() if _all_finite([t for _, _, t in items]) for _, _, t in items
        }
        for role, name, t in todo:
            version = t._version
            if id(t) in finite:
                _clean_versions[id(t)] = (weakref.ref(t), version)
                clean.append(t)
                continue
            counts = _native.scan(t)
            if counts is None:
                continue
            if counts[3] >= 0:
                if self._allowed_name(name):
                    continue
                raise _entry_error(role, name, t, counts)
            _clean_versions[id(t)] = (weakref.ref(t), version)
            clean.append(t)
        return clean

    def _note_clean_state(self) -> None:
        """Parameters the block's own scans left known finite (an optimizer step wrote and scanned
        them): the next block's entry check need not scan them again."""
        for _, _, t in self._state_tensors():
            if _native.known_finite(t):
                _clean_versions[id(t)] = (weakref.ref(t), t._version)

    def _check_args(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        consequence = self.report == "consequence"
        for path, t in _tensors_in((args, kwargs), ""):
            if not t.is_floating_point():
                continue
            if consequence:
                if t.requires_grad and t.is_leaf and id(t) not in self._grad_hooked:
                    self._hook_gradient(
                        t,
                        f"the gradient of the model's argument "
                        f"'{self._arg_name(module, args, kwargs, path)}'",
                    )
                if not _native.known_finite(t):
                    name = self._arg_name(module, args, kwargs, path)
                    _native.entry(t, name, int(self._allowed_name(name)))  # judged by what it reaches
                continue
            counts = _native.scan(t)
            if counts is None or counts[3] < 0:
                continue
            name = self._arg_name(module, args, kwargs, path)
            if self._allowed_name(name):
                continue
            raise _entry_error("argument", name, t, counts)

    def _hook_gradient(self, t: torch.Tensor, where: str) -> None:
        """A leaf's gradient is a sink: checked when autograd has accumulated it."""
        self._grad_hooked.add(id(t))

        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                _native.reached([p.grad], [where])

        self._handles.append(t.register_post_accumulate_grad_hook(hook))

    def _output_reached(self, output: Any) -> None:
        pairs = list(_tensors_in(output, ""))
        if pairs:
            _native.reached([t for _, t in pairs], [f"the model's output{p}" for p, _ in pairs])

    @staticmethod
    def _arg_name(module: torch.nn.Module, args: tuple, kwargs: dict, path: str) -> str:
        # path is "[0][i]..." for positional, "[1]['key']..." for keyword arguments
        match = re.match(r"\[(\d)\]\[([^\]]+)\](.*)", path)
        if match is None:
            return path
        where, key, rest = match.groups()
        if where == "1":
            return key.strip("'\"") + rest
        try:
            import inspect

            params = [
                p
                for p in inspect.signature(module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            return params[int(key)].name + rest
        except (ValueError, TypeError, IndexError):
            return f"args[{key}]{rest}"

    # -- the block ----------------------------------------------------------------------
    def __enter__(self) -> watch:
        if self._active:
            raise RuntimeError("cublas_guard_ext.watch: this watch is already active")
        mode = self.mode if self.mode is not None else modes.current()
        if mode == "off":
            return self
        if _capturing():
            raise WatchCaptureError(when="in progress when the watch block began")
        names: list[str] = []
        ids: dict[int, int] = {}
        clean: list[torch.Tensor] = []
        if self.model is not None:
            for name, module in self.model.named_modules():
                ids[id(module)] = len(names)
                names.append(name)
            if self.check_parameters:
                clean = self._check_state()
        allowed = ["1" if self._allowed_name(n) else "0" for n in names]
        tid = threading.get_ident()
        push, pop = _native.push, _native.pop

        def pre(module: torch.nn.Module, args: Any) -> None:
            if threading.get_ident() == tid:
                i = ids.get(id(module))
                if i is not None:
                    push(i)

        consequence = self.report == "consequence"
        top = id(self.model)
        output_reached = self._output_reached

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() == tid and id(module) in ids:
                pop()
                if consequence and id(module) == top:
                    output_reached(output)

        nn_module = torch.nn.modules.module
        try:
            if self.model is not None:
                self._handles.append(self.model.register_forward_pre_hook(self._check_args, with_kwargs=True))
                self._handles.append(nn_module.register_module_forward_pre_hook(pre))
                self._handles.append(nn_module.register_module_forward_hook(post, always_call=True))
            state, state_names = [], []
            if self.model is not None:
                for kind, items in (
                    ("parameter", self.model.named_parameters()),
                    ("buffer", self.model.named_buffers()),
                ):
                    for name, t in items:
                        state.append(t)
                        state_names.append(name)
                        if consequence and kind == "parameter" and t.requires_grad:
                            self._hook_gradient(t, f"the gradient of parameter '{name}'")
            _watch_patches.install()
            self._patched = True
            _native.begin(
                _MODE_CODES[mode],
                names,
                allowed,
                self.allow_ops,
                clean,
                _REPORT_CODES[self.report],
                int(self.model is not None),
                state,
                state_names,
            )
            if self.verify_inputs:
                _native.set_verify(True)
        except BaseException:
            self._remove_hooks()
            raise
        self._active = True
        return self

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._grad_hooked.clear()
        if self._patched:
            self._patched = False
            _watch_patches.remove()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if not self._active:
            return False
        self._active = False
        self._remove_hooks()
        if self.model is not None and self.check_parameters:
            try:
                self._note_clean_state()
            except Exception:  # only spares the next entry check a scan
                pass
        pending = _native.end()
        if pending is not None:
            finding = _typed(pending)
            if exc is None:
                raise finding
            if hasattr(exc, "add_note"):  # the exception in flight stays; the finding is noted
                exc.add_note(f"cublas_guard_ext.watch also recorded earlier: {finding}")
        return False

    def stats(self) -> tuple[int, int, int] | None:
        """(ops seen, outputs scanned, scans saved) so far in this thread's innermost watch.

        Saved: values already known (the last scan of the same storage at the same version) or
        finite by construction (ops that only move values, see ``csrc/watch/``)."""
        return _native.stats()


def _is_active() -> bool:
    """Whether this thread watches now (tests check nothing is left on)."""
    return bool(_native.active()) or bool(_native.key_included())
