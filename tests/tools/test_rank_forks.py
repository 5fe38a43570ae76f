"""helpers.rank_forks: a rank forked from the zygote sees what ``python script ...`` would give it
(argv, environment, working directory, sys.path[0], exit code, atexit, a traceback), the same as a
fresh interpreter (CGX_TEST_FRESH_RANKS=1), and a rank that hangs is killed and said to."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from helpers import rank_forks

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys
    out = sys.argv[2]
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("planted")
    if what == "hang":
        import time
        time.sleep(600)
    json.dump({"argv": sys.argv[1:], "env": os.environ.get("CGX_RANK_FORKS_PROBE"), "cwd": os.getcwd(),
               "path": sys.path, "stdin": sys.stdin.read(), "torch": "torch" in sys.modules}, open(out, "w"))
    print("to stdout"); print("to stderr", file=sys.stderr)
    sys.exit(int(what))
    """
)


@pytest.fixture(params=["zygote", "fresh"])
def ranks_mode(request, monkeypatch):
    if request.param == "fresh":
        monkeypatch.setenv(rank_forks.FRESH_RANKS_ENV, "1")
    else:
        monkeypatch.delenv(rank_forks.FRESH_RANKS_ENV, raising=False)
    return request.param


@pytest.mark.slow
def test_a_rank_sees_what_a_fresh_interpreter_would(tmp_path: Path, ranks_mode: str, monkeypatch) -> None:
    script = tmp_path / "scripts" / "rank.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    env = dict(os.environ, CGX_RANK_FORKS_PROBE=f"probe-{ranks_mode}")
    results = [tmp_path / f"r{i}.json" for i in range(3)]
    outputs = [tmp_path / f"r{i}.output" for i in range(3)]
    argvs = [
        [str(script), "0", str(results[0])],
        [str(script), "3", str(results[1])],
        [str(script), "raise", str(results[2])],
    ]
    codes, ends, hung = rank_forks.run_ranks(argvs, env, outputs, limit_s=60.0)
    assert (codes, hung) == ([0, 3, 1], False) and len(ends) == 3
    for i in (0, 1):
        seen = json.loads(results[i].read_text())
        assert seen["argv"] == argvs[i][1:] and seen["env"] == f"probe-{ranks_mode}"
        assert seen["cwd"] == str(tmp_path / "cwd") and seen["stdin"] == ""
        # as `python script`: the script's folder first, or nowhere under PYTHONSAFEPATH (CI's
        # installed-package suite sets it)
        if os.environ.get("PYTHONSAFEPATH"):
            assert str(script.parent) not in seen["path"], seen
        else:
            assert seen["path"][0] == str(script.parent), seen
        assert seen["torch"] == (ranks_mode == "zygote")  # the one difference: torch already imported
        # buffered as a fresh interpreter buffers them (PYTHONUNBUFFERED or not)
        order = (
            ["to stdout", "to stderr"] if os.environ.get("PYTHONUNBUFFERED") else ["to stderr", "to stdout"]
        )
        assert outputs[i].read_text().splitlines() == order
        assert (tmp_path / f"r{i}.json.atexit").read_text() == "ran"
    assert "ValueError: planted" in outputs[2].read_text() and "Traceback" in outputs[2].read_text()


@pytest.mark.slow
def test_a_hung_rank_is_killed_and_said_to_have_hung(tmp_path: Path, ranks_mode: str) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    argvs = [[str(script), "0", str(tmp_path / "a.json")], [str(script), "hang", str(tmp_path / "b.json")]]
    outputs = [tmp_path / "a.output", tmp_path / "b.output"]
    codes, _, hung = rank_forks.run_ranks(argvs, dict(os.environ), outputs, limit_s=3.0)
    assert hung and codes[1] is None
    assert (tmp_path / "a.json").exists()
