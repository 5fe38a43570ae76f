"""The per-test seeds of conftest.py: the same in every process, and named when a test fails.

Each check runs a planted test file in a fresh pytest process next to a copy of this suite's
conftest.py (and its helpers), with two different PYTHONHASHSEEDs (hash() of a str is salted per process; the seed must not be).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

PLANTED = """
import torch


def test_draws():
    print("initial_seed", torch.initial_seed(), "draw", torch.rand(3).tolist())


def test_fails():
    assert torch.rand(1).item() > 2.0, "planted failure"
"""


def run_planted(tmp_path: Path, hash_seed: str, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    shutil.copytree(TESTS / "helpers", tmp_path / "helpers", dirs_exist_ok=True)  # the conftest imports it
    (tmp_path / "test_planted.py").write_text(PLANTED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # rootdir = tmp_path, not this repository
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-s",
            "--rootdir",
            str(tmp_path),
            "test_planted.py",
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
    )


def crc_seed(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) % (2**31)


def draws(out: str) -> str:
    """The planted test's printed line, from its "initial_seed" on (-s prints it after the file name)."""
    line = next(line for line in out.splitlines() if "initial_seed" in line)
    return line[line.index("initial_seed") :]


@pytest.mark.slow
def test_the_seed_is_a_crc_of_the_test_id_in_every_process(tmp_path: Path) -> None:
    first = run_planted(tmp_path, "1", "-k", "draws")
    second = run_planted(tmp_path, "2", "-k", "draws")
    assert first.returncode == 0 and second.returncode == 0, first.stdout + second.stdout
    line = draws(first.stdout)
    assert line.startswith(f"initial_seed {crc_seed('test_planted.py::test_draws')} draw ["), line
    assert draws(second.stdout) == line  # the same seed, so the same random inputs


@pytest.mark.slow
def test_a_failing_test_names_its_seed(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    result = run_planted(tmp_path, "3", f"--junitxml={xml}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "planted failure" in result.stdout
    seed = crc_seed("test_planted.py::test_fails")
    # Under the failure, in its own section; once, and not for the test that passed.
    assert "test seed" in result.stdout and result.stdout.count("seed=") == 1, result.stdout
    assert f"seed={seed} " in result.stdout, result.stdout
    assert f'<property name="seed" value="{seed}"' in xml.read_text()
