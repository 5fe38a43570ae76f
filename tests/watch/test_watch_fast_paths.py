"""watch's per-op fast paths (issue 50) miss nothing: the inline count of small contiguous CPU
outputs (each dtype it reads, NaN/+Inf/-Inf counts and the first bad index, float64 not narrowed),
the fused scan beyond its size limit and for strided outputs, and ops that return only views
(skipped after the op) keeping the module of their autograd node for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

_INLINE_MAX = 1024  # watch_device_cpu.cpp's kInlineScanMax
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _births(fn) -> cg.NonFiniteOutputError:
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(mode="sync"):
            fn()
    return info.value


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 16, _INLINE_MAX, _INLINE_MAX + 1], ids=lambda n: f"n{n}")
def test_log_of_a_small_output_names_log_with_counts_and_first_index(dtype, n):
    values = torch.ones(n, dtype=dtype)
    values[n - 1] = -1.0  # NaN
    if n > 2:
        values[n // 2] = 0.0  # -Inf
    err = _births(lambda: values.log())
    assert err.op == "aten.log.default" and err.dtype == str(dtype)
    assert err.nan_count == 1 and err.posinf_count == 0
    assert err.neginf_count == (1 if n > 2 else 0)
    assert err.first_bad_index == (n // 2 if n > 2 else n - 1)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_an_overflow_to_plus_inf_in_a_small_output_is_born(dtype):
    big = torch.finfo(dtype).max
    x = torch.full((8,), big / 2, dtype=dtype)
    err = _births(lambda: x * 4.0)
    assert err.op == "aten.mul.Tensor" and err.posinf_count == 8 and err.first_bad_index == 0


def test_float64_values_beyond_float32_range_are_finite_not_births():
    x = torch.full((16,), 1e200, dtype=torch.float64)
    with cg.watch(mode="sync") as w:
        y = x * 1e100  # 1e300: finite in float64, +inf had it been narrowed to float32
        ops, scanned = w.stats()
    assert torch.isfinite(y).all() and scanned >= 1


def test_a_strided_small_output_goes_through_the_fused_scan_and_is_born():
    x = torch.ones(8, 8)
    x[3, 5] = -1.0
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(mode="sync"):
            out = torch.empty(8, 8).t()  # a transposed out=: not contiguous
            torch.log(x, out=out)
    err = info.value
    assert err.op == "aten.log.out" and err.nan_count == 1
    assert err.first_bad_coords == [3, 5]


def test_a_view_op_keeps_its_nodes_module_for_the_backward():
    class Viewing(torch.nn.Module):
        def forward(self, x):
            return x.expand(4, 16)  # a view only: the fallback skips the scan after it

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.viewing = Viewing()

        def forward(self, x):
            return self.viewing(x)

    model = Model()
    x = torch.ones(1, 16, dtype=torch.float16, requires_grad=True)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync", report="birth"):
            out = model(x)
            # ExpandBackward0 sums the 4 rows: 4 * 60000 overflows float16 in backward.
            out.backward(torch.full((4, 16), 60000.0, dtype=torch.float16))
    err = info.value
    assert err.phase == "backward" and err.posinf_count == 16
    assert err.module == "viewing" and err.backward_node == "ExpandBackward0"


def test_a_block_after_a_birth_reads_no_tag_of_it():
    # A block's start resets only what the last block used (the ring entries, tag slots and node
    # tags below its high-water marks): the node tag block 1 left at the sqrt's node must not make
    # block 2's backward birth at that node look like its consequence.
    class Sqrt(torch.nn.Module):
        def forward(self, x):
            return torch.sqrt(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Sqrt(), torch.nn.Linear(4, 1))
    with pytest.raises(cg.NonFiniteOutputError) as first:
        with cg.watch(model, mode="sync"):
            model(-torch.ones(2, 4)).sum().backward()  # sqrt(-1): NaN born in forward
    assert first.value.op == "aten.sqrt.default" and first.value.phase == "forward"
    x = torch.zeros(2, 4, requires_grad=True)
    with pytest.raises(cg.NonFiniteOutputError) as second:
        with cg.watch(model, mode="sync"):
            model(x).sum().backward()  # sqrt(0) is finite; its gradient is not
    err = second.value
    assert err.phase == "backward" and err.backward_node == "SqrtBackward0" and err.module == "0"
    assert err.posinf_count + err.neginf_count > 0 and err.op is not None


# -- the project's guarded ops: one watched op each (their inner steps sealed) -----------------


def test_a_guarded_layer_is_one_watched_op_with_one_scan():
    # Its kernel allocates the output, copies the bias and, from its autograd kernel, calls
    # the op again: none of those is the user's op, and each cost a hook and a scan.
    layer = cg.SafeLinear(128, 384)
    x = torch.randn(64, 128)
    layer(x)
    with cg.watch(mode="sync") as w:
        layer(x)
        assert w.stats() == (1, 1)


def test_an_overflow_inside_a_guarded_backward_gemm_is_born_at_that_op():
    layer = cg.SafeLinear(4, 1024, dtype=torch.float16)
    with torch.no_grad():
        layer.weight.fill_(0.25)
        layer.bias.zero_()
    x = torch.ones(2, 4, dtype=torch.float16, requires_grad=True)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(layer, mode="sync"):
        layer(x).backward(torch.full((2, 1024), 300.0, dtype=torch.float16))  # 1024 x 300 x 0.25
    err = info.value
    assert err.op == "cublas_guard.linear_grad_input.default" and err.phase == "backward"
    assert err.posinf_count == 8 and err.overflow_bound == 76800.0


def test_a_composite_ops_output_is_read_once_by_the_op_inside_that_made_it():
    x, weight, bias = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    with torch.no_grad(), cg.watch(mode="sync") as w:
        F.linear(x, weight, bias)  # aten::linear (composite) runs aten::addmm
        ops, scanned = w.stats()
    assert scanned == 1 and ops >= 2
    with pytest.raises(cg.NonFiniteOutputError) as info, torch.no_grad(), cg.watch(mode="sync"):
        F.linear(x * 1e30, weight * 1e30, bias)  # the birth is still named, at the op inside
    assert info.value.op == "aten.addmm.default"


def test_an_op_returning_its_inputs_storage_is_not_read_again():
    x = torch.randn(4, 8)
    with torch.no_grad(), cg.watch(mode="sync") as w:
        y = x * 2
        torch.ops.aten._unsafe_view(y, [8, 4])  # y's storage, with no view annotation
        assert w.stats()[1] == 1
    with pytest.raises(cg.NonFiniteOutputError), torch.no_grad(), cg.watch(mode="sync"):
        torch.ops.aten._unsafe_view(x * 1e30 * 1e30, [8, 4])


def test_a_copy_or_bounded_map_of_finite_tensors_is_tagged_finite_without_a_read():
    x = torch.randn(64, 64)
    with torch.no_grad(), cg.watch(mode="sync") as w:
        y = x * 2  # scanned
        y.clone(), torch.relu(y), F.gelu(y), torch.softmax(y, -1), y.double(), y.to(torch.bfloat16).float()
        assert w.stats()[1] == 2  # x * 2 and the narrowing cast to bfloat16 only


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.full((8,), 1e6, dtype=torch.float64).to(torch.float16), id="narrowing"),
        pytest.param(lambda: torch.full((8,), 10**6).to(torch.float16), id="int64-to-float16"),
    ],
)
def test_a_cast_that_can_overflow_is_still_read(make):
    assert _births(make).op == "aten._to_copy.default"


def test_a_copy_of_a_non_finite_value_inherits_it_and_is_no_new_birth():
    x = torch.randn(8)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(mode="sync"):
        torch.log(x - 10).clone()  # born at log; the clone is not a birth
    assert info.value.op == "aten.log.default"


def _embedding_backward(scale: float) -> tuple[torch.Tensor, tuple[int, int]]:
    """The dense gradient of a 1000-row embedding looked up at 4 positions, two of them row 7."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 8)
    with torch.no_grad():
        emb.weight.mul_(1e-3)  # the forward stays finite at any scale used here
    ids = torch.tensor([7, 3, 7, 9])
    (emb(ids) * scale).sum().backward()
    return emb.weight.grad, (ids.numel(), emb.weight.numel())


def test_an_embeddings_dense_gradient_of_a_bounded_sum_is_tagged_finite_without_a_read():
    scans = {}
    for scale in (1.0, 1e38):  # 4 terms x 1e38 may overflow (2e38 does not): that one is read
        with cg.watch(mode="sync") as w:
            grad, _ = _embedding_backward(scale)
            scans[scale] = w.stats()[1]
        assert torch.isfinite(grad).all()
    assert scans[1.0] == scans[1e38] - 1  # embedding_dense_backward's 1000 x 8 output went unread


def test_an_embedding_gradient_that_overflows_in_its_sum_is_still_born_there():
    # 2e38 x 1 each, twice into row 7: 4e38 overflows float32, though each term is finite
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(mode="sync"):
        _embedding_backward(2e38)
    assert info.value.op == "aten.embedding_dense_backward.default"
    assert info.value.posinf_count == 8  # row 7's eight values


def test_an_embeddings_bounded_gradient_spares_adamws_read_of_its_second_moment():
    # The sum's bound (largest term x terms) below half of 2^62 gives the gradient a bound, so
    # AdamW's exp_avg_sq needs no read at the step's end; 1e18 x 4 terms x 2 does not.
    scans = {}
    for scale in (1.0, 1e18):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(1000, 8)
        opt = torch.optim.AdamW(emb.parameters(), lr=1e-3)
        ids = torch.tensor([7, 3, 7, 9])
        emb(ids).sum().backward()
        opt.step()  # the states exist
        opt.zero_grad()
        with cg.watch(mode="sync") as w:
            (emb(ids) * scale).sum().backward()
            before = w.stats()[1]
            opt.step()
            scans[scale] = w.stats()[1] - before
    assert scans == {1.0: 1, 1e18: 2}  # the parameter; and exp_avg_sq where the bound is unknown
