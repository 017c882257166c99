"""What the trainer callbacks share: option checks, when to update, the evaluation swap,
the hand-over of the final weights, and the full-tensor form of the EMA for checkpoints
that one rank writes."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.options import EmaOptions, check_int
from dtensor_ema.state import EMA_TENSORS
from dtensor_ema.zero_partition import is_partitioned, partition_piece, whole_view

__all__ = [
    "EvalSwap",
    "StepGate",
    "check_ema_options",
    "copy_ema_into_model",
    "decay_name",
    "follow_trainable",
    "full_ema_tensors",
    "is_rank0",
]

_NOT_OPTIONS = ("self", "model", "mesh")


def check_ema_options(options: dict[str, Any]) -> None:
    """Refuse unknown or invalid :class:`~dtensor_ema.ModelEMA` keywords when the callback
    is created, not at the first training step.

    Raises:
        TypeError: a keyword ``ModelEMA`` does not take (the message lists the valid ones).
        ValueError: a value out of range, or conflicting with another (``tau`` with
            ``half_life``): ``ModelEMA``'s own checks, run without a model.
    """
    valid = [n for n in inspect.signature(ModelEMA.__init__).parameters if n not in _NOT_OPTIONS]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"unknown ModelEMA option(s) {unknown}; valid options are {valid} (and the "
            "callback's own arguments)"
        )
    given = dict(options)
    check_int("updates", given.pop("updates", 0), 0)
    EmaOptions.from_arguments(**given)


@dataclass(frozen=True, slots=True)
class StepGate:
    """When a callback calls ``ema.update()``: after optimizer step ``step`` (1-based, the
    trainer's global step once the step is done) if ``step > start_step``, the epoch is at
    least ``start_epoch`` and ``step`` is a multiple of ``every``."""

    every: int = 1
    start_step: int = 0
    start_epoch: int = 0

    def __post_init__(self) -> None:
        check_int("update_every_n_steps", self.every, 1)
        check_int("start_step", self.start_step, 0)
        check_int("start_epoch", self.start_epoch, 0)

    @property
    def delayed(self) -> bool:
        """Whether the EMA starts later than the first step (it then restarts from the
        model's weights at its first update)."""
        return self.start_step > 0 or self.start_epoch > 0

    def should_update(self, step: int, epoch: int = 0) -> bool:
        return step > self.start_step and epoch >= self.start_epoch and step % self.every == 0


class EvalSwap:
    """Holds :meth:`ModelEMA.average_parameters` open between two trainer events (e.g.
    ``on_validation_start`` and ``on_validation_end``), with a guard against nesting."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def enter(self, ema: ModelEMA) -> None:
        """Swap the EMA weights in. Collective for replicated tensors (see
        ``average_parameters``): every rank must call it."""
        if self._stack is not None:
            raise RuntimeError("the EMA weights are already swapped into the model")
        stack = contextlib.ExitStack()
        stack.enter_context(ema.average_parameters())
        self._stack = stack

    def exit(self) -> None:
        """Restore the training weights (local, no communication); a no-op when not swapped."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """This rank's storage of ``tensor`` that a forward reads: a DTensor's local shard, a
    plain tensor whole; for a ZeRO-3 parameter its partition (padding excluded), plus the
    whole copy DeepSpeed holds beside it when it holds one (persistent parameters)."""
    if isinstance(tensor, DTensor):
        return [tensor.to_local().detach()]
    if is_partitioned(tensor):
        whole = whole_view(tensor)
        return [partition_piece(tensor)] + ([] if whole is None else [whole])
    return [tensor.detach()]


def model_float_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's floating-point parameters and buffers (the objects, deduplicated)."""
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


@torch.no_grad()
def copy_ema_into_model(ema: ModelEMA, module: nn.Module) -> None:
    """Leave the EMA weights in ``module`` for good (the hand-over at the end of training).

    Enters :meth:`ModelEMA.average_parameters`, snapshots this rank's piece of every
    floating-point tensor (a DTensor's local shard, a plain tensor whole, a ZeRO-3
    parameter's partition and the whole copy DeepSpeed may hold beside it), leaves the
    context and writes the snapshot back into the same storage. So the values are exactly
    those the swap evaluates, for any layout the swap supports, through ``ModelEMA``'s
    public API. Communication: that of ``average_parameters`` (collective for replicated
    tensors and for ZeRO-3 parameters held whole). Peak extra memory: one more copy of this
    rank's pieces of the model.
    """
    with ema.average_parameters():
        pieces = [piece for t in model_float_tensors(module) for piece in _pieces(t)]
        snapshot = [piece.clone() for piece in pieces]
    for piece, value in zip(pieces, snapshot, strict=True):
        piece.copy_(value)


def full_ema_tensors(ema: ModelEMA, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The EMA tensors as full CPU tensors in the EMA's own dtype, keyed by fqn, for a
    checkpoint that one rank writes (DDP). **Collective** on every EMA mesh: every rank
    must call it. With ``rank0_only`` the other ranks get ``{}``.

    Exact: the EMA's dtype (float32 for bf16 models), unlike ``get_ema_state_dict`` which
    casts to the model's dtypes for export. One ``full_tensor()`` per EMA tensor; peak
    extra memory: one full tensor on every rank in flight, plus the result on rank 0.
    """
    keep = is_rank0() or not rank0_only
    out: dict[str, torch.Tensor] = {}
    for fqn, tensor in ema.state_dict()[EMA_TENSORS].items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            out[fqn] = full.detach().to("cpu", copy=True)
    return out


def follow_trainable(ema: ModelEMA, say: Callable[[str], None]) -> bool:
    """With ``track="trainable"``, follow a trainable set that changed since the EMA chose
    its tensors (a trainer's unfreezing callback, e.g. Lightning's ``BackboneFinetuning``):
    parameters that became trainable start averaging from their current values
    (``ema.add_tensors``); frozen ones keep their average (they stop moving, so it
    converges to their value). Tells ``say`` what changed. Returns whether it changed.

    **Collective** over the EMA's mesh when the set changed (``add_tensors``'s); local
    otherwise (one ``requires_grad`` read per float parameter). Every rank sees the same
    flips when the same callback made them. Peak extra memory: the new shards."""
    now, frozen = ema.engine.plan.trainable_changes()
    if not (now or frozen):
        return False
    tracked = ema.engine.plan.by_fqn()
    new = [k for k in now if k not in tracked]
    ema.add_tensors(new)
    say(
        f"EMA (track='trainable'): {len(now)} parameter(s) became trainable, "
        f"{len(new)} of them now averaged from their current values"
        + (f"; {len(frozen)} frozen, their averages kept" if frozen else "")
    )
    return True


def decay_name(kind: str, value: float) -> str:
    """An EMA's name from its decay (or other number): ``decay_0_999``; ``_`` for the
    decimal point, since DCP joins checkpoint keys with dots."""
    return f"{kind}_{value:g}".replace(".", "_")


def is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
