"""What the silent-corruption checks cost on a healthy step (target <= 1.03x TrainingGuard alone).

One training step of all-MiniLM-L6-v2 (8 sequences x 56 tokens, MSE on the embeddings,
AdamW; the harness of training_guard_bench.py) through ``TrainingGuard.step`` alone and with
``silent_corruption=SilentCorruptionChecks(replica_every=1)``: every step folds every
parameter into its signature, gathers ``[flag, signatures...]`` over a process group and
judges the loss and gradient norm for a spike, with one host read. The process group is a
one-rank gloo group in this process (the gather of a few hundred int64 is what crosses the
wire with more ranks; what is measured is the signatures, the packing and the judgement).
Each variant trains its own copy of the model, interleaved (A, B, A, B, ...); medians of
wall and process CPU time. Printed too: the checks' own work on the last step, timed alone.

    python benchmarks/silent_corruption_bench.py --threads 1        # ~3-5 minutes on a CPU
    python benchmarks/silent_corruption_bench.py --device cuda      # a GPU, if there is one
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # the package's checkout, and the harness package
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def main(argv: list[str] | None = None) -> int:
    from harness import training_step

    ap = argparse.ArgumentParser(
        prog="python benchmarks/silent_corruption_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    training_step.add_options(ap)
    ap.add_argument("--every", type=int, default=1, help="replica_every (default 1: every step)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import cublas_guard_ext as cg

    w = training_step.workload(args)
    if isinstance(w, str):
        print(w)
        return 2
    backend = "gloo"
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(backend, init_method=f"file://{folder}/pg", rank=0, world_size=1)
        try:
            names = ["TrainingGuard", "+ silent corruption"]
            models = {n: copy.deepcopy(w.model) for n in names}
            opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-5) for n, m in models.items()}
            checks = cg.SilentCorruptionChecks(replica_every=args.every, replica_group=dist.group.WORLD)
            guards = {
                "TrainingGuard": cg.TrainingGuard(models["TrainingGuard"], opts["TrainingGuard"]),
                names[1]: cg.TrainingGuard(models[names[1]], opts[names[1]], silent_corruption=checks),
            }

            def variant(name: str):
                model, opt, guard = models[name], opts[name], guards[name]

                def closure():
                    opt.zero_grad(set_to_none=True)
                    loss = w.loss(model)
                    loss.backward()
                    return loss

                return lambda: guard.step(closure)

            t = training_step.interleaved({n: variant(n) for n in names}, w.rounds, args.warmup, w.sync)
            print(training_step.headline(w, f"AdamW, replica checks every {args.every} step(s)", t, w.rounds))
            print("\n".join(training_step.table(t, base="TrainingGuard")))
            assert checks.verdicts == [], checks.verdicts
            assert checks.replicas is not None and checks.replicas.checks > 0
            # The checks' own work, alone, on the last step's values: the signatures of every
            # parameter, the spike judgement, the gather and the one read.
            flag = torch.zeros((), device=args.device)
            loss = torch.ones((), device=args.device)
            own = []
            for _ in range(w.rounds):
                c0 = time.process_time()
                checks.exchange(flag, loss)
                own.append(time.process_time() - c0)
            own_ms = statistics.median(own) * 1e3
            n_params = sum(p.numel() for p in models[names[1]].parameters())
            print(
                f"the checks' own work per step (signatures of {n_params / 1e6:.1f}M parameters, spike "
                f"judgement, gather, one read), alone: {own_ms:.1f} ms CPU = "
                f"{own_ms / (t.median_cpu('TrainingGuard') * 1e3):.1%} of the TrainingGuard step's CPU median"
            )
            rw, rc = t.ratio(names[1], "TrainingGuard")
            print(f"ratio {names[1]} / TrainingGuard: wall {rw:.3f}x, CPU {rc:.3f}x (target <= 1.03x)")
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
