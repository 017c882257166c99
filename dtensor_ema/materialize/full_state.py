"""Full state dicts keyed like the model: gathered out of the EMA, and loaded back into it.

Out (:func:`gather_state`): the EMA's (or the model's) local pieces travel in flat buckets
(:mod:`dtensor_ema.materialize.gather`), then the integer buffers and tied aliases are filled in, in
the model's key order (tensors the EMA does not track come from the model, or are left
out), and the model's own state-dict post-hooks run
(:func:`dtensor_ema.model_keys.to_model_keys`: torchtitan's fused ``wqkv`` comes out as
``wq``/``wk``/``wv``). In (:func:`load_full_state`): the model's load pre-hooks run first,
everything is checked, then each rank copies its own piece. Keys are the unwrapped model's
``state_dict()`` keys, without wrapper components (``_checkpoint_wrapped_module``, ...).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema.layout import PlanEntry, ema_local_from_full, model_geometry, model_shape
from dtensor_ema.materialize.gather import (
    LocalPiece,
    consecutive_runs,
    gather_full_tensors,
    gather_to_rank0,
)
from dtensor_ema.model_keys import from_model_keys, hooked_prefixes, to_model_keys
from dtensor_ema.plan import EmaPlan
from dtensor_ema.state import TensorSpec, compare_tensors

__all__ = ["gather_state", "iter_state", "load_full_state", "rank0_flag"]

StateDict = dict[str, Any]


def gather_state(
    plan: EmaPlan,
    model: nn.Module,
    which: Literal["ema", "model"],
    *,
    rank0_only: bool,
    cpu_offload: bool,
    bucket_bytes: int,
    include_untracked: bool = True,
) -> StateDict:
    """Full tensors of the EMA (``which="ema"``) or of the model's current weights.
    **Collective** over every mesh of the pieces (as :func:`gather_full_tensors`; with
    ``rank0_only`` a gather to rank 0 where the layout allows, and ``{}`` on other ranks).

    Returns contiguous tensors in the model's dtypes and key order, sharing no memory with
    the model or the EMA. With ``include_untracked`` (and always for ``which="model"``) it
    is a whole state dict: untracked float tensors and integer buffers carry the model's
    values. Without it, only the tracked tensors (and their tied aliases); integer buffers
    too when nothing is untracked, so an EMA of the whole model still gives a whole state
    dict.
    """
    whole = include_untracked or which == "model" or not plan.untracked
    ordered = _gather_keys(
        plan, which, plan.keys, whole,
        rank0_only=rank0_only, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes,
    )  # fmt: skip
    if rank0_only and not ordered:
        return {}
    return to_model_keys(model, ordered)


def iter_state(
    plan: EmaPlan,
    model: nn.Module,
    which: Literal["ema", "model"],
    *,
    rank0_only: bool,
    cpu_offload: bool,
    bucket_bytes: int,
    include_untracked: bool = True,
) -> Iterator[StateDict]:
    """:func:`gather_state`'s dict in consecutive pieces: each holds the full tensors of a
    run of the model's keys of at most ``bucket_bytes`` (at least one tensor; the keys of a
    module with state-dict post-hooks stay in one piece, so its hooks see all of them, and
    a tied alias comes with the tensor it shares). Every key comes once, in the model's
    order (hook outputs where the hooks put them). **Collective**: every rank of every
    mesh involved must run the iterator to its end (with ``rank0_only`` the other ranks get
    empty dicts).

    Peak extra memory: one piece (at most ``bucket_bytes``, or its one larger tensor) while
    it is gathered, plus what the model's hooks allocate on it; the previous piece is gone
    once the caller drops it.
    """
    whole = include_untracked or which == "model" or not plan.untracked
    for keys in _key_groups(plan, model, bucket_bytes):
        ordered = _gather_keys(
            plan, which, keys, whole,
            rank0_only=rank0_only, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes,
        )  # fmt: skip
        piece = to_model_keys(model, ordered) if ordered else {}
        ordered.clear()  # the hooks' inputs (a fused wqkv) go before the caller's next piece
        yield piece
        del piece


def _gather_keys(
    plan: EmaPlan,
    which: Literal["ema", "model"],
    keys: list[str],
    whole: bool,
    *,
    rank0_only: bool,
    cpu_offload: bool,
    bucket_bytes: int,
) -> StateDict:
    """The full tensors of ``keys`` (canonical fqns, in that order; tied aliases need
    their tensor's key among them), before the model's hooks. Collective."""
    entries = plan.by_fqn()
    untracked = plan.untracked if whole else {}
    piece = _ema_piece if which == "ema" else _source_piece
    world = plan.world
    wanted = set(keys)
    pieces = [piece(entries[k], world) for k in keys if k in entries]
    pieces += [_model_piece(k, untracked[k], world) for k in keys if k in untracked]
    shapes = {k: entries[k].shape for k in keys if k in entries}
    shapes.update({k: model_shape(untracked[k]) for k in keys if k in untracked})
    if rank0_only:  # a gather to rank 0: the other ranks receive nothing
        full = gather_to_rank0(pieces, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes)
        if not full:
            return {}
    else:
        full = gather_full_tensors(pieces, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes)
    # ZeRO-3 parameters travel flattened: back to their real shapes (fresh, contiguous).
    full = {k: v.view(shapes[k]) if k in shapes else v for k, v in full.items()}
    device = torch.device("cpu") if cpu_offload else None
    followed = (
        {
            k: v.detach().to(device=device, copy=True)
            for k, v in plan.followed.items()
            if k in wanted
        }
        if whole
        else {}
    )
    ordered: StateDict = {}
    for key in keys:
        if key in full:
            ordered[key] = full[key]
        elif key in followed:
            ordered[key] = followed[key]
        elif key in plan.aliases and plan.aliases[key] in full:
            ordered[key] = full[plan.aliases[key]]
    return ordered


def _key_groups(plan: EmaPlan, model: nn.Module, bucket_bytes: int) -> Iterator[list[str]]:
    """Runs of ``plan.keys`` for :func:`iter_state`: units (a key; all keys under the
    outermost module with state-dict post-hooks; a tied alias joined to its tensor's unit)
    packed in order into groups of at most ``bucket_bytes`` of full tensors."""
    entries = plan.by_fqn()
    hooked = sorted(p for p in hooked_prefixes(model) if p)
    unit_of: dict[str, str] = {}
    for key in plan.keys:
        target = plan.aliases.get(key, key)
        outer = next((p for p in hooked if target.startswith(p)), None)
        unit_of[key] = outer if outer is not None else target
    if "" in hooked_prefixes(model):  # the root's hooks see every key
        unit_of = dict.fromkeys(plan.keys, "")
    units: dict[str, list[str]] = {}
    for key in plan.keys:
        units.setdefault(unit_of[key], []).append(key)

    def nbytes(key: str) -> int:
        if key in plan.aliases:
            return 0
        if key in entries:
            entry = entries[key]
            return math.prod(entry.shape) * entry.source.element_size()
        tensor = plan.untracked.get(key)
        return 0 if tensor is None else math.prod(model_shape(tensor)) * tensor.element_size()

    sizes = [sum(nbytes(k) for k in keys) for keys in units.values()]
    for run in consecutive_runs(list(units.values()), sizes, bucket_bytes):
        yield [k for keys in run for k in keys]


@torch.no_grad()
def load_full_state(plan: EmaPlan, model: nn.Module, state_dict: StateDict) -> None:
    """Copy this rank's piece of every full tensor in ``state_dict`` into the EMA. Local.

    Values are cast to the EMA dtype; integer buffers, tied aliases and untracked tensors
    may be present (they are ignored) or absent. Peak extra memory: none beyond the given
    tensors (and their casts).

    Raises:
        ValueError: missing or unexpected names, shape mismatches, non-float values for
            averaged tensors. Nothing is written then.
    """
    state_dict = from_model_keys(model, state_dict)
    ours = {e.fqn: TensorSpec(tuple(e.shape), e.ema_local.dtype) for e in plan}
    saved = {
        k: (
            v.to(ours[k].dtype)
            if isinstance(v, torch.Tensor) and k in ours and v.is_floating_point()
            else v
        )
        for k, v in state_dict.items()
    }
    problems = compare_tensors(saved, ours, ignore=[*plan.followed, *plan.aliases, *plan.untracked])
    if problems:
        raise ValueError(f"full EMA state dict does not match the model: {problems}")
    pieces = [(e.ema_local, ema_local_from_full(e, saved[e.fqn])) for e in plan]
    for target, piece in pieces:
        target.copy_(piece)


def gather_options(
    rank0_only: bool | None, only_rank0_receives: bool, cpu_offload: bool, bucket_bytes: int
) -> dict[str, Any]:
    """The keyword arguments of :func:`gather_state` from ``get_*_state_dict``'s (the
    deprecated ``rank0_only`` folded in, see :func:`rank0_flag`)."""
    return {
        "rank0_only": rank0_flag(rank0_only, only_rank0_receives),
        "cpu_offload": cpu_offload,
        "bucket_bytes": bucket_bytes,
    }


def rank0_flag(rank0_only: bool | None, only_rank0_receives: bool) -> bool:
    """``rank0_only`` read as "only rank 0 calls", which hangs the collective: renamed to
    ``only_rank0_receives``; the old name still works, with a ``DeprecationWarning``."""
    if rank0_only is None:
        return only_rank0_receives
    warnings.warn(
        "rank0_only= is deprecated: every rank must still call; use only_rank0_receives=",
        DeprecationWarning,
        stacklevel=4,
    )
    return rank0_only or only_rank0_receives


def _ema_piece(entry: PlanEntry, world: DeviceMesh | None) -> LocalPiece:
    return dataclasses.replace(
        _source_piece(entry, world),
        local=entry.ema_local,
        levels=entry.levels,
        piece_shape=entry.source_piece.shape,
    )


def _source_piece(entry: PlanEntry, world: DeviceMesh | None) -> LocalPiece:
    return dataclasses.replace(
        _model_piece(entry.fqn, entry.source, world), local=entry.source_piece
    )


def _model_piece(fqn: str, tensor: torch.Tensor, world: DeviceMesh | None) -> LocalPiece:
    """The model's own local piece of ``tensor`` (``to_local()`` of a DTensor, the
    partition of a ZeRO-3 parameter as a shard of its flattened tensor)."""
    local, shape, mesh, placements = model_geometry(tensor, world)
    return LocalPiece(
        fqn=fqn,
        local=local,
        shape=shape,
        mesh=mesh,
        placements=placements,
        out_dtype=tensor.dtype,
    )
