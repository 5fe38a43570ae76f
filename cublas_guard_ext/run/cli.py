"""``python -m cublas_guard_ext run [options] (SCRIPT | -m MODULE) [ARGS...]``.

The script runs as ``python SCRIPT ARGS`` itself: this process checks the command line, puts
the bootstrap folder (``_site``, a ``sitecustomize``) on ``PYTHONPATH`` with the options in
``CUBLAS_GUARD_RUN``, and replaces itself (``os.execv``, the same PID for torchrun and signals)
with the interpreter running the script. So ``sys.argv``, ``sys.path[0]``, ``__main__`` (the
script is ``sys.modules["__main__"]``: its functions pickle for spawn workers), ``-m``'s
semantics and the exit status are Python's own, and the same bootstrap reaches every Python
process the script starts. The bootstrap installs the guard when the process imports torch
(see ``_site/sitecustomize.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from .options import DEFAULT_REPORT_DIR, ENV_VAR, HELP, USAGE, RunOptions, UsageError, parse

PROG = "python -m cublas_guard_ext run"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def _error(message: str) -> int:
    print(USAGE, file=sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _report_dir_problem(folder: str) -> str | None:
    """Why reports cannot be written to ``folder``, or None when they can."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def _interpreter_flags() -> list[str]:
    """This interpreter's flags (-X, -W, -O, -B, ...), and -u when stdout is unbuffered."""
    flags = list(subprocess._args_from_interpreter_flags())
    if getattr(sys.stdout, "write_through", False) and not os.environ.get("PYTHONUNBUFFERED"):
        flags.append("-u")
    return flags


def environment(options: RunOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    """The script's environment: the bootstrap folder first on PYTHONPATH, the options in
    CUBLAS_GUARD_RUN, the mode as every layer's default (CUBLAS_GUARD_MODE)."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *paths])
    env[ENV_VAR] = options.encode()
    env["CUBLAS_GUARD_MODE"] = options.mode
    return env


def main(argv: list[str]) -> int:
    try:
        options = parse(list(argv))
    except UsageError as err:
        return _error(str(err))
    if options is None:
        print(HELP)
        return 0
    if sys.flags.no_site or sys.flags.ignore_environment or sys.flags.isolated:
        return _error(
            "this interpreter runs with -S, -E or -I: the bootstrap (a sitecustomize on PYTHONPATH) "
            "could not reach the script; run it without those flags"
        )
    if options.script is not None:
        if options.script == "-":
            return _error("reading the script from stdin is not supported: give its path")
        if not os.path.isfile(options.script):
            what = "is a folder, not a script" if os.path.isdir(options.script) else "does not exist"
            return _error(f"the script {options.script!r} {what} (in {os.getcwd()})")
    shown = options.report_dir
    options.report_dir = os.path.abspath(options.report_dir)
    problem = _report_dir_problem(options.report_dir)
    if problem is not None:
        print(
            f"cublas_guard_ext run: cannot write reports to {shown} ({problem}); the script runs "
            f"guarded, and a failure's report goes to stderr only"
            + (" (choose a folder with --report DIR)" if shown == DEFAULT_REPORT_DIR else ""),
            file=sys.stderr,
        )
    options.main_pid = os.getpid()  # execve keeps it: the script's process
    options.capsules_in_report = not os.environ.get("CUBLAS_GUARD_CAPSULE_DIR")
    command = [sys.executable, *_interpreter_flags(), *options.target()]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, command, environment(options))
    except OSError as err:
        return _error(f"cannot start {sys.executable}: {err}")
    return 0  # not reached: execve replaced this process
