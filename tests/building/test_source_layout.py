"""The two libraries' seam, visible in csrc/: a file's library is its folder.

Under csrc/locked/ stand the version-locked library's own files (``LOCKED_*`` in
cublas_guard_ext/_native/building/sources.py); everywhere else the stable core's (``CORE_*``), compiled into
both libraries and so never including a header from csrc/locked/ (the core is built against the
stable ABI alone: a locked header would pull ATen or Python's C API into it). sources.py and the
tree are held to the same rule here, and each rule is shown to catch a violation.

The folders are layers too (csrc/README.md, "The layers"): a file includes only from its own
layer or below, so no include runs back up.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from cublas_guard_ext._native.building import sources

CSRC = Path(__file__).resolve().parents[2] / "csrc"
LOCKED = "locked/"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# Bottom to top; "" is the top-level files (ops.cpp, testing.cpp). locked/ is one layer, above all.
LAYERS = ("core", "report", "scan", "linear", "cuda", "moe", "replay", "", "locked")

pytestmark = pytest.mark.skipif(not CSRC.is_dir(), reason="needs csrc/ (a source checkout)")


def _lists() -> dict[str, tuple[str, ...]]:
    return {
        "CORE_CPU_SOURCES": sources.CORE_CPU_SOURCES,
        "CORE_CUDA_SOURCES": sources.CORE_CUDA_SOURCES,
        "CORE_MODULE_SOURCE": (sources.CORE_MODULE_SOURCE,),
        "LOCKED_CPU_SOURCES": sources.LOCKED_CPU_SOURCES,
        "LOCKED_CUDA_SOURCES": sources.LOCKED_CUDA_SOURCES,
    }


def _includes(csrc: Path, name: str) -> list[str]:
    """The files of csrc/ that ``name`` includes with quotes (relative to csrc/, as the build's
    -I csrc resolves them; a name not under csrc/ is torch's or the system's)."""
    text = (csrc / name).read_text()
    return [inc for inc in _INCLUDE.findall(text) if (csrc / inc).is_file()]


def _locked_chain(csrc: Path, source: str) -> list[str] | None:
    """The include chain from ``source`` to the first file under locked/, or None."""
    seen: set[str] = set()
    stack: list[list[str]] = [[source]]
    while stack:
        chain = stack.pop()
        for inc in _includes(csrc, chain[-1]):
            if inc.startswith(LOCKED):
                return [*chain, inc]
            if inc not in seen:
                seen.add(inc)
                stack.append([*chain, inc])
    return None


def layout_problems(csrc: Path, lists: dict[str, tuple[str, ...]]) -> list[str]:
    """Every way sources.py's ``lists`` and the tree under ``csrc`` disagree with the rule."""
    problems = []
    on_disk = {p.relative_to(csrc).as_posix() for p in csrc.rglob("*") if p.suffix in (".cpp", ".cu")}
    listed = Counter(s for names in lists.values() for s in names)
    for name in sorted(on_disk - set(listed)):
        problems.append(f"csrc/{name} is in no list of sources.py")
    for name in sorted(set(listed) - on_disk):
        problems.append(f"sources.py lists {name}, which is not in csrc/")
    for name, count in sorted(listed.items()):
        if count > 1:
            problems.append(f"sources.py lists {name} {count} times")
    bases = Counter(Path(s).name for s in listed)
    for base, count in sorted(bases.items()):
        if count > 1:
            problems.append(
                f"{count} sources are named {base} (torch's JIT builder names objects by base name)"
            )
    for list_name, names in lists.items():
        locked_list = list_name.startswith("LOCKED_")
        for name in names:
            if name.startswith(LOCKED) and not locked_list:
                problems.append(f"{name} stands under csrc/{LOCKED} but is in {list_name}")
            elif locked_list and not name.startswith(LOCKED):
                problems.append(f"{name} is in {list_name} but stands outside csrc/{LOCKED}")
            elif not locked_list and name in on_disk:
                chain = _locked_chain(csrc, name)
                if chain is not None:
                    problems.append(f"core source {name} includes a locked header: {' -> '.join(chain)}")
    return problems


def _layer(name: str) -> str:
    return name.split("/")[0] if "/" in name else ""


def upward_includes(csrc: Path) -> list[str]:
    """Every include from a lower layer of ``csrc`` to a higher one, and every file in a folder
    that is no layer."""
    problems = []
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in (".h", ".cpp", ".cu")):
        name = path.relative_to(csrc).as_posix()
        if _layer(name) not in LAYERS:
            problems.append(
                f"{name}: folder {_layer(name)}/ is in no layer (add it to LAYERS and csrc/README.md)"
            )
            continue
        for inc in _includes(csrc, name):
            if _layer(inc) in LAYERS and LAYERS.index(_layer(inc)) > LAYERS.index(_layer(name)):
                problems.append(
                    f"{name} includes {inc}: {_layer(name) or 'top'} -> {_layer(inc) or 'top'} runs back up"
                )
    return problems


def test_no_include_runs_back_up() -> None:
    assert upward_includes(CSRC) == []


def test_an_include_running_back_up_and_a_folder_of_no_layer_are_named(tree: Path) -> None:
    errors = tree / "report" / "errors.cpp"
    errors.write_text('#include "linear/linear_op.h"\n' + errors.read_text())
    (tree / "extra").mkdir()
    (tree / "extra" / "thing.h").write_text("#pragma once\n")
    assert upward_includes(tree) == [
        "extra/thing.h: folder extra/ is in no layer (add it to LAYERS and csrc/README.md)",
        "report/errors.cpp includes linear/linear_op.h: report -> linear runs back up",
    ]


def test_sources_py_and_the_tree_follow_one_rule() -> None:
    assert layout_problems(CSRC, _lists()) == []


def test_the_locked_folder_holds_the_locked_sources() -> None:
    locked = [*sources.LOCKED_CPU_SOURCES, *sources.LOCKED_CUDA_SOURCES]
    assert locked and all(s.startswith(LOCKED) for s in locked)
    assert "locked/watch/watch_scan.cu" in sources.LOCKED_CUDA_SOURCES


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    return copy


def test_a_core_source_including_a_locked_header_is_named_with_its_chain(tree: Path) -> None:
    # Through a core header, so that only following the includes finds it.
    header = tree / "scan" / "strided_index.h"
    header.write_text('#include "locked/watch/watch.h"\n' + header.read_text())
    problems = layout_problems(tree, _lists())
    assert "core source cuda/scan.cu includes a locked header: " in "\n".join(problems)
    assert (
        "core source linear/gemm_route.cpp includes a locked header: "
        "linear/gemm_route.cpp -> scan/strided_index.h -> locked/watch/watch.h"
    ) in problems


def test_a_locked_source_outside_the_folder_and_a_core_one_inside_are_named(tree: Path) -> None:
    lists = _lists()
    (tree / "locked" / "ops_meta.cpp").rename(tree / "ops_meta.cpp")
    (tree / "testing.cpp").rename(tree / "locked" / "testing.cpp")
    lists["LOCKED_CPU_SOURCES"] = tuple(
        "ops_meta.cpp" if s == "locked/ops_meta.cpp" else s for s in lists["LOCKED_CPU_SOURCES"]
    )
    lists["CORE_CPU_SOURCES"] = tuple(
        "locked/testing.cpp" if s == "testing.cpp" else s for s in lists["CORE_CPU_SOURCES"]
    )
    problems = layout_problems(tree, lists)
    assert "ops_meta.cpp is in LOCKED_CPU_SOURCES but stands outside csrc/locked/" in problems
    assert "locked/testing.cpp stands under csrc/locked/ but is in CORE_CPU_SOURCES" in problems


def test_a_file_in_no_list_a_missing_one_and_duplicates_are_named(tree: Path) -> None:
    lists = _lists()
    (tree / "locked" / "watch" / "watch_extra.cpp").write_text("// not listed\n")
    (tree / "locked" / "report" / "checks.cpp").write_text("// linear/checks.cpp's base name\n")
    lists["LOCKED_CUDA_SOURCES"] += ("locked/watch/gone.cu", "locked/watch/watch_ops.cpp")
    lists["LOCKED_CPU_SOURCES"] += ("locked/report/checks.cpp",)
    problems = layout_problems(tree, lists)
    assert "csrc/locked/watch/watch_extra.cpp is in no list of sources.py" in problems
    assert "sources.py lists locked/watch/gone.cu, which is not in csrc/" in problems
    assert "sources.py lists locked/watch/watch_ops.cpp 2 times" in problems
    assert "2 sources are named checks.cpp (torch's JIT builder names objects by base name)" in problems
