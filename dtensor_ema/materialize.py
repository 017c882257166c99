"""Turn local shards back into full tensors with as few collectives as possible.

``DTensor.full_tensor()`` issues one all-gather per tensor and pads uneven shards (161
collectives for ResNet-50). Here every rank packs its local shards of many tensors into one
flat buffer, a single ``all_gather_into_tensor`` per bucket moves them, and each full tensor
is cut back out of the gathered rows. The layout of every rank's buffer is computed from the
global shapes alone (``Shard(0)`` chunk semantics), so nothing but the payload is exchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from dtensor_ema.layout import chunk_range, contiguous_stride, shard_mesh_dim

__all__ = ["DEFAULT_BUCKET_BYTES", "LocalPiece", "gather_full_tensors", "gather_to_rank0"]

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Upper bound on one gathered bucket (``W`` ranks' padded rows together)."""

# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single (absent in 2.7).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """This rank's local piece of a global tensor, and how the pieces are laid out.

    ``mesh=None`` or all-``Replicate`` placements mean ``local`` already is the full tensor.
    """

    fqn: str
    local: torch.Tensor
    shape: torch.Size
    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]
    out_dtype: torch.dtype


def gather_full_tensors(
    pieces: Sequence[LocalPiece],
    *,
    rank0_only: bool = False,
    cpu_offload: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[str, torch.Tensor]:
    """Materialize full tensors from local pieces. **Collective** on every mesh involved.

    Pieces sharded on dim 0 over one mesh dim (``Shard(0)``, HSDP ``(Replicate, Shard(0))``)
    travel in flat buckets: one all-gather per (process group, device, dtype) bucket of at
    most ``bucket_bytes``. Any other sharded layout falls back to ``full_tensor()``.

    Args:
        pieces: identical sequence (fqns, shapes, placements) on every rank.
        rank0_only: only global rank 0 keeps the result; other ranks return ``{}`` but must
            still call (they take part in the collectives).
        cpu_offload: results live on the CPU; the gathered buckets are freed as they go, so
            peak device memory is about one bucket.
        bucket_bytes: bound on one bucket's gathered bytes (at least one tensor per bucket).

    Returns:
        ``fqn -> full tensor`` of shape ``piece.shape`` and dtype ``piece.out_dtype``,
        contiguous, sharing no memory with the pieces.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    flat_groups: dict[tuple[Any, ...], list[LocalPiece]] = {}
    for piece in pieces:
        mesh_dim = shard_mesh_dim(piece.placements) if piece.mesh is not None else None
        if piece.mesh is None or not piece.placements or _all_replicate(piece.placements):
            if keep:
                out[piece.fqn] = _to_output(piece.local, piece.out_dtype, cpu_offload)
        elif mesh_dim is None:
            full = DTensor.from_local(
                piece.local,
                piece.mesh,
                piece.placements,
                run_check=False,
                shape=piece.shape,
                stride=contiguous_stride(piece.shape),
            ).full_tensor()
            if keep:
                out[piece.fqn] = _to_output(full, piece.out_dtype, cpu_offload)
        else:
            key = (piece.mesh, mesh_dim, piece.local.device, piece.out_dtype)
            flat_groups.setdefault(key, []).append(piece)
    for (mesh, mesh_dim, _, _), group_pieces in flat_groups.items():
        assert isinstance(mesh, DeviceMesh)
        assert isinstance(mesh_dim, int)
        for bucket in _buckets(group_pieces, mesh.size(mesh_dim), bucket_bytes):
            out.update(_gather_bucket(bucket, mesh, mesh_dim, keep=keep, cpu=cpu_offload))
    return {p.fqn: out[p.fqn] for p in pieces if p.fqn in out}


def _all_replicate(placements: Iterable[Placement]) -> bool:
    return all(p.is_replicate() for p in placements)


def _to_output(tensor: torch.Tensor, dtype: torch.dtype, cpu: bool) -> torch.Tensor:
    device = torch.device("cpu") if cpu else tensor.device
    return tensor.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _row_numel(shape: torch.Size) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _buckets(
    pieces: list[LocalPiece], world_size: int, bucket_bytes: int
) -> Iterable[list[LocalPiece]]:
    """Consecutive runs of pieces whose gathered size stays under ``bucket_bytes``."""
    bucket: list[LocalPiece] = []
    size = 0
    for piece in pieces:
        rows = math.ceil(piece.shape[0] / world_size) if piece.shape[0] else 0
        piece_bytes = rows * _row_numel(piece.shape) * world_size * piece.local.element_size()
        if bucket and size + piece_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(piece)
        size += piece_bytes
    if bucket:
        yield bucket


def _send_buffer(
    pieces: list[LocalPiece], numels: list[int], padded: int, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's flat send buffer of ``padded`` elements: the local pieces in order.

    When the pieces already lie back to back in one storage in ``dtype`` (EMA shards made
    with ``parameters_as_bucket_view=True``) and the storage extends ``padded`` elements
    from the first one, the buffer is a view of it: no packing copy. The elements past this
    rank's own (padding for ranks with shorter shards) are sent but never read.
    """
    for piece, numel in zip(pieces, numels, strict=True):
        assert piece.local.numel() == numel, (piece.fqn, piece.local.shape, numel)
    first = next((p.local for p in pieces if p.local.numel()), pieces[0].local)
    if first.numel() and all(p.local.dtype == dtype and p.local.is_contiguous() for p in pieces):
        itemsize = first.element_size()
        expected = first.data_ptr()
        adjacent = True
        for piece in pieces:
            if piece.local.numel() and piece.local.data_ptr() != expected:
                adjacent = False
                break
            expected += piece.local.numel() * itemsize
        storage = first.untyped_storage()
        offset = first.storage_offset()
        if adjacent and (offset + padded) * itemsize <= storage.nbytes():
            return first.new_empty(0).set_(storage, offset, (padded,), (1,))
    send = torch.empty(padded, dtype=dtype, device=first.device)
    cursor = 0
    for piece, numel in zip(pieces, numels, strict=True):
        send[cursor : cursor + numel].view(piece.local.shape).copy_(piece.local)
        cursor += numel
    return send


def _gather_bucket(
    pieces: list[LocalPiece], mesh: DeviceMesh, mesh_dim: int, *, keep: bool, cpu: bool
) -> dict[str, torch.Tensor]:
    """One flat all-gather over ``mesh_dim``'s group, then cut the full tensors out."""
    world_size = mesh.size(mesh_dim)
    my_rank = mesh.get_local_rank(mesh_dim)
    # segment[r][i]: numel of piece i in rank r's buffer; every rank derives all of them.
    segments = [
        [chunk_range(p.shape[0], world_size, r)[1] * _row_numel(p.shape) for p in pieces]
        for r in range(world_size)
    ]
    padded = max(sum(row) for row in segments)
    dtype = pieces[0].out_dtype
    device = pieces[0].local.device
    if padded == 0:  # every rank derives the same zero: all skip the collective together
        target = torch.device("cpu") if cpu else device
        return (
            {p.fqn: torch.empty(p.shape, dtype=dtype, device=target) for p in pieces}
            if keep
            else {}
        )
    send = _send_buffer(pieces, segments[my_rank], padded, dtype)
    recv = torch.empty(world_size * padded, dtype=dtype, device=device)
    _all_gather_flat(recv, send, group=mesh.get_group(mesh_dim))
    del send
    if not keep:
        return {}
    rows = recv.view(world_size, padded)
    out: dict[str, torch.Tensor] = {}
    cursors = [0] * world_size
    for i, piece in enumerate(pieces):
        full = torch.empty(piece.shape, dtype=dtype, device=torch.device("cpu") if cpu else device)
        flat = full.view(-1)
        start = 0
        for r in range(world_size):
            numel = segments[r][i]
            flat[start : start + numel].copy_(rows[r, cursors[r] : cursors[r] + numel])
            start += numel
            cursors[r] += numel
        out[piece.fqn] = full
    return out


def gather_to_rank0(
    pieces: Sequence[LocalPiece],
    *,
    cpu_offload: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[str, torch.Tensor]:
    """Materialize full tensors on global rank 0 only. **Collective** (see below).

    Like :func:`gather_full_tensors` with ``rank0_only=True``, but the flat buckets travel
    with ``dist.gather`` to rank 0 instead of an all-gather to everyone: a rank other than
    0 holds only its send buffer (its ``1/W`` share of one bucket, nothing at all when its
    shards are gathered straight from a bucket view) and receives nothing. Pieces sharded
    over a process group that does not contain rank 0 (the other replicas of an HSDP mesh)
    are not sent: rank 0 gets them from its own group. Layouts without a flat gather fall
    back to ``full_tensor()`` (an all-gather).

    Every rank of every process group involved must call this, with the same ``pieces``
    (fqns, shapes, placements) and ``bucket_bytes``.

    Returns:
        On rank 0 (or without a process group): ``fqn -> full tensor`` as
        :func:`gather_full_tensors`. Elsewhere: ``{}``.
    """
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    flat_groups: dict[tuple[Any, ...], list[LocalPiece]] = {}
    for piece in pieces:
        mesh_dim = shard_mesh_dim(piece.placements) if piece.mesh is not None else None
        if piece.mesh is None or not piece.placements or _all_replicate(piece.placements):
            if keep:
                out[piece.fqn] = _to_output(piece.local, piece.out_dtype, cpu_offload)
        elif mesh_dim is None:
            full = DTensor.from_local(
                piece.local,
                piece.mesh,
                piece.placements,
                run_check=False,
                shape=piece.shape,
                stride=contiguous_stride(piece.shape),
            ).full_tensor()
            if keep:
                out[piece.fqn] = _to_output(full, piece.out_dtype, cpu_offload)
        else:
            key = (piece.mesh, mesh_dim, piece.local.device, piece.out_dtype)
            flat_groups.setdefault(key, []).append(piece)
    for (mesh, mesh_dim, _, _), group_pieces in flat_groups.items():
        assert isinstance(mesh, DeviceMesh)
        assert isinstance(mesh_dim, int)
        group = mesh.get_group(mesh_dim)
        if 0 not in dist.get_process_group_ranks(group):
            continue
        for bucket in _buckets(group_pieces, mesh.size(mesh_dim), bucket_bytes):
            out.update(_gather_bucket_to_rank0(bucket, mesh, mesh_dim, keep=keep, cpu=cpu_offload))
    return {p.fqn: out[p.fqn] for p in pieces if p.fqn in out}


def _gather_bucket_to_rank0(
    pieces: list[LocalPiece], mesh: DeviceMesh, mesh_dim: int, *, keep: bool, cpu: bool
) -> dict[str, torch.Tensor]:
    """One ``dist.gather`` of flat send buffers to global rank 0, then cut the tensors out."""
    world_size = mesh.size(mesh_dim)
    my_rank = mesh.get_local_rank(mesh_dim)
    segments = [
        [chunk_range(p.shape[0], world_size, r)[1] * _row_numel(p.shape) for p in pieces]
        for r in range(world_size)
    ]
    padded = max(sum(row) for row in segments)
    dtype = pieces[0].out_dtype
    device = pieces[0].local.device
    target = torch.device("cpu") if cpu else device
    if padded == 0:
        return (
            {p.fqn: torch.empty(p.shape, dtype=dtype, device=target) for p in pieces}
            if keep
            else {}
        )
    send = _send_buffer(pieces, segments[my_rank], padded, dtype)
    rows = torch.empty(world_size, padded, dtype=dtype, device=device) if keep else None
    dist.gather(
        send,
        list(rows.unbind(0)) if rows is not None else None,
        dst=0,
        group=mesh.get_group(mesh_dim),
    )
    del send
    if rows is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    cursors = [0] * world_size
    for i, piece in enumerate(pieces):
        full = torch.empty(piece.shape, dtype=dtype, device=target)
        flat = full.view(-1)
        start = 0
        for r in range(world_size):
            numel = segments[r][i]
            flat[start : start + numel].copy_(rows[r, cursors[r] : cursors[r] + numel])
            start += numel
            cursors[r] += numel
        out[piece.fqn] = full
    return out
