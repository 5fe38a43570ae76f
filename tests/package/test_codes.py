"""Mode and role codes: one Python source (cublas_guard_ext._native.loading.codes), and every C++
definition of them in csrc/ agrees with it (a planted disagreement fails)."""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

from cublas_guard_ext._native.loading import codes
from cublas_guard_ext.guarded_linear import _transforms, modes, ops
from cublas_guard_ext.guarded_linear import nn as guarded_nn

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_ENUM = re.compile(r"enum\s+(?:class\s+)?(\w+)\s*:\s*int64_t\s*\{([^}]*)\}")
_ENUMERATOR = re.compile(r"(k\w+)\s*=\s*(-?\d+)")
_CONSTANT = re.compile(r"constexpr\s+(?:int|int64_t)\s+(kMode\w+|kRole\w+)\s*=\s*(-?\d+)")
# What C++ calls each code ("kSync" in GuardMode, "kModeSync" elsewhere, "kRoleGradOutput").
_MODE_NAMES = {
    "kOff": "off",
    "kSync": "sync",
    "kAsync": "async",
    "kModeOff": "off",
    "kModeSync": "sync",
    "kModeAsync": "async",
}
_ROLE_NAMES = {
    "kRoleInput": "input",
    "kRoleWeight": "weight",
    "kRoleBias": "bias",
    "kRoleGradOutput": "grad_output",
}


def cpp_codes(root: Path = CSRC) -> list[tuple[str, str, str, int]]:
    """(file, C++ name, "mode"/"role", value) for every definition found."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".h", ".cpp", ".cu")):
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(root))
        for enum, body in _ENUM.findall(text):
            if enum in ("GuardMode", "TensorRole"):
                for name, value in _ENUMERATOR.findall(body):
                    found.append((where, name, "mode" if enum == "GuardMode" else "role", int(value)))
        for name, value in _CONSTANT.findall(text):
            found.append((where, name, "mode" if name.startswith("kMode") else "role", int(value)))
    return found


def disagreements(root: Path = CSRC) -> list[str]:
    out = []
    for where, name, what, value in cpp_codes(root):
        table, names = (codes.MODE_CODES, _MODE_NAMES) if what == "mode" else (codes.ROLE_CODES, _ROLE_NAMES)
        key = names.get(name)
        if key is None:
            out.append(f"{where}: {name} = {value} is a {what} code codes.py does not know")
        elif table[key] != value:
            out.append(f"{where}: {name} = {value}, but codes.py says {key!r} = {table[key]}")
    return out


def test_csrc_agrees_with_codes_py() -> None:
    found = cpp_codes()
    assert {
        ("linear/guard_mode.h", "kSync", "mode", 1),
        ("report/async_record.h", "kRoleGradOutput", "role", 3),
    } <= {(w, n, k, v) for w, n, k, v in found}
    assert {n for _, n, k, _ in found if k == "mode"} >= {"kOff", "kSync", "kAsync"}
    assert {n for _, n, k, _ in found if k == "role"} == set(_ROLE_NAMES)
    assert disagreements() == []


def test_a_planted_disagreement_fails(tmp_path: Path) -> None:
    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root)
    header = root / "report" / "async_record.h"
    header.write_text(header.read_text().replace("kRoleBias = 2", "kRoleBias = 4"))
    (root / "planted.cpp").write_text("constexpr int kModeAsync = 3;\nconstexpr int kModeLazy = 5;\n")
    assert disagreements(root) == [
        "planted.cpp: kModeAsync = 3, but codes.py says 'async' = 2",
        "planted.cpp: kModeLazy = 5 is a mode code codes.py does not know",
        "report/async_record.h: kRoleBias = 4, but codes.py says 'bias' = 2",
    ]


def test_the_python_side_uses_codes_py() -> None:
    assert modes.MODE_CODES is codes.MODE_CODES
    assert ops._ENV_DEFAULT == codes.MODE_ENV_DEFAULT
    assert (_transforms._MODE_OFF, _transforms._ROLE_GRAD_OUTPUT) == (codes.MODE_OFF, codes.ROLE_GRAD_OUTPUT)
    # SafeLinear's TorchScript branch writes the codes as literals (TorchScript takes no global ints).
    source = Path(guarded_nn.__file__).read_text()
    match = re.search(
        r'code = (\d+) if mode is None else \((\d+) if mode == "off" else '
        r'\((\d+) if mode == "async" else (\d+)\)\)',
        source,
    )
    assert match, "SafeLinear's TorchScript mode line changed: update this test"
    default, off, async_, other = (int(v) for v in match.groups())
    assert (default, off, async_, other) == (
        codes.MODE_SYNC,
        codes.MODE_OFF,
        codes.MODE_ASYNC,
        codes.MODE_SYNC,
    )
    watch_module = importlib.import_module("cublas_guard_ext.watching.session")
    assert watch_module._MODE_CODES == {"sync": codes.MODE_SYNC, "async": codes.MODE_ASYNC}
