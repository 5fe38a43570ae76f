"""``python -m cublas_guard_ext run``: unmodified scripts (written to tmp_path) in subprocesses.

Most tests start the script the way ``run`` leaves it after its exec: ``python SCRIPT`` with
the environment :func:`cli.environment` builds (the bootstrap first on PYTHONPATH, the options in
CUBLAS_GUARD_RUN); that spares each test a second interpreter importing torch. The tests named
``..._through_the_command`` go through ``python -m cublas_guard_ext run`` itself.
The distributed test is in tests/test_run_distributed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cublas_guard_ext.run import cli, options

pytestmark = pytest.mark.slow
TIMEOUT = 240


def _env(**extra: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for key in (
        "CUBLAS_GUARD_RUN",
        "CUBLAS_GUARD_CAPSULE_DIR",
        "CUBLAS_GUARD_EXT_FAULT",
        "RANK",
        "WORLD_SIZE",
    ):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def write(folder: Path, name: str, code: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return path


def run_script(
    tmp_path: Path,
    script: Path,
    *flags: str,
    args: tuple[str, ...] = (),
    through_command: bool = False,
    **env: str,
) -> subprocess.CompletedProcess:
    """The script under ``run FLAGS``; reports in tmp_path/reports unless --report is given."""
    flags = flags if "--report" in flags else (*flags, "--report", str(tmp_path / "reports"))
    if through_command:
        command = [sys.executable, "-m", "cublas_guard_ext", "run", *flags, str(script), *args]
        environ = _env(**env)
    else:
        opts = options.parse([*flags, str(script), *args])
        opts.report_dir = os.path.abspath(opts.report_dir)
        opts.main_pid = None  # set below: the child's PID is not known before it starts
        opts.capsules_in_report = "CUBLAS_GUARD_CAPSULE_DIR" not in env
        command = [sys.executable, str(script), *args]
        environ = cli.environment(opts, _env(**env))
    return subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT, env=environ, cwd=str(tmp_path)
    )


def the_error_comes_last(stderr: str, headline: str) -> None:
    """The report's line comes before the traceback, and the traceback ends with the error."""
    before, _, after = stderr.rpartition("Traceback (most recent call last):")
    assert "cublas_guard_ext run: incident report: " in before, stderr
    assert "incident report" not in after and headline in after.split("\n  File ")[-1], stderr


def reports(tmp_path: Path, folder: str = "reports") -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / folder).glob("*.json"))]


MODEL = """
import torch
from torch import nn

class LogAct(nn.Module):
    def forward(self, x):
        return torch.log(x)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.act = LogAct()
        self.head = nn.Linear(16, 2)
        with torch.no_grad():  # tanh's output stays positive: log is finite unless a test plants it
            self.encoder[0].bias.fill_(10.0)

    def forward(self, x):
        return self.head(self.act(self.encoder(x)))
"""


# -- the command line -------------------------------------------------------------------------
def test_the_mode_defaults_to_the_environments_then_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_GUARD_MODE", raising=False)
    assert options.parse(["x.py"]).mode == "sync"
    monkeypatch.setenv("CUBLAS_GUARD_MODE", "async")
    assert options.parse(["x.py"]).mode == "async"
    assert options.parse(["--mode", "off", "x.py"]).mode == "off"
    monkeypatch.setenv("CUBLAS_GUARD_MODE", "bogus")  # not a mode: run's own default
    assert options.parse(["x.py"]).mode == "sync"


def test_options_after_the_script_belong_to_the_script() -> None:
    opts = options.parse(["--mode=async", "--watch", "train.py", "--watch", "-m", "x"])
    assert (opts.mode, opts.watch, opts.script, opts.args) == (
        "async",
        True,
        "train.py",
        ["--watch", "-m", "x"],
    )
    opts = options.parse(["--raise-on-nonfinite-steps", "-mpkg.mod", "--lr", "3"])
    assert (opts.module, opts.args, opts.nonfinite_steps) == ("pkg.mod", ["--lr", "3"], "raise")
    assert opts.target() == ["-m", "pkg.mod", "--lr", "3"]
    assert options.parse(["--", "-weird.py"]).script == "-weird.py"
    assert options.parse(["--help"]) is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--frobnicate", "x.py"], "unknown option '--frobnicate'"),
        (["--mode", "fast", "x.py"], "--mode must be one of sync, async, off, got 'fast'"),
        (["--watch"], "no script given"),
        (["--skip-nonfinite-steps", "--raise-on-nonfinite-steps", "x.py"], "exclude each other"),
        (["--mode", "off", "--watch", "x.py"], "--watch cannot work with --mode off"),
        (["-m"], "-m needs a module name"),
        (["--report"], "--report needs a value"),
    ],
)
def test_a_bad_command_line_is_refused_with_its_reason(argv: list[str], message: str) -> None:
    with pytest.raises(options.UsageError) as info:
        options.parse(argv)
    assert message in str(info.value)


def test_bad_input_through_the_command(tmp_path: Path) -> None:
    """`python -m cublas_guard_ext run` hands its command line to run: exit 2, the usage and one
    reason; nothing runs."""
    out = subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", "run", "--frobnicate", "x.py"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=str(tmp_path),
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines()[0].startswith("usage: python -m cublas_guard_ext run")
    assert out.stderr.strip().splitlines()[-1] == (
        "python -m cublas_guard_ext run: error: unknown option '--frobnicate' (the script's own options go "
        "after SCRIPT)"
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["missing.py"], "the script 'missing.py' does not exist"),
        (["."], "the script '.' is a folder, not a script"),
        (["-"], "reading the script from stdin is not supported"),
    ],
)
def test_a_script_that_is_not_there_is_refused_before_anything_runs(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2  # (an exec would have replaced this process)
    err = capsys.readouterr().err
    assert f"python -m cublas_guard_ext run: error: {message}" in err


def test_help_lists_the_options(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for option in (
        "--mode",
        "--watch",
        "--skip-nonfinite-steps",
        "--raise-on-nonfinite-steps",
        "--report",
        "-m MODULE",
    ):
        assert option in text


# -- the script runs as python would run it ---------------------------------------------------
def test_argv_path_main_and_exit_code_through_the_command(tmp_path: Path) -> None:
    sub = tmp_path / "proj"
    sub.mkdir()
    script = write(
        sub,
        "train.py",
        """
        import json, pickle, sys
        import torch

        def helper():
            return 1

        print(json.dumps({
            "argv": sys.argv, "path0": sys.path[0], "name": __name__,
            "is_main": sys.modules["__main__"].__dict__ is globals(),
            "pickles": pickle.loads(pickle.dumps(helper)) is helper,
            "linear": torch.nn.Linear.forward.__module__,
        }))
        sys.exit(3)
        """,
    )
    out = run_script(tmp_path, script, args=("--lr", "0.1", "--watch"), through_command=True)
    assert out.returncode == 3, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["argv"] == [str(script), "--lr", "0.1", "--watch"]
    assert seen["path0"] == str(sub) and seen["name"] == "__main__"
    assert seen["is_main"] and seen["pickles"]
    assert seen["linear"] == "cublas_guard_ext.run.linear"
    assert "cublas_guard_ext run" not in out.stderr  # nothing went wrong: nothing said
    assert not (tmp_path / "reports").exists() or not list((tmp_path / "reports").glob("*.json"))


def test_minus_m_runs_a_module_as_python_would(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(
        pkg,
        "train.py",
        """
        import json, sys, torch
        print(json.dumps({"argv": sys.argv, "name": __name__, "spec": __spec__.name,
                          "path0": sys.path[0]}))
        """,
    )
    opts = options.parse(["--report", str(tmp_path / "r"), "-m", "pkg.train", "a", "--b"])
    out = subprocess.run(
        [sys.executable, *opts.target()],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=cli.environment(opts, _env()),
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["argv"] == [str(pkg / "train.py"), "a", "--b"]
    assert (seen["name"], seen["spec"], seen["path0"]) == ("__main__", "pkg.train", str(tmp_path))


def test_system_exit_inside_the_script_keeps_its_code_and_writes_no_report(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", "import torch\nraise SystemExit(5)\n")
    out = run_script(tmp_path, script)
    assert out.returncode == 5 and out.stderr == ""
    assert reports(tmp_path) == []


def test_an_uncaught_error_writes_the_report_then_the_traceback_last(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", MODEL + "\nmodel = Model()\nraise KeyError('no such batch')\n")
    out = run_script(tmp_path, script)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "KeyError: 'no such batch'"
    the_error_comes_last(out.stderr, "KeyError: 'no such batch'")
    (data,) = reports(tmp_path)
    assert data["error"]["class"] == "KeyError" and data["where"]["step"] is None


def test_raising_before_torch_is_imported_says_nothing_was_guarded(tmp_path: Path) -> None:
    script = write(tmp_path, "s.py", "import sys\nraise RuntimeError('config missing')\n")
    out = run_script(tmp_path, script, through_command=True)
    assert out.returncode == 1
    assert "the script raised RuntimeError before it imported torch: nothing was guarded" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "RuntimeError: config missing"


def test_an_unwritable_report_folder_is_said_once_and_the_run_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    script = write(tmp_path, "s.py", MODEL + "\nprint(Model().head(torch.rand(2, 16)).shape)\n")
    out = run_script(tmp_path, script, "--report", str(blocker / "r"), through_command=True)
    assert out.returncode == 0 and "torch.Size([2, 2])" in out.stdout
    assert out.stderr.count("cannot write reports to") == 1, out.stderr
    bad = write(tmp_path, "bad.py", MODEL + "\nModel()(__import__('torch').rand(2, 7))\n")
    out = run_script(tmp_path, bad, "--report", str(blocker / "r"))
    assert out.returncode == 1 and "the incident report could not be written to" in out.stderr
    assert "layer encoder.0" in out.stderr  # the facts still said, in one line


def test_the_bootstrap_failing_says_one_line_and_the_script_runs(tmp_path: Path) -> None:
    env = _env(PYTHONPATH=cli.SITE_DIR, CUBLAS_GUARD_RUN='{"mode": "bogus"}')
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print('ran', torch.nn.Linear.forward.__module__)"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ran torch.nn.modules.linear"
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("cublas_guard_ext run: could not install the guard (UsageError: --mode")
    assert line.endswith("the script runs unguarded")


def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    script = write(
        tmp_path,
        "s.py",
        "import os, torch\nprint(os.environ.get('THEIRS_RAN'), torch.nn.Linear.forward.__name__)\n",
    )
    out = run_script(tmp_path, script, PYTHONPATH=str(theirs))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["yes", "guarded_forward"]


# -- what the guard finds ---------------------------------------------------------------------
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


class _Report(HTMLParser):
    """What a test needs from the HTML: the marked birth op, the modules on the path, the text
    of the statistics section, and that nothing is fetched from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.birth_ops: list[str] = []
        self.birth_modules: list[str] = []
        self.path_modules: list[str] = []
        self.external: list[str] = []
        self.stats_text: list[str] = []
        self._in_stats = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if a.get("id") == "statistics":
            self._in_stats = 1
        elif self._in_stats and tag == "section":
            self._in_stats += 1
        if "data-birth-op" in a:
            self.birth_ops.append(a["data-birth-op"])
        if a.get("class") == "birth" and "data-module" in a:
            self.birth_modules.append(a["data-module"])
        if a.get("class") == "path" and "data-module" in a:
            self.path_modules.append(a["data-module"])
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//")) or (tag == "link" and key == "href"):
                self.external.append(a[key])

    def handle_endtag(self, tag: str) -> None:
        if self._in_stats and tag == "section":
            self._in_stats -= 1

    def handle_data(self, data: str) -> None:
        if self._in_stats:
            self.stats_text.append(data)


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
    page = _Report()
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


def test_spawn_dataloader_workers_pickle_the_scripts_function_and_are_guarded(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "s.py",
        """
        import torch
        from torch.utils.data import DataLoader

        def collate(batch):
            guarded = torch.nn.Linear.forward.__module__ == "cublas_guard_ext.run.linear"
            return torch.tensor(batch, dtype=torch.float32), guarded

        if __name__ == "__main__":
            loader = DataLoader(list(range(6)), batch_size=3, num_workers=1, collate_fn=collate,
                                multiprocessing_context="spawn")
            print([(b.tolist(), g) for b, g in loader])
        """,
    )
    out = run_script(tmp_path, script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[([0.0, 1.0, 2.0], True), ([3.0, 4.0, 5.0], True)]"


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


def test_a_process_that_never_imports_torch_pays_nothing(tmp_path: Path) -> None:
    """The bootstrap imports neither torch nor this package: a Python subprocess of the run that
    does not use torch (a tool, a helper script) starts as it would."""
    opts = options.parse(["--watch", "x.py"])
    code = "import sys; print('torch' in sys.modules, 'cublas_guard_ext' in sys.modules, sys.meta_path[0].__class__.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli.environment(opts, _env()),
    )
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.split() == ["False", "False", "_AfterTorchImport"]


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
            watching = sys.modules["cublas_guard_ext.watch"]._is_active()
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
