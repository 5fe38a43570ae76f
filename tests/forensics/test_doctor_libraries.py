"""Which file each CUDA library was loaded from: real shared objects built here (gcc
-shared, with the sonames and RUNPATH of pip's cuBLAS) loaded in a subprocess with
LD_LIBRARY_PATH, so that ld.so itself puts libcublas and libcublasLt in two folders; cuBLAS
wheels of two CUDA majors faked as .dist-info folders; torch's pins through the
cuda-toolkit meta-package; the known-bad table on synthetic facts; the JSON's fields."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext._native.building import toolkit
from cublas_guard_ext._native.machine import facts, known_builds, libraries
from cublas_guard_ext.errors import ExtensionBuildError
from cublas_guard_ext.tools import doctor, doctor_libraries

from helpers.doctor_env import gpu_env

needs_gcc = pytest.mark.skipif(
    shutil.which("gcc") is None or not sys.platform.startswith("linux"), reason="needs gcc and ld.so (Linux)"
)
# The fake libcublas.so.13 / libcublasLt.so.13 loaded before torch: a CUDA torch would bind its
# own NEEDED libcublas.so.13 to them by soname. There, CI's CUDA build stage runs the real case
# (torch's pip cuBLAS and a second libcublasLt on LD_LIBRARY_PATH, .ci/cuda_build_check.sh).
fake_cublas_before_torch = pytest.mark.skipif(
    torch.version.cuda is not None, reason="a CUDA torch binds its libcublas.so.13 to the fakes by soname"
)


def _shared(path: Path, source: str, *link: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    c = path.with_suffix(".c")
    c.write_text(source)
    command = ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{path.name}", "-o", str(path), str(c), *link]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    c.unlink()


def _lt_source(version: int) -> str:
    return f"#include <stddef.h>\nsize_t cublasLtGetVersion(void) {{ return {version}; }}\n"


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> dict[str, Path]:
    """A pip layout (site-packages/nvidia/cu13/lib, owned by a fake nvidia-cublas 13.1.1.3
    .dist-info) whose libcublas.so.13 NEEDs libcublasLt.so.13 through RUNPATH=$ORIGIN, as
    the real wheel's does, and a "system CUDA" folder with another libcublasLt.so.13."""
    root = tmp_path_factory.mktemp("fake_cuda")
    site = root / "site-packages"
    pip_lib = site / "nvidia" / "cu13" / "lib"
    system = root / "system-cuda" / "lib64"
    _shared(pip_lib / "libcublasLt.so.13", _lt_source(130101))
    _shared(
        pip_lib / "libcublas.so.13",
        "#include <stddef.h>\nsize_t cublasLtGetVersion(void);\n"
        "int cublasGetProperty(int t, int *v) { static const int p[3] = {13, 1, 1}; *v = p[t];"
        " return cublasLtGetVersion() ? 0 : 1; }\n",
        f"-L{pip_lib}",
        "-l:libcublasLt.so.13",
        "-Wl,--enable-new-dtags",  # RUNPATH, not RPATH: searched after LD_LIBRARY_PATH
        "-Wl,-rpath,$ORIGIN",
    )
    _shared(system / "libcublasLt.so.13", _lt_source(130000))
    info = site / "nvidia_cublas-13.1.1.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-cublas\nVersion: 13.1.1.3\n")
    (info / "RECORD").write_text(
        "nvidia/cu13/lib/libcublas.so.13,,\nnvidia/cu13/lib/libcublasLt.so.13,,\n"
        "nvidia_cublas-13.1.1.3.dist-info/METADATA,,\n"
    )
    return {"site": site, "pip_lib": pip_lib, "system": system}


def run_doctor_after(preload: list[str], fake: dict[str, Path], ld_library_path: str | None):
    """doctor --json in a process that first loaded ``preload`` (as another CUDA package
    imported before torch would), with the fake site-packages on sys.path."""
    code = textwrap.dedent(
        f"""
        import ctypes, sys
        for path in {preload!r}:
            ctypes.CDLL(path)
        sys.path.append({str(fake["site"])!r})
        from cublas_guard_ext._native.machine import libraries
        from cublas_guard_ext.tools import doctor
        print("QUICK", len(libraries.quick_conflicts()), file=sys.stderr)
        sys.exit(doctor.main(as_json=True, probe=False))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if ld_library_path is not None:
        env["LD_LIBRARY_PATH"] = ld_library_path
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    report = json.loads(result.stdout)
    return result, report, {c["name"]: c for c in report["checks"]}


@pytest.mark.slow
@needs_gcc
@fake_cublas_before_torch
def test_libcublaslt_from_a_folder_on_ld_library_path_fails_and_names_it(fake_cuda) -> None:
    system, pip_lib = fake_cuda["system"], fake_cuda["pip_lib"]
    result, report, rows = run_doctor_after([str(pip_lib / "libcublas.so.13")], fake_cuda, str(system))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    row = rows["loaded libraries: libcublas and libcublasLt folders"]
    assert row["status"] == "FAIL", row
    assert "different folders" in row["reason"] and str(system / "libcublasLt.so.13") in row["reason"]
    assert f"from LD_LIBRARY_PATH's entry {system}" in row["reason"]
    assert "pip's nvidia-cublas 13.1.1.3" in row["reason"] and "#170676" in row["reason"]
    assert row["fix"].startswith("unset LD_LIBRARY_PATH; or preload")
    assert f'ctypes.CDLL("{pip_lib / "libcublasLt.so.13"}", mode=ctypes.RTLD_GLOBAL)' in row["fix"]
    libs = report["environment"]["cuda_libraries"]
    [lt] = libs["loaded"]["libcublasLt"]
    assert lt["version"] == "13.0.0" and lt["ld_library_path_entry"] == str(system)  # read from the file
    [lib] = libs["loaded"]["libcublas"]
    assert lib["version"] == "13.1.1" and lib["distribution"] == "nvidia-cublas 13.1.1.3"
    other = [c for c in libs["installed"]["libcublasLt"] if c["path"] == str(pip_lib / "libcublasLt.so.13")]
    assert other and other[0]["loaded"] is False and other[0]["source"] == "site-packages"
    assert "QUICK 1" in result.stderr  # what an error's constructor would read
    # The fix is the first thing to paste.
    assert report["next_steps"][0]["command"] == row["fix"]


@pytest.mark.slow
@needs_gcc
@fake_cublas_before_torch
def test_the_same_process_without_the_stray_folder_passes(fake_cuda) -> None:
    result, report, rows = run_doctor_after([str(fake_cuda["pip_lib"] / "libcublas.so.13")], fake_cuda, None)
    assert result.returncode == 0, [r for r in rows.values() if r["status"] == "FAIL"]
    assert rows["loaded libraries"]["status"] == "OK"
    assert "libcublas 13.1.1, libcublasLt 13.1.1" in rows["loaded libraries"]["reason"]
    assert "QUICK 0" in result.stderr


@pytest.mark.slow
@needs_gcc
@fake_cublas_before_torch
def test_one_library_mapped_twice_fails(fake_cuda) -> None:
    system, pip_lib = fake_cuda["system"], fake_cuda["pip_lib"]
    preload = [str(system / "libcublasLt.so.13"), str(pip_lib / "libcublasLt.so.13")]  # by path: two copies
    result, report, rows = run_doctor_after(preload, fake_cuda, f"/nonexistent:{system}")
    assert result.returncode == 1
    row = rows["loaded libraries: libcublasLt mapped twice"]
    assert row["status"] == "FAIL" and "mapped twice" in row["reason"], row
    assert f"{system / 'libcublasLt.so.13'} (from LD_LIBRARY_PATH's entry {system})" in row["reason"]
    assert row["fix"].startswith(f"export LD_LIBRARY_PATH=/nonexistent   # without {system}")
    [conflict] = report["environment"]["cuda_libraries"]["conflicts"]
    assert conflict["stray"] == str(system / "libcublasLt.so.13") and conflict["kind"] == "mapped_twice"


@needs_gcc
def test_an_unmapped_copy_is_never_loaded_to_ask_it_anything(fake_cuda) -> None:
    path = str(fake_cuda["system"] / "libcublasLt.so.13")  # never loaded by this process
    assert libraries._query_version("libcublasLt", path) is None
    assert libraries.exports(path, "cublasLtGetVersion") is None
    assert path not in libraries.mapped().get("libcublasLt", [])


def test_conflicts_are_a_function_of_the_facts() -> None:
    owner = {
        "/pip/libcublas.so.13": "nvidia-cublas 13.1.1.3",
        "/pip/libcublasLt.so.13": "nvidia-cublas 13.1.1.3",
    }
    same = {"libcublas": ["/pip/libcublas.so.13"], "libcublasLt": ["/pip/libcublasLt.so.13"]}
    assert libraries.conflicts(same, [], owner.get) == []
    split = {
        "libcublas": ["/pip/libcublas.so.13"],
        "libcublasLt": ["/usr/local/cuda/lib64/libcublasLt.so.13"],
    }
    [found] = libraries.conflicts(split, [], owner.get)
    # Not from LD_LIBRARY_PATH (e.g. loaded by path first): still a FAIL, with the preload fix only.
    assert found["kind"] == "split_cublas" and found["ld_library_path_entry"] is None
    assert found["fix"].startswith("preload the pip copies before torch:\nimport ctypes")


def test_mapped_reads_the_maps_format() -> None:
    maps = (
        "7f00-7f01 r--p 00000000 08:01 1 /a/libcublasLt.so.13\n"
        "7f01-7f02 r-xp 00001000 08:01 1 /a/libcublasLt.so.13\n"
        "7f02-7f03 r--p 00000000 08:01 2 /b/libcublasLt.so.13.0.0.19\n"
        "7f03-7f04 r--p 00000000 08:01 3 /a/libnvrtc-builtins.so.13.0\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"
        "7f05-7f06 r--p 00000000 08:01 4 /x/cublas_guard_ext/_C.so\n"
    )
    assert libraries.mapped("/x/cublas_guard_ext/_C.so", maps) == {
        "libcublasLt": ["/a/libcublasLt.so.13", "/b/libcublasLt.so.13.0.0.19"],
        "cublas_guard_ext": ["/x/cublas_guard_ext/_C.so"],
    }


def _fake_dist(site: Path, folder: str, name: str, version: str) -> None:
    info = site / folder
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.slow
def test_cu12_and_cu13_cublas_wheels_together_fail(tmp_path) -> None:
    site = tmp_path / "site-packages"
    _fake_dist(site, "nvidia_cublas_cu12-12.8.4.1.dist-info", "nvidia-cublas-cu12", "12.8.4.1")
    _fake_dist(site, "nvidia_cublas-13.1.1.3.dist-info", "nvidia-cublas", "13.1.1.3")
    dists = libraries.cublas_distributions(path=[str(site)])
    assert [(d["name"], d["cuda_major"]) for d in dists] == [
        ("nvidia-cublas-cu12", 12),
        ("nvidia-cublas", 13),
    ]
    mixed = libraries.mixed_cuda_majors(dists)
    assert mixed is not None and "CUDA 12 and 13" in mixed["message"] and "#3327" in mixed["message"]
    assert mixed["fix"].startswith("pip uninstall nvidia-cublas-cu12")
    # Through the doctor, in a process that sees them in its environment.
    result = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "doctor", "--json", "--no-probe"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    rows = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert result.returncode == 1 and rows["cuBLAS wheels' CUDA"]["status"] == "FAIL", rows[
        "cuBLAS wheels' CUDA"
    ]
    assert libraries.mixed_cuda_majors(dists[1:]) is None


TORCH_2_14_1 = [
    "filelock",
    'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; platform_system == "Linux"',
    'nvidia-cudnn-cu13==9.24.0.43; platform_system == "Linux"',
]
CUDA_TOOLKIT_13_0_3 = [
    "nvidia-cublas==13.1.1.3.*; (sys_platform == 'linux' and platform_machine == 'x86_64') and extra == 'cublas'",
    "nvidia-cuda-nvcc==13.0.88.*; (sys_platform == 'linux' and platform_machine == 'x86_64') and extra == 'nvcc'",
    "nvidia-cuda-runtime==13.0.96.*; (sys_platform == 'linux') and extra == 'cudart'",
]


def test_torchs_pins_are_read_through_the_cuda_toolkit_meta_package() -> None:
    pins = toolkit.torch_cuda_pins(TORCH_2_14_1, CUDA_TOOLKIT_13_0_3)
    assert pins == {
        "cuda-toolkit": "13.0.3",
        "nvidia-cudnn-cu13": "9.24.0.43",
        "nvidia-cublas": "13.1.1.3",
        "nvidia-cuda-runtime": "13.0.96",
    }  # nvcc is not among the extras torch asks for
    assert toolkit.pip_toolkit_command(pins, "13.0") == 'pip install "cuda-toolkit[nvcc,cccl]==13.0.3"'
    # An older torch pinned the wheels directly; with no pin at all, torch's CUDA release.
    assert toolkit.torch_cuda_pins(["nvidia-cublas-cu12==12.8.4.1; platform_system == 'Linux'"], []) == {
        "nvidia-cublas-cu12": "12.8.4.1"
    }
    assert toolkit.pip_toolkit_command({}, "12.8") == 'pip install "cuda-toolkit[nvcc,cccl]==12.8.*"'


@pytest.mark.parametrize(
    "cublas,runtime,ccs,missing,row",
    [
        ("12.9.1", "12.9", ["10.0"], [], "cuBLAS >= 12.8"),
        ("13.0.2.14", "13.0", ["9.0", "10.3"], [], "cuBLAS >= 12.8"),
        ("13.1.0.2", "13.1", ["11.0"], [], "cuBLAS >= 12.8"),
        ("13.1.0.3", "13.1", ["10.0"], [], None),
        ("13.1.0", "13.1", ["10.0"], [], None),  # three parts equal to the bound: not taken as bad
        ("12.9.1", "12.9", ["9.0"], [], None),
        ("12.6.4", "12.6", ["10.0"], [], None),
        ("13.4.0", "13.4", ["9.0"], ["cublasLtGroupedMatrixLayoutCreate"], "CUDA 13.4 preview"),
        ("13.4.0", "13.4", ["9.0"], [], None),
    ],
)
def test_the_known_bad_table(cublas, runtime, ccs, missing, row) -> None:
    found = known_builds.matching(
        {
            "cublas": cublas,
            "cuda_runtime": runtime,
            "compute_capabilities": ccs,
            "lt_missing_symbols": missing,
        }
    )
    assert len(found) == (1 if row else 0) and (row is None or found[0].name.startswith(row)), found
    for r in known_builds.KNOWN_BAD_BUILDS:  # every row says where it is documented
        assert r.source and r.fix and r.what


def _env_with_libraries(cublas: str, runtime: str, cc: str, missing=()) -> dict:
    env = gpu_env(**{"devices.0.compute_capability": cc})
    env["extension"]["cuda_compiled_version"] = 13000
    env["cuda_libraries"] = {
        "loaded": {
            "libcublas": [{"path": "/nv/libcublas.so.13", "version": cublas}],
            "libcudart": [{"path": "/nv/libcudart.so.13", "version": runtime}],
        },
        "conflicts": [],
        "cublas_distributions": [{"name": "nvidia-cublas", "version": cublas, "cuda_major": 13}],
        "lt_missing_symbols": list(missing),
        "pip_toolkit_command": 'pip install "cuda-toolkit[nvcc,cccl]==13.0.3"',
    }
    return env


def test_the_known_bad_check_in_the_doctor() -> None:
    rows = {c.name: c for c in doctor.checks(_env_with_libraries("13.0.2", "13.0", "10.0"), probe=False)}
    bad = rows["known-bad builds"]
    assert bad.status == "FAIL" and "pytorch PR #178333" in bad.reason and "13.1.0.3" in bad.fix
    ok = {c.name: c for c in doctor.checks(_env_with_libraries("13.0.2", "13.0", "9.0"), probe=False)}
    assert ok["known-bad builds"].status == "OK" and ok["loaded libraries"].status == "OK"
    assert ok["extension's CUDA"].status == "OK"


def test_an_extension_compiled_by_another_cuda_major_warns() -> None:
    env = _env_with_libraries("13.1.0", "13.0", "9.0")
    env["extension"]["cuda_compiled_version"] = 12090
    row = next(c for c in doctor.checks(env, probe=False) if c.name == "extension's CUDA")
    assert row.status == "WARN" and "CUDA 12.9, torch runs CUDA 13.0" in row.reason and "#5145" in row.reason
    env["extension"]["cuda_compiled"] = False
    row = next(c for c in doctor.checks(env, probe=False) if c.name == "extension's CUDA")
    assert row.status == "FAIL" and row.fix.startswith('pip install "cuda-toolkit[nvcc,cccl]==13.0.3", then')


@pytest.mark.slow
def test_the_json_carries_every_new_field() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "doctor", "--json", "--no-probe"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]  # no false FAIL here
    report = json.loads(result.stdout)
    libs = report["environment"]["cuda_libraries"]
    assert set(libs) == {
        "loaded",
        "installed",
        "ld_library_path",
        "cublas_distributions",
        "conflicts",
        "lt_missing_symbols",
        "pip_toolkit_command",
    }
    assert list(libs["loaded"]) == list(libraries.LIBRARY_KEYS)
    for copies in libs["loaded"].values():
        for copy in copies:
            assert set(copy) == {"path", "folder", "version", "distribution", "ld_library_path_entry"}
    for copies in libs["installed"].values():
        for copy in copies:
            assert set(copy) == {"path", "source", "distribution", "loaded"}
    assert libs["conflicts"] == []
    # The project's own library is among the loaded, from the file the loader names.
    [own] = libs["loaded"][libraries.OWN_LIBRARY]
    assert os.path.realpath(own["path"]) == os.path.realpath(report["environment"]["extension"]["path"])
    assert report["next_steps"] and all(set(s) == {"why", "command"} for s in report["next_steps"])
    names = {c["name"] for c in report["checks"]}
    assert {"loaded libraries", "cuBLAS wheels' CUDA", "known-bad builds", "extension's CUDA"} <= names


def test_next_steps_for_a_gpu_user() -> None:
    env = gpu_env()
    steps = [s["command"] for s in doctor.next_steps(doctor.checks(env, probe=False), env, capsule="/c.pt")]
    assert steps == [
        "python -m cublas_guard_ext replay /c.pt",
        "CUDA_LAUNCH_BLOCKING=1 python train.py",
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer python train.py",
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1 torchrun --no-python compute-sanitizer python train.py",
    ]
    text = doctor.render(doctor.checks(env, probe=False), env, doctor.next_steps([], env, capsule="/c.pt"))
    assert (
        text.splitlines()[-1]
        == "  PYTORCH_NO_CUDA_MEMORY_CACHING=1 torchrun --no-python compute-sanitizer python train.py"
    )
    assert "Next, ready to paste:" in text


@pytest.mark.skipif(
    torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA"),
    reason="this build has CUDA kernels (CI's CUDA build stage checks a build without them)",
)
def test_a_cuda_torch_without_cuda_kernels_raises_a_typed_error_at_the_first_cuda_call(monkeypatch) -> None:
    # The dispatcher's own registry: this CPU build has no CUDA kernel for the op.
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(toolkit, "torch_cuda_pins", lambda *a: {"cuda-toolkit": "13.0.3"})
    monkeypatch.setattr(facts, "_checked_devices", set())
    for _ in range(2):  # every call, not only the first
        with pytest.raises(ExtensionBuildError) as info:
            facts.first_cuda_use(torch.device("cuda", 0))
        assert isinstance(info.value, ImportError) and info.value.missing == "CUDA kernels"
        assert 'pip install "cuda-toolkit[nvcc,cccl]==13.0.3"' in str(info.value)
    assert facts._checked_devices == set()


def test_a_cublas_error_names_a_library_conflict_first(monkeypatch, inject_fault) -> None:
    conflict = {
        "message": "libcublas and libcublasLt come from different folders: ...",
        "fix": "unset X\nline 2",
    }
    monkeypatch.setattr(libraries, "quick_conflicts", lambda: [{**conflict, "kind": "split_cublas"}])
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        cg.SafeLinear(4, 2, name="lib")(torch.randn(3, 4))
    lines = str(info.value).splitlines()
    first = lines.index("  likely causes, most likely first:") + 1
    assert lines[first] == f"    1. the loaded libraries conflict: {conflict['message']}"
    assert "Next: unset X" in str(info.value) and "      line 2" in lines


def test_the_capsule_records_the_loaded_files_and_doctor_compares_them() -> None:
    from cublas_guard_ext import capsule

    here = capsule.environment()
    assert set(here["loaded_libraries"]) == {"loaded", "ld_library_path", "conflicts"}
    then = json.loads(json.dumps(here))
    then["loaded_libraries"]["loaded"]["libcublasLt"] = [{"path": "/other/libcublasLt.so.13"}]
    then["loaded_libraries"]["conflicts"] = ["libcublasLt is mapped twice in this process: ..."]
    rows = {c.name: c for c in doctor.capsule_checks(then, here)}
    assert "/other/libcublasLt.so.13" in rows["capsule: libcublasLt file"].reason
    assert "mapped twice" in rows["capsule: library conflicts"].reason


def test_render_marks_each_copy_in_a_conflict() -> None:
    lib_facts = {
        "loaded": {
            "libcublas": [
                {
                    "path": "/pip/libcublas.so.13",
                    "version": "13.1.1",
                    "distribution": "nvidia-cublas 13.1.1.3",
                }
            ],
            "libcublasLt": [
                {"path": "/sys/libcublasLt.so.13", "version": "13.0.0", "ld_library_path_entry": "/sys"}
            ],
        },
        "installed": {
            "libcublasLt": [{"path": "/pip/libcublasLt.so.13", "source": "site-packages", "loaded": False}]
        },
        "conflicts": [
            {"stray": "/sys/libcublasLt.so.13", "paths": ["/pip/libcublas.so.13", "/sys/libcublasLt.so.13"]}
        ],
    }
    text = "\n".join(doctor_libraries.render_libraries(lib_facts))
    assert "/sys/libcublasLt.so.13  (LD_LIBRARY_PATH entry /sys, no pip wheel)  <-- CONFLICT (stray)" in text
    assert "/pip/libcublas.so.13  (pip: nvidia-cublas 13.1.1.3)  <-- CONFLICT" in text
    assert "/pip/libcublasLt.so.13  (no pip wheel)" in text


def test_a_fix_of_several_lines_stays_in_its_column() -> None:
    fix = libraries.preload_fix("/pip")
    text = doctor.render([doctor.Check("loaded libraries: x", "FAIL", "why", fix)], gpu_env(), steps=[])
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "fix: import ctypes" in line)
    column = lines[first].index("import ctypes")
    assert [line[column:] for line in lines[first : first + 4]] == fix.splitlines()
    assert all(not line[:column].strip() for line in lines[first + 1 : first + 4])
