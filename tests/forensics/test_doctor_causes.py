"""The doctor's checks for the causes of cuBLAS failures on current CUDA releases (a cuBLAS wheel
that does not match torch, libcublas and libcublasLt of different releases, GPUs CUDA 13 dropped,
workspace settings on new architectures), each on faked facts, and `doctor --capsule` comparing
this machine with a capsule's environment."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext import capsule
from cublas_guard_ext.tools import doctor

from helpers.doctor_env import gpu_env


def env_with(cublas=None, **changes) -> dict:
    env = gpu_env(**changes)
    env["cublas"] = (
        cublas
        if cublas is not None
        else {
            "torch_requires": {"name": "nvidia-cublas", "version": "13.1.0.3"},
            "installed": {"name": "nvidia-cublas", "version": "13.1.0.3"},
            "loaded": {"libcublas": "13.1.0", "libcublasLt": "13.1.0"},
        }
    )
    return env


def check(env: dict, prefix: str) -> doctor.Check:
    return next(c for c in doctor.checks(env, probe=False) if c.name.startswith(prefix))


def test_the_healthy_machine_passes_these_checks() -> None:
    items = doctor.checks_2026(env_with())
    assert [(c.name, c.status) for c in items] == [
        ("cuBLAS wheel vs torch", "OK"),
        ("libcublas vs libcublasLt", "OK"),
        ("GPU vs CUDA 13 (cuda:0)", "OK"),
        ("cuBLAS workspace settings", "OK"),
    ]
    assert all(not c.fix for c in items)


@pytest.mark.parametrize(
    "installed,loaded,status,text",
    [
        ("13.0.2.14", "13.0.2", "FAIL", "torch was built with 13.1.0.3"),
        (None, None, "WARN", "is not installed"),
        ("13.1.0.3", "12.8.4", "FAIL", "another copy comes first"),
    ],
)
def test_a_cublas_wheel_that_does_not_match_torch(installed, loaded, status, text) -> None:
    facts = {
        "torch_requires": {"name": "nvidia-cublas", "version": "13.1.0.3"},
        "installed": {"name": "nvidia-cublas", "version": installed} if installed else None,
        "loaded": {"libcublas": loaded, "libcublasLt": loaded} if loaded else {},
    }
    item = check(env_with(facts), "cuBLAS wheel vs torch")
    assert item.status == status and text in item.reason, item
    if status == "FAIL" and installed != "13.1.0.3":
        assert item.fix == "pip install nvidia-cublas==13.1.0.3" and "#174949" in item.reason


def test_the_wheel_check_is_skipped_where_it_cannot_apply() -> None:
    assert check(env_with(torch_cuda=None), "cuBLAS wheel vs torch").status == "SKIP"
    no_pin = {"torch_requires": None, "installed": None, "loaded": {}}
    item = check(env_with(no_pin), "cuBLAS wheel vs torch")
    assert item.status == "SKIP" and "pins neither an nvidia-cublas wheel nor cuda-toolkit" in item.reason
    # torch 2.14+ pins the cuda-toolkit meta-package; without its metadata the version is unknown.
    toolkit_only = {
        "torch_requires": {"name": "cuda-toolkit[cublas]", "version": "13.0.3"},
        "installed": None,
    }
    item = check(env_with({**toolkit_only, "loaded": {}}), "cuBLAS wheel vs torch")
    assert item.status == "WARN" and item.fix == 'pip install "cuda-toolkit[cublas]==13.0.3"', item


def test_libcublas_and_libcublaslt_of_different_releases() -> None:
    facts = {
        "torch_requires": None,
        "installed": None,
        "loaded": {"libcublas": "13.1.0", "libcublasLt": "12.9.1"},
    }
    item = check(env_with(facts), "libcublas vs libcublasLt")
    assert item.status == "FAIL" and "libcublas 13.1.0, libcublasLt 12.9.1" in item.reason and item.fix
    facts["loaded"] = {"libcublas": "13.1.0"}
    assert check(env_with(facts), "libcublas vs libcublasLt").status == "SKIP"


@pytest.mark.parametrize(
    "cc,arch_list,status,text",
    [
        ("7.0", ["sm_70", "sm_80", "sm_90"], "FAIL", "below 7.5"),
        ("6.1", ["sm_80"], "FAIL", "CUDA 13 builds no longer cover"),
        ("8.6", ["sm_80", "sm_90"], "WARN", "sm_86 is not in torch's arch list"),
        ("9.0", ["sm_80", "sm_90"], "OK", "supported"),
    ],
)
def test_gpus_cuda_13_dropped_or_torch_lacks(cc, arch_list, status, text) -> None:
    env = env_with(**{"devices.0.compute_capability": cc, "torch_arch_list": arch_list})
    item = check(env, "GPU vs CUDA 13")
    assert item.status == status and text in item.reason, item
    if cc == "7.0":
        assert "CUDA 12" in item.fix


def test_a_volta_on_cuda_12_is_not_failed_for_cuda_13() -> None:
    env = env_with(torch_cuda="12.8", **{"devices.0.compute_capability": "7.0", "torch_arch_list": ["sm_70"]})
    assert check(env, "GPU vs CUDA 12").status == "OK"


@pytest.mark.parametrize(
    "config,lt,cc,status,text",
    [
        (":4096:8", None, "9.0", "WARN", "wants 32 MiB"),
        (":4096:8", None, "8.0", "OK", "CUBLAS_WORKSPACE_CONFIG=:4096:8"),
        (":0:0", None, "8.0", "WARN", "no workspace at all"),
        ("4096:8", None, "9.0", "FAIL", "is not ':SIZE_KiB:COUNT"),
        (None, "1024", "9.0", "WARN", "CUBLASLT_WORKSPACE_SIZE=1024 KiB"),
        (None, "lots", "9.0", "WARN", "is not a size in KiB"),
        (":32768:2", "32768", "10.0", "OK", ""),
    ],
)
def test_workspace_settings_on_new_architectures(config, lt, cc, status, text) -> None:
    env = env_with(**{"devices.0.compute_capability": cc})
    env["env"]["CUBLAS_WORKSPACE_CONFIG"] = config
    env["env"]["CUBLASLT_WORKSPACE_SIZE"] = lt
    item = check(env, "cuBLAS workspace settings")
    assert item.status == status and text in item.reason, item


def test_cublas_facts_read_this_machine() -> None:
    facts = doctor.cublas_facts()
    assert set(facts) == {"torch_requires", "installed", "loaded"}
    if torch.version.cuda is None:  # a CPU torch pins no cuBLAS wheel and loads none
        assert facts["torch_requires"] is None and facts["loaded"] == {}


def test_capsule_checks_name_what_differs() -> None:
    here = capsule.environment()
    assert [c.status for c in doctor.capsule_checks(copy.deepcopy(here), here)] == ["OK"]
    then = copy.deepcopy(here)
    then["torch"] = "2.9.0+cu130"
    then["gpu"] = {"name": "NVIDIA H100", "compute_capability": "9.0"}
    then["libraries"] = {
        "libcublas": [{"path": "/x/libcublas.so.13", "version": "13.0.2"}],
        "libcublasLt": "not loaded",
    }
    then["env"] = {**here["env"], "CUDA_LAUNCH_BLOCKING": "1"}
    items = {c.name: c for c in doctor.capsule_checks(then, here)}
    assert items["capsule: torch"].reason == f"the capsule's '2.9.0+cu130', here {torch.__version__!r}"
    assert items["capsule: GPU"].status == "WARN" and "NVIDIA H100" in items["capsule: GPU"].reason
    assert "13.0.2" in items["capsule: libcublas"].reason
    assert "capsule: CUDA_LAUNCH_BLOCKING" in items
    assert "capsule environment" not in items


@pytest.mark.slow
def test_doctor_reads_a_capsule(tmp_path, monkeypatch, inject_fault) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_DIR", str(tmp_path))
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        cg.SafeLinear(4, 2)(torch.randn(3, 4))
    data = torch.load(info.value.capsule, weights_only=True)
    data["environment"]["torch"] = "2.9.0+cu130"
    data["environment"]["gpu"] = {"name": "NVIDIA H100", "compute_capability": "9.0"}
    torch.save(data, info.value.capsule)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cublas_guard_ext",
            "doctor",
            "--json",
            "--no-probe",
            "--capsule",
            info.value.capsule,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    rows = {c["name"]: c for c in report["checks"]}
    assert rows["capsule: torch"]["status"] == "WARN" and "2.9.0+cu130" in rows["capsule: torch"]["reason"]
    assert "NVIDIA H100" in rows["capsule: GPU"]["reason"]
    assert report["environment"]["capsule"]["path"] == info.value.capsule
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "cublas_guard_ext",
            "doctor",
            "--no-probe",
            "--capsule",
            str(tmp_path / "nope.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # a file that is no capsule is one line on stderr and exit 2, before any report
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "cannot read" in missing.stderr and "nope.pt" in missing.stderr
