"""TrainingGuard where users train; each integration is imported only when used.

* :mod:`cublas_guard_ext.integrations.transformers`: ``GuardedTrainer`` and
  ``TrainingGuardMixin`` for a ``transformers.Trainer``.
* :mod:`cublas_guard_ext.integrations.lightning`: ``TrainingGuardCallback`` for a
  Lightning ``Trainer`` (``pytorch_lightning`` or ``lightning``).

Importing this package imports neither library.
"""
