"""Swapping the EMA into the model's own tensors and back (``ModelEMA.average_parameters``).

Only the tracked tensors are swapped (``ModelEMA(track=...)``: the others are the model's
own already, and stay untouched). Each rank rebuilds only its own local piece of every
tracked tensor from the EMA rows the
plan gives it: for an FSDP2/TP parameter the EMA shard is gathered over the replica dims
only (none on a 1-D FSDP mesh), so the full model is never gathered on a rank; replicated
(plain/DDP) tensors are gathered in buckets straight into the model's tensors. The raw
weights come back the same way from a backup of this rank's EMA-sized rows (buffers, which
DDP does not keep identical across ranks, are backed up whole).

A ZeRO-3 parameter's piece is its partition, which DeepSpeed's own forward gathers: writing
the EMA there is the whole swap, with no copy of the model. Where DeepSpeed also holds a
parameter whole beside its partition (persistent parameters after a step; every parameter
after a forward without backward, such as an evaluation), the next forward reads the whole
copy instead, so it is refreshed from the pieces after each write
(:func:`_refresh_wholes`: bucketed flat all-gathers of those tensors on entry and on exit),
and ZeRO++ hpZ's secondary partitions (copies that backward gathers from) are dropped, as
DeepSpeed drops them after each optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from dtensor_ema.layout import PlanEntry
from dtensor_ema.materialize.gather import LocalPiece, SplitPiece, gather_full_tensors, iter_unsplit
from dtensor_ema.plan import EmaPlan, reshard_fsdp

__all__ = ["swapped_in"]

Backup = tuple[bool, torch.Tensor]


@contextlib.contextmanager
def swapped_in(plan: EmaPlan, model: nn.Module, bucket_bytes: int) -> Iterator[None]:
    """Hold the EMA in ``model``'s tensors for the body of the ``with``; restore on exit.

    **Collective** over the groups of the replica dims (and the world mesh of ZeRO-3
    parameters DeepSpeed holds whole), on entry and on exit (every rank of the mesh must
    enter). FSDP2 modules are resharded on entry and exit. Any error while
    swapping in restores the raw weights before it propagates.

    Peak extra memory: the backup (this rank's EMA-sized rows of each parameter, ``1/W`` of
    the swapped bytes; full local copies of plain buffers) plus one gathered bucket (at most
    ``bucket_bytes``, twice: the received rows and the rebuilt tensors); for ZeRO-3
    parameters DeepSpeed holds whole (persistent ones after a step, every one after a
    forward without backward), one bucket of their gathered values.
    """
    reshard_fsdp(model)
    backups = [_backup(entry) for entry in plan]
    with torch.no_grad():
        try:
            _write_pieces(plan.entries, [e.ema_local for e in plan], bucket_bytes)
            _refresh_wholes(plan.entries, bucket_bytes)
        except BaseException:
            _restore(plan.entries, backups, bucket_bytes)
            raise
    try:
        yield
    finally:
        reshard_fsdp(model)
        with torch.no_grad():
            _restore(plan.entries, backups, bucket_bytes)


def _write_pieces(
    entries: Sequence[PlanEntry], rows: Sequence[torch.Tensor], bucket_bytes: int
) -> None:
    """Rebuild each entry's local piece from ``rows`` (this rank's EMA-sized rows, one per
    entry) and copy it into the model. Collective over the replica dims."""
    split = [
        SplitPiece(r, e.source_piece.shape, e.levels, e.source_piece.dtype)
        for r, e in zip(rows, entries, strict=True)
    ]
    for bucket in iter_unsplit(split, bucket_bytes=bucket_bytes):
        for i, piece in bucket:
            entries[i].source_piece.copy_(piece)


def _restore(entries: Sequence[PlanEntry], backups: Sequence[Backup], bucket_bytes: int) -> None:
    """Put the raw weights back from :func:`_backup`'s copies (collective for the entries
    backed up by their EMA-sized rows only)."""
    split_entries = [e for e, (full, _) in zip(entries, backups, strict=True) if not full]
    _write_pieces(split_entries, [b for full, b in backups if not full], bucket_bytes)
    for entry, (full, backup) in zip(entries, backups, strict=True):
        if full:
            entry.source_piece.copy_(backup)
    _refresh_wholes(entries, bucket_bytes)


def _refresh_wholes(entries: Sequence[PlanEntry], bucket_bytes: int) -> None:
    """Write the model's whole copies (:meth:`~dtensor_ema.layout.PlanEntry.whole_view`)
    from its pieces, which were just written, and drop its cached copies of them
    (:meth:`~dtensor_ema.layout.PlanEntry.drop_cached_copies`). **Collective** over those
    entries' meshes when any has a whole copy (DeepSpeed keeps the ranks in the same
    state); nothing otherwise. Gathered in runs of at most ``bucket_bytes`` whole bytes."""
    for entry in entries:
        entry.drop_cached_copies()
    run: list[tuple[PlanEntry, torch.Tensor]] = []
    size = 0
    for entry in entries:
        whole = entry.whole_view()
        if whole is None:
            continue
        nbytes = whole.numel() * whole.element_size()
        if run and size + nbytes > bucket_bytes:
            _write_wholes(run, bucket_bytes)
            run, size = [], 0
        run.append((entry, whole))
        size += nbytes
    if run:
        _write_wholes(run, bucket_bytes)


def _write_wholes(run: list[tuple[PlanEntry, torch.Tensor]], bucket_bytes: int) -> None:
    pieces = [
        LocalPiece(e.fqn, e.source_piece, e.ema.shape, e.layout.mesh, e.layout.placements, w.dtype)
        for e, w in run
    ]
    full = gather_full_tensors(pieces, bucket_bytes=bucket_bytes)
    for entry, whole in run:
        whole.copy_(full.pop(entry.fqn).view(whole.shape))


def _backup(entry: PlanEntry) -> Backup:
    """What the swap saves of one tensor: ``(True, full local piece)`` for buffers, which
    ranks need not hold identically (BatchNorm statistics under DDP), ``(False, this rank's
    EMA-sized rows)`` for parameters, whose replicas are identical by construction."""
    if entry.levels and not entry.is_parameter:
        return True, entry.source_piece.clone()
    return False, entry.source_local.clone()
