"""What was saved by the flat layout of the package still loads: a model saved whole with
``torch.save(model)`` (its pickle names ``cublas_guard_ext.nn``) and a failure capsule.

The files in data/ were written by data/make_saved_files.py when every module of the package
lay beside ``__init__`` (nn.py, capsule.py, ...); they are kept as they are.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

import cublas_guard_ext as cg

DATA = Path(__file__).resolve().parent / "data"
MODEL = DATA / "saved_model.pt"
CAPSULE = DATA / "saved_capsule.cgcapsule.pt"


def test_the_saved_model_names_the_flat_module_path() -> None:
    with zipfile.ZipFile(MODEL) as archive:
        pickle = next(archive.read(n) for n in archive.namelist() if n.endswith("data.pkl"))
    assert b"cublas_guard_ext.nn\nSafeLinear" in pickle
    assert b"cublas_guard_ext.nn\n_SafeConv1DOverTransformers" in pickle


def test_a_model_saved_whole_loads_and_computes_the_same() -> None:
    # The fixture holds GPT-2's Conv1D swap: unpickling it imports transformers.
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = torch.load(MODEL, weights_only=False)
    assert [type(m) for m in model[::2]] == [cg.SafeLinear, cg.SafeLinear]

    # SafeConv1D's class over transformers' Conv1D, made on first use, found by the unpickler
    assert isinstance(model[1], cg.SafeConv1D) and isinstance(model[1], Conv1D)
    assert [m.mode for m in model] == ["sync", "sync", "async"]
    assert model[2].guard_name == "extra"
    saved = torch.load(DATA / "saved_model_io.pt", weights_only=True)
    torch.testing.assert_close(model(saved["x"]), saved["y"], rtol=0, atol=0)
    # Still guarded: a NaN input is refused by the loaded layer, as by a new one.
    with pytest.raises(cg.NonFiniteInputError):
        model(torch.full((2, 4), float("nan")))


def test_a_saved_capsule_reads() -> None:
    data = cg.capsule.load(CAPSULE)
    assert data["format"] == cg.capsule.FORMAT and data["error_class"] == "CublasError"
    assert data["layer"] == "enc.0.ffn" and data["status"] == 13
    assert {"a", "b", "c"} <= set(data["gemm_operands"])


@pytest.mark.slow
def test_a_saved_capsule_replays(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_GUARD_EXT_FAULT", raising=False)
    result = cg.replay(str(CAPSULE))
    assert result["ran"] is True and result["reproduced"] is False  # no fault armed this time
    assert result["call"]["m"] == 3 and result["verdict"].startswith("NOT REPRODUCED")
