"""What a rank stopped by ``run``'s watchdog does, in order (fast: no torchrun; the real
two-rank run is tests/run/test_run_distributed.py, slow)."""

from __future__ import annotations

import pytest

from cublas_guard_ext.run import ranks, runtime


class _Exited(BaseException):
    pass


def test_a_stopped_rank_says_why_before_it_lets_the_failed_rank_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # The failed rank ends once every rank acknowledged, and torchrun then stops the others
    # (SIGTERM): the line must be out before the acknowledgement, or a loaded machine loses it.
    events: list[tuple] = []
    monkeypatch.setattr(runtime, "_stopping_for", {})
    monkeypatch.setattr(ranks, "claim", lambda: True)
    monkeypatch.setattr(runtime, "_write", lambda err, peer: ("/reports/rank0.json", {}))
    monkeypatch.setattr(runtime, "_say", lambda message: events.append(("say", message)))
    monkeypatch.setattr(ranks, "acknowledge", lambda: events.append(("acknowledge",)))
    monkeypatch.setattr(ranks, "wait_for_the_failed_rank_to_end", lambda: events.append(("wait",)))

    def exit_now(code: int) -> None:
        events.append(("exit", code))
        raise _Exited

    monkeypatch.setattr(runtime.os, "_exit", exit_now)
    peer = {
        "rank": 1,
        "host": "h",
        "pid": 7,
        "error": "NonFiniteOutputError: x",
        "report": "/reports/rank1.json",
    }
    with pytest.raises(_Exited):
        runtime._on_peer_failure(peer)
    assert [event[0] for event in events] == ["say", "acknowledge", "wait", "exit"]
    said = events[0][1]
    assert said.startswith("stopping this rank: rank 1 (host h, pid 7) failed first: NonFiniteOutputError")
    assert "its report: /reports/rank1.json; this rank's: /reports/rank0.json" in said
    assert events[-1] == ("exit", 1)
