"""The update kernel: one fused multi-tensor call per group of local tensors.

The EMA update is memory-bound (it costs about a ``copy_`` of the same bytes), so the only
things worth optimizing are the bytes touched and the per-call dispatch: tensors are grouped
once at construction by (averaged or copied, device, EMA dtype, source dtype) and each group
is updated with one ``torch._foreach_lerp_`` (or ``_foreach_copy_``) on cached local views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtensor_ema.plan import EmaPlan

__all__ = ["UpdateGroup", "update_groups"]


@dataclass(slots=True)
class UpdateGroup:
    """Local tensors that one fused call updates: same device, EMA dtype, source dtype."""

    ema_locals: list[torch.Tensor]
    source_locals: list[torch.Tensor]
    averaged: bool
    """``False``: the EMA copies the sources (excluded tensors, copied buffers)."""

    def sources_in_ema_dtype(self) -> list[torch.Tensor]:
        """The source locals, upcast (a temporary copy) when their dtype is not the EMA's."""
        dtype = self.ema_locals[0].dtype
        if self.source_locals[0].dtype == dtype:
            return self.source_locals
        return [s.to(dtype) for s in self.source_locals]

    def apply_(self, decay: float, upcast: list[torch.Tensor] | None = None) -> None:
        """``ema.lerp_(source, 1 - decay)``; a copy for copied tensors or ``decay == 0``.

        ``upcast``: :meth:`sources_in_ema_dtype`, when the caller already made it.
        """
        if self.averaged and decay != 0.0:
            sources = upcast if upcast is not None else self.sources_in_ema_dtype()
            torch._foreach_lerp_(self.ema_locals, sources, 1.0 - decay)
        else:
            torch._foreach_copy_(self.ema_locals, self.source_locals)

    def apply_weight_(self, weight: torch.Tensor) -> None:
        """``ema.lerp_(source, weight)`` with a 0-dim device tensor: no host sync.

        ``weight`` 0 leaves the EMA unchanged and 1 copies the source, exactly (the lerp
        kernel computes ``end - (end - start) * (1 - w)`` for ``w >= 0.5``).
        """
        weight = weight.to(self.ema_locals[0].dtype)
        weights = [weight] * len(self.ema_locals)
        torch._foreach_lerp_(self.ema_locals, self.sources_in_ema_dtype(), weights)


def update_groups(plan: EmaPlan) -> list[UpdateGroup]:
    """One group per (averaged, device, EMA dtype, source dtype); empty shards dropped."""
    groups: dict[tuple[Any, ...], UpdateGroup] = {}
    for e in plan:
        if e.ema_local.numel() == 0:
            continue
        key = (e.averaged, e.ema_local.device, e.ema_local.dtype, e.source_local.dtype)
        group = groups.setdefault(key, UpdateGroup([], [], e.averaged))
        group.ema_locals.append(e.ema_local)
        group.source_locals.append(e.source_local)
    return list(groups.values())
