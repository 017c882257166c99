"""Turn local shards back into full tensors with as few collectives as possible.

``DTensor.full_tensor()`` issues one all-gather per tensor and pads uneven shards (161
collectives for ResNet-50). Here every rank packs its local shards of many tensors into one
flat buffer, a single flat all-gather (``all_gather_single``) per bucket moves them, and
each tensor is cut back out of the gathered rows. The layout of every rank's buffer is
computed from the shapes alone (``Shard(0)`` chunk semantics), so nothing but the payload
is exchanged.

Two stages, each bucketed:

1. :func:`iter_unsplit` undoes the replica split of :mod:`dtensor_ema.layout`: one flat
   all-gather per replica dim, innermost first, rebuilds each tensor's *local piece* (what
   the rank holds of it in the model). This is all the evaluation swap needs.
2. :func:`gather_full_tensors` then gathers pieces that are themselves sharded (FSDP2/TP
   parameters) over their own mesh, one mesh dim at a time, the last split first: one flat
   all-gather per mesh dim and bucket, concatenating along whichever tensor dim that mesh
   dim shards (``Shard(d)``, and FSDP2 over TP's ``_StridedShard``);
   ``DTensor.full_tensor()`` for any other layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtensor_ema._collectives import all_gather_single, gather
from dtensor_ema.layout import ReplicaLevel, chunk_range, contiguous_stride, shard_mesh_dim

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "LocalPiece",
    "SplitPiece",
    "consecutive_runs",
    "gather_full_tensors",
    "gather_to_rank0",
    "iter_unsplit",
]

T = TypeVar("T")

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Upper bound on one gathered bucket (``W`` ranks' padded rows together)."""

_all_gather_flat = all_gather_single


@dataclass(frozen=True, slots=True)
class SplitPiece:
    """This rank's rows of a tensor's local piece, split over replica ``levels``.

    ``piece_shape``: the local piece's shape once every level is gathered back;
    ``dtype``: the dtype the rows travel in and the result has.
    """

    local: torch.Tensor
    piece_shape: torch.Size
    levels: tuple[ReplicaLevel, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """This rank's EMA (or model) rows of a global tensor, and how they are laid out.

    ``levels``: replica dims to undo first (see :class:`SplitPiece`); the result is the
    local piece of ``shape`` under ``mesh``/``placements`` (the model tensor's own layout;
    ``mesh=None`` or all-``Replicate`` mean the piece already is the full tensor).
    """

    fqn: str
    local: torch.Tensor
    shape: torch.Size
    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]
    out_dtype: torch.dtype
    levels: tuple[ReplicaLevel, ...] = ()
    piece_shape: torch.Size | None = None


def iter_unsplit(
    pieces: Sequence[SplitPiece], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """Rebuild local pieces from their replica-split rows, one bucket at a time.

    **Collective** over each replica level's process group: every rank of those groups
    must iterate to the end with the same sequence of pieces (fqns, shapes, levels).
    Pieces without levels are yielded as they are (no copy).

    Yields:
        Lists of ``(index into pieces, tensor of piece_shape)``; tensors of a bucket are
        fresh and contiguous, in ``piece.dtype``. Peak extra memory: about one bucket
        (at most ``bucket_bytes`` gathered, plus the bucket's outputs).
    """
    plain: list[tuple[int, torch.Tensor]] = []
    grouped: dict[tuple[Any, ...], list[int]] = {}
    for i, piece in enumerate(pieces):
        if not piece.levels:
            plain.append((i, piece.local))
            continue
        key = (tuple(level.key for level in piece.levels), piece.local.device, piece.dtype)
        grouped.setdefault(key, []).append(i)
    if plain:
        yield plain
    for indices in grouped.values():
        direct = [i for i in indices if _direct(pieces[i])]
        for i in direct:  # large, evenly split: gathered straight into their output
            yield [(i, _gather_direct(pieces[i]))]
        bucketed = [i for i in indices if not _direct(pieces[i])]
        for bucket in _buckets(bucketed, pieces, bucket_bytes):
            yield list(zip(bucket, _unsplit_bucket([pieces[i] for i in bucket]), strict=True))


DIRECT_BYTES = 1 << 20
"""Pieces at least this large whose rows split evenly skip the flat buffers (one
all-gather each, straight into the output: no packing, no unpacking, no extra memory)."""


def _direct(piece: SplitPiece) -> bool:
    if len(piece.levels) != 1:
        return False
    level = piece.levels[0]
    nbytes = math.prod(piece.piece_shape) * piece.local.element_size()
    return level.rows % level.size == 0 and nbytes >= DIRECT_BYTES


def _gather_direct(piece: SplitPiece) -> torch.Tensor:
    out = torch.empty(piece.piece_shape, dtype=piece.dtype, device=piece.local.device)
    send = piece.local.to(piece.dtype, memory_format=torch.contiguous_format)
    _all_gather_flat(out.view(-1), send.reshape(-1), group=piece.levels[0].group)
    return out


def _buckets(
    indices: list[int], pieces: Sequence[SplitPiece], bucket_bytes: int
) -> Iterable[list[int]]:
    """Consecutive runs of pieces whose gathered (piece-sized) bytes stay under the bound."""
    sizes = [math.prod(pieces[i].piece_shape) * pieces[i].local.element_size() for i in indices]
    return consecutive_runs(indices, sizes, bucket_bytes)


def consecutive_runs(items: Sequence[T], sizes: Sequence[int], bound: int) -> Iterator[list[T]]:
    """Split ``items`` into consecutive runs whose ``sizes`` add up to at most ``bound``
    (a single item larger than ``bound`` forms a run of its own): every bucketed pass of
    the package packs its work this way."""
    run: list[T] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if run and total + size > bound:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run


def _row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _unsplit_bucket(pieces: list[SplitPiece]) -> list[torch.Tensor]:
    """Gather the pieces' rows level by level (innermost first); they share their levels."""
    current = [p.local for p in pieces]
    depth = len(pieces[0].levels)
    for k in reversed(range(depth)):
        level = pieces[0].levels[k]
        rows = [p.levels[k].rows for p in pieces]
        shapes = [(r, *p.piece_shape[1:]) for r, p in zip(rows, pieces, strict=True)]
        current = _gather_rows(current, shapes, level, pieces[0].dtype)
    return current


def _send_buffer(
    locals_: Sequence[torch.Tensor], numels: list[int], padded: int, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's flat send buffer of ``padded`` elements: the local pieces in order.

    When the pieces already lie back to back in one storage in ``dtype`` (EMA shards made
    with ``parameters_as_bucket_view=True``) and the storage extends ``padded`` elements
    from the first one, the buffer is a view of it: no packing copy. The elements past this
    rank's own (padding for ranks with shorter shards) are sent but never read.
    """
    for local, numel in zip(locals_, numels, strict=True):
        assert local.numel() == numel, (tuple(local.shape), numel)
    first = next((t for t in locals_ if t.numel()), locals_[0])
    if first.numel() and all(t.dtype == dtype and t.is_contiguous() for t in locals_):
        itemsize = first.element_size()
        expected = first.data_ptr()
        adjacent = True
        for local in locals_:
            if local.numel() and local.data_ptr() != expected:
                adjacent = False
                break
            expected += local.numel() * itemsize
        storage = first.untyped_storage()
        offset = first.storage_offset()
        if adjacent and (offset + padded) * itemsize <= storage.nbytes():
            return first.new_empty(0).set_(storage, offset, (padded,), (1,))
    send = torch.empty(padded, dtype=dtype, device=first.device)
    cursor = 0
    for local, numel in zip(locals_, numels, strict=True):
        send[cursor : cursor + numel].view(local.shape).copy_(local)
        cursor += numel
    return send


def _gather_rows(
    locals_: list[torch.Tensor],
    shapes: list[tuple[int, ...]],
    level: ReplicaLevel,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One flat all-gather over ``level.group``: each output of ``shapes[i]`` is the
    concatenation of every rank's dim-0 chunk (``Shard(0)`` semantics) of it."""
    size, me = level.size, level.rank
    segments = [
        [chunk_range(shape[0], size, r)[1] * _row_numel(shape) for shape in shapes]
        for r in range(size)
    ]
    padded = max(sum(row) for row in segments)
    device = locals_[0].device
    outputs = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    if padded == 0:  # every rank derives the same zero: all skip the collective together
        return outputs
    send = _send_buffer(locals_, segments[me], padded, dtype)
    recv = torch.empty(size * padded, dtype=dtype, device=device)
    _all_gather_flat(recv, send, group=level.group)
    del send
    _unpack_(outputs, recv.view(size, padded), segments)
    return outputs


def _unpack_(
    outputs: Sequence[torch.Tensor], rows: torch.Tensor, segments: list[list[int]]
) -> None:
    """Fill each output with its segments of every rank's gathered row, in rank order.

    ``rows[r]`` is rank ``r``'s flat buffer; ``segments[r][i]`` the numel output ``i``
    takes from it (rank ``r``'s ``Shard(0)`` chunk), consecutively per rank."""
    cursors = [0] * len(segments)
    for i, out in enumerate(outputs):
        flat = out.view(-1)
        start = 0
        for r, row_segments in enumerate(segments):
            numel = row_segments[i]
            flat[start : start + numel].copy_(rows[r, cursors[r] : cursors[r] + numel])
            start += numel
            cursors[r] += numel


def gather_full_tensors(
    pieces: Sequence[LocalPiece],
    *,
    rank0_only: bool = False,
    cpu_offload: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[str, torch.Tensor]:
    """Materialize full tensors from local pieces. **Collective** on every group involved
    (the replica levels' groups and the pieces' meshes).

    Args:
        pieces: identical sequence (fqns, shapes, placements, levels) on every rank.
        rank0_only: only global rank 0 keeps the result; other ranks return ``{}`` but must
            still call (they take part in the collectives).
        cpu_offload: results live on the CPU; gathered buckets are freed as they go, so
            peak device memory is about one bucket.
        bucket_bytes: bound on one bucket's gathered bytes (at least one tensor per bucket).

    Returns:
        ``fqn -> full tensor`` of shape ``piece.shape`` and dtype ``piece.out_dtype``,
        contiguous, sharing no memory with the pieces.

    Raises:
        ValueError: a piece is a tensor subclass (a model tensor the EMA does not hold, such
            as QLoRA's NF4 weights, see :func:`~dtensor_ema.layout.plain_tensor`), on
            every rank before any collective.
    """
    odd = [
        f"{p.fqn!r} ({type(p.local).__name__})" for p in pieces if type(p.local) is not torch.Tensor
    ]
    if odd:
        raise ValueError(
            f"cannot copy the model's {', '.join(odd[:3])} into a plain full tensor: a tensor "
            "subclass the EMA does not hold. Take the tracked tensors only (get_ema_state_dict()"
            ", export_peft_adapter), or evaluate in the model with ema.average_parameters()"
        )
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    sharded: list[LocalPiece] = []
    split = [_split_of(p) for p in pieces]
    for bucket in iter_unsplit(split, bucket_bytes=bucket_bytes):
        for i, piece_tensor in bucket:
            piece = pieces[i]
            if _is_full(piece):
                if keep and piece_tensor is piece.local:  # not gathered: still ours
                    out[piece.fqn] = _to_output(piece_tensor, piece.out_dtype, cpu_offload)
                elif keep:  # a fresh gathered tensor already in out_dtype: no second copy
                    out[piece.fqn] = piece_tensor.to("cpu") if cpu_offload else piece_tensor
            else:
                sharded.append(_replace_local(piece, piece_tensor))
    out.update(_gather_sharded(sharded, keep=keep, cpu=cpu_offload, bucket_bytes=bucket_bytes))
    return {p.fqn: out[p.fqn] for p in pieces if p.fqn in out}


@dataclass(frozen=True, slots=True)
class _Stage:
    """One flat all-gather on the way from a local piece to its full tensor: over
    ``mesh_dim``'s group, concatenating the ranks' chunks along tensor dim ``dim`` into a
    tensor of ``shape``."""

    mesh_dim: int
    dim: int
    shape: tuple[int, ...]


def _strided_split_factor(placement: Placement) -> int | None:
    """``split_factor`` of torch's private ``_StridedShard`` (FSDP2 over TP shards the
    TP-local piece: ``(_StridedShard(d, split_factor=tp), Shard(d))``), else ``None``. The
    one place that reads it; an unknown layout falls back to ``full_tensor()``."""
    if type(placement).__name__ != "_StridedShard":
        return None
    factor = getattr(placement, "split_factor", None)
    return factor if isinstance(factor, int) else None


def _shard_stages(piece: LocalPiece) -> list[_Stage] | None:
    """The flat gathers that rebuild ``piece``'s full tensor, the last split first; ``None``
    for layouts left to ``DTensor.full_tensor()``.

    Plain ``Shard`` placements split the tensor mesh dim by mesh dim, left to right
    (``torch.chunk`` semantics, so uneven chunks derive from the shapes alone); FSDP2 over
    TP, ``(_StridedShard(d, split_factor=n), Shard(d))`` with ``n`` the TP size, splits by
    the TP dim first, then the FSDP dim."""
    mesh, placements = piece.mesh, piece.placements
    coordinate = mesh.get_coordinate() if mesh is not None else None
    if mesh is None or coordinate is None:
        return None
    strided = [m for m, p in enumerate(placements) if _strided_split_factor(p) is not None]
    shards = [m for m, p in enumerate(placements) if isinstance(p, Shard)]
    others = set(range(len(placements))) - set(strided) - set(shards)
    if any(not isinstance(placements[m], Replicate) for m in others):
        return None  # Partial, or a private placement we do not know
    dims = {m: getattr(placements[m], "dim", None) for m in (*strided, *shards)}
    if strided:
        if len(strided) != 1 or len(shards) != 1:
            return None
        fsdp, tp = strided[0], shards[0]
        if tp <= fsdp or dims[fsdp] != dims[tp]:
            return None
        if _strided_split_factor(placements[fsdp]) != mesh.size(tp):
            return None
        order = [tp, fsdp]
    else:
        order = shards
    shape = list(piece.shape)
    shapes = [tuple(shape)]
    for mesh_dim in order:
        dim = dims[mesh_dim]
        assert isinstance(dim, int)
        shape[dim] = chunk_range(shape[dim], mesh.size(mesh_dim), coordinate[mesh_dim])[1]
        shapes.append(tuple(shape))
    if shapes[-1] != tuple(piece.local.shape):
        return None
    stages = []
    for k in reversed(range(len(order))):
        dim = dims[order[k]]
        assert isinstance(dim, int)
        stages.append(_Stage(order[k], dim, shapes[k]))
    return stages


def _gather_sharded(
    pieces: list[LocalPiece], *, keep: bool, cpu: bool, bucket_bytes: int
) -> dict[str, torch.Tensor]:
    """Full tensors of pieces sharded over their own mesh. **Collective** over the mesh
    dims' groups.

    Pieces go in consecutive runs of at most ``bucket_bytes`` full bytes; for each run,
    stage ``k`` of every piece is one flat all-gather per (mesh dim, device, dtype), so a
    2-D FSDP2+TP model costs about two collectives per run instead of one per tensor.
    Peak extra memory: one run's gathered tensors plus their intermediate pieces.
    """
    out: dict[str, torch.Tensor] = {}
    staged: list[tuple[LocalPiece, list[_Stage]]] = []
    for piece in pieces:  # the same order on every rank
        stages = _shard_stages(piece)
        if stages is not None:
            staged.append((piece, stages))
            continue
        assert piece.mesh is not None
        full = DTensor.from_local(
            piece.local,
            piece.mesh,
            piece.placements,
            run_check=False,
            shape=piece.shape,
            stride=contiguous_stride(piece.shape),
        ).full_tensor()
        if keep:
            out[piece.fqn] = _to_output(full, piece.out_dtype, cpu)
    sizes = [math.prod(p.shape) * p.local.element_size() for p, _ in staged]
    for run in consecutive_runs(staged, sizes, bucket_bytes):
        current = [piece.local for piece, _ in run]
        for k in range(max(len(stages) for _, stages in run)):
            groups: dict[tuple[Any, ...], list[int]] = {}
            for i, (piece, stages) in enumerate(run):
                if k < len(stages):
                    key = (piece.mesh, stages[k].mesh_dim, piece.local.device, piece.out_dtype)
                    groups.setdefault(key, []).append(i)
            for (mesh, mesh_dim, _, dtype), members in groups.items():
                gathered = _gather_stage(
                    [current[i] for i in members],
                    [run[i][1][k] for i in members],
                    mesh,
                    mesh_dim,
                    dtype,
                )
                for i, tensor in zip(members, gathered, strict=True):
                    current[i] = tensor
        if keep:
            for (piece, _), tensor in zip(run, current, strict=True):
                out[piece.fqn] = tensor.to("cpu") if cpu else tensor
    return out


def _gather_stage(
    locals_: list[torch.Tensor],
    stages: list[_Stage],
    mesh: DeviceMesh,
    mesh_dim: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One flat all-gather over ``mesh_dim``'s group: output ``i`` of ``stages[i].shape`` is
    the concatenation along ``stages[i].dim`` of every rank's chunk (``Shard`` semantics)."""
    size, me = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    segments = [
        [
            chunk_range(st.shape[st.dim], size, r)[1] * _numel_without(st.shape, st.dim)
            for st in stages
        ]
        for r in range(size)
    ]
    padded = max(sum(row) for row in segments)
    device = locals_[0].device
    if padded == 0:  # every rank derives the same zero: all skip the collective together
        return [torch.empty(st.shape, dtype=dtype, device=device) for st in stages]
    send = _send_buffer(locals_, segments[me], padded, dtype)
    recv = torch.empty(size * padded, dtype=dtype, device=device)
    _all_gather_flat(recv, send, group=mesh.get_group(mesh_dim))
    del send
    if len(stages) == 1 and stages[0].dim == 0 and all(r[0] == padded for r in segments):
        return [recv.view(stages[0].shape)]  # evenly split along dim 0: already in order
    outputs = [torch.empty(st.shape, dtype=dtype, device=device) for st in stages]
    rows = recv.view(size, padded)
    cursors = [0] * size
    for output, st in zip(outputs, stages, strict=True):
        for r in range(size):
            offset, length = chunk_range(st.shape[st.dim], size, r)
            chunk_shape = list(st.shape)
            chunk_shape[st.dim] = length
            numel = length * _numel_without(st.shape, st.dim)
            chunk = rows[r, cursors[r] : cursors[r] + numel].view(chunk_shape)
            output.narrow(st.dim, offset, length).copy_(chunk)
            cursors[r] += numel
    return outputs


def _numel_without(shape: Sequence[int], dim: int) -> int:
    """Elements per index of ``dim`` (the product of the other dims)."""
    return math.prod(size for d, size in enumerate(shape) if d != dim)


def _is_full(piece: LocalPiece) -> bool:
    """The local piece is the whole tensor (no mesh, or replicated on every mesh dim)."""
    return piece.mesh is None or not piece.placements or _all_replicate(piece.placements)


def _replace_local(piece: LocalPiece, local: torch.Tensor) -> LocalPiece:
    return LocalPiece(piece.fqn, local, piece.shape, piece.mesh, piece.placements, piece.out_dtype)


def _all_replicate(placements: Iterable[Placement]) -> bool:
    return all(p.is_replicate() for p in placements)


def _to_output(tensor: torch.Tensor, dtype: torch.dtype, cpu: bool) -> torch.Tensor:
    device = torch.device("cpu") if cpu else tensor.device
    return tensor.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def gather_to_rank0(
    pieces: Sequence[LocalPiece],
    *,
    cpu_offload: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[str, torch.Tensor]:
    """Materialize full tensors on global rank 0 only. **Collective** (see below).

    Like :func:`gather_full_tensors` with ``rank0_only=True``, but the flat buckets travel
    with ``dist.gather`` to rank 0 instead of an all-gather to everyone, so a rank other
    than 0 receives nothing and holds only its send buffer (its ``1/W`` share of one
    bucket; nothing when its shards are already adjacent, see ``parameters_as_bucket_view``).
    This covers replicated tensors split over one replica dim (plain/DDP models on a 1-D
    mesh) and sharded pieces with no replica split (FSDP2 on its own mesh); a group that
    does not contain rank 0 sends nothing (rank 0 gets those tensors from its own group).
    Other layouts (split over several replica dims, or sharded *and* split) go through
    :func:`gather_full_tensors` (all-gathers).

    Every rank of every process group involved must call this, with the same ``pieces``
    (fqns, shapes, placements, levels) and ``bucket_bytes``.

    Returns:
        On rank 0 (or without a process group): ``fqn -> full tensor`` as
        :func:`gather_full_tensors`. Elsewhere: ``{}``.
    """
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    rest: list[LocalPiece] = []
    groups: dict[tuple[Any, ...], list[tuple[LocalPiece, int]]] = {}
    for piece in pieces:
        full = _is_full(piece)
        if full and not piece.levels:
            if keep:
                out[piece.fqn] = _to_output(piece.local, piece.out_dtype, cpu_offload)
        elif full and len(piece.levels) == 1:
            level = piece.levels[0]
            key: tuple[Any, ...] = ("level", level.key, piece.local.device, piece.out_dtype)
            groups.setdefault(key, []).append((piece, 0))
        elif not full and not piece.levels and shard_mesh_dim(piece.placements) is not None:
            mesh_dim = shard_mesh_dim(piece.placements)
            assert piece.mesh is not None and mesh_dim is not None
            key = ("mesh", piece.mesh, mesh_dim, piece.local.device, piece.out_dtype)
            groups.setdefault(key, []).append((piece, mesh_dim))
        else:
            rest.append(piece)
    for key, members in groups.items():
        first, mesh_dim = members[0]
        if key[0] == "level":
            level = first.levels[0]
            group, size, me = level.group, level.size, level.rank
        else:
            assert first.mesh is not None
            group = first.mesh.get_group(mesh_dim)
            size, me = first.mesh.size(mesh_dim), first.mesh.get_local_rank(mesh_dim)
        if 0 not in dist.get_process_group_ranks(group):
            continue
        if key[0] == "level":  # iter_unsplit's order: the large, evenly split pieces last
            members.sort(key=lambda item: _direct(_split_of(item[0])))
        bucket: list[LocalPiece] = []
        nbytes = 0
        for piece, _ in members:
            piece_bytes = math.prod(piece.shape) * piece.local.element_size()
            if bucket and nbytes + piece_bytes > bucket_bytes:
                out.update(_gather_to_root(bucket, group, size, me, keep=keep, cpu=cpu_offload))
                bucket, nbytes = [], 0
            bucket.append(piece)
            nbytes += piece_bytes
        if bucket:
            out.update(_gather_to_root(bucket, group, size, me, keep=keep, cpu=cpu_offload))
    if rest:
        out.update(
            gather_full_tensors(
                rest, rank0_only=True, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes
            )
        )
    return {p.fqn: out[p.fqn] for p in pieces if p.fqn in out}


def _split_of(piece: LocalPiece) -> SplitPiece:
    """``piece`` as :func:`iter_unsplit` takes it: a full one in its output dtype, a
    sharded one (gathered over its mesh afterwards) in its own."""
    shape = piece.piece_shape if piece.piece_shape is not None else piece.local.shape
    dtype = piece.out_dtype if _is_full(piece) else piece.local.dtype
    return SplitPiece(piece.local, shape, piece.levels, dtype)


def _gather_to_root(
    pieces: list[LocalPiece],
    group: dist.ProcessGroup,
    size: int,
    me: int,
    *,
    keep: bool,
    cpu: bool,
) -> dict[str, torch.Tensor]:
    """One ``dist.gather`` of flat send buffers to global rank 0 over ``group`` (whose
    ranks hold the dim-0 chunks of every piece), then cut the full tensors out."""
    segments = [
        [chunk_range(p.shape[0], size, r)[1] * _row_numel(p.shape) for p in pieces]
        for r in range(size)
    ]
    padded = max(sum(row) for row in segments)
    dtype = pieces[0].out_dtype
    device = pieces[0].local.device
    target = torch.device("cpu") if cpu else device
    if padded == 0:
        if not keep:
            return {}
        return {p.fqn: torch.empty(p.shape, dtype=dtype, device=target) for p in pieces}
    send = _send_buffer([p.local for p in pieces], segments[me], padded, dtype)
    rows = torch.empty(size, padded, dtype=dtype, device=device) if keep else None
    gather(send, list(rows.unbind(0)) if rows is not None else None, dst=0, group=group)
    del send
    if rows is None:
        return {}
    if len(pieces) == 1 and rows.device == target and all(r[0] == padded for r in segments):
        return {pieces[0].fqn: rows.view(pieces[0].shape)}  # evenly split: already in order
    fulls = [torch.empty(p.shape, dtype=dtype, device=target) for p in pieces]
    _unpack_(fulls, rows, segments)
    return {p.fqn: full for p, full in zip(pieces, fulls, strict=True)}
