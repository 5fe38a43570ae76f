"""No false alarm (issue 47, point 5): transformers' architectures, tiny and random, run a
forward and backward under watch with padding on both sides, eager and SDPA attention. Their
masks leave every real query a key; the padded queries of a left-padded causal model see no
real key, and transformers keeps them finite (finfo.min, not -inf; _unmask_unattended for SDPA),
so the new rule (a NaN made from Inf-only inputs is a birth) must stay silent on all of them."""

from __future__ import annotations

import pytest
import torch

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 48, "vocab_size": 64}


def _decoder(name: str) -> torch.nn.Module:
    if name == "llama":
        config = transformers.LlamaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=1)
        return transformers.LlamaForCausalLM(config)
    if name == "mistral":
        config = transformers.MistralConfig(
            **SMALL, num_hidden_layers=2, num_key_value_heads=1, sliding_window=4
        )
        return transformers.MistralForCausalLM(config)
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_head=2, n_layer=2, vocab_size=64, n_positions=32)
        return transformers.GPT2LMHeadModel(config)
    if name == "bert":
        config = transformers.BertConfig(**SMALL, num_hidden_layers=2, max_position_embeddings=32)
        return transformers.BertForMaskedLM(config)
    raise ValueError(name)


def _mask(padding: str) -> torch.Tensor:
    mask = torch.ones(2, 8, dtype=torch.long)
    if padding == "left":
        mask[0, :3] = 0
    else:
        mask[0, -3:] = 0
    return mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "bert"])
def test_padding_on_either_side_runs_clean(name, padding, attn):
    torch.manual_seed(0)
    model = _decoder(name)
    model.set_attn_implementation(attn)
    ids = torch.randint(1, 64, (2, 8))
    with cg.watch(model, mode="sync"):
        out = model(input_ids=ids, attention_mask=_mask(padding), labels=ids)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    nothing_left()


@pytest.mark.parametrize("padding", ["left", "right"])
def test_t5_and_whisper_with_padding_run_clean(padding):
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=64,
            d_model=32,
            d_kv=16,
            d_ff=48,
            num_layers=1,
            num_heads=2,
            pad_token_id=0,
            decoder_start_token_id=0,
        )  # fmt: skip
    )
    ids = torch.randint(1, 64, (2, 8))
    with cg.watch(t5, mode="sync"):
        out = t5(input_ids=ids, attention_mask=_mask(padding), labels=ids)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    whisper = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(
            vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, num_mel_bins=8,
            max_source_positions=8, max_target_positions=16, pad_token_id=0, decoder_start_token_id=1,
        )
    )  # fmt: skip
    features = torch.randn(2, 8, 16)
    with cg.watch(whisper, mode="sync"):
        out = whisper(input_features=features, decoder_attention_mask=_mask(padding), labels=ids)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    nothing_left()
