"""Guard modes and how the default is chosen.

* ``"sync"`` (default): the offending layer's forward raises, before its output
  is returned. On CUDA this costs one host synchronization per call.
* ``"async"``: no host synchronization. A scan that finds non-finite values
  fills a record the host reads later; the error (naming the layer and the
  call) is raised by the next guarded call, by :func:`check`, or at the end of
  a :func:`guard` block, whichever comes first.
* ``"off"``: no value scan; the host-side checks and the checked cuBLAS call stay.

The default for layers without their own mode: the innermost :func:`guard`
block of this context, else the ``CUBLAS_GUARD_MODE`` environment variable,
else ``"sync"``. A layer's own ``mode`` always wins.

"This context" is a :mod:`contextvars` context: each thread and each asyncio
task has its own (a task starts with the blocks open where it was created), so
a block in one task never changes another's mode. A generator has no context
of its own (PEP 568 was deferred): a block open inside a suspended generator is
seen by its caller until the generator resumes and leaves it. Whatever the
order in which blocks end, each removes exactly its own entry.
"""

from __future__ import annotations

import contextvars
import os
from typing import Literal

import torch

from .._native.loading import codes as _codes

Mode = Literal["off", "sync", "async"]
MODE_CODES = _codes.MODE_CODES  # the one source: _native/loading/codes.py
ENV_VAR = "CUBLAS_GUARD_MODE"

# The open guard() blocks, innermost last: (block id, mode) pairs.
_blocks: contextvars.ContextVar[tuple[tuple[object, Mode], ...]] = contextvars.ContextVar(
    "cublas_guard_blocks", default=()
)


def validate(mode: str) -> Mode:
    """Return ``mode`` if it names a mode, else raise ``ValueError``."""
    if mode not in MODE_CODES:
        raise ValueError(f"cublas_guard_ext: mode must be one of {sorted(MODE_CODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _env_default() -> Mode:
    value = os.environ.get(ENV_VAR, "sync").strip().lower() or "sync"
    if value not in MODE_CODES:
        raise ValueError(
            f"cublas_guard_ext: {ENV_VAR}={value!r} is not a mode; use one of {sorted(MODE_CODES)}"
        )
    return value  # type: ignore[return-value]


def current() -> Mode:
    """The mode a layer without its own ``mode`` uses right now, in this context.

    Under ``torch.compile`` the mode is read once, when the graph is traced
    (Dynamo cannot trace a ``ContextVar``): a compiled graph keeps the default
    mode in force when it was compiled. A layer's own ``mode`` is unaffected.
    """
    if torch.compiler.is_compiling():
        return _current_when_traced()
    return _current()


def _current() -> Mode:
    blocks = _blocks.get()
    if blocks:
        return blocks[-1][1]
    return _env_default()


def _current_when_traced() -> Mode:
    return _current()


# What ``torch._dynamo.assume_constant_result`` does (Dynamo calls the function once while tracing
# and puts its result in the graph as a constant), without importing torch._dynamo here: that
# import alone costs over a second, at every ``import cublas_guard_ext``. tests/linear/test_modes.py
# checks that the decorator still sets exactly this.
_current_when_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]
