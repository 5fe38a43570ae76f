"""torchao's Float8Linear and direct FP8 calls under ``python -m cublas_guard_ext run``: guarded
without an edit of the script (a subprocess: slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.run_scripts import run_script, write

pytest.importorskip("torchao")

SCRIPT = """
import torch
from torch import nn
from torchao.float8 import convert_to_float8_training

torch.manual_seed(0)
model = convert_to_float8_training(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(torch.bfloat16))
x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
model(x).float().sum().backward()  # clean: runs
print("clean step ok", type(model[0]).__name__, model[0].guard_name)
x = torch.randn(8, 64)
x[1, 2] = float("inf")
print("silent cast", x.to(torch.float8_e4m3fn)[1, 2].float().item()) if "{cast}" == "1" else None
bad = torch.randn(8, 64, dtype=torch.bfloat16)
bad[1, 2] = float("inf")
model(bad)
"""


@pytest.mark.slow
def test_run_guards_float8_linear_without_an_edit(tmp_path: Path) -> None:
    result = run_script(tmp_path, write(tmp_path, "train.py", SCRIPT.replace("{cast}", "0")))
    assert result.returncode != 0
    assert "clean step ok GuardedFloat8Linear 0" in result.stdout, result.stderr
    assert "Fp8NonFiniteError" in result.stderr
    assert "layer '0', forward GEMM, operand input (e4m3fn, tensorwise): 0 NaN, 1 +Inf" in result.stderr


@pytest.mark.slow
def test_run_names_the_cast_that_swallows_an_inf(tmp_path: Path) -> None:
    result = run_script(tmp_path, write(tmp_path, "train.py", SCRIPT.replace("{cast}", "1")))
    assert "silent cast" not in result.stdout
    assert "cast, operand input (e4m3fn): 0 NaN, 1 +Inf, 0 -Inf of 512 values" in result.stderr, result.stderr
