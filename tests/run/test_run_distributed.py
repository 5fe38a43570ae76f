"""``run`` under torchrun: two gloo ranks on the CPU, rank 1 meets a NaN; nobody hangs.

Rank 0 waits in an all_reduce for rank 1, which never arrives: without ``run`` it would wait
for gloo's timeout (30 minutes by default). With it, rank 1 writes its report naming the op,
tells rank 0 through the process group's store, and rank 0's watchdog writes its own report
naming rank 1 and ends the process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.run_scripts import script_env, write

pytestmark = pytest.mark.slow

SCRIPT = """
import sys, time
import torch, torch.distributed as dist
from torch import nn

class LogAct(nn.Module):
    def forward(self, x):
        return torch.log(x)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = LogAct()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(x))

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 6):
    x = torch.rand(4, 8) + 0.5
    if rank == 1 and step == 3:
        print("FAILING_AT", time.time(), flush=True)
        x = -x
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    dist.all_reduce(loss.detach())
    if rank == 0 and step == 3:
        print("rank 0 passed step 3: the test failed", flush=True)
dist.destroy_process_group()
"""


# torchrun's two ways to reach every rank: `-m cublas_guard_ext run` and `--no-python python -m ...`
LAUNCHES = {"module": ["-m"], "no-python": ["--no-python", sys.executable, "-m"]}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_rank_1_meets_a_nan_and_both_ranks_end_within_seconds(tmp_path: Path, launch: str) -> None:
    script = write(tmp_path, "train.py", SCRIPT)
    folder = tmp_path / "reports"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        *LAUNCHES[launch],
        "cublas_guard_ext",
        "run",
        "--watch",
        "--report",
        str(folder),
        str(script),
    ]
    started = time.time()
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=script_env(), cwd=str(tmp_path)
    )
    ended = time.time()
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "the test failed" not in text
    failing_at = float(
        next(line for line in out.stdout.splitlines() if line.startswith("FAILING_AT")).split()[1]
    )
    assert failing_at > started and ended - failing_at < 30, (
        f"{ended - failing_at:.1f} s after the NaN\n{text}"
    )
    by_rank = {}
    for path in folder.glob("*.json"):
        data = json.loads(path.read_text())
        by_rank[data["rank"]] = data
    assert set(by_rank) == {0, 1}, text
    one, zero = by_rank[1], by_rank[0]
    assert one["error"]["class"] == "NonFiniteOutputError"
    assert one["where"]["op"].startswith("aten.log") and one["where"]["module"] == "act"
    assert one["where"]["step"] == 3 and one["stem"].endswith(f"rank1-local1-pid{one['pid']}")
    assert zero["error"]["class"] == "PeerFailedError" and zero["peer"]["rank"] == 1
    assert zero["peer"]["report"] == one["report"]
    assert "rank 1 failed first (NonFiniteOutputError" in zero["error"]["message"]
    assert (folder / "index.html").is_file()
    index = (folder / "index.html").read_text()
    assert Path(one["report"]).name in index and Path(zero["report"]).name in index
    # rank 0 said why it stopped, naming rank 1 and its report
    assert "[rank 0] cublas_guard_ext run: stopping this rank: rank 1" in text
