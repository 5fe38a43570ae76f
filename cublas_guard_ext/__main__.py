"""``python -m cublas_guard_ext {demo,doctor,bench,replay,run,build}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # everything after SCRIPT is the script's: not argparse's to read
        from .run import cli

        return cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m cublas_guard_ext", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cublas_guard_ext {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a guarded model, show the guard catching bad inputs, time it")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--no-bench", action="store_true", help="skip the timing section")
    sub.add_parser("bench", help="a short SafeLinear vs nn.Linear timing on this machine")
    doctor = sub.add_parser("doctor", help="report the CUDA/cuBLAS environment and what is wrong with it")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--no-probe", action="store_true", help="skip the live GEMM on the GPU")
    doctor.add_argument(
        "--capsule",
        metavar="PATH",
        help="also compare this machine with the environment a failure capsule recorded",
    )
    replay = sub.add_parser(
        "replay", help="run a failure capsule's cuBLAS call alone and say whether it fails by itself"
    )
    replay.add_argument("capsule", metavar="CAPSULE", help="the capsule file a failing call wrote")
    replay.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser(
        "build",
        help="compile the version-locked library for this torch (watch needs it where the wheel's is another torch's)",
    )
    sub.add_parser(
        "run",
        help="run an unmodified script (or -m MODULE) under the guard; `run --help` for its options",
    )
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .tools import demo as demo_module

        return demo_module.run(steps=args.steps, benchmark=not args.no_bench)
    if args.command == "bench":
        from .tools import bench
        from .tools.demo import _device

        print(bench.quick(_device()))
        return 0
    if args.command == "doctor":
        from .tools import doctor as doctor_module

        return doctor_module.main(as_json=args.json, probe=not args.no_probe, capsule=args.capsule)
    if args.command == "build":
        from .tools import build_locked

        return build_locked.main()
    if args.command == "replay":
        from .capsule import replaying as replay_module

        return replay_module.main(args.capsule, as_json=args.json)
    parser.error(f"unknown command {args.command}")
    return 2


def _version() -> str:
    from . import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
