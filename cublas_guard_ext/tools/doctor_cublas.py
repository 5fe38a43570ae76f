"""The doctor's checks for 2026's causes of CUBLAS_STATUS_EXECUTION_FAILED / NOT_SUPPORTED
reports (the cuBLAS wheel and libraries, the GPU's arch, workspace settings) and the
comparison of a capsule's machine with this one. Part of ``doctor`` (tools/doctor.py, which
re-exports these names); each check is a function of the facts it is given, so the tests
fake them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .._native.building import toolkit
from .._native.machine.facts import FAIL, OK, SKIP, WARN
from ..capsule import contents as _capsule


@dataclass
class Check:
    """One item of the doctor's checklist."""

    name: str
    status: str  # OK | WARN | FAIL | SKIP (could not be checked here)
    reason: str
    fix: str = ""


# ---------------------------------------------------------------------------
# 2026's causes of CUBLAS_STATUS_EXECUTION_FAILED / NOT_SUPPORTED reports
# ---------------------------------------------------------------------------
def cublas_facts() -> dict[str, Any]:
    """The facts the 2026 checks read: the nvidia-cublas wheel torch pins (directly, or through
    the ``cuda-toolkit[cublas,...]`` meta-package torch 2.14+ pins) and the one installed,
    the libcublas/libcublasLt versions actually loaded."""
    out: dict[str, Any] = {"torch_requires": None, "installed": None, "loaded": {}}
    try:
        from importlib import metadata

        pins = toolkit.torch_cuda_pins()
        for name in ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas-cu11"):
            if name in pins:
                out["torch_requires"] = {"name": name, "version": pins[name]}
                if "cuda-toolkit" in pins:
                    out["torch_requires"]["via"] = f"cuda-toolkit=={pins['cuda-toolkit']}"
                break
        else:
            if "cuda-toolkit" in pins:  # pinned, but cuda-toolkit's own metadata is not installed
                out["torch_requires"] = {"name": "cuda-toolkit[cublas]", "version": pins["cuda-toolkit"]}
        name = (out["torch_requires"] or {}).get("name")
        for candidate in ([name] if name else []) + [
            "nvidia-cublas",
            "nvidia-cublas-cu12",
            "nvidia-cublas-cu13",
        ]:
            try:
                out["installed"] = {"name": candidate, "version": metadata.version(candidate)}
                break
            except (metadata.PackageNotFoundError, ValueError):
                continue
    except Exception:  # a diagnostic never raises
        pass
    for key, entries in _capsule.loaded_cublas().items():
        if isinstance(entries, list) and entries:
            out["loaded"][key] = entries[0]["version"]
    return out


def _version_tuple(text: Any, parts: int = 3) -> tuple[int, ...] | None:
    numbers = re.findall(r"\d+", str(text or ""))
    return tuple(int(n) for n in numbers[:parts]) if numbers else None


def _workspace_config_parts(config: str) -> list[tuple[int, int]] | None:
    if not re.fullmatch(r"(:\d+:\d+)+", config.strip()):
        return None
    return [(int(a), int(b)) for a, b in re.findall(r":(\d+):(\d+)", config)]


def checks_2026(env: dict[str, Any]) -> list[Check]:
    """The wheel torch pins vs the one installed and loaded, libcublas vs libcublasLt, GPUs
    CUDA 13 dropped, workspace settings on Hopper and newer."""
    out: list[Check] = []
    cublas = env.get("cublas")
    if cublas is not None:  # the library facts (cublas_facts(); main() gathers them)
        out += _library_checks(env, cublas)
    out += _gpu_and_workspace_checks(env)
    return out


def _library_checks(env: dict[str, Any], cublas: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    required, installed, loaded = (
        cublas.get("torch_requires"),
        cublas.get("installed"),
        cublas.get("loaded") or {},
    )
    if not env.get("torch_cuda"):
        out.append(
            Check(
                "cuBLAS wheel vs torch", SKIP, f"not applicable: torch {env.get('torch')} is a CPU-only build"
            )
        )
    elif not required:
        out.append(
            Check(
                "cuBLAS wheel vs torch",
                SKIP,
                "could not check: torch's metadata pins neither an nvidia-cublas wheel nor "
                "cuda-toolkit[cublas] (a conda or system CUDA install)",
            )
        )
    elif required["name"].startswith("cuda-toolkit"):
        out.append(
            Check(
                "cuBLAS wheel vs torch",
                WARN,
                f"torch pins cuda-toolkit=={required['version']}, whose metadata (the nvidia-cublas "
                "version it means) is not installed",
                f'pip install "cuda-toolkit[cublas]=={required["version"]}"',
            )
        )
    else:
        want = _version_tuple(required["version"])
        have = _version_tuple((installed or {}).get("version"))
        running = _version_tuple(loaded.get("libcublas"))
        fix = f"pip install {required['name']}=={required['version']}"
        if have is None:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    WARN,
                    f"torch pins {required['name']}=={required['version']} but it is not installed",
                    fix,
                )
            )
        elif have != want:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    FAIL,
                    f"{installed['name']} {installed['version']} is installed, torch was built with "
                    f"{required['version']}"
                    + (f" (pinned via {required['via']})" if required.get("via") else "")
                    + " (a mismatched cuBLAS is behind the 2026 EXECUTION_FAILED "
                    "reports fixed by upgrading it: pytorch/pytorch#174949, #180713)",
                    fix,
                )
            )
        elif running is not None and running != want[: len(running)]:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    FAIL,
                    f"the wheel matches torch ({required['version']}) but the libcublas loaded is "
                    f"{loaded.get('libcublas')}: another copy comes first (LD_LIBRARY_PATH?)",
                    "remove other CUDA libraries from LD_LIBRARY_PATH",
                )
            )
        else:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    OK,
                    f"{installed['name']} {installed['version']} as torch pins"
                    + (f" (via {required['via']})" if required.get("via") else "")
                    + (f", loaded {loaded['libcublas']}" if loaded.get("libcublas") else ""),
                )
            )
    lib, lt = loaded.get("libcublas"), loaded.get("libcublasLt")
    if lib and lt:
        same = _version_tuple(lib) == _version_tuple(lt)
        out.append(
            Check(
                "libcublas vs libcublasLt",
                OK if same else FAIL,
                f"libcublas {lib}, libcublasLt {lt}"
                + ("" if same else ": two releases mixed (every cuBLAS call goes through both)"),
                ""
                if same
                else "install one nvidia-cublas wheel and drop the other copy from LD_LIBRARY_PATH",
            )
        )
    else:
        out.append(
            Check(
                "libcublas vs libcublasLt",
                SKIP,
                "could not check: " + ("libcublas is not loaded" if not lib else "libcublasLt is not loaded"),
            )
        )
    return out


def _gpu_and_workspace_checks(env: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    cuda_major = (_version_tuple(env.get("torch_cuda"), 1) or (0,))[0]
    for device in env.get("devices") or [] if env.get("torch_cuda") else []:
        cc = _version_tuple(device.get("compute_capability"), 2)
        if not cc:
            continue
        name = f"GPU vs CUDA {cuda_major} (cuda:{device.get('index')})"
        arch = f"sm_{cc[0]}{cc[1] if len(cc) > 1 else 0}"
        listed = any(
            a.startswith(arch) or a == f"compute_{arch[3:]}" for a in env.get("torch_arch_list") or []
        )
        if cuda_major >= 13 and cc < (7, 5):
            out.append(
                Check(
                    name,
                    FAIL,
                    f"{device.get('name')} is compute capability {device.get('compute_capability')}: CUDA 13 "
                    "builds no longer cover GPUs below 7.5 (Maxwell, Pascal, Volta)",
                    "install a torch built with CUDA 12.x (e.g. the cu126 or cu128 wheels)",
                )
            )
        elif not listed:
            out.append(
                Check(
                    name,
                    WARN,
                    f"{arch} is not in torch's arch list {env.get('torch_arch_list')}",
                    "install a torch build whose arch list has this GPU, or build from source with "
                    f"TORCH_CUDA_ARCH_LIST={device.get('compute_capability')}",
                )
            )
        else:
            out.append(Check(name, OK, f"{arch} is supported and in torch's arch list"))
    config = (env.get("env") or {}).get("CUBLAS_WORKSPACE_CONFIG")
    lt_size = (env.get("env") or {}).get("CUBLASLT_WORKSPACE_SIZE")
    newest = max(
        (_version_tuple(d.get("compute_capability"), 2) or (0,) for d in env.get("devices") or []),
        default=None,
    )
    problems, fix = [], ""
    if config:
        parts = _workspace_config_parts(config)
        if parts is None:
            out.append(
                Check(
                    "cuBLAS workspace settings",
                    FAIL,
                    f"CUBLAS_WORKSPACE_CONFIG={config!r} is not ':SIZE_KiB:COUNT[:SIZE:COUNT...]'",
                    "fix it, e.g. CUBLAS_WORKSPACE_CONFIG=:4096:8, or unset it",
                )
            )
            return out
        if all(size == 0 for size, _ in parts):
            problems.append("CUBLAS_WORKSPACE_CONFIG gives cuBLAS no workspace at all")
        elif newest is not None and newest >= (9, 0) and max(size for size, _ in parts) < 32768:
            problems.append(
                f"CUBLAS_WORKSPACE_CONFIG={config} gives at most "
                f"{max(size for size, _ in parts) >> 10} MiB per call; cuBLAS on Hopper and "
                "newer (compute capability 9.0+) wants 32 MiB"
            )
            fix = "CUBLAS_WORKSPACE_CONFIG=:32768:2 (or unset it: torch's default is 32 MiB there)"
    if lt_size:
        if not lt_size.strip().isdigit():
            problems.append(f"CUBLASLT_WORKSPACE_SIZE={lt_size!r} is not a size in KiB")
        elif newest is not None and newest >= (9, 0) and int(lt_size) < 32768:
            problems.append(
                f"torch's cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE={lt_size} KiB) is below "
                "the 32 MiB cuBLASLt wants on compute capability 9.0+"
            )
            fix = fix or "raise CUBLASLT_WORKSPACE_SIZE to 32768, or unset it"
    if problems:
        out.append(
            Check(
                "cuBLAS workspace settings",
                WARN,
                "; ".join(problems),
                fix or "unset CUBLAS_WORKSPACE_CONFIG to give cuBLAS its default workspace",
            )
        )
    else:
        out.append(
            Check(
                "cuBLAS workspace settings",
                OK,
                "defaults"
                if not (config or lt_size)
                else f"CUBLAS_WORKSPACE_CONFIG={config}, CUBLASLT_WORKSPACE_SIZE={lt_size}",
            )
        )
    return out


# The capsule's environment facts compared with this machine's, by name.
_CAPSULE_FACTS = (
    ("torch", lambda e: e.get("torch")),
    ("torch's CUDA", lambda e: e.get("torch_cuda")),
    ("CUDA runtime", lambda e: e.get("cuda_runtime")),
    ("driver", lambda e: e.get("driver")),
    ("libcublas", lambda e: _lib_versions(e, "libcublas")),
    ("libcublasLt", lambda e: _lib_versions(e, "libcublasLt")),
    *(
        (f"{key} file", lambda e, key=key: _loaded_paths(e, key))
        for key in ("libcudart", "libcublas", "libcublasLt", "libnvrtc", "libcudnn")
    ),
    (
        "library conflicts",
        lambda e: "; ".join((e.get("loaded_libraries") or {}).get("conflicts") or []) or None,
    ),
    ("GPU", lambda e: (e.get("gpu") or {}).get("name")),
    ("compute capability", lambda e: (e.get("gpu") or {}).get("compute_capability")),
    ("torch arch list", lambda e: " ".join(e.get("torch_arch_list") or [])),
    ("TF32", lambda e: (e.get("tf32") or {}).get("allow_tf32")),
    ("extension build", lambda e: (e.get("extension") or {}).get("kind")),
)


def _loaded_paths(env: dict[str, Any], key: str) -> str | None:
    """The files a library was mapped from, as the capsule or this machine records them."""
    copies = ((env.get("loaded_libraries") or {}).get("loaded") or {}).get(key) or []
    return ", ".join(c.get("path", "?") for c in copies) or None


def _lib_versions(env: dict[str, Any], key: str) -> str:
    entry = (env.get("libraries") or {}).get(key)
    return ", ".join(str(e.get("version")) for e in entry) if isinstance(entry, list) else str(entry)


def capsule_checks(recorded: dict[str, Any], here: dict[str, Any]) -> list[Check]:
    """This machine against a capsule's environment: one WARN per fact that differs."""
    out = []
    for name, get in _CAPSULE_FACTS:
        then, now = get(recorded), get(here)
        if then != now:
            out.append(
                Check(
                    f"capsule: {name}",
                    WARN,
                    f"the capsule's {then!r}, here {now!r}",
                    "replay the capsule on the machine it came from, or expect a different result",
                )
            )
    variables = sorted(set(recorded.get("env") or {}) | set(here.get("env") or {}))
    for var in variables:
        then, now = (recorded.get("env") or {}).get(var), (here.get("env") or {}).get(var)
        if then != now:
            out.append(
                Check(
                    f"capsule: {var}",
                    WARN,
                    f"the capsule's {then!r}, here {now!r}",
                    f"set {var} as the capsule had it to compare like with like",
                )
            )
    if not out:
        out.append(Check("capsule environment", OK, "this machine matches the capsule's environment"))
    return out
