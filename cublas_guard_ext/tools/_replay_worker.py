"""The replay's worker process: ``python -m cublas_guard_ext.tools._replay_worker CAPSULE VARIANT...``.

Started by :mod:`cublas_guard_ext.capsule_replay` with ``CUDA_LAUNCH_BLOCKING=1``. Runs
each named variant of the capsule's GEMM through the native replay op
(csrc/replay/replay_cpu.cpp, replay_cuda.cu) on fresh buffers (the stored values, or
seeded synthetic ones of the recorded layout and alignment) and prints one JSON line
per variant: {"name", "status": passed | failed | not applicable | not run, "detail"}.
Exits with status 3 right after a variant that left a CUDA error (the context is
broken: the parent starts a new worker for the rest).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from .._native.loading import loader
from ..capsule import scaled as _scaled
from ..capsule.contents import load
from ..capsule.replaying import VARIANTS
from ..errors import CUBLAS_STATUS

CONTEXT_BROKEN = 3
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}
_LIMIT = 2**31 - 1


def _status_text(status: int) -> str:
    entry = CUBLAS_STATUS.get(status)
    return f"status {status} ({entry[0] if entry else 'unknown cublasStatus_t'})"


def _aligned(numel: int, dtype: torch.dtype, device: torch.device, alignment: int) -> torch.Tensor:
    """A flat buffer whose address has exactly ``alignment`` (the largest power of two
    dividing it, capped at 256), as the captured call's pointer had."""
    es = torch.empty((), dtype=dtype).element_size()
    room = 512 // es
    base = torch.empty(numel + room, dtype=dtype, device=device)
    for offset in range(room):
        address = base.data_ptr() + offset * es
        got = 1
        while got < 256 and address % (got * 2) == 0:
            got *= 2
        if got == min(int(alignment or 256), 256):
            return base[offset : offset + numel]
    return base[:numel]


class Replay:
    def __init__(self, data: dict[str, Any], device: torch.device) -> None:
        self.data, self.device = data, device
        self.call = data["call"]
        self.dtype = _DTYPES[self.call["dtype"]]
        self.ops = data.get("gemm_operands") or {}
        gen = torch.Generator().manual_seed(0)
        self.source: dict[str, torch.Tensor] = {}
        for name in "abc":
            entry = self.ops.get(name) or {}
            values = entry.get("values")
            if isinstance(values, torch.Tensor):
                self.source[name] = values.to(self.dtype)
            else:  # synthetic: seeded values of the recorded size
                numel = int(entry.get("numel", 0))
                self.source[name] = torch.randn(numel, generator=gen, dtype=torch.float32).to(self.dtype)

    def buffers(self, tight: bool) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        c = self.call
        lds = {"a": c["lda"], "b": c["ldb"], "c": c["ldc"]}
        if not tight:
            out = {}
            for name, values in self.source.items():
                buf = _aligned(
                    values.numel(), self.dtype, self.device, (self.ops.get(name) or {}).get("alignment", 256)
                )
                buf.copy_(values)
                out[name] = buf
            return out, lds
        # Contiguous copies: each stored matrix with the tightest leading dimension, 256-aligned.
        shapes = {
            "a": (c["k"], c["m"]) if c["transa"] == "T" else (c["m"], c["k"]),
            "b": (c["n"], c["k"]) if c["transb"] == "T" else (c["k"], c["n"]),
            "c": (c["m"], c["n"]),
        }
        out, new_lds = {}, {}
        for name, (rows, cols) in shapes.items():
            matrix = (
                self.source[name].as_strided((rows, cols), (1, lds[name]))
                if rows and cols
                else self.source[name][:0].reshape(rows, cols)
            )
            flat = matrix.t().contiguous().reshape(-1)  # column-major with ld = rows
            buf = _aligned(flat.numel(), self.dtype, self.device, 256)
            buf.copy_(flat)
            out[name], new_lds[name] = buf, max(1, rows)
        return out, new_lds

    def reference(self, bufs: dict[str, torch.Tensor], lds: dict[str, int]) -> torch.Tensor:
        c = self.call

        def matrix(name: str, rows: int, cols: int) -> torch.Tensor:
            return bufs[name].detach().cpu().double().as_strided((rows, cols), (1, lds[name]))

        a = matrix("a", c["k"], c["m"]).t() if c["transa"] == "T" else matrix("a", c["m"], c["k"])
        b = matrix("b", c["n"], c["k"]).t() if c["transb"] == "T" else matrix("b", c["k"], c["n"])
        out = matrix("c", c["m"], c["n"])
        return c["alpha"] * (a @ b) + c["beta"] * out

    def run(self, routine: str, math_mode: str, workspace: bool, tight: bool = False) -> dict[str, Any]:
        c = self.call
        bufs, lds = self.buffers(tight)
        small = c["m"] * c["n"] * max(1, c["k"]) <= 2**27
        ref = self.reference(bufs, lds) if small and c["m"] and c["n"] else None
        try:
            status = torch.ops.cublas_guard_internal.replay_gemm(
                bufs["a"],
                bufs["b"],
                bufs["c"],
                c["transa"] == "T",
                c["transb"] == "T",
                c["m"],
                c["n"],
                c["k"],
                lds["a"],
                lds["b"],
                lds["c"],
                float(c["alpha"]),
                float(c["beta"]),
                routine,
                math_mode,
                workspace,
            )
        except RuntimeError as err:
            text = str(err).splitlines()[0]
            broken = "CUDA error" in text
            return {"status": "failed" if broken else "error", "detail": text, "context_broken": broken}
        if status != 0:
            return {"status": "failed", "detail": f"{routine}: {_status_text(status)}"}
        detail = f"{routine}: {_status_text(0)}"
        if ref is not None:
            got = bufs["c"].detach().cpu().double().as_strided((c["m"], c["n"]), (1, lds["c"]))
            scale = ref.abs().max().item() or 1.0
            error = (got - ref).abs().max().item() / scale
            detail += f", max relative error vs a float64 reference {error:.1e}"
        return {"status": "passed", "detail": detail}


def _other_routine(routine: str, dtype: torch.dtype) -> str:
    wide = routine.endswith("_64")
    base = routine[:-3] if wide else routine
    if dtype == torch.float32:
        other = "cublasGemmEx" if base == "cublasSgemm" else "cublasSgemm"
    elif dtype == torch.float64:
        other = "cublasGemmEx" if base == "cublasDgemm" else "cublasDgemm"
    else:
        other = "cublasSgemmEx" if base == "cublasGemmEx" else "cublasGemmEx"
    return other + ("_64" if wide else "")


_CPU_NOT_APPLICABLE = {
    "TF32 flipped": "TF32 is a GPU math mode; the CPU runs torch's addmm",
    "other routine": "the CPU has one routine (torch's addmm)",
    "cublasLt": "cuBLASLt is CUDA only",
    "no workspace": "the cuBLAS workspace is a GPU resource",
    "_64 API": "torch's CPU addmm has no 32-bit limit: there is no _64 form",
}


def variant(name: str, replay: Replay) -> dict[str, Any]:
    c, cuda = replay.call, replay.device.type == "cuda"
    routine, math = c["routine"], c.get("math_mode") or ""
    if not cuda and name in _CPU_NOT_APPLICABLE:
        return {"status": "not applicable", "detail": _CPU_NOT_APPLICABLE[name]}
    if name == "as recorded":
        return replay.run(routine, math, True)
    if name == "contiguous copies":
        return replay.run(routine, math, True, tight=True)
    if name == "TF32 flipped":
        if replay.dtype != torch.float32:
            return {"status": "not applicable", "detail": f"TF32 concerns float32 only ({c['dtype']})"}
        tf32 = "TF32" in math
        result = replay.run(routine, "CUBLAS_DEFAULT_MATH" if tf32 else "CUBLAS_TF32_TENSOR_OP_MATH", True)
        result["detail"] = ("TF32 off: " if tf32 else "TF32 on: ") + result["detail"]
        return result
    if name == "other routine":
        return replay.run(_other_routine(routine, replay.dtype), math, True)
    if name == "cublasLt":
        return replay.run("cublasLtMatmul", math, True)
    if name == "no workspace":
        result = replay.run(routine, math, False)
        result["detail"] = "a private handle without workspace: " + result["detail"]
        return result
    if name == "_64 API":
        if routine.endswith("_64"):
            if max(c["m"], c["n"], c["k"], c["lda"], c["ldb"], c["ldc"]) > _LIMIT:
                return {"status": "not applicable", "detail": "the call needs the _64 API (beyond 2^31-1)"}
            return replay.run(routine[:-3], math, True)
        return replay.run(routine + "_64", math, True)
    return {"status": "not applicable", "detail": f"unknown variant {name!r}"}


def main(argv: list[str]) -> int:
    path, names = argv[0], argv[1:] or list(VARIANTS)
    data = load(path)
    loader.load()
    if data.get(_scaled.KEY) or data.get(_scaled.CAST_KEY):  # FP8: the GEMM or cast alone (capsule/scaled.py)
        for name in names:
            result = _scaled.run_recorded(data) if name == "as recorded" else {"status": "not applicable"}
            print(
                json.dumps({**result, "name": name, "detail": result.get("detail", "a cuBLAS variant")}),
                flush=True,
            )
        return 0
    call = data.get("call")
    reason = None
    if not call:
        reason = "this capsule holds no GEMM call (the error was not raised inside a guarded GEMM call)"
    elif str(call.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
        reason = f"the call ran on {call.get('device')}; this machine has no CUDA GPU"
    elif call.get("dtype") not in _DTYPES:
        reason = f"unknown dtype {call.get('dtype')!r}"
    if reason is not None:
        for name in names:
            print(json.dumps({"name": name, "status": "not run", "detail": reason}), flush=True)
        return 0
    device = torch.device("cpu")
    if str(call["device"]).startswith("cuda"):
        index = torch.device(call["device"]).index or 0
        device = torch.device("cuda", index if index < torch.cuda.device_count() else 0)
        torch.cuda.set_device(device)
        # The handle's math mode for float32 follows torch: as recorded unless a variant sets it.
        torch.backends.cuda.matmul.allow_tf32 = "TF32" in str(call.get("math_mode"))
    replay = Replay(data, device)
    for name in names:
        try:
            result = variant(name, replay)
        except Exception as err:  # one variant's trouble is its own line, not the end
            result = {
                "status": "error",
                "detail": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}",
            }
        result["name"] = name
        broken = result.pop("context_broken", False)
        print(json.dumps(result), flush=True)
        if broken:
            return CONTEXT_BROKEN
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
