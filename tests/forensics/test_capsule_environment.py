"""The capsule's library facts are read once and again only when what they come from changed:
a library mapped or unmapped (/proc/self/maps), LD_LIBRARY_PATH, a wheel installed or removed
(a sys.path folder's mtime). Every failing call writes a capsule; these facts cost milliseconds."""

from __future__ import annotations

import os

import pytest

from cublas_guard_ext._native.machine import libraries
from cublas_guard_ext.capsule import environment_block as block


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the facts were really read (loaded_cublas is the first of them)."""
    count = [0]
    original = block.loaded_cublas

    def counting():
        count[0] += 1
        return original()

    monkeypatch.setattr(block, "loaded_cublas", counting)
    monkeypatch.setattr(block, "_LIBRARY_FACTS", None)
    return count


def test_unchanged_facts_are_read_once_and_each_caller_gets_its_own_copy(reads: list[int]) -> None:
    first = block.environment()
    first["loaded_libraries"]["conflicts"].append("edited by a caller")
    second = block.environment()
    assert reads == [1]
    assert "edited by a caller" not in second["loaded_libraries"]["conflicts"]
    # ...and the cached facts are what a fresh reading says
    own = (block._BUILD_INFO or {}).get("path")
    assert second["libraries"] == block.loaded_cublas()
    assert second["loaded_libraries"] == block._loaded_libraries(own)
    assert second["nvidia_wheels"] == block._nvidia_wheels()


def test_a_new_mapping_rereads_them(reads: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    block.environment()
    text = libraries._maps_text()
    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /opt/elsewhere/libcublas.so.13\n"
    monkeypatch.setattr(libraries, "_maps_text", lambda: text + line)
    block.environment()
    assert reads == [2]


def test_ld_library_path_rereads_them(reads: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    block.environment()
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/elsewhere/lib64")
    block.environment()
    assert reads == [2]


def test_a_wheel_installed_on_sys_path_rereads_them(
    reads: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    block.environment()
    (tmp_path / "nvidia_cublas-13.1.0.3.dist-info").mkdir()  # the folder's mtime moves
    os.utime(tmp_path, ns=(0, os.stat(tmp_path).st_mtime_ns + 1_000_000))
    block.environment()
    assert reads == [2]


def test_quick_conflicts_are_classified_again_only_when_the_maps_or_the_path_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every error's constructor asks for them: unchanged sources, one classification; a
    libcublasLt mapped from a second folder is seen at the next error."""
    count = [0]
    original = libraries.conflicts

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(libraries, "conflicts", counting)
    monkeypatch.setattr(libraries, "_QUICK", None)
    before = libraries.quick_conflicts()
    before.append({"kind": "edited by a caller"})
    assert libraries.quick_conflicts() == before[:-1] and count == [1]
    text = libraries._maps_text()
    two = (
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 41 /opt/one/libcublas.so.13\n"
        "7f0000001000-7f0000002000 r-xp 00000000 08:01 42 /opt/one/libcublasLt.so.13\n"
        "7f0000002000-7f0000003000 r-xp 00000000 08:01 43 /opt/two/libcublasLt.so.13\n"
    )
    monkeypatch.setattr(libraries, "_maps_text", lambda: text + two)
    found = libraries.quick_conflicts()
    assert count == [2]
    assert any("/opt/two/libcublasLt.so.13" in str(c) for c in found), found
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/two")
    libraries.quick_conflicts()
    assert count == [3]
