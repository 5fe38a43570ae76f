"""Replicas that must agree: every N steps, each rank folds each parameter into an
order-sensitive signature (:mod:`.signatures`) and the replicas compare them in one
collective with at most one host read.

The collective is an ``all_gather`` of the packed signatures (one int64 per parameter, and
the step's own flag in front when the replica group is the group TrainingGuard already
all-reduces its flag over: then the gather *replaces* that all-reduce). Every rank receives
every rank's signatures, so every rank learns, in the same collective, which rank differs
and in which parameter: all raise together and nothing waits in a collective another rank
left. Not a SUM all-reduce: a sum of signatures can agree while the ranks do not (two
errors that cancel). Not min/max either: they say *that* the ranks differ, not *who*.

On the device, from the gathered ``[world, 1 + P]`` tensor: the flag's maximum over the
ranks, whether any parameter column differs, the first such column, and that column's
``world`` signatures; read in one ``tolist()``. Only on a mismatch (rare) do the ranks
exchange their identities (host, device, GPU UUID) with ``all_gather_object``.

Which replica group: DDP's process group; HSDP (FSDP2 on a 2-D mesh whose first dimension
replicates) that dimension's group, the parameters' local shards compared; or the group the
caller gives. Plain FSDP2 (every parameter sharded over every rank) has no replicas.
"""

from __future__ import annotations

import collections
import os
import socket
from typing import Any

import torch

from . import signatures

__all__ = ["identity", "replica_group_of", "ReplicaCheck"]


def identity(device: torch.device | None) -> dict[str, Any]:
    """This process: global rank, host, PID, the device its parameters live on and, on CUDA,
    the GPU's UUID (what a launcher cordons)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    uuid = None
    if device is not None and device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            if uuid and not uuid.startswith("GPU-"):
                uuid = f"GPU-{uuid}"  # nvidia-smi's spelling
        except Exception:  # the error path must not fail
            uuid = None
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device) if device is not None else None,
        "gpu_uuid": uuid,
    }


def _first_param(model: torch.nn.Module) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


def replica_group_of(model: torch.nn.Module, inner: torch.nn.Module) -> tuple[Any, str | None]:
    """(the group whose ranks hold equal copies of this rank's parameters, None) or (None, why
    there is none). DDP: its process group; HSDP: the mesh dimension that replicates."""
    from .state import _is_ddp, _wrappers

    for m in _wrappers(model):
        if _is_ddp(m):
            return m.process_group, None
    p = _first_param(inner)
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None:
        from torch.distributed.tensor import Replicate

        dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
        if dims and mesh.size(dims[0]) > 1:
            return mesh.get_group(dims[0]), None
        return None, (
            "the parameters are sharded over every rank (FSDP2 on a 1-D mesh): no rank holds a "
            "copy of another's; HSDP (a 2-D mesh with a replicate dimension) or DDP has replicas"
        )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD, None  # a model replicated by the caller's own means
    return None, "no process group of more than one rank is initialised"


class ReplicaCheck:
    """Signatures of one model's parameters, and what a gathered table of them says."""

    def __init__(self, inner: torch.nn.Module, group: Any, every: int) -> None:
        import torch.distributed as dist

        self.group = group
        self.every = every
        self.names = [n for n, _ in inner.named_parameters()]
        self.params = [p for _, p in inner.named_parameters()]
        self.world = dist.get_world_size(group)
        self.gloo = dist.get_backend(group) == "gloo"
        self.folder = signatures.Folder(self.params)
        self.last_agreeing_step: int | None = None
        self.checks = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def local(self) -> torch.Tensor:
        """[P] int64: this rank's parameter signatures, on the parameters' device."""
        return self.folder()

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """[world, len(packed)]: every rank's packed row (the one collective)."""
        import torch.distributed as dist

        if self.gloo and packed.device.type != "cpu":
            packed = packed.cpu()
        rows = [torch.empty_like(packed) for _ in range(self.world)]
        dist.all_gather(rows, packed.contiguous(), group=self.group)
        return torch.stack(rows)

    @staticmethod
    def summary(table: torch.Tensor) -> torch.Tensor:
        """From the gathered ``[world, P]`` signatures, on the device: ``[any differ, first
        differing column, how many columns differ, that column's world signatures...]``."""
        differ = (table != table[:1]).any(0)
        first = torch.argmax(differ.to(torch.int32)) if differ.numel() else table.new_zeros(())
        count = differ.sum()
        column = table[:, first] if table.shape[1] else table.new_zeros(table.shape[0])
        return torch.cat([differ.any().reshape(1).long(), first.reshape(1).long(), count.reshape(1), column])

    def verdict(self, values: list[int]) -> dict[str, Any] | None:
        """None when the replicas agree; else which rank differs in which parameter (from the
        host-read summary): the ranks outside the majority of the first differing column. Two
        replicas (or a tie) cannot tell which copy is wrong: the ranks that differ from the
        lowest rank's copy are named, and a note says so."""
        self.checks += 1
        if not values[0]:
            return None
        first, count, column = values[1], values[2], values[3:]
        tally = collections.Counter(column)
        top = tally.most_common()
        note = None
        if len(top) > 1 and top[0][1] == top[1][1]:
            majority = column[0]
            note = (
                f"{len(column)} replicas split evenly: which copy is wrong cannot be told from the "
                "copies alone; the ranks named differ from the lowest rank's copy"
            )
        else:
            majority = top[0][0]
        ranks = [i for i, v in enumerate(column) if v != majority]
        return {
            "parameter": self.names[first] if first < len(self.names) else f"<parameter {first}>",
            "differing_parameters": count,
            "group_ranks": ranks,
            "note": note,
        }
