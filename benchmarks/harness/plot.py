"""overhead.png: the scan's bandwidth and speed-up and SafeLinear's time ratio against size.

matplotlib (Agg) when it is installed; otherwise a plain SVG drawn by hand, so that a machine
without matplotlib (the GPU machine) still gets a picture.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .rows import only
from .suite import linear_flops


def plot(
    path: Path,
    scan: list[dict],
    linear: list[dict],
    ts: list[dict],
    device: torch.device,
    env: dict | None = None,
) -> Path:
    """overhead.png with matplotlib (Agg); overhead.svg by hand if matplotlib is missing."""
    scan = [r for r in only(scan) if not r.get("skipped")]
    linear = [r for r in only(linear) if not r.get("skipped")]
    ref = "copy (r+w)" if device.type == "cuda" else "x.sum()"
    frac_target = 0.90 if device.type == "cuda" else 0.80
    speed_target = 1.4 if device.type == "cuda" else 10.0
    panels = [
        {
            "title": f"scan bandwidth / {ref} bandwidth",
            "xlabel": "elements (float32)",
            "ylabel": "fraction",
            "logy": False,
            "series": [
                (
                    "scan" + (" kernel" if device.type == "cuda" else " + decision"),
                    [(r["numel"], r["frac"]) for r in scan if r.get("frac")],
                )
            ],
            "hline": (frac_target, f"target {frac_target:.0%}"),
            "ylim0": True,
        },
        {
            "title": "scan speed-up over the naive checks (with decisions)",
            "xlabel": "elements (float32)",
            "ylabel": "time ratio (x)",
            "logy": True,
            "series": [
                ("isfinite().all()", [(r["numel"], r["isfinite_x"]) for r in scan if r.get("isfinite_x")]),
                ("seed check", [(r["numel"], r["seed_x"]) for r in scan if r.get("seed_x")]),
            ],
            "hline": (speed_target, f"target vs isfinite: {speed_target:g}x (large sizes)"),
            "hline2": (2.7, "target vs seed: 2.7x (large sizes)") if device.type == "cuda" else None,
        },
    ]
    series = []
    for mode in ("sync", "async", "off"):
        for direction in ("fwd", "fwd+bwd"):
            for tf32 in (False, True):
                pts = sorted(
                    (linear_flops(r["M"], r["K"], r["N"], "fwd"), r[f"{mode}_x"])
                    for r in linear
                    if r["direction"] == direction and bool(r["tf32"]) == tf32
                )
                if pts:
                    style = {
                        "color": {"sync": "tab:red", "async": "tab:blue", "off": "tab:green"}[mode],
                        "ls": "-" if direction == "fwd" else "--",
                        "marker": "^" if tf32 else "o",
                    }
                    series.append((f"{mode} {direction}" + (" tf32" if tf32 else ""), pts, style))
    panels.append(
        {
            "title": "SafeLinear / nn.Linear time",
            "xlabel": "GEMM size 2*M*K*N (FLOP)",
            "ylabel": "time ratio (x)",
            "logy": False,
            "series": series,
            "hline": (1.0, "nn.Linear"),
        }
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = path.with_suffix(".svg")
        svg.write_text(_svg(panels))
        return svg
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    for ax, pnl in zip(axes, panels):
        for label, pts, *style in pnl["series"]:
            if pts:
                xs, ys = zip(*pts)
                kw = {"marker": "o", **(style[0] if style else {})}
                ax.plot(xs, ys, ms=3.5, lw=1.2, label=label, **kw)
        y, lab = pnl["hline"]
        ax.axhline(y, color="k", ls=":", lw=0.9, label=lab)
        if pnl.get("hline2"):
            y2, lab2 = pnl["hline2"]
            ax.axhline(y2, color="gray", ls=":", lw=0.9, label=lab2)
        ax.set_xscale("log", base=2)
        if pnl["logy"]:
            ax.set_yscale("log")
        if pnl.get("ylim0"):
            top = max([1.1] + [y * 1.1 for _, pts, *_ in pnl["series"] for _, y in pts])
            ax.set_ylim(0, top)
        ax.set_title(pnl["title"], fontsize=10)
        ax.set_xlabel(pnl["xlabel"])
        ax.set_ylabel(pnl["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    env = env or {}
    where = env.get("gpu") or env.get("cpu") or device.type.upper()
    fig.suptitle(
        f"cublas_guard_ext overhead: {where}, torch {env.get('torch', torch.__version__)}, "
        f"{env.get('date_utc', '')}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _svg(panels: list[dict]) -> str:
    """A plain SVG line chart per panel (log2 x), for machines without matplotlib."""
    import math

    w, h, pad = 420, 300, 48
    colors = [
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
        "#000000",
        "#aaaa00",
    ]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h}" font-size="9" '
        'font-family="sans-serif">'
    ]
    for i, pnl in enumerate(panels):
        ox = i * w
        pts = [p for _, s, *_ in pnl["series"] for p in s if p[1] and p[1] > 0]
        if not pts:
            continue
        ty = (lambda v: math.log10(v)) if pnl["logy"] else (lambda v: v)
        xs = [math.log2(x) for x, _ in pts]
        ys = [ty(y) for _, y in pts] + [ty(pnl["hline"][0])]
        x0, x1 = min(xs), max(xs) + 1e-9
        y0 = min(ys + ([] if pnl["logy"] else [0.0]))
        y1 = max(ys) + 0.05 * (max(ys) - y0) + 1e-9

        def px(x: float) -> float:
            return ox + pad + (math.log2(x) - x0) / (x1 - x0) * (w - 2 * pad)

        def py(y: float) -> float:
            return h - pad - (ty(y) - y0) / (y1 - y0) * (h - 2 * pad)

        out.append(
            f'<rect x="{ox + pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#888"/>'
        )
        out.append(f'<text x="{ox + w / 2}" y="16" text-anchor="middle" font-size="11">{pnl["title"]}</text>')
        out.append(f'<text x="{ox + w / 2}" y="{h - 8}" text-anchor="middle">{pnl["xlabel"]} (log2)</text>')
        hv = pnl["hline"][0]
        out.append(
            f'<line x1="{ox + pad}" x2="{ox + w - pad}" y1="{py(hv):.1f}" y2="{py(hv):.1f}" stroke="#000" stroke-dasharray="4"/>'
        )
        out.append(f'<text x="{ox + pad + 2}" y="{py(hv) - 3:.1f}">{pnl["hline"][1]}</text>')
        for k, (label, s, *_) in enumerate(pnl["series"]):
            s = [p for p in s if p[1] and p[1] > 0]
            if not s:
                continue
            c = colors[k % len(colors)]
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s)
            out.append(f'<polyline points="{path}" fill="none" stroke="{c}"/>')
            out.append(
                f'<text x="{ox + w - pad - 4}" y="{pad + 12 + 11 * k}" text-anchor="end" fill="{c}">{label}</text>'
            )
        for frac in (0.0, 0.5, 1.0):
            yv = y0 + frac * (y1 - y0)
            label = f"{10**yv:.3g}" if pnl["logy"] else f"{yv:.3g}"
            out.append(
                f'<text x="{ox + pad - 3}" y="{h - pad - frac * (h - 2 * pad):.1f}" text-anchor="end">{label}</text>'
            )
    out.append("</svg>")
    return "\n".join(out)
