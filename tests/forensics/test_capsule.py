"""The failure capsule (cublas_guard_ext.capsule) and its replay (cg.replay, `replay` CLI).

Failures come from the fault hook: in this process through the `inject_fault` fixture, in a
fresh process through CUBLAS_GUARD_EXT_FAULT=site:code:times (read when the library loads).
Each capsule is written into the test's own folder (CUBLAS_GUARD_CAPSULE_DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg
from cublas_guard_ext import capsule, errors
from cublas_guard_ext.capsule import replaying

NAME = "enc.3.ffn"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    target = tmp_path / "capsules"
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_DIR", str(target))
    monkeypatch.delenv("CUBLAS_GUARD_CAPSULE", raising=False)
    monkeypatch.delenv("CUBLAS_GUARD_CAPSULE_MAX_BYTES", raising=False)
    monkeypatch.delenv("CUBLAS_GUARD_EXT_FAULT", raising=False)
    return target


def column_major(values: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
    return values.double().as_strided((rows, cols), (1, ld))


def recompute(data: dict) -> torch.Tensor:
    """alpha * op(A) op(B) + beta * C from a capsule's call and stored buffers (float64),
    as the column-major m x n matrix cuBLAS would have written."""
    call, ops = data["call"], data["gemm_operands"]
    m, n, k = call["m"], call["n"], call["k"]
    a = (
        column_major(ops["a"]["values"], k, m, call["lda"]).t()
        if call["transa"] == "T"
        else column_major(ops["a"]["values"], m, k, call["lda"])
    )
    b = (
        column_major(ops["b"]["values"], n, k, call["ldb"]).t()
        if call["transb"] == "T"
        else column_major(ops["b"]["values"], k, n, call["ldb"])
    )
    c = column_major(ops["c"]["values"], m, n, call["ldc"])
    return call["alpha"] * (a @ b) + call["beta"] * c


def failing_forward(inject_fault, status: int = 13, layer=None, x=None) -> tuple[cg.CublasError, tuple]:
    layer = layer if layer is not None else cg.SafeLinear(12, 5, name=NAME)
    x = x if x is not None else torch.randn(3, 12)
    inject_fault("gemm", status)
    with pytest.raises(cg.CublasError) as info:
        layer(x)
    return info.value, (x, layer.weight.detach(), layer.bias.detach())


def test_a_forward_failure_writes_a_capsule(folder, inject_fault) -> None:
    err, (x, w, b) = failing_forward(inject_fault)
    assert err.capsule is not None and os.path.dirname(err.capsule) == str(folder)
    assert (
        f"capsule: {err.capsule} (replay the call alone: python -m cublas_guard_ext replay "
        f"{err.capsule})" in str(err)
    )
    data = torch.load(err.capsule, weights_only=True)  # plain data: no code runs
    assert data["format"] == capsule.FORMAT and data["error_class"] == "CublasError"
    assert (data["status"], data["status_name"], data["layer"], data["phase"]) == (
        13,
        "CUBLAS_STATUS_EXECUTION_FAILED",
        NAME,
        "forward",
    )
    assert isinstance(data["call_number"], int) and data["call_number"] >= 1
    call = data["call"]
    for key in (
        "transa",
        "transb",
        "m",
        "n",
        "k",
        "lda",
        "ldb",
        "ldc",
        "alpha",
        "beta",
        "data_type",
        "compute_type",
        "math_mode",
    ):
        assert call[key] == err.fields[key], key
    assert (call["routine"], call["dtype"], call["source"]) == (err.api, "torch.float32", "recorded")
    assert (call["m"], call["n"], call["k"], call["beta"]) == (5, 3, 12, 1.0)
    # The buffers cuBLAS got, with their values: recomputing the call gives F.linear.
    assert data["values"] == "values"
    for name in "abc":
        entry = data["gemm_operands"][name]
        assert entry["dtype"] == "torch.float32" and entry["alignment"] >= 4
        assert entry["values"].dtype == torch.float32
    torch.testing.assert_close(
        recompute(data).t(), F.linear(x.double(), w.double(), b.double()), rtol=1e-12, atol=1e-12
    )
    # The user's tensors of the call, described.
    assert data["call_operands"]["input"]["shape"] == [3, 12]
    assert data["call_operands"]["weight"]["strides"] == [12, 1]
    assert set(data["call_operands"]) == {"input", "weight", "bias"}
    assert any("failing_forward" in line for line in data["python_stack"])
    env = data["environment"]
    assert env["torch"] == torch.__version__ and env["python"] == sys.version.split()[0]
    if torch.version.cuda is None:
        assert env["libraries"] == {"libcublas": "not loaded", "libcublasLt": "not loaded"}
        assert env["cublas_runtime_version"] == "not loaded"
    assert capsule.load(err.capsule)["call"] == call


@pytest.mark.parametrize("needs", ["grad_input", "grad_weight"])
def test_a_backward_failure_writes_a_capsule(folder, inject_fault, needs: str) -> None:
    """The operands of a backward GEMM exist only in C++: the capsule has them all the same."""
    layer = cg.SafeLinear(6, 4, name=NAME)
    x = torch.randn(7, 6, requires_grad=needs == "grad_input")
    layer.weight.requires_grad_(needs == "grad_weight")
    y = layer(x)
    g = torch.randn_like(y)
    inject_fault("gemm", 14)
    with pytest.raises(cg.CublasError) as info:
        y.backward(g)
    err = info.value
    assert err.purpose == needs and err.capsule and err.capsule in str(err)
    data = torch.load(err.capsule, weights_only=True)
    assert data["phase"] == needs and data["status"] == 14 and data["values"] == "values"
    expected = (
        g.double() @ layer.weight.detach().double()
        if needs == "grad_input"
        else g.double().t() @ x.detach().double()
    )
    torch.testing.assert_close(recompute(data).t(), expected, rtol=1e-12, atol=1e-12)
    names = {"grad_input": {"grad_output", "weight"}, "grad_weight": {"grad_output", "input"}}[needs]
    assert set(data["call_operands"]) == names
    assert data["call_operands"]["grad_output"]["shape"] == [7, 4]


@pytest.fixture
def uninitialised_is_nan():
    """Every at::empty comes filled with NaN (torch's deterministic mode fills uninitialised
    memory): whatever the capsule keeps of memory the call never wrote or read shows as NaN
    every time, not only when the allocator happens to hand back a NaN-filled block."""
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.isnan(torch.empty(8)).all()
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("phase", ["forward", "forward without bias", "grad_input", "grad_weight"])
def test_the_capsule_keeps_exactly_the_operands_the_gemm_read(
    folder, inject_fault, uninitialised_is_nan, phase: str
) -> None:
    """A, B (and C when beta != 0) are bitwise the tensors the GEMM read; C with beta = 0 is
    the output's fresh, uninitialised memory, which cuBLAS does not read: kept as zeros and
    marked unread, so recomputing the call gives the product, not NaN."""
    layer = cg.SafeLinear(6, 4, bias=phase != "forward without bias", name=NAME)
    x = torch.randn(7, 6, requires_grad=phase == "grad_input")
    layer.weight.requires_grad_(phase == "grad_weight")
    w, g = layer.weight.detach(), torch.randn(7, 4)
    y = None if phase.startswith("forward") else layer(x)
    inject_fault("gemm", 14)
    with pytest.raises(cg.CublasError) as info:
        if y is None:
            layer(x)
        else:
            y.backward(g)
    data = capsule.load(info.value.capsule)
    ops, beta = data["gemm_operands"], data["call"]["beta"]
    a, b, c, expected = {
        "forward": (w, x, layer.bias.detach().expand(7, 4) if layer.bias is not None else None, None),
        "grad_input": (w, g, None, g.double() @ w.double()),
        "grad_weight": (x, g, None, g.double().t() @ x.detach().double()),
    }[phase.split()[0]]
    if expected is None:
        expected = F.linear(x.double(), w.double(), None if c is None else layer.bias.double())
    assert beta == (0.0 if c is None else 1.0)
    assert torch.equal(ops["a"]["values"], a.detach().reshape(-1))
    assert torch.equal(ops["b"]["values"], b.detach().reshape(-1))
    torch.testing.assert_close(recompute(data).t(), expected, rtol=1e-12, atol=1e-12)
    if c is None:
        assert ops["c"]["read"] is False and ops["c"]["note"] == capsule.UNREAD_C
        assert torch.equal(ops["c"]["values"], torch.zeros(expected.numel()))
        assert ops["c"]["numel"] == expected.numel()
    else:
        assert "read" not in ops["c"] and torch.equal(ops["c"]["values"], c.reshape(-1))


def test_an_unread_c_is_kept_as_statistics_of_zeros(folder, inject_fault, uninitialised_is_nan, monkeypatch):
    """Over the size cap, the unread C's statistics are those of zeros, not of NaN garbage."""
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_MAX_BYTES", "100")
    layer = cg.SafeLinear(6, 4, bias=False, name=NAME)
    inject_fault("gemm", 14)
    with pytest.raises(cg.CublasError) as info:
        layer(torch.randn(7, 6))
    data = capsule.load(info.value.capsule)
    assert data["values"] == "statistics" and data["call"]["beta"] == 0.0
    stats = data["gemm_operands"]["c"]["statistics"]
    assert (stats["nan_count"], stats["min"], stats["max"]) == (0, 0.0, 0.0)
    assert stats["sha256"] == hashlib.sha256(bytes(4 * 28)).hexdigest()
    assert data["gemm_operands"]["c"]["read"] is False


def test_capture_off(folder, inject_fault, monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE", "0")
    err, _ = failing_forward(inject_fault)
    assert err.capsule is None and err.capsule_note is None
    assert "capsule" not in str(err)
    assert not folder.exists()


def test_an_unwritable_folder_leaves_the_error_intact(tmp_path, folder, inject_fault, monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE", "0")
    layer, x = cg.SafeLinear(12, 5, name=NAME), torch.randn(3, 12)
    plain, _ = failing_forward(inject_fault, layer=layer, x=x)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_DIR", str(blocker / "capsules"))
    monkeypatch.delenv("CUBLAS_GUARD_CAPSULE")
    err, _ = failing_forward(inject_fault, layer=layer, x=x)
    assert type(err) is type(plain) and err.fields.keys() == plain.fields.keys()
    assert (err.status, err.layer, err.purpose) == (plain.status, plain.layer, plain.purpose)
    assert err.capsule is None and err.capsule_note.startswith(("FileExistsError", "NotADirectoryError"))
    lines = str(err).splitlines()
    note = [line for line in lines if "capsule" in line]
    assert note == [f"  capsule: not written ({err.capsule_note})"]

    # The same message otherwise; the output (operand C) is a new allocation on each call,
    # so its alignment may differ between the two.
    def same(text_lines):
        return [re.sub(r"\d+-byte aligned", "N-byte aligned", line) for line in text_lines]

    assert same(line for line in lines if line not in note) == same(str(plain).splitlines())


def test_values_over_the_cap_are_kept_as_statistics(folder, inject_fault, monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_MAX_BYTES", "100")
    layer = cg.SafeLinear(12, 5, name=NAME, mode="off")  # off: the NaN/Inf reach the GEMM
    x = torch.randn(3, 12)
    x[1, 4], x[2, 0], x[0, 7] = float("nan"), float("inf"), float("-inf")
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        layer(x)
    data = torch.load(info.value.capsule, weights_only=True)
    assert data["values"] == "statistics" and data["values_total_bytes"] > 100
    ops = data["gemm_operands"]
    assert all("values" not in ops[name] for name in "abc")
    stats_b = ops["b"]["statistics"]  # B is the input
    assert (stats_b["nan_count"], stats_b["posinf_count"], stats_b["neginf_count"]) == (1, 1, 1)
    finite = x[torch.isfinite(x)]
    assert (stats_b["min"], stats_b["max"]) == (finite.min().item(), finite.max().item())
    assert stats_b["sha256"] == hashlib.sha256(bytes(x.contiguous().untyped_storage())).hexdigest()
    stats_a = ops["a"]["statistics"]
    assert (
        stats_a["sha256"]
        == hashlib.sha256(bytes(layer.weight.detach().clone().untyped_storage())).hexdigest()
    )
    assert stats_a["nan_count"] == 0


def test_only_the_newest_capsules_are_kept(folder, inject_fault, monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_KEEP", "3")
    paths = [failing_forward(inject_fault)[0].capsule for _ in range(5)]
    assert sorted(str(p) for p in folder.iterdir()) == sorted(paths[-3:])


def test_other_errors_write_no_capsule(folder) -> None:
    with pytest.raises(cg.ShapeMismatchError) as info:
        cg.SafeLinear(4, 2)(torch.randn(3, 5))
    assert info.value.capsule is None and "capsule" not in str(info.value)
    assert not folder.exists()


def _payload_error(kind: str, **fields) -> errors.GuardError:
    return errors.from_payload({"kind": kind, "layer": NAME, **fields})


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "grad_input", "grad_weight"])
def test_an_error_around_the_gemm_records_the_planned_call(folder, phase: str) -> None:
    """A PendingCudaError or CudaLaunchError is raised before the GEMM: the capsule holds the
    GEMM the guarded call was about to run, planned from its operands (here checked by
    recomputing it from the stored buffers)."""
    x, w, b, g = torch.randn(5, 3, 6), torch.randn(4, 6), torch.randn(4), torch.randn(5, 3, 4)
    operands = {
        "forward": {"input": x, "weight": w, "bias": b},
        "grad_input": {"grad_output": g, "weight": w},
        "grad_weight": {"grad_output": g, "input": x},
    }[phase]
    err = _payload_error(
        "pending_cuda",
        stage="before the guarded call",
        cuda_error="cudaErrorAssert",
        cuda_error_code=710,
        cuda_error_string="device-side assert triggered",
    )
    errors.attach_capsule(err, {"phase": phase, "call_number": 9, "operands": operands, "buffers": {}})
    data = capsule.load(err.capsule)
    assert data["call"]["source"] == "planned" and data["call_number"] == 9
    assert data["call"]["routine"] == "torch CPU addmm"
    x, w, b, g = x.double(), w.double(), b.double(), g.double()
    expected = {
        "forward": F.linear(x, w, b).reshape(15, 4),
        "grad_input": g.reshape(15, 4) @ w,
        "grad_weight": g.reshape(15, 4).t() @ x.reshape(15, 6),
    }[phase]
    torch.testing.assert_close(recompute(data).t(), expected, rtol=1e-12, atol=1e-12)
    assert "planned from its operands" in cg.replay(err.capsule)["verdict"]


@pytest.mark.slow
def test_unreadable_operands_replay_on_synthetic_values(folder) -> None:
    """In a broken CUDA context nothing on the device can be read: the capsule keeps the
    layout and says so, and the replay says it ran on synthetic values (meta tensors
    stand in for unreadable ones here)."""
    x, w = torch.empty(3, 6, device="meta"), torch.empty(4, 6, device="meta")
    err = _payload_error(
        "cuda_launch",
        kernel="scan",
        cuda_error="cudaErrorNoKernelImageForDevice",
        cuda_error_code=209,
        cuda_error_string="no kernel image",
    )
    errors.attach_capsule(
        err, {"phase": "forward", "call_number": 1, "operands": {"input": x, "weight": w}, "buffers": {}}
    )
    data = capsule.load(err.capsule)
    assert data["values"] == "unreadable"
    assert all("unreadable" in data["gemm_operands"][n] for n in "abc")
    assert data["gemm_operands"]["a"]["numel"] == 24
    result = cg.replay(err.capsule)
    assert "synthetic values" in result["verdict"]


def _fresh_env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.mark.slow
def test_replay_reproduced_with_the_fault_and_not_without(folder, inject_fault, monkeypatch) -> None:
    err, _ = failing_forward(inject_fault)
    monkeypatch.setenv("CUBLAS_GUARD_EXT_FAULT", "gemm:13:1")  # the replay's process fails once
    result = cg.replay(err.capsule)
    assert result["reproduced"] is True and result["ran"] is True
    by_name = {v["name"]: v for v in result["variants"]}
    assert [v["name"] for v in result["variants"]] == list(replaying.VARIANTS)
    assert by_name["as recorded"]["status"] == "failed"
    assert "status 13 (CUBLAS_STATUS_EXECUTION_FAILED)" in by_name["as recorded"]["detail"]
    assert by_name["contiguous copies"]["status"] == "passed"  # the one fault was used up
    for name in ("TF32 flipped", "other routine", "cublasLt", "no workspace", "_64 API"):
        assert by_name[name]["status"] == "not applicable" and by_name[name]["detail"], name  # a CPU call
    assert result["verdict"].startswith("REPRODUCED: the GEMM fails by itself")
    assert "bug report (paste as is):" in result["verdict"] and "m=5 n=3 k=12" in result["verdict"]
    assert result["call"]["m"] == 5

    monkeypatch.delenv("CUBLAS_GUARD_EXT_FAULT")
    result = cg.replay(err.capsule)
    assert result["reproduced"] is False
    first = result["variants"][0]
    assert first["name"] == "as recorded" and first["status"] == "passed"
    error = float(first["detail"].rsplit(" ", 1)[-1])
    assert error < 1e-6, first  # float32 GEMM vs the float64 reference
    assert result["verdict"].startswith("NOT REPRODUCED")
    assert "CUDA_LAUNCH_BLOCKING=1" in result["verdict"] and "compute-sanitizer" in result["verdict"]
    assert "watch(model)" in result["verdict"]


@pytest.mark.slow
def test_replay_cli(folder, inject_fault) -> None:
    err, _ = failing_forward(inject_fault)
    out = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "replay", err.capsule, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_fresh_env(CUBLAS_GUARD_EXT_FAULT="gemm:7:100"),
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"reproduced", "verdict", "variants", "call"} <= set(report)
    assert report["reproduced"] is True
    assert all(set(v) >= {"name", "status"} for v in report["variants"])
    # With 100 faults armed the contiguous copies fail too.
    assert {v["name"]: v["status"] for v in report["variants"]}["contiguous copies"] == "failed"
    text = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "replay", err.capsule],
        capture_output=True,
        text=True,
        timeout=600,
        env=_fresh_env(),
    )
    assert text.returncode == 0 and "NOT REPRODUCED" in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "replay", str(folder / "none.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "cannot read" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,expect",
    [
        ("gemm:7:1", "CUBLAS_STATUS_INVALID_VALUE"),
        ("launch:209:1,gemm:14:2", "CUBLAS_STATUS_INTERNAL_ERROR"),
    ],
)
def test_a_fresh_process_takes_its_fault_from_the_environment(spec: str, expect: str) -> None:
    code = "import torch, cublas_guard_ext as cg; cg.SafeLinear(4, 2)(torch.randn(3, 4))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=_fresh_env(CUBLAS_GUARD_EXT_FAULT=spec, CUBLAS_GUARD_CAPSULE="0"),
    )
    assert out.returncode != 0 and expect in out.stderr and "CublasError" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,testing,message",
    [
        ("gemm:13", "1", "ignoring CUBLAS_GUARD_EXT_FAULT entry 'gemm:13': expected site:code:times"),
        ("nowhere:13:1", "1", "unknown fault site 'nowhere'"),
        ("gemm:x:1", "1", "ignoring CUBLAS_GUARD_EXT_FAULT entry 'gemm:x:1'"),
        ("gemm:13:1", None, "CUBLAS_GUARD_EXT_FAULT is ignored without CUBLAS_GUARD_EXT_TESTING=1"),
    ],
)
def test_a_bad_environment_fault_is_named_and_ignored(spec: str, testing, message: str) -> None:
    code = "import torch, cublas_guard_ext as cg; print(cg.SafeLinear(4, 2)(torch.randn(3, 4)).shape)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=_fresh_env(CUBLAS_GUARD_EXT_FAULT=spec, CUBLAS_GUARD_EXT_TESTING=testing),
    )
    assert out.returncode == 0, out.stderr
    assert message in out.stderr and "torch.Size([3, 2])" in out.stdout


# --------------------------------------------------------------------------
# On a GPU (skipped here): the CUDA replay kernel's variants, and a real failure
# --------------------------------------------------------------------------
from helpers import requires_cuda  # noqa: E402


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_replay_runs_every_variant(folder, inject_fault, monkeypatch, dtype) -> None:
    layer = cg.SafeLinear(64, 32, name=NAME, device="cuda", dtype=dtype)
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        layer(torch.randn(16, 64, device="cuda", dtype=dtype))
    data = capsule.load(info.value.capsule)
    assert data["values"] == "values" and data["environment"]["gpu"]["compute_capability"]
    assert data["environment"]["libraries"]["libcublas"] != "not loaded"
    monkeypatch.setenv("CUBLAS_GUARD_EXT_FAULT", "gemm:13:1")
    result = cg.replay(info.value.capsule)
    by_name = {v["name"]: v for v in result["variants"]}
    assert result["reproduced"] and by_name["as recorded"]["status"] == "failed"
    expected_na = {"TF32 flipped"} if dtype != torch.float32 else set()
    for name in set(replaying.VARIANTS) - {"as recorded"}:
        want = "not applicable" if name in expected_na else "passed"
        assert by_name[name]["status"] == want, by_name[name]


@requires_cuda
def test_a_real_earlier_kernel_failure_replays_as_not_reproduced(tmp_path) -> None:
    """An out-of-range nn.Embedding index before a SafeLinear (a device-side assert: the
    context is broken, so in a process of its own): a PendingCudaError with a capsule of the
    GEMM the layer was about to run; replayed alone it passes: NOT REPRODUCED."""
    script = (
        "import torch, cublas_guard_ext as cg\n"
        "emb = torch.nn.Embedding(10, 64).cuda(); lin = cg.SafeLinear(64, 32, name='head').cuda()\n"
        "try:\n"
        "    lin(emb(torch.tensor([3, 12], device='cuda'))); torch.cuda.synchronize()\n"
        "except cg.PendingCudaError as err:\n"
        "    print('CAPSULE', err.capsule)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=_fresh_env(CUBLAS_GUARD_CAPSULE_DIR=str(tmp_path), CUBLAS_GUARD_EXT_FAULT=None),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("CAPSULE ")]
    assert lines, out.stdout + out.stderr
    path = lines[0].split(" ", 1)[1]
    data = capsule.load(path)
    assert data["error_class"] == "PendingCudaError" and data["call"]["source"] == "planned"
    assert data["call"]["routine"] == "cublasSgemm" and data["layer"] == "head"
    result = cg.replay(path)
    assert result["ran"] and result["reproduced"] is False, result["verdict"]
    assert result["verdict"].startswith("note:") and "NOT REPRODUCED" in result["verdict"]
    print("\n" + replaying.render(result))


@torch.library.custom_op("capsuletest::failing_mm", mutates_args=())
def _failing_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, "
        "opa, opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
    )


@_failing_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


@pytest.mark.slow
def test_watch_reraise_writes_a_capsule(folder) -> None:
    """watch() re-raises another op's cuBLAS failure typed: it gets a capsule too (no guarded
    GEMM call in it: the replay says there is nothing of ours to run)."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(cg.CublasError) as info:
        with cg.watch(model):
            _failing_mm(torch.randn(2, 4), torch.randn(4, 3))
    err = info.value
    assert err.capsule and err.capsule in str(err) and err.op == "capsuletest.failing_mm.default"
    data = capsule.load(err.capsule)
    assert data["error_class"] == "CublasError" and data["status_name"] == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert data["call"] is None and data["values"] == "none (no GEMM call)"
    result = cg.replay(err.capsule)
    assert result["ran"] is False and all(v["status"] == "not run" for v in result["variants"])
    assert "holds no GEMM call" in result["variants"][0]["detail"]
