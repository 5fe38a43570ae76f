"""cublas_guard_ext: know why cuBLAS failed, and refuse poisoned Linear inputs.

Public API::

    SafeLinear, SafeConv1D, name_layers          # the drop-in nn.Linear (and GPT-2's Conv1D)
    replace_linear, restore_linear, coverage     # swap them into a model and back
    scan, ScanResult, check_features, linear     # the ops
    check, guard                                 # async-mode reporting
    watch                                        # which op/module first produced NaN/Inf
    replay                                       # run a failure capsule's GEMM alone
    TrainingGuard, NonFiniteStepError            # guard a training step, replay a bad one
    TrainingDivergedError                        # too many bad steps in a row
    SilentCorruptionChecks, SilentCorruptionError  # replicas that disagree, rerun verdicts
    GuardError and its subclasses                # errors with fields
"""

from __future__ import annotations

from . import (
    _module_aliases,  # noqa: F401  (the flat layout's module paths, kept importable)
    _native_callbacks,  # noqa: F401  (loaded before the native library first calls it)
)
from .capsule.replaying import replay
from .errors import (
    CublasError,
    CublasOutOfMemoryError,
    CudaLaunchError,
    DeviceMismatchError,
    DTypeError,
    ExtensionBuildError,
    Fp8ArgumentError,
    Fp8NonFiniteError,
    Fp8RangeError,
    Fp8RangeWarning,
    Fp8ScaleError,
    GraphCaptureError,
    GuardError,
    NonFiniteEntryError,
    NonFiniteFromNowhereError,
    NonFiniteInputError,
    NonFiniteMaskedKeysError,
    NonFiniteOutputError,
    NonFiniteStepError,
    OutOfMemoryError,
    PendingCudaError,
    RouterLogitsError,
    RouterLogitsWarning,
    ShapeMismatchError,
    SilentCorruptionError,
    SizeLimitError,
    TrainingDivergedError,
    WatchCaptureError,
)
from .guarded_linear.nn import SafeConv1D, SafeLinear, name_layers
from .guarded_linear.ops import DTYPE_POLICIES, ScanResult, check, check_features, guard, linear, scan
from .models.swap import Coverage, coverage, replace_linear, restore_linear
from .training.guard import TrainingGuard
from .training.silent_corruption import SilentCorruptionChecks
from .watching.session import watch

__version__ = "0.1.0"

__all__ = [
    "SafeLinear",
    "SafeConv1D",
    "replace_linear",
    "restore_linear",
    "coverage",
    "Coverage",
    "name_layers",
    "scan",
    "ScanResult",
    "check_features",
    "linear",
    "check",
    "guard",
    "watch",
    "WatchCaptureError",
    "NonFiniteFromNowhereError",
    "replay",
    "TrainingGuard",
    "NonFiniteStepError",
    "TrainingDivergedError",
    "SilentCorruptionChecks",
    "SilentCorruptionError",
    "GuardError",
    "DTypeError",
    "ShapeMismatchError",
    "DeviceMismatchError",
    "NonFiniteInputError",
    "Fp8NonFiniteError",
    "Fp8ScaleError",
    "Fp8RangeError",
    "Fp8RangeWarning",
    "Fp8ArgumentError",
    "RouterLogitsError",
    "RouterLogitsWarning",
    "NonFiniteOutputError",
    "NonFiniteMaskedKeysError",
    "NonFiniteEntryError",
    "SizeLimitError",
    "CublasError",
    "CublasOutOfMemoryError",
    "PendingCudaError",
    "CudaLaunchError",
    "GraphCaptureError",
    "OutOfMemoryError",
    "ExtensionBuildError",
    "DTYPE_POLICIES",
]
