"""Inputs and layers of the input matrix (errors/test_bad_inputs*.py, linear/test_edge_inputs.py):
a named layer, a bitwise snapshot of a tensor, and the check that a layer still works."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches

NAN, INF = float("nan"), float("inf")


NAME = "enc.3.fc"  # every layer of the input matrix is named, so every message can be checked for it


@dataclasses.dataclass
class Snapshot:
    """Everything about a tensor a guard could change by mistake."""

    raw: torch.Tensor | None  # the whole storage as bytes (bitwise: NaN payloads included)
    version: int
    geometry: tuple

    @classmethod
    def of(cls, t: torch.Tensor) -> Snapshot:
        raw = None
        if t.device.type != "meta" and t.layout == torch.strided:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()
        return cls(raw, t._version, (t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset()))

    def assert_same(self, t: torch.Tensor, what: str = "input") -> None:
        assert t._version == self.version, f"the guard wrote to its {what} in place"
        assert (t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset()) == self.geometry
        if self.raw is not None:
            now = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            assert torch.equal(now, self.raw), f"the {what}'s storage changed (bitwise)"


def make_layer(
    device: str, in_features: int = 8, out_features: int = 4, bias: bool = True, mode: str | None = None
) -> cg.SafeLinear:
    return cg.SafeLinear(in_features, out_features, bias=bias, device=device, name=NAME, mode=mode)


def still_works(safe: cg.SafeLinear, batch: tuple[int, ...] = (3,)) -> None:
    """Forward and backward match F.linear on a fresh, clean input."""
    device = safe.weight.device
    x = torch.randn(*batch, safe.in_features, device=device, requires_grad=True)
    y = safe(x)
    ref_x = x.detach().clone().requires_grad_(True)
    params = [p for p in (safe.weight, safe.bias) if p is not None]
    ref = F.linear(ref_x, safe.weight, safe.bias)
    assert_matches(y, ref)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params], grad)
    want = torch.autograd.grad(ref, [ref_x, *params], grad)
    for g, w in zip(got, want):
        assert_matches(g, w)


def randn_with(shape: tuple[int, ...], device: str, where: dict[tuple[int, ...], float]) -> torch.Tensor:
    x = torch.randn(shape, device=device)
    for index, value in where.items():
        x[index] = value
    return x
