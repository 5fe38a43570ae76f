"""Known-bad CUDA library builds: one table, each row with its source.

The doctor evaluates it against this machine's facts (the loaded cuBLAS, the CUDA runtime,
the GPUs' compute capabilities, what the loaded libcublasLt exports); the tests against
synthetic ones. A row names what goes wrong, on which GPUs and releases, the fix, and where
that is documented. Add a row here, not a check elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .facts import FAIL


def version_tuple(text: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", str(text or "")))


def in_range(version: Any, at_least: str, below: str) -> bool:
    """``at_least <= version < below``, compared only as far as ``version`` is precise: a
    loaded cuBLAS reports three parts (13.1.0), a bound may have four (13.1.0.3); a version
    equal to a bound on every part it has is not taken as inside a range it may be outside."""
    have = version_tuple(version)
    if not have:
        return False
    low, high = version_tuple(at_least), version_tuple(below)
    if have < low[: len(have)]:
        return False
    return have < high[: len(have)]


@dataclass(frozen=True)
class KnownBadBuild:
    name: str
    status: str
    applies: Callable[[dict[str, Any]], bool]
    what: str
    fix: str
    source: str


def _blackwell_tensor_memory(facts: dict[str, Any]) -> bool:
    majors = {version_tuple(cc)[:1] for cc in facts.get("compute_capabilities") or []}
    return bool(majors & {(10,), (11,)}) and in_range(facts.get("cublas"), "12.8", "13.1.0.3")


def _cuda_13_4_preview(facts: dict[str, Any]) -> bool:
    return version_tuple(facts.get("cuda_runtime"))[:2] == (
        13,
        4,
    ) and "cublasLtGroupedMatrixLayoutCreate" in (facts.get("lt_missing_symbols") or [])


KNOWN_BAD_BUILDS: tuple[KnownBadBuild, ...] = (
    KnownBadBuild(
        name="cuBLAS >= 12.8, < 13.1.0.3 on compute capability 10.x/11.x",
        status=FAIL,
        applies=_blackwell_tensor_memory,
        what="a cuBLASLt matmul that runs next to another kernel using tensor memory can give "
        "silently wrong results or NaNs",
        fix='pip install "nvidia-cublas>=13.1.0.3" (or a torch that pins it)',
        source="cuBLAS release notes, quoted in pytorch PR #178333",
    ),
    KnownBadBuild(
        name="CUDA 13.4 preview libcublasLt",
        status=FAIL,
        applies=_cuda_13_4_preview,
        what="its libcublasLt lacks cublasLtGroupedMatrixLayoutCreate, which its own headers "
        "declare: code built against them fails to load ('undefined symbol')",
        fix="use a released CUDA (the nvidia wheels your torch pins), or a corrected 13.4 package",
        source="pytorch #196073",
    ),
)


def matching(facts: dict[str, Any]) -> list[KnownBadBuild]:
    """The rows that apply to ``facts``: ``cublas`` (the loaded cuBLAS, as precise as known),
    ``cuda_runtime``, ``compute_capabilities`` (["10.0", ...]), ``lt_missing_symbols``."""
    return [row for row in KNOWN_BAD_BUILDS if row.applies(facts)]
