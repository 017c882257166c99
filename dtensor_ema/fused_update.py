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
    _staged: list[_StagedBatch] | None = None
    """Upcast plan for mixed dtypes, built on first use (see :meth:`_staged_lerp_`)."""

    def sources_in_ema_dtype(self, sources: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The sources (default: the source locals), upcast (a temporary copy) when their
        dtype is not the EMA's."""
        sources = self.source_locals if sources is None else sources
        dtype = self.ema_locals[0].dtype
        if sources[0].dtype == dtype:
            return sources
        return [s.to(dtype) for s in sources]

    def apply_(self, decay: float, sources: list[torch.Tensor] | None = None) -> None:
        """``ema.lerp_(source, 1 - decay)``; a copy for copied tensors or ``decay == 0``.

        ``sources``: what to read instead of the source locals (an upcast made once for
        several EMAs, or a staged host copy); same shapes, any float dtype.
        """
        if not self.averaged or decay == 0.0:
            torch._foreach_copy_(
                self.ema_locals, self.source_locals if sources is None else sources
            )
        elif sources is None and self.source_locals[0].dtype != self.ema_locals[0].dtype:
            self._staged_lerp_(1.0 - decay)
        else:
            sources = self.source_locals if sources is None else sources
            torch._foreach_lerp_(self.ema_locals, self.sources_in_ema_dtype(sources), 1.0 - decay)

    def _staged_lerp_(self, weight: float) -> None:
        """Mixed dtypes (bf16 model, fp32 EMA): upcast into one reused scratch buffer of at
        most ``UPCAST_CHUNK`` elements, batch by batch, instead of a fresh fp32 temporary
        per tensor every step (4-5x slower on CPU, where fresh pages cost more than the
        arithmetic: benchmarks/bf16_paths.py). Same values bit for bit: the upcast is exact
        and ``lerp`` is elementwise."""
        if self._staged is None:
            self._staged = _staged_batches(self.ema_locals, self.source_locals)
        for batch in self._staged:
            if batch.scratch:
                torch._foreach_copy_(batch.scratch, batch.sources)
                torch._foreach_lerp_(batch.emas, batch.scratch, weight)
            else:  # non-contiguous tensors: the plain upcast
                upcast = [s.to(batch.emas[0].dtype) for s in batch.sources]
                torch._foreach_lerp_(batch.emas, upcast, weight)

    def apply_weight_(self, weight: torch.Tensor) -> None:
        """``ema.lerp_(source, weight)`` with a 0-dim device tensor: no host sync.

        ``weight`` 0 leaves the EMA unchanged and 1 copies the source, exactly (the lerp
        kernel computes ``end - (end - start) * (1 - w)`` for ``w >= 0.5``).
        """
        weight = weight.to(self.ema_locals[0].dtype)
        weights = [weight] * len(self.ema_locals)
        torch._foreach_lerp_(self.ema_locals, self.sources_in_ema_dtype(), weights)


UPCAST_CHUNK = 1 << 24
"""Elements of the reused upcast scratch buffer (64 MiB in float32)."""


@dataclass(slots=True)
class _StagedBatch:
    emas: list[torch.Tensor]
    sources: list[torch.Tensor]
    scratch: list[torch.Tensor]
    """Views of the shared scratch buffer, one per source; empty: upcast on the fly."""


def _staged_batches(emas: list[torch.Tensor], sources: list[torch.Tensor]) -> list[_StagedBatch]:
    """Cut contiguous (EMA, source) pairs into flat slices of at most ``UPCAST_CHUNK``
    elements and pack them into batches that fit one scratch buffer. Built once: the
    slices are views, so later updates only launch kernels."""
    slices: list[tuple[torch.Tensor, torch.Tensor]] = []
    loose = _StagedBatch([], [], [])
    for ema, source in zip(emas, sources, strict=True):
        if not (ema.is_contiguous() and source.is_contiguous()):
            loose.emas.append(ema)
            loose.sources.append(source)
            continue
        flat_ema, flat_source = ema.view(-1), source.view(-1)
        for start in range(0, flat_ema.numel(), UPCAST_CHUNK):
            end = start + UPCAST_CHUNK
            slices.append((flat_ema[start:end], flat_source[start:end]))
    batches = [loose] if loose.emas else []
    if not slices:
        return batches
    total = sum(e.numel() for e, _ in slices)
    scratch = torch.empty(
        min(total, UPCAST_CHUNK), dtype=slices[0][0].dtype, device=slices[0][0].device
    )
    batch, used = _StagedBatch([], [], []), 0
    for ema, source in slices:
        if used + ema.numel() > scratch.numel():
            batches.append(batch)
            batch, used = _StagedBatch([], [], []), 0
        batch.emas.append(ema)
        batch.sources.append(source)
        batch.scratch.append(scratch[used : used + ema.numel()])
        used += ema.numel()
    batches.append(batch)
    return batches


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
