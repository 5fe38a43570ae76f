"""TrainingGuard(skip_list=) under DDP and FSDP2 on 2 CPU ranks (gloo): a listed sample in rank
1's batch at step 3 makes both ranks skip step 3 before its closure (no rank waits in DDP's
gradient all-reduce or FSDP2's all-gather), and both end equal, bitwise, to a run that never
drew step 3."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers when run as a worker
from helpers.distributed import LONG_TIMEOUT_S, WORLD, launch  # noqa: E402

STEPS, LISTED_STEP, LISTED_RANK = 5, 3, 1


def ids_of(rank: int, step: int) -> list[int]:
    return [1000 * step + 100 * rank + r for r in range(4)]


def worker(rank: int, init_file: str, scenario: str, out_dir: str) -> int:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cublas_guard_ext as cg

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=LONG_TIMEOUT_S),
    )
    result: dict = {"rank": rank, "calls": [], "warnings": []}
    try:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        scenario, wrapper = scenario.split("-")
        if wrapper == "ddp":
            model = DDP(inner)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for i in (0, 2):
                fully_shard(inner[i], mesh=mesh)
            model = fully_shard(inner, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        listed = scenario == "listed"
        guard = cg.TrainingGuard(model, opt, skip_list=Path(out_dir, "skip.jsonl") if listed else None)
        for step in range(1, STEPS + 1):
            if not listed and step == LISTED_STEP:
                continue  # the reference never draws step 3's batches
            gen = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)

            def closure(x=x, y=y, step=step):
                result["calls"].append(step)
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                guard.step(closure, sample_ids=ids_of(rank, step))
            result["warnings"] += [str(w.message) for w in seen]
        result["final"] = [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for p in model.parameters()
        ]
        result["list_skips"] = guard.list_skips
        result["status"] = "ok"
    except Exception:  # noqa: BLE001
        import traceback

        result["status"] = "error"
        result["other_error"] = traceback.format_exc()[-2000:]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["status"] == "ok" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_a_listed_sample_on_one_rank_skips_the_step_on_every_rank(tmp_path, wrapper):
    listed_id = ids_of(LISTED_RANK, LISTED_STEP)[2]
    (tmp_path / "skip.jsonl").write_text(json.dumps({"sample_id": listed_id, "step": 3}) + "\n")
    results, codes, _ = launch(f"listed-{wrapper}", tmp_path, script=__file__)
    assert codes == [0, 0], results
    for r in results:
        assert r["calls"] == [1, 2, 4, 5] and r["list_skips"] == 1
    assert (
        f"[rank 1] training step 3: skipped before its closure ran: it holds listed sample {listed_id}"
        in (results[1]["warnings"][0])
    )
    assert "another rank's batch holds a listed sample (every rank skips alike)" in results[0]["warnings"][0]
    (tmp_path / "ref").mkdir()
    reference, codes, _ = launch(f"reference-{wrapper}", tmp_path / "ref", script=__file__)
    assert codes == [0, 0], reference
    assert [r["final"] for r in results] == [r["final"] for r in reference]
    assert results[0]["final"] == results[1]["final"]


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker":
        sys.exit(worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]))
    sys.exit("usage: test_skip_list_distributed.py worker RANK INIT_FILE SCENARIO OUT_DIR")
