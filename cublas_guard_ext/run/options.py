"""What ``python -m cublas_guard_ext run`` was asked for: the command line, parsed, and the one
environment variable that carries it into the script's process and every process it starts.

No torch here: the bootstrap (``_site/sitecustomize.py``) reads the options in every Python
process of the run, including the ones that never import torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ENV_VAR = "CUBLAS_GUARD_RUN"
DEFAULT_REPORT_DIR = "cublas_guard_reports"
MODES = ("sync", "async", "off")
STEP_POLICIES = ("skip", "raise")
STEP_FLAGS = {"skip": "--skip-nonfinite-steps", "raise": "--raise-on-nonfinite-steps"}

USAGE = """\
usage: python -m cublas_guard_ext run [--mode {sync,async,off}] [--watch]
                                      [--skip-nonfinite-steps | --raise-on-nonfinite-steps]
                                      [--report DIR] (SCRIPT | -m MODULE) [ARGS...]"""

HELP = (
    USAGE
    + """

Run an unmodified PyTorch script (or `-m MODULE`) exactly as `python SCRIPT ARGS` would, with
the guard installed in it and in every Python process it starts (torchrun ranks, DataLoader
workers, subprocesses). When the script dies, each process writes an incident report (HTML and
JSON) to the report folder and, in a distributed run, stops the other ranks within seconds.

options:
  --mode {sync,async,off}     every nn.Linear runs the guarded op in this mode (default:
                              $CUBLAS_GUARD_MODE if set, else sync; off keeps the checks and
                              the checked cuBLAS call, no value scan)
  --watch                     name the op and module where a NaN/Inf is born, in every forward
                              and backward (compiled code runs eagerly to be watched)
  --skip-nonfinite-steps      every optimizer.step() checks the gradients first and skips a
                              step whose gradients hold NaN/Inf (with a warning naming the step)
  --raise-on-nonfinite-steps  ... or raises NonFiniteStepError naming the step
  --report DIR                where incident reports go (default: ./cublas_guard_reports)
  -m MODULE                   run a module, as `python -m MODULE ARGS` would
  -h, --help                  show this help

Under torchrun:  torchrun --nproc-per-node 8 -m cublas_guard_ext run train.py ARGS
             or  torchrun --nproc-per-node 8 --no-python python -m cublas_guard_ext run train.py ARGS
More: docs/run.md"""
)


class UsageError(ValueError):
    """A command line ``run`` cannot act on; the message is one line for the user."""


@dataclass
class RunOptions:
    """The options of one run, as the command line gave them."""

    mode: str = "sync"
    watch: bool = False
    nonfinite_steps: str | None = None  # "skip", "raise" or None (no check)
    report_dir: str = DEFAULT_REPORT_DIR
    # What runs: a script path, or a module (-m); and its arguments.
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    # The whole command the user typed after `python -m cublas_guard_ext` (for the report's
    # ready-to-paste commands).
    command: list[str] = field(default_factory=list)
    # The PID of the script's own process (run execs the script in its own process, so the PID
    # stays): the processes it starts inherit the options but are not the script.
    main_pid: int | None = None
    # Whether capsules go into the report folder (the user did not choose a capsule folder).
    capsules_in_report: bool = False

    def target(self) -> list[str]:
        """What `python` runs: [SCRIPT, *ARGS] or [-m, MODULE, *ARGS]."""
        head = ["-m", self.module] if self.module is not None else [str(self.script)]
        return head + list(self.args)

    def run_flags(self) -> list[str]:
        """The options as ``run`` takes them (the report's commands repeat them)."""
        flags = [] if self.mode == "sync" else ["--mode", self.mode]
        flags += ["--watch"] if self.watch else []
        if self.nonfinite_steps:
            flags.append(STEP_FLAGS[self.nonfinite_steps])
        if self.report_dir != DEFAULT_REPORT_DIR:
            flags += ["--report", self.report_dir]
        return flags

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> RunOptions:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{ENV_VAR} is not a JSON object")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        options = cls(**known)
        validate(options)
        return options


def from_environment() -> RunOptions | None:
    """The options of the run this process belongs to, or None outside a run."""
    text = os.environ.get(ENV_VAR)
    return RunOptions.decode(text) if text else None


def validate(options: RunOptions) -> None:
    if options.mode not in MODES:
        raise UsageError(f"--mode must be one of {', '.join(MODES)}, got {options.mode!r}")
    if options.nonfinite_steps not in (None, *STEP_POLICIES):
        raise UsageError(f"nonfinite_steps must be skip, raise or None, got {options.nonfinite_steps!r}")
    if options.watch and options.mode == "off":
        raise UsageError(
            "--watch cannot work with --mode off (off watches nothing): use --mode sync or async"
        )


def _value(argv: list[str], i: int, name: str) -> tuple[str, int]:
    """The value of option ``name`` at argv[i] (``--name=V`` or ``--name V``), and the next index."""
    token = argv[i]
    if token.startswith(name + "="):
        return token[len(name) + 1 :], i + 1
    if i + 1 >= len(argv):
        raise UsageError(f"{name} needs a value")
    return argv[i + 1], i + 2


def parse(argv: list[str]) -> RunOptions | None:
    """The options of ``run ARGV``; None for --help. Raises UsageError with a one-line reason.

    Everything after SCRIPT (or after ``-m MODULE``) belongs to the script, even when it looks
    like one of run's options: ``run train.py --watch`` passes ``--watch`` to train.py."""
    options = RunOptions(command=["run", *argv])
    # Without --mode: the mode the environment already chose (CUBLAS_GUARD_MODE), else sync.
    inherited = os.environ.get("CUBLAS_GUARD_MODE", "").strip().lower()
    if inherited in MODES:
        options.mode = inherited
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            return None
        if token == "--":
            i += 1
            break
        if token == "-m" or (token.startswith("-m") and len(token) > 2 and not token.startswith("--")):
            module = token[2:] if len(token) > 2 else None
            if module is None:
                if i + 1 >= len(argv):
                    raise UsageError("-m needs a module name")
                module, i = argv[i + 1], i + 2
            else:
                i += 1
            options.module, options.args = module, list(argv[i:])
            validate(options)
            return options
        if token == "--mode" or token.startswith("--mode="):
            options.mode, i = _value(argv, i, "--mode")
        elif token == "--report" or token.startswith("--report="):
            options.report_dir, i = _value(argv, i, "--report")
            if not options.report_dir:
                raise UsageError("--report needs a folder")
        elif token == "--watch":
            options.watch, i = True, i + 1
        elif token in STEP_FLAGS.values():
            policy = "skip" if token == STEP_FLAGS["skip"] else "raise"
            if options.nonfinite_steps not in (None, policy):
                raise UsageError("--skip-nonfinite-steps and --raise-on-nonfinite-steps exclude each other")
            options.nonfinite_steps, i = policy, i + 1
        elif token.startswith("-") and token != "-":
            raise UsageError(f"unknown option {token!r} (the script's own options go after SCRIPT)")
        else:
            break
    if i >= len(argv):
        raise UsageError(
            "no script given: run [options] SCRIPT [ARGS...] or run [options] -m MODULE [ARGS...]"
        )
    options.script, options.args = argv[i], list(argv[i + 1 :])
    validate(options)
    return options
