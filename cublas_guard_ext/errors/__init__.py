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
from .base import (  # noqa: F401
    GuardError,
)
from .format import (  # noqa: F401
    _DTYPES,
    _PRODUCER_HINTS,
    _ROUTINES,
    _bytes,
    _coords,
    _counts_text,
    _distributed_rank,
    _dtype,
    _environment_line,
    _first_bad_line,
    _fold_inputs,
    _inputs_line,
    _layer,
    _memory_line,
    _routines_on,
    _shape,
    _value_name,
    _watch_lines,
    _where,
)
from .inputs import (  # noqa: F401
    DeviceMismatchError,
    DTypeError,
    ExtensionBuildError,
    NonFiniteEntryError,
    NonFiniteFromNowhereError,
    NonFiniteInputError,
    NonFiniteOutputError,
    ShapeMismatchError,
    SizeLimitError,
    WatchCaptureError,
    _WatchFinding,
)
from .parse import (  # noqa: F401
    _BY_KIND,
    _CAPTURED,
    _PAYLOAD_RE,
    PAYLOAD_MARKER,
    _typed_from_native_message,
    attach_capsule,
    from_native,
    from_payload,
    parse_payload,
)
from .runtime import (  # noqa: F401
    CublasError,
    CublasOutOfMemoryError,
    CudaLaunchError,
    GraphCaptureError,
    OutOfMemoryError,
    PendingCudaError,
)
from .status import (  # noqa: F401
    _NAN_STORY,
    CUBLAS_STATUS,
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
    "NonFiniteFromNowhereError",
    "WatchCaptureError",
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
