"""TrainingGuard under DDP and FSDP2 on 2 CPU ranks (gloo), launched like tests/training/test_distributed.py.

A fault planted on rank 1 only, at step 3: both ranks take the same decision (the flag's
all-reduce), raise the same NonFiniteStepError naming rank 1 and the op (the replay runs on
every rank without collectives and finds the producer on rank 1), or skip together and end
identical; parameters are as before the bad step on both ranks.
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
from helpers.distributed import LONG_TIMEOUT_S, WORLD, launch  # noqa: E402

STEPS = 5
BAD_RANK, BAD_STEP = 1, 3


class Fault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mode = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "log":
            return x + torch.log(-x.abs() - 1.0)
        if self.mode == "backward":  # finite forward; sqrt's gradient at 0 is Inf (times 0: NaN)
            return x + torch.sqrt(torch.relu(x) * 0.0)
        if self.mode == "rows":  # the same, in features 12..15 only: under FSDP2 only rank 1's
            # shard of the first Linear (rows 8..15) gets NaN gradients; rank 0's stays finite
            tail = x[:, 12:] + torch.sqrt(torch.relu(x[:, 12:]) * 0.0)
            return torch.cat([x[:, :12], tail], dim=1)
        return x


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), Fault(), nn.Linear(16, 3))


def shard(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 10, generator=gen), torch.randn(8, 3, generator=gen)


def worker(rank: int, init_file: str, scenario: str, out_dir: str) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    import cublas_guard_ext as cg

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=LONG_TIMEOUT_S),
    )
    kind, fault, on_nan = scenario.split("-")  # e.g. "ddp-log-raise"
    result: dict = {"rank": rank, "scenario": scenario, "steps_done": 0}
    try:
        inner = make_model()
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(inner)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for i in (0, 3):
                fully_shard(inner[i], mesh=mesh)
            model = fully_shard(inner, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        reference = on_nan == "ref"  # a run without step BAD_STEP's batches, nothing planted
        guard = cg.TrainingGuard(model, opt, on_nan="raise" if reference else on_nan)

        def params() -> dict[str, list]:
            out = {}
            for k, v in inner.state_dict().items():
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[k] = v.detach().flatten().tolist()
            return out

        for step in range(1, STEPS + 1):
            if reference and step == BAD_STEP:
                result["losses"].append(None)
                continue
            x, y = shard(rank, step)
            planted = rank == BAD_RANK and step == BAD_STEP
            inner[2].mode = fault if planted else ""

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            if step == BAD_STEP:
                result["before"] = params()
                finite = [
                    bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                    for p in inner.parameters()
                ]
                assert all(finite)

            def local_check(
                closure=closure, step=step
            ):  # this rank's own view of its step (before the guard's)
                loss = closure()
                grads = [
                    p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    for p in inner.parameters()
                    if p.grad is not None
                ]
                if step == BAD_STEP:
                    result["local_bad"] = not (
                        all(bool(torch.isfinite(g).all()) for g in grads) and bool(torch.isfinite(loss))
                    )
                return loss

            try:
                loss = guard.step(local_check)
            except cg.NonFiniteStepError as err:
                result["error"] = {
                    k: err.fields.get(k)
                    for k in ("step", "op", "module", "phase", "classification", "rank", "world_size")
                }
                result["message"] = str(err)
                result["after"] = params()
                break
            finally:
                inner[2].mode = ""
            result["steps_done"] = step
            result.setdefault("losses", []).append(None if loss is None else float(loss.detach()))
        result["skipped"] = [e.step for e in guard.skipped]
        result["skipped_rank"] = [e.rank for e in guard.skipped]
        result["final"] = params()
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        import traceback

        result["status"] = "error"
        result["other_error"] = {"type": type(exc).__name__, "message": traceback.format_exc()[-2000:]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["status"] == "ok" else 2)


def run(scenario: str, tmp_path: Path) -> list[dict]:
    tmp_path.mkdir(exist_ok=True)
    start = time.monotonic()
    results, codes, _ = launch(scenario, tmp_path, script=__file__)
    assert codes == [0, 0], results
    print(f"\n[{scenario}] both ranks done in {time.monotonic() - start:.1f} s")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    "fault,phase,op", [("log", "forward", "aten.log.default"), ("backward", "backward", "aten.div.Tensor")]
)
def test_bad_step_on_one_rank_raises_on_every_rank_naming_it(kind, fault, phase, op, tmp_path):
    results = run(f"{kind}-{fault}-raise", tmp_path)
    for r in results:
        assert r["steps_done"] == BAD_STEP - 1
        assert r["error"] == {
            "step": BAD_STEP,
            "op": op,
            "module": "2",
            "phase": phase,
            "classification": "persistent",
            "rank": BAD_RANK,
            "world_size": WORLD,
        }
        assert r["message"].startswith(f"[rank {BAD_RANK}/{WORLD}] training step {BAD_STEP}: ")
        assert r["after"] == r["before"], "the bad step changed the parameters"
    assert results[0]["after"] == results[1]["after"]


@pytest.mark.slow
def test_fsdp_bad_shard_on_one_rank_only_every_rank_still_decides_alike(tmp_path):
    """Only rank 1's gradient shard is non-finite (rank 0's local check is clean): without the
    flag's all-reduce rank 0 would step while rank 1 replays, and their collectives would part."""
    results = run("fsdp-rows-raise", tmp_path)
    for r in results:
        assert r["steps_done"] == BAD_STEP - 1
        assert r["error"] == {
            "step": BAD_STEP,
            "op": "aten.div.Tensor",
            "module": "2",
            "phase": "backward",
            "classification": "persistent",
            "rank": BAD_RANK,
            "world_size": WORLD,
        }
        assert r["after"] == r["before"]
    assert results[0]["local_bad"] is False and results[1]["local_bad"] is True


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_skip_on_every_rank_keeps_ranks_identical(kind, tmp_path):
    results = run(f"{kind}-log-skip", tmp_path)
    for r in results:
        assert r["steps_done"] == STEPS and r["skipped"] == [BAD_STEP] and r["skipped_rank"] == [BAD_RANK]
        assert r["losses"][BAD_STEP - 1] is None
    assert results[0]["final"] == results[1]["final"]
    assert results[0]["final"] != results[0]["before"], "training changed nothing"
    # and equal, bitwise, to a run that never saw step 3's batches
    reference = run(f"{kind}-none-ref", tmp_path / "ref")
    assert [r["final"] for r in reference] == [r["final"] for r in results]


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker":
        sys.exit(worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]))
    sys.exit("usage: test_training_guard_distributed.py worker RANK INIT_FILE SCENARIO OUT_DIR")
