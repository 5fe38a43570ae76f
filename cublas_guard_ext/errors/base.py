"""GuardError, the base of every cublas_guard_ext error: fields as attributes, one
message in three parts (the most likely cause, the details, what to do next), the
rank under torchrun, the environment block and the failure capsule's line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from .format import _distributed_rank, _environment_line, _expert_line

# The environment block of the runtime errors (``with_environment``) is read by
# _native/machine/facts.py (error_context: versions, GPU, libraries), which hands its reader in when
# it loads: errors is the package's bottom floor and imports nothing of it. Until then (never,
# once the package has loaded) the errors carry no environment block.
_environment_reader: list[Callable[[], dict[str, Any]]] = []


def read_environment_with(reader: Callable[[], dict[str, Any]]) -> None:
    """Called by _native/machine/facts.py: ``reader()`` gives the environment block of an error."""
    _environment_reader[:] = [reader]


class GuardError(Exception):
    """Base class of every cublas_guard_ext error.

    ``fields`` holds the structured data (also readable as attributes);
    ``str(err)`` is the formatted message.
    """

    kind: ClassVar[str] = "guard"
    # Errors about the CUDA/cuBLAS runtime also describe the environment.
    with_environment: ClassVar[bool] = False
    # The failure capsule's path (cublas_guard_ext.capsule), for the cuBLAS-side errors
    # raised by a guarded call or watch; None when capture is off or writing failed
    # (then capsule_note says why).
    capsule: str | None = None
    capsule_note: str | None = None

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        if message is None and "rank" not in fields:
            fields.update(_distributed_rank())
        if self.with_environment and message is None and "environment" not in fields and _environment_reader:
            fields["environment"] = _environment_reader[0]()
        self.fields: dict[str, Any] = fields
        super().__init__(message if message is not None else self._format())

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    # Subclasses fill these three; _format puts them in order.
    def _headline(self) -> str:
        return f"cublas_guard_ext error ({self.kind})"

    def _details(self) -> list[str]:
        return [f"{k}: {v}" for k, v in self.fields.items()]

    def _next_steps(self) -> list[str]:
        return []

    def _format(self) -> str:
        rank = self.fields.get("rank")
        prefix = f"[rank {rank}/{self.fields.get('world_size', '?')}] " if rank is not None else ""
        lines = [prefix + self._headline()]
        place = _expert_line(self.fields)  # raised inside one expert of a grouped GEMM
        if place:
            lines.append(f"  {place}")
        lines += [f"  {d}" for d in self._details()]
        if self.fields.get("environment"):
            lines.append(f"  environment: {_environment_line(self.fields['environment'])}")
        if self.capsule:
            lines.append(
                f"  capsule: {self.capsule} (replay the call alone: python -m cublas_guard_ext "
                f"replay {self.capsule})"
            )
        elif self.capsule_note:
            lines.append(f"  capsule: not written ({self.capsule_note})")
        steps = self._next_steps()
        if steps:
            lines.append("Next: " + steps[0])
            lines += [f"      {s}" for s in steps[1:]]
        return "\n".join(lines)
