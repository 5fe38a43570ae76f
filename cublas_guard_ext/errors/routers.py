"""A guarded MoE router's logits growing toward the softmax's saturation (issue 47, point 6).

models/routers.py measures the absmax of a guarded router's logits after its product; above the
threshold for the logits' dtype it warns once per router with :class:`RouterLogitsWarning`
(:class:`RouterLogitsError` when strict: ``cublas_guard_ext.models.routers.set_router_limits(
strict=True)`` or ``CUBLAS_GUARD_ROUTER_STRICT=1``). The text says what the numbers mean and the
next step: router z-loss (ST-MoE, Zoph et al. 2022, eq. 5), the router in float32, a lower
learning rate or clipping.
"""

from __future__ import annotations

import math
from typing import Any

from .base import GuardError


class RouterLogitsWarning(UserWarning):
    """A guarded router's logits crossed the threshold for their dtype (docs/moe.md, "Router
    logits"): the routing instability router z-loss exists to fight, before any value overflows.
    Once per router."""


def _overflow_at(dtype: str) -> str:
    """Where exp overflows for the logits' dtype (ln of the largest finite value)."""
    largest = {"torch.float16": 65504.0, "torch.float64": 1.7976931348623157e308}.get(
        dtype, 3.4028234663852886e38
    )
    return f"{math.log(largest):.2f}"


def router_logits_message(fields: dict[str, Any]) -> str:
    """The text of RouterLogitsWarning and RouterLogitsError."""
    f = fields
    dtype = str(f.get("dtype"))
    text = (
        f"cublas_guard_ext: router '{f.get('router')}': its logits reached an absmax of {f.get('absmax'):.4g} "
        f"({dtype}), above the threshold {f.get('threshold'):g} for {dtype} "
        f"(exp overflows {dtype} past {_overflow_at(dtype)})"
    )
    frac = f.get("one_hot_fraction")
    if frac is not None:
        text += (
            f"\n  {frac:.1%} of its {f.get('tokens')} tokens route with a top-1 probability above 0.99 "
            "(the routing collapses to one-hot before anything overflows)"
        )
    if f.get("call") is not None:
        text += f"\n  at the router's call {f['call']}; warned once per router"
    text += (
        "\n  the router instability of large-logit MoE training: the logits grow until the softmax "
        "saturates, then its rounding and its gradients break first"
        "\nNext: add router z-loss (ST-MoE): z_loss = 1e-3 * mean over tokens of "
        "logsumexp(router_logits, dim=-1) ** 2, added to the loss"
    )
    if dtype != "torch.float32":
        text += f"\n      compute the router in float32 (its product and the softmax), not {dtype}"
    text += (
        "\n      lower the learning rate or clip gradients (torch.nn.utils.clip_grad_norm_); "
        "a threshold of your own: cublas_guard_ext.models.routers.set_router_limits(threshold=...)"
    )
    return text


class RouterLogitsError(GuardError, ValueError):
    """RouterLogitsWarning raised as an error (strict: ``set_router_limits(strict=True)`` or
    ``CUBLAS_GUARD_ROUTER_STRICT=1``)."""

    kind = "router_logits"

    def _format(self) -> str:
        return router_logits_message(self.fields)
