"""The CUDA kernels' host-independent logic, run on the CPU through the test hooks: the strided
scan's index -> offset walk (csrc/scan/strided_index.h, with divisors precomputed for tensors
below 2^31 elements) and the launch-limit check every kernel of ours passes before it is
launched (csrc/linear/launch_limits.h), with the error it raises. The same functions run on the GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

import cublas_guard_ext as cg

from helpers import requires_cuda

T = torch.ops.cublas_guard_testing
INT31 = 2**31


def reference_offsets(sizes: list[int], strides: list[int], indices: list[int]) -> list[int]:
    out = []
    for i in indices:
        offset, rest = 0, i
        for size, stride in zip(reversed(sizes), reversed(strides)):
            offset += (rest % size) * stride
            rest //= size
        out.append(offset)
    return out


def test_the_walk_matches_torch_views_element_for_element() -> None:
    """Every element of permuted, sliced, expanded views: the offset the walk gives is where
    torch keeps the element."""
    base = torch.arange(4 * 5 * 6 * 7, dtype=torch.int64).reshape(4, 5, 6, 7)
    views = [
        base.permute(3, 1, 0, 2),
        base[:, ::2, 1:, ::3],
        base[1:3].transpose(0, 3),
        torch.arange(11, dtype=torch.int64).expand(3, 4, 11),
        base.reshape(-1)[5:].as_strided((9, 13), (17, 3)),
    ]
    for v in views:
        n = v.numel()
        indices = list(range(n))
        got = T.strided_offsets(list(v.shape), list(v.stride()), 0, indices)
        flat = v.storage_offset()
        storage = v.as_strided((v.untyped_storage().nbytes() // 8,), (1,), 0)
        values = [int(storage[flat + o]) for o in got]
        assert values == v.reshape(-1).tolist()
        # the 64-bit walk (forced by a numel beyond 2^31) gives the same offsets
        assert T.strided_offsets(list(v.shape), list(v.stride()), INT31 + 1, indices) == got


@pytest.mark.parametrize("seed", range(6))
def test_the_32_bit_divisions_are_exact_near_2_31(seed: int) -> None:
    """Sizes [q, d] with strides [1, 0] make the offset the quotient i // d itself: the
    multiply-high division against Python's, for divisors and dividends up to 2^31 - 1."""
    rng = random.Random(seed)
    divisors = [1, 2, 3, 7, 641, 65535, 65537, 2**30 + 1, INT31 - 1] + [
        rng.randrange(1, INT31) for _ in range(6)
    ]
    for d in divisors:
        q = (INT31 - 1) // d  # q * d < 2^31: the 32-bit path
        n = q * d
        indices = sorted({0, 1, d - 1, d, n - 1, n - d} | {rng.randrange(n) for _ in range(40)})
        indices = [i for i in indices if 0 <= i < n]
        got = T.strided_offsets([q, d], [1, 0], 0, indices)
        assert got == [i // d for i in indices], d
        got_rem = T.strided_offsets([q, d], [0, 1], 0, indices)
        assert got_rem == [i % d for i in indices], d


def test_random_geometries_with_negative_free_strides_and_many_dims() -> None:
    rng = random.Random(3)
    for _ in range(200):
        ndim = rng.randint(1, 16)
        sizes = [rng.randint(1, 5) for _ in range(ndim)]
        strides = [rng.randint(0, 1000) for _ in range(ndim)]
        n = 1
        for s in sizes:
            n *= s
        indices = sorted({rng.randrange(n) for _ in range(min(n, 50))})
        want = reference_offsets(sizes, strides, indices)
        assert T.strided_offsets(sizes, strides, 0, indices) == want
        assert T.strided_offsets(sizes, strides, INT31, indices) == want


def test_the_hook_refuses_bad_geometries() -> None:
    with pytest.raises(ValueError, match="positive sizes"):
        T.strided_offsets([2, 0], [1, 1], 0, [0])
    with pytest.raises(ValueError, match="positive sizes"):
        T.strided_offsets([2] * 17, [1] * 17, 0, [0])
    with pytest.raises(ValueError, match="out of range"):
        T.strided_offsets([2, 3], [3, 1], 0, [6])


# ---------------------------------------------------------------------------------------------
# The launch-limit check: a launch beyond the device's limits is refused before it is made.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def lowered_launch_limits():
    yield T.set_launch_limits
    T.set_launch_limits(0, 0, 0, 0)


def launch(grid, block, shared=0, kernel="cublas_guard scan_contiguous_kernel") -> None:
    T.launch_limits_check(kernel, list(grid), list(block), shared, "lin")


def test_launches_within_every_limit_pass() -> None:
    launch((1, 1, 1), (1, 1, 1))
    launch((2**31 - 1, 65535, 65535), (1024, 1, 1))
    launch((528, 1, 1), (32, 32, 1), shared=48 * 1024)
    launch((1, 1, 1), (16, 1, 64))


@pytest.mark.parametrize(
    "grid,block,shared,rule",
    [
        ((2**31, 1, 1), (256, 1, 1), 0, "1 <= grid.x <= 2147483647"),
        ((1, 65536, 1), (256, 1, 1), 0, "1 <= grid.y <= 65535"),
        ((1, 1, 65536), (256, 1, 1), 0, "1 <= grid.z <= 65535"),
        ((0, 1, 1), (256, 1, 1), 0, "1 <= grid.x <= 2147483647"),
        ((1, 1, 1), (1025, 1, 1), 0, "1 <= block.x <= 1024"),
        ((1, 1, 1), (1, 1, 65), 0, "1 <= block.z <= 64"),
        ((1, 1, 1), (64, 32, 1), 0, "block.x * block.y * block.z <= 1024 threads"),
        ((1, 1, 1), (256, 1, 1), 48 * 1024 + 1, "dynamic shared memory <= 49152 bytes per block"),
    ],
)
def test_a_launch_beyond_a_limit_raises_a_launch_error_naming_kernel_sizes_and_rule(
    grid, block, shared, rule
) -> None:
    with pytest.raises(cg.CudaLaunchError) as info:
        launch(grid, block, shared)
    err = info.value
    assert isinstance(err, RuntimeError)
    f = err.fields
    assert f["kernel"] == "cublas_guard scan_contiguous_kernel" and f["layer"] == "lin"
    assert (f["grid"], f["block"], f["shared_memory_bytes"]) == (list(grid), list(block), shared)
    assert (f["rule"], f["precheck"], f["cuda_error"]) == (rule, True, "cudaErrorInvalidConfiguration")
    text = str(err)
    assert f"scan_contiguous_kernel was not launched: its sizes break the device limit {rule}" in text
    assert f"grid {tuple(grid)}, block {tuple(block)}, {shared} bytes of dynamic shared memory" in text


def test_tests_can_lower_the_limits_every_launch_is_checked_against(lowered_launch_limits) -> None:
    """The seam a GPU test uses to make a real scan's launch cross a limit."""
    lowered_launch_limits(4, 0, 0, 0)
    launch((4, 1, 1), (256, 1, 1))
    with pytest.raises(cg.CudaLaunchError, match=r"grid\.x <= 4"):
        launch((5, 1, 1), (256, 1, 1))
    lowered_launch_limits(0, 0, 128, 1024)
    with pytest.raises(cg.CudaLaunchError, match=r"block\.x <= 128"):
        launch((1, 1, 1), (256, 1, 1))
    with pytest.raises(cg.CudaLaunchError, match="dynamic shared memory <= 1024"):
        launch((1, 1, 1), (128, 1, 1), shared=2048)
    lowered_launch_limits(0, 0, 0, 0)
    launch((5, 1, 1), (256, 1, 1), shared=2048)  # the device's limits again


@requires_cuda
def test_on_a_gpu_a_real_scan_launch_beyond_a_lowered_limit_is_refused(lowered_launch_limits) -> None:
    x = torch.randn(1 << 20, device="cuda")  # a multi-block scan
    lowered_launch_limits(1, 0, 0, 0)
    with pytest.raises(cg.CudaLaunchError) as info:
        cg.scan(x)
    assert info.value.fields["kernel"] == "cublas_guard scan_contiguous_kernel"
    assert info.value.fields["grid"][0] > 1 and info.value.fields["rule"] == "1 <= grid.x <= 1"
    with pytest.raises(cg.CudaLaunchError, match="scan_strided_kernel"):
        cg.scan(torch.randn(1024, 1024, device="cuda")[:, ::2])
    lowered_launch_limits(0, 0, 0, 0)
    assert cg.scan(x).first_bad_index == -1  # nothing was left broken


@requires_cuda
def test_on_a_gpu_the_first_async_call_of_a_process_may_be_inside_a_capture() -> None:
    """The async record is allocated at a process's first async call; when that call is being
    captured into a CUDA graph its zeroing must not touch the legacy stream (which would
    invalidate a capture on a blocking stream): a fresh process captures on a blocking stream,
    replays and checks."""
    import subprocess
    import sys

    code = """
import ctypes, sys, torch, torch.nn.functional as F, cublas_guard_ext as cg
layer = cg.SafeLinear(64, 32, device="cuda", mode="async", name="captured_first")
x = torch.randn(8, 64, device="cuda")
# A blocking stream (cudaStreamCreate without flags; torch's own streams are non-blocking): the
# legacy stream synchronizes with it, so a legacy-stream call during its capture invalidates it.
for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
    try:
        cudart = ctypes.CDLL(name)
        break
    except OSError:
        cudart = None
if cudart is None:
    print("SKIP: no libcudart to create a blocking stream")
    sys.exit(0)
handle = ctypes.c_void_p()
assert cudart.cudaStreamCreate(ctypes.byref(handle)) == 0
side = torch.cuda.ExternalStream(handle.value)
side.wait_stream(torch.cuda.current_stream())
graph = torch.cuda.CUDAGraph()
with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
    y = layer(x)
graph.replay()
torch.cuda.synchronize()
assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-5)
x.view(-1)[5] = float("nan")
graph.replay()
try:
    cg.check()
    raise SystemExit("no report for the NaN seen by the replay")
except cg.NonFiniteInputError as err:
    assert err.deferred and err.nan_count == 1
print("CAPTURED FIRST OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode == 0 and out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0 and "CAPTURED FIRST OK" in out.stdout, out.stdout + out.stderr
