"""Spikes: a loss or gradient norm far out of its recent history, judged on the device.

The history is a ``[2, window]`` float32 ring on the loss's device (loss, gradient norm of
the steps taken); the judgement is a robust z-score: ``(value - median) / scale`` with
``scale = max(1.4826 * MAD, floor * |median|)`` over the values kept, MAD the median absolute
deviation. Robust, so one earlier spike does not hide the next; the floor keeps a converged,
nearly constant loss (MAD ~ 0) from calling every wobble a spike. Only upward spikes count
(a loss that drops is not suspicious), and only once ``min_history`` steps are kept.

Everything stays on the device: the verdict is a 0-d bool tensor that TrainingGuard folds
into its one flag read, so a healthy step adds a few small kernels and no host sync. The
host keeps only the ring's position and fill (plain ints).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["SpikeDetector"]


class SpikeDetector:
    """Judge each step's loss and gradient norm against the last ``window`` steps taken."""

    def __init__(self, threshold: float, window: int, min_history: int, floor: float) -> None:
        self.threshold = float(threshold)
        self.window = int(window)
        self.min_history = int(min_history)
        self.floor = float(floor)
        self.values: torch.Tensor | None = None
        self.pos = 0
        self.filled = 0
        self._current: torch.Tensor | None = None

    @staticmethod
    def _scalar(value: Any, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.detach().reshape(()).float().to(device, non_blocking=True)
        if isinstance(value, (int, float)):
            return torch.tensor(float(value), device=device)
        return torch.tensor(math.nan, device=device)  # not known: never a spike (NaN compares false)

    def judge(self, loss: Any, grad_norm: torch.Tensor | None) -> torch.Tensor | None:
        """A 0-d bool tensor: this step's loss or gradient norm is a spike (no host sync); None
        without a usable value. Keeps the values for :meth:`keep`."""
        device = None
        for v in (loss, grad_norm):
            if isinstance(v, torch.Tensor):
                device = v.device
                break
        if device is None:
            self._current = None
            return None
        current = torch.stack([self._scalar(loss, device), self._scalar(grad_norm, device)])
        self._current = current
        if self.values is None or self.values.device != device:
            self.values = torch.zeros(2, self.window, device=device)
            self.pos = self.filled = 0
        if self.filled < self.min_history:
            return torch.zeros((), dtype=torch.bool, device=device)
        kept = self.values[:, : self.filled]
        median = kept.median(dim=1).values
        mad = (kept - median[:, None]).abs().median(dim=1).values
        scale = torch.maximum(1.4826 * mad, self.floor * median.abs()).clamp_min(1e-30)
        z = (current - median) / scale
        self._z = z
        self._median = median
        return (z > self.threshold).any()

    def keep(self) -> None:
        """The step was taken: its values join the history (a device write, no sync)."""
        if self._current is None or self.values is None:
            return
        finite = torch.isfinite(self._current)
        # a value not known (NaN: no loss returned, no gradient) keeps the slot's old value
        self.values[:, self.pos] = torch.where(finite, self._current, self.values[:, self.pos])
        self.pos = (self.pos + 1) % self.window
        self.filled = min(self.filled + 1, self.window)

    def describe(self) -> str:
        """The last judgement in words (host reads: only for a message)."""
        if self._current is None or getattr(self, "_z", None) is None:
            return "a spike"
        cur, z, med = self._current.tolist(), self._z.tolist(), self._median.tolist()
        parts = []
        for name, c, zz, m in zip(("loss", "gradient norm"), cur, z, med, strict=True):
            if math.isfinite(zz) and zz > self.threshold:
                parts.append(
                    f"{name} {c:.6g} against a median of {m:.6g} over the last {self.filled} steps "
                    f"(robust z-score {zz:.3g} > {self.threshold:g})"
                )
        return "; ".join(parts) or "a spike"
