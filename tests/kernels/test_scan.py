"""The fused scan against torch.isnan / torch.isinf, on fresh random tensors."""

from __future__ import annotations

import math

import pytest
import torch

import cublas_guard_ext as cg

NAN, INF = float("nan"), float("inf")


def reference(x: torch.Tensor) -> tuple[int, int, int, int]:
    flat = x.reshape(-1)  # logical row-major order, whatever the strides
    bad = ~torch.isfinite(flat)
    first = int(bad.nonzero()[0, 0]) if bad.any() else -1
    return (
        int(torch.isnan(flat).sum()),
        int((flat == INF).sum()),
        int((flat == -INF).sum()),
        first,
    )


def as_tuple(result: cg.ScanResult) -> tuple[int, int, int, int]:
    return (result.nan_count, result.posinf_count, result.neginf_count, result.first_bad_index)


def plant(x: torch.Tensor, positions: list[int], values: list[float]) -> torch.Tensor:
    flat = x.view(-1)
    for pos, value in zip(positions, values):
        flat[pos] = value
    return x


SIZES = [0, 1, 2, 3, 4, 5, 7, 16, 17, 255, 1023, 4096 + 3, 32768, 32769, 100_003, (1 << 20) + 7]


@pytest.mark.parametrize("n", SIZES)
def test_clean_tensor(device: str, n: int) -> None:
    x = torch.randn(n, device=device) * 1e30  # large but finite: a sum would overflow, a scan must not
    assert as_tuple(cg.scan(x)) == (0, 0, 0, -1)


@pytest.mark.parametrize("n", [s for s in SIZES if s > 0])
@pytest.mark.parametrize("where", ["first", "last", "random", "mixed"])
def test_planted_values(device: str, n: int, where: str) -> None:
    x = torch.randn(n, device=device)
    gen = torch.Generator().manual_seed(n)
    if where == "first":
        plant(x, [0], [NAN])
    elif where == "last":
        plant(x, [n - 1], [-INF])
    elif where == "random":
        k = min(n, 5)
        positions = torch.randperm(n, generator=gen)[:k].tolist()
        plant(x, positions, [NAN, INF, -INF, NAN, INF][:k])
    else:  # many of each kind, scattered
        k = max(1, n // 50)
        positions = torch.randperm(n, generator=gen)[: 3 * k].tolist()
        values = ([NAN] * k + [INF] * k + [-INF] * k)[: len(positions)]
        plant(x, positions, values)
    before = x.clone()
    assert as_tuple(cg.scan(x)) == reference(x)
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(
        x.nan_to_num(0.0), before.nan_to_num(0.0)
    ), "the scan must not modify its input"


def test_nan_payloads_and_signs(device: str) -> None:
    """Every NaN bit pattern is a NaN; -0.0, denormals and FLT_MAX are finite."""
    bits = torch.tensor(
        [
            0x7FC00000,
            0xFFC00000,
            0x7F800001,
            0xFFFFFFFF,
            0x7F800000,
            0xFF800000,
            0x80000000,
            0x00000001,
            0x7F7FFFFF,
            0xFF7FFFFF,
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    x = bits.view(torch.float32).to(device)
    assert as_tuple(cg.scan(x)) == (4, 1, 1, 0)


def _views(device: str) -> dict[str, torch.Tensor]:
    base = torch.randn(37, 53, device=device)
    big = torch.randn(6, 7, 8, 9, device=device)
    many_dims = torch.randn([2] * 18, device=device).permute(*reversed(range(18)))
    return {
        "transposed": base.t(),
        "row_slice": base[:, 5:40],
        "step_slice": base[::2, ::3],
        "offset_1": base.view(-1)[1:],
        "offset_2": base.view(-1)[2:1000],
        "offset_3": base.view(-1)[3:],
        "expanded": torch.randn(1, 53, device=device).expand(37, 53),
        "scalar_expanded": torch.randn((), device=device).expand(10, 10),
        "permuted_4d": big.permute(2, 0, 3, 1),
        "channels_last": big.contiguous(memory_format=torch.channels_last),
        "zero_dim": torch.randn((), device=device),
        "size_one_dims": torch.randn(1, 37, 1, 1, 53, 1, device=device)[:, ::2],
        "eighteen_dims": many_dims,
    }


@pytest.mark.parametrize(
    "name",
    [
        "transposed",
        "row_slice",
        "step_slice",
        "offset_1",
        "offset_2",
        "offset_3",
        "expanded",
        "scalar_expanded",
        "permuted_4d",
        "channels_last",
        "zero_dim",
        "size_one_dims",
        "eighteen_dims",
    ],
)
def test_non_contiguous_views(device: str, name: str) -> None:
    view = _views(device)[name]
    assert as_tuple(cg.scan(view)) == (0, 0, 0, -1)
    # Plant through the view (logical positions), so the expected index is known.
    n = view.numel()
    if view.stride() and 0 in view.stride():
        view.as_strided((1,), (1,))[0] = NAN  # expanded: one storage element = many logical ones
    else:
        for logical in sorted({0, n // 3, n - 1}):
            idx = []
            rest = logical
            for size in reversed(view.shape):
                idx.append(rest % size)
                rest //= size
            view[tuple(reversed(idx))] = [NAN, INF, -INF][logical % 3]
    assert as_tuple(cg.scan(view)) == reference(view)


def test_large_counts_are_int64_exact() -> None:
    """Counts past 2^31 would need a 9 GB tensor; check exactness at 2^24+ instead."""
    n = (1 << 24) + 5
    x = torch.full((n,), NAN)
    x[::2] = INF
    result = cg.scan(x)
    assert result.nan_count == n // 2
    assert result.posinf_count == n - n // 2
    assert result.first_bad_index == 0


def test_scan_result_is_lazy_and_cached(device: str) -> None:
    x = torch.randn(10, device=device)
    x[7] = NAN
    result = cg.scan(x)
    assert result.tensor.dtype == torch.int64 and result.tensor.shape == (4,)
    assert result.tensor.device == x.device
    assert result._host is None, "creating the result must not read it"
    assert result.first_bad_index == 7 and result._host is not None
    assert result.bad_count == 1 and not result.all_finite
    assert "first_bad_index=7" in repr(result)


def test_all_finite_is_false_when_the_only_bad_element_is_first(device: str) -> None:
    # first_bad_index == 0 is a finding, not "none" (-1).
    x = torch.randn(6, device=device)
    x[0] = NAN
    result = cg.scan(x)
    assert result.first_bad_index == 0 and result.bad_count == 1
    assert not result.all_finite
    assert cg.scan(torch.randn(6, device=device)).all_finite


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_scan_refuses_other_dtypes(device: str, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="float32, bfloat16, float16 or float64"):
        cg.scan(torch.zeros(3, device=device).to(dtype))


def test_scan_refuses_non_tensors() -> None:
    with pytest.raises(TypeError, match="torch.Tensor"):
        cg.scan([1.0, math.nan])  # type: ignore[arg-type]
