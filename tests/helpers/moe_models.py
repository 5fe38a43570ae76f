"""Tiny mixtures of experts for the tests in tests/moe/: transformers models built from configs
(offline, random weights) covering every experts layout transformers has, a decorated experts
class of our own for the flags no small model combines, a user's own 3-D experts module, and the
grouped GEMM's reference (F.linear per group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64
HIDDEN = 16
EXPERTS = 4


def _init(model: nn.Module, std: float = 0.2) -> nn.Module:
    """Random weights of a useful size (transformers' init leaves 3-D experts at zero or tiny)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    return model


def mixtral(layers: int = 2) -> nn.Module:
    """Gate and up concatenated, [experts, out, in] weights, no bias."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return _init(transformers.MixtralForCausalLM(config)).eval()


def qwen3_moe(layers: int = 2) -> nn.Module:
    """Mixtral's layout with Qwen's router (softmax, top-k, norm_topk_prob)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        moe_intermediate_size=12,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
    )
    return _init(transformers.Qwen3MoeForCausalLM(config)).eval()


def gpt_oss(layers: int = 2) -> nn.Module:
    """Gate and up interleaved, transposed [experts, in, out] weights, biases."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        layer_types=["full_attention"] * layers,
    )
    return _init(transformers.GptOssForCausalLM(config)).eval()


def deepseek_v3(layers: int = 2) -> nn.Module:
    """A router that converts its weight before the product (``self.weight.type(torch.float32)``)
    and sigmoid group routing; a shared expert beside the routed ones."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        moe_intermediate_size=12,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
        max_position_embeddings=64,
    )
    return _init(transformers.DeepseekV3ForCausalLM(config)).eval()


def ergo(layers: int = 2) -> nn.Module:
    """No gate (up projection and an activation), transposed weights, its own forward around the
    experts interface (per-route RMSNorm), a dense first layer and a shared expert."""
    config = transformers.ErgoConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        first_dense_intermediate_size=24,
        num_dense_blocks=1,
        moe_intermediate_size=12,
        shared_intermediate_size=12,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        layer_types=["full_attention"] * layers,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
    )
    return _init(transformers.ErgoForCausalLM(config)).eval()


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss, "ergo": ergo}


def experts_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from cublas_guard_ext.models.experts import is_hf_experts

    return [(n, m) for n, m in model.named_modules() if is_hf_experts(m)]


def decorated_experts(
    *, has_gate: bool, has_bias: bool, is_transposed: bool, post_norm: bool = False
) -> type:
    """An experts class decorated like transformers' own, for flag combinations no small model
    has (no gate with bias in Linear layout, a post-expert norm)."""
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config: object) -> None:
            super().__init__()
            self.num_experts, hidden, inner = EXPERTS, HIDDEN, 12
            width = 2 * inner if has_gate else inner
            up = (EXPERTS, hidden, width) if is_transposed else (EXPERTS, width, hidden)
            down = (EXPERTS, inner, hidden) if is_transposed else (EXPERTS, hidden, inner)
            name = "gate_up_proj" if has_gate else "up_proj"
            setattr(self, name, nn.Parameter(torch.randn(up) * 0.3))
            self.down_proj = nn.Parameter(torch.randn(down) * 0.3)
            if has_bias:
                setattr(self, name + "_bias", nn.Parameter(torch.randn(EXPERTS, width) * 0.3))
                self.down_proj_bias = nn.Parameter(torch.randn(EXPERTS, hidden) * 0.3)
            self.act_fn = nn.SiLU()
            if post_norm:
                self.post_expert_norm = nn.LayerNorm(hidden)

        def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
            """The "eager" implementation: a loop over the experts."""
            out = torch.zeros_like(hidden_states)
            up = self.gate_up_proj if has_gate else self.up_proj
            up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
            down_bias = self.down_proj_bias if has_bias else None
            for e in range(self.num_experts):
                token, position = torch.where(top_k_index == e)
                if token.numel() == 0:
                    continue
                h = _linear(
                    hidden_states[token], up[e], None if up_bias is None else up_bias[e], is_transposed
                )
                h = self._apply_gate(h) if has_gate else self.act_fn(h)
                d_bias = None if down_bias is None else down_bias[e]
                h = _linear(h, self.down_proj[e], d_bias, is_transposed)
                if post_norm:
                    h = self.post_expert_norm(h)
                out.index_add_(0, token, h * top_k_weights[token, position, None])
            return out

    return use_experts_implementation(
        Experts,
        has_gate=has_gate,
        has_bias=has_bias,
        is_transposed=is_transposed,
        has_post_expert_norm=post_norm,
    )


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ w if transposed else F.linear(x, w)
    return out if b is None else out + b


def experts_config(implementation: str = "grouped_mm") -> object:
    config = transformers.PretrainedConfig()
    config._experts_implementation = implementation
    return config


class OwnExperts(nn.Module):
    """A user's own mixture of experts: a 3-D Parameter multiplied with bmm in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) * 0.2)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.unsqueeze(1), self.w[expert]).squeeze(1)


def grouped_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    """The grouped GEMM as F.linear per group, zero rows past the last end."""
    ends = [int(e) for e in offs.tolist()]
    out_features = weight.shape[2] if transposed else weight.shape[1]
    pieces, begin = [], 0
    for e, end in enumerate(ends):
        w = weight[e].t() if transposed else weight[e]
        if end > begin:
            pieces.append(F.linear(x[begin:end], w, None if bias is None else bias[e]))
        begin = end
    dtype = pieces[0].dtype if pieces else x.dtype  # (under autocast, F.linear's)
    pieces.append(x.new_zeros(x.shape[0] - begin, out_features, dtype=dtype))
    return torch.cat(pieces)
