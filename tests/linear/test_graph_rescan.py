"""A CUDA graph replays the scans it captured, whatever the clean-parameter cache said at capture
time: a NaN written into a weight between replays is reported.

The CPU has no graphs; the decisions a capture changes (scan the parameters in every captured
call, mark nothing clean) are the device-independent code's, run here through the test hook
``linear_as_captured`` (the CPU backend with its stream taken to be under capture). The CUDA test
captures a real graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches, requires_cuda

NAN = float("nan")


def captured_forward(layer: cg.SafeLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.cublas_guard_testing.linear_as_captured(x, layer.weight, layer.bias, layer.guard_name)


@pytest.mark.locked
def test_a_captured_call_scans_a_weight_the_cache_knows_clean() -> None:
    layer = cg.SafeLinear(8, 4, mode="async", name="captured_w")
    x = torch.randn(3, 8)
    with torch.no_grad():
        layer(x)  # eager: the weight is scanned once and known clean from now on
        # A write the cache cannot see (no version bump), standing for what a replay reads
        # after the weight changed: only a scan inside the captured call finds it.
        layer.weight.data[2, 5] = NAN
        layer(x)  # eager calls trust the cache (documented): nothing is recorded
        cg.check()
        out = captured_forward(layer, x)
    assert out.shape == (3, 4)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.fields["role"] == "weight" and info.value.layer == "captured_w"
    assert info.value.first_bad_coords == [2, 5]


def test_a_captured_call_scans_the_bias_too() -> None:
    layer = cg.SafeLinear(8, 4, mode="async", name="captured_b")
    x = torch.randn(3, 8)
    with torch.no_grad():
        layer(x)
        layer.bias.data[1] = float("-inf")
        captured_forward(layer, x)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.fields["role"] == "bias" and info.value.fields["neginf_count"] == 1


def test_a_captured_call_marks_nothing_clean() -> None:
    """A capture records its scans and runs none: the eager call after it must still scan."""
    layer = cg.SafeLinear(8, 4, mode="async", name="after_capture")
    x = torch.randn(3, 8)
    with torch.no_grad():
        captured_forward(layer, x)  # the weight's first call is a captured one
        cg.check()  # (the CPU model did run the scans: all clean)
        layer.weight.data[0, 7] = NAN  # unseen by the cache
        layer(x)  # eager: the weight was never proven clean, so it is scanned
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.fields["role"] == "weight" and info.value.first_bad_coords == [0, 7]


def test_the_captured_call_computes_the_linear() -> None:
    layer = cg.SafeLinear(16, 8, mode="async", name="captured_out")
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert_matches(captured_forward(layer, x), F.linear(x, layer.weight, layer.bias))


def test_the_hook_refuses_without_the_testing_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_EXT_TESTING", "0")
    layer = cg.SafeLinear(4, 2, name="refused")
    with pytest.raises(RuntimeError, match="CUBLAS_GUARD_EXT_TESTING=1"):
        captured_forward(layer, torch.randn(1, 4))


@requires_cuda
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_nan_written_into_the_weight_between_replays_is_reported(with_bias: bool) -> None:
    layer = cg.SafeLinear(128, 64, bias=with_bias, device="cuda", mode="async", name="replayed_w")
    static_x = torch.randn(32, 128, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: the weight becomes "known clean"
        for _ in range(3):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(static_y, F.linear(static_x, layer.weight, layer.bias))
    cg.check()  # a clean replay
    with torch.no_grad():
        layer.weight[3, 5] = NAN  # between replays, as an optimizer step outside the graph would
    graph.replay()
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.fields["role"] == "weight" and info.value.layer == "replayed_w"
    assert info.value.first_bad_coords == [3, 5]
    assert info.value.fields["replay"] == 2  # the second replay of the captured call
    with torch.no_grad():
        layer.weight[3, 5] = 0.0
    graph.replay()
    torch.cuda.synchronize()
    cg.check()  # clean again
