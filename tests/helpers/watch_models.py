"""Small models with planted NaN/Inf producers for the watch tests, and the check that a watch
block left nothing behind."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

watch_module = importlib.import_module("cublas_guard_ext.watching.session")
patches_module = importlib.import_module("cublas_guard_ext.watching.global_patches")


def nothing_left() -> None:
    """No hook, session or patch of a watch block is left once it has exited."""
    mod = torch.nn.modules.module
    assert not mod._global_forward_pre_hooks
    assert not mod._global_forward_hooks
    assert not watch_module._is_active()
    assert torch.autograd.backward is patches_module._originals.get("backward", torch.autograd.backward)
    assert patches_module._patch_users == 0


class FeedForward(nn.Module):
    def __init__(self, width: int, planted: str = "") -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.planted == "log":
            h = torch.log(h - 100.0)  # log of a negative number: NaN, from finite inputs
        elif self.planted == "sqrt":
            h = torch.sqrt(torch.relu(h) * 0.0)  # sqrt(0) = 0: finite forward, Inf gradient
        elif self.planted == "log_":
            h = (h - 100.0).log_()
        return self.fc2(h)


class Attention(nn.Module):
    """Scores with an additive causal -inf mask built inside forward, masked_fill, softmax."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        causal = torch.full((t, t), float("-inf")).triu(1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + causal
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return F.softmax(scores, dim=-1) @ v


class Block(nn.Module):
    def __init__(self, width: int, planted: str = "") -> None:
        super().__init__()
        self.attn = Attention(width)
        self.norm = nn.LayerNorm(width)
        self.ff = FeedForward(width, planted)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x), pad)
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, width: int = 16, planted: str = "", planted_layer: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, planted if i == planted_layer else "") for i in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        if pad is None:
            pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
            pad[:, -1] = True  # the last position is padding
        for layer in self.layers:
            x = layer(x, pad)
        return self.head(x).sum()


def batch(width: int = 16) -> torch.Tensor:
    return torch.randn(2, 5, width)


class LogHead(nn.Module):
    """fc, then log(relu(h)) where relu makes exact zeros: log(0) = -inf at birth."""

    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(torch.relu(self.fc(x)))  # -inf where relu gave 0
        if self.clamp:
            h = h.clamp_min(-30.0)  # what the model does with it: finite again
        return h


class Net(nn.Module):
    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.head = LogHead(clamp)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(x))


class Identityish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + bias


def tiny_t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)
