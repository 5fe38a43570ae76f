"""Guard modes and how the default is chosen.

* ``"sync"`` (default): the offending layer's forward raises, before its output
  is returned. On CUDA this costs one host synchronization per call.
* ``"async"``: no host synchronization. A scan that finds non-finite values
  fills a record the host reads later; the error (naming the layer and the
  call) is raised by the next guarded call, by :func:`check`, or at the end of
  a :func:`guard` block, whichever comes first.
* ``"off"``: no value scan; the host-side checks and the checked cuBLAS call stay.

The default for layers without their own mode: the innermost :func:`guard`
block of this thread, else the ``CUBLAS_GUARD_MODE`` environment variable,
else ``"sync"``. A layer's own ``mode`` always wins.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Literal

Mode = Literal["off", "sync", "async"]
MODE_CODES: dict[str, int] = {"off": 0, "sync": 1, "async": 2}
ENV_VAR = "CUBLAS_GUARD_MODE"

_local = threading.local()


def validate(mode: str) -> Mode:
    """Return ``mode`` if it names a mode, else raise ``ValueError``."""
    if mode not in MODE_CODES:
        raise ValueError(
            f"cublas_guard_ext: mode must be one of {sorted(MODE_CODES)}, got {mode!r}"
        )
    return mode  # type: ignore[return-value]


def _env_default() -> Mode:
    value = os.environ.get(ENV_VAR, "sync").strip().lower() or "sync"
    if value not in MODE_CODES:
        raise ValueError(
            f"cublas_guard_ext: {ENV_VAR}={value!r} is not a mode; use one of {sorted(MODE_CODES)}"
        )
    return value  # type: ignore[return-value]


def current() -> Mode:
    """The mode a layer without its own ``mode`` uses right now, in this thread."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return _env_default()


@contextlib.contextmanager
def guard(mode: Mode = "async", *, check_on_exit: bool = True) -> Iterator[None]:
    """Run a block with a default mode; on exit, wait for and report async findings.

    >>> with cublas_guard_ext.guard("async"):
    ...     loss = model(x).sum(); loss.backward()
    # any NaN/Inf recorded inside the block is raised here at the latest
    """
    validate(mode)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(mode)
    try:
        yield
    finally:
        stack.pop()
    # Only on a normal exit: an exception already in flight is the better report.
    if check_on_exit:
        from .ops import check

        check()
