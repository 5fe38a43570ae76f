"""Unmodified scripts run under ``python -m cublas_guard_ext run`` in subprocesses, and the
incident report's HTML read back (run/test_run*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

from cublas_guard_ext.run import cli, options

TIMEOUT = 240


def script_env(**extra: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for key in (
        "CUBLAS_GUARD_RUN",
        "CUBLAS_GUARD_CAPSULE_DIR",
        "CUBLAS_GUARD_EXT_FAULT",
        "RANK",
        "WORLD_SIZE",
        "PYTHONSAFEPATH",  # the tests compare with python run without -P (CI's installed-package stage sets it)
    ):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def write(folder: Path, name: str, code: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return path


def run_script(
    tmp_path: Path,
    script: Path,
    *flags: str,
    args: tuple[str, ...] = (),
    through_command: bool = False,
    **env: str,
) -> subprocess.CompletedProcess:
    """The script under ``run FLAGS``; reports in tmp_path/reports unless --report is given."""
    flags = flags if "--report" in flags else (*flags, "--report", str(tmp_path / "reports"))
    if through_command:
        command = [sys.executable, "-m", "cublas_guard_ext", "run", *flags, str(script), *args]
        environ = script_env(**env)
    else:
        opts = options.parse([*flags, str(script), *args])
        opts.report_dir = os.path.abspath(opts.report_dir)
        opts.main_pid = None  # set below: the child's PID is not known before it starts
        opts.capsules_in_report = "CUBLAS_GUARD_CAPSULE_DIR" not in env
        command = [sys.executable, str(script), *args]
        environ = cli.environment(opts, script_env(**env))
    return subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT, env=environ, cwd=str(tmp_path)
    )


def the_error_comes_last(stderr: str, headline: str) -> None:
    """The report's line comes before the traceback, and the traceback ends with the error."""
    before, _, after = stderr.rpartition("Traceback (most recent call last):")
    assert "cublas_guard_ext run: incident report: " in before, stderr
    assert "incident report" not in after and headline in after.split("\n  File ")[-1], stderr


def reports(tmp_path: Path, folder: str = "reports") -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / folder).glob("*.json"))]


MODEL = """
import torch
from torch import nn

class LogAct(nn.Module):
    def forward(self, x):
        return torch.log(x)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.act = LogAct()
        self.head = nn.Linear(16, 2)
        with torch.no_grad():  # tanh's output stays positive: log is finite unless a test plants it
            self.encoder[0].bias.fill_(10.0)

    def forward(self, x):
        return self.head(self.act(self.encoder(x)))
"""


class ReportPage(HTMLParser):
    """What a test needs from the HTML: the marked birth op, the modules on the path, the text
    of the statistics section, and that nothing is fetched from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.birth_ops: list[str] = []
        self.birth_modules: list[str] = []
        self.path_modules: list[str] = []
        self.external: list[str] = []
        self.stats_text: list[str] = []
        self._in_stats = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if a.get("id") == "statistics":
            self._in_stats = 1
        elif self._in_stats and tag == "section":
            self._in_stats += 1
        if "data-birth-op" in a:
            self.birth_ops.append(a["data-birth-op"])
        if a.get("class") == "birth" and "data-module" in a:
            self.birth_modules.append(a["data-module"])
        if a.get("class") == "path" and "data-module" in a:
            self.path_modules.append(a["data-module"])
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//")) or (tag == "link" and key == "href"):
                self.external.append(a[key])

    def handle_endtag(self, tag: str) -> None:
        if self._in_stats and tag == "section":
            self._in_stats -= 1

    def handle_data(self, data: str) -> None:
        if self._in_stats:
            self.stats_text.append(data)
