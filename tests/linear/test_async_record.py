"""The async record's claim and call numbers.

The first bad scan claims the record; the host frees the claim once it has taken the report, by
a store to host memory (no CUDA call: ordered with every stream, possible inside a graph
capture, never failing). A CUDA graph's replays carry the capture's call number plus their own
replay number, counted on the device. The CUDA tests skip without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches, requires_cuda

NAN, INF = float("nan"), float("inf")


def test_each_report_frees_the_record_for_the_next(device: str) -> None:
    """Ten bad calls in a row, each reported with its own call number and finding: the claim is
    never left taken."""
    layer = cg.SafeLinear(8, 4, device=device, mode="async", name="claim_cycles")
    calls = []
    for i in range(10):
        x = torch.randn(3, 8, device=device)
        x[i % 3, i % 8] = NAN if i % 2 else INF
        layer(x)
        with pytest.raises(cg.NonFiniteInputError) as info:
            cg.check()
        assert info.value.first_bad_index == (i % 3) * 8 + i % 8
        assert (info.value.nan_count, info.value.posinf_count) == ((1, 0) if i % 2 else (0, 1))
        assert "replay" not in info.value.fields and "replay" not in str(info.value)
        calls.append(info.value.call)
    assert calls == list(range(calls[0], calls[0] + 10))
    cg.check()


def test_a_finding_while_the_record_is_taken_waits_until_it_is_free(device: str) -> None:
    """First writer wins: the weight's finding in the same call is dropped; once the input's
    report is taken the weight is scanned again and its finding is recorded."""
    layer = cg.SafeLinear(8, 4, device=device, mode="async", name="first_wins")
    with torch.no_grad():
        layer.weight[2, 3] = NAN
    x = torch.randn(2, 8, device=device)
    x[0, 1] = NAN
    layer(x)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert (info.value.role, info.value.first_bad_index) == ("input", 1)
    layer(torch.randn(2, 8, device=device))
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert (info.value.role, info.value.first_bad_index) == ("weight", 2 * 8 + 3)
    with torch.no_grad():
        layer.weight[2, 3] = 0.5
    layer(torch.randn(2, 8, device=device))
    cg.check()


@requires_cuda
def test_a_report_frees_the_record_for_a_scan_on_another_stream() -> None:
    """The host frees the claim before the call that takes the report returns. A reset queued on
    the legacy default stream (a cudaMemset) would wait behind whatever that stream still had
    queued, and a bad scan on a side stream meanwhile would find the claim taken and be dropped."""
    layer = cg.SafeLinear(16, 8, device="cuda", mode="async", name="streams")
    good = torch.randn(4, 16, device="cuda")
    bad1, bad2 = good.clone(), good.clone()
    bad1[0, 1] = NAN
    bad2[3, 5] = INF
    layer(bad1)
    torch.cuda.synchronize()  # bad1's record is filled
    side = torch.cuda.Stream()
    torch.cuda._sleep(200_000_000)  # the default stream stays busy for about 0.1 s
    with torch.cuda.stream(side):
        with pytest.raises(cg.NonFiniteInputError) as first:
            layer(good)  # takes bad1's report
        layer(bad2)  # scanned on `side` at once, while the default stream still sleeps
    torch.cuda.synchronize()
    assert first.value.first_bad_index == 1
    with pytest.raises(cg.NonFiniteInputError) as second:
        cg.check()
    assert second.value.first_bad_index == 3 * 16 + 5 and second.value.posinf_count == 1


def _warm_up(layer: cg.SafeLinear, x: torch.Tensor) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph wants
        for _ in range(3):
            layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


@requires_cuda
def test_a_report_taken_inside_a_graph_capture_is_raised_and_recording_goes_on() -> None:
    """The first guarded call of a capture takes a finding recorded before it. A claim reset by
    cudaMemset would be refused inside a capture after the report was taken: the report would be
    lost and the claim stay taken, so async mode would record nothing ever after."""
    layer = cg.SafeLinear(32, 16, device="cuda", mode="async", name="taken_in_capture")
    static_x = torch.randn(8, 32, device="cuda")
    _warm_up(layer, static_x)
    bad = static_x.clone()
    bad[2, 3] = NAN
    layer(bad)
    torch.cuda.synchronize()  # the finding waits in the record
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(cg.NonFiniteInputError) as info:
        with torch.no_grad(), torch.cuda.graph(graph):
            layer(static_x)
    assert info.value.first_bad_index == 2 * 32 + 3 and info.value.layer == "taken_in_capture"
    torch.cuda.synchronize()
    bad[2, 3], bad[5, 6] = 0.5, -INF
    layer(bad)  # recorded: the claim is free
    with pytest.raises(cg.NonFiniteInputError) as again:
        cg.check()
    assert again.value.first_bad_index == 5 * 32 + 6 and again.value.neginf_count == 1


@requires_cuda
def test_graph_replays_report_their_own_replay_number() -> None:
    """The call number is baked into the captured kernels' arguments; the replay number is
    counted on the device by the captured call's first scan, clean replays included."""
    layer = cg.SafeLinear(64, 32, device="cuda", mode="async", name="replayed")
    static_x = torch.randn(16, 64, device="cuda")
    _warm_up(layer, static_x)  # calls 1-3
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)  # call 4, captured
    for _ in range(3):  # replays 1-3, clean
        graph.replay()
    torch.cuda.synchronize()
    assert_matches(static_y, F.linear(static_x, layer.weight, layer.bias))
    cg.check()
    static_x[1, 2] = NAN
    graph.replay()  # replay 4
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert (info.value.call, info.value.replay) == (4, 4)
    assert "call 4 (CUDA graph replay 4)" in str(info.value)
    static_x[1, 2] = 0.25
    graph.replay()  # 5, clean
    static_x[0, 0] = INF
    graph.replay()  # 6
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert (info.value.call, info.value.replay, info.value.first_bad_index) == (4, 6, 0)
    static_x[0, 0] = -INF
    layer(static_x)  # an eager call after the capture: call 5, no replay
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.call == 5 and "replay" not in info.value.fields
