"""The order-sensitive tensor signature (cublas_guard_ext.training.signatures) and the fault-injection
helpers (cublas_guard_ext.training.fault_injection)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from cublas_guard_ext.training import signatures
from cublas_guard_ext.training.fault_injection import GemmBitFlip, flip_bit, spike_bit

M64 = 1 << 64


def reference(t: torch.Tensor) -> int:
    """The fold written out in Python integers: the bytes zero-padded to whole rows of 16 int64
    words, sum of word_i * (w[i % 16] + v[i // 16]) mod 2**64 (w odd, v even: every weight
    odd), plus the crc32 of shape and dtype."""
    import zlib

    raw = bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())
    raw += bytes(-len(raw) % signatures.ROW_BYTES)
    words = [int.from_bytes(raw[8 * i : 8 * i + 8], "little", signed=True) for i in range(len(raw) // 8)]
    lanes_w, rows_w = signatures._weights_for(torch.device("cpu"), len(words) // 16 + 1)
    lw, rw = lanes_w.tolist(), rows_w.tolist()
    total = sum(word * (lw[i % 16] + rw[i // 16]) for i, word in enumerate(words))
    total += zlib.crc32(f"{tuple(t.shape)} {t.dtype}".encode())
    total %= M64
    return total - M64 if total >= M64 // 2 else total


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((37, 13), torch.float32),
        ((5, 3), torch.bfloat16),
        ((129,), torch.float64),
        ((300, 200), torch.float32),
    ],
)
def test_the_fold_is_exactly_the_documented_sum(shape, dtype):
    t = torch.randn(shape).to(dtype)
    assert int(signatures.fold(t)) == reference(t)


def test_a_folder_batches_small_tensors_and_agrees_with_fold_each():
    """Small tensors go through one batch, large ones (>= 64 KiB) one by one, cached views:
    the same signatures as one fold each, again after an in-place update."""
    tensors = [torch.randn(300, 200), torch.randn(7), torch.randn(33, 5).bfloat16(), torch.randn(64, 64)]
    tensors.append(torch.tensor([True, False, True]))
    folder = signatures.Folder(tensors)
    assert folder().tolist() == [int(signatures.fold(t)) for t in tensors]
    for t in tensors[:4]:
        t.mul_(2)
    assert folder().tolist() == [int(signatures.fold(t)) for t in tensors]
    assert [reference(t) for t in tensors[:3]] == folder().tolist()[:3]


def test_every_single_bit_flip_changes_it():
    t = torch.randn(40, 7)
    base = int(signatures.fold(t))
    for index in (0, 17, 279):  # the low and the high half of an int64 word
        for bit in range(32):
            u = t.clone()
            flip_bit(u, index, bit)
            assert int(signatures.fold(u)) != base, (index, bit)


def test_elements_trading_places_change_it():
    rng = random.Random(0)
    t = torch.randn(64, 9)
    base = int(signatures.fold(t))
    flat = t.reshape(-1)
    for _ in range(200):
        i, j = rng.sample(range(flat.numel()), 2)
        if flat[i] == flat[j]:
            continue
        u = flat.clone()
        u[i], u[j] = flat[j], flat[i]
        assert int(signatures.fold(u.view_as(t))) != base, (i, j)
    swapped = t.clone()
    swapped[[3, 5]] = t[[5, 3]]  # two rows
    assert int(signatures.fold(swapped)) != base


def test_the_same_bytes_give_the_same_signature_whatever_the_layout_or_threads():
    t = torch.randn(33, 17)
    base = int(signatures.fold(t))
    assert int(signatures.fold(t.clone())) == base
    assert int(signatures.fold(t.t().contiguous().t())) == base  # non-contiguous, same values
    offset = torch.randn(33 * 17 + 1)[1:].view(33, 17)  # 4 bytes off an 8-byte boundary
    offset.copy_(t)
    assert int(signatures.fold(offset)) == base
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int(signatures.fold(torch.randn(1000, 100, generator=torch.Generator().manual_seed(1))))
        torch.set_num_threads(2)
        two = int(signatures.fold(torch.randn(1000, 100, generator=torch.Generator().manual_seed(1))))
    finally:
        torch.set_num_threads(threads)
    assert one == two
    assert int(signatures.fold(t.reshape(17, 33))) != base  # the shape is part of it
    assert int(signatures.fold(t.double())) != int(signatures.fold(t))


def test_stats_count_non_finite_values_and_keep_finite_magnitudes():
    ints, floats = signatures.stats(torch.tensor([1.0, float("nan"), -3.0, float("inf")]))
    assert ints[1].item() == 2 and floats.tolist() == [3.0, pytest.approx(10**0.5)]


# -- fault injection ---------------------------------------------------------------------------------


def test_flip_bit_flips_exactly_one_bit():
    t = torch.tensor([1.0, 2.0])
    assert flip_bit(t, 0, 31) == -1.0  # the sign
    assert flip_bit(t, 1, 23) == 4.0  # the exponent's lowest bit: 2 (exponent 128) -> 4
    with pytest.raises(ValueError, match=r"bit must be in \[0, 32\) for torch.float32, got 32"):
        flip_bit(t, 0, 32)
    with pytest.raises(ValueError, match="index 5 is outside a tensor of 2 elements"):
        flip_bit(t, 5, 0)


def test_spike_bit_makes_a_large_finite_value():
    t = torch.tensor([0.75, 3e-5, -2e-3])
    index, bit = spike_bit(t)
    u = t.clone()
    flip_bit(u, index, bit)
    # 3e-5 (exponent 111: bit 4 clear) times 2**16 is the largest value one flip can make
    # below 2**40 without Inf; 0.75 can only double or become ~2.5e38
    assert (index, bit) == (1, 23 + 4) and u[1] == t[1] * 2.0**16
    assert spike_bit(torch.zeros(0)) is None


def test_gemm_bit_flip_matches_op_shape_skip_and_times():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    clean = model(x).detach()
    with GemmBitFlip(ops=["aten.addmm"], shape=(3, 2), bit=31, index=0, skip=1, times=1) as fault:
        first = model(x).detach()  # skipped
        second = model(x).detach()  # flipped: the sign of element 0
        third = model(x).detach()  # times=1: no more
    assert torch.equal(first, clean) and torch.equal(third, clean)
    assert second[0, 0] == -clean[0, 0] and torch.equal(second.reshape(-1)[1:], clean.reshape(-1)[1:])
    assert (fault.calls, fault.flips) == (3, 1)
    with pytest.raises(ValueError, match="GemmBitFlip: not GEMM ops: \\['aten.add'\\]"):
        GemmBitFlip(ops=["aten.add"])
