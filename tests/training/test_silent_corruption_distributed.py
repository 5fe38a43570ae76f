"""TrainingGuard(silent_corruption=...) across gloo ranks on the CPU, by injected faults.

Each scenario starts 2-4 ranks (tests/helpers/distributed.py). Proven here:

* a parameter corrupted on one replica (DDP, 3 ranks; HSDP, 4 ranks: 2 replicas x 2 shards):
  every rank raises the same SilentCorruptionError naming the rank, its host and device,
  the parameter and the step; nothing hangs; the tracker gets one line;
* a bit flipped once in one GEMM output of a checked step on rank 1: ``transient`` on rank 1,
  the module, the phase and the GEMM named, its capsule written, no step applied;
* the same fault in every GEMM of one shape on rank 1: ``persistent`` on rank 1 (rank 1's
  replay of the capsule's operands differs from rank 0's replay of the same operands);
* a NaN in one rank's batch: TrainingGuard's own verdict (reproducible, the op named);
* clean training, hundreds of steps with and without dropout: no verdict, replicas checked
  every step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers when run as a worker
from helpers.distributed import LONG_TIMEOUT_S, launch  # noqa: E402

BAD_RANK = 1
# HSDP on 4 ranks, mesh [[0, 1], [2, 3]]: rank 3's replica is rank 1; of two copies, the one
# named is the one that differs from the lower rank's (which is wrong cannot be told)
HSDP_BAD_RANK = 3


def make_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(10, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(16, 3))


def shard(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 10, generator=gen), torch.randn(8, 3, generator=gen)


def worker(rank: int, init_file: str, scenario: str, out_dir: str) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    import cublas_guard_ext as cg
    from cublas_guard_ext.training.fault_injection import GemmBitFlip, flip_bit

    world = int(os.environ["CGX_TEST_WORLD"])
    os.environ["CUBLAS_GUARD_CAPSULE_DIR"] = str(Path(out_dir) / f"capsules{rank}")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=LONG_TIMEOUT_S),
    )
    result: dict = {"rank": rank, "scenario": scenario, "steps_done": 0}
    start = time.monotonic()
    try:
        steps, bad_step = 8, 4
        options: dict = {"tracker": str(Path(out_dir) / "tracker.jsonl")}
        dropout = 0.0
        if scenario == "replica":
            options.update(replica_every=2)
        elif scenario in ("transient", "persistent"):
            options.update(check_every=bad_step, replica_every=None)
        elif scenario == "nan":
            options.update(replica_every=1)
        elif scenario.endswith("-spike"):  # a one-off exponent flip after the spike history filled
            steps, bad_step = 22, 20
            options.update(replica_every=None)
        elif scenario.startswith("clean"):
            steps, bad_step = 300, -1
            dropout = 0.3 if scenario == "clean-dropout" else 0.0
            options.update(replica_every=1, check_every=50)
        inner = make_model(dropout)
        if scenario == "fsdp-spike":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for i in (0, len(inner) - 1):
                fully_shard(inner[i], mesh=mesh)
            model = fully_shard(inner, mesh=mesh)
        elif scenario == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            for i in (0, len(inner) - 1):
                fully_shard(inner[i], mesh=mesh)
            model = fully_shard(inner, mesh=mesh)
            options.update(replica_every=2)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(inner)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        checks = cg.SilentCorruptionChecks(**options)
        guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
        result["replica_note"] = checks.replica_note

        def params() -> dict[str, list]:
            out = {}
            for k, v in inner.state_dict().items():
                v = v.to_local() if hasattr(v, "to_local") else v
                out[k] = v.detach().flatten().tolist()
            return out

        for step in range(1, steps + 1):
            x, y = shard(rank, step)
            if scenario == "nan" and step == bad_step and rank == BAD_RANK:
                x[2, 3] = float("nan")

            scale = 1e-3 if scenario.endswith("-spike") else 1.0  # small gradients: a flip is a spike

            def closure(x=x, y=y, scale=scale):
                opt.zero_grad()
                loss = scale * F.mse_loss(model(x), y)
                loss.backward()
                return loss

            fault = None
            if step == bad_step and rank == (HSDP_BAD_RANK if scenario == "hsdp" else BAD_RANK):
                if scenario in ("replica", "hsdp"):
                    w = inner[0].weight
                    flip_bit(w.to_local() if hasattr(w, "to_local") else w, index=5, bit=3)
                elif scenario == "transient":  # once, in the first run of the checked step
                    fault = GemmBitFlip(ops=["aten.addmm"], shape=(8, 16), bit=22, times=1)
                elif scenario.endswith("-spike"):  # the first Linear's grad_weight GEMM, once
                    fault = GemmBitFlip(ops=["aten.mm"], shape=(16, 10), bit="spike", times=1)
                elif scenario == "persistent":  # a faulty unit: every such GEMM on this rank
                    fault = GemmBitFlip(ops=["aten.addmm"], shape=(8, 16), bit=30, times=None)
            if step == bad_step:
                result["before"] = params()
            try:
                if fault is not None:
                    try:
                        with fault:
                            guard.step(closure)
                    finally:
                        result["flips"] = fault.flips
                else:
                    guard.step(closure)
            except (cg.SilentCorruptionError, cg.NonFiniteStepError) as err:
                result["error"] = {
                    "class": type(err).__name__,
                    **json.loads(json.dumps(err.fields, default=str)),
                }
                result["capsule"] = err.capsule
                result["message"] = str(err)
                result["after"] = params()
                break
            result["steps_done"] = step
        result["verdicts"] = len(checks.verdicts)
        result["replica_checks"] = checks.replicas.checks if checks.replicas is not None else None
        result["final"] = params()
        result["status"] = "ok"
    except Exception:  # noqa: BLE001
        import traceback

        result["status"] = "error"
        result["other_error"] = traceback.format_exc()[-3000:]
    result["elapsed"] = time.monotonic() - start
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["status"] == "ok" else 2)


def run(scenario: str, tmp_path: Path, world: int = 2) -> list[dict]:
    tmp_path.mkdir(exist_ok=True)
    start = time.monotonic()
    results, codes, _ = launch(scenario, tmp_path, script=__file__, world=world)
    assert codes == [0] * world, results
    print(f"\n[{scenario}] {world} ranks done in {time.monotonic() - start:.1f} s")
    return results


def tracker_lines(tmp_path: Path) -> list[dict]:
    path = tmp_path / "tracker.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("scenario,world", [("replica", 3), ("hsdp", 4)])
def test_a_corrupted_replica_is_named_on_every_rank(scenario, world, tmp_path):
    results = run(scenario, tmp_path, world)
    bad_step, bad = 4, (HSDP_BAD_RANK if scenario == "hsdp" else BAD_RANK)
    for r in results:
        err = r["error"]
        assert err["class"] == "SilentCorruptionError", r
        assert err["verdict"] == "replicas_differ"
        assert (err["step"], err["rank"], err["ranks"], err["parameter"]) == (
            bad_step,
            bad,
            [bad],
            "0.weight",
        )
        assert err["host"] and err["device"] == "cpu" and err["gpu_uuid"] is None
        assert r["message"].startswith(f"[rank {bad}/{world}] training step {bad_step}: replicas disagree")
        assert r["steps_done"] == bad_step - 1
        assert r["after"] == r["before"] or r["rank"] == bad  # (the bad rank's copy was flipped)
    if scenario == "hsdp":
        assert "split evenly" in results[0]["message"]
    lines = tracker_lines(tmp_path)
    assert len(lines) == 1, lines
    assert lines[0]["verdict"] == "replicas_differ" and lines[0]["rank"] == bad
    assert lines[0]["where"] == {"parameter": "0.weight"} and lines[0]["step"] == bad_step
    assert lines[0]["written_by"]["rank"] == bad


@pytest.mark.slow
def test_a_bit_flipped_once_in_a_gemm_is_transient_on_that_rank(tmp_path):
    results = run("transient", tmp_path)
    for r in results:
        err = r["error"]
        assert err["verdict"] == "transient", r["message"]
        assert (err["rank"], err["module"], err["phase"], err["what"]) == (BAD_RANK, "0", "forward", "output")
        assert err["gemm"].startswith("forward GEMM")
        assert err["comparison"].startswith("bitwise")
        assert r["after"] == r["before"], "a step with a transient verdict was applied"
    assert results[BAD_RANK]["flips"] == 1
    assert results[BAD_RANK]["capsule"] and os.path.exists(results[BAD_RANK]["capsule"])
    assert results[0]["capsule"] is None  # the capsule is on the named rank's host
    lines = tracker_lines(tmp_path)
    assert [line["verdict"] for line in lines] == ["transient"]
    assert lines[0]["capsule"] == results[BAD_RANK]["capsule"]


@pytest.mark.slow
def test_the_same_fault_every_time_on_one_rank_is_persistent_there(tmp_path):
    results = run("persistent", tmp_path)
    for r in results:
        err = r["error"]
        assert err["verdict"] == "persistent", r["message"]
        assert (err["rank"], err["module"], err["phase"]) == (BAD_RANK, "0", "forward")
        replays = {p["rank"]: p["signature"] for p in err["replays"]}
        assert replays[0] != replays[1]
        assert r["after"] == r["before"]
    assert results[BAD_RANK]["capsule"] and os.path.exists(results[BAD_RANK]["capsule"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_one_off_spike_in_a_backward_gemm_is_transient_under_ddp_and_fsdp(kind, tmp_path):
    """The spike is seen after the step: the gradients (already averaged / reduce-scattered)
    name the parameter and its GEMM; which rank computed it cannot be told from them."""
    results = run(f"{kind}-spike", tmp_path)
    for r in results:
        err = r["error"]
        assert err["verdict"] == "transient", r["message"]
        assert (err["step"], err["module"], err["phase"], err["what"]) == (
            20,
            "0",
            "backward",
            "gradient of weight",
        )
        assert err["trigger"].count("gradient norm") >= 1 and "cannot be told" in err["note"]
        assert r["after"] == r["before"]
    assert results[BAD_RANK]["flips"] == 1


@pytest.mark.slow
def test_a_nan_from_the_data_is_reproducible_and_named(tmp_path):
    results = run("nan", tmp_path)
    for r in results:
        err = r["error"]
        assert err["class"] == "NonFiniteStepError"
        assert err["classification"] == "persistent" and err["rank"] == BAD_RANK
        assert err["phase"] == "entry"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["clean", "clean-dropout"])
def test_clean_training_raises_no_false_alarm(scenario, tmp_path):
    results = run(scenario, tmp_path)
    for r in results:
        assert "error" not in r, r.get("message")
        assert r["steps_done"] == 300 and r["verdicts"] == 0
        assert r["replica_checks"] == 300
    assert results[0]["final"] == results[1]["final"]
    assert tracker_lines(tmp_path) == []


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker":
        sys.exit(worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]))
    sys.exit("usage: test_silent_corruption_distributed.py worker RANK INIT_FILE SCENARIO OUT_DIR")
