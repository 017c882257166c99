"""What every facade does when a library's habit saves the EMA from rank 0 alone.

A sharded EMA holds ``1/W`` of every tensor per rank, so rank 0 cannot produce the full
tensors by itself. :class:`Rank0Save` makes that habit either work or fail loudly:

* unsharded (no process group, or one rank): the full tensors are local; nothing to do;
* sharded: ``gather_for_save()``, called on **every** rank just before the rank-0 save
  (one collective gather to rank 0), leaves a full CPU copy on rank 0 that the facade's
  ``state_dict()``/``save_pretrained()`` then hand out; without it, or once the EMA has
  moved since, they raise naming that one-line fix, instead of saving one rank's piece.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtensor_ema.model_ema import ModelEMA

__all__ = ["Rank0Save", "world_size"]


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Rank0Save:
    """Full EMA tensors for a save that one rank makes (see the module docstring)."""

    def __init__(self, ema: ModelEMA, owner: str) -> None:
        self.ema = ema
        self.owner = owner
        self._full: dict[str, torch.Tensor] | None = None
        self._version = -1
        self.version = 0
        """Bumped by the facade whenever the EMA changes (update, set, load)."""

    def gather(self) -> None:
        """**Collective** over the EMA's mesh (every rank must call): rank 0 keeps a full CPU
        copy of the EMA (its peak extra memory: one full copy; the other ranks: one bucket)
        until the EMA changes. A no-op when unsharded."""
        if world_size() == 1:
            return
        full = self.ema.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
        self._full, self._version = (full or None), self.version

    def full(self, what: str) -> dict[str, Any]:
        """The full EMA state dict keyed like the model (local). Raises on a sharded EMA
        unless :meth:`gather` ran on every rank since the last change."""
        if world_size() == 1:
            return self.ema.get_ema_state_dict()
        if self._full is not None and self._version == self.version:
            return self._full
        raise RuntimeError(
            f"{what} on a sharded EMA (each of the {world_size()} ranks holds 1/"
            f"{world_size()} of every tensor) would save one rank's piece. Fix: call "
            f"`{self.owner}.gather_for_save()` on every rank just before the rank-0 save "
            "(collective; rank 0 then holds one full CPU copy until the next update)."
        )
