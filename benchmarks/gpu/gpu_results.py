"""The RESULTS.md section of one GPU check run (benchmarks/gpu/gpu_check.sh), in the format
`benchmarks/run.py --preset gpu` writes (the same environment lines and target table, from
benchmarks/harness/report.py and targets.py): date, card, driver, torch, CUDA, cuBLAS, the command,
and each target's row with PASS / MISS / NOT RUN.

Run 1's rows: both GEMM paths' benchmark targets side by side (each path's results.json from
run.py), every CUDA test green (smoke and the xdist run). Run 2's rows: watch's CUDA tests, the
watch_bench.py and training_guard_bench.py ratios on GPT-2 small in bfloat16, and memcheck clean.

    python benchmarks/gpu/gpu_results.py --run 1 --steps DETAILS/steps.txt --details DETAILS \\
        --command "bash benchmarks/gpu/gpu_check.sh" --results-md OUT/RESULTS.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# The benchmarks' harness package, and the checkout's package only when none is installed: an
# installed wheel's prebuilt library must not be shadowed by a checkout that has none (importing
# that one would JIT-build it, minutes with CUDA).
for path in (ROOT, HERE.parent):
    if str(path) not in sys.path and (path != ROOT or importlib.util.find_spec("cublas_guard_ext") is None):
        sys.path.insert(0, str(path))

GEMM_PATHS = ("legacy", "lt")
# The model targets of run 2: (step, target id, text, regex of the ratio in the step's output, limit).
MODEL_TARGETS = (
    (
        "watch-bench",
        "gpu-watch-gpt2-bf16",
        "watch(model, mode='async') training step <= 1.10x the plain step, GPT-2 small, bf16 autocast",
        r"watch\(async\) vs plain: ([0-9.]+)x wall",
        1.10,
    ),
    (
        "guard-bench",
        "gpu-training-guard-gpt2-bf16",
        "TrainingGuard.step <= 1.02x the plain step, GPT-2 small, bf16 autocast, fused AdamW",
        r"ratio TrainingGuard / plain: wall ([0-9.]+)x",
        1.02,
    ),
)


def read_steps(path: Path) -> dict[str, tuple[str, str]]:
    """steps.txt lines "name|status|seconds|note" -> {name: (status, note)} (the last of a name)."""
    steps: dict[str, tuple[str, str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("|", 3)
            if len(parts) == 4:
                steps[parts[0]] = (parts[1], parts[3])
    return steps


def step_target(tid: str, text: str, steps: dict[str, tuple[str, str]], names: tuple[str, ...]) -> dict:
    """PASS when every named step passed, MISS when one failed, NOT RUN otherwise."""
    from harness.targets import _target

    states = [steps.get(n, ("NOT RUN", "")) for n in names]
    notes = "; ".join(f"{n}: {s} {note}".strip() for n, (s, note) in zip(names, states))
    if all(s == "PASS" for s, _ in states):
        value = 0.0
    elif any(s in ("FAIL", "FOUND", "KILLED", "STOPPED", "TIMEOUT") for s, _ in states):
        value = 1.0
    else:
        value = None
    row = _target(tid, text, value, 0.0, "<=", ".0f", notes)
    row["threshold"], row["measured"] = "all green", {0.0: "green", 1.0: "red", None: "-"}[value]
    return row


def bench_targets(details: Path) -> list[dict]:
    """Each GEMM path's benchmark targets, side by side: the path in the id and the text."""
    rows = []
    by_path = {}
    for gp in GEMM_PATHS:
        results = details / f"bench-{gp}" / "results.json"
        by_path[gp] = json.loads(results.read_text())["targets"] if results.exists() else []
    ids = list(dict.fromkeys(t["id"] for gp in GEMM_PATHS for t in by_path[gp]))
    for tid in ids:
        for gp in GEMM_PATHS:
            found = next((t for t in by_path[gp] if t["id"] == tid), None)
            if found is not None:
                rows.append({**found, "id": f"{tid} [{gp}]", "target": f"[{gp}] {found['target']}"})
    if not ids:
        from harness.targets import _target

        for gp in GEMM_PATHS:
            rows.append(
                _target(f"gpu-bench [{gp}]", f"[{gp}] run.py --preset gpu targets", None, 0, "<=", ".0f")
            )
    return rows


def model_targets(details: Path) -> list[dict]:
    from harness.targets import _target

    rows = []
    for step, tid, text, pattern, limit in MODEL_TARGETS:
        log = details / f"{step}.log"
        found = re.findall(pattern, log.read_text(errors="replace")) if log.exists() else []
        value = float(found[-1]) if found else None
        rows.append(_target(tid, text, value, limit, "<=", ".3f", f"details/{step}.log"))
    return rows


def section_targets(run: int, steps: dict[str, tuple[str, str]], details: Path) -> list[dict]:
    if run == 1:
        return [
            step_target("gpu-build", "the sm_90 build registers the CUDA kernels", steps, ("build",)),
            step_target(
                "gpu-cuda-tests",
                "every CUDA test green (smoke, then the xdist run)",
                steps,
                ("smoke", "tests"),
            ),
            *bench_targets(details),
        ]
    return [
        step_target("gpu-watch-cuda-tests", "watch's CUDA tests green", steps, ("watch-tests",)),
        *model_targets(details),
        step_target(
            "gpu-memcheck",
            "compute-sanitizer memcheck reports no error on its workload (PYTORCH_NO_CUDA_MEMORY_CACHING=1)",
            steps,
            ("sanitizer",),
        ),
    ]


def environment() -> dict:
    import torch

    from harness import env_probe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return env_probe.environment(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu/gpu_results.py", description=__doc__)
    ap.add_argument("--run", type=int, choices=(1, 2), required=True)
    ap.add_argument("--steps", type=Path, required=True)
    ap.add_argument("--details", type=Path, required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--wall-s", type=float, default=0.0)
    ap.add_argument(
        "--results-md",
        type=Path,
        required=True,
        help="written: a copy of benchmarks/RESULTS.md with the section",
    )
    ap.add_argument("--targets-txt", type=Path, help="also write the targets' short table here")
    args = ap.parse_args(argv)

    from harness import report, tables

    steps = read_steps(args.steps)
    ts = section_targets(args.run, steps, args.details)
    env = environment()
    note = (
        "run 1: build, smoke, every CUDA test in one xdist run, both GEMM paths' benchmark targets"
        if args.run == 1
        else "run 2: watch's CUDA tests, watch_bench and training_guard_bench on GPT-2 small (bf16), memcheck"
    )
    name = f"gpu-check-run{args.run}"
    section = "\n\n".join(
        [
            f"## GPU check, run {args.run} (preset `{name}`)",
            report.env_lines(env, args.command, note, args.wall_s),
            "### Targets",
            tables.targets_table(ts),
        ]
    )
    if not args.results_md.exists() and (ROOT / "benchmarks" / "RESULTS.md").exists():
        shutil.copyfile(ROOT / "benchmarks" / "RESULTS.md", args.results_md)
    report.update_results_md(args.results_md, name, section)
    short = tables.short_table(ts)
    if args.targets_txt:
        args.targets_txt.write_text(short + "\n")
    print(short)
    return 0


if __name__ == "__main__":
    sys.exit(main())
