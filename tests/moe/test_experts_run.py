"""``python -m cublas_guard_ext run`` guards the experts of an unmodified script's mixture of
experts: whichever of transformers' GEMM implementations the model chose (eager, batched_mm,
grouped_mm), the guarded one runs, and a NaN in an expert's weight is named there."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.run_scripts import reports, run_script, the_error_comes_last, write

pytest.importorskip("transformers")

SCRIPT = """
import torch
import transformers
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

torch.manual_seed(0)
config = transformers.MixtralConfig(
    vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
)
model = transformers.MixtralForCausalLM(config).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.2)
for name in ("eager", "batched_mm", "grouped_mm"):
    print(name, "->", ALL_EXPERTS_FUNCTIONS.get_interface(name, None).__name__)
ids = torch.randint(0, 64, (2, 7))
print("logits", tuple(model(ids).logits.shape))
with torch.no_grad():
    model.model.layers[1].mlp.experts.gate_up_proj[2, 5, 3] = float("nan")
model(ids)
"""


@pytest.mark.slow
def test_run_guards_every_experts_implementation_and_names_the_expert(tmp_path: Path) -> None:
    script = write(tmp_path, "moe.py", SCRIPT)
    out = run_script(tmp_path, script)
    assert out.returncode == 1, out.stderr
    for name in ("eager", "batched_mm", "grouped_mm"):
        assert f"{name} -> guarded_experts_forward" in out.stdout
    assert "logits (2, 7, 64)" in out.stdout
    the_error_comes_last(
        out.stderr,
        "NonFiniteInputError: layer 'model.layers.1.mlp.experts.gate_up_proj[2]': weight has 1 NaN",
    )
    assert "in expert 2 of 'model.layers.1.mlp.experts', parameter gate_up_proj" in out.stderr
    (data,) = reports(tmp_path)
    assert data["where"]["layer"] == "model.layers.1.mlp.experts.gate_up_proj[2]"
