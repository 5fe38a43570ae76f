"""The stable core's fast entries on a CUDA device (the GPU check's ``tests`` step runs this).

The suite runs on the locked library, where the core's entries are not loaded, and
test_core_entry.py covers them on the CPU. Their CUDA branch (the device mask set by the first-use
diagnostics, the hand-over of torch's half-precision cuBLAS settings, the CUDA kernel table) runs
only on a GPU: this test starts a process on the core alone (CUBLAS_GUARD_EXT_NATIVE=core, the
prebuilt ``_core_cuda``) and checks there, for each entry that torch has (the C entry from torch
2.14, and its Python twin), products against float64 in every dtype, a NaN refused with its
typed error and index, mixed devices handed back, and the autograd node's gradients.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from helpers import requires_cuda
from helpers.run_scripts import script_env

CHILD = r"""
import json
import torch
import cublas_guard_ext as cg
from cublas_guard_ext._native.core_twins import stable_core
from cublas_guard_ext._native.loading import loader

info = loader.info()
assert info.library == "core" and "_core_cuda" in info.path, (info.library, info.path)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
entries = {"python": (stable_core.fast_linear, stable_core.cuda_first_use_done)}
c = stable_core.c_entry(info.path)
if c is not None:
    entries["c"] = (c[0], c[1])
OFF, SYNC = 0, 1
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 3e-3}
gen = torch.Generator().manual_seed(2026)
for name, (entry, first_use) in entries.items():
    x = torch.randn(6, 32, generator=gen, dtype=torch.float64).cuda()
    w = torch.randn(8, 32, generator=gen, dtype=torch.float64).cuda()
    b = torch.randn(8, generator=gen, dtype=torch.float64).cuda()
    with torch.no_grad():
        # Before the device's first-use diagnostics the entry hands the call back.
        assert entry(x, w, b, "cuda.entry", SYNC, False) is None, name
        first_use(0)
        for dtype, tol in TOL.items():
            args = [t.to(dtype) for t in (x, w, b)]
            ref = torch.nn.functional.linear(*(t.double() for t in args))  # of the rounded inputs
            out = entry(*args, "cuda.entry", SYNC, False)
            assert out is not None and out.is_cuda and out.dtype == dtype, (name, dtype)
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        bad = x.float().clone()
        bad[2, 5] = float("nan")
        try:
            entry(bad, w.float(), None, "cuda.entry", SYNC, False)
            raise AssertionError(f"{name}: a NaN input was not refused")
        except cg.NonFiniteInputError as e:
            assert e.fields["layer"] == "cuda.entry" and e.fields["first_bad_index"] == 69, e.fields
        if name == "c":  # tensors on two kinds of device: the dispatcher words that error
            assert entry(x, w.cpu(), b, "cuda.entry", OFF, False) is None
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    bg = b.clone().requires_grad_()
    out = entry(xg, wg, bg, "cuda.grad", SYNC, True)
    assert out.grad_fn is not None, name
    g = torch.randn(6, 8, generator=gen, dtype=torch.float64).cuda()
    got = torch.autograd.grad(out, (xg, wg, bg), g)
    want = torch.autograd.grad(torch.nn.functional.linear(xg, wg, bg), (xg, wg, bg), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
layer = cg.SafeLinear(32, 8).cuda()
with torch.no_grad():
    out = layer(torch.randn(4, 32, device="cuda"))
assert out.shape == (4, 8) and bool(out.isfinite().all())
print("RESULT " + json.dumps({"entries": sorted(entries), "torch": torch.__version__}))
"""


@requires_cuda
def test_the_cores_entries_on_cuda_in_a_process_of_their_own() -> None:
    if importlib.util.find_spec("cublas_guard_ext._core_cuda") is None:
        pytest.skip("no prebuilt _core_cuda (a JIT build of the locked library): pip install -e . builds it")
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=script_env(CUBLAS_GUARD_EXT_NATIVE="core"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    shims = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
    assert result["entries"] == (["c", "python"] if shims else ["python"]), result
