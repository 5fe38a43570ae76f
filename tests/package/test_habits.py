"""What a user notices before using anything: the import adds no compiler (no torch._dynamo,
no torch.onnx), the package is typed (py.typed), ``--version`` answers, reprs are as
documented, and the lazy Dynamo markers still mean what Dynamo's own decorator sets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.guarded_linear import modes, ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_import_loads_neither_dynamo_nor_onnx_nor_transformers():
    code = (
        "import sys, torch; before = set(sys.modules); import cublas_guard_ext; "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'torch.onnx', 'transformers', "
        "'pytorch_lightning') if m in sys.modules and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_lazy_dynamo_markers_are_what_assume_constant_result_sets():
    import torch._dynamo

    def probe():
        return None

    marked = torch._dynamo.assume_constant_result(probe)
    added = {k: v for k, v in vars(marked).items()}
    assert added == {"_dynamo_marked_constant": True}
    for fn in (modes._current_when_traced, ops._onnx_exporting):
        assert {k: getattr(fn, k, None) for k in added} == added, fn


@pytest.mark.locked
def test_a_compiled_optimizer_step_still_tells_the_parameter_cache():
    model = cg.replace_linear(nn.Sequential(nn.Linear(4, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()

    @torch.compile(backend="aot_eager")
    def step():
        optimizer.step()

    generations = []
    for _ in range(3):
        step()
        generations.append(torch.ops.cublas_guard_testing.clean_cache_stats.default()[2])
    assert generations[1] == generations[0] + 1 and generations[2] == generations[1] + 1


def test_py_typed_is_shipped_as_package_data():
    assert (ROOT / "cublas_guard_ext" / "py.typed").is_file()
    tomllib = pytest.importorskip(
        "tomllib", reason="Python >= 3.11 reads TOML (the version matrix runs 3.10)"
    )
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["cublas_guard_ext"]


@pytest.mark.slow
def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"cublas_guard_ext {cg.__version__}"


def test_safelinear_repr_is_linears_under_its_own_name_plus_its_options():
    assert repr(cg.SafeLinear(3, 2)) == repr(nn.Linear(3, 2)).replace("Linear(", "SafeLinear(", 1)
    assert repr(cg.SafeLinear(3, 2, bias=False, mode="async", scan_grad=True)) == (
        "SafeLinear(in_features=3, out_features=2, bias=False, mode='async', scan_grad=True)"
    )
    assert "repr is nn.Linear's under its own class name" in " ".join(
        cg.SafeLinear.__doc__.replace("``", "").split()
    )


def test_training_guard_doc_has_each_section_once():
    text = (ROOT / "docs" / "training-guard.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert len(headings) == len(set(headings)), headings
    assert headings.count("## Costs") == 1
