"""``python -m cublas_guard_ext build``: compile the version-locked library for this torch.

The wheel carries the stable core, which runs the guarded layers on every torch from its
floor on, and a locked library for the one torch (and CPython) it was built with. Elsewhere,
what needs the locked library (watch, the fast eager entry) is compiled here once, into
torch's extension cache; every later process loads it instead of the core.

The build runs in a child process that asks for the locked library alone
(CUBLAS_GUARD_EXT_NATIVE=locked): a process that already loaded the core cannot load a second
library registering the same ops.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = (
    "from cublas_guard_ext._native.loading import loader\n"
    "info = loader.load()\n"
    "print(f'cublas_guard_ext: the version-locked library is ready ({info.kind}): {info.path}')\n"
)


def main() -> int:
    """Build (or find up to date) the locked library; 0 when it loads, else the child's code."""
    env = dict(os.environ, CUBLAS_GUARD_EXT_NATIVE="locked")
    env.pop("CUBLAS_GUARD_EXT_FORCE_JIT", None)
    rc = subprocess.call([sys.executable, "-c", _CHILD], env=env)
    if rc == 0:
        print("cublas_guard_ext: new processes use it (watch included); this one keeps what it loaded")
    return rc
