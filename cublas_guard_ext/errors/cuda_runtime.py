"""The errors of the CUDA/cuBLAS runtime: a cuBLAS status, an earlier kernel's CUDA
error, a guard kernel's launch, sync mode in a graph capture, out of memory. The ones a
failure capsule is written for (parse.attach_capsule) are here."""

from __future__ import annotations

import torch

from .base import GuardError
from .format import _bytes, _dtype, _layer, _memory_line, _shape, _watch_lines, _where
from .status import CUBLAS_STATUS


class CublasError(GuardError, RuntimeError):
    """A cuBLAS call returned a failure status."""

    kind = "cublas"
    with_environment = True

    @property
    def status(self) -> int:
        return int(self.fields.get("status", -1))

    @property
    def status_name(self) -> str:
        name = self.fields.get("status_name")
        if name:
            return str(name)
        entry = CUBLAS_STATUS.get(self.status)
        return entry[0] if entry else f"cublasStatus_t({self.status})"

    @property
    def meaning(self) -> str:
        entry = CUBLAS_STATUS.get(self.status)
        return entry[1] if entry else "an unknown cuBLAS status"

    def _headline(self) -> str:
        f = self.fields
        stage = "creating the cuBLAS handle" if f.get("stage") == "handle" else (f.get("api") or "the GEMM")
        if f.get("op"):  # re-raised by watch() from an op it observed
            return f"watch: {f.get('op')} {_where(f)} ({f.get('phase')}): {self.status_name}: {self.meaning}"
        if f.get("precheck"):
            return (
                f"layer {_layer(f.get('layer'))}: {self.status_name} (refused before the call): "
                f"the arguments break the rule {f.get('rule')}"
            )
        return f"layer {_layer(f.get('layer'))}: {self.status_name} from {stage}: {self.meaning}"

    def _details(self) -> list[str]:
        f = self.fields
        entry = CUBLAS_STATUS.get(self.status)
        lines = []
        causes = [
            f"the loaded libraries conflict: {c['message']}"
            for c in (f.get("environment") or {}).get("library_conflicts") or []
        ] + list(entry[2] if entry else [])
        if causes:
            lines.append("likely causes, most likely first:")
            lines += [f"  {i}. {c}" for i, c in enumerate(causes, 1)]
        if "m" in f:
            api = f" via {f['api']}" if f.get("api") else ""
            lines.append(
                f"call ({f.get('purpose')}{api}): transa={f.get('transa')} transb={f.get('transb')} "
                f"m={f.get('m')} n={f.get('n')} k={f.get('k')} lda={f.get('lda')} "
                f"ldb={f.get('ldb')} ldc={f.get('ldc')}"
                + (f" alpha={f.get('alpha')} beta={f.get('beta')}" if "alpha" in f else "")
            )
        if f.get("data_type"):
            lines.append(f"data type: {f['data_type']}, compute type: {f.get('compute_type')}")
        if f.get("chunk"):
            lines.append(f"piece of a split GEMM: {f['chunk']}")
        if f.get("math_mode"):
            lines.append(f"math mode: {f.get('math_mode')}")
        for op in ("a", "b", "c"):
            if f"{op}_shape" in f:
                role = f" ({f[f'{op}_role']})" if f.get(f"{op}_role") else ""
                lines.append(
                    f"operand {op.upper()}{role}: shape {_shape(f.get(f'{op}_shape'))} strides "
                    f"{_shape(f.get(f'{op}_strides'))} {_dtype(f.get(f'{op}_dtype'))} on "
                    f"{f.get(f'{op}_device')}, {f.get(f'{op}_alignment')}-byte aligned"
                )
        if f.get("device"):
            lines.append(f"device: {f.get('device')}")
        memory = _memory_line(f)
        if memory:
            lines.append(memory)
        if f.get("detail"):
            lines.append(f"detail: {f.get('detail')}")
        lines += _watch_lines(f)
        return lines

    def _next_steps(self) -> list[str]:
        entry = CUBLAS_STATUS.get(self.status)
        steps = list(entry[3]) if entry else ["run `python -m cublas_guard_ext doctor`"]
        conflicts = (self.fields.get("environment") or {}).get("library_conflicts") or []
        if conflicts:  # the most likely cause's fix first, ready to paste (the preload lines too)
            steps[0:0] = conflicts[0]["fix"].splitlines()
        data_type = str(self.fields.get("data_type", ""))
        if self.status in (8, 15) and data_type in ("CUDA_R_16BF", "CUDA_R_16F"):
            # NOT_SUPPORTED / ARCH_MISMATCH in half precision: the GPU or the cuBLAS build.
            steps.insert(
                0,
                "bfloat16 GEMMs need compute capability 8.0+ (float16: 5.3+); on an older GPU "
                "use float16 or float32; if fp32 works but every fp16/bf16 GEMM fails, check "
                "that torch's bundled cuBLAS matches the CUDA runtime (`doctor`)",
            )
        return steps


class PendingCudaError(GuardError, RuntimeError):
    """An earlier kernel's asynchronous CUDA error, seen before this layer's GEMM."""

    kind = "pending_cuda"
    with_environment = True

    def _headline(self) -> str:
        f = self.fields
        if f.get("op"):  # re-raised by watch() from an op it observed
            return (
                f"watch: {f.get('op')} {_where(f)} ({f.get('phase')}) failed with a CUDA error "
                f"({f.get('cuda_error_string')}); the usual cause is an EARLIER kernel"
            )
        return (
            f"layer {_layer(f.get('layer'))}: an EARLIER CUDA kernel failed "
            f"({f.get('cuda_error')}: {f.get('cuda_error_string')}); this Linear did not cause it"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = [
            f"seen {f.get('stage')}",
            "usual culprits: an index out of range in nn.Embedding, torch.gather/index_select "
            "or a loss (e.g. a class label >= num_classes in cross_entropy): a device-side "
            "assert",
        ]
        if f.get("sticky", True):
            lines.append("the CUDA context is now unusable: every later CUDA call fails; restart the process")
        return lines + _watch_lines(f)

    def _next_steps(self) -> list[str]:
        if self.fields.get("launch_blocking"):
            return [
                "CUDA_LAUNCH_BLOCKING=1 is already set: the failing kernel is the last CUDA op "
                "before this layer; check its indices"
            ]
        return [
            "rerun with CUDA_LAUNCH_BLOCKING=1 to have the error raised at the line that failed",
            "check embedding/label indices: assert idx.min() >= 0 and idx.max() < num_embeddings",
        ]


class CudaLaunchError(GuardError, RuntimeError):
    """A guard kernel failed to launch (e.g. no kernel image for this GPU)."""

    kind = "cuda_launch"
    with_environment = True

    def _headline(self) -> str:
        f = self.fields
        if f.get("precheck"):  # refused before the launch: its sizes break a device limit
            return (
                f"layer {_layer(f.get('layer'))}: {f.get('kernel')} was not launched: "
                f"its sizes break the device limit {f.get('rule')}"
            )
        return (
            f"layer {_layer(f.get('layer'))}: launching {f.get('kernel')} failed: "
            f"{f.get('cuda_error')} ({f.get('cuda_error_string')})"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        if f.get("grid"):
            lines.append(
                f"grid {tuple(f['grid'])}, block {tuple(f.get('block') or ())}, "
                f"{f.get('shared_memory_bytes', 0)} bytes of dynamic shared memory "
                f"(the launch would fail with {f.get('cuda_error')})"
            )
        if f.get("built_archs"):
            lines.append(f"this extension was built for compute capabilities {f.get('built_archs')} (x100)")
        if f.get("device_name"):
            lines.append(f"the GPU: {f.get('device_name')}, compute capability {f.get('compute_capability')}")
        return lines

    def _next_steps(self) -> list[str]:
        if self.fields.get("cuda_error") == "cudaErrorNoKernelImageForDevice":
            cc = str(self.fields.get("compute_capability", "X.Y"))
            return [f"rebuild for this GPU: TORCH_CUDA_ARCH_LIST={cc} pip install --no-build-isolation -e ."]
        if self.fields.get("precheck"):
            return [
                "the guard sizes its launches to the device: this is a bug of cublas_guard_ext; report it "
                "with this message and the output of `python -m cublas_guard_ext doctor`"
            ]
        return ["run `python -m cublas_guard_ext doctor`"]


class GraphCaptureError(GuardError, RuntimeError):
    """Sync mode inside CUDA graph capture (it must read results on the host)."""

    kind = "graph_capture"

    def _headline(self) -> str:
        return (
            f"layer {_layer(self.fields.get('layer'))}: mode='sync' cannot run inside CUDA graph "
            "capture (it reads the scan result on the host before the GEMM)"
        )

    def _details(self) -> list[str]:
        return []

    def _next_steps(self) -> list[str]:
        return ["capture with mode='async' (errors are reported at cublas_guard_ext.check()) or mode='off'"]


class OutOfMemoryError(GuardError, torch.OutOfMemoryError):
    """GPU memory ran out where cuBLAS or the guard needed it."""

    kind = "out_of_memory"
    with_environment = True

    def _headline(self) -> str:
        f = self.fields
        request = f" ({_bytes(f['bytes_requested'])} requested)" if f.get("bytes_requested") else ""
        return f"layer {_layer(f.get('layer'))}: out of GPU memory for {f.get('stage')}{request}"

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        memory = _memory_line(f)
        if memory:
            lines.append(memory)
        if f.get("device"):
            lines.append(f"device: {f.get('device')}")
        if f.get("detail"):
            lines.append(f"detail: {f.get('detail')}")
        return lines

    def _next_steps(self) -> list[str]:
        return [
            "lower the batch size",
            "call torch.cuda.empty_cache() before the failing step (cuBLAS allocates outside torch's cache)",
            "give cuBLAS a smaller workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8",
            "look for other processes on the GPU: nvidia-smi",
        ]


class CublasOutOfMemoryError(OutOfMemoryError, CublasError):
    """cuBLAS failed for memory: ALLOC_FAILED, or NOT_INITIALIZED creating its handle.

    Both an :class:`OutOfMemoryError` (so ``torch.OutOfMemoryError`` handlers
    catch it) and a :class:`CublasError` (``.status``, the call's arguments).
    """

    kind = "cublas_out_of_memory"

    def _headline(self) -> str:
        return CublasError._headline(self)

    def _details(self) -> list[str]:
        return CublasError._details(self)

    def _next_steps(self) -> list[str]:
        return OutOfMemoryError._next_steps(self)
