"""Build speed and progress, for setup.py and the JIT alike: a precompiled header of the
common torch headers, ninja's output turned into readable progress lines (file, n of N,
seconds), and the hooks that put both into torch's extension builder. ``build`` re-exports
what the others use; like it, this file is loaded by path from setup.py and imports no
module of the package.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

CSRC_DIR = Path(__file__).resolve().parent.parent.parent / "csrc"
if not CSRC_DIR.is_dir():  # an installed wheel's copy (see build.CSRC_DIR)
    CSRC_DIR = Path(__file__).resolve().parent.parent / "_csrc"

# Set by build.apply_env for the plan being built: its notes (said once, before the first
# compile), the runtime to link instead of torch's -lcudart, and how to rewrite the link line.
pending_notes: list[str] = []
pending_cudart: list[str] = []
link_cudart_by_name: list[Callable[[str, str], None]] = []

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
    {"linear/checks.cpp", "report/errors.cpp", "scan/scan_cpu.cpp", "locked/report/python_errors.cpp"}
)
# The unity build's generated files (unity_build.py) start with this: they parse torch's
# headers once each, so they do without the PCH (building it would cost more than it saves).
UNITY_FILE_PREFIX = "unity_"
PROGRESS_PREFIX = "cublas_guard_ext build:"
# The define that marks a build of the stable core (core_build.py, csrc/core/tensor_api.h).
STABLE_MARKER = "-DCUBLAS_GUARD_STABLE"
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
    # The unity groups without the PCH (2026-12-06): the locked library's own 26 s, the core's 14.
    "unity_locked.cpp": 26.0,
    "unity_core.cpp": 14.0,
    "locked/watch/watch_fallback.cpp": 12.0,
    "locked/watch/watch_python.cpp": 10.0,
    "locked/watch/watch_session.cpp": 10.0,
    "locked/linear/autograd.cpp": 25.0,
    "locked/report/python_errors.cpp": 19.0,
    "locked/python_module.cpp": 19.0,
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
    out = _compiler_banner(os.environ.get("CXX", "c++"))
    return "Free Software Foundation" in out and "clang" not in out.lower()


@functools.lru_cache(maxsize=8)
def _compiler_banner(compiler: str) -> str:
    """``compiler --version``'s output ("" when it does not run), asked once per process and
    compiler: the JIT key and the build both want it, and a process that only loads a cached
    build must not start a compiler over and over (nor at all when nothing is cached)."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def rewrite_ninja_file(path: str, pch: bool) -> None:
    """Add readable descriptions to torch's build.ninja, and the precompiled header.

    The PCH is built by its own edge with the compile rule's exact flags (GCC
    rejects a PCH built with other flags) and force-included (``-include``) in
    every C++ compile but those of NO_PCH_SOURCES and the unity groups, which start
    at once instead of waiting for it (with no file left to use it, there is no PCH);
    with ``-Winvalid-pch`` a rejected PCH is a warning and the header is parsed as
    usual. A file this does not recognise is left as is.
    """
    text = Path(path).read_text()
    if f"{PCH_HEADER}.gch" in text or "\nrule compile\n" not in text:
        return  # already ours, or not torch's usual layout

    def source(line: str) -> str:
        return line.split(": ", 1)[1].split()[1]

    def wants_pch(line: str) -> bool:
        name = _source_name(source(line))
        return (
            line.split(": ", 1)[1].startswith("compile ")
            and name not in NO_PCH_SOURCES
            and not os.path.basename(name).startswith(UNITY_FILE_PREFIX)
        )

    # No PCH where no compile would use it (a unity build's groups parse the headers once each).
    pch = pch and any(
        wants_pch(line) for line in text.splitlines() if re.match(r"build \S.*: compile ", line)
    )
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

    def uses_pch(line: str) -> bool:
        return pch and wants_pch(line)

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
                "(a cold CPU build of both libraries takes about 40 s on 2 idle cores)"
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
            # The stable core must not see ATen's headers (the PCH is ATen's): it is
            # compiled against the stable ABI alone (core_build.py).
            stable = STABLE_MARKER in Path(path).read_text()
            rewrite_ninja_file(path, pch=pch and not stable)
            if pending_cudart:
                link_cudart_by_name[0](path, pending_cudart[0])
        except OSError as exc:  # the build still works without our additions
            print(f"{PROGRESS_PREFIX} could not annotate {path}: {exc}", file=stream or sys.stderr)

    def run(build_directory, verbose, error_prefix):
        run_ninja(build_directory, error_prefix, stream=stream, title=title, notes=list(pending_notes))

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
