"""What SafeLinear's forward pays for remembering the guarded layer that ran last on the thread
(``guarded_linear/error_hooks.py``'s ``LAST_RAN.label = label``: a refused float16 input names it), measured in place.

A/B in one process, on one layer's weights: the forward as it is now against the same forward
without the record (the pre-record forward, kept here), nn.Linear as the reference, M=1, K=N=16,
one torch thread, no grad. Rounds interleave A/B/C (alternating order); the figure is the median
of the per-round paired differences (after - before), with its interquartile range, and the
ratios of medians to nn.Linear. Needs the prebuilt _C (the fast eager entry): the JIT build has
none, and its slower path would hide the difference.

    chrt -f 1 python benchmarks/investigations/last_ran_record.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.guarded_linear import nn as cgnn

torch.set_num_threads(1)
if cgnn._fast_linear is None:
    sys.exit("needs the prebuilt _C (the fast eager entry); this is a JIT build")
_fast_linear, _guarded_linear = cgnn._fast_linear, cgnn._guarded_linear


def forward_without_record(self: cg.SafeLinear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    weight, bias, label = self.weight, self.bias, self.guard_label
    if self.dtype_policy == "strict":
        out = _fast_linear(input, weight, bias, label, self.mode, self.scan_grad)
        if out is not None:
            return out
    return _guarded_linear(
        input,
        weight,
        bias,
        layer=label,
        mode=self.mode,
        scan_grad=self.scan_grad,
        dtype_policy=self.dtype_policy,
    )


class WithoutRecord(cg.SafeLinear):
    _eager_forward = forward_without_record


def main(rounds: int) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(16, 16)
    x = torch.randn(1, 16)
    calls = 400
    for mode in ("off", "async", "sync"):
        after, before = cg.SafeLinear(16, 16, mode=mode, name="l"), WithoutRecord(16, 16, mode=mode, name="l")
        for m in (after, before):
            m.load_state_dict(ref.state_dict())
        fns = {"nn.Linear": ref, "before": before, "after": after}
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for r in range(rounds):
                for k, f in fns.items() if r % 2 else reversed(list(fns.items())):
                    t0 = time.perf_counter_ns()
                    for _ in range(calls):
                        f(x)
                    times[k].append((time.perf_counter_ns() - t0) / calls)
        med = {k: statistics.median(v) for k, v in times.items()}
        diffs = sorted(a - b for a, b in zip(times["after"], times["before"]))
        q = len(diffs) // 4
        print(
            f"{mode:5s}: nn.Linear {med['nn.Linear']:.0f} ns; without the record {med['before'] / med['nn.Linear']:.2f}x, "
            f"with it {med['after'] / med['nn.Linear']:.2f}x; paired difference median {statistics.median(diffs):+.0f} ns "
            f"(IQR {diffs[q]:+.0f} .. {diffs[-q - 1]:+.0f}, {rounds} rounds of {calls} calls)"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 301)
