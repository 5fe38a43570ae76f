"""The package is laid out in layers with no import cycle (docs/architecture.md).

Read statically: every module of the package is parsed (ast), its imports of
other modules of the package are listed, top-level ones (run when the module is
imported: module body, class bodies, if/try blocks) apart from late ones (inside
a function, run when it is called). A module may import from its own layer or
below. Late imports that go up must be listed in LATE_UPWARD with the reason.

Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` first; that
implicit edge is left out (Python runs the parent first by design), only the
import statements written in the modules are checked.
"""

from __future__ import annotations

import ast
import fnmatch
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import cublas_guard_ext

PACKAGE = "cublas_guard_ext"
PACKAGE_DIR = Path(cublas_guard_ext.__file__).resolve().parent

# Bottom first. Patterns are fnmatch patterns on the dotted module name; every
# module of the package must match exactly one layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "native: building/loading the library, environment facts",
        ("cublas_guard_ext._native", "cublas_guard_ext._native.*"),
    ),
    (
        "capsule: the failing call written to a file, and its replay",
        ("cublas_guard_ext.capsule", "cublas_guard_ext._capsule_file", "cublas_guard_ext.capsule_replay"),
    ),
    ("errors: every user-facing message", ("cublas_guard_ext.errors", "cublas_guard_ext.errors.*")),
    ("ops and modes", ("cublas_guard_ext.ops", "cublas_guard_ext.modes", "cublas_guard_ext._transforms")),
    (
        "nn and watch",
        (
            "cublas_guard_ext.nn",
            "cublas_guard_ext.swap",
            "cublas_guard_ext.watch",
            "cublas_guard_ext._watch_patches",
        ),
    ),
    ("training: TrainingGuard", ("cublas_guard_ext.training", "cublas_guard_ext._training_state")),
    ("the public API", ("cublas_guard_ext",)),
    (
        "tools: doctor, demo, bench",
        ("cublas_guard_ext.tools", "cublas_guard_ext.tools.*", "cublas_guard_ext.__main__"),
    ),
    (
        "integrations: transformers, Lightning (imported only when used)",
        ("cublas_guard_ext.integrations", "cublas_guard_ext.integrations.*"),
    ),
    (
        "run: an unmodified script under the guard, its bootstrap and incident reports",
        ("cublas_guard_ext.run", "cublas_guard_ext.run.*"),
    ),
]

# (importer, imported): why this late import may go up a layer.
LATE_UPWARD: dict[tuple[str, str], str] = {
    (
        "cublas_guard_ext._native.loader",
        "cublas_guard_ext.errors",
    ): "the loader raises ExtensionBuildError when a build cannot work; like every "
    "user-facing message it is written in errors.py, imported only where it is raised",
    (
        "cublas_guard_ext._native.facts",
        "cublas_guard_ext.errors",
    ): "the first CUDA call raises ExtensionBuildError when the library has no CUDA kernels "
    "(require_cuda_kernels); imported only where it is raised, as in the loader",
    (
        "cublas_guard_ext._native.stable_core",
        "cublas_guard_ext.errors",
    ): "under the stable core, its errors are turned into the typed classes of errors/ when "
    "one is raised (and the locked library's absence is an ExtensionBuildError)",
    (
        "cublas_guard_ext._native.stable_core",
        "cublas_guard_ext.errors.parse",
    ): "the same translation: the payload line read by the one parser of native messages",
    (
        "cublas_guard_ext.ops",
        "cublas_guard_ext.watch",
    ): "check() also raises this thread's pending watch(mode='async') finding; watch "
    "is built on ops, so ops reaches it only when check() runs",
    (
        "cublas_guard_ext.__main__",
        "cublas_guard_ext.run.cli",
    ): "`python -m cublas_guard_ext run` hands its whole command line to the run package, "
    "imported only for that command",
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    late: bool


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every .py of the package under ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((PACKAGE, *parts))] = path
    return names


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(name: str, modules: dict[str, Path], node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
        return [t for t in targets if t in modules]
    if node.level:
        base_parts = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base != PACKAGE and not base.startswith(PACKAGE + "."):
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:  # `from . import ops`: the submodule
            out.append(sub)
        elif base in modules:  # `from .ops import check`: the module itself
            out.append(base)
    return sorted(set(out))


def import_edges(root: Path) -> tuple[dict[str, Path], list[Edge]]:
    modules = module_names(root)
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

        def visit(node: ast.AST, late: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(name, modules, child):
                        if target != name:
                            edges.append(Edge(name, target, child.lineno, late))
                inner = late or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner)

        visit(tree, False)
    return modules, edges


def layer_of(name: str) -> int:
    found = [
        i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]
    assert len(found) == 1, f"{name} matches layers {found} of LAYERS: give it exactly one"
    return found[0]


def find_cycle(nodes: list[str], edges: list[Edge]) -> list[str] | None:
    graph: dict[str, set[str]] = {n: set() for n in nodes}
    for edge in edges:
        graph[edge.importer].add(edge.imported)
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def violations(root: Path) -> list[str]:
    """Everything wrong with the layering of the package under ``root``."""
    modules, edges = import_edges(root)
    problems = []
    for name in modules:
        try:
            layer_of(name)
        except AssertionError as err:
            problems.append(str(err))
    if problems:
        return problems
    cycle = find_cycle(list(modules), [e for e in edges if not e.late])
    if cycle:
        problems.append("top-level import cycle: " + " -> ".join(cycle))
    used = set()
    for e in edges:
        if layer_of(e.imported) <= layer_of(e.importer):
            continue
        where = f"{e.importer} (line {e.line}) imports {e.imported}"
        up = f"layer '{LAYERS[layer_of(e.importer)][0]}' -> '{LAYERS[layer_of(e.imported)][0]}'"
        if not e.late:
            problems.append(f"upward top-level import: {where}, {up}")
        elif (e.importer, e.imported) in LATE_UPWARD:
            used.add((e.importer, e.imported))
        else:
            problems.append(f"upward late import not in LATE_UPWARD: {where}, {up}")
    for pair in sorted(set(LATE_UPWARD) - used):
        problems.append(f"LATE_UPWARD entry {pair} no longer matches a late import: remove it")
    return problems


def test_the_import_graph_is_read() -> None:
    modules, edges = import_edges(PACKAGE_DIR)
    top = {(e.importer, e.imported) for e in edges if not e.late}
    late = {(e.importer, e.imported) for e in edges if e.late}
    # A few known edges of each kind: the reader sees relative, aliased and nested imports.
    assert ("cublas_guard_ext.nn", "cublas_guard_ext.ops") in top
    assert ("cublas_guard_ext.errors.base", "cublas_guard_ext._native.facts") in top
    assert ("cublas_guard_ext.tools.doctor", "cublas_guard_ext._native.facts") in top
    assert ("cublas_guard_ext.modes", "cublas_guard_ext.ops") in late
    assert ("cublas_guard_ext._native.loader", "cublas_guard_ext.errors") in late
    assert ("cublas_guard_ext.__main__", "cublas_guard_ext.tools.doctor") in late
    assert {"cublas_guard_ext", "cublas_guard_ext._native.loader", "cublas_guard_ext.tools.demo"} <= set(
        modules
    )


def test_every_module_has_one_layer() -> None:
    for name in module_names(PACKAGE_DIR):
        layer_of(name)


def test_no_top_level_import_cycle() -> None:
    modules, edges = import_edges(PACKAGE_DIR)
    cycle = find_cycle(list(modules), [e for e in edges if not e.late])
    assert cycle is None, " -> ".join(cycle)


def test_imports_follow_the_layers() -> None:
    assert violations(PACKAGE_DIR) == []


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / PACKAGE
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return root


def _plant(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code)


def test_a_planted_upward_top_level_import_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    assert violations(root) == []
    _plant(root / "errors" / "__init__.py", "from ..nn import SafeLinear  # errors may not use nn\n")
    problems = violations(root)
    assert any(
        p.startswith("upward top-level import: cublas_guard_ext.errors") and "cublas_guard_ext.nn" in p
        for p in problems
    ), problems
    # ops imports the facts at top level: the facts importing ops closes a cycle.
    _plant(root / "_native" / "facts.py", "from .. import ops\n")
    problems = violations(root)
    assert any(
        p.startswith("top-level import cycle:") and "cublas_guard_ext._native.facts" in p for p in problems
    ), problems


def test_a_planted_late_upward_import_fails_unless_allow_listed(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _plant(root / "ops.py", "def _planted() -> None:\n    from .tools import doctor  # noqa: F401\n")
    problems = violations(root)
    assert any(
        p.startswith("upward late import not in LATE_UPWARD: cublas_guard_ext.ops")
        and "cublas_guard_ext.tools.doctor" in p
        for p in problems
    ), problems
    assert not any("top-level" in p for p in problems), problems


def test_a_module_without_a_layer_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "helpers.py").write_text("from . import ops\n")
    assert any("cublas_guard_ext.helpers matches layers []" in p for p in violations(root))


@pytest.mark.parametrize("pair", sorted(LATE_UPWARD))
def test_each_allow_listed_late_import_exists(pair: tuple[str, str]) -> None:
    _, edges = import_edges(PACKAGE_DIR)
    assert any(e.late and (e.importer, e.imported) == pair for e in edges), pair
    assert not any(not e.late and (e.importer, e.imported) == pair for e in edges), pair


# The native op namespaces (csrc/ops.cpp, csrc/testing.cpp): what a user sees under
# torch.ops.cublas_guard is the product; test hooks and the package's private entry
# points live in namespaces of their own.
PUBLIC_OPS = {
    "scan",
    "linear",
    "linear_grad_input",
    "linear_grad_weight",
    "check_features",
    "guard_values",
    "async_check",
    "build_info",
    "check_in_graph",
}  # (ops.py: check() inside a compiled graph)


def _ops_in(namespace: str) -> set[str]:
    import torch

    prefix = namespace + "::"
    return {s.name[len(prefix) :] for s in torch._C._jit_get_all_schemas() if s.name.startswith(prefix)}


def test_the_public_op_namespace_holds_the_product_only() -> None:
    assert _ops_in("cublas_guard") == PUBLIC_OPS
    assert {"set_fault", "set_size_limit", "simulate_cuda_errors", "clean_cache_stats"} <= _ops_in(
        "cublas_guard_testing"
    )
    from cublas_guard_ext._native import loader

    internal = {"parameters_changed", "reset_layer_calls", "argument_rules", "set_reduction_options"}
    if loader.info().library == "locked":  # the fast entry's installer is the locked library's
        internal.add("python_module_install")
    assert internal <= _ops_in("cublas_guard_internal")
