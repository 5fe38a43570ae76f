"""The build tooling shared by setup.py and the JIT loader: the progress a person
sees while ninja runs, the precompiled header added to torch's build.ninja, and
the JIT cache key. Fast: tiny ninja projects, no extension build."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cublas_guard_ext._native.building import build as _build
from cublas_guard_ext._native.building import toolkit as _toolkit
from cublas_guard_ext._native.loading import loader as _loader

needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="needs the ninja binary")
needs_gcc = pytest.mark.skipif(not _build.pch_enabled(), reason="the precompiled header is GCC-only")

# The layout torch's _write_ninja_file produces (CPU build, JIT flavour with a link step).
TORCH_STYLE = """ninja_required_version = 1.3
cxx = {cxx}

cflags = {cflags}
post_cflags = {post}
cuda_dlink_post_cflags = \nsycl_dlink_post_cflags = \nldflags = {ldflags}

rule compile
  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags
  depfile = $out.d
  deps = gcc



rule link
  command = $cxx $in $ldflags -o $out

build a.o: compile {src}/a.cpp
build b.o: compile {src}/b.cpp



build lib.so: link a.o b.o

default lib.so
"""


def write_project(
    tmp_path: Path,
    cxx: str,
    cflags: str = "",
    post: str = "",
    ldflags: str = "",
    a_body: str = "int a() { return 1; }\n",
) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "a.cpp").write_text(a_body)
    (src / "b.cpp").write_text("int b() { return 2; }\n")
    build = tmp_path / "build"
    build.mkdir(exist_ok=True)
    (build / "build.ninja").write_text(
        TORCH_STYLE.format(cxx=cxx, cflags=cflags, post=post, ldflags=ldflags, src=src)
    )
    return build


FAKE_CC = """#!/bin/sh
# a stand-in compiler: {action}, then writes -o's file and -MF's depfile
{action}
out=""; dep=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift;; -MF) dep="$2"; shift;; esac
  shift
done
if [ -n "$dep" ]; then echo "$out:" > "$dep"; fi
touch "$out"
"""


def fake_compiler(tmp_path: Path, action: str) -> str:
    path = tmp_path / "fakecc.sh"
    path.write_text(FAKE_CC.format(action=action))
    path.chmod(0o755)
    return str(path)


def test_rewrite_adds_descriptions_and_the_pch_edge(tmp_path: Path) -> None:
    build = write_project(tmp_path, "c++")
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=True)
    text = (build / "build.ninja").read_text()
    gch = build / (_build.PCH_HEADER + ".gch")
    assert "  description = CXX $in" in text and "  description = LINK $out" in text
    assert f"build {gch}: pch {build / _build.PCH_HEADER}" in text
    assert f"build a.o: compile {tmp_path / 'src' / 'a.cpp'} | {gch}" in text
    assert "-o $out $post_cflags $pch_flags" in text
    # The PCH is built with the compile rule's own flags (GCC rejects one built otherwise).
    assert "-x c++-header $cflags -c $in -o $out $post_cflags\n" in text
    assert (build / _build.PCH_HEADER).read_text() == "#include <ATen/ATen.h>\n#include <torch/library.h>\n"
    # Idempotent: a second pass changes nothing.
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=True)
    assert (build / "build.ninja").read_text() == text


def test_files_that_do_not_need_the_pch_do_not_wait_for_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_build._ninja, "NO_PCH_SOURCES", frozenset({"a.cpp"}))
    monkeypatch.setattr(_build._ninja, "SLOW_SOURCES", {"a.cpp": 50.0})
    build = write_project(tmp_path, "c++")
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=True)
    lines = (build / "build.ninja").read_text().splitlines()
    gch = build / (_build.PCH_HEADER + ".gch")
    a_edge = lines.index(f"build a.o: compile {tmp_path / 'src' / 'a.cpp'}")  # no "| gch"
    assert lines[a_edge + 1] == "  pch_flags ="  # its own, empty value: no -include
    b_edge = lines.index(f"build b.o: compile {tmp_path / 'src' / 'b.cpp'} | {gch}")
    # ninja starts ready edges in file order: the PCH, then (once it is built) the files
    # that wait for it, then the others, even a slower one: they fill the second core.
    assert lines.index(f"build {gch}: pch {build / _build.PCH_HEADER}") < b_edge < a_edge
    # The real list names real sources, and none of those that need the op registry or all
    # of ATen (they are what the PCH is for).
    monkeypatch.undo()
    assert _build.NO_PCH_SOURCES and _build.NO_PCH_SOURCES <= set(_build.CPU_SOURCES)
    for name in (
        _build.NO_PCH_SOURCES if _build.CSRC_DIR.is_dir() else ()
    ):  # (an installed build has no csrc/)
        text = (_build.CSRC_DIR / name).read_text()
        assert "torch/library.h" not in text and "ATen/ATen.h" not in text, name


def test_rewrite_without_pch_only_describes(tmp_path: Path) -> None:
    build = write_project(tmp_path, "c++")
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=False)
    text = (build / "build.ninja").read_text()
    assert "description = CXX $in" in text and "rule pch" not in text and ".gch" not in text
    assert not (build / _build.PCH_HEADER).exists()


def test_rewrite_starts_the_slowest_compile_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_build._ninja, "SLOW_SOURCES", {"b.cpp": 30.0})
    build = write_project(tmp_path, "c++")
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=True)
    edges = [line for line in (build / "build.ninja").read_text().splitlines() if ": compile " in line]
    assert [e.split()[1] for e in edges] == ["b.o:", "a.o:"]
    # The link keeps its inputs in their order (static initializers run in link order).
    assert "build lib.so: link a.o b.o" in (build / "build.ninja").read_text()


def test_rewrite_leaves_an_unknown_layout_alone(tmp_path: Path) -> None:
    path = tmp_path / "build.ninja"
    path.write_text("rule cc\n  command = cc $in\nbuild x.o: cc x.c\n")
    _build.rewrite_ninja_file(str(path), pch=True)
    assert path.read_text() == "rule cc\n  command = cc $in\nbuild x.o: cc x.c\n"


@needs_ninja
def test_progress_names_each_file_n_of_n_and_seconds(tmp_path: Path) -> None:
    # A "compiler" that takes a while: every step is slower than the heartbeat.
    build = write_project(tmp_path, fake_compiler(tmp_path, "sleep 0.4"))
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=False)
    stream = io.StringIO()
    said = _build.run_ninja(
        str(build), "Error", stream=stream, verbose=False, heartbeat_s=0.25, title="test build"
    )
    lines = stream.getvalue().splitlines()
    assert said
    assert all(line.startswith(_build.PROGRESS_PREFIX) for line in lines), lines
    assert f"test build: 2 compile steps in {build}" in lines[0]
    progress = [line for line in lines if "] " in line and " s  " in line]
    assert [p.split("]")[0].split("[")[1] for p in progress] == ["1/3", "2/3", "3/3"], lines
    assert {p.rsplit(" ", 1)[1] for p in progress[:2]} == {"a.cpp", "b.cpp"}
    assert progress[2].endswith("linked lib.so")
    seconds = [float(p.split("]")[1].split(" s ")[0]) for p in progress]
    assert seconds == sorted(seconds) and seconds[0] >= 0.3
    assert any("still compiling" in line and "s elapsed" in line for line in lines), lines
    assert lines[-1].startswith(f"{_build.PROGRESS_PREFIX} done in ")

    # Up to date (every warm JIT import): silent.
    quiet = io.StringIO()
    assert not _build.run_ninja(str(build), "Error", stream=quiet, verbose=False)
    assert quiet.getvalue() == ""


@needs_ninja
def test_a_failed_step_raises_with_the_compiler_output(tmp_path: Path) -> None:
    build = write_project(tmp_path, fake_compiler(tmp_path, "echo 'a.cpp:1: error: planted'; exit 1"))
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=False)
    stream = io.StringIO()
    with pytest.raises(RuntimeError, match="planted") as info:
        _build.run_ninja(str(build), "Error compiling", stream=stream, verbose=False)
    assert str(info.value).startswith("Error compiling: ")
    assert "FAILED after" in stream.getvalue()


@needs_ninja
@needs_gcc
def test_the_precompiled_header_is_used(tmp_path: Path, monkeypatch) -> None:
    # A real compile with a small PCH: -H lists "! <file>.gch" when GCC uses a PCH,
    # and -Werror turns -Winvalid-pch (a rejected PCH) into a failure.
    monkeypatch.setattr(_build._ninja, "PCH_INCLUDES", ("vector", "string"))
    build = write_project(
        tmp_path,
        "c++",
        cflags="-O2 -fPIC",
        post="-std=c++17 -H -Werror",
        ldflags="-shared",
        a_body='int a() { std::vector<std::string> v{"x"}; return (int)v.size(); }\n',
    )
    monkeypatch.setattr(_build._ninja, "NO_PCH_SOURCES", frozenset({"b.cpp"}))
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=True)
    stream = io.StringIO()
    _build.run_ninja(str(build), "Error", stream=stream, verbose=True)
    text = stream.getvalue()
    assert f"! {build / _build.PCH_HEADER}.gch" in text, text
    a_cmd = next(c for c in text.splitlines() if "/a.cpp -o" in c)
    b_cmd = next(c for c in text.splitlines() if "/b.cpp -o" in c)
    assert f"-include {build / _build.PCH_HEADER}" in a_cmd and "-include" not in b_cmd, text
    # verbose: ninja's own lines (the full commands, with n of N) pass through
    assert "[1/4] c++ -MMD" in text and "-x c++-header" in text
    assert (build / "lib.so").exists()


def test_hooks_patch_torch_only_while_active() -> None:
    from torch.utils import cpp_extension

    before = (cpp_extension._write_ninja_file, cpp_extension._run_ninja_build)
    with _build.torch_build_hooks():
        assert cpp_extension._write_ninja_file is not before[0]
        assert cpp_extension._run_ninja_build is not before[1]
    assert (cpp_extension._write_ninja_file, cpp_extension._run_ninja_build) == before


# ---------------------------------------------------------------------------
# JIT cache key
# ---------------------------------------------------------------------------
def test_two_prefixes_get_two_jit_directories(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    plan = _build.plan(with_cuda=False)
    a = _loader.jit_build_directory(plan, prefix=str(tmp_path / "venv-a"))
    b = _loader.jit_build_directory(plan, prefix=str(tmp_path / "venv-b"))
    assert a != b
    assert Path(a).parent == Path(b).parent == tmp_path / "ext"
    # Stable: the same environment finds its build again.
    assert _loader.jit_build_directory(plan, prefix=str(tmp_path / "venv-a")) == a
    # This process's own prefix is the default.
    assert _loader.jit_build_directory(plan) == _loader.jit_build_directory(plan, prefix=sys.prefix)


@pytest.mark.skipif(not _build.CSRC_DIR.is_dir(), reason="the JIT build needs csrc/ (a source checkout)")
def test_the_jit_build_uses_the_keyed_directory(tmp_path: Path, monkeypatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_load(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    for prefix in ("venv-a", "venv-b"):
        monkeypatch.setattr(sys, "prefix", str(tmp_path / prefix))
        with pytest.raises(Exception):  # noqa: B017 (the loader wraps the fake's Stop in its own error)
            _loader._jit_build()
        seen[prefix] = seen["build_directory"]
        assert Path(seen["build_directory"]).name == seen["name"]
    assert seen["venv-a"] != seen["venv-b"]


@pytest.mark.parametrize(
    "change",
    [
        lambda k: k.update(torch="9.9.9"),
        lambda k: k.update(torch_cuda="99.9"),  # differs from any real build
        # Another Python's suffix, whichever Python runs the test.
        lambda k: k.update(
            python=next(
                s
                for s in (".cpython-312-x86_64-linux-gnu.so", ".cpython-313-x86_64-linux-gnu.so")
                if s != k["python"]
            )
        ),
        lambda k: k.update(cxx_flags=k["cxx_flags"] + ["-O0"]),
        lambda k: k.update(with_cuda=True),
    ],
    ids=["torch", "torch-cuda", "python-abi", "flags", "cuda-build"],
)
def test_every_incompatibility_changes_the_name(monkeypatch, change) -> None:
    plan = _build.plan(with_cuda=False)
    key = _build.jit_cache_key(plan)
    base = _build.jit_name(plan)
    changed = dict(key)
    change(changed)
    monkeypatch.setattr(_build, "jit_cache_key", lambda build, prefix=None: changed)
    assert _build.jit_name(plan) != base
    assert base.startswith(
        f"cublas_guard_ext_cpu_torch{torch.__version__.replace('.', '_').replace('+', '_')}_py"
    )


# ---------------------------------------------------------------------------
# CUDA toolkit vs torch's CUDA wheels (faked toolkits and wheels: no GPU, no real nvcc)
# ---------------------------------------------------------------------------
def compile_like_torch(
    tmp_path: Path, plan: _build.BuildPlan, toolkit: Path, extra_includes: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Preprocess a file that includes cublas_v2.h the way torch's builders order the
    include path: the plan's dirs (-I), then torch's with the toolkit's (-isystem), then
    the plan's own flags (which carry the -idirafter dirs)."""

    source = tmp_path / "uses_cublas.cpp"
    source.write_text(
        "#include <cublas_v2.h>\n#include <crt/host_config.h>\n"
        'static_assert(FAKE_CUDART == 13000 && FAKE_CUBLAS == 1 && FAKE_TOOLKIT_CRT, "");\n'
    )
    command = (
        [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only"]
        + [f"-I{d}" for d in list(extra_includes) + plan.include_dirs]
        + ["-isystem", str(toolkit / "include")]
        + [f for f in plan.cxx_flags if f.startswith("-idirafter")]
        + [str(source)]
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _cxx_runs() -> bool:
    """A C++ compiler that runs (the version matrix sets CXX=false: the wheel needs none)."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    return cxx is not None and subprocess.run([cxx, "--version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _cxx_runs(), reason="needs a C++ compiler")
def test_only_the_headers_the_toolkit_lacks_come_from_the_wheel(tmp_path: Path, cuda_facts) -> None:
    toolkit = cuda_facts("13.0")
    plan = _build.plan(with_cuda=True)
    wheel = str(cuda_facts.wheel)
    assert plan.with_cuda and wheel not in plan.include_dirs, plan.include_dirs
    [private] = plan.include_dirs_after
    assert Path(private).parent == tmp_path / "ext"
    # cuBLAS, cuBLASLt, cuSPARSE (ATen's CUDA headers include them); not the runtime's own.
    assert sorted(os.listdir(private)) == ["cublasLt.h", "cublas_api.h", "cublas_v2.h", "cusparse.h"]
    assert os.readlink(os.path.join(private, "cublas_v2.h")) == os.path.join(
        os.path.realpath(wheel), "cublas_v2.h"
    )
    assert f"-idirafter{private}" in plan.cxx_flags
    i = plan.nvcc_flags.index(f"-idirafter{private}")
    assert plan.nvcc_flags[i - 1] == "-Xcompiler"  # nvcc has no -idirafter of its own
    # A real compile: the toolkit's cuda_runtime.h and crt/, the wheel's cuBLAS.
    result = compile_like_torch(tmp_path, plan, toolkit)
    assert result.returncode == 0, result.stderr
    # The layout before the fix (the wheel folder on the include path) meets the #error.
    before = compile_like_torch(tmp_path, plan, toolkit, extra_includes=(wheel,))
    assert before.returncode != 0 and "toolkit headers are incompatible" in before.stderr
    # Stable: the next plan (every JIT import makes one) reuses the same folder.
    assert _build.plan(with_cuda=True).include_dirs_after == [private]


def test_a_toolkit_with_cublas_takes_nothing_from_the_wheel(cuda_facts) -> None:
    cuda_facts("13.2", with_cublas=True)
    plan = _build.plan(with_cuda=True)
    # cublas_v2.h is the toolkit's: only what it lacks (here cuBLASLt, cuSPARSE, the API header).
    [private] = plan.include_dirs_after
    assert "cublas_v2.h" not in os.listdir(private) and "cuda_runtime.h" not in os.listdir(private)
    assert plan.notes == []  # same CUDA release: nothing to say


def test_a_cuda_version_mismatch_is_said_before_compiling(tmp_path: Path, cuda_facts) -> None:
    cuda_facts("13.0")
    plan = _build.plan()
    assert plan.with_cuda and "(nvcc 13.0, torch's CUDA 13.2)" in plan.reason
    [note] = plan.notes
    assert "is CUDA 13.0" in note and "built with CUDA 13.2" in note, note
    assert "Fix: a CUDA 13.2 toolkit (CUDA_HOME=<its root>), or a torch built for CUDA 13.0" in note
    # apply_env hands the note to the build hooks: first, before any compile step finishes.
    _build.apply_env(plan)
    build = write_project(tmp_path, fake_compiler(tmp_path, "sleep 0.2"))
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=False)  # as the write hook does
    stream = io.StringIO()
    with _build.torch_build_hooks(stream=stream):
        from torch.utils import cpp_extension

        cpp_extension._run_ninja_build(str(build), False, "Error")
    lines = stream.getvalue().splitlines()
    assert lines[0] == f"{_build.PROGRESS_PREFIX} NOTE: {note}", lines
    assert "compile steps" in lines[1] and "] " in lines[2]
    # An up-to-date build (a warm JIT import) says nothing, the note neither.
    quiet = io.StringIO()
    with _build.torch_build_hooks(stream=quiet):
        cpp_extension._run_ninja_build(str(build), False, "Error")
    assert quiet.getvalue() == ""


def test_another_cuda_major_builds_cpu_only_and_says_why(cuda_facts, monkeypatch) -> None:
    cuda_facts("12.4")
    with_cuda, reason = _build.decide_cuda()
    assert not with_cuda
    assert reason.startswith("WARNING: nvcc at ") and "is CUDA 12.4" in reason and "CUDA 13.2" in reason
    assert "building CPU-only" in reason and "Fix: a CUDA 13.2 toolkit" in reason
    assert not _build.plan().with_cuda
    monkeypatch.setenv("FORCE_CUDA", "1")
    with pytest.raises(RuntimeError, match=r"FORCE_CUDA=1 but nvcc at .* is CUDA 12\.4"):
        _build.decide_cuda()


def test_no_cublas_headers_anywhere_builds_cpu_only(cuda_facts, monkeypatch) -> None:
    cuda_facts("13.2")
    monkeypatch.setattr(_toolkit, "cublas_include_dirs", lambda: [])
    with_cuda, reason = _build.decide_cuda()
    assert not with_cuda and reason.startswith("WARNING: no cuBLAS headers (cublas_v2.h)"), reason
    assert "pip install the nvidia-cublas wheel of torch's CUDA 13.2" in reason
    monkeypatch.setenv("FORCE_CUDA", "1")  # forced: the build itself reports the missing headers
    assert _build.decide_cuda()[0]


def test_the_jit_key_is_the_same_before_and_after_apply_env(cuda_facts, monkeypatch) -> None:
    cuda_facts("13.2", with_cublas=True)
    plan = _build.plan(with_cuda=True)
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ and "TORCH_CUDA_ARCH_LIST" in plan.env
    before = _build.jit_name(plan)
    assert _build.jit_cache_key(plan)["arch_list"] == plan.env["TORCH_CUDA_ARCH_LIST"]
    _build.apply_env(plan)  # the loader's order: plan, apply_env, then the name
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == plan.env["TORCH_CUDA_ARCH_LIST"]
    assert _build.jit_name(plan) == before
    # A plan made after apply_env (a test, the doctor) finds the same directory.
    assert _build.jit_name(_build.plan(with_cuda=True)) == before
    # The user's own list is another build: another directory.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert _build.jit_cache_key(_build.plan(with_cuda=True))["arch_list"] == "8.6"
    assert _build.jit_name(_build.plan(with_cuda=True)) != before
    # An empty setting is no setting: torch would try to detect a GPU and fail.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")
    empty = _build.plan(with_cuda=True)
    assert _build.jit_name(empty) == before
    _build.apply_env(empty)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == plan.env["TORCH_CUDA_ARCH_LIST"]


@pytest.mark.skipif(not _build.CSRC_DIR.is_dir(), reason="the JIT build needs csrc/ (a source checkout)")
def test_a_failed_cuda_jit_build_falls_back_to_cpu_and_remembers(
    tmp_path: Path, cuda_facts, monkeypatch, capsys
) -> None:
    from cublas_guard_ext.errors import ExtensionBuildError

    cuda_facts("13.2", with_cublas=True)
    built: list[bool] = []

    def fake_build(plan):
        built.append(plan.with_cuda)
        if plan.with_cuda:
            try:
                raise RuntimeError("Error building extension:\nlinear.cu(12): error: planted")
            except RuntimeError as exc:
                raise ExtensionBuildError(missing="a successful compile", detail="...", fix="...") from exc
        return _loader.NativeInfo("jit", "/x.so", False, "cpu")

    monkeypatch.setattr(_loader, "_jit_build_plan", fake_build)
    assert _loader._jit_build().detail == "cpu" and built == [True, False]
    err = capsys.readouterr().err
    assert "WARNING: the CUDA build failed" in err and "building the CPU-only extension instead" in err
    assert "linear.cu(12): error: planted" in err and "FORCE_CUDA=1 makes this an error" in err
    marker = Path(_loader.jit_build_directory(_build.plan(with_cuda=True))) / _toolkit.CUDA_FAILED_MARKER
    assert marker.is_file()
    # The next import does not fail the same compile again: straight to the CPU build.
    built.clear()
    assert _loader._jit_build().detail == "cpu" and built == [False]
    assert f"the CUDA build failed before ({marker})" in capsys.readouterr().err
    # A source edited since (newer than the marker) retries the CUDA build.
    os.utime(marker, (1, 1))
    built.clear()
    _loader._jit_build()
    assert built == [True, False]
    # FORCE_CUDA=1: the failure is the user's answer, no fallback.
    monkeypatch.setenv("FORCE_CUDA", "1")
    built.clear()
    with pytest.raises(ExtensionBuildError, match="a successful compile"):
        _loader._jit_build()
    assert built == [True]


def test_no_fallback_for_what_a_cpu_build_lacks_too(cuda_facts) -> None:
    from cublas_guard_ext.errors import ExtensionBuildError

    cuda_facts("13.2", with_cublas=True)
    plan = _build.plan(with_cuda=True)
    no_ninja = ExtensionBuildError(missing="ninja", detail="...", fix="pip install ninja")
    assert _build.cuda_fallback_note(plan, no_ninja) is None
    assert _build.cuda_fallback_note(_build.plan(with_cuda=False), RuntimeError("x")) is None
    assert _build.cuda_fallback_note(plan, RuntimeError("nvcc: error")) is not None
