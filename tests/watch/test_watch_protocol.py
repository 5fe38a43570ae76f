"""watch's one protocol where a GPU would break it, run on the CPU through its test seam
(``cublas_guard_testing.watch_test_seam``): the CPU as two devices (float64 tensors on a tag
array of their own, a cast between them a copy between devices), a second thread watching at
the same time, a record read late (at ``check()`` or the block's end, as on a GPU running
behind the host), a flood of births, a tag array that grows; and what a finding explains (the
counts and magnitudes at the producing op, an op outside every module, a compiled model)."""

from __future__ import annotations

import importlib
import logging
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import requires_cuda

watch_module = importlib.import_module("cublas_guard_ext.watching.session")
SEAM = torch.ops.cublas_guard_testing.watch_test_seam


@contextmanager
def seam(two_cpu_devices: bool = False, late_harvest: bool = False, tag_capacity: int = 0) -> Iterator[None]:
    SEAM(two_cpu_devices, late_harvest, tag_capacity)
    try:
        yield
    finally:
        SEAM(False, False, 0)


# -- tags across devices ---------------------------------------------------------------------


class CastAcross(nn.Module):
    """A NaN born on "device 1" (float64) and moved to "device 0" (float32) by a cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.log(x.double() - 1.0)  # NaN where x < 1: born in log, on float64's array
        return y.float() * 2.0  # _to_copy reads y's tag from the other array


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_nan_moved_between_devices_keeps_its_origin(mode):
    with seam(two_cpu_devices=True):
        with pytest.raises(cg.NonFiniteOutputError) as info:
            model = CastAcross()
            with cg.watch(model, mode=mode):
                model(torch.full((4, 4), 0.5))
    assert info.value.op == "aten.log.default"
    assert info.value.reached == "the model's output"


def test_two_blocks_in_a_row_across_devices_read_no_stale_tag():
    with seam(two_cpu_devices=True):
        model = CastAcross()
        with cg.watch(model, mode="sync"):  # harmless births, clamped away before the output
            torch.log(torch.full((8,), -1.0, dtype=torch.float64)).nan_to_num()
            model(torch.full((4, 4), 3.0))
        with cg.watch(model, mode="sync"):
            out = model(torch.full((4, 4), 3.0))
    assert torch.isfinite(out).all()


class BackwardAcross(nn.Module):
    """-inf born in log (float32), carried to float64 by a cast whose backward (a float64 ->
    float32 copy of a huge finite gradient) overflows: a consequence of the forward -inf, read
    from the other device's node tags, not a birth of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.log(x).double()  # -inf where x == 0, tagged; the cast's node tag on float64's array
        return (g.clamp_min(-5.0) * 1e300).sum()  # finite; its gradient 1e300 overflows float32


def test_a_backward_op_on_another_device_than_its_forward_reads_that_nodes_tag():
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    model = BackwardAcross()
    with seam(two_cpu_devices=True):
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(model, mode="sync"):
                model(x).backward()
    assert info.value.op == "aten.log.default" and info.value.phase == "forward"
    assert info.value.reached == "the gradient of the model's argument 'x'"


# -- one record per thread -------------------------------------------------------------------


def test_two_threads_watching_at_once_each_get_their_own_findings():
    barrier = threading.Barrier(2)
    found: dict[str, list[str]] = {"log": [], "sqrt": []}
    failures: list[BaseException] = []

    def run(name: str) -> None:
        fn = getattr(torch, name)
        try:
            barrier.wait()
            for _ in range(40):
                x = torch.rand(256) + 0.5
                try:
                    with cg.watch(None, mode="sync"):
                        for _ in range(4):
                            x = x * 1.001 + 0.001
                        fn(-x)
                except cg.NonFiniteOutputError as e:
                    found[name].append(e.op)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert found["log"] == ["aten.log.default"] * 40
    assert found["sqrt"] == ["aten.sqrt.default"] * 40


# -- losses are reported, never silent ---------------------------------------------------------


class Flood(nn.Module):
    """`births` harmless NaNs (each born in log, then made finite), then one in sqrt that
    reaches the output."""

    def __init__(self, births: int) -> None:
        super().__init__()
        self.births = births

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.births):
            h = torch.nan_to_num(torch.log(h - 10.0))
        return torch.sqrt(h - 10.0)


def test_a_nan_reaching_the_output_after_a_flood_of_harmless_births_is_named():
    with pytest.raises(cg.NonFiniteOutputError) as info:
        model = Flood(1500)
        with cg.watch(model, mode="sync"):
            model(torch.ones(4))
    assert info.value.op == "aten.sqrt.default"
    assert info.value.lost is None  # read at each op: nothing lost


def test_births_the_record_lapped_are_reported_with_how_to_keep_more():
    model = Flood(100)
    with seam(late_harvest=True):
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(model, mode="sync", capacity=64):
                model(torch.ones(4))
    err = info.value
    assert err.op == "aten.sqrt.default"  # the newest births stay in the ring
    assert err.reached == "the model's output"
    # 101 births in a ring of 64 (and descriptors in a ring of 64): at least 37 were lost
    lost = int(re.search(r"watch lost (\d+) birth\(s\)", err.lost).group(1))
    assert 37 <= lost <= 100 and "watch(..., capacity=256) keeps more" in err.lost
    assert f"lost: watch lost {lost} birth(s)" in str(err)


def test_birth_mode_raises_when_its_births_were_lost():
    with seam(late_harvest=True):
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(None, mode="async", capacity=64):
                h = torch.ones(4)
                for _ in range(100):
                    h = torch.nan_to_num(torch.log(h - 10.0))
    assert info.value.op == "aten.log.default"
    assert "watch lost" in str(info.value)


def test_capacity_is_checked():
    with pytest.raises(ValueError, match=r"capacity must be an int in \[64, 16777216\], got 8"):
        cg.watch(None, capacity=8)


def test_the_native_begin_refuses_a_config_without_its_keys_and_starts_nothing():
    """watch.py validates the user's arguments; the native side only converts the config."""
    for config in ({}, {"mode": 1, "report": "birth"}, [("mode", 1)]):
        with pytest.raises(
            TypeError, match=r"^cublas_guard_ext._C._watch_begin: a config dict with mode, report, capacity$"
        ):
            watch_module._native._watch_begin(config)
        assert not watch_module._is_active()


# -- the birth stack: taken at the birth op, or said to be where it was detected ---------------


class LateRead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.log(-x)  # BIRTH LINE
        cg.check()  # CHECK LINE: the host reads the record here
        return y * 2.0


def _line_of(marker: str) -> int:
    import inspect

    source, start = inspect.getsourcelines(LateRead.forward)
    return start + next(i for i, line in enumerate(source) if marker in line)


def test_the_birth_stack_is_the_birth_ops_line():
    with pytest.raises(cg.NonFiniteOutputError) as info:
        model = LateRead()
        with cg.watch(model, mode="sync"):
            model(torch.ones(3))
    assert info.value.op == "aten.log.default"
    assert f"test_watch_protocol.py:{_line_of('BIRTH LINE')} in forward" in info.value.birth_stack
    assert "born at (innermost Python frame first)" in str(info.value)


def test_a_birth_read_late_is_not_said_to_be_born_where_it_was_read():
    with seam(late_harvest=True):
        with pytest.raises(cg.NonFiniteOutputError) as info:
            model = LateRead()
            with cg.watch(model, mode="sync"):
                model(torch.ones(3))
    err = info.value
    assert err.op == "aten.log.default"  # the op and module are the birth's
    assert err.birth_stack is None
    assert f"test_watch_protocol.py:{_line_of('CHECK LINE')} in forward" in err.detected_stack
    assert "born at" not in str(err) and "detected at (not where it was born" in str(err)


# -- capture refusal, grown tag arrays ----------------------------------------------------------


def test_torch_cuda_graph_is_refused_before_it_synchronizes_or_switches_streams():
    graph = object.__new__(torch.cuda.graph)  # its __init__ needs a GPU; __enter__ is what is patched
    with cg.watch(nn.Linear(2, 2), mode="sync"):
        with pytest.raises(cg.WatchCaptureError, match="begun inside a watch block"):
            with graph:
                raise AssertionError("the capture must not begin")
    assert not watch_module._is_active()


def test_grown_tag_arrays_are_kept_until_the_final_check():
    with seam(tag_capacity=4):
        with cg.watch(None, mode="sync"):
            xs = [torch.rand(3) + i for i in range(10)]  # more storages than 4 slots: the array grows
            assert torch.ops.cublas_guard_testing.watch_retired_arrays() >= 1
            cg.check()  # waits for the devices: the old arrays can go
            assert torch.ops.cublas_guard_testing.watch_retired_arrays() == 0
    assert len(xs) == 10


def test_the_seam_and_the_watch_hooks_need_the_testing_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_GUARD_EXT_TESTING")
    with pytest.raises(RuntimeError, match="watch_test_seam is a test hook; set CUBLAS_GUARD_EXT_TESTING=1"):
        SEAM(True, False, 0)
    hooks = torch.ops.cublas_guard_testing
    with pytest.raises(RuntimeError, match="watch_set_key_included is a test hook; set CUBLAS_GUARD"):
        hooks.watch_set_key_included(True)
    with pytest.raises(RuntimeError, match="watch_retired_arrays is a test hook; set CUBLAS_GUARD"):
        hooks.watch_retired_arrays()


# -- what a finding explains --------------------------------------------------------------------


def test_an_fp16_overflow_says_the_inputs_maxima_and_the_range():
    layer = nn.Linear(1024, 4).half()
    with torch.no_grad():
        layer.weight.fill_(0.25)
        layer.bias.zero_()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(layer, mode="sync"):
            layer(torch.full((2, 1024), 300.0, dtype=torch.float16))  # 300 * 0.25 * 1024 = 76800
    err = info.value
    assert err.op in ("aten.addmm.default", "aten.mm.default")
    assert err.zero_count == 0 and err.posinf_count == 8
    assert 300.0 in err.input_absmax and 0.25 in err.input_absmax
    message = str(err)
    assert "counts at that op: NaN 0, +Inf 8, -Inf 0, zeros 0" in message
    assert "300 squared exceeds the float16 range 65504" in message


def test_an_sgd_blow_up_at_the_loss_shows_the_magnitudes_and_is_outside_any_module():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e3)
    x, target = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(40):  # unwatched steps until the prediction is huge but finite
        with torch.no_grad():
            largest = model(x).abs().max().item()
        if 2e19 <= largest <= 1e30:
            break
        opt.zero_grad()
        F.mse_loss(model(x), target).backward()
        opt.step()
    assert 2e19 <= largest <= 1e30
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            F.mse_loss(model(x), target).backward()  # the square overflows float32
    err = info.value
    assert err.op == "aten.mse_loss.default" and err.module is None and err.backward_node is None
    assert err.reached == "the loss (a root of backward)"
    message = str(err)
    assert "outside any module (the loss computed after the model's forward" in message
    assert "in module ''" not in message
    assert "inputs' absolute maxima:" in message and "exceeds the float32 range" in message


def test_every_documented_field_exists_on_every_finding():
    entry = cg.NonFiniteEntryError(role="argument", name="x", nan_count=1, posinf_count=0, neginf_count=0)
    output = cg.NonFiniteOutputError(op="aten.log.default", nan_count=1, posinf_count=0, neginf_count=0)
    for err in (entry, output):
        for name in cg.errors.NonFiniteOutputError.WATCH_FIELDS:
            getattr(err, name)  # None when not known, never AttributeError
    assert output.module is None and output.reached is None and entry.op is None


# -- torch.compile inside a block -----------------------------------------------------------------


class PlantedLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(-self.fc(x).abs() - 1.0)  # NaN everywhere: born in log


def test_a_compiled_model_runs_eagerly_in_a_block_and_its_op_is_named(caplog: pytest.LogCaptureFixture):
    torch.manual_seed(0)
    model = PlantedLog()
    compiled = torch.compile(model)
    with (
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.WARNING, logger="torch._dynamo"),
    ):
        warnings.simplefilter("always")
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(model, mode="sync"):
                compiled(torch.randn(3, 4))
    assert info.value.op == "aten.log.default" and info.value.module == ""
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.name.startswith("torch._dynamo")] == []
    assert torch.compiler.is_compiling() is False


def test_help_describes_arguments_an_example_and_costs():
    doc = cg.watch.__doc__ or ""
    for part in ("Arguments:", "capacity:", "verify_inputs:", "Example", "Costs:", "force_eager"):
        assert part in doc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("number", [10, 10.0], ids=["int", "float"])
def test_a_python_numbers_magnitude_is_the_number_never_unknown(number, device):
    # x * 10 passes 10 as a wrapped 0-dim CPU tensor (int64 or float64): its magnitude is read on
    # the host when the op is tagged (also beside a CUDA op, where the tensor is on another device).
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * number

    model = Scale()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.tensor([3e38, 1.0], device=device))
    err = info.value
    assert err.op == "aten.mul.Tensor" and err.input_absmax == [torch.tensor(3e38).item(), 10.0]
    assert "inputs' absolute maxima: 3.000e+38, 10 (" in str(err)
