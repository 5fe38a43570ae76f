"""``watch``: the op and module where a NaN/Inf was born, forward and backward.

The user guide is ``docs/watch.md``, the protocol ``docs/watch-design.md``; the
class :class:`watch` below has the reference (``help(cublas_guard_ext.watch)``).
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import threading
from collections.abc import Iterable
from typing import Any

import torch

from .. import errors
from .._native.loading import seam as _native_seam
from .._native.loading.codes import MODE_CODES
from ..errors import NonFiniteFromNowhereError, WatchCaptureError
from ..errors import optimizer_step as _optimizer_messages
from ..errors.format import _dtype, _fold_inputs
from ..errors.parse import _typed_from_native_message
from ..guarded_linear import modes
from ..guarded_linear import ops as _ops

# Under the stable core alone (no version-locked library for this torch) watch says how to build it.
_seam = _native_seam.seam()
AVAILABLE = _seam.has_watch
_native = _seam.watch_methods("cublas_guard_ext.watch")
from . import global_patches as _watch_patches  # noqa: E402  (needs the native module above)
from . import optimizer_step as _optimizer_step  # noqa: E402

__all__ = ["watch", "check_pending", "WatchCaptureError", "NonFiniteFromNowhereError"]

_MODE_CODES = {mode: code for mode, code in MODE_CODES.items() if mode != "off"}
_REPORTS = ("consequence", "birth")
_OP_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?")
_OP_NAMESPACES = {"aten", "prims", "quantized", "cublas_guard", "_c10d_functional", "c10d"}
_DEFAULT_CAPACITY = 4096


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


_thread_state = threading.local()


def _entry_slices() -> dict[str, list]:
    """Where the bad values of this thread's deferred buffers sat on entry, by name (their
    findings say it, as a refusal on entry does; an argument's spread says nothing of a cache)."""
    if not hasattr(_thread_state, "entries"):
        _thread_state.entries = {}
    return _thread_state.entries


def _typed(message: str) -> errors.GuardError:
    """The typed finding for a native message; where it arrived and where it was born are added."""
    err = _typed_from_native_message(message)
    if err is None:
        return errors.GuardError(message)
    if isinstance(err, errors.NonFiniteEntryError) and err.fields.get("bad_slices") is None:
        slices = _entry_slices().get(str(err.fields.get("name")))
        if slices and err.fields.get("role") == "buffer":
            err = errors.NonFiniteEntryError(**{**err.fields, "bad_slices": slices})
    if isinstance(err, errors.NonFiniteOutputError) and err.fields.get("phase") == "optimizer step":
        fields = dict(err.fields)
        fields.update(_optimizer_step.describe(fields))
        _optimizer_step.left_step()
        fields["reached"] = _optimizer_messages.reached(fields) or fields.get("reached")
        err = errors.NonFiniteOutputError(**fields)
    f = err.fields
    extra = []
    if f.get("reached") and not isinstance(err, errors.NonFiniteOutputError):  # its own details say it
        extra.append(f"  reached: {f['reached']}")
    if f.get("birth_stack"):
        frames = str(f["birth_stack"]).splitlines()
        extra.append("  born at (innermost Python frame first): " + frames[0])
        extra += [f"    {frame}" for frame in frames[1:]]
    elif f.get("detected_stack"):
        frames = str(f["detected_stack"]).splitlines()
        extra.append(
            "  detected at (not where it was born: watch read the birth after its op returned, as on a "
            "GPU running behind the host; the op and module above are the birth's): " + frames[0]
        )
        extra += [f"    {frame}" for frame in frames[1:]]
    if extra:
        err.args = (str(err) + "\n" + "\n".join(extra),)
    return err


def check_pending() -> None:
    """Raise this thread's pending async watch finding, if any (``check()`` calls it)."""
    message = _native._watch_take_pending()
    if message is not None:
        raise _typed(message)


_ops.raise_pending_watch_findings_with(check_pending)  # check() raises it: ops cannot import us


def _bad_slices(tensor: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """Where a non-finite tensor's bad values sit, read only for the report: (dim, first, last,
    size) for each dimension whose bad values occupy only part of it (a KV cache's unused
    positions: dim 2, 5..15 of 16), None when they are spread over every index of every dim."""
    if tensor.dim() == 0 or tensor.is_sparse:
        return None
    with torch.no_grad():
        bad = ~torch.isfinite(tensor.detach())
        out = []
        for dim in range(bad.dim()):
            others = [d for d in range(bad.dim()) if d != dim]
            hit = bad.any(dim=others) if others else bad
            idx = hit.nonzero().flatten()
            if 0 < idx.numel() < bad.shape[dim]:
                out.append((dim, int(idx[0]), int(idx[-1]), int(bad.shape[dim])))
    return out or None


def _cache_shaped(t: torch.Tensor) -> bool:
    """A non-finite buffer shaped like a preallocated cache ([batch, heads, positions, dim] or
    so): 3-D or more, wholly non-finite (before the prefill writes it) or in part (the positions
    not written yet). Other buffers are still refused on entry: a running statistic is written
    back by ops whose written arguments watch does not read (batch norm's), so waiting for what
    it reaches could lose it."""
    return t.dim() >= 3


def _entry_error(
    role: str, name: str, tensor: torch.Tensor, counts: tuple[int, int, int, int]
) -> errors.GuardError:
    nan, posinf, neginf, first = counts
    return errors.NonFiniteEntryError(
        bad_slices=_bad_slices(tensor),
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
    """Called by csrc/locked/watch/watch_reraise.cpp: the typed error for an op that failed with a cuBLAS/CUDA error."""
    fields = json.loads(payload)
    fields.pop("kind", None)
    for key, value in list(fields.items()):
        if key.endswith("_dtype"):
            fields[key] = _dtype(value)
    _fold_inputs(fields)
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


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured (a seam the CPU tests replace)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class watch:
    """Context manager: names the op and module where a NaN/Inf was born, forward and backward.

    ::

        with cublas_guard_ext.watch(model, mode="async"):
            loss = loss_fn(model(batch), target)
            loss.backward()
            optimizer.step()

    Every op the block runs (forward, backward, the ops composite ops decompose into) goes
    through a C++ dispatcher hook that scans each floating output once. A value born
    non-finite from finite inputs is tagged with its origin (op, module, phase); ops that only
    pass a NaN on (a ``-inf`` mask, ``masked_fill(..., -inf)``, the softmax after it) are never
    blamed. The same protocol runs on the CPU and on CUDA (there with no host sync inside the
    block: docs/watch-design.md).

    Arguments:
        model: the ``nn.Module`` whose modules name the ops (None: no module names, no entry
            check, report="birth").
        mode: ``"sync"`` raises when the finding is known; ``"async"`` keeps the first finding
            and raises it at the next watched op, at :func:`cublas_guard_ext.check` or at the
            end of the block; None follows :mod:`cublas_guard_ext.modes` (``"off"``: nothing).
        allow: ops (``"aten.log"``, ``torch.ops.aten.log``), module-name patterns
            (``"encoder.*.attn"``, covering submodules) and argument/parameter names where
            non-finite values are intended.
        check_parameters: check parameters and buffers on entry (a non-finite one raises
            ``NonFiniteEntryError`` before the block starts; with report="consequence", a
            buffer shaped like a preallocated cache, 3-D or more, is judged by what it reaches
            instead, as an argument is).
        report: ``"consequence"`` (the default with a model): a finding only when a tagged
            value reaches the model's outputs, a loss passed to ``backward``, a gradient, a
            parameter, buffer or optimizer state (T5's clamped ``log(0)`` is silent);
            ``"birth"``: every birth at its op.
        verify_inputs: also rescan inputs watch saw produced finite; a non-finite one raises
            ``NonFiniteFromNowhereError`` (a write outside stream order, ``.data``, numpy).
            Costs a host read per op output (a sync per op on CUDA): for hunting races.
        capacity: births and findings the record keeps, and call descriptors the ring keeps,
            per device (default 4096); a finding raised after more says so in its ``lost``
            field.

    Raises ``NonFiniteOutputError`` (a ``ValueError``) naming the op, the module (or
    ``outside`` it: the loss after the forward, the optimizer step), the phase, the counts
    (NaN, +Inf, -Inf, zeros), the inputs' absolute maxima and the overflow they explain;
    ``NonFiniteEntryError`` for a non-finite argument; cuBLAS/CUDA failures of any op
    re-raised typed (``CublasError``, ``PendingCudaError``); ``WatchCaptureError`` when a CUDA
    graph capture is begun inside the block. Inside the block ``torch.compile``'d code runs
    eagerly (``torch.compiler.set_stance("force_eager")``, restored at the end), so ops inside
    a compiled model are named too.

    Example (an fp16 ``nn.Linear`` whose weights are 0.25, fed 300.0 everywhere, K = 1024)::

        >>> with cg.watch(layer, mode="sync"):
        ...     layer(torch.full((2, 1024), 300.0, dtype=torch.float16))
        NonFiniteOutputError: watch: aten.addmm.default in the watched model's top level (forward)
        produced 0 NaN, 8 +Inf, 0 -Inf from finite inputs
          first bad element: flat index 0 = output[0, 0] (+Inf)
          output: shape [2, 4] torch.float16 on cpu
          inputs: self [4] torch.float16 strides [1]; mat1 [2, 1024] torch.float16 strides
          [1024, 1]; mat2 [1024, 4] torch.float16 strides [1, 1024]
          counts at that op: NaN 0, +Inf 8, -Inf 0, zeros 0
          inputs' absolute maxima: 0, 300, 0.25 (300 squared exceeds the float16 range 65504:
          a product of such values overflows)
        Next: if these values are intended there, pass the op or the module to watch(..., allow=[...])
          reached: the model's output
          born at (innermost Python frame first): train.py:7 in <module>

    Costs: one scan per op output (CPU: in the calling thread, 1.18-1.21x a MiniLM AdamW step
    in CPU time, docs/watch.md; CUDA: one kernel launch per output, no host sync), and at the
    block's start one fused check of the parameters and buffers. Findings are per thread;
    nothing stays registered after the block, also when it raised.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        mode: str | None = None,
        allow: Iterable[Any] = (),
        *,
        check_parameters: bool = True,
        report: str | None = None,
        verify_inputs: bool = False,
        capacity: int = _DEFAULT_CAPACITY,
    ) -> None:
        if mode is not None and mode != "off" and mode not in _MODE_CODES:
            raise ValueError(f"cublas_guard_ext.watch: mode must be 'sync', 'async' or None, got {mode!r}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"cublas_guard_ext.watch: model must be an nn.Module or None, got {type(model).__name__}"
            )
        if report is not None and report not in _REPORTS:
            raise ValueError(
                f"cublas_guard_ext.watch: report must be 'consequence', 'birth' or None, got {report!r}"
            )
        if report == "consequence" and model is None:
            raise ValueError(
                "cublas_guard_ext.watch: report='consequence' needs the model (its outputs, parameters "
                "and gradients are where a non-finite value matters); without one watch reports at birth"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 64 <= capacity <= 1 << 24:
            raise ValueError(
                f"cublas_guard_ext.watch: capacity must be an int in [64, 16777216], got {capacity!r}"
            )
        self.verify_inputs = bool(verify_inputs)
        self.model = model
        self.mode = mode
        self.capacity = capacity
        # Judged by consequence when there is a model, else at birth (nothing to reach).
        self.report = report if report is not None else ("birth" if model is None else "consequence")
        self.allow_ops, self.allow_patterns = _split_allow(allow)
        self.check_parameters = check_parameters
        self._handles: list[Any] = []
        self._grad_hooked: set[int] = set()
        self._deferred_buffers: list[tuple[str, torch.Tensor, list | None]] = []  # non-finite on entry
        self._patched = False
        self._matmul_patched = False
        self._active = False
        self._stance: Any = None

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
                t = _optimizer_step.local_shard(t)
                if t.is_floating_point() and t.numel() > 0:
                    yield role, name, t

    def _check_state(self) -> list[torch.Tensor]:
        """Parameters and buffers on entry: the project's fused scan on each, one host read per
        device and dtype, the per-tensor counts only where it found something. (The scan reads
        ~16 GB/s on one CPU core; ``_foreach_norm(inf)``, used before, 1.3 GB/s: 70 ms of a
        MiniLM step's 90 MB of parameters.) Returns those found
        finite: the block starts them with a finite tag instead of scanning them again."""
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, str, torch.Tensor]]] = {}
        for item in self._state_tensors():
            groups.setdefault((item[2].device, item[2].dtype), []).append(item)
        finite = []
        for items in groups.values():
            # Judged finite at the end of the last watched optimizer step and not written since.
            known = {id(t): t for _, _, t in items if _optimizer_step.known_finite(t)}
            finite += known.values()
            items = [item for item in items if id(item[2]) not in known] if known else items
            if not items or _native._watch_all_finite([t for _, _, t in items]):
                finite += [t for _, _, t in items]
                continue
            for role, name, t in items:
                counts = _native._watch_scan(t)
                if counts is None or counts[3] < 0:
                    finite.append(t)
                elif role == "buffer" and self.report == "consequence" and _cache_shaped(t):
                    # Judged by what it reaches, as an argument is: a KV cache's masked-out
                    # positions are then named at the attention, with the mask (watching/sdpa.py),
                    # and a cache read only where it was written is no finding.
                    with torch.no_grad():
                        self._deferred_buffers.append((name, t, _bad_slices(t)))
                elif not self._allowed_name(name):
                    raise _entry_error(role, name, t, counts)
        return finite

    def _check_args(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        consequence = self.report == "consequence"
        for path, t in _tensors_in((args, kwargs), ""):
            if not t.is_floating_point():
                continue
            if consequence:
                if t.requires_grad and t.is_leaf and id(t) not in self._grad_hooked:
                    self._hook_gradient(
                        t,
                        f"the gradient of the model's argument '{self._arg_name(module, args, kwargs, path)}'",
                    )
                name = self._arg_name(module, args, kwargs, path)
                _native._watch_entry(t, name, self._allowed_name(name))  # judged by what it reaches
                continue
            counts = _native._watch_scan(t)
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
                _native._watch_reached([p.grad], [where])

        self._handles.append(t.register_post_accumulate_grad_hook(hook))

    def _output_reached(self, output: Any) -> None:
        pairs = list(_tensors_in(output, ""))
        if pairs:
            _native._watch_reached([t for _, t in pairs], [f"the model's output{p}" for p, _ in pairs])

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
        finite_state: list[torch.Tensor] = []
        if self.model is not None:
            for name, module in self.model.named_modules():
                ids[id(module)] = len(names)
                names.append(name)
            if self.check_parameters:
                finite_state = self._check_state()
        tid = threading.get_ident()
        push, pop = _native._watch_push, _native._watch_pop

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

        try:
            state: list[tuple[str, torch.Tensor]] = []
            if self.model is not None:
                self._handles.append(self.model.register_forward_pre_hook(self._check_args, with_kwargs=True))
                # Hooks on the model's own modules (not global ones: those would fire for every
                # module of the process, and torch.compile warns about them).
                for module in self.model.modules():
                    self._handles.append(module.register_forward_pre_hook(pre))
                    self._handles.append(module.register_forward_hook(post, always_call=True))
                for kind, items in (
                    ("parameter", self.model.named_parameters()),
                    ("buffer", self.model.named_buffers()),
                ):
                    for name, t in items:
                        state.append((name, _optimizer_step.local_shard(t)))  # names the shards
                        if consequence and kind == "parameter" and t.requires_grad:
                            self._hook_gradient(t, f"the gradient of parameter '{name}'")
            _watch_patches.install()
            self._patched = True
            _optimizer_step.model_entered(self.model)
            _optimizer_step.block_began()
            _watch_patches._sdpa.model_entered(self.model, mode)
            # Compiled regions run eagerly inside the block: every op reaches the hook. (No
            # torch._dynamo imported: nothing was compiled, and importing it costs seconds.)
            if "torch._dynamo" in sys.modules:
                self._stance = torch.compiler.set_stance("force_eager")
                self._stance.__enter__()
            _native._watch_begin(
                {
                    "mode": _MODE_CODES[mode],
                    "report": self.report,
                    "has_model": self.model is not None,
                    "verify_inputs": self.verify_inputs,
                    "capacity": self.capacity,
                    "module_names": names,
                    "module_allowed": [self._allowed_name(n) for n in names],
                    "allowed_ops": self.allow_ops,
                    "state": state,
                    "finite_state": finite_state,
                }
            )
            for name, t, slices in self._deferred_buffers:
                _entry_slices()[name] = slices  # as they were on entry, like the counts
                _native._watch_entry(t, name, self._allowed_name(name), True)
            if self._deferred_buffers:  # eager attention's products are read for them (sdpa.py)
                _watch_patches._sdpa.buffers_deferred([(n, t) for n, t, _ in self._deferred_buffers])
                _watch_patches.install_matmul()
                self._matmul_patched = True
            self._deferred_buffers.clear()
        except BaseException:
            self._remove_hooks()
            _optimizer_step.model_left(self.model)
            _watch_patches._sdpa.model_left(self.model)
            raise
        self._active = True
        return self

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._grad_hooked.clear()
        if self._stance is not None:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)
        if self._matmul_patched:
            self._matmul_patched = False
            _watch_patches.remove_matmul()
        if self._patched:
            self._patched = False
            _watch_patches.remove()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if not self._active:
            return False
        step_finding = None
        try:
            _optimizer_step.block_ending()
        except errors.GuardError as err:  # a sync finding in what an unhooked step wrote
            step_finding = err
        self._active = False
        self._remove_hooks()
        pending = _native._watch_end()
        try:
            finding = _typed(pending) if pending is not None else step_finding
            if not _native._watch_active():  # the outermost block: no entry left to report
                _entry_slices().clear()
        finally:
            _optimizer_step.model_left(self.model)
            _watch_patches._sdpa.model_left(self.model)
        if finding is not None:
            if exc is None:
                raise finding
            if hasattr(exc, "add_note"):  # the exception in flight stays; the finding is noted
                exc.add_note(f"cublas_guard_ext.watch also recorded earlier: {finding}")
        return False

    def stats(self) -> tuple[int, int] | None:
        """(ops seen, outputs scanned) so far in this thread's innermost watch; None outside one."""
        return _native._watch_stats()


def _is_active() -> bool:
    """Whether this thread watches now (tests check nothing is left on)."""
    return bool(_native._watch_active()) or bool(_native._watch_key_included())
