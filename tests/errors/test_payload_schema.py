"""One schema for error payloads (cublas_guard_ext.errors.schema), checked against both sides.

Static: every field name csrc/ writes (`.add("name", ...)`, the memory table, the families
built from a prefix and a suffix) must be in the schema, every schema field must be written
somewhere in csrc/, and every field the Python error classes read must be in the schema.
Dynamic: the payloads of real errors (raised on this machine) have the kinds the schema says.
A planted field on either side must make the check fail.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext import errors
from cublas_guard_ext.errors import schema

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
ERRORS_DIR = Path(errors.__file__).resolve().parent

_ADD = re.compile(r'\.add\(\s*"([A-Za-z_][A-Za-z_0-9]*)"')
_TABLE = re.compile(r'\{\s*"([a-z_]+)"\s*,\s*m\.')  # add_memory_fields' {"free_bytes", m.free_bytes}
_KIND = re.compile(r'ErrorReport\s+\w+\(\s*"([a-z_0-9]+)"\s*\)')
_SUFFIX = re.compile(r'\+\s*"(_[a-z_]+)"\s*\)\.c_str\(\)')
_PREFIX = re.compile(r'describe_tensor\(\s*\w+\s*,\s*"([a-z_]+)"|"(input|scalar_)"\s*\+')
# Python reads: f.get("x"), f["x"], self.fields.get("x"), fields.get("x"), f'{op}_shape' families.
_READ = re.compile(r"""(?:\bf|fields)(?:\.get\(|\[)\s*["']([a-z_0-9]+)["']""")


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".cpp", ".cu", ".h"))


def native_fields(root: Path = CSRC) -> dict[str, set[str]]:
    """What csrc/ writes into payloads: literal field names, family prefixes and suffixes,
    report kinds."""
    out: dict[str, set[str]] = {"fields": set(), "suffixes": set(), "prefixes": set(), "kinds": set()}
    for path in _sources(root):
        text = path.read_text(encoding="utf-8")
        out["fields"] |= set(_ADD.findall(text)) | set(_TABLE.findall(text))
        out["suffixes"] |= set(_SUFFIX.findall(text))
        out["prefixes"] |= {a or b for a, b in _PREFIX.findall(text)}
        out["kinds"] |= set(_KIND.findall(text))
    return out


def python_reads(root: Path = ERRORS_DIR) -> set[str]:
    reads = set()
    for path in sorted(root.glob("*.py")):
        if path.name != "schema.py":
            reads |= set(_READ.findall(path.read_text(encoding="utf-8")))
    return reads


def disagreements(csrc: Path = CSRC, py: Path = ERRORS_DIR) -> list[str]:
    found = native_fields(csrc)
    out = []
    for name in sorted(found["fields"]):
        if schema.kind_of(name) is None:
            out.append(f"csrc/ writes field {name!r}, which the schema does not list")
    for name in sorted(set(schema.NATIVE_FIELDS) - found["fields"]):
        out.append(f"the schema lists field {name!r}, which csrc/ never writes")
    for suffix in sorted(found["suffixes"] - set(schema.FAMILY_SUFFIXES)):
        out.append(f"csrc/ builds fields ending {suffix!r}, a family the schema does not list")
    for prefix in sorted(found["prefixes"] - set(schema.FAMILY_PREFIXES)):
        out.append(f"csrc/ builds fields starting {prefix!r}, a family the schema does not list")
    for kind in sorted(found["kinds"] ^ set(schema.REPORT_KINDS)):
        side = "csrc/ raises" if kind in found["kinds"] else "the schema lists"
        out.append(f"{side} report kind {kind!r}, which the other side does not have")
    for name in sorted(python_reads(py)):
        if schema.kind_of(name) is None and name not in schema.PYTHON_FIELDS:
            out.append(f"the Python errors read field {name!r}, which the schema does not list")
    return out


def test_csrc_and_python_agree_with_the_schema() -> None:
    assert disagreements() == []


def test_the_readers_see_the_fields() -> None:
    found = native_fields()
    assert {"layer", "status", "lda", "free_bytes", "nan_count", "cuda_error_code"} <= found["fields"]
    assert {"_shape", "_strides", "_role", "_alignment", "_storage_offset"} <= found["suffixes"]
    assert {"tensor", "input"} <= found["prefixes"]
    assert {"cublas", "non_finite", "shape_mismatch"} <= found["kinds"]
    assert {"status", "m", "first_bad_index", "expected_last_dim"} <= python_reads()


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    csrc, py = tmp_path / "csrc", tmp_path / "errors"
    shutil.copytree(CSRC, csrc)
    shutil.copytree(ERRORS_DIR, py, ignore=shutil.ignore_patterns("__pycache__"))
    return csrc, py


def test_a_field_only_csrc_writes_fails(tmp_path: Path) -> None:
    csrc, py = _copy(tmp_path)
    assert disagreements(csrc, py) == []
    path = csrc / "linear" / "gemm_report.cpp"
    path.write_text(path.read_text().replace('report.add("chunk"', 'report.add("piece"'))
    problems = disagreements(csrc, py)
    assert "csrc/ writes field 'piece', which the schema does not list" in problems
    assert "the schema lists field 'chunk', which csrc/ never writes" in problems


def test_a_field_only_python_reads_fails(tmp_path: Path) -> None:
    csrc, py = _copy(tmp_path)
    path = py / "cuda_runtime.py"
    text = path.read_text()
    assert 'f.get("sticky", True)' in text
    path.write_text(text.replace('f.get("sticky", True)', 'f.get("stuck", True)'))
    assert "the Python errors read field 'stuck', which the schema does not list" in disagreements(csrc, py)


def test_a_new_family_or_report_kind_fails(tmp_path: Path) -> None:
    csrc, py = _copy(tmp_path)
    path = csrc / "linear" / "gemm_report.cpp"
    text = path.read_text().replace('+ "_alignment").c_str()', '+ "_align").c_str()')
    path.write_text(text.replace('ErrorReport report("cublas")', 'ErrorReport report("cublas_v2")'))
    cuda = csrc / "cuda" / "linear.cu"
    cuda.write_text(
        cuda.read_text().replace('ErrorReport report("graph_capture")', 'ErrorReport report("capture")')
    )
    problems = disagreements(csrc, py)
    assert "csrc/ builds fields ending '_align', a family the schema does not list" in problems
    assert "csrc/ raises report kind 'cublas_v2', which the other side does not have" in problems
    assert "csrc/ raises report kind 'capture', which the other side does not have" in problems
    assert "the schema lists report kind 'graph_capture', which the other side does not have" in problems


@pytest.fixture
def native_messages(monkeypatch):
    """Records the message of each error the native side raises (python_errors.cpp calls
    cublas_guard_ext._native_callbacks.typed_error with it; under the stable core alone,
    _native/core_twins/stable_core.py hands the RuntimeError's message to errors.parse)."""
    from cublas_guard_ext import _native_callbacks
    from cublas_guard_ext.errors import parse

    seen: list[str] = []

    def spying(real):
        def spy(message, native=None):
            seen.append(message)
            return real(message, native)

        return spy

    monkeypatch.setattr(_native_callbacks, "typed_error", spying(_native_callbacks.typed_error))
    monkeypatch.setattr(parse, "_typed_from_native_message", spying(parse._typed_from_native_message))
    return seen


def _cases(inject_fault, size_limit):
    layer = cg.SafeLinear(8, 4, name="schema")
    nan = torch.randn(2, 8)
    nan[1, 3] = float("nan")

    def fault():
        inject_fault("gemm", 13)
        layer(torch.randn(2, 8))

    def too_big():
        size_limit(4, allow_64bit=False)
        layer(torch.randn(5, 8))

    def async_nan():
        cg.SafeLinear(8, 4, name="schema-async", mode="async")(nan)
        cg.check()

    return {
        "shape": lambda: layer(torch.randn(2, 7)),
        "dtype": lambda: layer(torch.ones(2, 8, dtype=torch.int32)),
        "dtype mismatch": lambda: layer(torch.randn(2, 8, dtype=torch.float64)),
        "non-finite": lambda: layer(nan),
        "non-finite async": async_nan,
        "cublas": fault,
        "size limit": too_big,
    }


@pytest.mark.parametrize(
    "case", ["shape", "dtype", "dtype mismatch", "non-finite", "non-finite async", "cublas", "size limit"]
)
def test_real_payloads_have_the_schemas_kinds(
    case, native_messages, inject_fault, size_limit, monkeypatch
) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE", "0")
    with pytest.raises(cg.GuardError):
        _cases(inject_fault, size_limit)[case]()
    payload = errors.parse_payload(native_messages[-1])
    assert payload is not None and schema.problems(payload) == []


def test_problems_names_a_wrong_kind_and_an_unknown_field() -> None:
    assert schema.problems({"kind": "cublas", "m": "12", "a_shape": [1, 2], "mystery": 1}) == [
        "field 'm' = '12' is not of kind int",
        "field 'mystery' is not in the schema",
    ]
    assert schema.problems({"kind": "nope"}) == ["report kind 'nope' is not in schema.REPORT_KINDS"]
    assert schema.problems({"kind": "non_finite", "first_bad_value": "nan", "input3_shape": [2]}) == []
