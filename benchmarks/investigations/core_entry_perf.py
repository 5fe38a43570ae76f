"""Where the stable core's C entry spends a call, against the locked library's entry (issue 49, point 5).

For each library (CUBLAS_GUARD_EXT_NATIVE=locked | core) a child process calls the fast entry
(``seam().fast_linear``: 16x16, M=1, under no_grad, mode off) in a loop under
``perf record --call-graph dwarf``; the parent then splits the samples under the entry function
by the function it called (one level down, or ``--depth`` levels), and converts samples to
microseconds per call with the entry's own time, measured in the same child before the loop.

    python benchmarks/investigations/core_entry_perf.py [--calls 300000] [--depth 1]

Needs perf (``perf record`` allowed for this user) and both libraries built for the installed
torch (>= 2.14, where the core has its C entry); run it from outside the source tree. Slow: perf's
DWARF unwinding of ~9,000 samples takes a few minutes per library. What it found: RESULTS.md,
section "2026-12-07, 22:21- UTC".
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, torch
import cublas_guard_ext  # noqa: F401  (loads the library)
from cublas_guard_ext._native.loading import seam
torch.set_num_threads(1)
entry = seam.seam().fast_linear
lin = torch.nn.Linear(16, 16)
x = torch.randn(1, 16)
w, b = lin.weight, lin.bias
calls = int(sys.argv[1])
with torch.no_grad():
    for _ in range(3):  # warm, then time the entry alone
        start = time.perf_counter()
        for _ in range(calls // 10):
            entry(x, w, b, "bench", 0, False)
        per_call = (time.perf_counter() - start) / (calls // 10)
    print(f"ENTRY_US {per_call * 1e6:.3f}", flush=True)
    for _ in range(calls):
        entry(x, w, b, "bench", 0, False)
"""

# The entry functions' symbols: the core's C entry, the locked library's fast entry.
ENTRY = re.compile(r"cublas_guard::\(anonymous namespace\)::fast_linear")


def stacks(perf_data: str) -> list[list[str]]:
    """Each sample's stack, leaf first, as function names."""
    text = subprocess.run(
        ["perf", "script", "-i", perf_data, "--no-inline", "-F", "ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    samples, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            if current:
                samples.append(current)
                current = []
            continue
        parts = line.split(None, 1)
        current.append(parts[1] if len(parts) > 1 else parts[0])
    if current:
        samples.append(current)
    return samples


def split(samples: list[list[str]], depth: int) -> tuple[int, collections.Counter[str]]:
    """Samples under the entry, and their counts by the callee chain below it."""
    below: collections.Counter[str] = collections.Counter()
    total = 0
    for stack in samples:
        at = [i for i, frame in enumerate(stack) if ENTRY.search(frame)]
        if not at:
            continue
        total += 1
        i = at[-1]
        below[" -> ".join(reversed(stack[max(0, i - depth) : i])) or "(the entry itself)"] += 1
    return total, below


def profile(library: str, calls: int, depth: int, workdir: str) -> None:
    data = os.path.join(workdir, f"{library}.data")
    env = dict(os.environ, CUBLAS_GUARD_EXT_NATIVE=library, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            "perf",
            "record",
            "-F",
            "2000",
            "--call-graph",
            "dwarf,16384",
            "-o",
            data,
            "--",
            sys.executable,
            "-c",
            CHILD,
            str(calls),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    found = re.search(r"ENTRY_US ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"{library}: the child failed:\n{done.stdout}\n{done.stderr}")
    entry_us = float(found.group(1))
    total, below = split(stacks(data), depth)
    if total == 0:
        raise SystemExit(f"{library}: no sample under the entry (is perf allowed to unwind?)")
    print(f"\n{library}: the entry takes {entry_us:.2f} us a call ({total} samples under it)")
    for callee, count in below.most_common(14):
        print(f"  {count / total * entry_us:6.3f} us  {100 * count / total:5.1f}%  {callee[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300_000)
    ap.add_argument("--depth", type=int, default=1, help="callee levels below the entry to split by")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for library in ("locked", "core"):
            profile(library, args.calls, args.depth, workdir)


if __name__ == "__main__":
    main()
