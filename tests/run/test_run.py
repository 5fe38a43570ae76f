"""``python -m cublas_guard_ext run``: unmodified scripts (written to tmp_path) in subprocesses.

Most tests start the script the way ``run`` leaves it after its exec: ``python SCRIPT`` with
the environment :func:`cli.environment` builds (the bootstrap first on PYTHONPATH, the options in
CUBLAS_GUARD_RUN); that spares each test a second interpreter importing torch. The tests named
``..._through_the_command`` go through ``python -m cublas_guard_ext run`` itself.
Here: the command line, the script run as Python runs it, the bootstrap. What the guard finds is
in tests/run/test_run_findings.py, the distributed run in tests/run/test_run_distributed.py, the report's
facts and pages (in-process) in tests/run/test_run_report.py; they share the helpers below.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cublas_guard_ext.run import cli, options

from helpers.run_scripts import MODEL, TIMEOUT, reports, run_script, script_env, the_error_comes_last, write

pytestmark = pytest.mark.slow


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
        env=script_env(),
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
        env=cli.environment(opts, script_env()),
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["argv"] == [str(pkg / "train.py"), "a", "--b"]
    assert (seen["name"], seen["spec"], seen["path0"]) == ("__main__", "pkg.train", str(tmp_path))


@pytest.mark.parametrize("safe_path", ["", "1"])
def test_the_script_sees_the_sys_path_plain_python_gives_it(tmp_path: Path, safe_path: str) -> None:
    """The bootstrap folder is on PYTHONPATH for subprocesses, never on the script's sys.path:
    under PYTHONSAFEPATH it would otherwise become sys.path[0]."""
    script = write(tmp_path, "paths.py", "import json, sys\nprint(json.dumps(sys.path))\n")
    extra = {"PYTHONSAFEPATH": safe_path or None}
    plain = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=script_env(**extra),
        cwd=str(tmp_path),
    )
    guarded = run_script(tmp_path, script, **{k: v for k, v in extra.items() if v is not None})
    assert plain.returncode == 0 and guarded.returncode == 0, guarded.stderr
    assert json.loads(guarded.stdout.strip().splitlines()[-1]) == json.loads(
        plain.stdout.strip().splitlines()[-1]
    )


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
    env = script_env(PYTHONPATH=cli.SITE_DIR, CUBLAS_GUARD_RUN='{"mode": "bogus"}')
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print('ran', torch.nn.Linear.forward.__module__)"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=str(tmp_path),  # `-c` puts the cwd first on sys.path: not a source tree's package
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
        env=cli.environment(opts, script_env()),
        cwd=str(tmp_path),
    )
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.split() == ["False", "False", "_AfterTorchImport"]
