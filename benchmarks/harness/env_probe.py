"""The machine a benchmark ran on: CPU, memory, scheduling policy, torch, git, GPU.

Recorded with every run (results.json, the RESULTS.md section) because the figures mean little
without it: on this project's shared 2-core machine the load average and the scheduling policy
(`chrt`) change the small-case figures more than any code change does.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path

import torch

GIB = 1 << 30
MIB = 1 << 20


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "unknown"


def _sched_policy() -> str:
    """The process's scheduling policy: SCHED_FIFO/RR when run under `chrt` on a shared machine."""
    try:
        policy = os.sched_getscheduler(0)
    except (AttributeError, OSError):
        return "unknown"
    names = {
        getattr(os, n): n
        for n in ("SCHED_OTHER", "SCHED_FIFO", "SCHED_RR", "SCHED_BATCH", "SCHED_IDLE")
        if hasattr(os, n)
    }
    name = names.get(policy, str(policy))
    if name in ("SCHED_FIFO", "SCHED_RR"):
        name += f" priority {os.sched_getparam(0).sched_priority}"
    return name


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(device: torch.device) -> dict:
    import cublas_guard_ext._native.loading.loader as loader

    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory": _mem_total(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "loadavg_start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "scheduling": _sched_policy(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    info = loader.info()
    env["extension"] = f"{info.kind} ({'with' if info.has_cuda_kernels else 'without'} CUDA kernels)"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_cc"] = f"{props.major}.{props.minor}"
        env["gpu_memory"] = f"{props.total_memory / GIB:.0f} GiB"
        env["gpu_l2"] = f"{getattr(props, 'L2_cache_size', 0) / MIB:.0f} MiB"
        try:
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else ""
        except (OSError, subprocess.SubprocessError):
            env["nvidia_smi"] = ""
        # cuBLAS as loaded at run time (the extension's build facts; "?" when it cannot say).
        try:
            from cublas_guard_ext._native.machine import facts

            env["cublas"] = facts.native_build_info().get("cublas_runtime_version") or "?"
        except Exception:  # noqa: BLE001 (a report line, never a failure)
            env["cublas"] = "?"
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception:  # noqa: BLE001 (optional)
            env["triton"] = None
    return env
