"""No module but TrainingGuard's own reaches into it: what the integrations, the silent-corruption
checks and the guard's helper modules need is its documented interface (docs/training-guard.md,
"For integrations"), never an underscore member.

The scan reads the package's source (ast): an attribute ``._x`` (one leading underscore, not a
dunder) on an expression that holds a TrainingGuard is a finding. Such an expression is a name
or attribute called ``guard`` (or ending in ``_guard``: ``self.guard``, ``checks.guard``,
``training_guard``), a parameter annotated ``TrainingGuard``, or a name assigned from one of
those or from ``TrainingGuard(...)`` in the same module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import cublas_guard_ext

PACKAGE = Path(cublas_guard_ext.__file__).resolve().parent
GUARD_FILE = PACKAGE / "training" / "guard.py"
_GUARD_NAME = re.compile(r"(^|_)guard$")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _annotated_guard(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    return "TrainingGuard" in ast.unparse(annotation) and "Callback" not in ast.unparse(annotation)


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: set[str] = set()
        self.found: list[tuple[int, str]] = []

    def holds_guard(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return bool(_GUARD_NAME.search(node.id)) or node.id in self.aliases
        if isinstance(node, ast.Attribute):
            return bool(_GUARD_NAME.search(node.attr))
        if isinstance(node, ast.Call):
            return ast.unparse(node.func).split(".")[-1] == "TrainingGuard"
        return False

    def collect_aliases(self, tree: ast.AST) -> None:
        """Names bound to a guard anywhere in the module, to a fixpoint (``g = guard; h = g``)."""
        while True:
            before = len(self.aliases)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    args = node.args
                    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                        if _annotated_guard(a.annotation):
                            self.aliases.add(a.arg)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if _annotated_guard(node.annotation) or (node.value and self.holds_guard(node.value)):
                        self.aliases.add(node.target.id)
                elif isinstance(node, (ast.Assign, ast.NamedExpr)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        for t, v in _pairs(target, node.value):
                            if isinstance(t, ast.Name) and self.holds_guard(v):
                                self.aliases.add(t.id)
            if len(self.aliases) == before:
                return

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr) and self.holds_guard(node.value):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) pairs of an assignment, tuples unpacked element by element."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return [p for t, v in zip(target.elts, value.elts, strict=True) for p in _pairs(t, v)]
    return [(target, value)]


def reaches_into_guard(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every underscore member of a TrainingGuard the source touches."""
    tree = ast.parse(source)
    scan = _Scan()
    scan.collect_aliases(tree)
    scan.visit(tree)
    return sorted(scan.found)


def package_findings(package: Path) -> list[str]:
    guard_file = package / "training" / "guard.py"
    out = []
    for path in sorted(package.rglob("*.py")):
        if path == guard_file:
            continue
        for line, expr in reaches_into_guard(path.read_text(encoding="utf-8")):
            out.append(f"{path.relative_to(package.parent)}:{line}: {expr}")
    return out


def test_only_training_guards_own_file_touches_its_underscore_members():
    assert GUARD_FILE.is_file()
    found = package_findings(PACKAGE)
    assert not found, (
        "these modules use TrainingGuard's private members; use its interface "
        "(docs/training-guard.md, 'For integrations') or add to it:\n  " + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(guard):\n    return guard._take(1)\n", [(2, "guard._take")]),
        ("def f(self):\n    self.guard._history.mark(1)\n", [(2, "self.guard._history")]),
        ("def f(checks):\n    return checks.guard._gather(x)\n", [(2, "checks.guard._gather")]),
        ("def f(self):\n    g = self.guard\n    h = g\n    h._zero_grads()\n", [(4, "h._zero_grads")]),
        ("def f(self):\n    g, rng = self.guard, self._rng\n    g._begin()\n", [(3, "g._begin")]),
        ("def f(tg: TrainingGuard):\n    tg._buffers.restore()\n", [(2, "tg._buffers")]),
        ("def f(tg: 'TrainingGuard | None'):\n    return tg._batch\n", [(2, "tg._batch")]),
        ("t = TrainingGuard(m, o)\nt._agree(f)\n", [(2, "t._agree")]),
        ("x = TrainingGuard(m, o)._rank_world()\n", [(1, "TrainingGuard(m, o)._rank_world")]),
        ("def f(training_guard):\n    training_guard._is_bad(l)\n", [(2, "training_guard._is_bad")]),
    ],
)
def test_the_scan_finds_an_underscore_member_on_a_guard(source, expected):
    assert reaches_into_guard(source) == expected


@pytest.mark.parametrize(
    "source",
    [
        "def f(self):\n    return self._rng, self._batch, self.guard.steps\n",
        "def f(guard):\n    return guard.history.read(), guard.collective.gather(1), guard.__class__\n",
        "def f(module):\n    return module._buffers\n",
        "def f(cb: TrainingGuardCallback):\n    return cb._rng\n",
        "def f(self):\n    guard = self.guard\n    other = self.checks\n    return other._restore\n",
    ],
)
def test_the_scan_leaves_other_objects_and_public_members_alone(source):
    assert reaches_into_guard(source) == []
