"""The guard inside one process of a run: installed by the bootstrap right after ``import torch``.

* every ``nn.Linear`` through the guarded op, by qualified name (:mod:`.linear`);
* torchao's ``Float8Linear`` guarded, direct FP8 calls and float8 casts checked (:mod:`.float8`);
* every optimizer step counted, and checked with ``--skip/--raise-on-nonfinite-steps``
  (:mod:`.steps`);
* ``--watch``: watch blocks over every forward, backward and step (:mod:`.watching`);
* failure capsules in the report folder, one subfolder per process;
* an uncaught exception writes this process's incident report (:mod:`.incident`) before the
  traceback is printed (the original error comes last), and in a distributed run tells the
  other ranks and aborts the process group (:mod:`.ranks`); the other ranks' watchdogs write
  their own report naming this rank and end within seconds.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

from ..errors import GuardError, PeerFailedError
from . import float8, incident, linear, ranks, steps
from .options import RunOptions

_installed: dict[str, Any] = {}
_stopping_for: dict[str, Any] = {}  # "peer": the failure record the watchdog is stopping this rank for
CAPSULE_DIR_ENV = "CUBLAS_GUARD_CAPSULE_DIR"


def options() -> RunOptions | None:
    return _installed.get("options")


def _say(message: str) -> None:
    who = ranks.identity()
    prefix = f"[rank {who['rank']}] " if who["rank"] is not None and ranks.distributed() else ""
    try:
        print(f"{prefix}cublas_guard_ext run: {message}", file=sys.stderr, flush=True)
    except Exception:
        pass


def _root() -> Any:
    if "watch" in _installed:
        from . import watching

        root = watching.current_root()
        if root is not None:
            return root
    return linear.last_root()


def _write(exc: BaseException, peer: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """This process's report: (its path or None, the facts). Says once where it went."""
    opts = _installed["options"]
    data = incident.facts(exc, opts, step=steps.current_step(), root=_root(), peer=peer)
    path, problem = incident.write(data, opts.report_dir)
    if path is not None:
        extra = " (all ranks: index.html beside it)" if (path.parent / "index.html").exists() else ""
        _say(f"incident report: {path}{extra}")
        return str(path), data
    where = data["where"]
    place = ", ".join(f"{k} {where[k]}" for k in ("op", "module", "layer", "phase", "step") if where.get(k))
    _say(
        f"the incident report could not be written to {opts.report_dir} ({problem}); {place or 'no place known'}"
    )
    return None, data


def _excepthook(previous: Any) -> Any:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        peer = _stopping_for.get("peer")
        if peer is not None:  # the watchdog is ending this process for another rank's failure
            first = (str(exc).splitlines() or [""])[0][:300]
            _say(
                f"this rank's own error, a consequence of rank {peer.get('rank')}'s failure: "
                f"{exc_type.__name__}: {first}"
            )
            time.sleep(ranks.ACK_WAIT_S + ranks.ABORT_WAIT_S + ranks.ENDING_GRACE_S + 5.0)
        if not issubclass(exc_type, KeyboardInterrupt) and ranks.claim():
            try:
                if "watch" in _installed:
                    from . import watching

                    try:
                        watching.close(exc)
                    except Exception:
                        pass
                peer = ranks.peer_failure() if ranks.distributed() else None
                if peer is not None:  # this rank's error is a consequence of the peer's
                    path, _ = _write(_peer_error(peer, exc), peer)
                    ranks.acknowledge()
                    ranks.wait_for_the_failed_rank_to_end()  # the launcher names it first
                else:
                    path, data = _write(exc, None)
                    if ranks.distributed():
                        first = (data["error"]["message"] or "").splitlines()[:1]
                        ranks.announce_failure(
                            {
                                **ranks.identity(),
                                "error": f"{data['error']['class']}: {first[0] if first else ''}"[:500],
                                "report": path,
                            }
                        )
            except BaseException as err:  # the report must never hide the error
                _say(f"could not write the incident report ({type(err).__name__}: {err})")
        previous(exc_type, exc, tb)

    return hook


def _peer_error(peer: dict[str, Any], local: BaseException | None = None) -> PeerFailedError:
    err = PeerFailedError(
        failed_rank=peer.get("rank"),
        failed_host=peer.get("host"),
        failed_pid=peer.get("pid"),
        failed_error=peer.get("error"),
        failed_report=peer.get("report"),
        **({"local_error": f"{type(local).__name__}: {local}"[:500]} if local is not None else {}),
    )
    return err


def _on_peer_failure(peer: dict[str, Any]) -> None:
    """The watchdog saw another rank's failure: report, acknowledge, end this process."""
    if not ranks.claim():
        return
    _stopping_for["peer"] = peer
    try:
        path, _ = _write(_peer_error(peer), peer)
    except BaseException as err:
        path = None
        _say(f"could not write the incident report ({type(err).__name__}: {err})")
    _say(
        f"stopping this rank: rank {peer.get('rank')} (host {peer.get('host')}, pid {peer.get('pid')}) "
        f"failed first: {peer.get('error')}; its report: {peer.get('report') or '(not written)'}"
        + (f"; this rank's: {path}" if path else "")
    )
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        # Only now: the failed rank ends once every rank acknowledged, and the launcher then
        # stops this one (SIGTERM); acknowledged before the line above, a loaded machine lost it.
        ranks.acknowledge()
        ranks.wait_for_the_failed_rank_to_end()
    finally:
        os._exit(1)


def _check_async_at_exit() -> None:
    from ..guarded_linear.ops import check

    try:
        check()
    except GuardError as err:  # the script ended before anything raised it: report it now
        _say(f"at exit, an async-mode finding was still pending:\n{err}")
        if ranks.claim():
            try:
                _write(err, None)
            except Exception as problem:
                _say(f"could not write the incident report ({type(problem).__name__}: {problem})")


def _async_check_before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    from ..guarded_linear.ops import check

    check()


def install(text: str) -> None:
    """Install the guard in this process, per the options ``run`` encoded in ``text``; all of it
    or, when a part fails, none of it (the bootstrap then says the script runs unguarded)."""
    if _installed:
        return
    try:
        _install(RunOptions.decode(text))
    except BaseException:
        _uninstall()
        raise


def _uninstall() -> None:
    if _installed.pop("watch", None):
        from . import watching

        watching.uninstall()
    steps.uninstall()
    float8.uninstall()
    linear.uninstall()
    if getattr(sys.excepthook, "__name__", "") == "hook" and sys.excepthook.__module__ == __name__:
        sys.excepthook = _installed.get("previous_excepthook", sys.__excepthook__)
    _installed.clear()


def _install(opts: RunOptions) -> None:
    _installed["options"] = opts
    if opts.capsules_in_report:
        os.environ[CAPSULE_DIR_ENV] = os.path.join(opts.report_dir, "capsules", ranks.file_stem())
    linear.install()
    float8.install()  # torchao's Float8Linear, direct FP8 calls and float8 casts (run/float8.py)
    steps.install(opts.nonfinite_steps)
    if opts.watch:
        from . import watching

        watching.install(opts.mode)
        _installed["watch"] = True
    if opts.mode == "async":
        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        steps.keep(register_optimizer_step_pre_hook(torch.compiler.disable(_async_check_before_step)))
        atexit.register(_check_async_at_exit)
    previous = sys.excepthook
    if getattr(previous, "__name__", "") == "_before_torch_excepthook":
        previous = sys.__excepthook__
    _installed["previous_excepthook"] = previous
    sys.excepthook = _excepthook(previous)
    ranks.start_watchdog(_on_peer_failure)
