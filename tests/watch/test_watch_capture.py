"""CUDA graph capture and watch: refused with a typed error before anything
is captured. watch reads its findings on the host, which a capture forbids (``.item()`` during
capture fails with cudaErrorStreamCaptureUnsupported and invalidates the capture)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import cublas_guard_ext as cg

from helpers import requires_cuda

watch_module = importlib.import_module("cublas_guard_ext.watching.session")
patches_module = importlib.import_module("cublas_guard_ext.watching.global_patches")
WatchCaptureError = watch_module.WatchCaptureError


def nothing_left() -> None:
    mod = torch.nn.modules.module
    assert not mod._global_forward_pre_hooks and not mod._global_forward_hooks
    assert not watch_module._is_active()
    assert patches_module._patch_users == 0


def test_the_error_is_typed():
    err = WatchCaptureError(when="begun inside a watch block")
    assert isinstance(err, cg.GuardError) and isinstance(err, RuntimeError)
    assert "nothing was captured" in str(err) and "capture outside the watch block" in str(err)


def test_entering_a_block_during_a_capture_is_refused(monkeypatch):
    model = nn.Linear(4, 4)
    monkeypatch.setattr(watch_module, "_capturing", lambda: True)  # the seam: a stream capturing
    with pytest.raises(WatchCaptureError) as info:
        with cg.watch(model, mode="async"):
            raise AssertionError("the block must not start")
    assert "in progress when the watch block began" in str(info.value)
    nothing_left()


def test_beginning_a_capture_inside_a_block_is_refused_before_it_begins():
    original = torch.cuda.CUDAGraph.capture_begin
    calls = []
    with cg.watch(nn.Linear(4, 4), mode="sync"):
        assert torch.cuda.CUDAGraph.capture_begin is not original
        with pytest.raises(WatchCaptureError) as info:
            # what torch.cuda.graph's __enter__ calls; refused before the real capture_begin runs
            torch.cuda.CUDAGraph.capture_begin(calls)
    assert "begun inside a watch block" in str(info.value)
    assert calls == []
    assert torch.cuda.CUDAGraph.capture_begin is original  # the patch is gone with the block
    nothing_left()


def test_the_patches_are_per_thread_and_refcounted():
    import threading

    seen: list[bool] = []

    def other() -> None:  # a thread that does not watch: its backward is not a sink
        x = torch.randn(3, requires_grad=True)
        (x * 2).sum().backward()
        seen.append(torch.isfinite(x.grad).all().item())

    with cg.watch(nn.Linear(4, 4), mode="sync"):
        with cg.watch(nn.Linear(4, 4), mode="sync"):
            assert patches_module._patch_users == 2
        assert patches_module._patch_users == 1
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [True]
    nothing_left()


@requires_cuda
def test_capture_inside_a_block_is_refused_on_the_gpu_and_eager_still_works():
    model = nn.Linear(16, 16).cuda()
    x = torch.randn(8, 16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with cg.watch(model, mode="async"):
        with pytest.raises(WatchCaptureError):
            with torch.cuda.stream(side), torch.cuda.graph(graph):
                model(x)
        out = model(x)  # the block goes on, eagerly
    assert torch.isfinite(out).all()
    # outside the block, the same capture works
    static_out = None
    with torch.cuda.graph(graph):
        static_out = model(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(static_out, model(x))
    nothing_left()


@requires_cuda
def test_entering_a_block_inside_a_capture_is_refused_on_the_gpu():
    model = nn.Linear(16, 16).cuda()
    x = torch.randn(8, 16, device="cuda")
    model(x)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(WatchCaptureError):
            with cg.watch(model, mode="async"):
                model(x)
        model(x)
    graph.replay()
    nothing_left()
