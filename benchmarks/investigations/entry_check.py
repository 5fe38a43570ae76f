"""watch's entry check of the parameters on one CPU thread: the fused scan against the
``_foreach_norm(inf)`` it replaced (2026-12-02), on all-MiniLM-L6-v2's 103 parameters.

    python benchmarks/investigations/entry_check.py

Both answer "is every value finite?" with one host read; the figures are the mean of 10 calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent.parent, HERE.parent):  # the package's checkout, and the harness package
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def main() -> None:
    import torch

    import cublas_guard_ext  # noqa: F401 - loads the native module

    from harness import training_step

    torch.set_num_threads(1)
    native = sys.modules["cublas_guard_ext._C"]
    ap = argparse.ArgumentParser()
    training_step.add_options(ap)
    w = training_step.workload(ap.parse_args([]))
    assert not isinstance(w, str), w
    params = list(w.model.parameters())

    def foreach_norm() -> bool:
        with torch.no_grad():
            return bool(torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf")))).all())

    def time_ms(fn, n: int = 10) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e3

    print(f"{len(params)} parameters, {sum(p.numel() for p in params):,} values")
    print(f"_foreach_norm(inf), isfinite, one read: {time_ms(foreach_norm):.1f} ms")
    print(
        f"_C._watch_all_finite (the fused scan each, one read): {time_ms(lambda: native._watch_all_finite(params)):.1f} ms"
    )


if __name__ == "__main__":
    main()
