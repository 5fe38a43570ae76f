"""Gloo ranks on the CPU (two unless a test asks for more), each a process running a test
file as its worker script (``script worker RANK INIT_FILE SCENARIO OUT_DIR``, rendezvous
through ``init_method=file://``; the world size is in ``CGX_TEST_WORLD``):
training/test_distributed.py, test_fsdp.py, test_training_guard_distributed.py and
test_silent_corruption_distributed.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers.rank_forks import run_ranks

WORLD = 2


LONG_TIMEOUT_S = 60.0  # the gloo timeout of the other scenarios


PROCESS_LIMIT_S = 120.0  # no worker may run longer than this (else: a hang)


def launch(
    scenario: str, tmp_path: Path, script: str, world: int = WORLD
) -> tuple[list[dict], list[int], list[float]]:
    """Start ``world`` ranks (``script worker RANK INIT_FILE SCENARIO OUT_DIR``); wait for each
    (bounded); return their results, exit codes, and the seconds from the start to each
    process's exit."""
    init_file = tmp_path / "rendezvous"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        CGX_TEST_WORLD=str(world),
    )
    outputs = [tmp_path / f"rank{rank}.output" for rank in range(world)]
    argvs = [[script, "worker", str(rank), str(init_file), scenario, str(tmp_path)] for rank in range(world)]
    codes, ends, hung = run_ranks(argvs, env, outputs, PROCESS_LIMIT_S)
    if hung:
        pytest.fail(f"scenario {scenario!r}: a rank hung past {PROCESS_LIMIT_S} s")
    logs = [path.read_text(errors="replace") for path in outputs]
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result; its output:\n{logs[rank][-3000:]}"
        results.append(json.loads(path.read_text()))
    return results, codes, ends


def assert_the_other_rank_failed_fast(
    results: list[dict], codes: list[int], ends: list[float], label: str, bad_rank: int, bad_step: int
) -> None:
    """The rank that saw no bad value fails in its next collective, promptly (the peer's
    closed connection, not the timeout), and every process ends."""
    other = results[1 - bad_rank]
    assert other["status"] == "error" and codes[1 - bad_rank] == 2, (codes, other)
    assert other["steps_done"] == bad_step
    assert other["elapsed"] - other["step_started"] < LONG_TIMEOUT_S - 5, "it waited for the timeout"
    print(
        f"\n[{label}] rank {1 - bad_rank} got {other['other_error']['type']} after "
        f"{other['elapsed'] - other['step_started']:.1f} s in the step: "
        f"{other['other_error']['message'][:160]!r}; processes exited at "
        f"{', '.join(f'{e:.1f}' for e in ends)} s after launch"
    )
    assert max(ends) < PROCESS_LIMIT_S
