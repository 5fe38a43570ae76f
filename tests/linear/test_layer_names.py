"""Names that follow the model (cublas_guard_ext/guarded_linear/naming.py): an error names the layer by its path
in the model it runs in now, after PEFT's merge_and_unload, torch.compile, DDP/FSDP wrapping or a
block moved by hand, in forward, in backward and in a deferred report; never by a path that no
longer exists."""

from __future__ import annotations

import copy
import gc
import tempfile
import warnings
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

NAN = float("nan")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def lora_merged() -> tuple[nn.Module, nn.Module]:
    """(the PeftModel, the merged model): fc1 was LoRA's target, so its guarded base layer was
    named 'base_model.model.fc1.base_layer' and now sits at 'fc1'."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(MLP(), peft.LoraConfig(target_modules=["fc1"], r=2))
    cg.replace_linear(lora)
    assert lora.base_model.model.fc1.base_layer.guard_name == "base_model.model.fc1.base_layer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lora, lora.merge_and_unload()


def nan_input() -> torch.Tensor:
    x = torch.randn(2, 8)
    x[0, 1] = NAN
    return x


def backward_with_nan(model: nn.Module, layer: nn.Module | None = None) -> cg.NonFiniteInputError:
    """A NaN gradient arriving at ``layer`` (scan_grad; every guarded layer by default): the error
    is raised in backward, where no module of the model is running."""
    for module in model.modules():
        if isinstance(module, cg.SafeLinear):
            module.scan_grad = layer is None or module is layer
    out = model(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(cg.NonFiniteInputError) as info:
        (out * NAN).sum().backward()
    assert info.value.role == "grad_output"
    return info.value


def test_after_merge_and_unload_a_backward_error_names_the_merged_path():
    lora, merged = lora_merged()
    alive = weakref.ref(lora)
    del lora
    gc.collect()
    assert alive() is None  # the user kept only the merged model
    err = backward_with_nan(merged)
    assert err.layer == "fc2" and str(err).startswith("layer 'fc2': grad_output has")
    assert (merged.fc1.guard_name, merged.fc2.guard_name) == ("fc1", "fc2")


def test_with_the_peft_model_kept_a_backward_error_names_a_path_that_exists():
    lora, merged = lora_merged()
    err = backward_with_nan(merged, merged.fc1)  # named '...fc1.base_layer', a path gone
    assert err.layer == "base_model.model.fc1" and lora.get_submodule(err.layer) is merged.fc1


def test_after_merge_and_unload_a_deferred_report_names_the_merged_path():
    lora, merged = lora_merged()
    del lora
    gc.collect()
    merged.fc1.mode = "async"
    merged.fc1(nan_input())  # (a later guarded call would report it at its own call)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()  # outside every forward
    assert info.value.deferred and info.value.layer == "fc1"


def test_a_compiled_model_is_named_through_its_wrapper():
    lora, merged = lora_merged()
    compiled = torch.compile(merged, backend="eager")
    with pytest.raises(cg.NonFiniteInputError) as info:
        compiled(nan_input())
    assert info.value.layer == "fc1"
    model = cg.replace_linear(MLP())
    cg.name_layers(torch.compile(model, backend="eager"))  # named through the wrapper: no _orig_mod.
    assert model.fc1.guard_name == "fc1"
    torch._dynamo.reset()


def test_a_compiled_models_backward_error_keeps_the_models_names():
    model = cg.replace_linear(MLP())
    compiled = torch.compile(model, backend="eager")
    assert backward_with_nan(compiled).layer == "fc2"
    torch._dynamo.reset()


class Holder(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module) -> None:
        super().__init__()
        self.block = nn.Sequential(fc1, nn.ReLU(), fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_layers_moved_by_hand_are_named_where_they_are_now():
    old = cg.replace_linear(MLP())
    new = Holder(old.fc1, old.fc2)
    del old
    gc.collect()
    assert backward_with_nan(new).layer == "block.2"  # backward: no model on the stack
    assert new.block[0].guard_name == "block.0"  # the whole model renamed
    other = cg.replace_linear(MLP())
    newer = Holder(other.fc1, other.fc2)
    with pytest.raises(cg.NonFiniteInputError) as info:
        newer(nan_input())  # forward
    assert info.value.layer == "block.0"


def test_a_name_that_still_holds_is_kept():
    model = cg.replace_linear(MLP())
    cg.name_layers(model, prefix="rank1")  # a prefix of the user's
    assert backward_with_nan(model).layer == "rank1.fc2"
    outer = cg.replace_linear(nn.Sequential(MLP()))
    assert backward_with_nan(outer).layer == "0.fc2"
    twin = copy.deepcopy(outer)  # a copy: its names are true there too
    with pytest.raises(cg.NonFiniteInputError) as info:
        twin[0](nan_input())  # its block called by itself
    assert info.value.layer == "0.fc1"
    mine = cg.SafeLinear(16, 2, name="head")  # a name set by hand
    old = cg.replace_linear(MLP())
    old.fc2 = mine
    new = Holder(old.fc1, mine)
    assert backward_with_nan(new).layer == "head"


@pytest.fixture
def process_group() -> Iterator[None]:
    """A one-rank gloo group in this process (DDP and FSDP need one)."""
    import torch.distributed as dist

    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_ddp_is_looked_through(process_group: None):
    model = cg.replace_linear(MLP())
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(cg.NonFiniteInputError) as info:
        ddp(nan_input())
    assert info.value.layer == "fc1"
    cg.name_layers(ddp)
    assert model.fc1.guard_name == "fc1"  # not module.fc1
    assert backward_with_nan(ddp).layer == "fc2"


@pytest.mark.slow
def test_fsdp_units_are_looked_through(process_group: None):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = cg.replace_linear(nn.Sequential(MLP(), MLP()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = FullyShardedDataParallel(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, MLP),
        )
    assert "_fsdp_wrapped_module.0._fsdp_wrapped_module.fc1" in dict(sharded.named_modules())
    cg.name_layers(sharded)
    names = [m.guard_name for m in sharded.modules() if isinstance(m, cg.SafeLinear)]
    assert names == ["0.fc1", "0.fc2", "1.fc1", "1.fc2"]
    with pytest.raises(cg.NonFiniteInputError) as info:
        sharded(nan_input())
    assert info.value.layer == "0.fc1"
