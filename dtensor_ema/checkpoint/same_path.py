"""All ranks of a checkpoint call name the same directory, and a save gets one id.

A per-rank timestamp in a folder name, or a "latest" link resolved per rank, gives each
rank its own path: DCP then writes each rank's files into its own folder (the checkpoint
is lost) or loads each rank's rows from another checkpoint. :func:`agree_on_path` compares
a digest of every rank's resolved path before anything is written or read, and hands out
the save id rank 0 drew, in the same all-reduce.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from dtensor_ema._collectives import MESSAGE_BYTES, MESSAGE_RANKS, all_reduce, reduce_device
from dtensor_ema.checkpoint.files import Url

__all__ = ["agree_on_path"]

_DIGEST_BYTES = 16


def agree_on_path(group: dist.ProcessGroup | None, path: Path | Url, call: str) -> str:
    """Check that every rank of ``group`` resolves ``path`` to the same directory.

    **Collective** over ``group`` (``None``: one process, no communication): one all-reduce
    of ``(world size + 1) x 16`` bytes (each rank's path digest, and rank 0's fresh id); only
    when ranks differ, one more of at most :data:`MESSAGE_RANKS` paths of
    :data:`MESSAGE_BYTES` bytes, so that every rank can name them.

    Args:
        group: the process group of the call.
        path: this rank's path (resolved here: ``Path.resolve()``), or URL (as given).
        call: the public call, for the message (``"save_checkpoint"``).

    Returns:
        The id rank 0 drew for this call, the same on every rank (a UUID).

    Raises:
        ValueError: on every rank, when some rank's resolved path differs from rank 0's,
            naming rank 0's path and those of the first differing ranks.
    """
    resolved = path.resolve() if isinstance(path, Path) else path
    drawn = uuid.uuid4()
    if group is None or dist.get_world_size(group) == 1:
        return str(drawn)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = reduce_device(group)
    rows = torch.zeros(world + 1, _DIGEST_BYTES, dtype=torch.uint8, device=device)
    digest = hashlib.blake2b(str(resolved).encode(errors="surrogateescape"), digest_size=16)
    rows[rank] = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    if rank == 0:
        rows[world] = torch.frombuffer(bytearray(drawn.bytes), dtype=torch.uint8)
    all_reduce(rows, group=group)  # each row has one writer: the sum is that row
    rows = rows.cpu()
    save_id = str(uuid.UUID(bytes=bytes(rows[world].numpy().tobytes())))
    differing = [r for r in range(1, world) if not torch.equal(rows[r], rows[0])]
    if not differing:
        return save_id
    shown = [0, *differing[: MESSAGE_RANKS - 1]]
    paths = torch.zeros(len(shown), MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if rank in shown:
        encoded = str(resolved).encode(errors="replace")[:MESSAGE_BYTES]
        paths[shown.index(rank), : len(encoded)] = torch.frombuffer(
            bytearray(encoded), dtype=torch.uint8
        )
    all_reduce(paths, group=group)
    named = [f"rank {r}: {_text(row)}" for r, row in zip(shown, paths.cpu(), strict=True)]
    more = len(differing) - (len(shown) - 1)
    raise ValueError(
        f"{call}() was given different paths on different ranks ({len(differing)} of "
        f"{world} ranks differ from rank 0): {'; '.join(named)}"
        + (f"; {more} more differing ranks not shown" if more > 0 else "")
        + ". Every rank must pass the same checkpoint path (a per-rank timestamp in the name, "
        "or a link resolved per rank, gives each rank its own); nothing was written or read"
    )


def _text(row: torch.Tensor) -> str:
    return bytes(row.numpy().tobytes()).rstrip(b"\0").decode(errors="replace")
