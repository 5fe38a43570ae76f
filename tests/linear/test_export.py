"""SafeLinear and SafeConv1D exported to ONNX (the dynamo exporter and the TorchScript-based
one) as a plain linear, with a one-time warning that the guard's checks are not exported;
checked with onnx.checker on a temporary file and run with onnxruntime. Where errors are not
typed (TorchScript), the test pins what the docs say."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.guarded_linear import ops

onnx = pytest.importorskip("onnx")


class Block(nn.Module):
    """A guarded MLP and, when transformers is there, a GPT-2 style Conv1D projection."""

    def __init__(self, conv1d: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.proj = None
        if conv1d:
            from transformers.pytorch_utils import Conv1D

            self.proj = Conv1D(6, 8)

    def forward(self, x):
        y = self.mlp(x)
        return self.proj(y) if self.proj is not None else y


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def export(model, x, path, dynamo: bool) -> list[warnings.WarningMessage]:
    ops._onnx_warned = False  # the warning is once per process: each test sees its own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dynamo:
            pytest.importorskip("onnxscript")
            torch.onnx.export(model, (x,), str(path), dynamo=True)
        else:
            torch.onnx.export(model, (x,), str(path), dynamo=False)
    return [w for w in caught if "cublas_guard_ext" in str(w.message)]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_guarded_layers_export_to_onnx_as_plain_linears(tmp_path, dynamo):
    torch.manual_seed(0)
    model = cg.replace_linear(Block(conv1d=has_transformers())).eval()
    assert isinstance(model.mlp[0], cg.SafeLinear)
    x = torch.randn(3, 8)
    path = tmp_path / "model.onnx"
    ours = export(model, x, path, dynamo)
    assert [str(w.message) for w in ours] == [ops.ONNX_EXPORT_WARNING]  # once, not once per layer
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    kinds = {n.op_type for n in proto.graph.node}
    assert kinds & {"Gemm", "MatMul"} and not any("cublas" in n.domain for n in proto.graph.node)
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(x), rtol=1e-5, atol=1e-5)


def test_the_warning_is_given_once_per_process(tmp_path):
    model = cg.replace_linear(nn.Sequential(nn.Linear(4, 2))).eval()
    first = export(model, torch.randn(2, 4), tmp_path / "a.onnx", dynamo=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.onnx.export(model, (torch.randn(2, 4),), str(tmp_path / "b.onnx"), dynamo=False)
    assert len(first) == 1 and not [w for w in caught if "cublas_guard_ext" in str(w.message)]


def test_outside_an_export_the_guard_still_checks_and_torch_export_keeps_the_op():
    model = cg.replace_linear(nn.Sequential(nn.Linear(4, 2))).eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,))
    assert any("cublas_guard" in str(n.target) for n in program.graph.nodes)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(cg.NonFiniteInputError):
        model(bad)


def test_torchscript_errors_arrive_as_runtime_error_carrying_the_guards_message():
    # What docs/guarantees.md says: TorchScript's interpreter rethrows every error as
    # torch.jit.Error (a RuntimeError) with the message text only; the class and fields are
    # lost there (eager, torch.compile and torch.export keep them).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(cg.SafeLinear(4, 3, name="lin"))
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    with pytest.raises(RuntimeError) as info:
        scripted(x)
    assert not isinstance(info.value, cg.GuardError)
    assert "layer 'lin': input has 1 NaN, 0 +Inf, 0 -Inf" in str(info.value)
