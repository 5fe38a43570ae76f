"""watch's per-block state shared with the threads that run its backward.

Autograd runs the backward nodes of a graph on the thread that calls backward (CPU) or on its
device threads (CUDA), with the session of the thread whose forward built them, while that
thread may go on running ops, or end its block. The known-values table and the session are
locked, and the session is refcounted: a thread running a node keeps it alive."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
import torch.nn as nn

import cublas_guard_ext as cg

from helpers import requires_cuda

watch_module = importlib.import_module("cublas_guard_ext.watching.session")


class Mlp(nn.Module):
    def __init__(self, planted: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.planted:
            h = torch.sqrt(torch.relu(h) * 0.0)  # finite forward, Inf (then NaN) gradient
        return self.fc2(h).square().mean()


def _backward_in_threads(losses: list[torch.Tensor]) -> tuple[list[threading.Thread], list[BaseException]]:
    """Each loss's backward on its own thread, run as an autograd device thread runs: the watch
    key on (it comes with the forward thread's state), no session of its own, so every backward
    op finds the block's session through the node's forward thread."""
    failures: list[BaseException] = []

    def run(loss: torch.Tensor) -> None:
        previous = torch.ops.cublas_guard_testing.watch_set_key_included(True)
        try:
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failures.append(exc)
        finally:
            torch.ops.cublas_guard_testing.watch_set_key_included(previous)

    threads = [threading.Thread(target=run, args=(loss,)) for loss in losses]
    for t in threads:
        t.start()
    return threads, failures


def test_backward_on_other_threads_while_the_block_runs_ops_and_ends():
    torch.manual_seed(0)
    model = Mlp()
    for _ in range(15):  # without the lock and the refcount: a crash in about one run in three at 5
        with cg.watch(model, mode="async"):
            losses = [model(torch.randn(64, 32)) for _ in range(8)]
            threads, failures = _backward_in_threads(losses)
            for _ in range(20):  # the block's own thread keeps using the table meanwhile
                model(torch.randn(64, 32))
        # the block ended while the backward threads may still run its nodes
        for t in threads:
            t.join()
        assert failures == []
    assert not watch_module._is_active()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_backward_finding_on_another_thread_reaches_the_block():
    torch.manual_seed(0)
    model = Mlp(planted=True)
    found: list[BaseException] = []
    try:
        with cg.watch(model, mode="async"):
            losses = [model(torch.randn(16, 32)) for _ in range(4)]
            threads, failures = _backward_in_threads(losses)
            for t in threads:
                t.join()
            found += failures  # async: raised at the next watched op, there on the backward thread
    except cg.NonFiniteOutputError as exc:
        found.append(exc)  # or at the block's end
    assert len(found) >= 1 and all(isinstance(e, cg.NonFiniteOutputError) for e in found)
    err = found[0]
    assert err.phase == "backward" and err.backward_node == "SqrtBackward0"
    assert err.module == ""  # the model's top level, found through the forward's thread


@requires_cuda
def test_mixed_cpu_and_cuda_backward_under_one_block():
    torch.manual_seed(0)
    cpu_model, gpu_model = Mlp(), Mlp().cuda()

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cpu, self.gpu = cpu_model, gpu_model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cpu(x) + self.gpu(x.cuda()).cpu()

    model = Both()
    for _ in range(5):
        with cg.watch(model, mode="async"):
            loss = model(torch.randn(64, 32))
            loss.backward()  # CUDA nodes on the device thread, CPU nodes on this one
    planted = Both()
    planted.gpu.planted = True
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(planted, mode="async"):
            planted(torch.randn(8, 32)).backward()
    assert info.value.phase == "backward" and info.value.module == "gpu"
