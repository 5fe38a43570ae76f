"""The flat layout's module paths still work, and no module hides behind a name it exports.

The package moved into folders by concern (guarded_linear/, watching/, training/, capsule/,
models/); users' code, docs and pickles name the old paths (cublas_guard_ext.nn, .ops, ...).
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import types

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext import _module_aliases

OLD_TO_NEW = {
    f"cublas_guard_ext.{old}": f"cublas_guard_ext.{new}" for old, new in _module_aliases.MOVED.items()
}


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_an_old_path_is_the_module_that_holds_the_code(old: str) -> None:
    new = importlib.import_module(OLD_TO_NEW[old])
    assert importlib.import_module(old) is new  # the same object: a monkeypatch reaches the code
    assert sys.modules[old] is new


def test_the_old_paths_read_as_before() -> None:
    import cublas_guard_ext.nn
    import cublas_guard_ext.ops as ops
    from cublas_guard_ext.capsule_replay import VARIANTS
    from cublas_guard_ext.modes import current
    from cublas_guard_ext.swap import replace_linear
    from cublas_guard_ext.training import NON_FINITE_REFUSALS, TrainingGuard

    assert cublas_guard_ext.nn.SafeLinear is cg.SafeLinear and cg.nn.SafeConv1D is cg.SafeConv1D
    assert ops.check is cg.check and ops.linear is cg.linear and cg.ops.scan is cg.scan
    assert replace_linear is cg.replace_linear and TrainingGuard is cg.TrainingGuard
    assert current() == "sync" and VARIANTS[0] == "as recorded" and NON_FINITE_REFUSALS
    assert cg.capsule.load is importlib.import_module("cublas_guard_ext.capsule.contents").load
    assert cg._training_state._RngState.__module__ == "cublas_guard_ext.training.state"


def test_an_error_pickled_under_its_old_module_loads() -> None:
    # errors/runtime.py and errors/steps.py were renamed apart from run/runtime.py and run/steps.py
    import cublas_guard_ext.errors.runtime as runtime

    assert cg.errors.runtime is runtime and runtime.CublasError is cg.CublasError
    for cls, old in ((cg.CublasError, b"runtime"), (cg.NonFiniteStepError, b"steps")):
        new = cls.__module__.rpartition(".")[2].encode()
        data = pickle.dumps(cls, protocol=0).replace(b"errors." + new + b"\n", b"errors." + old + b"\n")
        assert b"cublas_guard_ext.errors." + old in data and pickle.loads(data) is cls


def test_a_pickle_naming_an_old_path_loads() -> None:
    cls = cg._training_state._RngState  # an object pickled in a checkpoint names its class
    data = pickle.dumps(cls, protocol=0).replace(b"training.state\n", b"_training_state\n")
    assert data.startswith(b"ccublas_guard_ext._training_state\n_RngState\n")
    assert pickle.loads(data) is cls


def test_the_public_names_stay_what_they_are() -> None:
    from cublas_guard_ext import guard, linear, replay, watch

    assert isinstance(watch, type) and watch.__name__ == "watch"
    assert callable(linear) and callable(guard) and callable(replay)
    assert cg.watch is watch and cg.linear is linear


def test_import_watch_as_gives_the_class_and_the_module_has_its_own_name() -> None:
    """``cublas_guard_ext.watch`` is the public class (Python's ``import a.b as c`` reads the
    attribute first, so the old module path cannot also be the module there); the module is
    ``cublas_guard_ext.watching.session``, a name nothing hides."""
    import cublas_guard_ext.watch as w
    import cublas_guard_ext.watching.session as session

    assert w is cg.watch
    assert isinstance(session, types.ModuleType) and session.watch is cg.watch
    assert sys.modules["cublas_guard_ext.watch"] is session  # old pickles and imports by path


def _attribute_chain(name: str) -> object:
    value: object = importlib.import_module("cublas_guard_ext")
    for part in name.split(".")[1:]:
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(
    "folder",
    ["guarded_linear", "watching", "training", "capsule", "models", "errors", "_native", "run", "tools"],
)
def test_no_module_hides_behind_a_name_its_package_exports(folder: str) -> None:
    """Every module of a folder is reached by attribute from the package, as by import."""
    package = importlib.import_module(f"cublas_guard_ext.{folder}")
    assert _attribute_chain(package.__name__) is package
    for info in __import__("pkgutil").iter_modules(package.__path__):
        if info.name.startswith("_") and folder in ("run", "tools"):
            continue  # the bootstrap folder and the replay worker run as scripts
        name = f"{package.__name__}.{info.name}"
        module = importlib.import_module(name)
        assert _attribute_chain(name) is module, name


@pytest.mark.slow
def test_a_fresh_process_imports_every_old_path() -> None:
    code = "import importlib\n" + "".join(f"importlib.import_module({old!r})\n" for old in sorted(OLD_TO_NEW))
    code += "import cublas_guard_ext.nn as m; assert m.SafeLinear.__module__ == 'cublas_guard_ext.guarded_linear.nn'\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr


def test_models_saved_now_name_the_new_paths(tmp_path) -> None:
    path = tmp_path / "m.pt"
    torch.save(torch.nn.Sequential(cg.SafeLinear(3, 2)), path)
    assert type(torch.load(path, weights_only=False)[0]) is cg.SafeLinear
