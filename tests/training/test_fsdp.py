"""FSDP2 mixed precision and a bf16 DDP model, on 2 CPU ranks (gloo), with SafeLinear.

Launched like tests/training/test_distributed.py (its ``launch`` helper runs this file as the worker).

* FSDP2: ``fully_shard`` on every Linear and on the root, ``init_device_mesh("cpu", (2,))``,
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: each
  SafeLinear's forward receives bf16 weights (all-gathered, plain tensors) and bf16 input,
  and computes in bf16. A few SGD steps end with parameters within bf16 tolerance of the same
  model built from nn.Linear, and the ranks agree.
* A NaN batch on rank 1 under FSDP2 raises ``NonFiniteInputError`` on rank 1, in the forward
  of the first layer (named ``rank1.0``), after that layer's all-gather. What the OTHER rank
  does, measured below: it has no error of its own and goes on to the next collective (the
  all-gather of the next layer's parameters in the same forward); when rank 1's process exits
  with the error, gloo sees the closed connection and rank 0 raises promptly, well before the
  process-group timeout (as for DDP, where it fails in the gradient all-reduce). If the bad
  rank caught the error and stayed alive, the other rank would wait for the gloo timeout,
  exactly as tests/training/test_distributed.py measures for DDP: under FSDP every forward and backward
  is a sequence of collectives, so skip a bad batch only by agreeing first (all-reduce a flag).
* DDP with a model cast to bf16 (``model.to(torch.bfloat16)``): parameters and gradients in
  bf16, gradient all-reduce in bf16; a few steps end within bf16 tolerance of nn.Linear's.
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
from helpers.distributed import LONG_TIMEOUT_S, WORLD, assert_the_other_rank_failed_fast, launch  # noqa: E402

STEPS = 4
BAD_RANK, BAD_STEP = 1, 2
LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def shard(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)


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
    result: dict = {"rank": rank, "scenario": scenario, "steps_done": 0}
    start = time.monotonic()

    def dump() -> None:
        result["elapsed"] = time.monotonic() - start
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))

    def build(safe: bool) -> nn.Module:
        model = make_model()
        if safe:
            model = cg.name_layers(cg.replace_linear(model), prefix=f"rank{rank}")
        return model

    def fsdp_train(model: nn.Module, poison: bool) -> dict[str, torch.Tensor]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        seen: list[tuple[torch.dtype, torch.dtype]] = []
        for module in model:
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            result["step_started"] = time.monotonic() - start
            x, y = shard(rank, step)
            if poison and rank == BAD_RANK and step == BAD_STEP:
                x[3, 4] = float("nan")
            opt.zero_grad()
            out = model(x)
            result["out_dtype"] = str(out.dtype)
            F.mse_loss(out.float(), y).backward()
            opt.step()
            result["steps_done"] = step + 1
        result["seen_dtypes"] = sorted({f"{a}/{b}" for a, b in seen})
        return {k: v.full_tensor().detach() for k, v in model.state_dict().items()}

    def ddp_bf16_train(model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model.to(torch.bfloat16))
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = shard(rank, step)
            opt.zero_grad()
            out = ddp(x.bfloat16())
            result["out_dtype"] = str(out.dtype)
            F.mse_loss(out.float(), y).backward()
            opt.step()
            result["steps_done"] = step + 1
        return {k: v.detach() for k, v in ddp.module.state_dict().items()}

    def fsdp_watched(
        model: nn.Module, watched: bool, blow_up_at: int | None = None
    ) -> dict[str, torch.Tensor]:
        """FSDP2 in float32 with AdamW (its parameters are DTensors: its step is watched op by
        op, on the local shards), each step inside ``cg.watch(model, mode="sync")``."""
        from contextlib import nullcontext

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for module in model:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(STEPS):
            x, y = shard(rank, step)
            with cg.watch(model, mode="sync") if watched else nullcontext():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                if step == blow_up_at:
                    loss = loss * 1e25  # gradients ~1e24 on every rank: exp_avg_sq's g*g overflows
                loss.backward()
                opt.step()
            result["steps_done"] = step + 1
        return {k: v.full_tensor().detach() for k, v in model.state_dict().items()}

    try:
        if scenario == "fsdp_watch":
            states = {"plain": fsdp_watched(make_model(), False), "watched": fsdp_watched(make_model(), True)}
            torch.save(states, Path(out_dir, f"rank{rank}.pt"))
            try:
                fsdp_watched(make_model(), True, blow_up_at=BAD_STEP)
            except cg.NonFiniteOutputError as err:
                keys = ("phase", "optimizer", "optimizer_step", "parameter", "state")
                result["finding"] = {k: err.fields.get(k) for k in keys} | {"message": str(err)}
        elif scenario == "fsdp":
            states = {"plain": fsdp_train(build(False), poison=False)}
            states["safe"] = fsdp_train(build(True), poison=False)
            torch.save(states, Path(out_dir, f"rank{rank}.pt"))
        elif scenario == "ddp_bf16":
            states = {"plain": ddp_bf16_train(build(False)), "safe": ddp_bf16_train(build(True))}
            torch.save(states, Path(out_dir, f"rank{rank}.pt"))
        else:  # "fsdp_nan"
            try:
                fsdp_train(build(True), poison=True)
            except cg.NonFiniteInputError as err:
                result["error"] = {"type": type(err).__name__, "layer": err.layer, "message": str(err)}
                raise
        result["status"] = "ok"
        dump()
        sys.stdout.flush()
        os._exit(0)  # no gloo teardown (see tests/training/test_distributed.py)
    except Exception as exc:  # noqa: BLE001 (recorded for the test, then the process fails)
        result["status"] = "error"
        if "error" not in result or result["error"]["message"] != str(exc):
            result["other_error"] = {"type": type(exc).__name__, "message": str(exc)[:500]}
        dump()
        sys.stdout.flush()
        os._exit(2)


def bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # a few steps of bf16 training: the two models may round differently at each step
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)


def run(scenario: str, tmp_path: Path) -> tuple[list[dict], list[int], list[float]]:
    return launch(scenario, tmp_path, script=__file__)


@pytest.mark.slow
def test_fsdp2_bf16_mixed_precision_matches_nn_linear(tmp_path: Path) -> None:
    results, codes, _ = run("fsdp", tmp_path)
    assert codes == [0, 0], results
    assert all(r["out_dtype"] == "torch.bfloat16" for r in results)
    # what each Linear's forward received: bf16 input and bf16 weights
    assert all(r["seen_dtypes"] == ["torch.bfloat16/torch.bfloat16"] for r in results), results
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    init = make_model().state_dict()
    for key, start in init.items():
        for r in range(WORLD):
            safe, plain = states[r]["safe"][key], states[r]["plain"][key]
            assert safe.dtype == torch.float32  # FSDP keeps fp32 master parameters
            assert torch.equal(safe, states[0]["safe"][key]), f"ranks disagree on {key}"
            bf16_close(safe, plain)
        assert not torch.equal(states[0]["safe"][key], start), "training changed nothing"


@pytest.mark.slow
def test_fsdp2_nan_on_one_rank_is_reported_there_by_layer(tmp_path: Path) -> None:
    results, codes, ends = run("fsdp_nan", tmp_path)
    bad, other = results[BAD_RANK], results[1 - BAD_RANK]
    assert bad["error"]["type"] == "NonFiniteInputError"
    assert bad["error"]["layer"] == f"rank{BAD_RANK}.0"
    assert f"layer 'rank{BAD_RANK}.0'" in bad["error"]["message"] and "1 NaN" in bad["error"]["message"]
    assert bad["steps_done"] == BAD_STEP and codes[BAD_RANK] == 2
    # The other rank: no error of its own; it fails in its next collective, promptly.
    assert "error" not in other
    assert_the_other_rank_failed_fast(results, codes, ends, "fsdp/nan", BAD_RANK, BAD_STEP)


@pytest.mark.slow
def test_fsdp2_under_watch_runs_clean_and_names_a_divergence_in_the_optimizer_step(tmp_path: Path) -> None:
    results, codes, _ = run("fsdp_watch", tmp_path)
    assert codes == [0, 0], results
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for key in make_model().state_dict():
        for r in range(WORLD):  # no false alarm, and watch changes nothing
            assert torch.equal(states[r]["watched"][key], states[r]["plain"][key]), key
    for r in results:  # the gradient is reduced across ranks: each rank finds it in its shard
        finding = r["finding"]
        assert finding["phase"] == "optimizer step" and finding["optimizer"] == "AdamW", finding
        assert finding["state"] == "exp_avg_sq" and finding["optimizer_step"] == BAD_STEP + 1, finding
        assert finding["parameter"] in {f"{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")}
        assert "run under watch" not in finding["message"]
        assert (
            "gradient norm this step (this rank's shards of the optimizer's parameters)" in finding["message"]
        )


@pytest.mark.slow
def test_ddp_with_a_bf16_model_matches_nn_linear(tmp_path: Path) -> None:
    results, codes, _ = run("ddp_bf16", tmp_path)
    assert codes == [0, 0], results
    assert all(r["out_dtype"] == "torch.bfloat16" for r in results)
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    init = make_model().state_dict()
    for key, start in init.items():
        for r in range(WORLD):
            safe, plain = states[r]["safe"][key], states[r]["plain"][key]
            assert safe.dtype == torch.bfloat16
            assert torch.equal(safe, states[0]["safe"][key]), f"ranks disagree on {key}"
            bf16_close(safe, plain)
        assert not torch.equal(states[0]["safe"][key], start.bfloat16()), "training changed nothing"


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker":
        sys.exit(worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]))
    sys.exit("usage: test_fsdp.py worker RANK INIT_FILE SCENARIO OUT_DIR (run by the tests)")
