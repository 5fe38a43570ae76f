"""Per rank, and never a hang: who this process is, and how one rank's failure stops the others.

Files are named by host, RANK/LOCAL_RANK and PID (``gpu-node-3-rank5-local1-pid4242``): ranks
sharing a folder never write one path, and a restarted rank (a new PID) never overwrites the
report of the one before.

The protocol, through the process group's own store (the TCPStore every rank of an initialised
``torch.distributed`` job already reaches; keys under ``cublas_guard_run/``):

1. A rank that fails writes its report first, then records itself (``failed/<n>``: its rank,
   host, PID, error and report path) and waits up to :data:`ACK_WAIT_S` for the other ranks to
   acknowledge, then aborts its process group, says it is ending, and lets the error end the
   process (non-zero, the error printed last).
2. Every rank runs a watchdog thread (a daemon; from the moment the process group exists) that
   polls the failure count. Seeing another rank's failure, it writes this rank's report
   naming that rank and its report, acknowledges, prints one line, waits for the failed rank
   to end first (so that the launcher names it as the first failure; torchrun then stops this
   rank itself) and ends the process (``os._exit(1)`` after flushing): this rank may sit
   inside a collective that would otherwise wait for the collective's timeout (NCCL's is 10
   minutes).

Without an initialised process group (a failure before ``init_process_group``) there is no
store to tell the others; the launcher's own failure handling (torchrun stops the group when a
worker exits) ends them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PREFIX = "cublas_guard_run/"
ACK_WAIT_S = 5.0
ABORT_WAIT_S = 3.0
POLL_S = 0.25
ENDING_GRACE_S = 2.0


def identity() -> dict[str, Any]:
    """Host, PID, and the launcher's RANK / LOCAL_RANK / WORLD_SIZE (None outside a launcher)."""

    def number(name: str) -> int | None:
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else None

    rank, world = number("RANK"), number("WORLD_SIZE")
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "local_rank": number("LOCAL_RANK"),
        "world_size": world,
    }


def file_stem(who: dict[str, Any] | None = None) -> str:
    who = who or identity()
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(who["host"]))
    parts = [host]
    if who.get("rank") is not None:
        parts.append(f"rank{who['rank']}")
    if who.get("local_rank") is not None:
        parts.append(f"local{who['local_rank']}")
    parts.append(f"pid{who['pid']}")
    return "-".join(parts)


def distributed() -> bool:
    """Whether this process is one rank of several: by the launcher's environment (torchrun),
    or by its initialised process group (mp.spawn and other launchers that set no WORLD_SIZE)."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        return True
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(
            dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
    except Exception:
        return False


def _store() -> Any:
    """The default process group's store, or None (no group, or torch.distributed unused)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


_lock = threading.Lock()
_handled = {"done": False}
_watchdog: dict[str, Any] = {}


def claim() -> bool:
    """The one report of this process: True for the first caller (the excepthook or the
    watchdog), False after."""
    with _lock:
        if _handled["done"]:
            return False
        _handled["done"] = True
        return True


def peer_failure(store: Any = None) -> dict[str, Any] | None:
    """The first failure another rank recorded, or None."""
    store = store if store is not None else _store()
    if store is None:
        return None
    try:
        if store.add(PREFIX + "failed_count", 0) <= 0:
            return None
        record = json.loads(store.get(PREFIX + "failed/1").decode())
    except Exception:
        return None
    if record.get("pid") == os.getpid() and record.get("host") == socket.gethostname():
        return None
    return record


def announce_failure(record: dict[str, Any]) -> None:
    """This rank failed: tell the others, wait for them to acknowledge, abort the group."""
    store = _store()
    if store is None:
        return
    try:
        number = store.add(PREFIX + "failed_count", 1)
        store.set(PREFIX + f"failed/{number}", json.dumps(record, default=str))
        world = _world_size()
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline:
            acked = store.add(PREFIX + "acks", 0)
            failed = store.add(PREFIX + "failed_count", 0)
            if acked + failed >= world:
                break
            time.sleep(0.05)
    except Exception:  # the store is gone (its host rank ended): nobody left to tell
        pass
    abort_process_group()
    try:
        store.set(PREFIX + "first_failure_ending", "1")
    except Exception:
        pass


def wait_for_the_failed_rank_to_end(store: Any = None) -> None:
    """Let the failed rank end first, so that the launcher names it as the first failure
    (torchrun's "root cause" is the first worker to exit): wait until it says it is ending,
    then a grace period in which the launcher usually stops this process itself."""
    store = store if store is not None else _store()
    deadline = time.monotonic() + ACK_WAIT_S + ABORT_WAIT_S + 2.0
    try:
        while time.monotonic() < deadline and store is not None:
            if store.check([PREFIX + "first_failure_ending"]):
                break
            time.sleep(0.05)
    except Exception:  # the store is gone: the failed rank has ended
        return
    time.sleep(ENDING_GRACE_S)


def _world_size() -> int:
    dist = sys.modules.get("torch.distributed")
    try:
        return int(dist.get_world_size())  # type: ignore[union-attr]
    except Exception:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)


def acknowledge() -> None:
    store = _store()
    try:
        if store is not None:
            store.add(PREFIX + "acks", 1)
    except Exception:
        pass


def abort_process_group() -> None:
    """Abort (or destroy) the default process group, giving up after ABORT_WAIT_S."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return

    def abort() -> None:
        try:
            if not dist.is_initialized():
                return
            c10d = dist.distributed_c10d
            if hasattr(c10d, "_abort_process_group"):
                c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception:
            pass

    worker = threading.Thread(target=abort, name="cublas_guard_run-abort", daemon=True)
    worker.start()
    worker.join(ABORT_WAIT_S)


def start_watchdog(on_peer_failure: Callable[[dict[str, Any]], None]) -> None:
    """Poll for another rank's failure (a daemon thread); ``on_peer_failure(record)`` runs once."""
    if _watchdog:
        return  # one per process (a DataLoader worker's never sees a process group: it only sleeps)

    def loop() -> None:
        store = None
        poll = POLL_S
        while True:
            time.sleep(poll)
            if store is None:
                store = _store() if distributed() else None
                if store is None:
                    continue
                # One store serves every rank: at most ~1000 polls a second in all (a 4096-rank
                # job polls every 4 s).
                poll = max(POLL_S, _world_size() / 1000)
            dist = sys.modules.get("torch.distributed")
            if dist is not None and not dist.is_initialized():
                return  # the group was destroyed: the run is ending normally
            record = peer_failure(store)
            if record is not None:
                on_peer_failure(record)
                return

    thread = threading.Thread(target=loop, name="cublas_guard_run-watchdog", daemon=True)
    _watchdog["thread"] = thread
    thread.start()
