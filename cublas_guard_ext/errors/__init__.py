"""The exception classes, and the one place where their messages are written.

Native code raises a c10 error whose last line is a JSON payload (the error's
kind and fields); :func:`from_native` turns it into one of the classes below.
Each class subclasses the built-in exception users already catch, carries its
fields as attributes (and in ``.fields``), and formats one message: the most
likely cause first, then the details, then what to do next.

Input errors that ``nn.Linear`` itself would raise as ``RuntimeError`` (wrong
shape, dtype, device) are also ``RuntimeError`` subclasses, so code written
around ``nn.Linear`` keeps catching them after the swap.

The package, by concern (each module under 600 lines; ``from cublas_guard_ext.errors
import X`` works for every name, as before the split):

* ``status``   the cublasStatus_t table (meaning, causes, next steps)
* ``format``   the pieces messages are written from (sizes, shapes, memory, environment)
* ``base``     GuardError
* ``inputs``   errors about a call's arguments, and watch's findings
* ``runtime``  errors of the CUDA/cuBLAS runtime (the ones that write a failure capsule)
* ``parse``    payload line -> typed exception; the capsule hook
* ``schema``   every payload field's name and kind, shared with csrc/ (tests/test_payload_schema.py)
"""

from __future__ import annotations

# Importable from errors.py before the split: kept so.
from .._native.facts import error_context  # noqa: F401
from .status import (  # noqa: F401
    CUBLAS_STATUS,
    _NAN_STORY,
)
from .format import (  # noqa: F401
    _bytes,
    _memory_line,
    _environment_line,
    _distributed_rank,
    _watch_lines,
    _layer,
    _DTYPES,
    _dtype,
    _shape,
    _ROUTINES,
    _routines_on,
    _value_name,
    _fold_inputs,
    _coords,
    _where,
    _inputs_line,
    _PRODUCER_HINTS,
    _counts_text,
    _first_bad_line,
)
from .base import (  # noqa: F401
    GuardError,
)
from .inputs import (  # noqa: F401
    DTypeError,
    ShapeMismatchError,
    DeviceMismatchError,
    NonFiniteInputError,
    SizeLimitError,
    _WatchFinding,
    NonFiniteOutputError,
    NonFiniteEntryError,
    ExtensionBuildError,
)
from .runtime import (  # noqa: F401
    CublasError,
    PendingCudaError,
    CudaLaunchError,
    GraphCaptureError,
    OutOfMemoryError,
    CublasOutOfMemoryError,
)
from .parse import (  # noqa: F401
    PAYLOAD_MARKER,
    _PAYLOAD_RE,
    _BY_KIND,
    parse_payload,
    from_payload,
    from_native,
    _CAPTURED,
    attach_capsule,
    _typed_from_native_message,
)

__all__ = [
    "CUBLAS_STATUS",
    "GuardError",
    "DTypeError",
    "ShapeMismatchError",
    "DeviceMismatchError",
    "NonFiniteInputError",
    "SizeLimitError",
    "NonFiniteOutputError",
    "NonFiniteEntryError",
    "ExtensionBuildError",
    "CublasError",
    "PendingCudaError",
    "CudaLaunchError",
    "GraphCaptureError",
    "OutOfMemoryError",
    "CublasOutOfMemoryError",
    "PAYLOAD_MARKER",
    "parse_payload",
    "from_payload",
    "from_native",
    "attach_capsule",
]
