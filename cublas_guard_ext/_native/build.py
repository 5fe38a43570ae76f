"""Build configuration shared by ``setup.py`` and the JIT loader.

One source of truth for the source list, the compiler flags and the decision
"build the CUDA kernels or not". ``setup.py`` loads this file by path, so it
must not import the package (which would try to load the extension).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO


def _sibling(name: str):
    """A module of this folder, also when setup.py loaded this file by path (no package)."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    qualified = f"_cublas_guard_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


_toolkit = _sibling("toolkit")
# Used by setup.py, the loader and the tests under these names (defined in toolkit.py).
decide_cuda, cuda_fallback_note, record_cuda_failure, link_cudart_by_name = (
    _toolkit.decide_cuda,
    _toolkit.cuda_fallback_note,
    _toolkit.record_cuda_failure,
    _toolkit.link_cudart_by_name,
)

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # cublas_guard_ext/ (this file is in _native/)
CSRC_DIR = PACKAGE_DIR.parent / "csrc"

_sources = _sibling("sources")
# The sources, relative to CSRC_DIR (defined in sources.py).
CPU_SOURCES, CUDA_SOURCES = _sources.CPU_SOURCES, _sources.CUDA_SOURCES


@dataclass
class BuildPlan:
    """What to compile and how; ``with_cuda`` explains itself in ``reason``."""

    with_cuda: bool
    reason: str
    sources: list[str]
    cxx_flags: list[str]
    nvcc_flags: list[str]
    ldflags: list[str]
    include_dirs: list[str] = field(default_factory=list)
    # Linked before torch's own libraries, from library_dirs (see shared_cxx_runtime).
    libraries: list[str] = field(default_factory=list)
    library_dirs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Searched after every other include dir, the toolkit's and torch's too (GCC's
    # -idirafter; already in cxx_flags/nvcc_flags): the wheel headers the toolkit lacks.
    include_dirs_after: list[str] = field(default_factory=list)
    # Said before compiling (see announce_notes): e.g. nvcc's CUDA differs from torch's.
    notes: list[str] = field(default_factory=list)
    # The CUDA toolkit the build uses (a resolved fact: the JIT key names it) and its nvcc's
    # release; None for a CPU build.
    cuda_home: str | None = None
    nvcc_version: str | None = None
    # The CUDA runtime to link instead of torch's ``-lcudart`` (``:libcudart.so.13``) when
    # the toolkit has only the versioned file, as pip's has; None: torch's flag links.
    cudart_library: str | None = None


def _torch_version_macro() -> str:
    import torch

    # A bare token the C++ side stringifies; keep it to [A-Za-z0-9_.+].
    return re.sub(r"[^A-Za-z0-9_.+]", "_", torch.__version__)


_cxx_flags = _sibling("cxx_flags")
# Used by setup.py, .ci/ and the tests under these names (defined in cxx_flags.py).
shared_cxx_runtime, without_static_runtime = _cxx_flags.shared_cxx_runtime, _cxx_flags.without_static_runtime
sanitizer_flags = _cxx_flags.sanitizer_flags


def plan(with_cuda: bool | None = None) -> BuildPlan:
    """The build plan for this machine (``with_cuda`` overrides the decision)."""
    import torch

    decided, reason = _toolkit.decide_cuda()
    if with_cuda is None:
        with_cuda = decided
    elif with_cuda != decided:
        reason = f"requested with_cuda={with_cuda} (auto: {reason})"
    version = _torch_version_macro()
    cxx = [
        # -O2, not -O3: the hot loop (the scan) is written with explicit vector types and
        # compiles to the same code; -O3 only made every TU slower to build. -g0: Python's
        # own CFLAGS (pyenv's carry -g) would add debug info for all of ATen (a 10 MB .so).
        "-O2",
        "-g0",
        "-fopenmp",  # at::parallel_for is an OpenMP pragma in the headers: without it, one thread
        "-Wall",
        f"-DCUBLAS_GUARD_TORCH_VERSION={version}",
    ]
    # nvcc's -O is the host compiler's (device code is optimized by ptxas either way).
    nvcc = ["-O2", "-lineinfo", f"-DCUBLAS_GUARD_TORCH_VERSION={version}"]
    ldflags = ["-fopenmp"]
    sanitize = sanitizer_flags()
    if sanitize:
        cxx = [f for f in cxx if f != "-O2"] + sanitize
        ldflags += [f for f in sanitize if f.startswith("-fsanitize")]
    sources = [str(CSRC_DIR / s) for s in CPU_SOURCES]
    include_dirs = [str(CSRC_DIR)]
    env: dict[str, str] = {}
    include_after: list[str] = []
    notes: list[str] = []
    library_dirs: list[str] = []
    cuda_home = nvcc_release = cudart_library = None
    if with_cuda:
        sources += [str(CSRC_DIR / s) for s in CUDA_SOURCES]
        cuda_home = _toolkit.find_cuda_home()
        if cuda_home:
            env["CUDA_HOME"] = cuda_home
            nvcc_release = _toolkit.nvcc_version(cuda_home)
            note = _toolkit.cuda_version_note(nvcc_release, torch.version.cuda, cuda_home)
            if note:
                notes.append(note)
            cudart_library = _toolkit.cudart_link_name(cuda_home)
            if cudart_library:
                # pip's toolkit: link the versioned runtime by file name, from its lib folder.
                library_dirs += [
                    str(Path(cuda_home) / lib)
                    for lib in ("lib64", "lib")
                    if (Path(cuda_home) / lib / cudart_library[1:]).exists()
                ][:1]
            # Only the wheel headers the toolkit lacks (cuBLAS & co.), searched after the
            # toolkit's: the wheel's own cuda_runtime.h must never shadow the toolkit's.
            private = _toolkit.cuda_wheel_include_dir(
                _toolkit.cublas_include_dirs(), str(Path(cuda_home) / "include")
            )
            if private:
                include_after.append(private)
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            env["TORCH_CUDA_ARCH_LIST"] = _toolkit.default_arch_list()
        cxx.append("-DCUBLAS_GUARD_WITH_CUDA")
        for directory in include_after:
            cxx.append(f"-idirafter{directory}")
            nvcc += ["-Xcompiler", f"-idirafter{directory}"]  # nvcc has no -idirafter of its own
    cxx_runtime_libraries, cxx_runtime_dirs = shared_cxx_runtime()
    return BuildPlan(
        with_cuda=with_cuda,
        reason=reason,
        sources=sources,
        cxx_flags=cxx,
        nvcc_flags=nvcc,
        ldflags=ldflags,
        include_dirs=include_dirs,
        libraries=cxx_runtime_libraries,
        library_dirs=cxx_runtime_dirs + library_dirs,
        env=env,
        include_dirs_after=include_after,
        notes=notes,
        cuda_home=cuda_home,
        nvcc_version=nvcc_release,
        cudart_library=cudart_library,
    )


def effective_env(build: BuildPlan) -> dict[str, str]:
    """The values torch's builder will see once apply_env ran: the user's own
    non-empty setting wins, the plan's default fills in the rest."""
    return {key: os.environ.get(key) or value for key, value in build.env.items()}


# The notes of the plan apply_env exported last: said once, before the first compile.
_pending_notes: list[str] = []
# The runtime the plan apply_env exported last links instead of torch's -lcudart (see
# BuildPlan.cudart_library); the JIT build's ninja file gets it (torch_build_hooks).
_pending_cudart: list[str] = []


def apply_env(build: BuildPlan) -> None:
    """Export the plan's environment (CUDA_HOME, arch list) for torch's builder.

    The plan's notes are said by the build hooks before ninja compiles anything (not
    when the build is up to date, as on every warm JIT import).
    """
    from torch.utils import cpp_extension

    for key, value in effective_env(build).items():
        os.environ[key] = value
    if "CUDA_HOME" in build.env:
        # cpp_extension read CUDA_HOME at import time; correct its guess too.
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    _pending_notes[:] = build.notes
    _pending_cudart[:] = [build.cudart_library] if build.cudart_library else []
    if build.notes and not hasattr(cpp_extension, "_run_ninja_build"):  # no hooks: say it now
        for note in build.notes:
            print(f"{PROGRESS_PREFIX} NOTE: {note}", file=sys.stderr, flush=True)


def cuda_failed_before(build: BuildPlan, build_directory: str) -> str | None:
    """The failure marker's path if ``build`` failed in ``build_directory`` since the last
    edit of a source or header (toolkit.record_cuda_failure), else None."""
    return _toolkit.cuda_failed_before(
        build.sources + [str(p) for p in CSRC_DIR.rglob("*.h")], build_directory
    )


# ---------------------------------------------------------------------------
# JIT cache key: one build directory per incompatible environment
# ---------------------------------------------------------------------------
def jit_cache_key(build: BuildPlan, prefix: str | None = None) -> dict[str, object]:
    """Everything that makes a JIT build unusable elsewhere, from resolved facts only: the
    prefix (two venvs never share a directory), torch, the flags and include dirs (another
    checkout is another build), the toolkit's real path and nvcc's release. Nothing depends
    on how the process started: the private header folder lives under TORCH_EXTENSIONS_DIR,
    which processes may set differently, so it enters by its (digest) name, not its place.
    Source edits are not in it: ninja rebuilds the changed files in place."""
    import torch

    def portable(values: list[str]) -> list[str]:
        out = []
        for value in values:
            for directory in build.include_dirs_after:
                value = value.replace(directory, os.path.basename(directory))
            out.append(value)
        return out

    return {
        "prefix": os.path.realpath(prefix if prefix is not None else sys.prefix),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
        "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag,
        "compiler": os.environ.get("CXX", "c++"),
        "with_cuda": build.with_cuda,
        "cuda_home": os.path.realpath(build.cuda_home) if build.with_cuda and build.cuda_home else None,
        # The nvcc major too: a build by nvcc 13 must not be loaded under a CUDA 12 runtime.
        "nvcc": build.nvcc_version if build.with_cuda else None,
        "cudart": build.cudart_library if build.with_cuda else None,
        # The list torch will build for: the same before and after apply_env ran.
        "arch_list": effective_env(build).get("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if build.with_cuda
        else None,
        "cxx_flags": portable(build.cxx_flags),
        "nvcc_flags": portable(build.nvcc_flags) if build.with_cuda else [],
        "ldflags": build.ldflags,
        "libraries": build.libraries,
        "library_dirs": build.library_dirs,
        "include_dirs": build.include_dirs,
        "include_dirs_after": [os.path.basename(d) for d in build.include_dirs_after],
        "pch": pch_enabled(),
    }


def jit_name(build: BuildPlan, prefix: str | None = None) -> str:
    """The JIT build's name (its cache directory and .so): readable part + key digest."""
    key = jit_cache_key(build, prefix)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    flavour = "cuda" if build.with_cuda else "cpu"
    torch_tag = re.sub(r"[^A-Za-z0-9]", "_", str(key["torch"]))
    py_tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return f"cublas_guard_ext_{flavour}_torch{torch_tag}_{py_tag}_{digest}"


# ---------------------------------------------------------------------------
# Build speed (a precompiled header) and progress, for setup.py and the JIT alike
# ---------------------------------------------------------------------------
# Most translation units register ops (torch/library.h, the dispatcher) and three need all
# of ATen's functions (autocast_mode.h, torch/csrc/autograd/function.h): parsing these takes
# most of those files' compile time at -O2, so it is done once, into a GCC precompiled header.
PCH_HEADER = "cublas_guard_pch.h"
PCH_INCLUDES = ("ATen/ATen.h", "torch/library.h")
# Files that do not wait for the PCH: they include only linear/linear_op.h (ATen's Tensor class) or
# torch's Python headers, and gain little from it (loading the 430 MB PCH alone takes about
# 4 CPU-s, as much as parsing <ATen/core/Tensor.h>; the four: 36 CPU-s without it, 30 with
# it), so they compile on the second core while the first builds the PCH: the 2-core
# critical path is 88 CPU-s instead of 104 (benchmarks/investigations/NOTES.md, "Build time").
NO_PCH_SOURCES = frozenset(
    {"linear/checks.cpp", "report/errors.cpp", "scan/scan_cpu.cpp", "report/python_errors.cpp"}
)
PROGRESS_PREFIX = "cublas_guard_ext build:"
HEARTBEAT_S = 15.0

_RULE_LABELS = {
    "compile": "CXX $in",
    "cuda_compile": "NVCC $in",
    "sycl_compile": "SYCL $in",
    "cuda_devlink": "DLINK $out",
    "sycl_devlink": "DLINK $out",
    "link": "LINK $out",
    "pch": "PCH $in",
}
_VERBS = {
    "CXX": "compiled",
    "NVCC": "compiled (nvcc)",
    "SYCL": "compiled (sycl)",
    "DLINK": "device-linked",
    "LINK": "linked",
    "PCH": "precompiled header",
}


# Compile cost of the heavier sources, in CPU seconds (measured 2026-11-30, with the PCH
# where it is used: watch.cpp, autograd.cpp and python_module.cpp parse torch/csrc/autograd on top
# of it, python_errors.cpp pybind11; an nvcc compile for two archs); the rest count 7. Only the
# start order depends on it.
SLOW_SOURCES = {
    ".cu": 100.0,
    "watch/watch_fallback.cpp": 12.0,
    "watch/watch_python.cpp": 10.0,
    "watch/watch_session.cpp": 10.0,
    "linear/autograd.cpp": 25.0,
    "report/python_errors.cpp": 19.0,
    "python_module.cpp": 19.0,
    "linear/linear_common.cpp": 10.0,
    "linear/checks.cpp": 9.0,
}


def _source_name(source: str) -> str:
    """A source's name as CPU_SOURCES writes it (relative to csrc/), else its base name."""
    path = Path(source.replace("$ ", " "))
    try:
        return path.resolve().relative_to(CSRC_DIR.resolve()).as_posix()
    except ValueError:
        return path.name


def _compile_weight(source: str) -> float:
    name = _source_name(source)
    return SLOW_SOURCES.get(name, SLOW_SOURCES.get(os.path.splitext(name)[1], 7.0))


def pch_enabled() -> bool:
    """Whether to precompile the common headers: GCC only; CUBLAS_GUARD_EXT_PCH=0 turns it off."""
    if os.environ.get("CUBLAS_GUARD_EXT_PCH", "1") == "0":
        return False
    try:
        out = subprocess.run(
            [os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out and "clang" not in out.lower()


def rewrite_ninja_file(path: str, pch: bool) -> None:
    """Add readable descriptions to torch's build.ninja, and the precompiled header.

    The PCH is built by its own edge with the compile rule's exact flags (GCC
    rejects a PCH built with other flags) and force-included (``-include``) in
    every C++ compile but those of NO_PCH_SOURCES, which start at once instead
    of waiting for it; with ``-Winvalid-pch`` a rejected PCH is a warning and
    the header is parsed as usual. A file this does not recognise is left as is.
    """
    text = Path(path).read_text()
    if f"{PCH_HEADER}.gch" in text or "\nrule compile\n" not in text:
        return  # already ours, or not torch's usual layout
    build_dir = os.path.dirname(os.path.abspath(path))
    header = os.path.join(build_dir, PCH_HEADER)
    gch = header + ".gch"
    out: list[str] = []
    rule: str | None = None
    described = False

    def close_rule() -> None:
        if rule in _RULE_LABELS and not described:
            out.append(f"  description = {_RULE_LABELS[rule]}")

    first_rule = True
    for line in text.splitlines():
        match = re.match(r"rule (\w+)$", line)
        if rule is not None and not line.startswith(" "):
            close_rule()
            rule = None
        if match:
            if first_rule and pch:
                out += [
                    f"pch_flags = -include {header} -Winvalid-pch",
                    "",
                    "rule pch",
                    "  command = $cxx -MMD -MF $out.d -x c++-header $cflags -c $in -o $out $post_cflags",
                    "  depfile = $out.d",
                    "  deps = gcc",
                    f"  description = {_RULE_LABELS['pch']}",
                    "",
                    f"build {gch}: pch {header}",
                    "",
                ]
            first_rule = False
            rule, described = match.group(1), False
        elif rule is not None and line.startswith("  description"):
            described = True
        elif rule == "compile" and pch and line.startswith("  command = "):
            line += " $pch_flags"
        out.append(line)
    if rule is not None:
        close_rule()

    def source(line: str) -> str:
        return line.split(": ", 1)[1].split()[1]

    def uses_pch(line: str) -> bool:
        return (
            pch
            and line.split(": ", 1)[1].startswith("compile ")
            and _source_name(source(line)) not in NO_PCH_SOURCES
        )

    # ninja starts ready edges in file order. The PCH edge comes first (above the rules);
    # then the files that wait for it, longest first (once it is built they are all ready,
    # and the slowest one started last would run alone at the end); then those that do
    # not wait for it, longest first, which fill the second core meanwhile.
    edges = [i for i, line in enumerate(out) if re.match(r"build \S.*: (?:compile|cuda_compile) ", line)]
    if edges and edges == list(range(edges[0], edges[0] + len(edges))):
        out[edges[0] : edges[-1] + 1] = sorted(
            (out[i] for i in edges),
            key=lambda line: (not uses_pch(line), -_compile_weight(source(line))),
        )
    if pch:
        for i in reversed(edges):
            line = out[i]
            if "|" in line or not line.split(": ", 1)[1].startswith("compile "):
                continue
            if uses_pch(line):
                out[i] = f"{line} | {gch}"
            else:
                out.insert(i + 1, "  pch_flags =")  # this edge's own (empty) value
    if pch:
        content = "".join(f"#include <{h}>\n" for h in PCH_INCLUDES)
        if not os.path.exists(header) or Path(header).read_text() != content:
            Path(header).write_text(content)
    new_text = "\n".join(out) + "\n"
    if new_text != text:
        Path(path).write_text(new_text)


def _ninja_jobs() -> int:
    max_jobs = os.environ.get("MAX_JOBS", "")
    if max_jobs.isdigit() and int(max_jobs) > 0:
        return int(max_jobs)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def run_ninja(
    build_directory: str,
    error_prefix: str,
    stream: TextIO | None = None,
    verbose: bool | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    title: str | None = None,
    notes: list[str] | None = None,
) -> bool:
    """Run ninja in ``build_directory`` and show readable progress on ``stream`` (stderr).

    One line per finished step (which file, n of N, seconds since the start),
    a "still working" line when a step takes longer than ``heartbeat_s``, the
    full compiler output on failure (in the raised RuntimeError, as torch's own
    runner does). CUBLAS_GUARD_EXT_VERBOSE_BUILD=1 also echoes every line ninja prints.
    ``notes`` (e.g. nvcc's CUDA differs from torch's) come first, before any compile
    finishes. Nothing is printed when ninja has nothing to do. Returns whether it said anything.
    """
    stream = stream if stream is not None else sys.stderr
    if verbose is None:
        verbose = os.environ.get("CUBLAS_GUARD_EXT_VERBOSE_BUILD") == "1"
    jobs = _ninja_jobs()
    command = ["ninja"] + (["-v"] if verbose else []) + ["-j", str(jobs)]
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")

    def say(text: str) -> None:
        print(f"{PROGRESS_PREFIX} {text}", file=stream, flush=True)

    try:
        ninja_text = (Path(build_directory) / "build.ninja").read_text()
        steps = len(re.findall(r"^build .*: (?:compile|cuda_compile|sycl_compile|pch) ", ninja_text, re.M))
    except OSError:
        steps = 0
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=build_directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.put(raw)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    output: list[str] = []
    done = total = 0
    announced = False  # an up-to-date build (every warm JIT import) prints nothing

    def announce() -> None:
        nonlocal announced
        if not announced:
            announced = True
            for note in notes or ():
                say(f"NOTE: {note}")
            say(
                f"{title or 'building'}: {steps} compile steps in {build_directory}, ninja -j{jobs} "
                "(a cold CPU build takes 35-85 s on 2 idle cores, by the machine)"
            )

    while True:
        try:
            line = lines.get(timeout=heartbeat_s if announced else min(1.0, heartbeat_s))
        except queue.Empty:
            if announced:
                state = f"{done}/{total} steps done" if total else "first step running"
                say(f"... still compiling: {state}, {time.monotonic() - started:.0f} s elapsed")
            announce()
            continue
        if line is None:
            break
        output.append(line)
        match = re.match(r"\[(\d+)/(\d+)\] (CXX|NVCC|SYCL|DLINK|LINK|PCH) (\S+)", line)
        if match:
            announce()
            done, total = int(match.group(1)), int(match.group(2))
            width = len(str(total))
            say(
                f"[{done:>{width}}/{total}] {time.monotonic() - started:6.1f} s  "
                f"{_VERBS[match.group(3)]} {os.path.basename(match.group(4))}"
            )
        elif verbose:
            print(line, end="", file=stream, flush=True)
    returncode = proc.wait()
    elapsed = time.monotonic() - started
    if returncode != 0:
        announce()
        say(f"FAILED after {elapsed:.1f} s (the compiler's output follows in the error)")
        raise RuntimeError(f"{error_prefix}: {''.join(output)}")
    if announced:
        say(f"done in {elapsed:.1f} s")
    return announced


@contextlib.contextmanager
def torch_build_hooks(stream: TextIO | None = None, title: str | None = None) -> Iterator[None]:
    """While active, torch's extension builder (setup.py or JIT) gets the PCH and our progress.

    Patches two private helpers of torch.utils.cpp_extension that both build
    paths go through (_write_ninja_file, _run_ninja_build); restored on exit.
    If a torch lacks them, the build runs as torch does it, without either.
    """
    from torch.utils import cpp_extension

    original_write = getattr(cpp_extension, "_write_ninja_file", None)
    original_run = getattr(cpp_extension, "_run_ninja_build", None)
    pch = pch_enabled()

    def write(path, *args, **kwargs):
        original_write(path, *args, **kwargs)
        try:
            rewrite_ninja_file(path, pch=pch)
            if _pending_cudart:
                _toolkit.link_cudart_by_name(path, _pending_cudart[0])
        except OSError as exc:  # the build still works without our additions
            print(f"{PROGRESS_PREFIX} could not annotate {path}: {exc}", file=stream or sys.stderr)

    def run(build_directory, verbose, error_prefix):
        run_ninja(build_directory, error_prefix, stream=stream, title=title, notes=list(_pending_notes))

    if original_write is not None:
        cpp_extension._write_ninja_file = write
    if original_run is not None:
        cpp_extension._run_ninja_build = run
    try:
        yield
    finally:
        if original_write is not None:
            cpp_extension._write_ninja_file = original_write
        if original_run is not None:
            cpp_extension._run_ninja_build = original_run
