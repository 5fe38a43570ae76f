"""What the native library calls in Python, by module and attribute name.

csrc/ reaches Python in three places (locked/report/python_errors.cpp, locked/watch/watch_reraise.cpp,
locked/watch/watch_session.cpp) with ``PyImport_ImportModule`` and ``PyObject_CallMethod`` /
``PyObject_GetAttrString``, which no import graph sees. Every such name is this module's and
only this module's, so moving the code behind one cannot break a call silently:
tests/package/test_native_callbacks.py checks that each name csrc/ mentions is here.
"""

from __future__ import annotations

from typing import Any

from .errors import GuardError, NonFiniteInputError
from .errors.parse import _typed_from_native_message
from .watching import session as _watch

__all__ = ["typed_error", "watch_op_failure", "watch_finding", "GuardError"]

# GuardError: csrc/locked/watch/watch_reraise.cpp (is_guard_error) tells ours from other exceptions.


def typed_error(message: str, native: dict[str, Any] | None) -> GuardError | None:
    """csrc/locked/report/python_errors.cpp: the typed exception for a native error's message (None
    if it is not one of ours); ``native``: the failing call's tensors, for its capsule."""
    err = _typed_from_native_message(message, native)
    if isinstance(err, NonFiniteInputError) and _watch.AVAILABLE and _watch._native._watch_active():
        # Refused inside a watch block: the message says so instead of advising to run under
        # watch (a value watch saw born is raised as watch's finding instead, at the refusal).
        err.fields["watch_on"] = True
        err.args = (err._format(),)
    return err


def watch_op_failure(payload: str, original: Any, message: str) -> BaseException:
    """csrc/locked/watch/watch_reraise.cpp: an op that failed inside a watch block, re-raised typed,
    naming the op and module, with the original as ``__cause__``."""
    return _watch._op_failure(payload, original, message)


def watch_finding(message: str) -> GuardError:
    """csrc/locked/watch/watch_session.cpp: watch's typed finding for a native message, with where it
    arrived and where it was born."""
    return _watch._typed(message)
