"""Writes the two files tests/package/test_saved_files.py loads: a model saved whole with
``torch.save(model)`` (SafeLinear, and GPT-2's Conv1D swapped by replace_linear) and a failure
capsule, both made by the flat layout of the package (every module beside ``__init__``), so
that the tests prove what was saved before the package moved into folders still loads.

Run from the repository root, with the native library built (CPU is enough):
    CUBLAS_GUARD_EXT_TESTING=1 python tests/package/data/make_saved_files.py
Rerunning it writes files of the layout it runs on: keep the committed ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import cublas_guard_ext as cg

HERE = Path(__file__).resolve().parent


def main() -> None:
    torch.manual_seed(0)
    # nn.Sequential, not a class of this script: the file must load without it.
    model = nn.Sequential(nn.Linear(4, 3), Conv1D(5, 3))  # Conv1D: GPT-2's layer, weight (in, out)
    cg.replace_linear(model, mode="sync")
    model.append(cg.SafeLinear(5, 2, name="extra", mode="async"))
    assert [type(m).__name__ for m in model] == ["SafeLinear", "SafeConv1D", "SafeLinear"]
    torch.save(model, HERE / "saved_model.pt")
    x = torch.randn(2, 4)
    torch.save({"x": x, "y": model(x).detach()}, HERE / "saved_model_io.pt")

    os.environ["CUBLAS_GUARD_CAPSULE_DIR"] = str(HERE / "capsule_out")
    layer = cg.SafeLinear(6, 3, name="enc.0.ffn")
    torch.ops.cublas_guard_testing.set_fault("gemm", 13, 1)
    try:
        layer(torch.randn(2, 6))
    except cg.CublasError as err:
        Path(err.capsule).replace(HERE / "saved_capsule.cgcapsule.pt")
    (HERE / "capsule_out").rmdir()


if __name__ == "__main__":
    main()
