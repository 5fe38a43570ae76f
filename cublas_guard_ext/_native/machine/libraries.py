"""Which file each CUDA library of this process was mapped from, every other copy of it on
the machine, and the conflicts between them (what ``doctor``, the capsule and a
``CublasError`` say about the loaded libraries).

The 2026 reports of cuBLAS failures with a root cause are mostly about *which copy* of a
library got loaded, not which version is installed: pip's libcublas finds libcublasLt
through its RUNPATH, and ld.so searches RPATH, then ``LD_LIBRARY_PATH``, then RUNPATH, so a
system CUDA on ``LD_LIBRARY_PATH`` supplies libcublasLt next to the pip libcublas (pytorch
#170676); a process that loaded one copy by name and another by path holds both. The
facts come from ``/proc/self/maps`` (what is mapped), the pip metadata's RECORD files (who
installed a file), ``LD_LIBRARY_PATH``, ``CUDA_HOME``, site-packages and ``ldconfig -p``
(where other copies lie). Every function is best effort and never raises: an unreadable
fact is reported as unknown.

``quick_conflicts`` is the cheap part (the maps and ``LD_LIBRARY_PATH`` only) that an
error reads when it is built; ``snapshot`` is everything, for the doctor and the capsule.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# The libraries followed, by key: a file name pattern each (the project's own library is
# matched by its path, see mapped()). libcudnn is the front library only (libcudnn.so.9),
# not its sub-libraries; libnvrtc not its builtins.
LIBRARY_PATTERNS = {
    "libcudart": re.compile(r"^libcudart\.so(\.\d+)*$"),
    "libcublas": re.compile(r"^libcublas\.so(\.\d+)*$"),
    "libcublasLt": re.compile(r"^libcublasLt\.so(\.\d+)*$"),
    "libnvrtc": re.compile(r"^libnvrtc\.so(\.\d+)*$"),
    "libcudnn": re.compile(r"^libcudnn\.so(\.\d+)*$"),
}
OWN_LIBRARY = "cublas_guard_ext"
LIBRARY_KEYS = (*LIBRARY_PATTERNS, OWN_LIBRARY)


def _library_key(path: str) -> str | None:
    name = os.path.basename(path)
    return next((key for key, pattern in LIBRARY_PATTERNS.items() if pattern.match(name)), None)


def _maps_text() -> str:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return maps.read()
    except OSError:
        return ""


def _loaded_handle(path: str) -> ctypes.CDLL | None:
    """A handle on ``path`` only if it is already loaded (RTLD_NOLOAD: never a new load,
    also when the file at that path was replaced on disk since, e.g. by a pip upgrade)."""
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):
        return None


# Real paths of mapped files, per process: every failing call's capsule asks for the whole
# map (112 files under a CUDA torch: ~1,100 lstat calls a time otherwise).
_real_path = functools.lru_cache(maxsize=4096)(os.path.realpath)


def mapped(own_path: str | None = None, maps_text: str | None = None) -> dict[str, list[str]]:
    """The files each followed library is mapped from in this process: key -> paths (one
    per distinct file, in map order). More than one path for a key is a library mapped twice."""
    own = os.path.realpath(own_path) if own_path else None
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for line in (maps_text if maps_text is not None else _maps_text()).splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].strip().removesuffix(" (deleted)")  # replaced on disk since it was mapped
        if path in seen:
            continue
        seen.add(path)
        key = OWN_LIBRARY if own and _real_path(path) == own else _library_key(path)
        if key is not None:
            out.setdefault(key, []).append(path)
    return out


def ld_library_path_entries(value: str | None = None) -> list[str]:
    value = os.environ.get("LD_LIBRARY_PATH", "") if value is None else value
    return [entry for entry in value.split(":") if entry]


def supplying_entry(path: str, entries: list[str]) -> str | None:
    """The ``LD_LIBRARY_PATH`` entry (as written there) whose folder holds ``path``."""
    folder = os.path.realpath(os.path.dirname(path))
    for entry in entries:
        if os.path.realpath(entry) == folder:
            return entry
    return None


@functools.lru_cache(maxsize=1)
def _file_owners() -> dict[str, str]:
    """Real path of every shared library a pip distribution installed -> "name version",
    from the RECORD files (read once per process; only nvidia wheels, cuda-toolkit, torch
    and this project install the libraries followed here)."""
    owners: dict[str, str] = {}
    try:
        from importlib import metadata

        for dist in metadata.distributions():
            name = (dist.metadata.get("Name") or "").lower()
            if not name.startswith(("nvidia-", "torch", "cublas-guard", "cublas_guard")):
                continue
            for file in dist.files or []:
                if ".so" in file.name:
                    owners.setdefault(os.path.realpath(dist.locate_file(file)), f"{name} {dist.version}")
    except Exception:  # a diagnostic never raises
        pass
    return owners


def distribution_of(path: str) -> str | None:
    """The pip distribution ("nvidia-cublas 13.1.1.3") that installed ``path``, if any."""
    return _file_owners().get(os.path.realpath(path))


def _query_version(key: str, path: str) -> str | None:
    """The version a mapped library reports about itself (ctypes on an already mapped file
    returns the same handle: nothing new is loaded). Never called on an unmapped copy."""
    lib = _loaded_handle(path)
    if lib is None:
        return None
    try:
        if key == "libcublasLt":
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            v = int(lib.cublasLtGetVersion())
            return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
        if key == "libcublas":
            parts = []
            for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
                value = ctypes.c_int(0)
                if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                    return None
                parts.append(str(value.value))
            return ".".join(parts)
        if key == "libcudart":
            value = ctypes.c_int(0)
            if lib.cudaRuntimeGetVersion(ctypes.byref(value)) != 0:
                return None
            return f"{value.value // 1000}.{value.value % 1000 // 10}"
        if key == "libnvrtc":
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
                return None
            return f"{major.value}.{minor.value}"
        if key == "libcudnn":
            lib.cudnnGetVersion.restype = ctypes.c_size_t
            v = int(lib.cudnnGetVersion())
            return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    except (OSError, AttributeError, ValueError):
        return None
    return None


def file_version(path: str) -> str | None:
    """The version in a library's file name (``libcublas.so.13.1.1`` -> 13.1.1), if any."""
    match = re.search(r"\.so\.([\d.]+)$", path)
    return match.group(1) if match else None


def exports(path: str, symbol: str) -> bool | None:
    """Whether a *mapped* library exports ``symbol`` (None if it cannot be asked)."""
    lib = _loaded_handle(path)
    return None if lib is None else hasattr(lib, symbol)


# ---------------------------------------------------------------------------
# Other copies: LD_LIBRARY_PATH, CUDA_HOME, site-packages, the linker cache
# ---------------------------------------------------------------------------
def _ldconfig_entries() -> list[str]:
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if ldconfig is None:
        return []
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.rsplit("=> ", 1)[1].strip() for line in out.splitlines() if "=> " in line]


def search_folders() -> list[tuple[str, str]]:
    """(folder, where it comes from) for every place a copy may lie, in ld.so's spirit:
    LD_LIBRARY_PATH first, then CUDA_HOME's, then pip's nvidia wheels and torch's lib."""
    folders: list[tuple[str, str]] = [(e, "LD_LIBRARY_PATH") for e in ld_library_path_entries()]
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(variable)
        if root:
            folders += [(os.path.join(root, lib), variable) for lib in ("lib64", "lib")]
    folders += [(os.path.join("/usr/local/cuda", lib), "/usr/local/cuda") for lib in ("lib64", "lib")]
    bases = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    for base in dict.fromkeys(bases):
        for pattern in ("nvidia/*/lib", "nvidia/*/*/lib", "torch/lib"):
            folders += [
                (folder, "site-packages") for folder in sorted(glob.glob(os.path.join(base, pattern)))
            ]
    return folders


def installed_copies(keys: tuple[str, ...] = tuple(LIBRARY_PATTERNS)) -> dict[str, list[dict[str, Any]]]:
    """Every copy of the followed libraries found on the machine: key -> [{path, source}],
    one entry per distinct file (its first place in the search order)."""
    out: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()

    def add(path: str, source: str) -> None:
        key = _library_key(path)
        real = os.path.realpath(path)
        if key in keys and real not in seen and os.path.isfile(real):
            seen.add(real)
            out.setdefault(key, []).append({"path": path, "source": source})

    for folder, source in search_folders():
        for path in sorted(glob.glob(os.path.join(folder, "lib*.so*"))):
            add(path, source)
    for path in _ldconfig_entries():
        add(path, "ldconfig -p")
    return out


# ---------------------------------------------------------------------------
# Conflicts
# ---------------------------------------------------------------------------
def preload_fix(folder: str, lt_name: str = "libcublasLt.so.13", lib_name: str = "libcublas.so.13") -> str:
    """The lines that make libcublas and libcublasLt both come from ``folder``: loaded by
    path, libcublasLt first, with RTLD_GLOBAL, before torch."""
    return (
        "import ctypes\n"
        f'ctypes.CDLL("{os.path.join(folder, lt_name)}", mode=ctypes.RTLD_GLOBAL)\n'
        f'ctypes.CDLL("{os.path.join(folder, lib_name)}", mode=ctypes.RTLD_GLOBAL)\n'
        "import torch"
    )


def _origin(path: str, entries: list[str], owner=distribution_of) -> str:
    entry = supplying_entry(path, entries)
    if entry is not None:
        return f"from LD_LIBRARY_PATH's entry {entry}"
    dist = owner(path)
    return f"pip's {dist}" if dist else "not from a pip wheel"


def _pip_side(paths: list[str], entries: list[str], owner) -> str | None:
    """Of several copies, the one that is not on LD_LIBRARY_PATH and a pip wheel installed."""
    for path in paths:
        if supplying_entry(path, entries) is None and owner(path):
            return path
    for path in paths:
        if supplying_entry(path, entries) is None:
            return path
    return None


def _unset_fix(stray_entries: list[str], entries: list[str]) -> str:
    rest = [e for e in entries if e not in stray_entries]
    if not rest:
        return "unset LD_LIBRARY_PATH"
    return f"export LD_LIBRARY_PATH={':'.join(rest)}   # without {', '.join(stray_entries)}"


def conflicts(
    loaded: dict[str, list[str]],
    entries: list[str] | None = None,
    owner=distribution_of,
) -> list[dict[str, Any]]:
    """The real conflicts among the loaded libraries, each a dict: ``kind``
    (``mapped_twice`` | ``split_cublas``), ``library``, ``paths``, ``stray`` (the copy that
    should not be there), ``ld_library_path_entry`` (the entry that supplied it, or None),
    ``message`` and ``fix`` (ready to paste). Pure: the facts come in as arguments."""
    entries = ld_library_path_entries() if entries is None else entries
    out: list[dict[str, Any]] = []
    for key in LIBRARY_KEYS:
        paths = loaded.get(key) or []
        if len(paths) < 2:
            continue
        keep = _pip_side(paths, entries, owner) or paths[0]
        strays = [p for p in paths if p != keep]
        stray_entries = [e for e in (supplying_entry(p, entries) for p in strays) if e]
        fix = _unset_fix(stray_entries, entries) if stray_entries else "load one copy only"
        if key in ("libcublas", "libcublasLt"):
            fix += "; or preload the pip copies before torch:\n" + preload_fix(os.path.dirname(keep))
        out.append(
            {
                "kind": "mapped_twice",
                "library": key,
                "paths": paths,
                "stray": strays[0],
                "ld_library_path_entry": stray_entries[0] if stray_entries else None,
                "message": f"{key} is mapped twice in this process: "
                + ", ".join(f"{p} ({_origin(p, entries, owner)})" for p in paths)
                + "; calls may go to either copy",
                "fix": fix,
            }
        )
    lib, lt = loaded.get("libcublas") or [], loaded.get("libcublasLt") or []
    if lib and lt:
        lib_folder = os.path.realpath(os.path.dirname(lib[0]))
        apart = [p for p in lt if os.path.realpath(os.path.dirname(p)) != lib_folder]
        if apart:
            # The stray side: the copy on LD_LIBRARY_PATH, else the one no pip wheel installed.
            if supplying_entry(lib[0], entries) and not supplying_entry(apart[0], entries):
                stray, keep_folder = lib[0], os.path.dirname(apart[0])
            else:
                stray, keep_folder = apart[0], os.path.dirname(lib[0])
            entry = supplying_entry(stray, entries)
            fix = (_unset_fix([entry], entries) + "; or " if entry else "") + (
                "preload the pip copies before torch:\n" + preload_fix(keep_folder)
            )
            out.append(
                {
                    "kind": "split_cublas",
                    "library": "libcublasLt" if stray in apart else "libcublas",
                    "paths": [lib[0], *apart],
                    "stray": stray,
                    "ld_library_path_entry": entry,
                    "message": f"libcublas and libcublasLt come from different folders: libcublas "
                    f"{lib[0]} ({_origin(lib[0], entries, owner)}), libcublasLt {apart[0]} "
                    f"({_origin(apart[0], entries, owner)})"
                    + (
                        f"; ld.so searches LD_LIBRARY_PATH ({entry}) before libcublas's RUNPATH, so "
                        "the stray copy won"
                        if entry
                        else ""
                    )
                    + " (pytorch #170676)",
                    "fix": fix,
                }
            )
    return out


_MAPPED_FILE = re.compile(r" (/[^\n]*)$", re.MULTILINE)  # a maps line's path, when it is a file


def mapped_files(maps_text: str | None = None) -> tuple[str, ...]:
    """Every file mapped into this process, once each, in map order: one regex pass (what
    the cached facts are keyed on; the heap's and anonymous mappings' addresses move without
    any library changing, so the maps' whole text would not do)."""
    return tuple(dict.fromkeys(_MAPPED_FILE.findall(_maps_text() if maps_text is None else maps_text)))


# The last quick_conflicts() answer and what it was read from (the files mapped, LD_LIBRARY_PATH):
# every error's constructor asks, and classifying each mapped file cost ~1.5 ms a time.
_QUICK: tuple[tuple, list[dict[str, Any]]] | None = None


def quick_conflicts() -> list[dict[str, Any]]:
    """The conflicts from the maps and LD_LIBRARY_PATH alone (no metadata scan, no ldconfig):
    cheap enough for an error's constructor. Never raises."""
    global _QUICK
    try:
        text = _maps_text()
        key = (mapped_files(text), os.environ.get("LD_LIBRARY_PATH"))
        if _QUICK is None or _QUICK[0] != key:
            _QUICK = (key, conflicts(mapped(maps_text=text), owner=lambda _path: None))
        return copy.deepcopy(_QUICK[1])
    except Exception:  # the error path must not fail
        return []


# ---------------------------------------------------------------------------
# cuBLAS wheels of two CUDA majors in one environment
# ---------------------------------------------------------------------------
def cublas_distributions(path: list[str] | None = None) -> list[dict[str, Any]]:
    """Installed cuBLAS wheels: [{name, version, cuda_major}] (nvidia-cublas-cu12 is CUDA 12;
    the unsuffixed nvidia-cublas carries its CUDA major in its version).

    Only the ``*.dist-info`` / ``*.egg-info`` folders named like a cuBLAS wheel are read: every
    error's capsule asks, and parsing all of an environment's metadata (a hundred wheels) cost
    ~45 ms per failing call, where listing the folders costs well under one."""
    out = []
    try:
        from importlib import metadata

        for folder in sys.path if path is None else path:
            try:
                names = os.listdir(folder or ".")
            except OSError:  # a zip on sys.path, a folder gone
                continue
            for entry in names:
                stem, dot, suffix = entry.rpartition(".")
                if suffix not in ("dist-info", "egg-info") or not dot:
                    continue
                if not re.sub(r"[-.]+", "_", stem.lower()).startswith("nvidia_cublas"):
                    continue
                dist = metadata.PathDistribution(Path(folder or ".", entry))
                name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
                match = re.fullmatch(r"nvidia-cublas(?:-cu(\d+))?", name)
                if match:
                    major = match.group(1) or dist.version.split(".")[0]
                    out.append({"name": name, "version": dist.version, "cuda_major": int(major)})
    except Exception:  # a diagnostic never raises
        pass
    return sorted(out, key=lambda d: (d["cuda_major"], d["name"]))


def mixed_cuda_majors(dists: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The conflict of cuBLAS wheels of two CUDA majors installed together, or None."""
    majors = sorted({d["cuda_major"] for d in dists})
    if len(majors) < 2:
        return None
    listed = ", ".join(f"{d['name']} {d['version']} (CUDA {d['cuda_major']})" for d in dists)
    keep = majors[-1]
    drop = " ".join(d["name"] for d in dists if d["cuda_major"] != keep)
    return {
        "kind": "cuda_majors_mixed",
        "library": "libcublas",
        "paths": [],
        "stray": None,
        "ld_library_path_entry": None,
        "message": f"cuBLAS wheels of CUDA {' and '.join(map(str, majors))} are installed together: {listed} "
        "(an EXECUTION_FAILED with both: vllm-omni PR #3327)",
        "fix": f"pip uninstall {drop}   # keep the CUDA {keep} wheel your torch pins",
    }


# ---------------------------------------------------------------------------
# Everything, for the doctor and the capsule
# ---------------------------------------------------------------------------
def snapshot(own_path: str | None = None, with_installed: bool = True) -> dict[str, Any]:
    """The loaded libraries (per key: path, folder, version, pip distribution, the
    LD_LIBRARY_PATH entry that supplied it), every other copy installed, the cuBLAS wheels
    and the conflicts. Plain data (the doctor's ``--json``, the capsule's environment)."""
    entries = ld_library_path_entries()
    loaded_paths = mapped(own_path)
    loaded: dict[str, list[dict[str, Any]]] = {}
    for key in LIBRARY_KEYS:
        loaded[key] = [
            {
                "path": path,
                "folder": os.path.dirname(path),
                "version": (_query_version(key, path) if key != OWN_LIBRARY else None) or file_version(path),
                "distribution": distribution_of(path),
                "ld_library_path_entry": supplying_entry(path, entries),
            }
            for path in loaded_paths.get(key, [])
        ]
    out: dict[str, Any] = {
        "loaded": loaded,
        "ld_library_path": entries,
        "cublas_distributions": cublas_distributions(),
    }
    found = conflicts(loaded_paths, entries)
    mixed = mixed_cuda_majors(out["cublas_distributions"])
    if mixed:
        found.append(mixed)
    out["conflicts"] = found
    if with_installed:
        loaded_real = {os.path.realpath(p) for paths in loaded_paths.values() for p in paths}
        out["installed"] = {
            key: [
                {
                    **copy,
                    "distribution": distribution_of(copy["path"]),
                    "loaded": os.path.realpath(copy["path"]) in loaded_real,
                }
                for copy in copies
            ]
            for key, copies in installed_copies().items()
        }
    return out
