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


def test_dry_run_prints_the_slots_in_order_of_value_and_runs_nothing(tmp_path: Path) -> None:
    out = dry_run(tmp_path)
    slots = re.findall(r"slot (\d) (\w+):", out)
    assert slots == [("1", "build"), ("2", "core"), ("3", "bench"), ("4", "sanitizer"), ("5", "rest")]
    assert "TORCH_CUDA_ARCH_LIST=9.0" in out
    core = next(line for line in out.splitlines() if "slot 2 core" in line)
    for needed in (
        "timeout -s INT",
        "tests/test_cuda.py",
        "--durations",
        f"--junitxml={tmp_path}/junit-core.xml",
    ):
        assert needed in core, needed
    rest = next(line for line in out.splitlines() if "slot 5 rest" in line)
    assert "-k cuda" in rest and "--ignore=tests/test_cuda.py" in rest and "timeout -s INT" in rest
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
    bench_hard = default["BENCH_S"] + 30
    pack = int(re.search(r"^PACK_S=(\d+)", text, re.M).group(1))
    reserved = default["BUILD_S"] + default["CORE_S"] + bench_hard + default["SANITIZER_S"] + pack
    assert reserved + 30 <= default["TOTAL_S"], (reserved, default)  # >= 30 s left for the rest
    assert "BUDGET PLAN" in text.split("set -u")[0], "the plan is written at the top"


def test_help_prints_the_header(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "BUDGET PLAN" in result.stdout and "set -u" not in result.stdout
