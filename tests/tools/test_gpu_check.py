"""benchmarks/gpu/gpu_check.sh on a machine without a GPU: both runs' budgets against the device
loan, every shell path of both runs with the GPU steps stubbed (--dry-run), the files that come
back, the RESULTS.md section, and the test selection (no test in two steps, none by name)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
SCRIPT = GPU / "gpu_check.sh"
TEXT = SCRIPT.read_text()
LOAN_S = 15 * 60  # device time per task, everything together
COLD_START_S = 3 * 60  # the worst cold start
COMMAND_LIMIT_S = 600  # the device tool's per-command limit
MAX_FILES = 8  # files a device call brings back

sys.path.insert(0, str(GPU))
import gpu_results  # noqa: E402
import select_cuda_tests as sel  # noqa: E402


def setting(name: str) -> str:
    return re.search(rf"^{name}=\"?([^\"\n]+)\"?$", TEXT, re.M).group(1)


def slots(run: int) -> dict[str, int]:
    return {k: int(v) for k, v in (s.split(":") for s in setting(f"RUN{run}_SLOTS").split())}


@pytest.mark.parametrize("run", [1, 2])
def test_each_run_stops_itself_inside_its_limit_with_every_step_funded(run: int) -> None:
    total, limit = int(setting(f"RUN{run}_TOTAL_S")), int(setting(f"RUN{run}_LIMIT_S"))
    assert sum(slots(run).values()) == total, slots(run)
    assert total + 30 <= limit <= COMMAND_LIMIT_S  # 30 s to pack and copy back past the total
    assert f"timeout_s {limit}" in TEXT.split("set -u")[0]  # the header says which limit to call with


def test_both_runs_and_the_worst_cold_start_fit_the_loan() -> None:
    assert COLD_START_S + int(setting("RUN1_LIMIT_S")) + int(setting("RUN2_LIMIT_S")) <= LOAN_S
    assert slots(1)["smoke"] == 60 and list(slots(1)) == ["env", "build", "smoke", "tests", "bench", "pack"]
    assert list(slots(2)) == ["env", "watch-tests", "watch-bench", "guard-bench", "sanitizer", "pack"]
    assert int(setting("MAX_FILES")) == MAX_FILES


def dry_run(out: Path, run: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "--run", str(run), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), **env},
    )


RUN_STEPS = {
    1: ["env", "build", "smoke", "tests", "bench-legacy", "bench-lt"],
    2: ["env", "build", "watch-tests", "watch-bench", "guard-bench", "sanitizer"],
}


@pytest.mark.slow
@pytest.mark.parametrize("run", [1, 2])
def test_the_dry_run_runs_every_step_and_brings_back_four_files(tmp_path: Path, run: int) -> None:
    result = dry_run(tmp_path, run)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["RESULTS.md", "details.tar.gz", "gpu_check.log", "summary.txt"]
    assert len(names) <= MAX_FILES
    summary = (tmp_path / "summary.txt").read_text()
    steps = re.findall(r"^(\S+)\s+(PASS|DONE|FAIL|SKIP|STOPPED|FOUND|NORUN|INCOMPL)\b", summary, re.M)
    assert [s for s, _ in steps] == RUN_STEPS[run], summary
    assert all(status in ("PASS", "DONE") for _, status in steps), summary
    with tarfile.open(tmp_path / "details.tar.gz") as tar:
        members = set(tar.getnames())
    assert "details/steps.txt" in members and "details/versions.txt" in members
    log = (tmp_path / "gpu_check.log").read_text()
    if run == 1:
        assert {"details/junit-smoke.xml", "details/junit-tests.xml"} <= members
        assert "-p select_cuda_tests --gpu-step smoke -m not slow" in log
        assert "-p select_cuda_tests --gpu-step tests -m not slow" in log
        assert "pip install --no-build-isolation --no-deps -e ." in log
        for gp in ("legacy", "lt"):
            assert (
                f"[dry-run] bench-{gp}" in log and f"--results-md {tmp_path}/details/RESULTS-{gp}.md" in log
            )
    else:
        assert "--gpu-step watch" in log
        assert "watch_bench.py --device cuda --model gpt2 --bf16" in log
        assert "training_guard_bench.py --device cuda --model gpt2 --bf16 --fused" in log
        assert "bash benchmarks/gpu/gpu_extra_checks.sh" in log
    results = (tmp_path / "RESULTS.md").read_text()
    section = results.split(f"<!-- BEGIN preset:gpu-check-run{run} -->")[1].split("<!-- END")[0]
    assert f"## GPU check, run {run}" in section and "- date: " in section
    assert f"- command: `bash benchmarks/gpu/gpu_check.sh --run {run} --dry-run`" in section
    assert "<!-- BEGIN preset:gpu -->" in results  # the rest of benchmarks/RESULTS.md is kept


@pytest.mark.slow
def test_more_files_than_come_back_fail_the_run(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"left-over-{i}.txt").write_text("x")
    result = dry_run(tmp_path, 2)
    assert result.returncode == 1
    assert "more than the 8 the device tool brings back" in result.stdout


def test_help_prints_the_plan_and_bad_arguments_are_refused() -> None:
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "BUDGET PLAN" in result.stdout and "set -u" not in result.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--run", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--run takes 1 or 2" in bad.stderr


# ---------------------------------------------------------------------------------------------
# Which step runs which test.
# ---------------------------------------------------------------------------------------------
def test_every_test_lands_in_at_most_one_step() -> None:
    cases = {
        (
            "tests/linear/test_gpu_smoke.py::test_cuda_half_and_double_forward_backward_match_f_linear[x]",
            True,
            False,
        ): "smoke",
        ("tests/building/test_libstdcxx.py::test_libstdcxx_so6_is_needed", False, False): "smoke",
        (
            "tests/building/test_libstdcxx.py::test_an_error_that_formats_integers_raises_in_a_fresh_process[cpu]",
            False,
            True,
        ): None,
        (
            "tests/building/test_libstdcxx.py::test_an_error_that_formats_integers_raises_in_a_fresh_process[cuda]",
            True,
            False,
        ): "smoke",
        (
            "tests/linear/test_gpu_smoke.py::test_cuda_scan_beyond_2_31_elements_contiguous",
            True,
            False,
        ): "tests",
        ("tests/linear/test_gemm_route.py::test_both_paths_match", True, False): "tests",
        ("tests/watch/test_watch_capture.py::test_x[cuda]", True, False): "watch",
        ("tests/watch/test_brand_new.py::test_y", True, False): "watch",  # a file watch adds later
        ("tests/watch/test_watch.py::test_cpu_only", False, False): None,
        (
            "tests/building/test_build_tooling.py::test_cuda_build_check_script",
            False,
            False,
        ): None,  # "cuda" in the name
    }
    for (nodeid, cuda, cpu_case), want in cases.items():
        assert sel.step_of(nodeid, cuda, cpu_case) == want, nodeid


def collect(step: str, files: list[str]) -> list[str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "select_cuda_tests",
            "--gpu-step",
            step,
        ]
        + ["-p", "no:cacheprovider", "-m", "not slow"]
        + files,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(GPU)},
    )
    assert result.returncode in (0, 5), result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_plugin_selects_by_skip_marker_and_device_parameter_never_twice() -> None:
    files = [
        "tests/linear/test_gpu_smoke.py",
        "tests/kernels/test_device_logic.py",
        "tests/linear/test_gemm_route.py",
        "tests/building/test_libstdcxx.py",
    ]
    got = {step: collect(step, files) for step in sel.STEPS}
    everything = [t for ts in got.values() for t in ts]
    assert len(everything) == len(set(everything))  # no test in two steps
    assert any("test_cuda_half_and_double" in t for t in got["smoke"])
    assert any("test_libstdcxx_so6_is_needed" in t for t in got["smoke"])
    assert not any("[cpu]" in t for t in got["smoke"])
    assert any("test_cuda_scan_beyond_2_31" in t for t in got["tests"])
    assert any("test_on_a_gpu_a_real_scan_launch" in t for t in got["tests"])
    assert any("test_a_gemm_split_in_m_n_and_k" in t and "cuda" in t for t in got["tests"])
    # CPU tests stay out, "cuda" in their name or not
    assert not any("cpu-legacy" in t or "test_the_walk_matches" in t for t in everything)
    assert got["watch"] == []


# ---------------------------------------------------------------------------------------------
# The RESULTS.md section's rows.
# ---------------------------------------------------------------------------------------------
def test_the_section_rows_say_pass_miss_or_not_run(tmp_path: Path) -> None:
    steps = tmp_path / "steps.txt"
    steps.write_text("env|DONE|1|x\nbuild|PASS|90|ok\nsmoke|PASS|20|5 passed\ntests|FAIL|80|1 failed\n")
    bench = tmp_path / "bench-lt"
    bench.mkdir()
    row = {"id": "gpu-fixed-async-host", "target": "t", "value": 3.1, "threshold": "<= 4.00"}
    (bench / "results.json").write_text(
        json.dumps({"targets": [{**row, "measured": "3.10", "status": "PASS", "detail": ""}]})
    )
    rows = gpu_results.section_targets(1, gpu_results.read_steps(steps), tmp_path)
    status = {r["id"]: r["status"] for r in rows}
    assert status == {
        "gpu-build": "PASS",
        "gpu-cuda-tests": "MISS",
        "gpu-fixed-async-host [lt]": "PASS",
    }
    (tmp_path / "watch-bench.log").write_text("...\nwatch(async) vs plain: 1.142x wall, 1.100x CPU time\n")
    (tmp_path / "guard-bench.log").write_text("ratio TrainingGuard / plain: wall 1.011x, CPU 1.0x\n")
    steps.write_text("watch-tests|PASS|30|ok\n")
    rows = gpu_results.section_targets(2, gpu_results.read_steps(steps), tmp_path)
    status = {r["id"]: (r["status"], r["measured"]) for r in rows}
    assert status == {
        "gpu-watch-cuda-tests": ("PASS", "green"),
        "gpu-watch-gpt2-bf16": ("MISS", "1.142"),
        "gpu-training-guard-gpt2-bf16": ("PASS", "1.011"),
        "gpu-memcheck": ("NOT RUN", "-"),
    }


@pytest.mark.slow
def test_the_small_memcheck_workload_runs_and_checks_its_results_on_the_cpu() -> None:
    """Run 2's memcheck workload (WORKLOAD_SIZE=small) is the same Python on any device: here it
    runs every path once on the CPU and compares each result with torch's."""
    result = subprocess.run(
        ["bash", str(GPU / "gpu_extra_checks.sh"), "--workload-only"],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "WORKLOAD_DEVICE": "cpu",
            "WORKLOAD_SIZE": "small",
            "CUBLAS_GUARD_EXT_TESTING": "1",  # the GEMMs on both paths, as gpu_check.sh runs it
        },
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checks = int(re.search(r"WORKLOAD OK: (\d+) checks on cpu", result.stdout).group(1))
    assert 30 <= checks < 100  # each path once, not every size (the full workload makes 142+)
