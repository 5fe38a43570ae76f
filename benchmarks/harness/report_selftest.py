"""Exercise the report path of a preset with made-up timings (no GPU needed).

    python benchmarks/harness/report_selftest.py [--preset gpu] [--out /tmp/report-selftest]

Builds the preset's plan, fills every group with synthetic per-round times (roughly shaped like a
real run: a scan at a given bandwidth, GEMMs at a given FLOP rate), and writes summary.md, the plot,
targets.txt and a RESULTS.md into --out. It checks that the tables, targets and plot render for the
GPU preset on a machine without a GPU; the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[0] = str(HERE.parent)  # benchmarks/ (run.py, the harness package), not harness/ itself
sys.path.insert(1, str(HERE.parent.parent))

import torch  # noqa: E402

import run  # noqa: E402
from harness import presets, suite  # noqa: E402


def fake_times(g: suite.Group, device: torch.device, rounds: int) -> dict[str, list[float]]:
    rng = random.Random(zlib.crc32(g.key().encode()))  # the same numbers in every process
    out = {}
    if g.kind == "scan":
        n = g.params["numel"]
        bw = 4.0e12 if device.type == "cuda" else 60e9
        launch = 5e-6 if device.type == "cuda" else 1e-6
        base = {
            "scan": 4 * n / (0.93 * bw) + 2 * launch,
            "scan_op": 4 * n / (0.95 * bw) + launch,
            "isfinite": 6 * n / bw + 3 * launch,
            "seed": 12 * n / bw + 6 * launch,
            "sum": 4 * n / bw + launch,
            "copy": 8 * n / bw + launch,
        }
    else:
        flops = suite.linear_flops(g.params["M"], g.params["K"], g.params["N"], g.params["direction"])
        rate = (50e12 if not g.params.get("tf32") else 300e12) if device.type == "cuda" else 150e9
        t = flops / rate + 8e-6
        base = {
            "nn.Linear": t,
            "sync": t * 1.03 + 10e-6,
            "async": t * 1.01 + 4e-6,
            "off": t * 1.005 + 2e-6,
            "F.linear": t - 1e-6,
            "gemm_off": t * 1.01,
            "F.linear_nobias": t - 2e-6,
            "gemm_off_nobias": t,
        }
    for name in g.members:
        out[name] = [base[name] * (1 + 0.02 * rng.random()) for _ in range(rounds)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpu", choices=presets.PRESETS)
    ap.add_argument("--out", type=Path, default=Path("/tmp/report-selftest"))
    args = ap.parse_args()
    p = presets.preset(args.preset)
    device = torch.device("cuda" if p.device in ("cuda", "auto") else "cpu")
    records = []
    for g in suite.plan(p, device):
        times = fake_times(g, device, p.rounds)
        rec = {
            "kind": g.kind,
            "params": dict(g.params),
            "members": g.members,
            "rounds": p.rounds,
            "times_s": times,
            "median_s": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
        }
        if g.kind == "scan" and device.type == "cuda" and g.params["numel"] >= (1 << 26):
            rec["do_bench_ms"] = {
                "scan_op": rec["median_s"]["scan_op"] * 1e3,
                "copy": rec["median_s"]["copy"] * 1e3,
            }
        if g.kind == "fixed" and device.type == "cuda":
            rec["wall_times_s"] = {k: [t * 1.1 for t in v] for k, v in times.items()}
        records.append(rec)
    records[-1] = {
        "kind": records[-1]["kind"],
        "params": records[-1]["params"],
        "members": records[-1]["members"],
        "skipped": "time budget of 150 s spent (synthetic)",
    }
    env = {
        "date_utc": "synthetic",
        "cpu": "synthetic CPU",
        "cpu_cores": 16,
        "torch_threads": 16,
        "memory": "?",
        "python": "3.x",
        "torch": torch.__version__,
        "torch_cuda": "13.0",
        "device": str(device),
        "loadavg_start": "0",
        "loadavg_end": "0",
        "scheduling": "SCHED_OTHER",
        "git_commit": "synthetic",
        "git_dirty": False,
        "extension": "synthetic",
    }
    if device.type == "cuda":
        env.update(
            {
                "gpu": "synthetic H200",
                "gpu_cc": "9.0",
                "gpu_memory": "139 GiB",
                "gpu_l2": "60 MiB",
                "nvidia_smi": "synthetic",
                "triton": None,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    run.write_reports(
        p.describe(),
        env,
        "synthetic",
        0.0,
        records,
        device,
        args.out / "results" / p.name,
        args.out / "RESULTS.md",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
