"""The stable core alone, for the tests (CUBLAS_GUARD_EXT_NATIVE=core)."""

from __future__ import annotations

from typing import Any

import torch

from cublas_guard_ext._native.core_twins import stable_core


class _Translating:
    """A test hook's op (packet or overload) whose errors arrive typed, as the locked library
    raises them from native code."""

    def __init__(self, op: Any) -> None:
        self._op = op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return stable_core.typed_errors(self._op)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._op, name)
        return _Translating(attr) if callable(attr) and not isinstance(attr, type) else attr


def translate_test_hooks() -> None:
    """Every op of torch.ops.cublas_guard_testing, wrapped (the namespace caches its packets)."""
    namespace = torch.ops.cublas_guard_testing
    names = {
        name.split("::", 1)[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("cublas_guard_testing::")
    }
    for name in sorted(names):
        setattr(namespace, name, _Translating(getattr(namespace, name)))


__all__ = ["translate_test_hooks"]
