"""Check, at construction, that parameters meant to be replicated are identical on every
replica rank.

Each rank averages only its rows of a replicated parameter (DDP weights, the HSDP
replicate dim, TP-replicated weights) and the rows are stitched together on export. If the
replicas differ (the EMA was built before DDP broadcast the weights, with a per-rank seed)
the stitched EMA mixes rows of different models, with no error anywhere. One checksum per
tensor catches that: the sum of its bit patterns as integers (exact, no rounding), so any
single changed element changes it. Buffers are not checked: DDP keeps them identical only
at the start of each forward, and BatchNorm statistics legitimately drift between ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema._collectives import all_gather_single, mesh_agree

if TYPE_CHECKING:
    from dtensor_ema.layout import PlanEntry

__all__ = ["bit_checksum", "check_replicas"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on ``tensor``'s device: the sum of its elements' bit patterns
    read as integers (wrapping). Equal tensors give equal sums; no host sync."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    return flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64)


def check_replicas(entries: Sequence[PlanEntry], world: DeviceMesh | None) -> None:
    """Refuse parameters whose replicas differ across the ranks that share them.

    **Collective** over every replica group of the plan's parameters (one all-gather of
    one int64 per tensor per group; for a DDP model one all-gather over the mesh), then one
    all-reduce of a flag per world mesh dim so that every rank raises if any rank found a
    mismatch. Reads each replicated parameter once (no copy for contiguous pieces).

    Raises:
        ValueError: on the ranks of a group whose replicas differ, naming the tensors and
            the ranks; ``RuntimeError`` on every other rank, naming those ranks.
    """
    groups: dict[str, tuple[dist.ProcessGroup, list[PlanEntry]]] = {}
    for entry in entries:
        if not entry.is_parameter:
            continue
        for level in entry.levels:
            groups.setdefault(level.key, (level.group, []))[1].append(entry)
    if world is None and not groups:
        return
    error: ValueError | None = None
    for group, members in groups.values():
        mine = torch.stack([bit_checksum(e.source_piece) for e in members])
        table = torch.empty(
            dist.get_world_size(group), *mine.shape, dtype=mine.dtype, device=mine.device
        )
        all_gather_single(table.view(-1), mine, group=group)
        differs = (table != table[:1]).any(dim=0).nonzero().flatten().tolist()
        if differs and error is None:
            names = [members[i].fqn for i in differs]
            error = ValueError(
                f"the model's replicated parameters differ across ranks "
                f"{dist.get_process_group_ranks(group)}: {names[:5]}"
                f"{' ...' if len(names) > 5 else ''} ({len(names)} tensors). Each rank "
                "averages only its rows, so the EMA would stitch rows of different models. "
                "Build the EMA after the ranks hold the same weights: after DDP wraps the "
                "model (DDP broadcasts rank 0's weights), or seed every rank alike."
            )
    mesh_agree(world, error, "checking that replicated parameters are identical")
