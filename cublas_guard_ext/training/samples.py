"""Which samples are behind a bad step: ``guard.step(closure, sample_ids=ids)``.

How the guard learns the batch: a forward pre-hook on the guarded model (the outermost
wrapper: DDP, a compiled module) while the closure runs, registered only for a step given
``sample_ids``, keeps references to the tensors the model is called with (no copy, no device
work). Their leading dimension is the batch's: one call with as many rows as ids, several
calls whose rows add up to them (micro-batches, in order), or several calls of the whole
batch. ``batch=`` names the batch explicitly instead (a model called on something else).

On a bad step the replay (:mod:`.replay`) runs with :class:`RowRecorder`: every module's
forward output and the gradient at its inputs, per row, NaN/Inf or not (bad steps only).
:func:`culprits` then names, in this order: the input rows that hold NaN/Inf; the rows of
the module (and phase) watch named; the row of the first bad element of watch's op; the
rows of the first module output (or input gradient) that went non-finite. Rows map to ids;
when they cannot (no leading batch dimension, a batch dimension elsewhere) it says so.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..errors.samples import SampleIdsError

__all__ = ["check_ids", "StepBatch", "BatchCapture", "RowRecorder", "culprits"]


def check_ids(sample_ids: Any, step: int) -> tuple[int, ...]:
    """The ids as a tuple of Python ints (host only), or SampleIdsError."""
    if isinstance(sample_ids, torch.Tensor):
        if sample_ids.device.type != "cpu":
            raise SampleIdsError(problem="device", device=str(sample_ids.device), step=step)
        if sample_ids.dim() != 1:
            raise SampleIdsError(problem="shape", shape=tuple(sample_ids.shape), step=step)
        if (
            sample_ids.dtype.is_floating_point
            or sample_ids.dtype.is_complex
            or sample_ids.dtype == torch.bool
        ):
            raise SampleIdsError(problem="type", got=f"a {sample_ids.dtype} tensor", step=step)
        values: list[Any] = sample_ids.tolist()
    elif isinstance(sample_ids, (str, bytes)) or not isinstance(sample_ids, Sequence):
        shape = getattr(sample_ids, "shape", None)
        if shape is not None and hasattr(sample_ids, "tolist"):  # a NumPy array
            if len(shape) != 1:
                raise SampleIdsError(problem="shape", shape=tuple(shape), step=step)
            values = sample_ids.tolist()
        else:
            raise SampleIdsError(problem="type", got=type(sample_ids).__name__, step=step)
    else:
        values = list(sample_ids)
    if not values:
        raise SampleIdsError(problem="empty", step=step)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            if hasattr(v, "__index__") and not isinstance(v, bool) and not isinstance(v, torch.Tensor):
                v = v.__index__()  # NumPy integers
            else:
                raise SampleIdsError(problem="not_integer", index=i, value=v, got=type(v).__name__, step=step)
        out.append(int(v))
    if len(set(out)) != len(out):
        seen: dict[int, int] = {}
        for row, v in enumerate(out):
            if v in seen:
                rows = [r for r, w in enumerate(out) if w == v]
                raise SampleIdsError(problem="duplicate", value=v, rows=rows, step=step)
            seen[v] = row
    return tuple(out)


def _named_tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a call, one level into tuples, lists and dicts, with where they were."""
    out: list[tuple[str, torch.Tensor]] = []

    def add(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (tuple, list)):
            out.extend((f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
        elif isinstance(value, dict):
            out.extend((f"{name}[{k!r}]", v) for k, v in value.items() if isinstance(v, torch.Tensor))

    for i, a in enumerate(args):
        add(f"#{i}", a)
    for k, v in kwargs.items():
        add(repr(k), v)
    return out


class BatchCapture:
    """The tensors the guarded model is called with while the closure runs (or ``given``)."""

    def __init__(self, model: torch.nn.Module, given: Any = None) -> None:
        self.model = model
        self.given = given
        self.calls: list[list[tuple[str, torch.Tensor]]] = []
        self._handle: Any = None
        if given is not None:
            self.calls.append(
                _named_tensors((given,), {}) if not isinstance(given, dict) else _named_tensors((), given)
            )

    def __enter__(self) -> BatchCapture:
        if self.given is None:
            self.calls = []
            self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls.append(_named_tensors(args, kwargs))

    def rows(self, call: int) -> int | None:
        tensors = self.calls[call] if 0 <= call < len(self.calls) else []
        if not tensors or tensors[0][1].dim() == 0:
            return None
        return int(tensors[0][1].shape[0])

    def argument(self, name: str) -> str:
        """'#0' -> "argument 'x'" (the forward's parameter name when known)."""
        if not name.startswith("#"):
            return f"argument {name}"
        index, _, rest = name[1:].partition("[")
        try:
            target = self.model.forward
            params = [p for p in inspect.signature(target).parameters.values() if p.kind != p.VAR_KEYWORD]
            label = repr(params[int(index)].name)
        except (ValueError, TypeError, IndexError):
            label = f"#{index}"
        if self.given is not None:
            return "batch=" + (f"[{rest}" if rest else "")
        return f"argument {label}" + (f"[{rest}" if rest else "")

    def layout(self, n: int, step: int) -> tuple[list[int] | None, str | None]:
        """(the first row of each call within the ids, None) or (None, why rows cannot be
        mapped); SampleIdsError when the ids cannot belong to this batch."""
        if not self.calls:
            return None, "the guarded model was not called in the closure: no batch was seen at its entry"
        rows = [self.rows(c) for c in range(len(self.calls))]
        for c, r in enumerate(rows):
            if r is None:
                what = self.calls[c][0] if self.calls[c] else None
                if what is None:
                    return None, "rows cannot be mapped: the model was called without a tensor"
                return None, (
                    f"rows cannot be mapped: the model's {self.argument(what[0])} has no leading batch "
                    f"dimension (shape {tuple(what[1].shape)})"
                )
        if sum(rows) == n:  # type: ignore[arg-type]
            offsets, total = [], 0
            for r in rows:
                offsets.append(total)
                total += r  # type: ignore[operator]
            return offsets, None
        if all(r == n for r in rows):
            return [0] * len(rows), None
        name, lead = self.calls[0][0]
        if len(rows) == 1 and n in tuple(lead.shape[1:]):
            dim = 1 + tuple(lead.shape[1:]).index(n)
            return None, (
                f"rows cannot be mapped: the model's {self.argument(name)} has shape {tuple(lead.shape)}: "
                f"its dimension {dim}, not the leading one, has one entry per id (pass batch= a tensor "
                "whose leading dimension is the batch)"
            )
        raise SampleIdsError(
            problem="length",
            count=n,
            batch_rows=rows,
            argument=self.argument(name),
            argument_shape=tuple(lead.shape),
            step=step,
        )


class StepBatch:
    """What a step given ``sample_ids`` knows of its batch: the ids, the explicit batch if
    any, and the capture of the model's calls (kept for a deferred replay)."""

    def __init__(self, ids: tuple[int, ...], given: Any, capture: BatchCapture) -> None:
        self.ids = ids
        self.given = given
        self.capture = capture
        self.per_sample: torch.Tensor | None = None  # the closure's per-sample losses, if it gave them

    def reduce(self, loss: Any) -> Any:
        """A closure may return one loss per row (``reduction="none"``, after its own backward
        of their mean): kept for a spike's verdict; the step judges and returns their mean."""
        if isinstance(loss, torch.Tensor) and loss.dim() == 1 and loss.numel() == len(self.ids) > 1:
            self.per_sample = loss.detach()
            return loss.mean()
        return loss

    @classmethod
    def of(cls, guard: Any, sample_ids: Any, batch: Any) -> StepBatch | None:
        """The step's batch (None without ids); ids that cannot name an explicit ``batch=``'s
        rows are refused here, before anything runs."""
        step = guard.steps + 1
        if sample_ids is None:
            if batch is not None:
                raise SampleIdsError(problem="no_ids", step=step)
            return None
        ids = check_ids(sample_ids, step)
        capture = BatchCapture(guard.model, batch)
        if batch is not None:
            capture.layout(len(ids), step)
        return cls(ids, batch, capture)

    def check(self, guard: Any, rng: Any) -> None:
        """After the closure (host only: shapes): the ids fit the batch the model saw, or the
        step is undone (RNG states, buffers, gradients, the count) and SampleIdsError raised."""
        if self.given is not None:
            return
        try:
            self.capture.layout(len(self.ids), guard.steps)
        except SampleIdsError:
            guard.restore(rng, optimizer=True)
            guard.steps -= 1
            raise


def _row_mask(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (~torch.isfinite(t)).reshape(t.shape[0], -1).any(1)


def _first_tensor(value: Any, rows: int) -> torch.Tensor | None:
    items = (
        value
        if isinstance(value, (tuple, list))
        else list(value.values())
        if isinstance(value, dict)
        else [value]
    )
    for v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1 and v.shape[0] == rows:
            return v
    return None


class RowRecorder:
    """During a replay: for every module, which rows of its output (forward) and of the
    gradient at its inputs (backward) hold NaN/Inf, per call of the guarded model."""

    def __init__(self, inner: torch.nn.Module, capture: BatchCapture) -> None:
        self.inner = inner
        self.capture = capture
        self.records: list[tuple[str, int, str, torch.Tensor]] = []
        self._handles: list[Any] = []
        self._active = False

    def __enter__(self) -> RowRecorder:
        self._active = True
        for name, m in self.inner.named_modules():
            self._handles.append(m.register_forward_hook(functools.partial(self._forward, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles = []

    def _call(self) -> tuple[int, int | None]:
        call = max(len(self.capture.calls) - 1, 0) if self.capture.given is None else 0
        return call, self.capture.rows(call)

    def _forward(self, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        call, rows = self._call()
        if rows is None:
            return
        out = _first_tensor(output, rows)
        if out is not None:
            self.records.append((name, call, "forward", _row_mask(out)))
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point() and a.dim() >= 1:
                if a.shape[0] == rows:
                    a.register_hook(functools.partial(self._grad, name, call))

    def _grad(self, name: str, call: int, grad: torch.Tensor) -> None:
        if self._active and grad is not None:
            self.records.append((name, call, "backward", _row_mask(grad)))


def culprits(
    ids: tuple[int, ...],
    capture: BatchCapture,
    recorder: RowRecorder,
    module: str | None,
    phase: str | None,
    coords: tuple[Any, Any] | None,
) -> dict[str, Any]:
    """The samples behind a bad step's replay, as plain values (they cross ranks)."""
    n = len(ids)
    out: dict[str, Any] = {"ids": [], "rows": [], "where": None, "note": None, "mapped": False, "batch": n}
    try:
        offsets, note = capture.layout(n, 0)
    except SampleIdsError as err:
        offsets, note = None, str(err).splitlines()[0]
    if offsets is None:
        out["note"] = note
        return out
    out["mapped"] = True
    found: list[int] = []
    where = None
    names: list[str] = []
    for c, tensors in enumerate(capture.calls):
        rows = capture.rows(c)
        for name, t in tensors:
            if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == rows:
                bad = _row_mask(t).nonzero().flatten().tolist()
                if bad:
                    found += [offsets[c] + r for r in bad]
                    names.append(capture.argument(name))
    if found:
        where = f"the model's {', '.join(dict.fromkeys(names))} holds NaN/Inf in these rows on entry"
    if not found and module is not None and phase in ("forward", "backward"):
        for name, c, ph, mask in recorder.records:
            if name == module and ph == phase:
                bad = mask.nonzero().flatten().tolist()
                if bad:
                    found = [offsets[c] + r for r in bad]
                    part = "output" if phase == "forward" else "gradient at its input"
                    where = f"the rows of the {part} of module '{module}' ({phase}) that hold watch's NaN/Inf"
                    break
    if not found and coords is not None and coords[0] and coords[1] and len(capture.calls) == 1:
        first, shape = coords
        if shape and shape[0] == capture.rows(0):
            found = [offsets[0] + int(first[0])]
            where = f"the row of the first bad element of the op watch named, output shape {tuple(shape)}"
    if not found:
        for name, c, ph, mask in recorder.records:
            bad = mask.nonzero().flatten().tolist()
            if bad:
                found = [offsets[c] + r for r in bad]
                part = "output" if ph == "forward" else "gradient at its input"
                label = f"module '{name}'" if name else "the model"
                where = f"the rows of the {part} of {label} ({ph}), the first to hold NaN/Inf in the replay"
                break
    rows_found = sorted(set(found))
    if not rows_found:
        out["mapped"] = False
        out["note"] = (
            "no row of the batch held the NaN/Inf where the replay could see it (the replay was "
            "finite, or the values appeared outside the model's modules)"
        )
        return out
    if len(rows_found) == n and n > 1:
        out["note"] = (
            "every row holds them, so the culprit cannot be told apart from the batch (an op that "
            "mixes rows, such as BatchNorm, or a fault that is not the data's)"
        )
    out.update(ids=[ids[r] for r in rows_found], rows=rows_found, where=where)
    return out


# -- spikes ---------------------------------------------------------------------------------


def spike_samples(checks: Any) -> dict[str, Any]:
    """This rank's samples behind a reproducible spike: the rows whose per-sample loss is an
    outlier within the batch (robust z-score, the spike detector's threshold and floor), as
    plain values (they are gathered over the ranks)."""
    guard = checks.guard
    rank = guard.collective.rank
    batch = guard.batch
    if batch is None:
        return {"rank": rank, "ids": [], "why": "no sample_ids were given, so it names the batch"}
    if batch.per_sample is None:
        return {
            "rank": rank,
            "ids": [],
            "why": "the closure returned one loss for the batch, so it names the batch; return the "
            "per-sample losses (reduction='none') to have the samples named",
        }
    values = batch.per_sample.double().cpu().tolist()
    finite = sorted(v for v in values if v == v and abs(v) != float("inf"))
    median = finite[len(finite) // 2] if finite else 0.0
    deviations = sorted(abs(v - median) for v in finite)
    mad = deviations[len(deviations) // 2] if deviations else 0.0
    spikes = checks.spikes
    threshold = spikes.threshold if spikes is not None else 10.0
    floor = spikes.floor if spikes is not None else 0.05
    scale = max(1.4826 * mad, floor * abs(median), 1e-30)
    rows = [r for r, v in enumerate(values) if not v == v or (v - median) / scale > threshold]
    if not rows:
        return {
            "rank": rank,
            "ids": [],
            "why": f"no sample's loss stands out in the batch (largest {max(values):.6g}, median "
            f"{median:.6g}), so it names the batch",
        }
    return {
        "rank": rank,
        "ids": [batch.ids[r] for r in rows],
        "rows": rows,
        "losses": [values[r] for r in rows],
        "median": median,
        "why": f"a robust z-score within the batch above {threshold:g}",
    }


def spike_culprits(checks: Any, gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's spike samples joined (the same on every rank)."""
    named = [g for g in gathered if g["ids"]]
    if not named:
        return {"ids": [], "why": gathered[0]["why"], "by_rank": {}}
    out = dict(named[0])
    out["ids"] = [i for g in named for i in g["ids"]]
    out["losses"] = [v for g in named for v in g["losses"]]
    out["by_rank"] = {g["rank"]: g["ids"] for g in named}
    return out


def list_spike(guard: Any, found: dict[str, Any], step: int) -> int:
    """on_spike="skip": each rank appends its own spike samples to the skip list and learns the
    others'; returns how many lines this rank wrote."""
    skip = guard.skip_list
    if skip is None or not found.get("ids"):
        return 0
    me = guard.collective.rank
    written = 0
    for rank, ids in found["by_rank"].items():
        if rank == me:
            where = f"per-sample loss: {found['why']}"
            written += skip.append(
                ids, step=step, verdict="reproducible", where=where, rank=me, reason="spike"
            )
        else:
            skip.add(ids)
    return written
