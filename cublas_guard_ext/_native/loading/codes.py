"""The integer codes the native ops take: guard modes and tensor roles, the one Python source.

The op schemas take ints (an int keeps a schema simple for torch.compile). C++ defines the
same values as ``GuardMode`` (csrc/linear/guard_mode.h) and ``TensorRole`` (csrc/report/async_record.h);
tests/package/test_codes.py reads every definition of them in csrc/ and fails when one disagrees
with this module. Python code uses these names, never the numbers.
"""

from __future__ import annotations

# GuardMode in csrc/linear/guard_mode.h.
MODE_CODES: dict[str, int] = {"off": 0, "sync": 1, "async": 2}
MODE_OFF = MODE_CODES["off"]
MODE_SYNC = MODE_CODES["sync"]
MODE_ASYNC = MODE_CODES["async"]
# The fast eager entry's "read CUBLAS_GUARD_MODE yourself" (csrc/locked/python_module.cpp).
MODE_ENV_DEFAULT = -1

# TensorRole in csrc/report/async_record.h: what a scanned tensor is to the layer.
ROLE_CODES: dict[str, int] = {"input": 0, "weight": 1, "bias": 2, "grad_output": 3}
ROLE_GRAD_OUTPUT = ROLE_CODES["grad_output"]
