"""``TrainingGuard(skip_list=PATH)``: the samples of reproducible bad steps, one JSON line
each, read when the guard is built and appended to as the run finds more.

A line: ``{"sample_id": 1017, "step": 4, "verdict": "persistent", "where": "...",
"rank": 0, "time": "2026-12-06T10:40:00+00:00", "reason": "non_finite"}`` (``reason``:
``"non_finite"`` or ``"spike"``). Ids are integers.

Reading: the path is checked when the guard is built (a directory, an unreadable or
unwritable file is a :class:`SkipListError` then, never at step 40,000). A line that does
not parse (the last one torn by a crash mid-write, say) is ignored with one warning; the
rest are kept. A file whose last byte is not a newline when a line is appended gets one
in front of that line, so the torn line stays a line of its own.

Writing: each line is one ``os.write`` to a descriptor opened with ``O_APPEND``, under an
exclusive ``flock``; reading takes a shared one. So processes sharing the file (the ranks
of a run) interleave whole lines, and a rank reading while another appends never mistakes
the line in flight for a torn one (POSIX local file systems; NFS does not promise
``O_APPEND``'s atomicity, and ``flock`` there depends on the mount).

The lookup is host-only: a set of ints, checked against the step's ids before the closure.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from ..errors.samples import SkipListError, skip_list_ignored

__all__ = ["SkipList"]

try:  # POSIX; elsewhere the O_APPEND write alone keeps lines whole
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_LOCK = threading.Lock()


@contextlib.contextmanager
def _file_lock(fd: int, exclusive: bool):
    """``flock`` across processes: appends exclusive, reads shared (a no-op without fcntl)."""
    if fcntl is None:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _ends_torn(fd: int) -> bool:
    """Whether the file's last byte is not a newline (a line cut short by a crash)."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


class SkipList:
    """The skip list at ``path``: ``ids`` (a set of ints), ``entries`` (the parsed lines),
    ``group`` (the host-side group the ranks agree on a skip over, set by :func:`open_skip_list`;
    None in one process)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.group: Any = None
        self.ids: set[int] = set()
        self.entries: list[dict[str, Any]] = []
        if self.path.is_dir():
            raise SkipListError(path=str(self.path), problem="directory")
        data = b""
        if self.path.exists():
            try:
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    with _file_lock(fd, exclusive=False):
                        data = _read_all(fd)
                finally:
                    os.close(fd)
            except OSError as err:
                raise SkipListError(
                    path=str(self.path), problem="unreadable", reason=_reason(err, self.path)
                ) from err
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as err:
            raise SkipListError(
                path=str(self.path), problem="unwritable", reason=_reason(err, self.path)
            ) from err
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        ignored: list[tuple[int, str]] = []
        lines = data.split(b"\n")
        torn = lines.pop() if lines else b""  # what follows the last newline: b"" when whole
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            entry = self._entry(raw)
            if isinstance(entry, str):
                ignored.append((number, entry))
            else:
                self.entries.append(entry)
                self.ids.add(entry["sample_id"])
        if torn:
            ignored.append((len(lines) + 1, f"{len(torn)} bytes without a newline (a write cut short)"))
        if ignored:
            warnings.warn(skip_list_ignored(str(self.path), ignored), RuntimeWarning, stacklevel=4)

    @staticmethod
    def _entry(raw: bytes) -> dict[str, Any] | str:
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"not JSON ({err.msg if hasattr(err, 'msg') else err})"
        if not isinstance(entry, dict):
            return "not a JSON object"
        sid = entry.get("sample_id")
        if isinstance(sid, bool) or not isinstance(sid, int):
            return f"no integer sample_id (got {sid!r})"
        return entry

    def listed(self, ids: tuple[int, ...]) -> list[int]:
        """The ids of the batch that are on the list (host only)."""
        if not self.ids:
            return []
        listed = self.ids
        return [i for i in ids if i in listed]

    def add(self, ids: list[int]) -> None:
        """Known from another rank's line (every rank decides alike): no write."""
        self.ids.update(ids)

    def append(
        self, ids: list[int], *, step: int, verdict: str, where: str | None, rank: int | None, reason: str
    ) -> int:
        """Append one line per id not yet listed; returns how many were written."""
        time = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        new = [i for i in dict.fromkeys(ids) if i not in self.ids]
        lines = []
        for sid in new:
            entry = {
                "sample_id": sid,
                "step": step,
                "verdict": verdict,
                "where": where,
                "rank": rank,
                "time": time,
                "reason": reason,
            }
            lines.append(entry)
        if not lines:
            return 0
        with _LOCK:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                with _file_lock(fd, exclusive=True):
                    first = "\n" if _ends_torn(fd) else ""  # decided under the lock, from the file
                    for entry in lines:
                        data = first + json.dumps(entry, default=str) + "\n"
                        first = ""
                        os.write(fd, data.encode("utf-8"))  # one write per line: whole under O_APPEND
            finally:
                os.close(fd)
        self.entries += lines
        self.ids.update(new)
        return len(lines)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(err: OSError, path: Path) -> str:
    """The OS's words, and the path they are about when it is not the list's own."""
    why = err.strerror or str(err)
    if err.filename is not None and str(err.filename) != str(path):
        why += f": {err.filename}"
    return why


# -- what TrainingGuard does with it (functions of the guard, to keep guard.py short) --------


def open_skip_list(guard: Any, path: Any) -> SkipList | None:
    """The list at construction, with the host-side group the ranks agree on a skip over.

    Every rank must skip alike, before its closure: the flag cannot ride on the step's own
    collective (the flag's all-reduce comes after the backward, and a rank that skipped its
    forward would leave the others waiting in DDP's gradient all-reduce). So one 4-byte MAX
    all-reduce on a gloo group (the guard's own when it is gloo): host memory only, no device
    work, no wait on the GPU's queue."""
    if path is None:
        return None
    skip = SkipList(path)
    if guard.group is not None:
        import torch.distributed as dist

        skip.group = guard.group
        if dist.get_backend(skip.group) != "gloo":
            skip.group = dist.new_group(ranks=dist.get_process_group_ranks(skip.group), backend="gloo")
    return skip


def skip_listed(guard: Any) -> bool:
    """Before the closure: whether this step's batch (on any rank) holds a listed sample; if
    so the step is counted, nothing runs, and a warning names the samples."""
    import torch

    from ..errors.samples import listed_batch_skipped

    skip = guard.skip_list
    batch = guard.batch
    hits = skip.listed(batch.ids) if batch is not None else []
    decided = bool(hits)
    if skip.group is not None:
        import torch.distributed as dist

        flag = torch.tensor([1 if hits else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=skip.group)
        decided = bool(flag[0])
    if not decided:
        return False
    guard.steps += 1
    guard.stepped = False
    guard.list_skips += 1
    guard.history.mark(guard.steps, skipped=True)
    rank = guard.collective.rank
    warnings.warn(listed_batch_skipped(guard.steps, hits, rank, str(skip.path)), RuntimeWarning, stacklevel=3)
    return True


def record_culprits(guard: Any, err: Any, reports: list[dict[str, Any]]) -> None:
    """A reproducible (persistent) bad step: each rank appends its own replay's culprits and
    learns the other ranks' (the reports were gathered), so every rank's list is the same.
    Not when the culprit cannot be told apart from the batch (every row)."""
    skip = guard.skip_list
    if skip is None or err.fields.get("classification") != "persistent":
        return
    me = guard.collective.rank
    written = 0
    for r in reports:
        found = r.get("samples") or {}
        if not r.get("reproduced") or not found.get("ids") or len(found["ids"]) == found.get("batch", 0) > 1:
            continue
        if r.get("rank") == me:
            written += skip.append(
                found["ids"],
                step=err.fields.get("step"),
                verdict="persistent",
                where=_where(r, found),
                rank=me,
                reason="non_finite",
            )
        else:
            skip.add(found["ids"])
    samples = err.fields.get("samples")
    if samples is not None:
        samples["skip_list"] = str(skip.path)
        samples["listed"] = bool(written) or any(i in skip.ids for i in samples.get("ids") or [])
        err.args = (err._format(),)


def _where(report: dict[str, Any], found: dict[str, Any]) -> str:
    if report.get("phase") == "entry":
        return found.get("where") or "the model's input"
    op = " ".join(str(p) for p in (report.get("op"), report.get("module"), report.get("phase")) if p)
    where = found.get("where") or ""
    return f"{op}: {where}" if op and where else op or where or "unknown"
