"""Who applies an averaging step to the EMA's local shards, and when.

Three updaters behind one interface (``submit``, ``wait``, ``rebind``, ``close``):

* :class:`InlineUpdater` applies each step at once, one fused call per
  :class:`~dtensor_ema.fused_update.UpdateGroup` (the default).
* :class:`CapturableUpdater` applies a step whose decay lives on the device, with no host
  synchronization (``capturable=True``: ``torch.compile`` / CUDA graphs).
* :class:`OffloadUpdater` snapshots the sources and applies the step to host-resident EMA
  shards in a worker thread, behind the training step (``offload=True``).

``submit(step, done)`` calls ``done()`` once the step has been applied, on the caller's
thread: ``ModelEMA`` counts a step only then, so a step whose worker raised is never
counted. The worker's error is raised by the next :meth:`Updater.wait`, which every
``ModelEMA`` method calls first, and the step it belonged to is lost (the EMA and its counter
stay at the previous step).
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from dtensor_ema.fused_update import UpdateGroup

__all__ = [
    "CapturableUpdater",
    "DeviceStep",
    "InlineUpdater",
    "OffloadUpdater",
    "Updater",
    "make_updater",
]

Done = Callable[[], None]


class DeviceStep(NamedTuple):
    """One capturable step: 0-dim device tensors, so nothing reads back to the host (a
    named tuple, which ``torch.compile(fullgraph=True)`` traces without a graph break)."""

    decay: torch.Tensor
    """The decay of an averaging step (``0`` copies)."""
    active: torch.Tensor
    """``False`` on calls that ``update_every`` skips: the EMA stays unchanged."""


class Updater(ABC):
    """Applies averaging steps to a list of update groups (the EMA's local shards)."""

    def __init__(self, groups: list[UpdateGroup]) -> None:
        self.groups = groups
        self._closed = False

    @abstractmethod
    def submit(self, step: Any, done: Done | None = None) -> None:
        """Apply ``step`` (now or later) and call ``done()`` once it has been applied."""

    def wait(self) -> None:  # noqa: B027 (synchronous updaters have nothing to wait for)
        """Block until every submitted step has been applied; raise a failed one's error."""

    def rebind(self, groups: list[UpdateGroup]) -> None:
        """Work on new groups from now on (the model re-allocated its tensors)."""
        self.wait()
        self.groups = groups

    def close(self) -> None:
        """Apply what is pending and release the updater's resources. Idempotent."""
        self._closed = True
        self.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ModelEMA was closed (close() or a with block ended)")


class InlineUpdater(Updater):
    """Applies each step at once: one fused call per group."""

    def submit(self, step: float, done: Done | None = None) -> None:
        self._check_open()
        for group in self.groups:
            group.apply_(step)
        if done is not None:
            done()


class CapturableUpdater(Updater):
    """Applies a :class:`DeviceStep`: weight ``1 - decay`` (averaged groups) or ``1``
    (copied groups) on active calls, ``0`` on skipped ones; all on the device."""

    def submit(self, step: DeviceStep, done: Done | None = None) -> None:
        self._check_open()
        zero = torch.zeros_like(step.decay)
        for group in self.groups:
            weight = 1.0 - step.decay if group.averaged else torch.ones_like(step.decay)
            group.apply_weight_(torch.where(step.active, weight, zero))
        if done is not None:
            done()


class OffloadUpdater(Updater):
    """Updates host-resident EMA shards in a worker thread, behind the training step.

    ``submit(decay)`` snapshots the source locals into host staging buffers (pinned, and an
    asynchronous device-to-host copy on a side stream when the sources are on CUDA; the
    current stream then waits for that copy, so the next optimizer step cannot overwrite
    the sources mid-copy), and hands the lerp to one worker thread. The next ``submit`` or
    :meth:`wait` joins the previous job first, so steps apply in order and readers see a
    finished EMA. Host memory: the EMA shards plus one staging copy of the source shards.
    The worker thread lives until :meth:`close` (or until the updater is garbage collected).
    """

    def __init__(self, groups: list[UpdateGroup]) -> None:
        super().__init__(groups)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtensor_ema")
        # Shut the thread down if the EMA is dropped without close(); the finalizer holds
        # the executor, not the updater.
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)
        self._pending: tuple[Future[None], Done | None] | None = None
        self._lock = threading.Lock()
        self._stage(groups)

    def _stage(self, groups: list[UpdateGroup]) -> None:
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

    def submit(self, step: float, done: Done | None = None) -> None:
        """Stage the sources now and apply ``step`` to the EMA shards in the background."""
        self._check_open()
        self.wait()
        event = None
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for group, staging in zip(self.groups, self._staging, strict=True):
                    torch._foreach_copy_(staging, group.source_locals, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
            current.wait_event(event)
        else:
            for group, staging in zip(self.groups, self._staging, strict=True):
                torch._foreach_copy_(staging, group.source_locals)
        future = self._executor.submit(self._apply, self.groups, self._staging, step, event)
        self._pending = (future, done)

    @staticmethod
    def _apply(
        groups: list[UpdateGroup], staging: list[list[torch.Tensor]], step: float, event: Any
    ) -> None:
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            for group, staged in zip(groups, staging, strict=True):
                group.apply_(step, staged)

    def wait(self) -> None:
        """Block until the submitted step has been applied, then count it (``done``).

        Raises:
            RuntimeError: the worker raised while applying the step (chained); that step is
                lost and not counted. Raised once: the updater is usable again afterwards.
        """
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        future, done = pending
        try:
            future.result()
        except Exception as e:
            raise RuntimeError(
                "an offloaded EMA update failed in the worker thread; that update was not "
                f"applied nor counted (the EMA stays at the previous step): {e!r}"
            ) from e
        if done is not None:
            done()

    def rebind(self, groups: list[UpdateGroup]) -> None:
        """New groups, new staging buffers; the same worker thread."""
        self.wait()
        self.groups = groups
        self._stage(groups)

    def close(self) -> None:
        """Join the pending step and shut the worker thread down. Idempotent; raises a
        pending step's error after the thread is gone."""
        self._closed = True
        try:
            self.wait()
        finally:
            self._finalizer.detach()
            self._executor.shutdown(wait=True)  # joins the thread; its job is done


def make_updater(groups: list[UpdateGroup], *, capturable: bool, offload: bool) -> Updater:
    """The updater for ``ModelEMA``'s ``capturable`` / ``offload`` options."""
    if offload:
        return OffloadUpdater(groups)
    if capturable:
        return CapturableUpdater(groups)
    return InlineUpdater(groups)
