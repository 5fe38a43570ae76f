"""The failure capsule: the failing GEMM call written to a file (contents.py: what a capsule
holds, writing it, reading it back), the safe read of a file that may not be one
(safe_read.py), and the replay of the call alone in a fresh process (replaying.py)."""

from __future__ import annotations

from .contents import (
    DEFAULT_KEEP,
    DEFAULT_MAX_BYTES,
    ENV_DIR,
    ENV_KEEP,
    ENV_MAX_BYTES,
    ENV_OFF,
    FORMAT,
    GEMM_ARGUMENT_FIELDS,
    SUFFIX,
    UNREAD_C,
    VERSION,
    build,
    capture,
    directory,
    enabled,
    environment,
    load,
    loaded_cublas,
    max_bytes,
)
from .safe_read import NOT_A_CAPSULE, REFUSED_CODE, CapsuleFileError

__all__ = [
    "FORMAT",
    "VERSION",
    "SUFFIX",
    "ENV_OFF",
    "ENV_DIR",
    "ENV_MAX_BYTES",
    "ENV_KEEP",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_KEEP",
    "GEMM_ARGUMENT_FIELDS",
    "UNREAD_C",
    "NOT_A_CAPSULE",
    "REFUSED_CODE",
    "CapsuleFileError",
    "enabled",
    "directory",
    "max_bytes",
    "loaded_cublas",
    "environment",
    "build",
    "capture",
    "load",
]
