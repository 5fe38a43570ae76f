"""The bootstrap of ``python -m cublas_guard_ext run``: Python imports this file at start-up in
every process whose PYTHONPATH starts with this folder (the script, torchrun's ranks,
DataLoader workers, subprocesses), before the script's first line.

With ``CUBLAS_GUARD_RUN`` set it installs an import hook and nothing else: when the process
imports torch, the guard is installed right after torch's own import finishes
(``cublas_guard_ext.run.runtime.install``). Nothing is imported earlier, so processes that never
use torch pay nothing, and a script that sets ``CUDA_VISIBLE_DEVICES`` or thread counts before
``import torch`` keeps working. If installing fails, one line says so and the script runs
unguarded. Any other ``sitecustomize`` the environment had is run afterwards, as if this one
were not there. This is not torch's backend autoload: a failure here never breaks
``import torch``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_ENV_VAR = "CUBLAS_GUARD_RUN"
_HERE = os.path.dirname(os.path.abspath(__file__))
_state = {"installed": False, "failed": False}


def _say(message: str) -> None:
    try:
        print(f"cublas_guard_ext run: {message}", file=sys.stderr, flush=True)
    except Exception:  # a closed stderr: nothing to tell
        pass


def _install_guard(text: str) -> None:
    """Right after torch's import: the guard, or one line saying why not."""
    try:
        from cublas_guard_ext.run import runtime

        runtime.install(text)
        _state["installed"] = True
    except BaseException as err:  # any failure: the script runs as it would without run
        _state["failed"] = True
        first = (str(err).splitlines() or [""])[0][:300]
        _say(f"could not install the guard ({type(err).__name__}: {first}); the script runs unguarded")


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds torch like the rest of sys.meta_path, and runs the install after its module ran."""

    def __init__(self, text: str) -> None:
        self.text = text

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (importlib's API)
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(name)  # the rest of sys.meta_path, as the import would
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, text = spec.loader, self.text
        original = loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            original(module)
            _install_guard(text)

        loader.exec_module = exec_module  # this spec's own loader object
        return spec


def _before_torch_excepthook(exc_type, exc, tb):  # noqa: ANN001, ANN202
    """Until torch is imported: say that nothing was guarded (in the script's own process)."""
    try:
        import json  # not cublas_guard_ext.run.options: the package's import would import torch

        options = json.loads(os.environ.get(_ENV_VAR, "{}"))
        if (
            not _state["installed"]
            and options.get("main_pid") == os.getpid()
            and not issubclass(exc_type, KeyboardInterrupt)
        ):
            what = "the guard could not be installed" if _state["failed"] else "it imported torch"
            _say(
                f"the script raised {exc_type.__name__} before {what}: nothing was guarded, "
                "no incident report was written (its traceback follows)"
            )
    except Exception:
        pass
    sys.__excepthook__(exc_type, exc, tb)


def _chain_to_the_next_sitecustomize() -> None:
    """Run the sitecustomize this folder shadows (a venv's, a distribution's), if any."""
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # as site.py does for a failing sitecustomize
        _say(f"the environment's own sitecustomize ({spec.origin}) failed: {type(err).__name__}: {err}")


def _bootstrap() -> None:
    text = os.environ.get(_ENV_VAR)
    if not text:
        return
    if "torch" in sys.modules:  # imported before us (a .pth file): install now
        _install_guard(text)
    else:
        sys.meta_path.insert(0, _AfterTorchImport(text))
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _before_torch_excepthook


def _leave_sys_path_as_python_would() -> None:
    """Take this folder off sys.path: the script sees the sys.path it would see without run.

    PYTHONPATH keeps it, so subprocesses still start with the bootstrap. Without this, under
    PYTHONSAFEPATH or ``-P`` (no script folder prepended) this folder would be ``sys.path[0]``,
    and ``-m pkg.mod`` would not find a package that plain ``python -P`` finds elsewhere.
    """
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


try:
    _bootstrap()
except Exception as _err:  # never break the interpreter's start
    _say(f"bootstrap failed ({type(_err).__name__}: {_err}); the script runs unguarded")
_chain_to_the_next_sitecustomize()
_leave_sys_path_as_python_would()
