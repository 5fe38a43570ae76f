"""Reading a file that should be a failure capsule, safely: a static look at its pickle
first (nothing imported or run), then ``torch.load(weights_only=True)``; every failure is one
:class:`CapsuleFileError` whose message is one line. A module of its own so that contents.py
stays under ~600 lines."""

from __future__ import annotations

import warnings
from typing import Any

import torch


class CapsuleFileError(ValueError):
    """A file that :func:`load` will not read as a capsule; ``str()`` is one line a person acts
    on. Fields: ``path``, ``reason`` (``"not a capsule"``, ``"refused: this file would run code
    when loaded"`` or the OS's words for a missing or unreadable file)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


REFUSED_CODE = "refused: this file would run code when loaded"
NOT_A_CAPSULE = "not a capsule"
_STRING_OPS = frozenset(
    ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING")
)


def _foreign_globals(path: str) -> list[str]:
    """The callables a pickle (a raw one, or the data.pkl of torch's zip format) names that
    torch's weights-only loader does not allow: what an ordinary unpickler would import and
    may call. Read statically (pickletools.genops): nothing is imported or run. A global that
    cannot be read statically (STACK_GLOBAL fed from the memo) counts as foreign."""
    import pickletools
    import zipfile

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            data = archive.read(pickles[0]) if pickles else b""
    else:
        with open(path, "rb") as f:
            data = f.read()
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except Exception:  # a torch without it: its loader still refuses what it does not allow
        allowed = None
    named: list[str] = []
    recent: list[Any] = []  # the operands pushed last, for STACK_GLOBAL
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _STRING_OPS:
                recent.append(arg)
            elif op.name in ("GLOBAL", "INST"):
                named.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                module, attr = (recent[-2], recent[-1]) if len(recent) >= 2 else ("?", "?")
                named.append(f"{module}.{attr}")
            elif op.name not in ("MEMOIZE", "FRAME", "PROTO", "PUT", "BINPUT", "LONG_BINPUT"):
                recent.append(None)  # anything else breaks a module/name pair
    except Exception:
        pass  # not a pickle, or cut short: what was read counts
    if allowed is None:
        return [g for g in named if g == "?.?" or not g.startswith(("torch.", "collections.OrderedDict"))]
    return [g for g in named if g not in allowed]


def read(name: str) -> Any:
    """The unpickled contents of ``name`` (not yet checked to be a capsule), or
    :class:`CapsuleFileError`."""
    try:
        foreign = _foreign_globals(name)
    except OSError as err:
        raise CapsuleFileError(name, err.strerror or str(err)) from None
    if foreign:
        raise CapsuleFileError(name, f"{REFUSED_CODE} (it names {', '.join(foreign[:3])})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: not the user's business
            data = torch.load(name, weights_only=True, map_location="cpu")
    except OSError as err:
        raise CapsuleFileError(name, err.strerror or str(err)) from None
    except Exception:  # random bytes, a truncated zip, another format: torch's words do not help
        raise CapsuleFileError(name, NOT_A_CAPSULE) from None
    return data
