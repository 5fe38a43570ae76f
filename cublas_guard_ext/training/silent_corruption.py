"""``TrainingGuard(silent_corruption=SilentCorruptionChecks(...))``: finite numbers that
cannot be trusted, caught for almost nothing on a healthy step.

>>> checks = cublas_guard_ext.SilentCorruptionChecks(replica_every=100, tracker="sdc.jsonl")
>>> guard = cublas_guard_ext.TrainingGuard(ddp_model, optimizer, silent_corruption=checks)

What a step does with it (docs/silent-corruption.md has the whole of it):

1. The guard's fused finite check gives its flag, as always; the spike detector
   (:mod:`.spikes`) judges the loss and gradient norm on the device; every ``replica_every``
   steps each parameter is folded into an order-sensitive signature (:mod:`.signatures`).
   One collective (:mod:`.replicas`: an ``all_gather`` of ``[flag, signatures...]``, or the
   flag's all-reduce on other steps) and **one host read** decide for every rank alike.
2. Replicas that differ: :class:`SilentCorruptionError` on every rank, naming the rank, its
   host, device and GPU UUID, the first differing parameter and the step.
3. A non-finite step: TrainingGuard's own replay under watch, unchanged.
4. A spike, or every ``check_every`` steps a checked step (its first run recorded module by
   module): the rerun verdict (:mod:`.rerun_verdict`). ``reproducible``: the step is taken
   (``on_spike="skip"`` drops it); ``transient`` / ``persistent``: never applied,
   ``on_verdict`` raises or skips.

Every verdict but a clean one goes to ``checks.verdicts`` and, with ``tracker=``, as one JSON
line to the tracker file (written by the rank the verdict names, else the lowest rank).
``exit_codes=True``: an uncaught :class:`SilentCorruptionError` ends the process with its
verdict's code (Megatron's 16 "rerun elsewhere" for a hardware verdict, 17 "validation
failed" otherwise), so a launcher can cordon the node.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors.corruption import DEFAULT_EXIT_CODES, SilentCorruptionError
from . import replicas as _replicas
from .run_signatures import Record, Recorder
from .spikes import SpikeDetector
from .state import _grad_norm

__all__ = ["SilentCorruptionChecks", "SilentCorruptionError"]

HEALTHY, SPIKE, NONFINITE, REPLICAS = 0, 1, 2, 3
_ON_VERDICT = ("raise", "skip")
_ON_SPIKE = ("apply", "skip")


def _positive_or_none(name: str, value: Any, kind: type = int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
        raise ValueError(
            f"SilentCorruptionChecks: {name} must be a positive {kind.__name__} or None, got {value!r}"
        )


class SilentCorruptionChecks:
    """What TrainingGuard checks for finite corruption, and what it does about a verdict.

    * ``replica_every`` (100): every that many steps, compare the replicas' parameters
      (DDP; HSDP's replicate dimension). None: never. Without replicas (one process, plain
      FSDP2) the check is off and ``replica_note`` says why, unless ``replica_group`` was given.
    * ``replica_group``: ``"auto"`` (DDP's group, HSDP's replicate dimension, else the default
      group of a replicated model) or a process group of ranks holding equal copies.
    * ``spike_threshold`` (10): a loss or gradient norm whose robust z-score against the last
      ``spike_window`` (64) steps taken exceeds it starts a rerun (after
      ``spike_min_history`` (16) steps; the scale never below ``spike_floor`` (0.05) times
      the median). None: no spike detection.
    * ``check_every`` (None): every that many steps, a checked step: its first run is recorded
      module by module and rerun, whatever its numbers (torchtitan's replayer, with where).
    * ``on_verdict``: ``"raise"`` :class:`SilentCorruptionError` for ``transient`` /
      ``persistent``, or ``"skip"`` (warn, drop the step, go on). ``on_spike``: a
      ``reproducible`` spike is the data's: ``"apply"`` (default) or ``"skip"`` it.
    * ``tolerance``: ``"calibrate"`` (bitwise when the reruns agree bit for bit; else
      ``calibration_factor`` (10) times the largest relative difference between two reruns)
      or a relative tolerance of your own.
    * ``cross_rank`` (True): for a reproducible spike under several ranks, replay the first
      outlying GEMM's operands on every rank (``persistent on rank r`` when one disagrees);
      a rank's GEMM output is an outlier when its absmax is ``outlier_factor`` (64) times the
      median of the other ranks'.
    * ``tracker``: a JSON-lines file, one line per verdict. ``exit_codes``: True (Megatron's
      16/17) or a dict verdict -> code; an uncaught :class:`SilentCorruptionError` then ends
      the process with that code.
    """

    def __init__(
        self,
        *,
        replica_every: int | None = 100,
        replica_group: Any = "auto",
        spike_threshold: float | None = 10.0,
        spike_window: int = 64,
        spike_min_history: int = 16,
        spike_floor: float = 0.05,
        check_every: int | None = None,
        on_verdict: str = "raise",
        on_spike: str = "apply",
        tolerance: float | str = "calibrate",
        calibration_factor: float = 10.0,
        cross_rank: bool = True,
        outlier_factor: float = 64.0,
        tracker: str | os.PathLike | None = None,
        exit_codes: bool | dict[str, int] = False,
    ) -> None:
        _positive_or_none("replica_every", replica_every)
        _positive_or_none("check_every", check_every)
        _positive_or_none("spike_threshold", spike_threshold, float)
        for name, value in (("spike_window", spike_window), ("spike_min_history", spike_min_history)):
            _positive_or_none(name, value)
        if spike_min_history > spike_window:
            raise ValueError(
                f"SilentCorruptionChecks: spike_min_history ({spike_min_history}) must not exceed "
                f"spike_window ({spike_window})"
            )
        if on_verdict not in _ON_VERDICT:
            raise ValueError(
                f"SilentCorruptionChecks: on_verdict must be 'raise' or 'skip', got {on_verdict!r}"
            )
        if on_spike not in _ON_SPIKE:
            raise ValueError(f"SilentCorruptionChecks: on_spike must be 'apply' or 'skip', got {on_spike!r}")
        if tolerance != "calibrate" and (
            isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0
        ):
            raise ValueError(
                "SilentCorruptionChecks: tolerance must be 'calibrate' (bitwise, or calibrated by a "
                f"second rerun) or a positive relative tolerance, got {tolerance!r}"
            )
        if exit_codes is True:
            exit_codes = dict(DEFAULT_EXIT_CODES)
        elif exit_codes is False or exit_codes is None:
            exit_codes = {}
        elif not isinstance(exit_codes, dict) or not all(
            k in DEFAULT_EXIT_CODES and isinstance(v, int) and 0 < v < 256 for k, v in exit_codes.items()
        ):
            raise ValueError(
                "SilentCorruptionChecks: exit_codes must be True, False or a dict from a verdict "
                f"({', '.join(DEFAULT_EXIT_CODES)}) to an exit code 1-255, got {exit_codes!r}"
            )
        self.replica_every = replica_every
        self.replica_group = replica_group
        self.check_every = check_every
        self.on_verdict = on_verdict
        self.on_spike = on_spike
        self.tolerance = tolerance
        self.calibration_factor = float(calibration_factor)
        self.cross_rank = cross_rank
        self.outlier_factor = float(outlier_factor)
        self.tracker = Path(tracker) if tracker is not None else None
        self.exit_codes: dict[str, int] = exit_codes
        self.spikes = (
            SpikeDetector(spike_threshold, spike_window, spike_min_history, spike_floor)
            if spike_threshold is not None
            else None
        )
        self.verdicts: list[dict[str, Any]] = []  # every verdict that was not clean
        self.replica_note: str | None = None
        self.replicas: _replicas.ReplicaCheck | None = None
        self.original: Record | None = None  # a checked step's first run
        self.guard: Any = None

    # -- set-up ----------------------------------------------------------------------------
    def _attach(self, guard: Any) -> SilentCorruptionChecks:
        """Called by TrainingGuard's constructor: bind to it, find the replicas."""
        if self.guard is not None:
            raise ValueError("SilentCorruptionChecks: this object already belongs to a TrainingGuard")
        if guard.deferred or guard.scaler is not None:
            raise ValueError(
                "TrainingGuard: silent_corruption= needs deferred=False and no scaler= (a verdict "
                "reruns the step before deciding whether to apply it)"
            )
        self.guard = guard
        if self.replica_every is not None:
            if self.replica_group == "auto":
                group, why = _replicas.replica_group_of(guard.model, guard.inner)
            else:
                group, why = self.replica_group, None
                if group is None:
                    why = "replica_group=None"
            if group is None:
                self.replica_note = f"replica checks off: {why}"
            else:
                self.replicas = _replicas.ReplicaCheck(guard.inner, group, self.replica_every)
        if self.exit_codes:
            _install_exit_hook()
        return self

    def _device(self) -> torch.device | None:
        p = next(iter(self.guard.inner.parameters()), None)
        if p is None:
            return None
        return (p.to_local() if hasattr(p, "to_local") else p).device

    def identity(self) -> dict[str, Any]:
        return _replicas.identity(self._device())

    # -- the step ----------------------------------------------------------------------------
    def run_closure(self, closure: Callable[[], Any]) -> Any:
        """The step's first run: recorded module by module on a checked step, else plain."""
        self.original = None
        if self.check_every and self.guard.steps % self.check_every == 0:
            record = Record()
            with Recorder(self.guard.inner, record):
                loss = closure()
            self.original = record
            return loss
        return closure()

    def _grad_norm(self) -> torch.Tensor | None:
        """The step's gradient norm: the one the guard noted, else computed."""
        guard = self.guard
        noted = guard.history.grad_norm(guard.steps)
        if noted is not None:
            return noted
        return _grad_norm([p.grad for p in guard.parameters() if p.grad is not None])

    def exchange(self, flag: torch.Tensor, loss: Any) -> tuple[int, dict[str, Any] | None]:
        """The step's collective(s) and its one host read: (the code all ranks agree on, the
        replicas' disagreement, the same on every rank, or None)."""
        guard = self.guard
        device = flag.device
        code = torch.where(flag != 0, NONFINITE, HEALTHY).to(torch.int64)
        if self.spikes is not None and loss is not None:
            spike = self.spikes.judge(loss, self._grad_norm())
            if spike is not None:
                code = torch.maximum(code, spike.to(device).to(torch.int64))
        code = code.reshape(1)
        check = self.replicas
        if check is None or not check.due(guard.steps):
            code = guard.collective.agree(code)
            return int(code.item()), None
        sigs = check.local().to(device)
        if guard.group is None or _same_ranks(guard.group, check.group):
            # one collective: the flag rides in front of the signatures
            table = check.gather(torch.cat([code, sigs]))
            summary = check.summary(table[:, 1:])
            code = torch.maximum(table[:, 0].max(), REPLICAS * summary[0]).reshape(1)
        else:
            # HSDP: the replica group is a slice of the world; its verdict joins the flag
            # before the flag's all-reduce over every rank, so every rank learns it
            summary = check.summary(check.gather(sigs))
            code = torch.maximum(code, REPLICAS * summary[:1].to(code.device))
            code = guard.collective.agree(code)
        values = torch.cat([code.reshape(1).to(summary.device), summary]).tolist()  # the one read
        found = check.verdict(values[1:])
        if found is not None:
            found["ranks"] = [_global_rank(check.group, r) for r in found.pop("group_ranks")]
        elif values[0] != REPLICAS:
            check.last_agreeing_step = guard.steps
        return int(values[0]), (found or {}) if values[0] == REPLICAS else None

    def decide(self, closure: Callable[[], Any], rng: Any, loss: Any, flag: torch.Tensor) -> Any:
        """TrainingGuard.step's decision with these checks: take, replay, rerun or raise."""
        guard = self.guard
        code, disagreement = self.exchange(flag, loss)
        if disagreement is not None:
            guard.restore(rng, optimizer=True)
            raise self._replicas_error(disagreement)
        if code == NONFINITE:  # (the bad step takes self.original: it places a transient)
            return guard.reject(closure, rng, loss)
        if code == SPIKE or self.original is not None:
            from . import rerun_verdict

            return rerun_verdict.run(self, closure, rng, loss, spike=code == SPIKE)
        if self.spikes is not None:
            self.spikes.keep()
        return guard.apply(loss)

    def read(self, flag: torch.Tensor) -> bool:
        """TrainingGuard's flag read with these checks (a guarded layer's refusal inside the step
        meets the other ranks in the same collectives): whether some rank's step was bad."""
        code, disagreement = self.exchange(flag, None)
        if disagreement is not None:
            raise self._replicas_error(disagreement)
        return code == NONFINITE

    def _replicas_error(self, found: dict[str, Any]) -> SilentCorruptionError:
        """Every rank builds the same error: what each replica group found and who everyone
        is are exchanged over every rank (rare path; HSDP: only some groups found it)."""
        import torch.distributed as dist

        check = self.replicas
        assert check is not None
        group = self.guard.group if self.guard.group is not None else check.group
        shared: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shared, {"who": self.identity(), "found": found or None}, group=group)
        by_rank = {s["who"]["rank"]: s["who"] for s in shared}
        found = next(s["found"] for s in shared if s["found"])
        named = found["ranks"][0] if found["ranks"] else None
        who = by_rank.get(named, {})
        last = check.last_agreeing_step
        note = found.get("note")
        since = f"the last check that agreed was at step {last}" if last is not None else "no earlier check"
        note = f"{note}; {since}" if note else since
        fields = {
            "verdict": "replicas_differ",
            "step": self.guard.steps,
            "rank": named,
            "ranks": found["ranks"],
            "world_size": dist.get_world_size(),
            "host": who.get("host"),
            "device": who.get("device"),
            "gpu_uuid": who.get("gpu_uuid"),
            "parameter": found["parameter"],
            "differing_parameters": found["differing_parameters"],
            "trigger": f"replica check (every {check.every} steps, {check.world} replicas)",
            "note": note,
        }
        return self.report(fields)

    # -- verdicts: the list, the tracker, the exit code -------------------------------------
    def report(
        self, fields: dict[str, Any], capsule: tuple[str | None, str | None] | None = None
    ) -> SilentCorruptionError:
        """Record a verdict (``verdicts``, a tracker line) and build its error; ``capsule``:
        (path, why not) of the GEMM's capsule, shown in the message."""
        code = self.exit_codes.get(fields["verdict"])
        if code is not None:
            fields["exit_code"] = code
        err = SilentCorruptionError(**fields)
        if capsule is not None and (capsule[0] or capsule[1]):
            err.capsule, err.capsule_note = capsule
            err.args = (err._format(),)
        entry = dict(err.fields)
        entry["capsule"] = err.capsule
        self.verdicts.append(entry)
        self._track(entry)
        return err

    def _track(self, fields: dict[str, Any]) -> None:
        if self.tracker is None:
            return
        named = fields.get("rank")
        me = self.identity()
        writer = named if named is not None else min(fields.get("ranks") or [me["rank"] or 0])
        if me["rank"] is not None and writer is not None and me["rank"] != writer:
            return
        line = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "step": fields.get("step"),
            "verdict": fields.get("verdict"),
            "rank": named,
            "host": fields.get("host"),
            "device": fields.get("device"),
            "gpu_uuid": fields.get("gpu_uuid"),
            "where": {
                k: fields.get(k)
                for k in ("parameter", "module", "phase", "what", "gemm")
                if fields.get(k) is not None
            },
            "trigger": fields.get("trigger"),
            "samples": (fields.get("samples") or {}).get("ids"),
            "capsule": fields.get("capsule"),
            "ranks": fields.get("ranks"),
            "exit_code": fields.get("exit_code"),
            "written_by": me,
        }
        try:
            self.tracker.parent.mkdir(parents=True, exist_ok=True)
            with _TRACKER_LOCK, open(self.tracker, "a", encoding="utf-8") as out:
                out.write(json.dumps(line, default=str) + "\n")
        except OSError as err:
            warnings.warn(
                f"SilentCorruptionChecks: could not write the tracker {self.tracker}: {err}",
                RuntimeWarning,
                stacklevel=3,
            )

    def skip_or_raise(self, err: SilentCorruptionError, cause: BaseException | None = None) -> None:
        guard = self.guard
        if self.on_verdict == "raise":
            raise err from cause
        guard.history.mark(err.fields.get("step"), skipped=True)
        warnings.warn(str(err), RuntimeWarning, stacklevel=4)
        return None


_TRACKER_LOCK = threading.Lock()


def _same_ranks(a: Any, b: Any) -> bool:
    import torch.distributed as dist

    if a is b:
        return True
    try:
        return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)
    except Exception:
        return False


def _global_rank(group: Any, group_rank: int) -> int:
    import torch.distributed as dist

    try:
        return dist.get_global_rank(group, group_rank)
    except Exception:  # the default group
        return group_rank


_exit_hook_installed: list[bool] = []


def _install_exit_hook() -> None:
    """An uncaught SilentCorruptionError (itself or in the chain) ends the process with its
    exit code, after the previous hook printed it (and ``run`` wrote its incident report)."""
    if _exit_hook_installed:
        return
    _exit_hook_installed.append(True)
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            code = (
                getattr(current, "fields", {}).get("exit_code")
                if isinstance(current, SilentCorruptionError)
                else None
            )
            if code is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(int(code))
            current = current.__cause__ or current.__context__

    sys.excepthook = hook
