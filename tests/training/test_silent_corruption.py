"""TrainingGuard(silent_corruption=...) in one process: spikes rerun to a verdict, checked
steps named module by module, a calibrated tolerance for kernels that are not bitwise
reproducible, one host read per healthy step, the tracker, the refusals of bad options.
The distributed verdicts (replicas, persistent on a rank) are in
test_silent_corruption_distributed.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.training.fault_injection import GemmBitFlip

from helpers import requires_cuda

SCALE = 1e-3  # a small loss: gradients ~1e-4, so one flipped exponent bit is a large spike


def make(seed: int = 0, safe: bool = False, noise: bool = False):
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(10, 16), nn.Tanh()]
    if noise:
        layers.append(Noisy())
    model = nn.Sequential(*layers, nn.Linear(16, 3))
    if safe:
        model = cg.replace_linear(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


class Noisy(nn.Module):
    """Adds noise of one ulp's order from a generator the guard does not restore: a kernel
    whose result is not bitwise reproducible (atomics), in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 1e-6 * torch.randn(x.shape, generator=self.gen))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)


def closure_for(model, opt, i: int, data=None):
    x, y = data if data is not None else batch(i)

    def closure():
        opt.zero_grad()
        loss = SCALE * F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def state(model, opt) -> dict:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    out["rng"] = torch.get_rng_state()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(guard, model, opt, steps: range) -> None:
    for i in steps:
        guard.step(closure_for(model, opt, i))


# -- spikes ------------------------------------------------------------------------------------


def test_a_one_off_spike_in_a_backward_gemm_is_transient_and_never_applied(tmp_path):
    model, opt = make()
    checks = cg.SilentCorruptionChecks(tracker=tmp_path / "sdc.jsonl")
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    train(guard, model, opt, range(1, 21))
    before = state(model, opt)
    with GemmBitFlip(ops=["aten.mm"], shape=(16, 10), bit="spike", times=1) as fault:
        with pytest.raises(cg.SilentCorruptionError) as info:
            guard.step(closure_for(model, opt, 21))
    assert fault.flips == 1
    err = info.value
    f = err.fields
    assert (f["verdict"], f["step"], f["module"], f["phase"], f["what"]) == (
        "transient",
        21,
        "0",
        "backward",
        "gradient of weight",
    )
    assert f["gemm"].startswith("grad_weight GEMM") and f["parameter"] == "0.weight"
    assert f["trigger"].startswith("gradient norm ") and "robust z-score" in f["trigger"]
    assert f["comparison"].startswith("bitwise") and f["loss"] == f["rerun_loss"]
    assert err.capsule and os.path.exists(err.capsule)
    assert isinstance(err, cg.GuardError) and isinstance(err, RuntimeError)
    assert same(state(model, opt), before), "a step with a transient verdict changed the model"
    assert all(p.grad is None for p in model.parameters())
    assert str(err).splitlines()[0] == (
        "training step 21: silent data corruption, transient: the step and its rerun first differ in "
        "module '0' (backward, gradient of weight); its GEMM: grad_weight GEMM (grad_output^T x input), "
        "in Linear; no optimizer step was taken"
    )
    lines = [json.loads(x) for x in (tmp_path / "sdc.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["verdict"] == "transient" and lines[0]["step"] == 21
    assert lines[0]["where"]["module"] == "0" and lines[0]["capsule"] == err.capsule
    assert checks.verdicts[-1]["verdict"] == "transient"
    # training goes on
    guard.step(closure_for(model, opt, 22))
    assert guard.stepped


def test_skip_drops_a_transient_step_and_equals_a_run_without_it():
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, silent_corruption=cg.SilentCorruptionChecks(on_verdict="skip"))
    ref_model, ref_opt = make()
    ref = cg.TrainingGuard(ref_model, ref_opt, silent_corruption=cg.SilentCorruptionChecks())
    train(guard, model, opt, range(1, 21))
    train(ref, ref_model, ref_opt, range(1, 21))
    with GemmBitFlip(ops=["aten.mm"], shape=(16, 10), bit="spike", times=1):
        with pytest.warns(RuntimeWarning, match="transient"):
            assert guard.step(closure_for(model, opt, 21)) is None
    assert not guard.stepped
    train(guard, model, opt, range(22, 25))
    train(ref, ref_model, ref_opt, range(22, 25))
    assert same(state(model, opt), state(ref_model, ref_opt))


def test_a_reproducible_spike_is_the_datas_and_is_applied_or_skipped():
    for on_spike in ("apply", "skip"):
        model, opt = make()
        checks = cg.SilentCorruptionChecks(on_spike=on_spike)
        guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
        train(guard, model, opt, range(1, 21))
        x, y = batch(21)
        before = state(model, opt)
        data = (x * 1e3, y)  # a bad batch: every run computes the same huge loss
        if on_spike == "apply":
            assert guard.step(closure_for(model, opt, 21, data)) is not None and guard.stepped
            assert not same(state(model, opt), before)
        else:
            with pytest.warns(RuntimeWarning, match="reproducible spike"):
                assert guard.step(closure_for(model, opt, 21, data)) is None
            assert same(state(model, opt), before)
        v = checks.verdicts[-1]
        assert v["verdict"] == "reproducible" and v["step"] == 21 and v["comparison"] == "bitwise"
        assert "robust z-score" in v["trigger"] and v["note"].startswith("largest forward output: module")


def test_no_spike_before_the_history_fills_and_none_in_clean_training():
    model, opt = make()
    checks = cg.SilentCorruptionChecks(spike_min_history=16)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    x, y = batch(1)
    guard.step(closure_for(model, opt, 1, (x * 1e3, y)))  # huge, but nothing to compare with yet
    train(guard, model, opt, range(2, 200))
    assert checks.verdicts == [] and guard.steps == 199


# -- checked steps -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ops,shape,module,phase,what,gemm",
    [
        (["cublas_guard.linear"], (8, 16), "0", "forward", "output", "forward GEMM"),
        (["cublas_guard.linear_grad_input"], (8, 16), "2", "backward", "input gradient", "grad_input GEMM"),
        (
            ["cublas_guard.linear_grad_weight"],
            (16, 10),
            "0",
            "backward",
            "gradient of weight",
            "grad_weight GEMM",
        ),
    ],
)
def test_a_checked_step_names_the_first_module_phase_and_gemm(ops, shape, module, phase, what, gemm):
    """A low mantissa bit, once: no spike and no NaN; only a checked step (its first run
    recorded) can see it, and names where it was born."""
    model, opt = make(safe=True)
    checks = cg.SilentCorruptionChecks(check_every=5)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    train(guard, model, opt, range(1, 5))
    before = state(model, opt)
    with GemmBitFlip(ops=ops, shape=shape, bit=2, index=3, times=1) as fault:
        with pytest.raises(cg.SilentCorruptionError) as info:
            guard.step(closure_for(model, opt, 5))
    assert fault.flips == 1 and abs(fault.values[0][1] / fault.values[0][0] - 1) < 1e-5
    f = info.value.fields
    assert (f["verdict"], f["module"], f["phase"], f["what"]) == ("transient", module, phase, what)
    assert f["gemm"].startswith(gemm) and "cublas_guard::linear in SafeLinear" in f["gemm"]
    assert f["trigger"] == "a checked step (every 5 steps)"
    assert info.value.capsule and os.path.exists(info.value.capsule)
    assert same(state(model, opt), before)


def test_checked_steps_of_clean_training_are_clean():
    model, opt = make(safe=True)
    checks = cg.SilentCorruptionChecks(check_every=3)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    train(guard, model, opt, range(1, 31))
    assert checks.verdicts == [] and guard.stepped


def test_kernels_that_are_not_bitwise_reproducible_get_a_calibrated_tolerance():
    """A module adding ~1e-6 relative noise each call (unrestored RNG: atomics in miniature):
    every rerun differs in the last bits, the second rerun calibrates a tolerance, and the step
    is clean; a real flip (a spike) is still transient under that tolerance."""
    model, opt = make(noise=True)
    checks = cg.SilentCorruptionChecks(check_every=4)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    train(guard, model, opt, range(1, 25))
    assert checks.verdicts == [] and guard.stepped
    with GemmBitFlip(ops=["aten.mm"], shape=(16, 10), bit="spike", times=1):
        with pytest.raises(cg.SilentCorruptionError) as info:
            guard.step(closure_for(model, opt, 25))
    f = info.value.fields
    assert f["verdict"] == "transient" and f["module"] == "0"
    assert f["comparison"].startswith("within a calibrated relative tolerance of ")
    assert "not bitwise reproducible" in f["comparison"]


def test_a_tolerance_of_your_own_skips_the_calibration():
    model, opt = make(noise=True)
    checks = cg.SilentCorruptionChecks(check_every=2, tolerance=1e-3)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    train(guard, model, opt, range(1, 11))
    assert checks.verdicts == []


# -- cost: host reads ----------------------------------------------------------------------------


def count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _o=original, _n=name, **k):
            reads.append(_n)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_host_read_per_healthy_step_with_replica_checks_every_step(monkeypatch, one_rank_group):
    model, opt = make()
    checks = cg.SilentCorruptionChecks(replica_every=1, replica_group=one_rank_group)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    train(guard, model, opt, range(1, 20))  # past the spike detector's min history
    reads = count_reads(monkeypatch)
    train(guard, model, opt, range(20, 25))
    assert reads == ["tolist"] * 5  # TrainingGuard alone: ["item"] * 5
    assert checks.replicas is not None and checks.replicas.checks == 24 and checks.verdicts == []


def test_one_host_read_per_healthy_step_on_other_steps(monkeypatch):
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, silent_corruption=cg.SilentCorruptionChecks())
    train(guard, model, opt, range(1, 20))
    reads = count_reads(monkeypatch)
    train(guard, model, opt, range(20, 25))
    assert reads == ["item"] * 5


@requires_cuda
def test_cuda_healthy_step_with_replica_checks_syncs_once(one_rank_group):
    """On a GPU, counted by torch itself (never run here: no GPU): gloo's copy of the packed row
    to the CPU waits for the step (a sync), after which the read is of CPU memory; with NCCL the
    read alone syncs. At most those two."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    checks = cg.SilentCorruptionChecks(replica_every=1, replica_group=one_rank_group)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    data = [(x.cuda(), y.cuda()) for x, y in (batch(i) for i in range(25))]
    for i in range(20):
        guard.step(closure_for(model, opt, i, data[i]))
    torch.cuda.synchronize()
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            guard.step(closure_for(model, opt, 21, data[21]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]  # gloo's device-to-host copy, the read


# -- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"replica_every": 0}, "replica_every must be a positive int or None, got 0"),
        ({"check_every": 1.5}, "check_every must be a positive int or None, got 1.5"),
        ({"spike_threshold": -1.0}, "spike_threshold must be a positive float or None, got -1.0"),
        (
            {"spike_window": 8, "spike_min_history": 16},
            "spike_min_history (16) must not exceed spike_window (8)",
        ),
        ({"on_verdict": "ignore"}, "on_verdict must be 'raise' or 'skip', got 'ignore'"),
        ({"on_spike": "raise"}, "on_spike must be 'apply' or 'skip', got 'raise'"),
        ({"tolerance": 0}, "tolerance must be 'calibrate' (bitwise, or calibrated by a second rerun) or a"),
        ({"tolerance": None}, "tolerance must be 'calibrate'"),
        ({"exit_codes": {"transient": 300}}, "exit_codes must be True, False or a dict"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError) as info:
        cg.SilentCorruptionChecks(**kwargs)
    assert str(info.value).startswith("SilentCorruptionChecks: " + message)


def test_refused_with_deferred_or_a_scaler_and_bound_to_one_guard():
    model, opt = make()
    checks = cg.SilentCorruptionChecks()
    with pytest.raises(ValueError, match="silent_corruption= needs deferred=False and no scaler="):
        cg.TrainingGuard(model, opt, scaler=torch.amp.GradScaler("cpu"), silent_corruption=checks)
    cg.TrainingGuard(model, opt, silent_corruption=cg.SilentCorruptionChecks())
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    assert guard.silent_corruption is checks and checks.replicas is None
    assert checks.replica_note == "replica checks off: no process group of more than one rank is initialised"
    with pytest.raises(ValueError, match="already belongs to a TrainingGuard"):
        cg.TrainingGuard(model, opt, silent_corruption=checks)


@pytest.mark.locked
def test_a_nan_step_keeps_trainingguards_own_verdict():
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, silent_corruption=cg.SilentCorruptionChecks(check_every=2))
    x, y = batch(1)
    x[0, 0] = math.nan
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, opt, 1, (x, y)))
    assert info.value.classification == "persistent" and info.value.phase == "entry"


# -- the error's message, from fields alone ------------------------------------------------------


def test_the_messages_of_each_verdict():
    common = {
        "step": 7,
        "rank": 1,
        "world_size": 4,
        "host": "node-3",
        "device": "cuda:1",
        "gpu_uuid": "GPU-abc",
    }
    replicas = cg.SilentCorruptionError(
        verdict="replicas_differ", parameter="fc1.weight", differing_parameters=2, ranks=[1], **common
    )
    text = str(replicas)
    assert text.splitlines()[0] == (
        "[rank 1/4] training step 7: replicas disagree: parameter 'fc1.weight' on rank 1 differs "
        "from the other replicas'; no optimizer step was taken"
    )
    assert "  rank 1: host node-3, device cuda:1, GPU UUID GPU-abc" in text
    assert "first differing parameter: fc1.weight (2 parameters differ)" in text
    assert "Next: restart from the last checkpoint away from rank 1 (host node-3" in text
    persistent = cg.SilentCorruptionError(
        verdict="persistent",
        module="fc1",
        phase="forward",
        what="output",
        gemm="forward GEMM (input x weight^T + bias), cublas_guard::linear in SafeLinear",
        replays=[{"rank": 0, "host": "a", "device": "cuda:0", "signature": 5}],
        exit_code=16,
        **common,
    )
    text = str(persistent)
    assert text.splitlines()[0].startswith(
        "[rank 1/4] training step 7: silent data corruption, persistent on rank 1: its replay of the "
        "GEMM in module 'fc1' (forward, output); its GEMM: forward GEMM"
    )
    assert "replay of the capsule on rank 0 (a, cuda:0): signature 5" in text
    assert "exit code: 16 if this error ends the process" in text
    assert "Next: cordon rank 1 (host node-3, device cuda:1, GPU UUID GPU-abc)" in text


# -- exit codes ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_exit_codes_end_the_process_with_the_verdicts_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.nn.functional as F
            from torch import nn
            import cublas_guard_ext as cg
            from cublas_guard_ext.training.fault_injection import GemmBitFlip
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            guard = cg.TrainingGuard(model, opt, silent_corruption=cg.SilentCorruptionChecks(
                check_every=3, exit_codes=True))
            x, y = torch.randn(8, 10), torch.randn(8, 3)
            def closure():
                opt.zero_grad(); loss = F.mse_loss(model(x), y); loss.backward(); return loss
            guard.step(closure); guard.step(closure)
            with GemmBitFlip(ops=["aten.addmm"], shape=(8, 16), bit=2, times=1):
                guard.step(closure)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=str(Path(cg.__file__).parents[1]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 16, proc.stderr[-2000:]
    assert "SilentCorruptionError: training step 3: silent data corruption, transient" in proc.stderr
    assert "exit code: 16 if this error ends the process" in proc.stderr
