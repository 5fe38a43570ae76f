"""Render an incident report of ``run`` in headless Chromium: docs/images/incident-report.png.

Runs a small training script with a planted NaN (a log of a negative value in one block's
activation, at step 3) under ``python -m cublas_guard_ext run --watch`` in a temporary folder,
then screenshots the report it wrote with Chromium (Debian: ``apt-get install -y chromium``):

    python benchmarks/screenshot_report.py                     # writes docs/images/incident-report.png
    python benchmarks/screenshot_report.py --report PATH.html --out shot.png --height 1600
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import torch
from torch import nn

class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(self.act(self.up(x)))

class LogScale(nn.Module):
    """A learned log-scaling that assumes positive input."""
    def forward(self, x):
        return torch.log(x)

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = Mlp(width)
        self.scale = LogScale()

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.scale(x.abs() + 1e-3 if self.training else x))

class Model(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            block.training = not (i == 1 and self.poisoned)
            x = block(x)
        return self.head(x).mean(1)

torch.manual_seed(0)
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 6):
    model.poisoned = step == 3
    loss = nn.functional.mse_loss(model(torch.randn(8, 10, 16)), torch.randn(8, 4))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def make_report(folder: Path) -> Path:
    script = folder / "train.py"
    script.write_text(SCRIPT)
    reports = folder / "cublas_guard_reports"  # run's default folder
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CUBLAS_GUARD_RUN", None)
    done = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "run", "--watch", "train.py"],
        cwd=str(folder),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    pages = sorted(reports.glob("*.html"))
    pages = [p for p in pages if p.name != "index.html"]
    if not pages:
        raise SystemExit(f"the script wrote no report:\n{done.stdout}\n{done.stderr}")
    print(done.stderr.strip().splitlines()[0])
    return pages[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/screenshot_report.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--report", help="an existing report to render (default: make one)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "images" / "incident-report.png"))
    ap.add_argument("--width", type=int, default=1100)
    ap.add_argument("--height", type=int, default=1480)
    args = ap.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("needs Chromium: apt-get install -y chromium")
        return 2
    folder = Path(tempfile.mkdtemp(prefix="screenshot_report-"))
    page = Path(args.report) if args.report else make_report(folder)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={folder / 'profile'}",
        f"--screenshot={out}",
        f"--window-size={args.width},{args.height}",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not out.is_file():
        print(f"chromium failed ({done.returncode}):\n{done.stderr}")
        return 1
    print(f"{out} ({out.stat().st_size // 1024} KB) from {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
