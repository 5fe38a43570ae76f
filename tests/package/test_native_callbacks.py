"""The native library calls Python by name (PyImport_ImportModule, PyObject_CallMethod,
PyObject_GetAttrString), which no import graph sees: every such call goes through
cublas_guard_ext._native_callbacks, and each name csrc/ mentions exists there."""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CALLBACKS = "cublas_guard_ext._native_callbacks"
_IMPORT = re.compile(r'PyImport_ImportModule\(\s*"([^"]+)"\s*\)')
_ATTRIBUTE = re.compile(r'PyObject_(?:CallMethod|GetAttrString)\(\s*\w+\s*,\s*"([^"]+)"')


def native_calls(root: Path) -> tuple[set[str], set[str]]:
    """The modules csrc/ imports, and the attributes it reads in the files that import one."""
    modules, attributes = set(), set()
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu", ".cuh"):
            continue
        text = path.read_text(encoding="utf-8")
        found = set(_IMPORT.findall(text))
        if found:
            modules |= found
            attributes |= set(_ATTRIBUTE.findall(text))
    return modules, attributes


def problems(root: Path) -> list[str]:
    modules, attributes = native_calls(root)
    out = [f"csrc/ imports {m} by name: go through {CALLBACKS}" for m in sorted(modules - {CALLBACKS})]
    module = importlib.import_module(CALLBACKS)
    out += [
        f"csrc/ reads {CALLBACKS}.{a}, which does not exist"
        for a in sorted(attributes)
        if not hasattr(module, a)
    ]
    out += [
        f"{CALLBACKS}.__all__ lists {a}, which csrc/ never reads"
        for a in sorted(set(module.__all__) - attributes)
    ]
    return out


def test_the_native_calls_are_found() -> None:
    modules, attributes = native_calls(CSRC)
    assert modules == {CALLBACKS}
    assert {"typed_error", "watch_op_failure", "watch_finding", "GuardError"} <= attributes


def test_every_name_csrc_calls_exists() -> None:
    assert problems(CSRC) == []


def test_a_planted_call_by_another_name_fails(tmp_path: Path) -> None:
    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root)
    target = root / "locked" / "watch" / "watch_session.cpp"
    target.write_text(target.read_text().replace('"watch_finding"', '"_typed"'))
    assert problems(root) == [
        f"csrc/ reads {CALLBACKS}._typed, which does not exist",
        f"{CALLBACKS}.__all__ lists watch_finding, which csrc/ never reads",
    ]
    (root / "extra.cpp").write_text('PyObject* m = PyImport_ImportModule("cublas_guard_ext.watch");\n')
    assert f"csrc/ imports cublas_guard_ext.watch by name: go through {CALLBACKS}" in problems(root)


def test_the_callbacks_reach_the_code_behind_them() -> None:
    from cublas_guard_ext import _native_callbacks as callbacks
    from cublas_guard_ext import errors

    assert callbacks.GuardError is errors.GuardError
    assert callbacks.typed_error("not a payload", None) is None
    err = callbacks.watch_finding("plain message, no payload")
    assert type(err) is errors.GuardError and str(err) == "plain message, no payload"
