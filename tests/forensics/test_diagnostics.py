"""The doctor, the environment checks, the memory and version parts of errors,
and the fp16/bf16 cast policy."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg
from cublas_guard_ext import errors
from cublas_guard_ext._native.machine import facts, libraries
from cublas_guard_ext.tools import doctor

from helpers import assert_matches
from helpers.doctor_env import gpu_env

STATUSES = {"OK", "WARN", "FAIL", "SKIP"}


def run_doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_doctor_json_is_valid_and_complete() -> None:
    result = run_doctor("--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"summary", "checks", "environment", "next_steps"}
    statuses = [c["status"] for c in report["checks"]]
    assert report["summary"] == {
        "failed": statuses.count("FAIL"),
        "warnings": statuses.count("WARN"),
        "skipped": statuses.count("SKIP"),
        "ok": statuses.count("OK"),
    }
    assert sum(report["summary"].values()) == len(statuses)
    names = [c["name"] for c in report["checks"]]
    for item in ("extension build", "TF32", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG"):
        assert item in names
    # the GPU checklist: versions, arch, memory; unknowable without a GPU -> SKIP
    if not torch.cuda.is_available():
        for item in ("driver vs runtime", "GPU arch vs torch", "GPU memory", "live cuBLAS probe"):
            check = next(c for c in report["checks"] if c["name"] == item)
            assert check["status"] == "SKIP" and "could not check" in check["reason"]
    for check in report["checks"]:
        assert set(check) == {"name", "status", "reason", "fix"}
        assert check["status"] in STATUSES and check["reason"]
    env = report["environment"]
    for key in ("torch", "torch_cuda", "torch_arch_list", "tf32", "env", "extension", "libraries", "devices"):
        assert key in env
    assert env["extension"]["built_with_torch"].split("+")[0] == torch.__version__.split("+")[0]


@pytest.mark.slow
def test_doctor_text_output() -> None:
    result = run_doctor()
    assert result.returncode == 0, result.stderr
    assert "cublas_guard_ext doctor" in result.stdout
    lines = result.stdout.splitlines()
    summary = next(line for line in lines if " failed, " in line)
    assert summary.startswith("0 failed") and summary.endswith(" ok")
    # The report ends with what to run next, ready to paste.
    assert "Next, ready to paste:" in lines[lines.index(summary) + 2]
    tf32 = next(line for line in result.stdout.splitlines() if "] TF32" in line)
    if torch.version.cuda is None:  # a CPU-only torch has no TF32 GEMMs to report on
        assert tf32.startswith("[skip]") and "not applicable" in tf32, tf32
    else:
        assert tf32.startswith(("[ok  ]", "[WARN]")), tf32


def test_cpu_only_torch_reports_tf32_and_launch_blocking_not_applicable() -> None:
    env = gpu_env(torch_cuda=None, cuda_available=False, devices=[])
    env["env"]["CUDA_LAUNCH_BLOCKING"] = "1"
    items = doctor.checks(env, probe=False)
    for name in ("TF32", "CUDA_LAUNCH_BLOCKING"):
        check = next(c for c in items if c.name == name)
        assert check.status == "SKIP" and check.reason.startswith("not applicable"), check


@pytest.mark.parametrize("blocking", [None, "1", "0"])
@pytest.mark.parametrize("tf32", [False, True])
def test_no_ok_row_carries_a_fix(blocking, tf32, monkeypatch) -> None:
    env = gpu_env(
        **{
            "tf32": {
                "torch.backends.cuda.matmul.allow_tf32": tf32,
                "torch.get_float32_matmul_precision()": "highest",
            }
        }
    )
    env["env"]["CUDA_LAUNCH_BLOCKING"] = blocking
    for environment in (env, gpu_env(torch_cuda=None, cuda_available=False, devices=[])):
        items = doctor.checks(environment, probe=False)
        assert [c for c in items if c.status == "OK" and c.fix] == []
    launch = next(c for c in doctor.checks(env, probe=False) if c.name == "CUDA_LAUNCH_BLOCKING")
    assert launch.status == "OK" and not launch.fix
    if blocking != "1":
        assert "rerun with CUDA_LAUNCH_BLOCKING=1" in launch.reason


@pytest.mark.parametrize(
    "value,status", [(None, "OK"), ("async", "OK"), (" Off ", "OK"), ("asnyc", "FAIL"), ("1", "FAIL")]
)
def test_the_guard_mode_variable_is_checked(value, status, monkeypatch) -> None:
    if value is None:
        monkeypatch.delenv("CUBLAS_GUARD_MODE", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_GUARD_MODE", value)
    check = next(c for c in doctor.checks(gpu_env(), probe=False) if c.name == "CUBLAS_GUARD_MODE")
    assert check.status == status, check
    if status == "FAIL":
        assert f"{value!r} is not a mode" in check.reason and "raises ValueError" in check.reason
        assert check.fix == "unset it or set one of async, off, sync"


@pytest.mark.slow
def test_doctor_fails_on_an_invalid_guard_mode() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUBLAS_GUARD_MODE": "asnyc"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    check = next(c for c in report["checks"] if c["name"] == "CUBLAS_GUARD_MODE")
    assert check["status"] == "FAIL" and report["summary"]["failed"] >= 1
    # ...and it is right: a SafeLinear without its own mode does raise with that setting.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, cublas_guard_ext as cg; cg.SafeLinear(4, 2)(torch.randn(3, 4))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUBLAS_GUARD_MODE": "asnyc"},
    )
    assert probe.returncode != 0 and "ValueError" in probe.stderr


def status_of(items, prefix: str) -> str:
    return next(c.status for c in items if c.name.startswith(prefix))


def test_healthy_gpu_environment_passes() -> None:
    items = doctor.checks(gpu_env(), probe=False)
    assert all(c.status in ("OK", "WARN") for c in items), [c for c in items if c.status == "FAIL"]
    assert status_of(items, "GPU arch vs torch") == "OK"
    assert status_of(items, "loaded libraries") == "OK" and status_of(items, "known-bad builds") == "OK"


@pytest.mark.parametrize(
    "changes,item,status,text",
    [
        ({"devices.0.compute_capability": "12.0"}, "GPU arch vs torch", "FAIL", "sm_120 is not in"),
        ({"torch_arch_list": ["sm_80", "compute_80"]}, "GPU arch vs torch", "WARN", "PTX"),
        ({"extension.built_archs": "800"}, "GPU arch vs extension", "FAIL", "TORCH_CUDA_ARCH_LIST=9.0"),
        ({"extension.driver_version": 12020}, "driver vs runtime", "FAIL", "driver supports CUDA 12.2"),
        ({"devices.0.free_memory": 10 << 20}, "GPU memory", "FAIL", "0.01 GiB free"),
        ({"devices.0.free_memory": 2 << 30}, "GPU memory", "WARN", "2.00 GiB free"),
        (
            {
                "cuda_libraries.conflicts": libraries.conflicts(
                    {
                        "libcublas": ["/a/libcublas.so.13", "/b/libcublas.so.13"],
                        "libcublasLt": ["/a/libcublasLt.so.13"],
                    },
                    ["/b"],
                    lambda path: None,
                )
            },
            "loaded libraries: libcublas mapped twice",
            "FAIL",
            "mapped twice",
        ),
        (
            {
                "cuda_libraries.conflicts": libraries.conflicts(
                    {"libcublas": ["/a/libcublas.so.13"], "libcublasLt": ["/b/libcublasLt.so.13"]},
                    ["/b"],
                    lambda path: None,
                )
            },
            "loaded libraries: libcublas and libcublasLt folders",
            "FAIL",
            "LD_LIBRARY_PATH's entry /b",
        ),
        (
            {
                "devices.0.compute_capability": "10.0",
                "torch_arch_list": ["sm_90", "sm_100"],
                "cuda_libraries.loaded.libcublas.0.version": "13.0.2",
            },
            "known-bad builds",
            "FAIL",
            "#178333",
        ),
        ({"extension.built_with_torch": "1.13.0"}, "extension build", "FAIL", "rebuild"),
        ({"extension.cuda_compiled": False}, "extension's CUDA", "FAIL", "has no CUDA kernels"),
        (
            {
                "tf32": {
                    "torch.backends.cuda.matmul.allow_tf32": True,
                    "torch.get_float32_matmul_precision()": "high",
                }
            },
            "TF32",
            "WARN",
            "allow_tf32 = False",
        ),
    ],
)
def test_each_gpu_problem_is_named(changes, item, status, text) -> None:
    items = doctor.checks(gpu_env(**changes), probe=False)
    check = next(c for c in items if c.name.startswith(item))
    assert check.status == status, check
    assert text in check.reason + " " + check.fix


def test_doctor_exit_status_is_non_zero_on_fail(monkeypatch, capsys) -> None:
    bad = gpu_env(**{"devices.0.compute_capability": "12.0"})
    monkeypatch.setattr(facts, "environment", lambda: copy.deepcopy(bad))
    assert doctor.main(as_json=False, probe=False) == 1
    assert "[FAIL] GPU arch vs torch" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cc,archs,status",
    [
        ((9, 0), ["sm_90"], "OK"),
        ((8, 6), ["sm_80"], "OK"),
        ((8, 0), ["sm_86"], "FAIL"),
        ((9, 0), ["sm_80", "compute_80"], "WARN"),
        ((10, 0), ["sm_90"], "FAIL"),
        ((7, 5), [], "FAIL"),
    ],
)
def test_arch_support(cc, archs, status) -> None:
    assert facts.arch_support(cc, archs)[0] == status


def test_first_cuda_use_warns_once_for_an_unsupported_gpu(monkeypatch) -> None:
    props = SimpleNamespace(name="Future GPU", major=12, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90"])
    monkeypatch.setattr(facts, "_checked_devices", set())
    monkeypatch.setattr(facts, "require_cuda_kernels", lambda: None)  # as a build with CUDA kernels
    with pytest.warns(RuntimeWarning, match="sm_120 is not in sm_80, sm_90"):
        facts.first_cuda_use(torch.device("cuda", 3))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        facts.first_cuda_use(torch.device("cuda", 3))  # once per device


def test_cublas_errors_carry_the_environment(device: str, inject_fault) -> None:
    inject_fault("gemm", 14)
    with pytest.raises(cg.CublasError) as info:
        cg.SafeLinear(8, 4, device=device, name="env")(torch.randn(2, 8, device=device))
    env = info.value.environment
    assert env["torch"] == torch.__version__ and env["allow_tf32"] is False
    assert "environment: torch " in str(info.value) and "TF32 off" in str(info.value)


@pytest.mark.parametrize("status", [3])
def test_alloc_failed_is_an_out_of_memory_error(device: str, inject_fault, status: int) -> None:
    inject_fault("gemm", status)
    with pytest.raises(torch.OutOfMemoryError) as info:
        cg.SafeLinear(8, 4, device=device, name="mem")(torch.randn(2, 8, device=device))
    err = info.value
    assert isinstance(err, cg.CublasOutOfMemoryError) and isinstance(err, cg.CublasError)
    assert err.status_name == "CUBLAS_STATUS_ALLOC_FAILED"
    assert "lower the batch size" in str(err) and "CUBLAS_WORKSPACE_CONFIG" in str(err)


def test_memory_fields_are_formatted() -> None:
    err = errors.from_payload(
        {
            "kind": "out_of_memory",
            "layer": "big",
            "stage": "the forward GEMM's output",
            "bytes_requested": 3 << 30,
            "free_bytes": 1536 << 20,
            "total_bytes": 80 << 30,
            "torch_allocated_bytes": 70 << 30,
            "torch_reserved_bytes": 75 << 30,
            "workspace_bytes": 32 << 20,
            "device": "cuda:0",
            "environment": {"torch": "x"},
        }
    )
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, cg.OutOfMemoryError)
    text = str(err)
    assert "(3.00 GiB requested)" in text
    assert "1.50 GiB free of 80.00 GiB on the device" in text
    assert "70.00 GiB allocated, 75.00 GiB reserved" in text and "workspace 32.00 MiB" in text


def test_handle_not_initialized_is_an_out_of_memory_error() -> None:
    err = errors.from_payload({"kind": "cublas", "status": 1, "stage": "handle", "layer": "h"})
    assert isinstance(err, cg.CublasOutOfMemoryError)
    assert "creating the cuBLAS handle" in str(err)
    assert isinstance(errors.from_payload({"kind": "cublas", "status": 1}), cg.CublasError)
    assert not isinstance(errors.from_payload({"kind": "cublas", "status": 13}), torch.OutOfMemoryError)


@pytest.mark.filterwarnings("ignore:dtype_policy='cast' is deprecated:FutureWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_policy_upcasts_half_precision(device: str, dtype: torch.dtype) -> None:
    layer = cg.SafeLinear(16, 8, device=device, dtype_policy="cast")
    x = torch.randn(4, 16, device=device).to(dtype).requires_grad_(True)
    y = layer(x)
    assert y.dtype == dtype
    assert_matches(y.float(), F.linear(x.float(), layer.weight, layer.bias).to(dtype).float(), rel=1e-2)
    y.float().sum().backward()
    assert x.grad.dtype == dtype and layer.weight.grad is not None
    bad = x.detach().clone()
    bad[1, 2] = float("nan")
    with pytest.raises(cg.NonFiniteInputError, match=r"x\[1, 2\]"):
        layer(bad)


@pytest.mark.filterwarnings("ignore:dtype_policy='cast' is deprecated:FutureWarning")
def test_cast_policy_still_refuses_float64_and_ints() -> None:
    layer = cg.SafeLinear(4, 2, dtype_policy="cast")
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(cg.DTypeError):
            layer(torch.ones(2, 4, dtype=dtype))
    with pytest.raises(ValueError, match="dtype_policy"):
        cg.SafeLinear(4, 2, dtype_policy="loose")
    # the default policy refuses fp16 input into a float32 layer, as nn.Linear does, and
    # points at autocast
    with pytest.raises(cg.DTypeError, match="torch.autocast"):
        cg.SafeLinear(4, 2)(torch.ones(2, 4, dtype=torch.float16))


@pytest.mark.filterwarnings("ignore:dtype_policy='cast' is deprecated:FutureWarning")
def test_replace_linear_passes_the_policy() -> None:
    model = cg.replace_linear(torch.nn.Sequential(torch.nn.Linear(4, 2)), dtype_policy="cast")
    assert model[0].dtype_policy == "cast"
    assert model(torch.randn(3, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
