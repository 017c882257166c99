"""The update kernel: one fused multi-tensor call per group of local tensors.

The EMA update is memory-bound (it costs about a ``copy_`` of the same bytes), so the only
things worth optimizing are the bytes touched and the per-call dispatch: tensors are grouped
once at construction by (averaged or copied, device, EMA dtype, source dtype) and each group
is updated with one ``torch._foreach_lerp_`` (or ``_foreach_copy_``) on cached local views.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from dtensor_ema.plan import EmaPlan

__all__ = ["OffloadPipeline", "UpdateGroup", "update_groups"]


@dataclass(slots=True)
class UpdateGroup:
    """Local tensors that one fused call updates: same device, EMA dtype, source dtype."""

    ema_locals: list[torch.Tensor]
    source_locals: list[torch.Tensor]
    averaged: bool
    """``False``: the EMA copies the sources (excluded tensors, copied buffers)."""

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
        sources = self.source_locals if sources is None else sources
        if self.averaged and decay != 0.0:
            torch._foreach_lerp_(self.ema_locals, self.sources_in_ema_dtype(sources), 1.0 - decay)
        else:
            torch._foreach_copy_(self.ema_locals, sources)

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


class OffloadPipeline:
    """Updates host-resident EMA shards in a worker thread, behind the training step.

    ``submit(decay)`` snapshots the source locals into host staging buffers (pinned, and an
    asynchronous device-to-host copy on a side stream when the sources are on CUDA; the
    current stream then waits for that copy, so the next optimizer step cannot overwrite
    the sources mid-copy), and hands the lerp to one worker thread. The next ``submit`` or
    :meth:`wait` joins the previous job first, so updates apply in order and readers see a
    finished EMA. Host memory: the EMA shards plus one staging copy of the source shards.
    """

    def __init__(self, groups: list[UpdateGroup]) -> None:
        self._groups = groups
        devices = {s.device for g in groups for s in g.source_locals}
        self._device = next(iter(devices), torch.device("cpu"))
        self._cuda = self._device.type == "cuda"
        self._staging = [
            [
                torch.empty(s.shape, dtype=s.dtype, device="cpu", pin_memory=self._cuda)
                for s in g.source_locals
            ]
            for g in groups
        ]
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtensor_ema")
        self._pending: Future[None] | None = None

    def submit(self, decay: float) -> None:
        """Stage the sources now and apply ``decay`` to the EMA shards in the background."""
        self.wait()
        event = None
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for group, staging in zip(self._groups, self._staging, strict=True):
                    torch._foreach_copy_(staging, group.source_locals, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
            current.wait_event(event)
        else:
            for group, staging in zip(self._groups, self._staging, strict=True):
                torch._foreach_copy_(staging, group.source_locals)
        self._pending = self._executor.submit(self._apply, decay, event)

    def _apply(self, decay: float, event: Any) -> None:
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            for group, staging in zip(self._groups, self._staging, strict=True):
                group.apply_(decay, staging)

    def wait(self) -> None:
        """Block until the submitted update has been applied (re-raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
