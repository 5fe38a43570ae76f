"""``torch.library.opcheck`` on every public op of the extension (``torch.ops.cublas_guard``), in
one place: the schema, the autograd registration, the fake (meta) kernel and AOT dispatch with
dynamic shapes, with sample inputs of every floating dtype the ops take (float32, float64,
bfloat16, float16), on the CPU and, when the CUDA build has a GPU, on CUDA.

The ops are read from the dispatcher, so an op added to csrc/ops.cpp without samples here fails
``test_every_public_op_has_samples`` instead of going unchecked. The test hooks
(``cublas_guard_testing``) and the package's private entry points (``cublas_guard_internal``) are
not the product and are not checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cublas_guard_ext._native.loading.codes import MODE_ASYNC, MODE_SYNC, ROLE_CODES

NAMESPACE = "cublas_guard"
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

Sample = tuple[Any, ...]


def _tensor(dtype: torch.dtype, device: str, *shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=grad)


def _samples(name: str, dtype: torch.dtype, device: str) -> list[Sample]:
    """Sample arguments of op ``name``: finite values, so every check passes and the op returns."""

    def t(*shape: int, grad: bool = True) -> torch.Tensor:
        return _tensor(dtype, device, *shape, grad=grad)

    def offs(*ends: int) -> torch.Tensor:  # a grouped GEMM's int32 group ends
        return torch.tensor(ends, dtype=torch.int32, device=device)

    table: dict[str, Callable[[], list[Sample]]] = {
        "scan": lambda: [(t(7, 3, grad=False),), (t(4, 6, grad=False).t(),), (t(0, grad=False),)],
        "linear": lambda: [
            (t(4, 5), t(3, 5), t(3), "l", MODE_SYNC, False),
            (t(2, 4, 5), t(3, 5), None, "l", MODE_ASYNC, True),
        ],
        "linear_grad_input": lambda: [(t(4, 3), t(3, 5), "l")],
        "linear_grad_weight": lambda: [(t(4, 3), t(4, 5), "l")],
        "check_features": lambda: [(t(4, 5, grad=False), 5, "l")],
        "guard_values": lambda: [(t(4, 5, grad=False), "l", ROLE_CODES["weight"], MODE_SYNC)],
        # Experts: 7 sorted rows in groups of 2, 0 and 3 (an empty expert, and 2 rows past the
        # last end that come back zero); Linear-layout and transposed weights, with a bias.
        "grouped_linear": lambda: [
            (t(7, 5), t(3, 4, 5), t(3, 4), offs(2, 2, 5), "e", "gate_up_proj", MODE_SYNC, False),
            (t(7, 5), t(3, 5, 4), None, offs(2, 2, 5), "e", "down_proj", MODE_ASYNC, True),
        ],
        "grouped_linear_grad_input": lambda: [
            (t(7, 4), t(3, 4, 5), offs(2, 2, 5), "e", "gate_up_proj", False),
            (t(7, 4), t(3, 5, 4), offs(3, 3, 7), "e", "down_proj", True),
        ],
        "grouped_linear_grad_weight": lambda: [
            (t(7, 4), t(7, 5), offs(2, 2, 5), "e", "gate_up_proj", False),
            (t(7, 4), t(7, 5), offs(0, 4, 7), "e", "down_proj", True),
        ],
        # The ops below take no floating tensor: their samples do not depend on the dtype.
        "check_in_graph": lambda: [(torch.empty(0, device=device),)],
        "async_check": lambda: [(True,), (False,)],
        "build_info": lambda: [()],
    }
    return table[name]()


# opcheck's default utilities; an op leaves one out only for a reason written next to it.
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
EXCLUDED_UTILS = {
    # build_info returns a str: test_aot_dispatch_dynamic compares the compiled and eager outputs
    # with torch.testing.assert_close, which has no comparison for str ("No comparison pair was
    # able to handle inputs of type <class 'str'>"). Its schema, autograd and fake checks run.
    "build_info": {"test_aot_dispatch_dynamic"},
}

# Ops whose inputs carry no floating dtype: checked once per device, not once per dtype.
DTYPE_FREE = {"check_in_graph", "async_check", "build_info"}


def public_ops() -> list[str]:
    prefix = NAMESPACE + "::"
    return sorted(
        {s.name[len(prefix) :] for s in torch._C._jit_get_all_schemas() if s.name.startswith(prefix)}
    )


PUBLIC_OPS = public_ops()


def test_every_public_op_has_samples() -> None:
    assert PUBLIC_OPS, f"no op registered under torch.ops.{NAMESPACE}"
    for name in PUBLIC_OPS:
        assert _samples(name, torch.float32, "cpu"), name
    assert set(EXCLUDED_UTILS) <= set(PUBLIC_OPS), "an exclusion names an op that is gone"


def _cases() -> list[Any]:
    cases = []
    for name in PUBLIC_OPS:
        for dtype in [None] if name in DTYPE_FREE else DTYPES:
            label = "any" if dtype is None else str(dtype).removeprefix("torch.")
            cases.append(pytest.param(name, dtype, id=f"{name}-{label}"))
    return cases


@pytest.mark.parametrize("name,dtype", _cases())
def test_opcheck(device: str, name: str, dtype: torch.dtype | None) -> None:
    op = getattr(torch.ops.cublas_guard, name).default
    for args in _samples(name, dtype or torch.float32, device):
        utils = tuple(u for u in ALL_UTILS if u not in EXCLUDED_UTILS.get(name, set()))
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (name, dtype, device, args, result)
