"""``run``'s findings in unmodified scripts (subprocesses; see tests/run/test_run.py for how a script
is started): a shape mismatch, a NaN born in forward and in backward under --watch (also through
DDP), an injected cuBLAS failure and its capsule, the optimizer-step options, async mode, compile,
trace and export, and DataLoader workers forked during a watch block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.run_scripts import MODEL, ReportPage, reports, run_script, the_error_comes_last, write

pytestmark = pytest.mark.slow


def test_a_shape_mismatch_at_the_first_linear_names_it(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", MODEL + "\nModel()(torch.rand(3, 5))\n")
    out = run_script(tmp_path, script)
    assert out.returncode == 1
    the_error_comes_last(out.stderr, "cublas_guard_ext.errors.inputs.ShapeMismatchError: layer 'encoder.0'")
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "ShapeMismatchError"
    assert data["where"]["layer"] == "encoder.0" and data["where"]["module"] == "encoder.0"
    tree = {n["name"]: n for n in data["module_tree"]["nodes"]}
    assert tree["encoder.0"]["birth"] and tree["encoder"]["on_path"] and not tree["head"]["on_path"]


def test_watch_names_a_planted_log_of_a_negative(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "s.py",
        MODEL
        + """
torch.manual_seed(0)
model = Model()
prep = nn.Identity()  # called first each step: a module without parameters is not the model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = prep(torch.rand(4, 8))
    with torch.no_grad():
        model.encoder[0].bias.fill_(10.0 if step < 2 else -10.0)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
""",
    )
    out = run_script(tmp_path, script, "--watch")
    assert out.returncode == 1, out.stderr
    the_error_comes_last(out.stderr, "NonFiniteOutputError: watch: aten.log.default in module 'act'")
    (data,) = reports(tmp_path)
    where = data["where"]
    assert where["op"].startswith("aten.log") and where["module"] == "act"
    assert where["phase"] == "forward" and where["step"] == 3
    stats = data["statistics"]
    assert stats["nan_count"] > 0 and stats["posinf_count"] == 0 and stats["counts_line"].startswith("NaN ")
    page = ReportPage()
    page.feed(Path(data["report"]).read_text())
    assert page.birth_ops == [where["op"]] and page.birth_modules == ["act"]
    assert "" in page.path_modules  # the model itself, on the way to the output
    stats_text = " ".join(page.stats_text)
    assert f"NaN {stats['nan_count']}" in stats_text and "aten.log" in stats_text
    assert page.external == []


def test_an_injected_cublas_failure_is_named_and_writes_its_capsule(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", MODEL + "\nModel()(torch.rand(3, 8))\n")
    out = run_script(tmp_path, script, CUBLAS_GUARD_EXT_TESTING="1", CUBLAS_GUARD_EXT_FAULT="gemm:13:1")
    assert out.returncode == 1
    the_error_comes_last(out.stderr, "CublasError: layer 'encoder.0': CUBLAS_STATUS_EXECUTION_FAILED")
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "CublasError" and data["where"]["layer"] == "encoder.0"
    capsule = Path(data["capsule"])
    assert capsule.is_file() and capsule.parent.parent == tmp_path / "reports" / "capsules"
    assert data["stem"] in capsule.parent.name
    assert data["cublas_call"]["status_name"] == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert {"m", "n", "k", "lda"} <= set(data["cublas_call"])
    commands = [c["command"] for c in data["next_commands"]]
    assert f"python -m cublas_guard_ext replay {capsule}" in commands
    assert any(c.startswith("PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer python ") for c in commands)
    assert any(c.startswith("CUDA_LAUNCH_BLOCKING=1 python -m cublas_guard_ext run ") for c in commands)
    assert data["doctor"]["summary"] is not None
    assert f"python -m cublas_guard_ext replay {capsule}" in Path(data["report"]).read_text()


STEPS = (
    MODEL
    + """
import sys
torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 4):
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.rand(4, 8) + 1).pow(2).mean()
    if step == 2:
        loss = loss * float("nan")
    opt.zero_grad(); loss.backward(); opt.step()
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    print(step, "unchanged" if same else "updated")
"""
)


def test_skip_nonfinite_steps_skips_exactly_the_bad_step(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", STEPS)
    out = run_script(tmp_path, script, "--skip-nonfinite-steps")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["1 updated", "2 unchanged", "3 updated"]
    assert "optimizer step 2 skipped: non-finite gradients in 4 parameters" in out.stderr


def test_raise_on_nonfinite_steps_names_the_step(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", STEPS)
    out = run_script(tmp_path, script, "--raise-on-nonfinite-steps")
    assert out.returncode == 1
    the_error_comes_last(
        out.stderr, "NonFiniteGradientsError: optimizer step 2: non-finite gradients in 4 parameters"
    )
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "NonFiniteGradientsError" and data["where"]["step"] == 2
    assert out.stdout.split() == ["1", "updated"]


def test_without_step_options_a_nan_step_runs_as_it_would(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", STEPS)
    out = run_script(tmp_path, script, "--mode", "off")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["1 updated", "2 updated"]


def test_compile_traces_the_guarded_layers_without_a_graph_break(tmp_path: Path) -> None:
    """No dispatch mode, no per-call hook: Dynamo traces the guarded op in one graph, the layers
    keep their names (torch.compile names them), and the result is F.linear's; torch.jit.script
    still scripts the model, and what torch.jit.trace and torch.export record is aten's linear."""
    script = write(
        tmp_path,
        "s.py",
        """
        import json
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch._dynamo.utils import counters

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        x = torch.randn(3, 8)
        y = torch.compile(model, backend="eager")(x)
        breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
        w = [p.double() for p in model.parameters()]
        ref = F.linear(F.linear(x.double(), w[0], w[1]).relu(), w[2], w[3])
        scripted = torch.jit.script(model)  # TorchScript compiles the patched forward's scripted branch
        assert torch.allclose(scripted(x), y, atol=1e-6)
        # artifacts written for elsewhere record nn.Linear's own op, not this extension's
        traced = str(torch.jit.trace(model, x).inlined_graph)
        exported = str(torch.export.export(model, (x,)).graph_module.code)
        assert "aten::linear" in traced and "cublas_guard::" not in traced, traced
        assert "aten.linear" in exported and "cublas_guard" not in exported, exported
        print(json.dumps({
            "breaks": breaks, "graphs": graphs,
            "names": [m._cublas_guard_run_name for m in model if isinstance(m, nn.Linear)],
            "error": float((y.double() - ref).abs().max()),
        }))
        """,
    )
    out = run_script(tmp_path, script)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["breaks"] == 0 and seen["graphs"] == 1 and seen["names"] == ["0", "2"]
    assert seen["error"] < 1e-5


def test_async_mode_reports_the_layer_before_the_optimizer_step(tmp_path: Path) -> None:
    """async: no host read in the forward; the finding is raised at the latest before the step."""
    script = write(
        tmp_path,
        "s.py",
        """
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.rand(4, 8)
        x[1, 3] = float("inf")
        loss = model(x).sum()
        print("forward returned", flush=True)
        opt.step()
        print("stepped")
        """,
    )
    out = run_script(tmp_path, script, "--mode", "async")
    assert out.returncode == 1 and out.stdout.split("\n")[0] == "forward returned", out.stderr
    the_error_comes_last(out.stderr, "NonFiniteInputError: layer '0'")
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "NonFiniteInputError" and data["where"]["layer"] == "0"
    assert data["statistics"]["posinf_count"] == 1 and data["statistics"]["nan_count"] == 0


def test_watch_names_a_nan_born_in_backward(tmp_path: Path) -> None:
    """sqrt at 0: finite forward, an infinite gradient born in backward in module 'act'."""
    script = write(
        tmp_path,
        "s.py",
        """
        import torch
        from torch import nn

        class SqrtAct(nn.Module):
            def forward(self, x):
                return torch.sqrt(torch.relu(x))

        model = nn.Sequential()
        model.add_module("fc", nn.Linear(8, 8))
        model.add_module("act", SqrtAct())
        model.add_module("out", nn.Linear(8, 1))
        with torch.no_grad():
            model.fc.weight.zero_(); model.fc.bias.zero_()  # relu(0) = 0: sqrt's gradient there is Inf
        model(torch.rand(2, 8)).sum().backward()
        """,
    )
    out = run_script(tmp_path, script, "--watch")
    assert out.returncode == 1, out.stderr
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "NonFiniteOutputError"
    assert data["where"]["phase"] == "backward" and data["where"]["module"] == "act"
    assert data["path"]["steps"][0].endswith("(born here, backward)")
    assert data["statistics"]["posinf_count"] + data["statistics"]["nan_count"] > 0


def test_watch_looks_through_ddp(tmp_path: Path) -> None:
    """A DDP-wrapped model (one gloo rank): the modules are named as the model's own ('act', not
    'module.act'), and the block still ends at each step."""
    script = write(
        tmp_path,
        "s.py",
        MODEL
        + """
import tempfile, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = DDP(Model())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 4):
    with torch.no_grad():
        model.module.encoder[0].bias.fill_(10.0 if step < 3 else -10.0)
    loss = model(torch.rand(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
""",
    )
    out = run_script(tmp_path, script, "--watch")
    assert out.returncode == 1, out.stderr
    (data,) = reports(tmp_path)
    assert (data["where"]["op"], data["where"]["module"], data["where"]["step"]) == (
        "aten.log.default",
        "act",
        3,
    )
    assert [n["name"] for n in data["module_tree"]["nodes"]][:2] == ["", "encoder"]


def test_an_async_finding_still_pending_at_exit_is_reported(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "s.py",
        """
        import torch
        layer = torch.nn.Linear(4, 2)
        layer(torch.full((3, 4), float("nan")))
        print("done")
        """,
    )
    out = run_script(tmp_path, script, "--mode", "async")
    assert out.stdout.strip() == "done"
    assert "at exit, an async-mode finding was still pending" in out.stderr
    assert "NaN" in out.stderr and "layer 'layer'" in out.stderr  # named after its variable
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "NonFiniteInputError" and data["where"]["layer"] == "layer"
    assert data["statistics"]["nan_count"] == 12


def test_a_forked_dataloader_worker_does_not_watch_the_parents_model(tmp_path: Path) -> None:
    """The worker forks while a block is open (between forward and backward); the child ends the
    inherited block, so the worker's own ops (a NaN made on purpose in collate) are not watched."""
    script = write(
        tmp_path,
        "s.py",
        """
        import sys
        import torch
        from torch import nn
        from torch.utils.data import DataLoader

        def collate(batch):
            watching = sys.modules["cublas_guard_ext.watching.session"]._is_active()
            return torch.log(torch.stack(batch) - 100), watching

        model = nn.Sequential(nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [torch.full((4,), float(i)) for i in range(8)]
        for step in range(2):
            out = model(torch.rand(2, 4))
            loader = DataLoader(data, batch_size=4, num_workers=1, collate_fn=collate,
                                multiprocessing_context="fork")
            seen = [watching for _, watching in loader]
            loss = out.sum(); opt.zero_grad(); loss.backward(); opt.step()
            print(seen)
        """,
    )
    out = run_script(tmp_path, script, "--watch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[False, False]", "[False, False]"]


def test_a_silent_corruption_verdict_reaches_the_report_and_the_exit_code(tmp_path: Path) -> None:
    """TrainingGuard(silent_corruption=...) inside a script under run: the report carries the
    verdict (HTML and JSON), the tracker its line, and exit_codes=True ends the process with
    16 after the report and the traceback."""
    script = write(
        tmp_path,
        "s.py",
        MODEL
        + """
import torch.nn.functional as F
import cublas_guard_ext as cg
from cublas_guard_ext.training.fault_injection import GemmBitFlip
torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
checks = cg.SilentCorruptionChecks(check_every=3, tracker="sdc.jsonl", exit_codes=True)
guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
x, y = torch.rand(4, 8), torch.rand(4, 2)
def closure():
    opt.zero_grad(); loss = F.mse_loss(model(x), y); loss.backward(); return loss
guard.step(closure); guard.step(closure)
with GemmBitFlip(ops=["cublas_guard.linear"], shape=(4, 2), bit=3, times=1):
    guard.step(closure)
""",
    )
    out = run_script(tmp_path, script)
    assert out.returncode == 16, out.stderr[-3000:]
    the_error_comes_last(
        out.stderr, "cublas_guard_ext.errors.corruption.SilentCorruptionError: training step 3: silent data"
    )
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "SilentCorruptionError"
    verdict = data["verdict"]
    assert (verdict["verdict"], verdict["step"], verdict["exit_code"]) == ("transient", 3, 16)
    assert verdict["where"]["module"] == "head" and verdict["where"]["phase"] == "forward"
    assert verdict["where"]["gemm"] == "forward GEMM (input x weight^T + bias), in Linear"
    assert verdict["capsule"] and Path(verdict["capsule"]).exists()
    page = Path(data["report"]).read_text()
    assert '<section id="verdict">' in page and "transient" in page
    (line,) = [json.loads(x) for x in (tmp_path / "sdc.jsonl").read_text().splitlines()]
    assert line["verdict"] == "transient" and line["where"]["module"] == "head"
