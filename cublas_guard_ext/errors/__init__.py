"""The exception classes, and the one place where their messages are written.

Native code raises a c10 error whose last line is a JSON payload (the error's
kind and fields); :func:`from_native` turns it into one of the classes below.
Each class subclasses the built-in exception users already catch, carries its
fields as attributes (and in ``.fields``), and formats one message: the most
likely cause first, then the details, then what to do next.

Input errors that ``nn.Linear`` itself would raise as ``RuntimeError`` (wrong
shape, dtype, device) are also ``RuntimeError`` subclasses, so code written
around ``nn.Linear`` keeps catching them after the swap.

The package exports exactly ``__all__`` (tests/errors/test_errors_package.py); the helpers
messages are written from are imported from their module. By concern, each module
under 600 lines:

* ``status``      the cublasStatus_t meanings, causes and next steps
* ``format``      the pieces messages are written from (sizes, shapes, memory, environment)
* ``magnitudes``  the magnitudes that explain a non-finite value
* ``base``        GuardError
* ``inputs``      errors about a call's arguments
* ``watch_findings``  what watch raises (an op's NaN/Inf, a bad entry, a capture refused)
* ``optimizer_step``  the lines of a finding born in ``optimizer.step()``
* ``nan_from_inf``    the lines of a NaN born from infinities (a fully masked attention row)
* ``routers``     a guarded MoE router's logits growing toward the softmax's saturation
* ``masked_operands``  an attention's NaN keys/values only at masked-out positions (a cache)
* ``entries``     where an entry finding's values sit and what to do for its role (a cache)
* ``runtime``     errors of the CUDA/cuBLAS runtime (the ones that write a failure capsule)
* ``experts``     a mixture of experts' errors (group offsets, the experts implementation)
* ``fp8``         FP8 GEMMs' errors (an operand's non-finite values, a scale, a range, the arguments)
* ``steps``       TrainingGuard's errors (a bad step, a diverged run)
* ``samples``     TrainingGuard's samples (ids that cannot name the rows, a skip list that cannot be used)
* ``corruption``  finite numbers that cannot be trusted (replicas that differ, a rerun verdict)
* ``run``         the errors of ``python -m cublas_guard_ext run``
* ``parse``       payload line -> typed exception; the capsule hook
* ``schema``      every payload field's name and kind, shared with csrc/ (tests/errors/test_payload_schema.py)
"""

from __future__ import annotations

from .base import GuardError
from .corruption import SilentCorruptionError
from .cuda_runtime import (
    CublasError,
    CublasOutOfMemoryError,
    CudaLaunchError,
    GraphCaptureError,
    OutOfMemoryError,
    PendingCudaError,
)
from .experts import ExpertsImplementationError, GroupOffsetsError
from .fp8 import Fp8ArgumentError, Fp8NonFiniteError, Fp8RangeError, Fp8RangeWarning, Fp8ScaleError
from .inputs import (
    DeviceMismatchError,
    DTypeError,
    ExtensionBuildError,
    NonFiniteInputError,
    ShapeMismatchError,
    SizeLimitError,
)
from .masked_operands import NonFiniteMaskedKeysError
from .parse import PAYLOAD_MARKER, attach_capsule, from_native, from_payload, parse_payload
from .routers import RouterLogitsError, RouterLogitsWarning
from .run import NonFiniteGradientsError, PeerFailedError
from .samples import SampleIdsError, SkipListError
from .status import CUBLAS_STATUS
from .training_steps import NonFiniteStepError, TrainingDivergedError
from .watch_findings import (
    NonFiniteEntryError,
    NonFiniteFromNowhereError,
    NonFiniteOutputError,
    WatchCaptureError,
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
    "NonFiniteMaskedKeysError",
    "WatchCaptureError",
    "ExtensionBuildError",
    "CublasError",
    "PendingCudaError",
    "CudaLaunchError",
    "GraphCaptureError",
    "OutOfMemoryError",
    "CublasOutOfMemoryError",
    "NonFiniteStepError",
    "TrainingDivergedError",
    "SampleIdsError",
    "SkipListError",
    "SilentCorruptionError",
    "PeerFailedError",
    "NonFiniteGradientsError",
    "GroupOffsetsError",
    "ExpertsImplementationError",
    "Fp8NonFiniteError",
    "Fp8ScaleError",
    "Fp8RangeError",
    "Fp8RangeWarning",
    "Fp8ArgumentError",
    "RouterLogitsError",
    "RouterLogitsWarning",
    "PAYLOAD_MARKER",
    "parse_payload",
    "from_payload",
    "from_native",
    "attach_capsule",
]
