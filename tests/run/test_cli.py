"""The command-line tools a new user runs first: the demo (under the async guard
mode) and the quick bench's noise handling."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from cublas_guard_ext.tools import bench


# ---------------------------------------------------------------------------
# bench: its own noise
# ---------------------------------------------------------------------------
def test_a_row_reports_its_spread_and_whether_it_is_noise() -> None:
    clear = bench.Row("clear", 10.0, 13.0, (1.28, 1.30, 1.33))
    assert clear.spread() == pytest.approx(0.025)
    assert not clear.within_noise()
    flat = bench.Row("flat", 10.0, 10.3, (0.97, 1.03, 1.08))  # 3% effect, 5.5% spread
    assert flat.within_noise()
    # A loaded machine: one round says 0.12x, the others disagree: noise, not a speedup.
    loaded = bench.Row("loaded", 10.0, 9.0, (0.12, 0.9, 1.1))
    assert loaded.within_noise()
    assert math.isnan(bench.Row("one round", 10.0, 12.0, (1.2,)).spread())
    assert bench.Row("one round", 10.0, 12.0, (1.2,)).within_noise()  # unknown noise: not reported


def test_speedup_rows_use_the_inverse_ratio() -> None:
    row = bench.Row("scan", 20.0, 10.0, (0.5, 0.45, 0.55))
    assert row.value(speedup=True) == pytest.approx(2.0)
    assert row.spread(speedup=True) == pytest.approx((1 / 0.45 - 1 / 0.55) / 2)
    assert not row.within_noise(speedup=True)


def test_the_table_withholds_noisy_ratios() -> None:
    rows = [
        bench.Row("sync", 10.0, 13.0, (1.28, 1.30, 1.33)),
        bench.Row("off", 10.0, 10.3, (0.97, 1.03, 1.08)),
    ]
    lines = bench.format_table(rows, "nn.Linear", "SafeLinear").splitlines()
    assert lines[0].split() == ["case", "nn.Linear", "SafeLinear", "ratio", "noise"]
    assert "1.30x" in lines[1] and lines[1].endswith("+-0.03")
    assert "~" in lines[2] and "x" not in lines[2].split("us")[-1] and lines[2].endswith("+-0.06")


def test_row_from_rounds_pairs_each_round() -> None:
    row = bench._row("r", [1e-6, 2e-6, 1e-6], [2e-6, 2e-6, 1.5e-6])
    assert row.ratios == pytest.approx((2.0, 1.0, 1.5))
    assert row.baseline_us == pytest.approx(1.0) and row.guarded_us == pytest.approx(2.0)


@pytest.mark.slow
def test_quick_bench_explains_its_columns_and_noise() -> None:
    import torch

    text = bench.quick(torch.device("cpu"))
    assert "noise = half the range" in text and "ratio = SafeLinear / nn.Linear" in text
    table = [line for line in text.splitlines() if line.startswith("forward ")]
    assert len(table) == 6
    for line in table:
        # the noise may pass 10 on a loaded machine (+-18.86 seen in CI): any width
        assert re.search(r"(\d+\.\d\dx|~)\s+\+-\d+\.\d\d$", line), line
    assert re.search(r"scan of 16,777,216 float32 with its decision: [\d.]+ GB/s", text)


# ---------------------------------------------------------------------------
# demo: each section reports what it caught itself
# ---------------------------------------------------------------------------
def _sections(stdout: str) -> dict[str, str]:
    parts = re.split(r"^--- (.+)$", stdout, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_demo_sections_catch_their_own_errors(mode: str) -> None:
    env = {**os.environ, "CUBLAS_GUARD_MODE": mode}
    result = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "demo", "--steps", "3", "--no-bench"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"guard mode: {mode}" in result.stdout
    sections = _sections(result.stdout)
    expected = {
        "features with a NaN and an +Inf": "NonFiniteInputError",
        "features of the wrong width": "ShapeMismatchError",
        "fp16 features into a float32 model": "DTypeError",
        "a weight that diverged to -Inf": "NonFiniteInputError",
        "CUBLAS_STATUS_EXECUTION_FAILED": "CublasError",
        # watch() on all-MiniLM-L6-v2: the producing op, forward and backward
        "a planted log of a negative number": "NonFiniteOutputError",
        "a planted sqrt at 0": "NonFiniteOutputError",
    }
    for prefix, error in expected.items():
        label = next(k for k in sections if k.startswith(prefix))
        body = sections[label]
        caught = re.findall(r"^\[caught in this section: (\w+), (.+)\]$", body, flags=re.M)
        assert [c[0] for c in caught] == [error], (label, body)
        # Only one error per section: nothing left over from the section before.
        assert len(re.findall(r"^\w+Error: ", body, flags=re.M)) == 1, (label, body)
    nan = next(v for k, v in sections.items() if k.startswith("features with a NaN"))
    weight = next(v for k, v in sections.items() if k.startswith("a weight that diverged"))
    if mode == "async":
        # encoder.0's finding is raised by the next guarded layer of the same forward; the
        # head's (the last layer) only by the check at the end of its own section.
        assert "recorded asynchronously" in nan and "recorded asynchronously" in weight
        assert "check() at the end of this section (async mode)" in weight
    else:
        assert "raised during this section's call" in nan and "raised during this section's call" in weight
        assert "asynchronously" not in nan + weight
    # all-MiniLM-L6-v2 when sentence-transformers is installed (make's venv), else a small
    # nn.TransformerEncoder: the planted log is named by op and module either way.
    from cublas_guard_ext.tools import _minilm

    module = "0.model.encoder.layer.3.intermediate" if _minilm.available() else ""
    assert re.search(
        r"aten\.log\.default in module '[^']*" + re.escape(module) + r"[^']*' \(forward\)", result.stdout
    ), result.stdout
    assert "(backward)" in sections[next(k for k in sections if k.startswith("a planted sqrt"))]
    assert "the guard caught 7 bad inputs" in result.stdout
