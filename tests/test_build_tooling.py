"""The build tooling shared by setup.py and the JIT loader: the progress a person
sees while ninja runs, the precompiled header added to torch's build.ninja, and
the JIT cache key. Fast: tiny ninja projects, no extension build."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cublas_guard_ext._native import build as _build
from cublas_guard_ext._native import loader as _loader

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


def write_project(tmp_path: Path, cxx: str, cflags: str = "", post: str = "", ldflags: str = "",
                  a_body: str = "int a() { return 1; }\n") -> Path:
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
    monkeypatch.setattr(_build, "NO_PCH_SOURCES", frozenset({"a.cpp"}))
    monkeypatch.setattr(_build, "SLOW_SOURCES", {"a.cpp": 50.0})
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
    for name in _build.NO_PCH_SOURCES if _build.CSRC_DIR.is_dir() else ():  # (an installed build has no csrc/)
        text = (_build.CSRC_DIR / name).read_text()
        assert "torch/library.h" not in text and "ATen/ATen.h" not in text, name


def test_rewrite_without_pch_only_describes(tmp_path: Path) -> None:
    build = write_project(tmp_path, "c++")
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=False)
    text = (build / "build.ninja").read_text()
    assert "description = CXX $in" in text and "rule pch" not in text and ".gch" not in text
    assert not (build / _build.PCH_HEADER).exists()


def test_rewrite_starts_the_slowest_compile_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_build, "SLOW_SOURCES", {"b.cpp": 30.0})
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
    said = _build.run_ninja(str(build), "Error", stream=stream, verbose=False, heartbeat_s=0.25,
                            title="test build")
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
    monkeypatch.setattr(_build, "PCH_INCLUDES", ("vector", "string"))
    build = write_project(tmp_path, "c++", cflags="-O2 -fPIC", post="-std=c++17 -H -Werror",
                          ldflags="-shared",
                          a_body="int a() { std::vector<std::string> v{\"x\"}; return (int)v.size(); }\n")
    monkeypatch.setattr(_build, "NO_PCH_SOURCES", frozenset({"b.cpp"}))
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
        lambda k: k.update(python=".cpython-312-x86_64-linux-gnu.so"),
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
    assert base.startswith(f"cublas_guard_ext_cpu_torch{torch.__version__.replace('.', '_').replace('+', '_')}_py")
