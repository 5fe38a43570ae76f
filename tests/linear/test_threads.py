"""Threads: 8 threads share SafeLinear layers (the native ops release the GIL, so the guard's
own state -- the clean-parameter cache, the layer registry, the async record -- is really used
concurrently).

What a thread sees:

* sync mode (the default): errors are raised in the call that caused them, so each error
  reaches exactly the thread that fed the bad input, naming the layer it called; the other
  threads' calls succeed and give F.linear's results.
* async mode: the record is ONE per device for the whole process (not per thread). A bad
  call in thread A is raised by the next guarded call of ANY thread (or ``check()``), so a
  clean thread may receive thread A's error; the error names thread A's layer and call number
  (``err.layer``, ``err.call``), never the receiving thread's. The same holds for ``check()``
  and for the end of a ``guard()`` block in any thread. Only the first bad call is kept until
  it is reported (later bad calls while one is pending are dropped). Use sync mode, or name
  layers per thread, when attribution across threads matters.
* ``guard(mode)`` sets the default mode per thread (thread-local): one thread's guard block
  does not change another thread's mode.
* On the GPU each thread can run on its own stream (CUDA-only test below).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches, requires_cuda

THREADS = 8
ITERATIONS = 60


def run_threads(target: Callable[[int], None], n: int = THREADS, timeout: float = 120.0) -> list:
    """Run target(i) in n threads started together; return the exceptions that escaped."""
    barrier = threading.Barrier(n)
    escaped: list = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # noqa: BLE001 (reported to the main thread)
            escaped.append((i, exc))

    threads = [threading.Thread(target=body, args=(i,), name=f"worker-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"{t.name} hung"
    return escaped


def shared_layers(device: str, mode: str | None = None) -> list[cg.SafeLinear]:
    return [
        cg.SafeLinear(24, 16, device=device, name="shared.0", mode=mode),
        cg.SafeLinear(16, 8, device=device, name="shared.1", mode=mode),
        cg.SafeLinear(24, 8, bias=False, device=device, name="shared.2", mode=mode),
    ]


def check_call(layer: cg.SafeLinear, x: torch.Tensor) -> torch.Tensor:
    """Forward + backward through the shared layer, both compared with F.linear (gradients
    via autograd.grad: nothing accumulates into the shared parameters)."""
    x = x.detach().requires_grad_(True)
    y = layer(x)
    ref = F.linear(x, layer.weight, layer.bias)
    assert_matches(y, ref)
    params = [p for p in (layer.weight, layer.bias) if p is not None]
    g = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, [x, *params], g), torch.autograd.grad(ref, [x, *params], g)):
        assert_matches(got, want)
    return y.detach()


def test_eight_threads_share_layers_correctly(device: str) -> None:
    layers = shared_layers(device)

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        for it in range(ITERATIONS):
            batch = 1 + (i + it) % 7
            x = torch.randn(batch, 24, generator=gen).to(device)
            if it % 3 == 0:
                x = torch.randn(24, batch, generator=gen).to(device).t()  # strided too
            h = check_call(layers[0], x)
            check_call(layers[1], torch.relu(h))
            check_call(layers[2], x)

    assert run_threads(work) == []


def test_each_sync_error_reaches_the_thread_that_caused_it(device: str) -> None:
    """Threads 2 and 5 feed NaN (into different layers) every 4th call; the others never do.
    Every error arrives in the thread that fed it, naming the layer that thread called."""
    layers = shared_layers(device)
    bad_threads = {2: 1, 5: 2}  # thread -> the layer index it poisons
    seen: dict[int, list] = {i: [] for i in range(THREADS)}
    expected_bad = {i: 0 for i in range(THREADS)}

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(100 + i)
        for it in range(ITERATIONS):
            x = torch.randn(4, 24, generator=gen).to(device)
            which = bad_threads.get(i, it % 3)
            if which == 1:
                x = torch.randn(4, 16, generator=gen).to(device)
            if i in bad_threads and it % 4 == 1:
                x[it % 4, (i + it) % x.shape[1]] = float("nan")
                expected_bad[i] += 1
            try:
                check_call(layers[which], x)
            except cg.NonFiniteInputError as err:
                seen[i].append((err.layer, err.nan_count, err.first_bad_coords, it))

    assert run_threads(work) == []
    for i in range(THREADS):
        if i in bad_threads:
            assert len(seen[i]) == expected_bad[i] == ITERATIONS // 4
            name = f"shared.{bad_threads[i]}"
            assert all(layer == name and nan == 1 for layer, nan, _, _ in seen[i]), seen[i]
            assert all(
                coords == [it % 4, (i + it) % (16 if name == "shared.1" else 24)]
                for _, _, coords, it in seen[i]
            )
        else:
            assert seen[i] == [], f"thread {i} received another thread's error: {seen[i]}"


def test_async_record_is_process_wide(device: str) -> None:
    """One bad async call in thread 3 (all threads in lockstep, so the next calls race):
    exactly ONE NonFiniteInputError is raised in the whole process -- in whichever thread
    makes the next guarded call, or by check() at the end -- and it names thread 3's layer
    and call, whoever receives it. Documented behaviour, see the module docstring."""
    layers = [cg.SafeLinear(12, 6, device=device, name=f"thread{i}.fc", mode="async") for i in range(THREADS)]
    received: list[tuple[int, str, int, bool]] = []
    lock = threading.Lock()
    step = threading.Barrier(THREADS)
    bad_iteration = ITERATIONS // 2

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        for it in range(ITERATIONS):
            x = torch.randn(3, 12, generator=gen).to(device)
            if i == 3 and it == bad_iteration:
                x[1, 4] = float("nan")
            step.wait()
            try:
                y = layers[i](x)
                if i == 3 and it == bad_iteration:
                    assert y[1].isnan().all()  # async: the bad call itself returns
            except cg.NonFiniteInputError as err:
                with lock:
                    received.append((i, err.layer, err.call, err.deferred))

    assert run_threads(work) == []
    try:
        cg.check()  # if nobody called after it, the main thread gets it here
    except cg.NonFiniteInputError as err:
        received.append((-1, err.layer, err.call, err.deferred))
    assert len(received) == 1, received
    receiver, layer, call, deferred = received[0]
    # the per-layer call counter may include calls of earlier tests with the same name
    assert layer == "thread3.fc" and deferred is True and call >= bad_iteration + 1
    print(
        f"\n[threads/{device}] thread 3's async finding was raised in "
        f"{'the main thread (check())' if receiver < 0 else f'thread {receiver}'}"
    )
    cg.check()


def test_async_concurrent_bad_calls_are_reported_once_each_and_intact(device: str) -> None:
    """Thread 0 feeds NaN on every call while 7 threads call clean layers as fast as they can.
    Only the first bad call is kept until reported (later ones, while one is pending, are
    dropped), but no finding may be reported twice, and every report must be intact (its
    fields are those of a real bad call: the layer, 1 NaN at [1, 2])."""
    layers = [cg.SafeLinear(4, 2, device=device, name=f"race{i}", mode="async") for i in range(THREADS)]
    reports: list[tuple[str, int, int, list]] = []
    lock = threading.Lock()
    returned_bad = [0]

    def work(i: int) -> None:
        x = torch.randn(2, 4, device=device)
        bad = x.clone()
        bad[1, 2] = float("nan")
        for _ in range(400):
            inp = bad if i == 0 else x
            try:
                layers[i](inp)
                if i == 0:
                    returned_bad[0] += 1
            except cg.NonFiniteInputError as err:
                with lock:
                    reports.append((err.layer, err.call, err.nan_count, err.first_bad_coords))

    assert run_threads(work) == []
    try:
        cg.check()
    except cg.NonFiniteInputError as err:
        reports.append((err.layer, err.call, err.nan_count, err.first_bad_coords))
    assert all(r[0] == "race0" and r[2] == 1 and r[3] == [1, 2] for r in reports), "a torn report"
    calls = [(layer, call) for layer, call, _, _ in reports]
    twice = sorted({c for c in calls if calls.count(c) > 1})
    # One reader takes the record's flag atomically: a finding is never reported twice.
    assert not twice, f"async finding(s) {twice} reported twice by concurrent checks"
    # every bad call that returned was either reported or dropped while another was pending
    assert 1 <= len(reports) <= returned_bad[0]
    print(f"\n[threads/{device}] {returned_bad[0]} bad async calls returned, {len(reports)} reported")


def test_guard_mode_is_per_thread(device: str) -> None:
    """guard('off') in one thread does not switch off the checks of another thread."""
    layer = cg.SafeLinear(8, 4, device=device, name="modes")
    bad = torch.randn(2, 8, device=device)
    bad[0, 0] = float("nan")
    inside = threading.Event()
    done = threading.Event()
    results: dict[str, object] = {}

    def relaxed() -> None:
        with cg.guard("off"):
            inside.set()
            results["off"] = layer(bad)  # no scan: NaN passes through
            done.wait(30)

    def strict() -> None:
        inside.wait(30)
        try:
            layer(bad)
        except cg.NonFiniteInputError as err:
            results["sync"] = err
        finally:
            done.set()

    threads = [threading.Thread(target=relaxed), threading.Thread(target=strict)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(results["off"], torch.Tensor) and results["off"][0].isnan().all()
    assert isinstance(results.get("sync"), cg.NonFiniteInputError)


def test_threads_parameter_updates_are_rescanned(device: str) -> None:
    """One thread poisons a shared weight under no_grad (version bump) while others call it:
    after the write, every thread's next call refuses it (role 'weight'); after the repair
    every call succeeds again. No call ever returns NaN silently in sync mode."""
    layer = cg.SafeLinear(10, 5, device=device, name="shared.w")
    phase = {"value": "clean"}
    barrier = threading.Barrier(THREADS)
    silent_nan: list[int] = []

    def work(i: int) -> None:
        for rnd in range(3):
            barrier.wait()
            if i == 0:
                with torch.no_grad():
                    layer.weight[2, 3] = float("nan") if rnd == 1 else 0.5
                phase["value"] = "bad" if rnd == 1 else "clean"
            barrier.wait()
            for _ in range(10):
                x = torch.randn(2, 10, device=device)
                try:
                    y = layer(x)
                    if y.isnan().any():
                        silent_nan.append(i)
                    assert phase["value"] == "clean", "a poisoned weight was not refused"
                except cg.NonFiniteInputError as err:
                    assert phase["value"] == "bad" and err.role == "weight" and err.layer == "shared.w"

    assert run_threads(work) == []
    assert silent_nan == []


@requires_cuda
def test_per_thread_streams() -> None:
    """Each thread on its own CUDA stream: correct results (sync mode waits on the thread's own
    stream), and the NaN thread's error reaches only it."""
    layers = shared_layers("cuda")
    errors: dict[int, list[str]] = {i: [] for i in range(THREADS)}

    def work(i: int) -> None:
        stream = torch.cuda.Stream()
        gen = torch.Generator().manual_seed(i)
        with torch.cuda.stream(stream):
            for it in range(ITERATIONS):
                x = torch.randn(64, 24, generator=gen).to("cuda", non_blocking=True)
                if i == 6 and it % 5 == 0:
                    x[7, 7] = float("nan")
                try:
                    check_call(layers[0], x)
                    check_call(layers[2], x[:, :].t().contiguous().t())
                except cg.NonFiniteInputError as err:
                    errors[i].append(err.layer)
            stream.synchronize()

    assert run_threads(work) == []
    assert errors[6] == ["shared.0"] * (ITERATIONS // 5)
    assert all(errors[i] == [] for i in range(THREADS) if i != 6)
