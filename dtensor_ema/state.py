"""What an EMA's checkpoint state holds, and the one place that checks a state against an EMA.

``ModelEMA.state_dict()`` (the schema, :data:`STATE_KEYS`)::

    {
        "updates": int,          # the update counter (>= 0)
        "config": str,           # JSON of the options that shape the next update
        "ema": {fqn: tensor},    # this rank's pieces: DTensors (sharded), or plain tensors
    }

The ``"ema"`` tensors are the live, sharded EMA tensors: on each rank a DTensor holds only
that rank's piece (a ZeRO-3 parameter's, a flat range of it, is a
:class:`~dtensor_ema.flat_chunks.FlatChunks`: DCP chunks of the real shape, so every
checkpoint holds every tensor in its real shape). The state is meant for
``torch.distributed.checkpoint`` (every rank writes its own piece, and DCP reshards on
load). ``torch.save`` of it on one rank captures one
rank's piece only: loading that file on another rank is refused (:func:`local_piece` checks
which rank a DTensor came from), never silently filled with the wrong rows.

:func:`validate_state` checks a candidate state (live tensors, tensors read from a file, or
shapes and dtypes read from a checkpoint's metadata) against the EMA's own state without
touching anything, and :func:`format_mismatch` words every mismatch the same way, so
``load_state_dict``, ``load_checkpoint`` and ``MultiModelEMA`` refuse alike and validate
before they write.

**Tracked sets** (``ModelEMA(track=...)``): a state holds only the tensors its EMA tracked,
and, when some float tensor was untracked, its ``config`` says so (``"track"`` and the
sorted ``"untracked"`` names, :data:`~dtensor_ema.options.TRACKING_CONFIG_KEYS`; absent
means every float tensor was tracked). :func:`tracked_difference` tells a state saved with
another tracked set of the same model from a state of another model; such a state is
refused, naming the tensors, unless the caller asks for the tensors both hold
(``common_subset=True``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtensor_ema.flat_chunks import FlatChunks
from dtensor_ema.layout import PlanEntry, ema_local_from_full
from dtensor_ema.options import TRACKING_CONFIG_KEYS
from dtensor_ema.plan import EmaPlan, listed
from dtensor_ema.update.counter import check_count

__all__ = [
    "CONFIG",
    "EMA_TENSORS",
    "STATE_KEYS",
    "UPDATES",
    "TensorSpec",
    "TrackedDifference",
    "check_config_values",
    "common_names",
    "compare_tensors",
    "deferred_names",
    "format_mismatch",
    "load_local_state",
    "local_piece",
    "local_state",
    "saved_count",
    "staging_state",
    "tag_rank",
    "tracked_difference",
    "validate_state",
    "wrapped_like",
]

UPDATES = "updates"
CONFIG = "config"
EMA_TENSORS = "ema"
STATE_KEYS = (UPDATES, CONFIG, EMA_TENSORS)
"""The keys of ``ModelEMA.state_dict()``; ``config`` may be absent (older states)."""

_RANK_TAG = "_dtensor_ema_coordinate"
"""Attribute set on each live EMA DTensor: the saving rank's coordinate in its mesh. Tensor
subclasses pickle their ``__dict__``, so ``torch.save`` keeps it and a load can tell whose
piece a DTensor holds."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of a saved tensor whose values are not at hand (checkpoint metadata)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> TensorSpec | None:
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), value.dtype)
    return None


def format_mismatch(
    missing: Sequence[str] = (),
    unexpected: Sequence[str] = (),
    mismatched: Sequence[str] = (),
    *,
    limit: int = 5,
) -> str:
    """``"missing [...]; unexpected [...]; mismatched [...]"``, at most ``limit`` names each,
    empty parts left out (``""`` when nothing differs)."""
    parts = [
        f"{label} {listed(names, limit)}"
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mismatched", mismatched),
        )
        if names
    ]
    return "; ".join(parts)


def compare_tensors(
    saved: Mapping[str, Any], ours: Mapping[str, Any], *, ignore: Sequence[str] = ()
) -> str:
    """Compare two ``fqn -> tensor or TensorSpec`` maps by names, shapes and dtypes.

    Returns :func:`format_mismatch`'s wording, ``""`` when they match. Names in ``ignore``
    are neither missing nor unexpected.
    """
    missing = [k for k in ours if k not in saved and k not in ignore]
    unexpected = [k for k in saved if k not in ours and k not in ignore]
    mismatched = []
    for k, value in ours.items():
        if k not in saved:
            continue
        theirs, mine = _spec(saved[k]), _spec(value)
        if theirs is None and mine is not None:
            mismatched.append(f"{k}: saved a non-tensor, this EMA has a tensor")
        elif theirs is not None and mine is not None and theirs != mine:
            mismatched.append(
                f"{k}: saved {theirs.shape} {theirs.dtype}, this EMA {mine.shape} {mine.dtype}"
            )
    return format_mismatch(missing, unexpected, mismatched)


def _config(value: str | Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value)


def _config_diffs(
    saved: str | Mapping[str, Any],
    ours: str | Mapping[str, Any],
    within: set[str] | None = None,
) -> list[str]:
    """Options that differ; the tracked set's description is metadata, not an option, and
    with ``within`` only the copied tensors among those names count."""
    theirs, mine = _config(saved), _config(ours)
    for key in TRACKING_CONFIG_KEYS:
        theirs.pop(key, None)
        mine.pop(key, None)
    if within is not None:
        for config in (theirs, mine):
            if isinstance(config.get("copied"), list):
                config["copied"] = [k for k in config["copied"] if k in within]
    return [
        f"{k}: checkpoint {theirs.get(k)!r}, this EMA {mine.get(k)!r}"
        for k in sorted(set(theirs) | set(mine))
        if theirs.get(k) != mine.get(k)
    ]


@dataclass(frozen=True, slots=True)
class TrackedDifference:
    """How a saved state's tracked set differs from this EMA's, for one model."""

    only_saved: tuple[str, ...] = ()
    """Tensors the saved EMA averaged that this EMA does not track."""
    only_ours: tuple[str, ...] = ()
    """Tensors this EMA tracks that the saved EMA did not."""

    def __bool__(self) -> bool:
        return bool(self.only_saved or self.only_ours)

    def message(self, common: int) -> str:
        parts = []
        if self.only_saved:
            parts.append(f"tracked only in the checkpoint {listed(self.only_saved, 5)}")
        if self.only_ours:
            parts.append(f"tracked only by this EMA {listed(self.only_ours, 5)}")
        return (
            f"the checkpoint's EMA tracks other tensors than this EMA ({'; '.join(parts)}). "
            f"Build the EMA with the checkpoint's tracked set (track=, add_tensors, "
            f"drop_tensors), or load the {common} tensors both track with "
            "common_subset=True (the others keep their current values)"
        )


def tracked_difference(
    saved_names: Iterable[str],
    saved_config: str | Mapping[str, Any] | None,
    ours: Mapping[str, Any],
) -> TrackedDifference:
    """The tensors of this EMA's model that one side tracks and the other does not.

    A saved name this EMA leaves untracked (its config lists it) was tracked only by the
    saved EMA; a name this EMA tracks that the saved config lists as untracked, only by
    this EMA. A saved config without an ``"untracked"`` list tracked every float tensor, so
    every tensor this EMA leaves untracked was tracked only by it. Names neither side
    knows are not a tracked-set difference (another model: :func:`compare_tensors`).
    """
    saved = list(saved_names)
    saved_set = set(saved)
    our_untracked = set(_config(ours[CONFIG]).get("untracked", ()))
    only_saved = [k for k in saved if k in our_untracked]
    only_ours: list[str] = []
    if saved_config is not None:
        saved_untracked = set(_config(saved_config).get("untracked", ()))
        only_saved += sorted(k for k in our_untracked - saved_untracked if k not in saved_set)
        only_ours = [k for k in ours[EMA_TENSORS] if k in saved_untracked]
    return TrackedDifference(tuple(only_saved), tuple(only_ours))


def common_names(state: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """This EMA's tensors that ``state`` holds and its EMA tracked (what
    ``common_subset=True`` loads), in this EMA's order."""
    values = state[EMA_TENSORS]
    diff = tracked_difference(values, state.get(CONFIG), ours)
    return [k for k in ours[EMA_TENSORS] if k in values and k not in diff.only_ours]


def deferred_names(saved_names: Iterable[str], ours: Mapping[str, Any]) -> list[str]:
    """Tensor names a check made before the saved ``config`` is read must not judge: those
    this EMA leaves untracked, and this EMA's tensors the saved state lacks (only the
    config tells whether its EMA left them untracked, or was another model's)."""
    saved = list(saved_names)
    present = set(saved)
    deferred = list(tracked_difference(saved, None, ours).only_saved)
    return deferred + [k for k in ours[EMA_TENSORS] if k not in present]


def staging_state(state: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """A state like ``state`` (an EMA's own :func:`local_state`) whose tensors are new
    buffers of the same layout, for a load to read into before anything live is written.

    Each ``"ema"`` tensor (only ``names``, when given) gets an uninitialized buffer of its
    shape, dtype and device; a DTensor gets one with its mesh, placements, global shape and
    stride, holding this rank's piece (no communication); a ZeRO-3 entry
    (:class:`~dtensor_ema.flat_chunks.FlatChunks`) one over the same flat range. The caller
    must fill every element (a DCP load whose chunks cover each tensor exactly once) before
    reading it. ``updates`` and ``config`` are kept, for the load to replace. Local. Peak
    extra memory: one copy of the EMA's local shards (``1/W`` of the tracked tensors).
    """
    tensors = state[EMA_TENSORS]
    chosen = list(tensors) if names is None else list(names)
    return {**state, EMA_TENSORS: {k: _empty_like(tensors[k]) for k in chosen}}


def _empty_like(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, FlatChunks):  # a ZeRO-3 entry: the same flat range, new memory
        return wrapped_like(value, torch.empty_like(value.local))
    if isinstance(value, DTensor):
        return wrapped_like(value, torch.empty_like(value.to_local()))
    return torch.empty_like(value)


def wrapped_like(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece, plain) wrapped as ``like`` is: a DTensor on ``like``'s
    mesh and placements with its global shape and stride, or a ZeRO-3 flat range
    (``FlatChunks``) at its offset; a plain ``like`` gives ``local`` itself. ``local``'s
    shape is not checked against ``like``'s piece. Local: no communication, no copy."""
    if isinstance(like, FlatChunks):
        return FlatChunks(local, like.shape, like.start)
    if isinstance(like, DTensor):
        return DTensor.from_local(
            local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    return local


def saved_count(value: Any) -> int:
    """A saved ``updates`` value as the count it stands for: an ``int`` (or a one-element
    integer tensor) in ``[0, 2**63 - 1]``, so that restoring it cannot fail halfway.

    Raises:
        ValueError: anything else, naming the value (a huge one by its size).
    """
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    ):
        value = int(value.item())
    return check_count(value, "checkpoint 'updates'")


def check_config_values(config: Any) -> None:
    """A saved ``config`` is JSON text (or a dict) whose numbers are finite and whose ints
    fit an int64: the decays, half-lives and step counts a resume would use.

    Raises:
        ValueError: naming the option and its value.
    """
    if not isinstance(config, (str, Mapping)):
        raise ValueError(f"checkpoint 'config' must be JSON text, got a {type(config).__name__}")
    try:
        parsed = _config(config)
    except ValueError as e:
        raise ValueError(f"checkpoint 'config' is not valid JSON ({type(e).__name__})") from None
    for where, number in _numbers(parsed, ()):
        name = ".".join(where) or "config"
        if isinstance(number, float) and not math.isfinite(number):
            raise ValueError(f"checkpoint option {name} must be finite, got {number!r}")
        if isinstance(number, int) and not -(2**63) <= number <= 2**63 - 1:
            raise ValueError(
                f"checkpoint option {name} must fit an int64, got an int of "
                f"{number.bit_length()} bits"
            )


def _numbers(value: Any, where: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], float]]:
    """``(path, number)`` of every int and float in a parsed JSON value."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _numbers(v, (*where, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, (*where, str(i)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield where, value


def validate_state(
    state: Mapping[str, Any], ours: Mapping[str, Any], *, common_subset: bool = False
) -> int:
    """Check a saved EMA state against this EMA's own ``state_dict()``; touch nothing.

    Args:
        state: a state in the :data:`STATE_KEYS` schema; its ``"ema"`` values may be
            tensors (DTensors or full plain tensors) or :class:`TensorSpec` (a checkpoint's
            metadata). Plain full tensors are compared by their global shape.
        ours: the EMA's own ``state_dict()``.
        common_subset: accept a state saved with another tracked set of the same model
            (:func:`tracked_difference`): only the tensors both track are checked (and
            loaded, :func:`common_names`); at least one must be.

    Returns:
        The saved update counter.

    Raises:
        KeyError: ``state`` lacks ``"ema"`` or ``"updates"`` (with a hint when it looks like
            a full model state dict, which :meth:`ModelEMA.load_full_state_dict` loads).
        ValueError: missing/unexpected fqns, shape or dtype mismatches, another tracked set
            (naming the tensors; unless ``common_subset``), a counter that is not an int
            in ``[0, 2**63 - 1]`` (:func:`saved_count`), a ``config`` that is not JSON or
            holds a non-finite number or an int beyond int64 (:func:`check_config_values`),
            or options (schedule, ``update_every``, ...) different from this EMA's:
            resuming with other options would not continue the saved trajectory.
    """
    for key in (EMA_TENSORS, UPDATES):
        if key not in state:
            hint = ""
            if all(isinstance(v, torch.Tensor) for v in state.values()) and state:
                hint = (
                    "; it looks like a full model state dict (get_ema_state_dict(), an "
                    "export_ema file): load those with ema.load_full_state_dict(...)"
                )
            raise KeyError(f"EMA state dict has no {key!r} entry (keys: {list(state)[:5]}){hint}")
    values = state[EMA_TENSORS]
    if not isinstance(values, Mapping):
        raise ValueError(f"EMA state dict's 'ema' must map fqns to tensors, got {type(values)}")
    updates = saved_count(state[UPDATES])
    if CONFIG in state:
        check_config_values(state[CONFIG])
    diff = tracked_difference(values, state.get(CONFIG), ours)
    problems = compare_tensors(
        {k: v for k, v in values.items() if k not in diff.only_saved},
        {k: v for k, v in ours[EMA_TENSORS].items() if k not in diff.only_ours},
    )
    if problems:
        raise ValueError(f"EMA state dict does not match the model: {problems}")
    common = [k for k in ours[EMA_TENSORS] if k in values and k not in diff.only_ours]
    if diff and not common_subset:
        raise ValueError(diff.message(len(common)))
    if diff and not common:
        raise ValueError(
            f"common_subset=True, but the checkpoint's EMA and this EMA track no tensor in "
            f"common ({diff.message(0)})"
        )
    if CONFIG in state:
        within = set(common) if diff else None
        diffs = _config_diffs(state[CONFIG], ours[CONFIG], within)
        if diffs:
            raise ValueError(
                "checkpoint EMA options differ from this EMA's (construct ModelEMA with the "
                f"checkpoint's options to resume): {'; '.join(diffs)}."
            )
    return updates


def local_state(plan: EmaPlan, updates: int, config: str) -> dict[str, Any]:
    """The :data:`STATE_KEYS` state of ``plan``'s EMA: its live tensors (no copy), each
    tagged with this rank's mesh coordinate (see :func:`local_piece`); ZeRO-3 entries as
    :class:`~dtensor_ema.flat_chunks.FlatChunks` over their live shards. Local."""
    for entry in plan:
        tag_rank(entry.ema)
    return {
        UPDATES: updates,
        CONFIG: config,
        EMA_TENSORS: {e.fqn: e.checkpoint_value() for e in plan},
    }


def load_local_state(
    plan: EmaPlan,
    state: Mapping[str, Any],
    ours: Mapping[str, Any],
    *,
    common_subset: bool = False,
) -> int:
    """Validate ``state`` against ``ours`` (the EMA's own :func:`local_state`), then copy
    this rank's piece of every saved tensor into ``plan``'s EMA; return the saved counter.

    Local, no collective. Nothing is written unless everything validates (a plain
    ``dcp.load`` may already have filled the live tensors in place; the error then says
    so). With ``common_subset`` only the tensors both EMAs track are copied (see
    :func:`validate_state`). Peak extra memory: none (pieces are copied in place).
    """
    values = state.get(EMA_TENSORS) if isinstance(state, Mapping) else None
    in_place = isinstance(values, Mapping) and any(_is_live(e, values.get(e.fqn)) for e in plan)
    try:
        updates = validate_state(state, ours, common_subset=common_subset)
    except ValueError as e:
        if in_place and "options differ" in str(e):
            raise ValueError(
                f"{e} The EMA tensors were already overwritten in place by dcp.load; "
                "dtensor_ema.load_checkpoint validates before it writes."
            ) from None
        raise
    assert isinstance(values, Mapping)
    loaded = set(common_names(state, ours))
    pieces = [(e.ema_local, local_piece(e, values[e.fqn])) for e in plan if e.fqn in loaded]
    with torch.no_grad():
        for target, piece in pieces:
            if piece is not target:
                target.copy_(piece)
    return updates


def _is_live(entry: PlanEntry, value: Any) -> bool:
    """``value`` is the entry's own live EMA (its DTensor, or chunks over its shard)."""
    if isinstance(value, FlatChunks):
        return value.local is entry.ema_local
    return value is entry.ema


def tag_rank(ema: torch.Tensor) -> None:
    """Mark a live EMA DTensor with this rank's mesh coordinate (see :func:`local_piece`)."""
    if isinstance(ema, DTensor):
        coordinate = ema.device_mesh.get_coordinate()
        if coordinate is not None:
            ema.__dict__[_RANK_TAG] = tuple(coordinate)


def local_piece(entry: PlanEntry, value: torch.Tensor) -> torch.Tensor:
    """This rank's EMA rows of a saved value for ``entry``. Local: no collective.

    ``value`` is ``entry.ema`` itself (a DCP load filled it in place; for a ZeRO-3 entry,
    :class:`~dtensor_ema.flat_chunks.FlatChunks` over its shard), a DTensor holding this
    rank's rows with the EMA's mesh and placements (another live EMA's, or a file this rank
    saved), chunks of this rank's flat range (another live ZeRO-3 EMA's), or a full plain
    tensor (this rank's rows are cut out, no copy).

    Raises:
        ValueError: a DTensor that another rank saved (``torch.save`` of ``state_dict()`` on
            one rank), or one on another mesh or with other placements; the message names
            the ways to load that do work.
    """
    ema, ema_local, fqn = entry.ema, entry.ema_local, entry.fqn
    if _is_live(entry, value):
        return ema_local
    if isinstance(value, FlatChunks):
        mine = entry.checkpoint_value()
        if not isinstance(mine, FlatChunks) or (value.start, value.local.shape) != (
            mine.start,
            ema_local.shape,
        ):
            raise ValueError(
                f"{fqn}: holds the flat range {value.start}+{value.local.numel()} of a ZeRO-3 "
                f"partition, not this rank's ({_layout(ema)}); load checkpoints with "
                "dtensor_ema.load_checkpoint or dcp.load (they reshard), or full tensors with "
                "ema.load_full_state_dict()"
            )
        return value.local
    if isinstance(value, DTensor):
        if not isinstance(ema, DTensor) or (value.device_mesh, tuple(value.placements)) != (
            ema.device_mesh,
            tuple(ema.placements),
        ):
            raise ValueError(
                f"{fqn}: a DTensor with placements {tuple(value.placements)} on mesh "
                f"{tuple(value.device_mesh.shape)} cannot be loaded locally into this EMA "
                f"({_layout(ema)}); load checkpoints with dtensor_ema.load_checkpoint or "
                "dcp.load (they reshard), or full tensors with ema.load_full_state_dict()"
            )
        saved_by = value.__dict__.get(_RANK_TAG)
        coordinate = ema.device_mesh.get_coordinate()
        mine = None if coordinate is None else tuple(coordinate)
        local = value.to_local()
        if (saved_by is not None and saved_by != mine) or local.shape != ema_local.shape:
            whose = f"the rank at mesh coordinate {saved_by}" if saved_by else "another rank"
            raise ValueError(
                f"{fqn}: this state holds the piece of {whose}, not this rank's (mesh "
                f"coordinate {mine}): ModelEMA.state_dict() holds only the saving rank's "
                "shards, so torch.save of it on one rank cannot be loaded on the others. Save "
                "with dtensor_ema.save_checkpoint (or dcp.save) on every rank and load with "
                "load_checkpoint, or save the full EMA (ema.get_ema_state_dict() / "
                "export_ema) and load it on every rank with ema.load_full_state_dict()"
            )
        return local
    return ema_local_from_full(entry, value)


def _layout(ema: torch.Tensor) -> str:
    if isinstance(ema, DTensor):
        return f"placements {tuple(ema.placements)} on mesh {tuple(ema.device_mesh.shape)}"
    return "unsharded"
