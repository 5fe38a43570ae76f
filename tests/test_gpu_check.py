"""benchmarks/gpu/gpu_check.sh on a machine without a GPU: its --dry-run plan, and its budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "gpu_check.sh"


def dry_run(tmp_path: Path, **env: str) -> str:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), **env},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_dry_run_prints_the_slots_in_the_issue_19_order_and_runs_nothing(tmp_path: Path) -> None:
    out = dry_run(tmp_path)
    slots = re.findall(r"slot (\d) (\w+):", out)
    assert slots == [
        ("1", "build"),
        ("2", "smoke"),
        ("3", "tests"),
        ("4", "bench"),
        ("4", "bench"),
        ("5", "sanitizer"),
    ]
    assert "TORCH_CUDA_ARCH_LIST=9.0" in out
    smoke = next(line for line in out.splitlines() if "slot 2 smoke" in line)
    for needed in (
        "timeout -s INT",
        "tests/test_libstdcxx.py",
        "tests/test_gpu_smoke.py",
        "_64bit",
        "tests/test_watch.py::",
        "--durations",
        f"--junitxml={tmp_path}/junit-smoke.xml",
    ):
        assert needed in smoke, needed
    tests = next(line for line in out.splitlines() if "slot 3 tests" in line)
    for needed in (
        "timeout -s INT",
        "-p select_cuda_tests",
        "-n ",
        "not slow",
        f"--junitxml={tmp_path}/junit-tests.xml",
    ):
        assert needed in tests, needed
    bench = [line for line in out.splitlines() if "slot 4 bench" in line]
    assert ["CUBLAS_GUARD_GEMM_PATH=legacy" in bench[0], "CUBLAS_GUARD_GEMM_PATH=lt" in bench[1]] == [
        True,
        True,
    ]
    # The benchmark plan comes from run.py --dry-run, which imports the checkout's package: only
    # where it has its native library (not in CI's installed-package run, whose source copy has
    # none and would JIT-build it).
    if any((ROOT / "cublas_guard_ext").glob("_C*.so")):
        assert "preset gpu" in out and "groups" in out
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing built


def test_one_run_fits_in_eight_minutes_with_every_slot_funded() -> None:
    """The defaults: the slots' reserves fit inside the total, and the total inside 8 minutes."""
    text = SCRIPT.read_text()
    default = {
        name: int(value) for name, value in re.findall(r'^(\w+)="\$\{GPU_CHECK_\w+:-(\d+)\}"', text, re.M)
    }
    assert default["TOTAL_S"] <= 8 * 60 - 30  # a margin inside the device call's 480 s
    bench_hard = 2 * default["BENCH_S"] + 30  # both GEMM paths
    pack = int(re.search(r"^PACK_S=(\d+)", text, re.M).group(1))
    reserved = (
        default["BUILD_S"]
        + default["SMOKE_S"]
        + default["TESTS_S"]
        + bench_hard
        + default["SANITIZER_S"]
        + pack
    )
    assert reserved + 15 <= default["TOTAL_S"], (reserved, default)  # + the environment report
    assert default["SMOKE_S"] <= 30  # a 20-second smoke step
    assert "BUDGET PLAN" in text.split("set -u")[0], "the plan is written at the top"


def test_help_prints_the_header(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "BUDGET PLAN" in result.stdout and "set -u" not in result.stdout


def test_the_model_bench_dry_run_plans_the_issue_targets_and_runs_nothing(tmp_path: Path) -> None:
    """gpu_model_bench.sh: the second call's plan (watch and TrainingGuard on bf16 GPT-2 small)."""
    script = ROOT / "benchmarks" / "gpu" / "gpu_model_bench.sh"
    result = subprocess.run(
        ["bash", str(script), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    steps = re.findall(r"^  (\S+)\s+(?:timeout|\(if)", result.stdout, re.M)
    assert steps == ["build", "watch-sync", "watch", "guard"]
    assert "watch_bench.py --device cuda --model gpt2 --bf16" in result.stdout
    assert "training_guard_bench.py --device cuda --model gpt2 --bf16 --fused" in result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing run
    # every test file the plan names exists
    for name in re.findall(r"tests/\S+\.py", result.stdout):
        assert (ROOT / name).is_file(), name
