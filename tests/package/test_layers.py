"""The package is laid out in layers with no import cycle (docs/architecture.md).

Read statically: every module of the package is parsed (ast), its imports of
other modules of the package are listed, top-level ones (run when the module is
imported: module body, class bodies, if/try blocks) apart from late ones (inside
a function, run when it is called). A module may import from its own layer or
below, either way; and no imports, late ones included, form a cycle. What a lower
layer needs from a higher one is handed in when the higher one loads (see
docs/architecture.md), never imported.

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

import cublas_guard_ext

PACKAGE = "cublas_guard_ext"
PACKAGE_DIR = Path(cublas_guard_ext.__file__).resolve().parent

# Bottom first: the one place the order is written (docs/architecture.md draws it). Patterns
# are fnmatch patterns on the dotted module name; every module of the package must match
# exactly one layer. A module imports only from its own layer or below, at top level or late
# (inside a function), and the imports form no cycle, late ones included.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "_import_hooks: a function run right after another package's module is imported",
        ("cublas_guard_ext._import_hooks",),
    ),
    (
        "errors: every user-facing message and error class",
        ("cublas_guard_ext.errors", "cublas_guard_ext.errors.*"),
    ),
    (
        "_native/loading's vocabulary: the ops' codes, which builds load here by name",
        ("cublas_guard_ext._native.loading.codes", "cublas_guard_ext._native.loading.compatibility"),
    ),
    (
        "_native/building: compiling the libraries (setup.py loads it by path)",
        ("cublas_guard_ext._native.building", "cublas_guard_ext._native.building.*"),
    ),
    (
        "_native/core_twins: what the stable core registers in Python",
        ("cublas_guard_ext._native.core_twins", "cublas_guard_ext._native.core_twins.*"),
    ),
    (
        "_native/loading: which library serves this process, the seam callers read",
        (
            "cublas_guard_ext._native",
            "cublas_guard_ext._native.loading",
            "cublas_guard_ext._native.loading.loader",
            "cublas_guard_ext._native.loading.seam",
        ),
    ),
    (
        "_native/machine: facts about this machine (doctor, capsule, error messages)",
        ("cublas_guard_ext._native.machine", "cublas_guard_ext._native.machine.*"),
    ),
    (
        "capsule: the failing call written to a file, read back, replayed",
        ("cublas_guard_ext.capsule", "cublas_guard_ext.capsule.*"),
    ),
    (
        "guarded_linear: SafeLinear, SafeConv1D, the ops, check(), guard(), the modes",
        ("cublas_guard_ext.guarded_linear", "cublas_guard_ext.guarded_linear.*"),
    ),
    (
        "fp8: torchao's Float8Linear guarded, direct scaled GEMMs and float8 casts checked",
        ("cublas_guard_ext.fp8", "cublas_guard_ext.fp8.*"),
    ),
    ("watching: watch and its global patches", ("cublas_guard_ext.watching", "cublas_guard_ext.watching.*")),
    (
        "models: replace_linear, restore_linear, coverage",
        ("cublas_guard_ext.models", "cublas_guard_ext.models.*"),
    ),
    (
        "training: TrainingGuard, its step state, its silent-corruption checks, fault injection",
        ("cublas_guard_ext.training", "cublas_guard_ext.training.*"),
    ),
    (
        "the native library's calls into Python, by module and attribute name (csrc/ names them)",
        ("cublas_guard_ext._native_callbacks",),
    ),
    (
        "the public API, and the flat layout's module paths",
        ("cublas_guard_ext", "cublas_guard_ext._module_aliases"),
    ),
    ("tools: doctor, demo, bench", ("cublas_guard_ext.tools", "cublas_guard_ext.tools.*")),
    (
        "integrations: transformers, Lightning (imported only when used)",
        ("cublas_guard_ext.integrations", "cublas_guard_ext.integrations.*"),
    ),
    (
        "run: an unmodified script under the guard, its bootstrap and incident reports",
        ("cublas_guard_ext.run", "cublas_guard_ext.run.*"),
    ),
    (
        "the command line: python -m cublas_guard_ext doctor|demo|bench|replay|run",
        ("cublas_guard_ext.__main__",),
    ),
]


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
    cycle = find_cycle(list(modules), edges)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    for e in edges:
        if layer_of(e.imported) <= layer_of(e.importer):
            continue
        where = f"{e.importer} (line {e.line}) imports {e.imported}"
        up = f"layer '{LAYERS[layer_of(e.importer)][0]}' -> '{LAYERS[layer_of(e.imported)][0]}'"
        problems.append(f"upward {'late' if e.late else 'top-level'} import: {where}, {up}")
    return problems


def test_the_import_graph_is_read() -> None:
    modules, edges = import_edges(PACKAGE_DIR)
    top = {(e.importer, e.imported) for e in edges if not e.late}
    late = {(e.importer, e.imported) for e in edges if e.late}
    # A few known edges of each kind: the reader sees relative, aliased and nested imports.
    assert ("cublas_guard_ext.guarded_linear.nn", "cublas_guard_ext.guarded_linear.ops") in top
    assert ("cublas_guard_ext._native.machine.facts", "cublas_guard_ext.errors.base") in top
    assert ("cublas_guard_ext.tools.doctor", "cublas_guard_ext._native.machine.facts") in top
    assert ("cublas_guard_ext.watching.session", "cublas_guard_ext.guarded_linear.ops") in top
    assert ("cublas_guard_ext._native.loading.loader", "cublas_guard_ext.errors") in late
    assert ("cublas_guard_ext.__main__", "cublas_guard_ext.tools.doctor") in late
    assert {
        "cublas_guard_ext",
        "cublas_guard_ext._native.loading.loader",
        "cublas_guard_ext.tools.demo",
    } <= set(modules)


def test_what_a_floor_above_hands_down_is_in_place() -> None:
    """What a lower floor needs from a higher one is handed in when the higher one loads:
    once the package has loaded, each is there (else errors would lose their environment
    block or capsule, and check() the pending watch finding, without a failing import)."""
    from cublas_guard_ext import errors
    from cublas_guard_ext._native.machine import facts
    from cublas_guard_ext.capsule import contents
    from cublas_guard_ext.guarded_linear import ops
    from cublas_guard_ext.watching import session

    assert errors.base._environment_reader == [facts.error_context]
    assert errors.parse._capsule_writer == [contents.capture]
    assert ops._pending_watch_findings == [session.check_pending]


def test_every_module_has_one_layer() -> None:
    for name in module_names(PACKAGE_DIR):
        layer_of(name)


def test_no_import_cycle_late_ones_included() -> None:
    modules, edges = import_edges(PACKAGE_DIR)
    cycle = find_cycle(list(modules), edges)
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
    _plant(
        root / "errors" / "__init__.py",
        "from ..guarded_linear.nn import SafeLinear  # errors may not use nn\n",
    )
    problems = violations(root)
    assert any(
        p.startswith("upward top-level import: cublas_guard_ext.errors")
        and "cublas_guard_ext.guarded_linear.nn" in p
        for p in problems
    ), problems
    # ops imports the facts at top level: the facts importing ops closes a cycle.
    root = _copy(tmp_path / "second")
    _plant(root / "_native" / "machine" / "facts.py", "from ...guarded_linear import ops\n")
    problems = violations(root)
    assert any(
        p.startswith("import cycle:") and "cublas_guard_ext._native.machine.facts" in p for p in problems
    ), problems


def test_a_planted_late_cycle_within_a_layer_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    # ops imports modes at top level; modes importing ops, even late, closes a cycle.
    _plant(
        root / "guarded_linear" / "modes.py", "def _planted() -> None:\n    from . import ops  # noqa: F401\n"
    )
    problems = violations(root)
    assert problems == [p for p in problems if p.startswith("import cycle:")] and problems, problems
    assert "cublas_guard_ext.guarded_linear.modes" in problems[0], problems


def test_a_planted_late_upward_import_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _plant(
        root / "guarded_linear" / "ops.py",
        "def _planted() -> None:\n    from ..run import options  # noqa: F401\n",
    )
    problems = violations(root)
    assert any(
        p.startswith("upward late import: cublas_guard_ext.guarded_linear.ops")
        and "cublas_guard_ext.run.options" in p
        for p in problems
    ), problems
    assert not any("top-level" in p or "cycle" in p for p in problems), problems


def test_a_module_without_a_layer_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "helpers.py").write_text("from . import ops\n")
    assert any("cublas_guard_ext.helpers matches layers []" in p for p in violations(root))


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
    "grouped_linear",
    "grouped_linear_grad_input",
    "grouped_linear_grad_weight",
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
    from cublas_guard_ext._native.loading import loader

    internal = {"parameters_changed", "reset_layer_calls", "argument_rules", "set_reduction_options"}
    if loader.info().library == "locked":  # the fast entry's installer is the locked library's
        internal.add("python_module_install")
    assert internal <= _ops_in("cublas_guard_internal")


def unresolved_relative_imports(root: Path) -> list[str]:
    """Relative imports naming no module or package of the package under ``root``: after a
    module moves a folder down, ``from ..errors import X`` names ``_native.errors``, which fails
    only when the (often late, error-path) import runs; the layer check above skips it."""
    modules = module_names(root)
    problems = []
    for name, path in modules.items():
        base_parts = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
                if base not in modules:
                    problems.append(f"{name}:{node.lineno}: {'.' * node.level}{node.module or ''} is {base}")
    return problems


def test_every_relative_import_names_a_module_of_the_package() -> None:
    assert unresolved_relative_imports(PACKAGE_DIR) == []


def test_a_relative_import_one_level_short_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _plant(
        root / "_native" / "loading" / "loader.py", "def f():\n    from ..errors import ExtensionBuildError\n"
    )
    problems = unresolved_relative_imports(root)
    assert len(problems) == 1 and "cublas_guard_ext._native.loading.loader:" in problems[0], problems
    assert problems[0].endswith("..errors is cublas_guard_ext._native.errors"), problems
