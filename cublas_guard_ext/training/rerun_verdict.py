"""The rerun verdict of a suspicious finite step: reproducible, transient, or persistent on a rank.

Started by :meth:`SilentCorruptionChecks.decide` for a spike or a checked step; every rank
runs it together (the decision was taken in one collective), so the reruns keep DDP's or
FSDP2's own collectives and pair up. The runs:

* **O**, the step itself: its loss and each parameter's gradient signature (as the optimizer
  would apply them; under DDP already averaged) and, on a checked step only, every module's
  signatures (:mod:`.run_signatures`);
* **A**, a rerun from the same RNG states and buffers, recorded module by module;
* **B**, a second recorded rerun, only when O and A differ: it tells a machine that computes
  bit for bit the same from kernels that do not (then a tolerance is calibrated from A and B:
  ``calibration_factor`` times their largest relative difference, never a guessed epsilon);
* **C**, a capture run, only to write the capsule of the GEMM named (its operands).

Verdicts: O == A (bitwise, or within the tolerance): ``reproducible`` -- the data or the model
(with several ranks, the first outlying GEMM is then replayed on every rank from the outlier
rank's operands: ``persistent`` on that rank when its replay disagrees with the others').
O != A: ``transient``, and where: the first module and phase whose signature differs between O
and A (a checked step), or, for a spike (O kept no module signatures), the rank whose loss
differed (forward) or the first parameter gradient, in backward order, that differed.
A step whose verdict is not clean is never applied.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import signatures
from .run_signatures import Capture, Record, Recorder, capsule_phase, compare, gemm_of, is_gemm_module

__all__ = ["run"]


class _Result:
    """One run's loss and parameter gradients (host values) and its module record."""

    def __init__(self, guard: Any, loss: Any, record: Record | None) -> None:
        self.record = record
        self.loss = None
        if isinstance(loss, torch.Tensor) and loss.dim() == 1 and loss.numel() > 1:
            loss = loss.detach().mean()  # per-sample losses (guard.step(sample_ids=)): their mean
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.loss = float(loss.detach().double().item())
        elif isinstance(loss, (int, float)):
            self.loss = float(loss)
        names = {id(p): n for n, p in guard.inner.named_parameters()}
        self.names: list[str] = []
        ints, floats = [], []
        for p in guard.parameters():
            if p.grad is None:
                continue
            i, f = signatures.stats(p.grad)
            ints.append(i)
            floats.append(f)
            self.names.append(names.get(id(p), f"<parameter {tuple(p.shape)}>"))
        self.ints = torch.stack([t.cpu() for t in ints]).tolist() if ints else []
        self.floats = torch.stack([t.cpu() for t in floats]).tolist() if floats else []


def _rel(x: float | None, y: float | None) -> float:
    if x is None or y is None or x == y:
        return 0.0
    scale = max(abs(x), abs(y))
    return abs(x - y) / scale if scale else 0.0


def _diff(a: _Result, b: _Result, tolerance: float | None) -> dict[str, Any]:
    """Where runs ``a`` and ``b`` of this rank differ (bitwise, or beyond ``tolerance``)."""
    worst = _rel(a.loss, b.loss)
    loss_same = (a.loss == b.loss) if tolerance is None else worst <= tolerance
    differing: list[str] = []
    if a.names != b.names:
        differing = ["(a different set of parameters has gradients)"]
        worst = float("inf")
    else:
        for k in reversed(range(len(a.names))):  # backward order: the last layers' first
            rel = max(_rel(x, y) for x, y in zip(a.floats[k], b.floats[k], strict=True))
            worst = max(worst, rel)
            same = (
                a.ints[k] == b.ints[k]
                if tolerance is None
                else (a.ints[k][1] == b.ints[k][1] and rel <= tolerance)
            )
            if not same:
                differing.append(a.names[k])
    parameter = differing[0] if differing else None
    event = None
    if a.record is not None and b.record is not None:
        index, rel = compare(a.record, b.record, tolerance)
        worst = max(worst, rel)
        if index is not None:
            keys = a.record.keys if index < len(a.record.keys) else b.record.keys
            event = list(keys[index]) if index < len(keys) else ["", "forward", "the run's structure", 0]
    return {
        "same": loss_same and parameter is None and event is None,
        "loss_same": loss_same,
        "parameter": parameter,
        "differing": differing,
        "event": event,
        "worst": worst,
        "losses": [a.loss, b.loss],
    }


def _rerun(
    guard: Any, closure: Callable[[], Any], rng: Any, record: bool = True, capture: Capture | None = None
) -> _Result:
    guard.restore(rng)
    rec = Record() if record else None
    with torch.enable_grad():
        if capture is not None:
            with capture.installed():
                loss = closure()
        elif rec is not None:
            with Recorder(guard.inner, rec):
                loss = closure()
        else:
            loss = closure()
    return _Result(guard, loss, rec)


def run(checks: Any, closure: Callable[[], Any], rng: Any, loss: Any, spike: bool) -> Any:
    """Rerun the step, decide its verdict on every rank alike, apply it only if clean."""
    guard = checks.guard
    step = guard.steps
    trigger = checks.spikes.describe() if spike and checks.spikes is not None else None
    original, checks.original = checks.original, None
    me = checks.identity()
    o = _Result(guard, loss, original)
    a = _rerun(guard, closure, rng)
    tolerance = None if checks.tolerance == "calibrate" else float(checks.tolerance)
    comparison = "bitwise" if tolerance is None else f"within your relative tolerance {tolerance:g}"
    oa = guard.collective.gather({**_diff(o, a, tolerance), "who": me, "trigger": trigger})
    verdict = "reproducible" if all(r["same"] for r in oa) else None
    if verdict is None and tolerance is None:
        b = _rerun(guard, closure, rng)
        ab = guard.collective.gather(_diff(a, b, None))
        if all(r["same"] for r in ab):
            comparison = "bitwise (two reruns agree bit for bit, the step does not)"
            verdict = "transient"
        elif not all(math.isfinite(r["worst"]) for r in ab):
            # the reruns took different paths (their records differ in structure): nothing to
            # calibrate with; the first place where they part is the verdict's
            comparison = "the two reruns themselves took different paths: no tolerance can be calibrated"
            verdict = "transient"
            oa = guard.collective.gather({**_diff(a, b, None), "who": me, "trigger": trigger})
        else:
            noise = max(r["worst"] for r in ab)
            tolerance = checks.calibration_factor * noise
            comparison = (
                f"within a calibrated relative tolerance of {tolerance:.3g} ({checks.calibration_factor:g} "
                f"x {noise:.3g}, the largest relative difference between two reruns: these kernels "
                "are not bitwise reproducible)"
            )
            oa = guard.collective.gather({**_diff(o, a, tolerance), "who": me, "trigger": trigger})
            verdict = "reproducible" if all(r["same"] for r in oa) else "transient"
            a = b  # the last run: its gradients are the ones in place
    elif verdict is None:
        verdict = "transient"
    triggers = [
        (f"rank {r['who']['rank']}: " if r["who"]["rank"] is not None else "") + r["trigger"]
        for r in oa
        if r.get("trigger")
    ]
    trigger_text = (
        "; ".join(triggers)
        if triggers
        else (f"a checked step (every {checks.check_every} steps)" if checks.check_every else None)
    )
    if verdict == "reproducible":
        persistent = _cross_rank(checks, closure, rng, a, step, trigger_text, comparison)
        if persistent is not None:
            guard.restore(rng, optimizer=True)
            return checks.skip_or_raise(persistent)
        if not spike:
            return _apply(checks, loss)
        spiked = next((r["who"] for r in oa if r.get("trigger")), oa[0]["who"])  # the same on every rank
        entry = {
            "verdict": "reproducible",
            "step": step,
            "trigger": trigger_text,
            "comparison": comparison,
            "loss": o.loss,
            "note": _largest(a),
            **{k: spiked[k] for k in ("rank", "host", "device", "gpu_uuid")},
        }
        from ..errors.samples import spike_text
        from . import samples as _samples

        entry["samples"] = _samples.spike_culprits(
            checks, guard.collective.gather(_samples.spike_samples(checks))
        )
        checks.verdicts.append(entry)
        checks._track(entry)
        if checks.on_spike == "skip":
            guard.restore(rng, optimizer=True)
            guard.history.mark(step, skipped=True)
            _samples.list_spike(guard, entry["samples"], step)
            warnings.warn(
                f"training step {step}: a reproducible spike ({trigger_text}); skipped (on_spike='skip')\n  "
                + spike_text(entry["samples"], str(guard.skip_list.path) if guard.skip_list else None),
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return _apply(checks, loss)
    err = _transient(checks, closure, rng, oa, step, trigger_text, comparison)
    guard.restore(rng, optimizer=True)
    return checks.skip_or_raise(err)


def _apply(checks: Any, loss: Any) -> Any:
    if checks.spikes is not None:
        checks.spikes.keep()
    return checks.guard.apply(loss)


def _largest(result: _Result) -> str | None:
    """For a reproducible spike: where the values are largest (the rerun's record)."""
    if result.record is None:
        return None
    ints, floats = result.record.read()
    best = None
    for key, f in zip(result.record.keys, floats, strict=True):
        if key[1] == "forward" and key[0] and (best is None or f[0] > best[1]):
            best = (key[0], f[0])
    return f"largest forward output: module '{best[0]}' (absmax {best[1]:.6g})" if best else None


def _named(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank a transient verdict names: the first whose module record or loss differed,
    else the first whose gradients did."""
    for test in (lambda r: r["event"] is not None, lambda r: not r["loss_same"], lambda r: not r["same"]):
        for r in reports:
            if test(r):
                return r
    return reports[0]


def _transient(
    checks: Any,
    closure: Callable[[], Any],
    rng: Any,
    oa: list[dict[str, Any]],
    step: int,
    trigger: str | None,
    comparison: str,
) -> Any:
    guard = checks.guard
    r = _named(oa)
    who = r["who"]
    modules = dict(guard.inner.named_modules())
    fields: dict[str, Any] = {
        "verdict": "transient",
        "step": step,
        "rank": who["rank"],
        "ranks": [x["who"]["rank"] for x in oa if not x["same"]],
        "world_size": len(oa) if len(oa) > 1 else None,
        "host": who["host"],
        "device": who["device"],
        "gpu_uuid": who["gpu_uuid"],
        "trigger": trigger,
        "comparison": comparison,
        "loss": r["losses"][0],
        "rerun_loss": r["losses"][1],
    }
    capsule = None
    if r["event"] is not None:
        module, phase, what, call = r["event"]
        fields.update(module=module, phase=phase, what=what if what != "output" else "output")
        gemm = gemm_of(modules.get(module), what)
        fields["gemm"] = gemm
        if gemm is not None:
            capsule = _capsule_of(checks, closure, rng, r["who"]["rank"], module, what, call, fields)
    elif not r["loss_same"]:
        fields.update(
            phase="forward",
            what="the loss",
            note="the step's forward kept no per-module signatures (it was not a checked step): "
            "the loss says the forward differed, not where; SilentCorruptionChecks(check_every=N) "
            "records checked steps module by module",
        )
    elif r["parameter"] is not None:
        module, _, leaf = r["parameter"].rpartition(".")
        fields.update(module=module, phase="backward", what=f"gradient of {leaf}", parameter=r["parameter"])
        siblings = (
            [f"{module}.{n}" for n, _ in modules[module].named_parameters(recurse=False)]
            if module in modules
            else []
        )
        alone = [n for n in siblings if n in r["differing"]] == [r["parameter"]]
        gemm = gemm_of(modules.get(module), fields["what"]) if alone else None
        if gemm is not None:
            # the module's other gradients (its bias: the sum of the same grad_output) agree,
            # so what reached the module agrees: the difference is born in this GEMM
            fields.update(
                gemm=gemm,
                note="only this gradient of the module differs (its other gradients, made from the "
                "same grad_output, agree): the difference was born in this GEMM",
            )
            capsule = _capsule_of(checks, closure, rng, who["rank"], module, fields["what"], 0, fields)
        else:
            fields["note"] = (
                "the first parameter gradient, in backward order, that differs; the step kept no "
                "per-module signatures, so the fault is in the backward at or after this module"
            )
        if len(oa) > 1:
            fields["note"] += "; the gradients were averaged over the ranks first, so the rank cannot be told"
    fields = {k: v for k, v in fields.items() if v is not None}
    return checks.report(fields, capsule)


def _capsule_of(
    checks: Any,
    closure: Callable[[], Any],
    rng: Any,
    rank: int | None,
    module: str,
    what: str,
    call: int,
    fields: dict[str, Any],
) -> tuple[str | None, str | None] | None:
    """Capture run C (every rank: the collectives must pair up); the named rank writes the
    capsule of the GEMM's operands as the rerun computed them."""
    phase = capsule_phase(what)
    if phase is None:
        return None
    guard = checks.guard
    capture = Capture(guard.inner, module, what, call)
    try:
        _rerun(guard, closure, rng, record=False, capture=capture)
    except Exception as err:  # the capsule is extra: never lose the verdict for it
        return None, f"the capture run failed: {type(err).__name__}: {err}"
    if rank is not None and checks.identity()["rank"] != rank:
        return None
    return _write_capsule(fields, capture.operands, phase)


def _write_capsule(
    fields: dict[str, Any], operands: dict[str, torch.Tensor], phase: str
) -> tuple[str | None, str | None]:
    from .. import capsule as _capsule
    from ..errors.corruption import SilentCorruptionError

    if not operands:
        return None, "the GEMM's operands were not seen in the capture run"
    err = SilentCorruptionError(**{k: v for k, v in fields.items() if k != "exit_code"})
    err.fields["layer"] = fields.get("module")
    return _capsule.capture(err, {"operands": operands, "phase": phase})


def _suspect(checks: Any, reports: list[list[list[Any]]]) -> tuple[int, str, int] | None:
    """The first GEMM output (in rank order of events) that is an outlier on one rank: its
    absmax ``outlier_factor`` times the median of the other ranks', or non-finite there only."""
    world = len(reports)
    keys = [tuple(e[:2]) for e in reports[0]]
    if any([tuple(e[:2]) for e in r] != keys for r in reports):
        return None
    for k, (module, call) in enumerate(keys):
        values = [r[k][2] for r in reports]
        bad = [r[k][3] for r in reports]
        for rank in range(world):
            others = [v for i, v in enumerate(values) if i != rank]
            median = statistics.median(others)
            if (bad[rank] and not any(b for i, b in enumerate(bad) if i != rank)) or (
                median > 0 and values[rank] > checks.outlier_factor * median
            ):
                return rank, module, call
    return None


def _cross_rank(
    checks: Any,
    closure: Callable[[], Any],
    rng: Any,
    a: _Result,
    step: int,
    trigger: str | None,
    comparison: str,
) -> Any:
    """Persistent on rank r: r's replay of its outlying GEMM's operands disagrees with the
    others' replay of the same operands. None when not applicable or the replays agree."""
    import torch.distributed as dist

    guard = checks.guard
    if not checks.cross_rank or guard.group is None or a.record is None:
        return None
    if any(hasattr(p, "to_local") for p in guard.inner.parameters()):
        return None  # FSDP2: a module's weights are sharded; its GEMM cannot be replayed locally
    modules = dict(guard.inner.named_modules())
    ints, floats = a.record.read()
    mine = [
        [key[0], key[3], floats[k][0], ints[k][1]]
        for k, key in enumerate(a.record.keys)
        if key[1] == "forward"
        and key[2] == "output"
        and is_gemm_module(modules.get(key[0], torch.nn.Module()))
    ]
    suspect = _suspect(checks, guard.collective.gather(mine))
    if suspect is None:
        return None
    group_rank, module, call = suspect
    src = dist.get_global_rank(guard.group, group_rank) if guard.group is not dist.group.WORLD else group_rank
    capture = Capture(guard.inner, module, "output", call)
    _rerun(guard, closure, rng, record=False, capture=capture)  # run C: the grads equal A's again
    box = [{"operands": capture.operands, "params": capture.call_params} if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=guard.group)
    payload = box[0]
    target = modules[module]
    device = next(target.parameters()).device
    params = {k: v.to(device) for k, v in payload["params"].items()}
    with torch.no_grad():
        out = torch.func.functional_call(target, params, (payload["operands"]["input"].to(device),))
    me = checks.identity()
    replays = guard.collective.gather({**me, "signature": int(signatures.fold(out).item())})
    theirs = [r["signature"] for r in replays if r["rank"] != src]
    if not theirs:
        return None
    majority = statistics.mode(theirs)
    if replays[group_rank]["signature"] == majority or theirs.count(majority) * 2 <= len(theirs):
        return None
    who = replays[group_rank]
    fields = {
        "verdict": "persistent",
        "step": step,
        "rank": src,
        "ranks": [src],
        "world_size": len(replays),
        "host": who["host"],
        "device": who["device"],
        "gpu_uuid": who["gpu_uuid"],
        "module": module,
        "phase": "forward",
        "what": "output",
        "gemm": gemm_of(target, "output"),
        "trigger": trigger,
        "comparison": comparison + "; the step reproduces on every rank, the GEMM's replay does not",
        "loss": a.loss,
        "replays": [{k: r[k] for k in ("rank", "host", "device", "signature")} for r in replays],
        "note": f"rank {src}'s output of this GEMM was an outlier (absmax over {checks.outlier_factor:g}x "
        "the other ranks' median); every rank replayed rank "
        f"{src}'s operands through the module's own forward",
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    capsule = _write_capsule(fields, capture.operands, "forward") if me["rank"] == src else None
    return checks.report(fields, capsule)
