"""Rank processes forked from a Python that has already imported torch (a "zygote"), for
helpers.distributed.launch: a rank started as ``python script worker ...`` spent ~3.5 of its ~4
CPU seconds importing torch, torch.distributed and pytest (2026-12-07, this 2-core VM), which
was most of every distributed test's cost, in `make test-slow` and again in CI's installed-package
suite.

What a rank sees is what ``python script worker RANK ...`` would give it, as far as a test can
tell: its own argv, environment (os.environ replaced, so C code's getenv agrees), working
directory, sys.path[0] (the script's folder, or nothing under PYTHONSAFEPATH), stdin from
/dev/null, stdout and stderr to a file, and a normal interpreter exit (atexit handlers, exit code
from sys.exit, traceback and 1 on an exception). What it does not see is a fresh interpreter:
torch is already imported, with the environment the zygote started with. So one zygote serves only
launches whose start-up environment is the same (the variables that act at interpreter start or at
torch's import: PYTHON*, OMP_*, MKL_*, KMP_*, GOMP_*, LD_*, TORCH_*, PYTORCH_*); another gets a new
zygote. The zygote imports nothing of cublas_guard_ext (its import reads the environment), never
runs an op and starts no thread of its own, so each fork starts from the same untouched state;
forking after ``import torch`` is what DataLoader workers do.

``CGX_TEST_FRESH_RANKS=1`` starts each rank as a fresh interpreter instead (the old way).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

FRESH_RANKS_ENV = "CGX_TEST_FRESH_RANKS"
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "TORCH_", "PYTORCH_")
_REPLY_GRACE_S = 30.0  # past the rank limit, before the zygote itself counts as hung


def startup_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` that act before a rank's own code runs."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)))


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.key = startup_key(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # its own failures, if any, show in the test's output
        )
        ready = self._read_line(120.0)
        if ready != {"ready": True}:
            self.close()
            raise RuntimeError(f"the rank zygote did not start: {ready!r}")

    def _read_line(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            self.close()
            raise RuntimeError(f"the rank zygote sent nothing in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"the rank zygote exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, request: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_line(request["limit"] + _REPLY_GRACE_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_zygote: _Zygote | None = None


def _close_zygote() -> None:
    if _zygote is not None:
        _zygote.close()


atexit.register(_close_zygote)


def run_ranks(
    argvs: list[list[str]], env: dict[str, str], outputs: list[Path], limit_s: float
) -> tuple[list[int | None], list[float], bool]:
    """Run one process per argv (argv[0]: the script) with ``env``, in this working directory,
    each one's stdout and stderr to its output file; wait at most ``limit_s`` for all.
    Returns (exit codes, as Popen's returncode; None for a rank killed as hung), the seconds
    from the start to each one's exit, and whether any hung (all were then killed)."""
    if os.environ.get(FRESH_RANKS_ENV) == "1":
        return _run_fresh(argvs, env, outputs, limit_s)
    global _zygote
    if _zygote is not None and (_zygote.key != startup_key(env) or _zygote.proc.poll() is not None):
        _zygote.close()
        _zygote = None
    if _zygote is None:
        _zygote = _Zygote(env)
    reply = _zygote.run(
        {
            "argvs": argvs,
            "env": env,
            "cwd": os.getcwd(),
            "outputs": [str(p) for p in outputs],
            "limit": limit_s,
        }
    )
    return reply["codes"], reply["ends"], reply["hung"]


def _run_fresh(argvs, env, outputs, limit_s):
    start = time.monotonic()
    procs = []
    for argv, output in zip(argvs, outputs):
        with open(output, "wb") as out:
            procs.append(
                subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    codes: list[int | None] = []
    ends: list[float] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, limit_s - (time.monotonic() - start))))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return [q.wait() if q is not p else None for q in procs], ends, True
        ends.append(time.monotonic() - start)
    return codes, ends, False


# ---- the zygote (python rank_forks.py serve) --------------------------------------------


def _child(argv: list[str], env: dict[str, str], cwd: str, output: str) -> None:
    """In the forked rank: become ``python argv...`` and never return to the serve loop."""
    import runpy

    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    # As the interpreter opens them: stdout block-buffered to a file, stderr line-buffered, both
    # written through under PYTHONUNBUFFERED (read at interpreter start; part of the zygote's key).
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    else:
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    if not sys.flags.safe_path:
        sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)  # SystemExit and exceptions leave through the interpreter's normal exit


def serve() -> None:
    if not sys.flags.safe_path:
        sys.path.pop(0)  # this file's folder: a rank gets its own script's folder instead
    import pytest  # noqa: F401  (what the ranks import first; nothing here runs)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401

    reply = sys.stdout.buffer
    reply.write(b'{"ready": true}\n')
    reply.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        start = time.monotonic()
        pids = []
        for argv, output in zip(request["argvs"], request["outputs"]):
            pid = os.fork()
            if pid == 0:
                _child(argv, request["env"], request["cwd"], output)
            pids.append(pid)
        codes: list[int | None] = [None] * len(pids)
        ends = [0.0] * len(pids)
        hung = False
        pending = set(pids)
        while pending:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if not hung and time.monotonic() - start > request["limit"]:
                    hung = True
                    for p in pending:
                        os.kill(p, 9)
                time.sleep(0.005)
                continue
            if pid in pending:
                pending.discard(pid)
                i = pids.index(pid)
                ends[i] = time.monotonic() - start
                codes[i] = None if hung else os.waitstatus_to_exitcode(status)
        reply.write((json.dumps({"codes": codes, "ends": ends, "hung": hung}) + "\n").encode())
        reply.flush()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
