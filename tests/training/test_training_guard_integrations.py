"""TrainingGuard in a transformers Trainer (a tiny GPT-2 built from its config, random weights,
offline) and in a Lightning Trainer: real training runs of a few steps, a planted fault named."""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Real training runs in real trainers (and a subprocess): seconds each.
pytestmark = pytest.mark.slow


def test_importing_the_integrations_package_imports_neither_library():
    code = (
        "import sys, cublas_guard_ext, cublas_guard_ext.integrations; "
        "print(any(m in sys.modules for m in ('transformers', 'pytorch_lightning', 'lightning')))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- transformers -----------------------------------------------------------------------------


def plant(module: nn.Module, when) -> None:
    """Replace ``module``'s forward: a log of a negative number when ``when()`` is true."""
    original = module.forward

    def forward(self, x):
        out = original(x)
        return out + torch.log(-out.abs() - 1.0) if when() else out

    module.forward = types.MethodType(forward, module)


def gpt2_trainer(tmp_path, on_nan: str, steps: int = 4, accumulate: int = 1, **overrides):
    transformers = pytest.importorskip("transformers")
    from cublas_guard_ext.integrations.transformers import GuardedTrainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, 64, (steps * 2 * accumulate, 12), generator=g)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        gradient_accumulation_steps=accumulate,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    trainer = GuardedTrainer(model=model, args=args, train_dataset=data, guard_on_nan=on_nan)
    return trainer, model


def test_transformers_trainer_raise_names_the_module_of_a_gpt2(tmp_path):
    trainer, model = gpt2_trainer(tmp_path, "raise")
    plant(model.transformer.h[1].mlp.act, lambda: trainer.state.global_step == 2)
    before = {}

    class Keep(importlib.import_module("transformers").TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 2:
                before.update({k: v.clone() for k, v in model.state_dict().items()})

    trainer.add_callback(Keep())
    with pytest.raises(cg.NonFiniteStepError) as info:
        trainer.train()
    err = info.value
    assert err.op == "aten.log.default" and err.module == "transformer.h.1.mlp.act" and err.phase == "forward"
    assert err.classification == "persistent" and err.step == 3
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_transformers_trainer_skip_drops_the_optimizer_step_and_trains_on(tmp_path):
    trainer, model = gpt2_trainer(tmp_path, "skip", steps=4)
    calls = {"n": 0}

    def third_forward_only():  # one-shot: the replay (call 4) is clean
        calls["n"] += 1
        return calls["n"] == 3

    plant(model.transformer.h[0].mlp.act, third_forward_only)
    with pytest.warns(RuntimeWarning, match="training step 3: "):
        trainer.train()
    assert [(e.step, e.classification) for e in trainer.guard.skipped] == [(3, "transient")]
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {3}, steps  # 4 Trainer steps, one of them dropped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_transformers_trainer_skips_a_step_a_guarded_conv1d_refuses(tmp_path):
    trainer, model = gpt2_trainer(tmp_path, "skip", steps=4)
    cg.replace_linear(model)  # GPT-2's Conv1D projections are guarded too
    calls = {"n": 0}

    def third_forward_only():
        calls["n"] += 1
        return calls["n"] == 3

    plant(model.transformer.h[0].mlp.act, third_forward_only)  # NaN into mlp.c_proj's input
    with pytest.warns(RuntimeWarning, match="layer 'transformer.h.0.mlp.c_proj' refused a non-finite input"):
        trainer.train()
    (err,) = trainer.guard.skipped
    assert err.step == 3 and err.refused_by == "transformer.h.0.mlp.c_proj"
    assert isinstance(err.__cause__, cg.NonFiniteInputError)
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert {int(s["step"]) for s in optimizer.state.values()} == {3}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_transformers_trainer_skip_with_accumulation_drops_the_whole_optimizer_step(tmp_path):
    # 2 micro-batches per optimizer step: the first of step 2 is bad (forward call 3, one-shot);
    # the second (call 5, after the replay) is fine but its step must still be dropped
    trainer, model = gpt2_trainer(tmp_path, "skip", steps=3, accumulate=2)
    calls = {"n": 0}

    def third_forward_only():
        calls["n"] += 1
        return calls["n"] == 3

    plant(model.transformer.h[0].mlp.act, third_forward_only)
    with pytest.warns(RuntimeWarning, match="training step 3: "):  # (step: the 3rd micro-batch)
        trainer.train()
    assert calls["n"] == 7 and len(trainer.guard.skipped) == 1
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert {int(s["step"]) for s in optimizer.state.values()} == {2}  # 3 optimizer steps, one dropped


# -- Lightning ------------------------------------------------------------------------------------


def lightning():
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("make venv installs pytorch-lightning")


def loader(data):
    return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)


def lightning_run(
    on_nan: str, fault_step: int | None, steps: int = 5, transient: bool = False, accumulate: int = 1
):
    pl = lightning()
    from cublas_guard_ext.integrations.lightning import TrainingGuardCallback

    class Fault(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            bad = (
                self.calls == fault_step
                if transient
                else (fault_step is not None and module.trainer.global_step == fault_step - 1)
            )
            return x + torch.log(-x.abs() - 1.0) if bad else x

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), Fault(), nn.Linear(12, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    module = Module()
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps * accumulate)
    ]
    callback = TrainingGuardCallback(on_nan=on_nan)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        accumulate_grad_batches=accumulate,
    )
    return trainer, module, data, callback


def test_lightning_callback_raise_names_the_module():
    trainer, module, data, callback = lightning_run("raise", fault_step=3)
    with pytest.raises(cg.NonFiniteStepError) as info:
        trainer.fit(module, loader(data))
    err = info.value
    assert err.op == "aten.log.default" and err.module == "net.2" and err.phase == "forward"
    assert err.classification == "persistent" and err.step == 3
    optimizer = trainer.optimizers[0]
    assert {int(s["step"]) for s in optimizer.state.values()} == {2}  # steps 1 and 2 only


def test_lightning_callback_skip_equals_a_run_without_that_batch():
    trainer, module, data, callback = lightning_run("skip", fault_step=3, transient=True)
    with pytest.warns(RuntimeWarning, match="training step 3: "):
        trainer.fit(module, loader(data))
    assert [(e.step, e.classification) for e in callback.guard.skipped] == [(3, "transient")]
    ref_trainer, ref, _, _ = lightning_run("raise", fault_step=None, steps=4)
    ref_trainer.fit(ref, loader(data[:2] + data[3:]))
    for (k, a), (_, b) in zip(module.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_lightning_callback_skip_with_accumulation_equals_a_run_without_that_optimizer_step():
    # 2 batches per optimizer step; batch 3 (the first of step 2) is bad once: the whole step
    # 2 is dropped, batch 4's gradients too
    trainer, module, data, callback = lightning_run(
        "skip", fault_step=3, steps=3, transient=True, accumulate=2
    )
    with pytest.warns(RuntimeWarning, match="training step 3: "):
        trainer.fit(module, loader(data))
    assert len(callback.guard.skipped) == 1
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {2}
    ref_trainer, ref, _, _ = lightning_run("raise", fault_step=None, steps=2, accumulate=2)
    ref_trainer.fit(ref, loader(data[:2] + data[4:]))
    for (k, a), (_, b) in zip(module.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def lightning_guarded_run(on_nan: str, nan_batch: int | None, batches: int = 5):
    """A replace_linear'd module; batch ``nan_batch`` (0-based) holds one NaN."""
    pl = lightning()
    from cublas_guard_ext.integrations.lightning import TrainingGuardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
            cg.replace_linear(self)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    module = Module()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(batches)]
    if nan_batch is not None:
        data[nan_batch][0][1, 2] = float("nan")
    callback = TrainingGuardCallback(on_nan=on_nan)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    return trainer, module, data, callback


def test_lightning_fit_skips_a_batch_a_safelinear_refuses_and_finishes():
    trainer, module, data, callback = lightning_guarded_run("skip", nan_batch=2)
    with pytest.warns(RuntimeWarning, match=r"training step 3: layer 'net.0' refused a non-finite input"):
        trainer.fit(module, loader(data))
    assert trainer.state.finished and trainer.fit_loop.epoch_loop.batch_progress.total.completed == 5
    (err,) = callback.guard.skipped
    assert err.refused_by == "net.0" and isinstance(err.__cause__, cg.NonFiniteInputError)
    assert "training_step" not in module.__dict__ and "backward" not in module.__dict__  # unwrapped
    ref_trainer, ref, _, _ = lightning_guarded_run("skip", nan_batch=None, batches=4)
    ref_trainer.fit(ref, loader(data[:2] + data[3:]))
    for (k, a), (_, b) in zip(module.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_lightning_fit_raise_on_a_refused_batch_names_the_layer():
    trainer, module, data, callback = lightning_guarded_run("raise", nan_batch=2)
    with pytest.raises(cg.NonFiniteStepError) as info:
        trainer.fit(module, loader(data))
    assert info.value.refused_by == "net.0" and info.value.step == 3
    assert isinstance(info.value.__cause__, cg.NonFiniteInputError)
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {2}


@pytest.mark.slow  # two fits: ~8-15 s here
def test_lightning_checkpoint_carries_the_guard_state(tmp_path):
    trainer, module, data, callback = lightning_run("raise", fault_step=None, steps=3)
    trainer.fit(module, loader(data))
    assert callback.guard.steps == 3
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"]  # the callback's state is in it
    trainer2, _, _, callback2 = lightning_run("raise", fault_step=None, steps=5)
    trainer2.fit(module, loader(data + data[:2]), ckpt_path=path)
    assert callback2.guard.steps == 5  # 3 restored + 2 more, as one run of 5 would count
    assert [h["step"] for h in json.loads(callback2.guard.state_dict()["history"])] == [1, 2, 3, 4, 5]


def test_the_documented_trainer_checkpoint_example_resumes_the_guard_state(tmp_path):
    # docs/training-guard.md, "Checkpointing the guard": the SaveGuard callback, word for word but
    # for the trainer it reads, then a resume from the first checkpoint.
    transformers = pytest.importorskip("transformers")
    trainer, _ = gpt2_trainer(tmp_path, "skip", save_strategy="steps", save_steps=2)

    class SaveGuard(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kw):
            path = f"{args.output_dir}/checkpoint-{state.global_step}/training_guard.pt"
            torch.save(trainer.guard.state_dict(), path)

    trainer.add_callback(SaveGuard())
    trainer.train()
    ckpt_dir = str(tmp_path / "checkpoint-2")
    assert torch.load(f"{ckpt_dir}/training_guard.pt", weights_only=False)["steps"] == 2
    final = trainer.guard.state_dict()
    assert final["steps"] == 4

    resumed, _ = gpt2_trainer(tmp_path / "resumed", "skip")
    resumed.load_guard_state(torch.load(f"{ckpt_dir}/training_guard.pt", weights_only=False))
    resumed.train(resume_from_checkpoint=ckpt_dir)
    assert resumed.guard.steps == 4  # counted on from 2, as the uninterrupted run did
    again = resumed.guard.state_dict()
    assert again == final  # the history (losses, gradient norms) too: the same trajectory


def test_transformers_mixin_loads_a_saved_guard_state_at_its_first_step():
    pytest.importorskip("transformers")
    from cublas_guard_ext.integrations.transformers import TrainingGuardMixin

    model = nn.Linear(2, 1)
    state = cg.TrainingGuard(model, None).state_dict()
    state["steps"] = 40
    holder = TrainingGuardMixin.__new__(TrainingGuardMixin)
    holder.guard, holder.guard_state = None, None
    holder.load_guard_state(state)
    assert holder.guard_state["steps"] == 40
    holder.guard = cg.TrainingGuard(model, None)
    holder.load_guard_state(state)
    assert holder.guard.steps == 40
