"""cublas_guard_ext micro-benchmarks: SafeLinear vs nn.Linear, the scan vs the naive checks,
the GEMM alone. Writes summary.md, results.json and overhead.png, updates RESULTS.md,
and prints PASS/MISS for each target of benchmarks/harness/targets.py.

    python benchmarks/run.py --preset cpu      # this 2-core CPU machine (< 10 minutes)
    python benchmarks/run.py --preset gpu      # an H200 (~4 minutes)
    python benchmarks/run.py --preset gpu-check  # the GPU check's target rows (gpu/gpu_check.sh --run 1)
    python benchmarks/run.py --preset quick    # a fast look, either device
    python benchmarks/run.py --preset gpu --dry-run   # list the cases, measure nothing
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # the harness package (benchmarks/harness/)
if str(ROOT) not in sys.path and importlib.util.find_spec("cublas_guard_ext") is None:
    # The repository's package only when none is installed: an installed wheel's prebuilt
    # library must not be shadowed by a checkout that has none (its import would JIT-build it).
    sys.path.insert(1, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from harness import presets, suite  # after sys.path is set

    ap = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--preset", choices=presets.PRESETS, default="cpu")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="override the preset's device")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<preset>)")
    ap.add_argument(
        "--results-md",
        type=Path,
        help="RESULTS.md to update (default benchmarks/RESULTS.md for the cpu and gpu presets; "
        "the quick and smoke presets update none unless given)",
    )
    ap.add_argument("--budget-s", type=float, help="stop starting new cases after this many seconds")
    ap.add_argument("--rounds", type=int, help="override the preset's rounds")
    ap.add_argument(
        "--only",
        choices=["fixed", "linear", "scan"],
        help="run only the cases of this kind (fixed: the fixed cost per call)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the cases and exit")
    ap.add_argument(
        "--from-json",
        type=Path,
        metavar="RESULTS_JSON",
        help="measure nothing: rebuild the tables, plot, targets and RESULTS.md section from a "
        "results.json an earlier run wrote (e.g. one copied back from the GPU machine)",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        return rerender(args.from_json, args.out, args.results_md)

    if sys.flags.optimize:
        print("run.py: the two-assert check uses assert; run without -O", file=sys.stderr)
        return 2

    import torch

    p = presets.preset(args.preset)
    if args.rounds:
        p.rounds = args.rounds
    command = "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(__file__, Path.cwd())] + sys.argv[1:]
    )
    try:  # `chrt` is in the exact command when the run had a real-time policy (investigations/NOTES.md)
        policy = os.sched_getscheduler(0)
        if policy in (os.SCHED_FIFO, os.SCHED_RR):
            flag = "-f" if policy == os.SCHED_FIFO else "-r"
            command = f"chrt {flag} {os.sched_getparam(0).sched_priority} {command}"
    except (AttributeError, OSError):
        pass

    if args.dry_run:
        want = args.device or (p.device if p.device != "auto" else "cpu")
        device = torch.device(want)
        groups = suite.plan(p, device, only=args.only)
        print(
            f"preset {p.name} on {device}: {len(groups)} groups, {p.rounds} rounds, "
            f"min_run_time {p.min_run_time}s per measurement, budget {args.budget_s or p.budget_s:.0f}s"
        )
        print(p.note)
        for g in groups:
            print(f"  {g.key():60s} {', '.join(g.members)}")
        return 0

    device = presets.resolve_device(p, args.device)
    import cublas_guard_ext._native.loading.loader as loader

    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("run.py: the gpu preset needs a CUDA GPU; this machine has none", file=sys.stderr)
            return 2
        if not loader.info().has_cuda_kernels:
            print(
                "run.py: the extension was built without CUDA kernels; rebuild it with a CUDA torch "
                "and toolkit (see docs/building.md)",
                file=sys.stderr,
            )
            return 2

    from harness import env_probe

    # A run of one kind of case keeps its own folder and RESULTS.md section (the preset's
    # full section stays as it is).
    name = p.name if args.only is None else f"{p.name}-{args.only}"
    out = args.out or HERE / "results" / name
    out.mkdir(parents=True, exist_ok=True)
    env = env_probe.environment(device)
    print(
        f"preset {p.name} on {device} ({env.get('gpu') or env['cpu']}), {suite.thread_info()}, "
        f"load average {env['loadavg_start']}; torch {torch.__version__}"
    )
    print(p.note)
    if (
        device.type == "cpu"
        and os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1)
        and env["scheduling"] == "SCHED_OTHER"
    ):
        print(
            f"NOTE: the machine is busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores). "
            "Each parallel region then waits milliseconds for its second thread to be scheduled, and "
            "small-case figures turn into scheduler quanta. On a shared machine run it as "
            "`chrt -f 1 python benchmarks/run.py ...` (see benchmarks/investigations/NOTES.md)."
        )

    started = time.perf_counter()
    records = suite.run(p, device, budget_s=args.budget_s, only=args.only)
    wall = time.perf_counter() - started
    env["loadavg_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    results_md = args.results_md
    if results_md is None and p.name in ("cpu", "gpu"):
        results_md = HERE / "RESULTS.md"
    described = p.describe()
    described["name"] = name
    if args.only == "fixed":
        described["note"] = (
            f"the fixed-cost cases of preset {p.name} only: shapes {p.fixed_shapes}, "
            f"dtypes {p.fixed_dtypes}, threads {p.fixed_threads or 'as set'}, "
            f"{' and '.join(p.fixed_directions)}, {p.fixed_rounds} rounds"
        )
    write_reports(described, env, command, wall, records, device, out, results_md)
    return 0


def rerender(path: Path, out: Path | None, results_md: Path | None) -> int:
    import json

    import torch

    payload = json.loads(path.read_text())
    device = torch.device(payload["env"]["device"])
    out = out or path.parent
    out.mkdir(parents=True, exist_ok=True)
    if results_md is None and payload["preset"]["name"].split("-")[0] in ("cpu", "gpu"):
        results_md = HERE / "RESULTS.md"
    write_reports(
        payload["preset"],
        payload["env"],
        payload["command"],
        payload["wall_s"],
        payload["records"],
        device,
        out,
        results_md,
    )
    return 0


def write_reports(
    preset: dict,
    env: dict,
    command: str,
    wall: float,
    records: list[dict],
    device,
    out: Path,
    results_md: Path | None,
) -> None:
    from harness import plot, report, rows, tables, targets

    name, note, rounds = preset["name"], preset["note"], preset["rounds"]
    out.mkdir(parents=True, exist_ok=True)
    scan = rows.scan_rows(records, device)
    linear = rows.linear_rows(records)
    fixed = rows.fixed_rows(records)
    ts = targets.targets(scan, linear, device) if (scan or linear) else []
    if fixed:
        ts += targets.fixed_targets(fixed, device)
    # (A run of the fixed-cost cases alone has nothing to plot.)
    plot_path = (
        plot.plot(out / "overhead.png", scan, linear, ts, device, env)
        if (scan or linear)
        else out / "overhead.png"
    )
    summary = report.summary_markdown(
        name, env, command, note, wall, device, rounds, ts, scan, linear, plot_path.name, fixed
    )
    (out / "summary.md").write_text(summary)
    report.write_json(
        out / "results.json",
        {"preset": preset, "env": env, "command": command, "wall_s": wall, "targets": ts, "records": records},
    )
    (out / "targets.txt").write_text(tables.short_table(ts) + "\n")
    if results_md is not None:
        rel = os.path.relpath(out.resolve(), results_md.resolve().parent)
        section = report.results_section(
            name, env, command, note, wall, device, rounds, ts, scan, linear, rel, plot_path.name, fixed
        )
        report.update_results_md(results_md, name, section)

    if scan:
        print()
        print(tables.scan_table(scan, device))
    if linear:
        print()
        print(tables.linear_table(linear, device, only_fwd_tf32_off=True))
    if fixed:
        print()
        print(tables.fixed_table(fixed, device))
    print(
        f"\nwrote {out}/summary.md, results.json, targets.txt"
        + (f", {plot_path.name}" if (scan or linear) else "")
        + (f"; updated {results_md}" if results_md else "")
        + f"  ({wall:.0f} s)"
    )
    print("\nTargets:")
    print(tables.short_table(ts))


if __name__ == "__main__":
    sys.exit(main())
