"""The unity build (cublas_guard_ext/_native/building/unity_build.py): which files each library
compiles, what a generated group holds, and that no file of a group waits for the PCH.
Fast: no compiler; the builds themselves are tests/building/test_build.py's (slow), the
file-by-file build CI's sanitizer stage, the CUDA builds' groups .ci/nvcc_check.sh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cublas_guard_ext._native.building import build as _build
from cublas_guard_ext._native.building import core_build as _core_build
from cublas_guard_ext._native.building import sources as _sources
from cublas_guard_ext._native.building import unity_build as _unity

needs_sources = pytest.mark.skipif(not _build.CSRC_DIR.is_dir(), reason="needs csrc/ (a source checkout)")


@pytest.fixture(autouse=True)
def unity_on(monkeypatch) -> None:
    monkeypatch.delenv(_unity.ENV_SWITCH, raising=False)


def included(path: str) -> list[str]:
    return [line.split('"')[1] for line in Path(path).read_text().splitlines() if line.startswith("#include")]


@needs_sources
def test_the_locked_cpu_build_compiles_two_files_one_per_layer(tmp_path: Path) -> None:
    plan = _build.plan(with_cuda=False)
    compiled = _unity.unity_sources(plan.sources, tmp_path)
    assert [Path(s).name for s in compiled] == ["unity_core.cpp", "unity_locked.cpp"]
    # Each source once, in the order of the source lists, each group in its own file.
    assert included(compiled[0]) == list(_sources.CORE_CPU_SOURCES)
    assert included(compiled[1]) == list(_sources.LOCKED_CPU_SOURCES)
    # Found through the include dir every plan has (csrc/), not by this checkout's path.
    assert str(_build.CSRC_DIR) in plan.include_dirs
    assert str(_build.CSRC_DIR) not in Path(compiled[0]).read_text()


@needs_sources
def test_the_stable_core_compiles_one_file(tmp_path: Path) -> None:
    compiled = _unity.unity_sources(_core_build.cpu_plan().sources, tmp_path)
    assert [Path(s).name for s in compiled] == ["unity_core.cpp"]
    assert included(compiled[0]) == [*_sources.CORE_CPU_SOURCES, _sources.CORE_MODULE_SOURCE]


@needs_sources
def test_cuda_files_stay_alone_and_a_group_takes_its_first_files_place(tmp_path: Path) -> None:
    csrc = _build.CSRC_DIR
    sources = [
        str(csrc / "cuda/scan.cu"),
        str(csrc / "ops.cpp"),
        str(csrc / "locked/watch/watch_ops.cpp"),
        str(csrc / "replay/replay_cuda.cu"),
        str(csrc / "testing.cpp"),
        str(csrc / "locked/watch/watch_verify.cpp"),
        str(tmp_path / "elsewhere.cpp"),  # not a csrc/ file: compiled as given
    ]
    compiled = _unity.unity_sources(sources, tmp_path / "u")
    assert compiled == [
        sources[0],
        str(tmp_path / "u" / "unity_core.cpp"),
        str(tmp_path / "u" / "unity_locked.cpp"),
        sources[3],
        sources[6],
    ]
    assert included(compiled[1]) == ["ops.cpp", "testing.cpp"]
    assert included(compiled[2]) == ["locked/watch/watch_ops.cpp", "locked/watch/watch_verify.cpp"]


@needs_sources
def test_a_group_of_one_file_is_that_file(tmp_path: Path) -> None:
    sources = [str(_build.CSRC_DIR / "ops.cpp"), str(_build.CSRC_DIR / "locked/watch/watch_ops.cpp")]
    assert _unity.unity_sources(sources, tmp_path) == sources
    assert not list(tmp_path.iterdir())


@needs_sources
def test_relative_directory_gives_relative_paths(tmp_path: Path, monkeypatch) -> None:
    # setup.py gives build/unity/<library> relative to the checkout: setuptools wants relative paths.
    monkeypatch.chdir(tmp_path)
    compiled = _unity.unity_sources(_core_build.cpu_plan().sources, Path("build") / "unity" / "_core")
    assert compiled == [os.path.join("build", "unity", "_core", "unity_core.cpp")]
    assert (tmp_path / compiled[0]).is_file()


@needs_sources
def test_an_unchanged_group_is_not_rewritten(tmp_path: Path) -> None:
    # ninja rebuilds what is newer than its object: an up-to-date build must stay up to date.
    sources = _build.plan(with_cuda=False).sources
    first = Path(_unity.unity_sources(sources, tmp_path)[0])
    os.utime(first, (1_000_000, 1_000_000))
    assert Path(_unity.unity_sources(sources, tmp_path)[0]) == first
    assert first.stat().st_mtime == 1_000_000
    # A changed list is written (one core source fewer).
    _unity.unity_sources(sources[:1] + sources[2:], tmp_path)
    assert first.stat().st_mtime != 1_000_000


@needs_sources
def test_the_switch_off_compiles_file_by_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(_unity.ENV_SWITCH, "0")
    sources = _build.plan(with_cuda=False).sources
    assert not _unity.unity_enabled()
    assert _unity.unity_sources(sources, tmp_path) == sources
    assert not list(tmp_path.iterdir())


def test_every_cpp_source_of_every_build_is_in_exactly_one_group() -> None:
    # A new source outside every group would compile alone, parsing torch's headers once more.
    lists = (
        _sources.CPU_SOURCES,
        _sources.CUDA_SOURCES,
        _sources.CORE_CPU_SOURCES,
        _sources.CORE_CUDA_SOURCES,
        (_sources.CORE_MODULE_SOURCE,),
    )
    cpp = {name for names in lists for name in names if name.endswith(".cpp")}
    grouped = [name for names in _sources.UNITY_GROUPS.values() for name in names]
    assert len(grouped) == len(set(grouped)), "a source in two groups would be compiled twice"
    assert cpp == set(grouped)
    # The locked library's own sources never join the core's group: the stable core has no ATen.
    assert not set(_sources.UNITY_GROUPS["core"]) & set(_sources.LOCKED_CPU_SOURCES)


def test_unity_groups_do_not_wait_for_the_precompiled_header(tmp_path: Path) -> None:
    build = tmp_path / "b"
    build.mkdir()
    edges = [
        f"build {build}/unity_core.o: compile {tmp_path}/u/unity_core.cpp",
        f"build {build}/unity_locked.o: compile {tmp_path}/u/unity_locked.cpp",
    ]
    (build / "build.ninja").write_text(
        "ninja_required_version = 1.3\ncxx = c++\n\ncflags = -O2\npost_cflags = \n\n"
        "rule compile\n  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags\n"
        "  depfile = $out.d\n  deps = gcc\n\n" + "\n".join(edges) + "\n"
    )
    _build.rewrite_ninja_file(str(build / "build.ninja"), pch=True)
    text = (build / "build.ninja").read_text()
    # No file would use it: no PCH edge, no -include, no 430 MB header built for nothing.
    assert "rule pch" not in text and ".gch" not in text and "-include" not in text, text
    assert not (build / _build.PCH_HEADER).exists()
    # The larger group starts first.
    assert text.index("unity_locked.o") < text.index("unity_core.o")
