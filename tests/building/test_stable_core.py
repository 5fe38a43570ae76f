"""Choosing between the two native libraries, and what the stable core says when it cannot serve:
a torch below its floor, a wheel's CUDA part of another CUDA major, a locked library that does not
load, watch without the locked library, and the core's errors turned typed."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext._native.building import core_build
from cublas_guard_ext._native.core_twins import stable_core
from cublas_guard_ext._native.loading import loader


@pytest.mark.parametrize("version", ["2.9.1", "2.9.0+cu128", "1.13.1"])
def test_a_torch_below_the_floor_is_refused_naming_both_versions(version: str) -> None:
    reason = core_build.torch_floor_error(version)
    assert reason is not None
    assert f"needs torch >= {core_build.FLOOR[0]}.{core_build.FLOOR[1]}" in reason
    assert f"this is torch {version}" in reason
    assert "pip install 'torch>=2.10'" in reason and "pip install --no-build-isolation -e ." in reason


@pytest.mark.parametrize("version", ["2.10.0", "2.13.0+cpu", "2.15.0+cu132", "3.0.0", "nightly"])
def test_the_floor_and_newer_torches_are_accepted(version: str) -> None:
    assert core_build.torch_floor_error(version) is None


def test_the_floor_is_the_target_version_the_core_is_compiled_for() -> None:
    assert core_build.TARGET_VERSION == "0x020a000000000000"
    assert f"-DTORCH_TARGET_VERSION={core_build.TARGET_VERSION}" in core_build.STABLE_DEFINES


def test_the_core_beside_a_torch_below_the_floor_raises_one_typed_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    with pytest.raises(cg.ExtensionBuildError, match=r"needs torch >= 2\.10.*this is torch 2\.9\.1") as info:
        loader._try_core()
    assert info.value.fields["missing"] == "torch >= 2.10"


def _fake_cuda_core(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, built_for: str, torch_cuda: str | None
) -> None:
    module = tmp_path / "_core_cuda.abi3.so"
    module.write_bytes(b"")
    (tmp_path / "_core_cuda.cuda").write_text(built_for + "\n")
    spec = types.SimpleNamespace(origin=str(module))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)


def test_a_cpu_only_torch_never_loads_the_cuda_part(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_cuda_core(monkeypatch, tmp_path, "13", None)
    assert loader._core_module_for_this_torch() == ("_core", None)


def test_a_cuda_torch_of_the_wheels_major_loads_the_cuda_part(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_cuda_core(monkeypatch, tmp_path, "13", "13.2")
    assert loader._core_module_for_this_torch() == ("_core_cuda", None)


def test_a_cu12_torch_beside_the_cu13_wheel_gets_the_cpu_core_and_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_cuda_core(monkeypatch, tmp_path, "13", "12.8")
    name, note = loader._core_module_for_this_torch()
    assert name == "_core"
    assert note == (
        "CUDA kernels left out: this wheel's are for CUDA 13, this torch uses CUDA 12.8; "
        "install the wheel built for CUDA 12"
    )


def test_a_locked_library_that_does_not_load_leaves_the_core_to_serve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    module = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    module.write_bytes(b"not a library")
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=str(module))
    )

    def broken(name: str, *args: object) -> types.ModuleType:
        raise ImportError(f"{module}: invalid ELF header")

    monkeypatch.setattr(loader.importlib, "import_module", broken)
    with pytest.warns(
        RuntimeWarning, match="the installed _C failed to load .*invalid ELF header.*stable core"
    ):
        assert loader._try_prebuilt(warn=True) is None


def test_a_locked_library_of_another_torch_is_skipped_without_loading_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    module = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    module.write_bytes(b"")
    (tmp_path / "_C.torch").write_text("2.14.1+cu130\n")
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=str(module))
    )
    monkeypatch.setattr(loader.importlib, "import_module", lambda *a: pytest.fail("must not load it"))
    monkeypatch.setattr(torch, "__version__", "2.15.0+cu132")
    assert loader._try_prebuilt(warn=True) is None


def test_an_unknown_native_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_EXT_NATIVE", "stable")
    with pytest.raises(cg.ExtensionBuildError, match="CUBLAS_GUARD_EXT_NATIVE='stable'") as info:
        loader.native_choice()
    assert "auto, locked, core" in str(info.value)


def test_the_cores_payload_errors_become_the_typed_classes() -> None:
    payload = (
        '{"kind": "shape_mismatch", "layer": "l", "role": "input", "shape": [2, 3], "reason": "last_dim"}'
    )
    err = stable_core.translate(
        RuntimeError("cublas_guard_ext: layer 'l': bad\n[cublas_guard_ext payload] " + payload)
    )
    assert isinstance(err, cg.ShapeMismatchError) and isinstance(err, ValueError)
    assert err.layer == "l" and err.shape == [2, 3]


@pytest.mark.parametrize(("tag", "cls"), [("[ValueError] ", ValueError), ("[TypeError] ", TypeError)])
def test_the_cores_plain_errors_become_the_builtin_they_name(tag: str, cls: type[Exception]) -> None:
    err = stable_core.translate(RuntimeError(tag + "cublas_guard_ext: mode must be 0, 1 or 2"))
    assert type(err) is cls and str(err) == "cublas_guard_ext: mode must be 0, 1 or 2"
    assert stable_core.translate(RuntimeError("an error of torch's own")) is None


def test_watch_without_the_locked_library_says_the_one_command_to_run() -> None:
    stand_in = stable_core.LockedOnly("cublas_guard_ext.watch")
    assert stand_in._watch_active() is False and stand_in._watch_take_pending() is None
    with pytest.raises(cg.ExtensionBuildError) as info:
        _ = stand_in._watch_begin
    text = str(info.value)
    assert info.value.fields["missing"] == "the version-locked library"
    assert f"torch {torch.__version__}" in text
    assert "run `python -m cublas_guard_ext build` once" in text and "then restart the process" in text


def test_the_build_command_builds_the_locked_library_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    from cublas_guard_ext.tools import build_locked

    seen: dict[str, object] = {}

    def call(argv: list[str], env: dict[str, str]) -> int:
        seen.update(argv=argv, env=env)
        return 0

    monkeypatch.setenv("CUBLAS_GUARD_EXT_FORCE_JIT", "1")
    monkeypatch.setattr(subprocess, "call", call)
    assert build_locked.main() == 0
    assert seen["argv"][0] == sys.executable and "loader.load()" in seen["argv"][2]
    assert seen["env"]["CUBLAS_GUARD_EXT_NATIVE"] == "locked"
    assert "CUBLAS_GUARD_EXT_FORCE_JIT" not in seen["env"]


def test_the_stable_sources_include_no_aten_header() -> None:
    """What makes the core one binary for every torch: its C++ sees only the stable ABI."""
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    for name in ("core/tensor_api_stable.cpp", "core/registration.h", "report/raise_stable.cpp"):
        text = (csrc / name).read_text()
        assert "#include <ATen/" not in text and "#include <c10/" not in text, name
