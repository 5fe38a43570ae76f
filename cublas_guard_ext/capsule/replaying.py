"""Replay a failure capsule: does this GEMM fail by itself?

``cg.replay(path)`` (and ``python -m cublas_guard_ext replay PATH [--json]``)
runs the captured call alone, in a fresh process on the same device with
``CUDA_LAUNCH_BLOCKING=1``, then its variants: TF32 flipped, the other cuBLAS
routine for the dtype, cublasLt instead of cublas, no workspace, contiguous
copies of the operands, the ``_64`` API. Each variant that does not exist on
the device (on the CPU: all but the call itself and contiguous copies) is
listed as not applicable, with the reason. A variant that breaks the CUDA
context does not spoil the next: the rest run in a new process.

The verdict:

* reproduced: the GEMM fails alone on this stack (cuBLAS, GPU, driver): which
  variants pass, what to try, and a bug report ready to paste;
* not reproduced: the failure came from outside this GEMM (an earlier kernel,
  memory pressure, a transient or hardware fault), and the next steps.

The worker is :mod:`cublas_guard_ext.tools._replay_worker`; this module only
starts it and writes the verdict (it needs no GPU and imports no op).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from . import contents as _capsule
from . import scaled as _scaled

# Every variant, in the order they run; the worker knows what each means.
VARIANTS = (
    "as recorded",
    "TF32 flipped",
    "other routine",
    "cublasLt",
    "no workspace",
    "contiguous copies",
    "_64 API",
)
WORKER = "cublas_guard_ext.tools._replay_worker"
_CONTEXT_BROKEN = 3  # the worker's exit status when a variant broke the CUDA context


def _run_worker(path: str, names: list[str], timeout: float) -> tuple[list[dict[str, Any]], int, str]:
    env = dict(os.environ)
    env["CUDA_LAUNCH_BLOCKING"] = "1"
    env[_capsule.ENV_OFF] = "0"  # the replay's own failures are not captured again
    proc = subprocess.run(
        [sys.executable, "-m", WORKER, path, *names], capture_output=True, text=True, timeout=timeout, env=env
    )
    results = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                results.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return results, proc.returncode, proc.stderr


def run_variants(path: str, timeout: float = 600.0) -> tuple[list[dict[str, Any]], str]:
    """Every variant's result ({"name", "status", "detail"}), each process starting afresh
    after one that broke the context; and the workers' stderr."""
    pending, results, errors = list(VARIANTS), [], []
    while pending:
        got, code, stderr = _run_worker(path, pending, timeout)
        errors.append(stderr)
        results += got
        done = {r["name"] for r in got}
        rest = [name for name in pending if name not in done]
        if code == _CONTEXT_BROKEN and got and len(rest) < len(pending):
            pending = rest
            continue
        for name in rest:  # the worker died without a word on these
            results.append(
                {
                    "name": name,
                    "status": "not run",
                    "detail": f"the replay process exited with status {code}: "
                    f"{(stderr.strip().splitlines() or [''])[-1][:300]}",
                }
            )
        break
    order = {name: i for i, name in enumerate(VARIANTS)}
    return sorted(results, key=lambda r: order.get(r["name"], len(order))), "".join(errors)


def _call_text(call: dict[str, Any]) -> str:
    return (
        f"{call.get('routine')} transa={call.get('transa')} transb={call.get('transb')} m={call.get('m')} "
        f"n={call.get('n')} k={call.get('k')} lda={call.get('lda')} ldb={call.get('ldb')} "
        f"ldc={call.get('ldc')} alpha={call.get('alpha')} beta={call.get('beta')} {call.get('dtype')}, "
        f"math mode {call.get('math_mode')}"
    )


def _env_text(env: dict[str, Any]) -> str:
    libs = env.get("libraries") or {}

    def lib(name: str) -> str:
        entry = libs.get(name)
        if not isinstance(entry, list):
            return f"{name} {entry or 'not loaded'}"
        return ", ".join(f"{name} {e.get('version')} ({e.get('path')})" for e in entry)

    gpu = env.get("gpu") or {}
    return (
        f"torch {env.get('torch')} (built with CUDA {env.get('torch_cuda') or 'none'}), CUDA runtime "
        f"{env.get('cuda_runtime')}, driver {env.get('driver')}, {lib('libcublas')}, {lib('libcublasLt')}, "
        f"GPU {gpu.get('name', 'none')} (compute capability {gpu.get('compute_capability', '-')}), "
        f"torch arch list {' '.join(env.get('torch_arch_list') or []) or '-'}"
    )


def verdict(data: dict[str, Any], variants: list[dict[str, Any]]) -> tuple[bool, str]:
    """(reproduced, the text a person acts on) for a capsule and its variants' results."""
    call = data.get("call") or {}
    first = next((v for v in variants if v["name"] == "as recorded"), None)
    reproduced = first is not None and first["status"] == "failed"
    passed = [v["name"] for v in variants if v["status"] == "passed" and v["name"] != "as recorded"]
    failed = [v["name"] for v in variants if v["status"] == "failed" and v["name"] != "as recorded"]
    synthetic = bool(call) and data.get("values") != "values"
    lines = []
    where = f"layer {data.get('layer')!r}, {data.get('phase')}, call {data.get('call_number')}"
    original = f"{data.get('status_name') or data.get('error_class')}"
    if synthetic:
        lines.append(
            "note: the operands' values are not in this capsule "
            f"({data.get('values')}): the replay ran on synthetic values of the recorded layout"
        )
    if call.get("source") == "planned":
        lines.append(
            "note: the error was raised around the GEMM, not by it: the replay runs the GEMM this "
            "call was about to run, planned from its operands' shapes (contiguous layout)"
        )
    if reproduced:
        lines.append(
            f"REPRODUCED: the GEMM fails by itself on this stack ({first.get('detail')}); "
            f"it was {original} at {where}."
        )
        lines.append(
            "variants that pass: "
            + (", ".join(passed) or "none")
            + "; that fail too: "
            + (", ".join(failed) or "none")
        )
        lines.append("what to try:")
        if "TF32 flipped" in passed:
            lines.append(
                "  - the call passes with TF32 flipped: set torch.backends.cuda.matmul.allow_tf32 "
                "accordingly, and report the failing math mode to NVIDIA"
            )
        if "other routine" in passed or "cublasLt" in passed:
            lines.append(
                "  - another routine computes it: a cuBLAS bug for this routine and shape; the "
                "cuBLAS wheel that matches torch (pip install nvidia-cublas==<torch's version>) "
                "often has the fix"
            )
        if "no workspace" in passed:
            lines.append(
                "  - it passes without a workspace: try CUBLAS_WORKSPACE_CONFIG=:0:0 or a "
                "smaller one (:4096:8)"
            )
        if "contiguous copies" in passed:
            lines.append(
                "  - contiguous operands pass: make the input contiguous (x.contiguous()) before the layer"
            )
        lines.append(
            "  - install the nvidia-cublas wheel matching the CUDA torch was built with, and "
            "run `python -m cublas_guard_ext doctor`"
        )
        lines.append(
            "  - check TORCH_CUDA_ARCH_LIST covers this GPU; try the call on another GPU to rule out the card"
        )
        lines.append("bug report (paste as is):")
        lines.append(
            f"  cuBLAS call fails in isolation with {original}: {_call_text(call)}; operand "
            f"alignments {', '.join(str((data.get('gemm_operands') or {}).get(n, {}).get('alignment')) for n in 'abc')}"
            f" bytes; variants passing: {', '.join(passed) or 'none'}; failing: {', '.join(failed) or 'none'}. "
            f"Environment: {_env_text(data.get('environment') or {})}. Replayed alone with "
            "CUDA_LAUNCH_BLOCKING=1 from a cublas_guard_ext capsule."
        )
    else:
        if first is None or first["status"] != "passed":
            lines.append(
                f"NOT RUN: {first.get('detail') if first else 'no result'}. The {original} at "
                f"{where} could not be replayed here; the capsule still has the facts "
                "(python -m cublas_guard_ext doctor --capsule compares them with a machine)."
            )
        else:
            lines.append(
                f"NOT REPRODUCED: the GEMM alone passes ({first.get('detail')}); the {original} "
                f"at {where} came from outside this GEMM: an earlier kernel (an out-of-range "
                "index in an embedding, a gather or a loss), memory pressure, or a transient or "
                "hardware fault."
            )
        lines.append("next steps:")
        lines.append(
            "  - rerun the failing run with CUDA_LAUNCH_BLOCKING=1: the kernel that really "
            "failed raises at its own line"
        )
        lines.append(
            "  - run it under compute-sanitizer (compute-sanitizer --tool memcheck python ...) "
            "to find an out-of-bounds access"
        )
        lines.append("  - wrap the model in cublas_guard_ext.watch(model): it names the op that failed")
        lines.append(
            "  - check the GPU's health (nvidia-smi -q: ECC errors, temperature) if it recurs "
            "at random places"
        )
    skipped = [f"{v['name']} ({v.get('detail')})" for v in variants if v["status"] == "not applicable"]
    if skipped:
        lines.append("not applicable here: " + "; ".join(skipped))
    return reproduced, "\n".join(lines)


def replay(path: str | os.PathLike, timeout: float = 600.0) -> dict[str, Any]:
    """Replays a capsule; returns {"reproduced", "verdict", "variants", "call", ...}."""
    path = str(path)
    data = _capsule.load(path)
    if data.get(_scaled.KEY) or data.get(_scaled.CAST_KEY):  # FP8: the scaled GEMM or the cast alone
        variants = _run_worker(path, ["as recorded"], timeout)[0]
        reproduced, text = _scaled.verdict(data, variants[0] if variants else None)
    else:
        variants, stderr = run_variants(path, timeout)
        reproduced, text = verdict(data, variants)
    return {
        "capsule": path,
        "ran": any(v["name"] == "as recorded" and v["status"] in ("passed", "failed") for v in variants),
        "reproduced": reproduced,
        "verdict": text,
        "variants": variants,
        "call": data.get("call"),
        "values": data.get("values"),
        "error": {
            "class": data.get("error_class"),
            "status": data.get("status"),
            "status_name": data.get("status_name"),
            "layer": data.get("layer"),
            "phase": data.get("phase"),
            "call_number": data.get("call_number"),
        },
    }


def render(result: dict[str, Any]) -> str:
    lines = [f"cublas_guard_ext replay {result['capsule']}"]
    if result.get("call"):
        lines.append(f"  call: {_call_text(result['call'])} ({result['call'].get('source')})")
    for v in result["variants"]:
        lines.append(f"  [{v['status']:>14}] {v['name']}: {v.get('detail', '')}")
    lines.append("")
    lines.append(result["verdict"])
    return "\n".join(lines)


def main(path: str, as_json: bool = False) -> int:
    try:
        result = replay(path)
    except _capsule.CapsuleFileError as err:
        print(f"cublas_guard_ext replay: cannot read {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as err:
        print(f"cublas_guard_ext replay: cannot read {path}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str) if as_json else render(result))
    return 0 if result["ran"] else 1
