"""CPU seconds per translation unit of the extension's build (load-independent).

Reads the build.ninja that setup.py / pip wrote (build/temp*/build.ninja), and
compiles each C++ source alone, one at a time, with exactly its ninja command,
under `/usr/bin/time`-style accounting (user+sys of the compiler processes).
Objects go to a scratch directory; the build directory is not touched except
that the precompiled header, when the ninja file has one, is built first (its
own row) so that the other rows are measured with it, as ninja would.

    python benchmarks/investigations/tu_times.py [build/temp.linux-x86_64-cpython-311] [--no-pch] [--only NAME ...]
        [--extra-flags "-ftime-report"]

Files whose edge sets its own empty `pch_flags` (cublas_guard_ext/_native/building/build.py's
NO_PCH_SOURCES) are compiled without the PCH, as ninja does. Prints one row per TU
(CPU s, wall s) and the totals, plus the critical path of a 2-job schedule in CPU
seconds: the PCH and the files that do not wait for it start at once, the others
when the PCH is built, each in the build file's order (ninja's).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time


def parse_ninja(
    path: str,
) -> tuple[dict[str, str], dict[str, str], list[tuple[str, str, str, dict[str, str]]]]:
    variables: dict[str, str] = {}
    rules: dict[str, str] = {}
    edges: list[tuple[str, str, str, dict[str, str]]] = []
    rule = None
    for line in open(path).read().splitlines():
        m = re.match(r"  (\w+) =(?: (.*))?$", line)
        if m and rule is None and edges and edges[-1][3] is not None:
            edges[-1][3][m.group(1)] = m.group(2) or ""  # a binding of the edge above
            continue
        m = re.match(r"rule (\w+)$", line)
        if m:
            rule = m.group(1)
            continue
        if rule and line.startswith("  command = "):
            rules[rule] = line[len("  command = ") :]
            continue
        if not line.startswith(" "):
            rule = None
        m = re.match(r"(\w+) = (.*)$", line)
        if m and not line.startswith(" "):
            variables[m.group(1)] = m.group(2)
            continue
        m = re.match(r"build (\S+): (\w+) (\S+)", line)
        if m:
            edges.append((m.group(1), m.group(2), m.group(3), {}))
    return variables, rules, edges


def expand(command: str, variables: dict[str, str], inp: str, out: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name == "in":
            return inp
        if name == "out":
            return out
        return expand(variables.get(name, ""), variables, inp, out)

    return re.sub(r"\$(\w+)", sub, command)


def timed(command: str) -> tuple[float, float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    rc = subprocess.run(command, shell=True).returncode
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, rc


def critical_path(pch: float, rows: list[tuple[float, bool]], jobs: int = 2) -> float:
    """Makespan of `jobs` workers: the PCH (cost `pch`, first in the file) and the
    (cost, waits_for_pch) rows, in file order; a row that waits starts after the PCH."""
    workers = [0.0] * jobs
    pending = ([(pch, False, True)] if pch else []) + [(c, w, False) for c, w in rows]
    pch_done = 0.0 if not pch else float("inf")
    while pending:
        i = workers.index(min(workers))
        now = workers[i]
        ready = [k for k, (_, waits, _) in enumerate(pending) if not waits or pch_done <= now]
        if not ready:  # wait for the PCH
            workers[i] = pch_done
            continue
        cost, _, is_pch = pending.pop(ready[0])
        workers[i] = now + cost
        if is_pch:
            pch_done = workers[i]
    return max(workers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir", nargs="?")
    ap.add_argument("--no-pch", action="store_true", help="compile without the precompiled header")
    ap.add_argument("--only", nargs="*", default=None, help="basenames of sources to measure")
    ap.add_argument("--extra-flags", default="", help="appended to every compile (e.g. -ftime-report)")
    args = ap.parse_args()
    build_dir = args.build_dir or (sorted(glob.glob("build/temp*")) or [""])[0]
    ninja = os.path.join(build_dir, "build.ninja")
    variables, rules, edges = parse_ninja(ninja)
    if args.no_pch:
        variables["pch_flags"] = ""
    scratch = tempfile.mkdtemp(prefix="tu_times_")
    rows: list[tuple[str, float, float]] = []
    waits: dict[str, bool] = {}
    pch_cpu = 0.0
    for out, rule, inp, bindings in edges:
        if rule == "pch":
            if args.no_pch:
                continue
            cmd = expand(rules[rule], variables, inp, out)
        elif rule in ("compile", "cuda_compile"):
            if args.only and os.path.basename(inp) not in args.only:
                continue
            cmd = expand(
                rules[rule], {**variables, **bindings}, inp, os.path.join(scratch, os.path.basename(out))
            )
            waits[os.path.basename(inp)] = bool(expand("$pch_flags", {**variables, **bindings}, inp, out))
        else:
            continue
        if args.extra_flags:
            cmd += " " + args.extra_flags
        cpu, wall, rc = timed(cmd)
        name = os.path.basename(inp)
        if rc:
            print(f"{name}: FAILED ({shlex.quote(cmd)})", file=sys.stderr)
            return 1
        if rule == "pch":
            pch_cpu = cpu
        rows.append((name, cpu, wall))
        print(f"  {name:28s} {cpu:7.1f} CPU-s {wall:7.1f} wall-s", flush=True)
    total = sum(r[1] for r in rows)
    tus = [(r[1], waits.get(r[0], False)) for r in rows if not r[0].endswith(".h")]
    print(
        f"  {'total':28s} {total:7.1f} CPU-s  ({len(tus)} TUs{', + PCH' if pch_cpu else ''}); "
        f"2-job critical path {critical_path(pch_cpu, tus):.1f} CPU-s (ninja's order)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
