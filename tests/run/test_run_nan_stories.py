"""``run --watch`` on the NaN stories of issue 47, unmodified scripts in subprocesses: a character
GPT whose AdamW learning rate is far too high (the optimizer step named, with the state, the
gradient's magnitude, the lr and the losses before it) and eager attention with left padding
and a causal mask (the softmax over fully masked rows named as a birth)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.run_scripts import reports, run_script, the_error_comes_last, write

pytestmark = pytest.mark.slow

CHAR_GPT = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
V, D, T = 65, 64, 32
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D); self.qkv = nn.Linear(D, 3 * D); self.proj = nn.Linear(D, D)
    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D); self.pos = nn.Embedding(T, D)
        self.blocks = nn.Sequential(Block(), Block()); self.head = nn.Linear(D, V)
    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.blocks(x))
model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=3e3)
data = torch.randint(0, V, (8, T + 1))
for step in range(10):
    logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, V), data[:, 1:].reshape(-1))
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_adamw_divergence_is_named_as_the_optimizer_step(tmp_path: Path) -> None:
    out = run_script(tmp_path, write(tmp_path, "gpt.py", CHAR_GPT), "--watch")
    assert out.returncode == 1, out.stderr
    # (which parameter overflows first depends on the CPU's summation order: not asserted)
    the_error_comes_last(
        out.stderr,
        "NonFiniteOutputError: watch: AdamW.step() (optimizer step, step 2) produced",
    )
    assert re.search(r"into exp_avg_sq of parameter '[a-z0-9.]+(weight|bias)' from finite inputs", out.stderr)
    # The magnitudes differ between torch releases' CPU kernels (torch 2.13: a gradient of ~1e21
    # and a second loss of 2.764e+17; torch 2.14.1: 1.959e+30 and 2.765e+17): their form is
    # asserted, not their digits.
    assert re.search(
        r"[0-9.]+e\+\d\d squared is [0-9.]+e\+\d\d, past the float32 range 3.403e\+38", out.stderr
    )
    assert re.search(
        r"recent losses \(passed to backward, oldest first\): 4\.49\d*, 2\.76\de\+17\n", out.stderr
    )
    assert "lr=3000 is far above AdamW's usual 1e-4 to 1e-3" in out.stderr
    assert "allow=" not in out.stderr and "--watch" not in out.stderr.split("Next:")[1]
    (data,) = reports(tmp_path)
    assert data["where"]["phase"] == "optimizer step" and data["where"]["step"] == 2


LEFT_PADDED_ATTENTION = """
import math, torch, torch.nn as nn
torch.manual_seed(0)
B, T, D, H = 2, 6, 16, 2
class Attn(nn.Module):
    def __init__(self):
        super().__init__(); self.qkv = nn.Linear(D, 3 * D); self.proj = nn.Linear(D, D)
    def forward(self, x, allowed):
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D // H)).masked_fill(~allowed, float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))
class Model(nn.Module):
    def __init__(self):
        super().__init__(); self.attn = Attn(); self.head = nn.Linear(D, 3)
    def forward(self, x, allowed):
        return self.head(self.attn(x, allowed))
keep = torch.ones(B, T, dtype=torch.bool); keep[0, :2] = False  # left padding
allowed = torch.ones(T, T, dtype=torch.bool).tril() & keep[:, None, None, :]
Model()(torch.randn(B, T, D), allowed).sum().backward()
"""


def test_a_fully_masked_query_is_named_at_the_softmax_not_refused_later(tmp_path: Path) -> None:
    out = run_script(tmp_path, write(tmp_path, "attn.py", LEFT_PADDED_ATTENTION), "--watch")
    assert out.returncode == 1, out.stderr
    the_error_comes_last(
        out.stderr,
        "NonFiniteOutputError: watch: aten._softmax.default in module 'attn' (forward) produced 24 NaN, "
        "0 +Inf, 0 -Inf from inputs that held Inf but no NaN",
    )
    assert "4 of 24 (batch, head, query) rows had every key masked" in out.stderr
    assert "reached: the input of cublas_guard.linear.default, which refused it" in out.stderr
    assert "NonFiniteInputError" not in out.stderr and "--watch" not in out.stderr.split("Next:")[1]
