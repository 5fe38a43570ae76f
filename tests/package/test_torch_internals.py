"""docs/torch-internals.md lists every private torch piece the code touches.

A torch release may rename or remove any of them without notice, so the page is where a
breakage is looked up. This test reads the sources (nothing of the package is run) for the
spellings of private torch pieces and fails naming each one the page does not mention:

* Python (``cublas_guard_ext/``, ``benchmarks/`` is not shipped and not read): a dotted name
  reached from an imported torch module with a private part (``torch._C._is_tracing``,
  ``cpp_extension._write_ninja_file`` as ``torch.utils.cpp_extension._write_ninja_file``),
  ``from torch... import _x`` and imports of private torch modules, private torch module
  names in strings (``sys.modules.get("torch._dynamo")``), and private attributes of torch's
  own objects (``._modules`` of an ``nn.Module``, ``._schema`` of an op overload, ...): an
  attribute ``._name`` of anything but ``self`` / ``cls`` (the package's own objects) whose
  name is a private attribute of one of torch's sample objects below (a static read cannot
  tell whose object it is).
* C++ (``csrc/``): ``#include <torch/csrc/...>`` headers, names in an ``impl`` namespace
  (``c10::impl::ExcludeDispatchKeyGuard``), ``torch::autograd::`` names, the
  ``TESTING_ONLY_`` dispatch keys, ``at::sequence_number::`` and the CUDA caching
  allocator's functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "torch-internals.md"
PACKAGE = ROOT / "cublas_guard_ext"
CSRC = ROOT / "csrc"

CPP_SPELLINGS = (
    # torch/csrc/stable/ and the AOTI shims (torch/csrc/inductor/aoti_torch/) are LibTorch's
    # stable C ABI, the promise the stable core is built on (docs/building.md), not internals.
    re.compile(r"#include\s*<(torch/csrc/(?!stable/|inductor/aoti_torch/)[\w/]+\.h)>"),
    re.compile(r"\b((?:at|c10)(?:::\w+)*::impl::\w+)"),
    re.compile(r"\b(torch::autograd::\w+)"),
    re.compile(r"\b(TESTING_ONLY_\w+)"),
    re.compile(r"\b(sequence_number::\w+)"),
    re.compile(r"\b(CUDACachingAllocator::\w+)"),
)


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _torch_private_attributes() -> frozenset[str]:
    """Private attribute names of torch's objects the package handles: tensors, modules,
    optimizers, GradScaler, op overloads and packets, parametrizations."""
    weight = torch.nn.Parameter(torch.zeros(1))
    samples = [
        torch.zeros(1),
        torch.nn.Linear(1, 1),
        torch.optim.SGD([weight], lr=0.1),
        torch.amp.GradScaler("cpu"),
        torch.ops.aten.add.Tensor,
        torch.ops.aten.add,
        torch.Generator(),
    ]
    names = set()
    for obj in samples:
        names.update(n for n in dir(obj) if _is_private(n))
        names.update(n for n in getattr(obj, "__dict__", {}) if _is_private(n))
    return frozenset(names)


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def python_spellings(path: Path, torch_attributes: frozenset[str]) -> set[str]:
    """The private torch pieces one Python file names, as dotted names from ``torch``, or as
    ``._name`` for a private attribute of a torch object."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}  # local name -> the torch module or object it is
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases["torch"] = "torch"
                    if any(_is_private(p) for p in alias.name.split(".")):
                        found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "torch" or node.module.startswith("torch."):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    aliases[alias.asname or alias.name] = full
                    if any(_is_private(p) for p in full.split(".")):
                        found.add(full)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                full = [*aliases[parts[0]].split("."), *parts[1:]]
                if any(_is_private(p) for p in full):
                    found.add(".".join(full))
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if _is_private(node.attr) and node.attr in torch_attributes and owner not in ("self", "cls"):
                found.add("." + node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"torch(\.\w+)+", node.value) and any(
                _is_private(p) for p in node.value.split(".")
            ):
                found.add(node.value)
    # a.b._c and a.b._c.d are one piece: keep the shortest dotted prefix that is private
    # and is found, so that `torch._dynamo` and `torch._dynamo.config` do not both count.
    return {
        name for name in found if not any(name != other and name.startswith(other + ".") for other in found)
    }


def cpp_spellings(text: str) -> set[str]:
    return {m.group(1) for pattern in CPP_SPELLINGS for m in pattern.finditer(text)}


def unlisted(doc_text: str, package: Path = PACKAGE, csrc: Path = CSRC) -> list[str]:
    """``file: spelling`` for each private torch piece a source names and the page does not."""
    torch_attributes = _torch_private_attributes()
    out = []
    for path in sorted(package.rglob("*.py")):
        for name in sorted(python_spellings(path, torch_attributes)):
            if name not in doc_text:
                out.append(f"{path.relative_to(package.parent)}: {name}")
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in (".cpp", ".h", ".cu")):
        for name in sorted(cpp_spellings(path.read_text(encoding="utf-8"))):
            if name not in doc_text:
                out.append(f"{path.relative_to(csrc.parent)}: {name}")
    return out


def test_every_private_torch_piece_is_listed() -> None:
    assert unlisted(DOC.read_text(encoding="utf-8")) == []


def test_a_planted_private_use_is_named(tmp_path: Path) -> None:
    package, csrc = tmp_path / "pkg", tmp_path / "csrc"
    package.mkdir()
    csrc.mkdir()
    (package / "a.py").write_text(
        "import torch\n"
        "from torch.utils import cpp_extension as ce\n"
        "from torch._subclasses import FakeTensor\n"
        "import torch.utils._pytree as pytree\n\n"
        "def f(m, t):\n"
        "    torch._C._is_tracing()\n"
        "    ce._write_ninja_file\n"
        "    sys.modules.get('torch._dynamo')\n"
        "    torch.nn.functional.linear(t, t)\n"
        "    return m._modules, t._version, m._my_own_field, self._buffers\n"
    )
    (csrc / "b.cpp").write_text(
        "#include <torch/csrc/autograd/function.h>\n"
        "c10::impl::ExcludeDispatchKeyGuard g(c10::DispatchKey::TESTING_ONLY_GenericMode);\n"
        "at::Tensor t; // c10::DispatchKey::CPU is public\n"
    )
    doc = "`torch._C._is_tracing` and `c10::impl::ExcludeDispatchKeyGuard`"
    assert unlisted(doc, package, csrc) == [
        "pkg/a.py: ._modules",
        "pkg/a.py: ._version",
        "pkg/a.py: torch._dynamo",
        "pkg/a.py: torch._subclasses.FakeTensor",
        "pkg/a.py: torch.utils._pytree",
        "pkg/a.py: torch.utils.cpp_extension._write_ninja_file",
        "csrc/b.cpp: TESTING_ONLY_GenericMode",
        "csrc/b.cpp: torch/csrc/autograd/function.h",
    ]
