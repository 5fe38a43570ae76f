"""cublas_guard_ext.errors as a package by concern: it exports exactly its ``__all__``, every
error class of cublas_guard_ext lives in it, each module stays under 600 lines, and messages
point at our own tools."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import types
from pathlib import Path

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext import errors

PACKAGE_ROOT = Path(cg.__file__).parent
ERRORS_ROOT = PACKAGE_ROOT / "errors"

# Error classes defined outside errors/, each with why it cannot live there.
DEFINED_ELSEWHERE = {
    "capsule/safe_read.py:CapsuleFileError": "the capsule reader's refusal of a file that is no "
    "capsule: a plain ValueError (the replay command prints it as one line), not a GuardError, "
    "kept beside the reader it belongs to",
    "run/options.py:UsageError": "the run bootstrap parses its options in processes that never "
    "import torch, and importing errors imports torch",
}


def test_the_package_exports_exactly_its_all() -> None:
    public = {
        name
        for name, value in vars(errors).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and type(value).__name__ != "_Feature"  # `from __future__ import annotations`
    }
    assert public == set(errors.__all__)
    for name in errors.__all__:
        exec(f"from cublas_guard_ext.errors import {name}", {})


def test_every_public_error_class_of_errors_is_exported() -> None:
    classes = set()
    for info in pkgutil.iter_modules([str(ERRORS_ROOT)]):
        module = importlib.import_module(f"cublas_guard_ext.errors.{info.name}")
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                classes.add(name)
    assert classes, "no error class found under errors/"
    assert classes <= set(errors.__all__), sorted(classes - set(errors.__all__))


def exception_classes_outside_errors(root: Path = PACKAGE_ROOT) -> set[str]:
    """``file:Class`` for every class under ``root`` but outside errors/ that derives, directly
    or through other classes of the package, from an exception class (read from the source:
    nothing is imported)."""
    builtin_errors = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    defined: list[tuple[str, str, list[str]]] = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                defined.append((where, node.name, bases))
    exceptions = set(builtin_errors) | {"OutOfMemoryError"}
    grew = True
    while grew:
        grew = False
        for _, name, bases in defined:
            if name not in exceptions and any(b in exceptions or b.endswith("Error") for b in bases):
                exceptions.add(name)
                grew = True
    return {
        f"{where}:{name}"
        for where, name, _ in defined
        if name in exceptions and not where.startswith("errors/")
    }


def test_every_error_class_lives_in_errors() -> None:
    assert exception_classes_outside_errors() == set(DEFINED_ELSEWHERE)


def test_a_planted_error_class_outside_errors_is_found(tmp_path: Path) -> None:
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "base.py").write_text("class GuardError(Exception):\n    pass\n")
    (tmp_path / "watch.py").write_text(
        "from .errors.base import GuardError\n\nclass Finding(GuardError, RuntimeError):\n    pass\n"
    )
    (tmp_path / "other.py").write_text("class Config:\n    pass\n")
    assert exception_classes_outside_errors(tmp_path) == {"watch.py:Finding"}


def test_each_module_is_under_600_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in Path(errors.__file__).parent.glob("*.py")}
    assert {
        "status.py",
        "format.py",
        "base.py",
        "inputs.py",
        "cuda_runtime.py",
        "parse.py",
        "schema.py",
    } <= set(sizes)
    assert max(sizes.values()) < 600, sizes


def test_the_classes_are_the_public_ones() -> None:
    assert errors.CublasError is cg.CublasError and errors.GuardError is cg.GuardError
    assert errors.parse._BY_KIND["cublas"] is cg.CublasError


def test_non_finite_input_points_at_watch() -> None:
    x = torch.randn(2, 4)
    x[1, 1] = float("nan")
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.SafeLinear(4, 2, name="l")(x)
    text = str(info.value)
    assert "cublas_guard_ext.watch(model)" in text and "set_detect_anomaly" not in text
