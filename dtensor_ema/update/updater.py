"""Who applies an averaging step to the EMA's local shards, and when.

The updaters share one interface (``run`` one ``update()`` call, ``submit`` a step,
``wait``, ``rebind``, ``invalidate``, ``close``); :func:`dtensor_ema.engine.make_updater`
is the one place that picks one (and wraps it in the CUDA-graph replay,
:class:`dtensor_ema.update.cuda_graph.GraphedUpdater`):

* :class:`InlineUpdater` applies each step at once, one fused call per
  :class:`~dtensor_ema.update.fused_update.UpdateGroup` (the default).
* :class:`CapturableUpdater` applies a step whose decay lives on the device, with no host
  synchronization (``capturable=True``: ``torch.compile`` / CUDA graphs).
* :class:`OffloadUpdater` snapshots the sources and applies the step to host-resident EMA
  shards in a worker thread, behind the training step (``offload=True``; on CUDA while
  :data:`CUDA_OFFLOAD` is ``"worker"``).
* :class:`ChunkedOffloadUpdater` streams host-resident (pinned) EMA shards through a
  bounded device scratch on a side stream and lerps them on the device (``offload=True``
  on CUDA once :data:`CUDA_OFFLOAD` is ``"chunked"``): no host copy of the sources, no
  host sync per step.

``submit(step, done)`` calls ``done()`` once the step has been applied, on the caller's
thread: ``ModelEMA`` counts a step only then, so a step whose worker raised is never
counted. The worker's error is raised by the next :meth:`Updater.wait`, which every
``ModelEMA`` method calls first, and the step it belonged to is lost (the EMA and its counter
stay at the previous step). :class:`ChunkedOffloadUpdater` calls ``done()`` once the step is
queued on the device: like any CUDA work, a device error surfaces at the next
synchronization.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from dtensor_ema.options import check_int
from dtensor_ema.update.counter import DeviceStep, UpdateCounter
from dtensor_ema.update.fused_update import UpdateGroup, apply_groups_, lerp_step_

__all__ = [
    "CUDA_OFFLOAD",
    "OFFLOAD_CHUNK_BYTES",
    "CapturableUpdater",
    "ChunkedOffloadUpdater",
    "InlineUpdater",
    "OffloadUpdater",
    "Updater",
    "host_runs",
    "offload_chunks",
]

Done = Callable[[], None]


class Updater(ABC):
    """Applies averaging steps to a list of update groups (the EMA's local shards)."""

    checks_sources: bool = True
    """Whether the caller re-binds the plan's views (``EmaEngine.sync_sources``) before
    each :meth:`run` (:meth:`~dtensor_ema.plan.EmaPlan.sync`: a few C-level passes).
    ``False`` for :class:`CapturableUpdater`, whose ``run`` compiles into one graph."""

    def __init__(self, groups: list[UpdateGroup]) -> None:
        self.groups = groups
        self._closed = False

    def run(self, counter: UpdateCounter) -> None:
        """One ``update()`` call: count it with ``counter`` and apply its step (now, or
        behind the training step for offloaded updaters, which count it once applied)."""
        self.ensure_open()
        call = counter.host_step()
        if call.step is None:  # a call update_every skips
            counter.record(call.updates, None)
            return
        self.submit(call.step, lambda: counter.record(call.updates, call.decay))

    @abstractmethod
    def submit(self, step: Any, done: Done | None = None) -> None:
        """Apply ``step`` (now or later) and call ``done()`` once it has been applied."""

    def wait(self) -> None:  # noqa: B027 (synchronous updaters have nothing to wait for)
        """Block until every submitted step has been applied; raise a failed one's error."""

    def rebind(self, groups: list[UpdateGroup]) -> None:
        """Work on new groups from now on (the model re-allocated its tensors), with the
        updater's own buffers for them (:meth:`_stage`)."""
        self.wait()
        self.groups = groups
        self._stage(groups)

    def _stage(self, groups: list[UpdateGroup]) -> None:  # noqa: B027 (most keep no buffers)
        """Make the updater's buffers for ``groups``."""

    def invalidate(self) -> None:  # noqa: B027 (only a captured graph holds state to drop)
        """Forget state derived from the EMA's values (a load wrote them in place)."""

    def close(self) -> None:
        """Apply what is pending and release the updater's resources. Idempotent."""
        self._closed = True
        self.wait()

    def buffer_nbytes(self) -> dict[str, int]:
        """Bytes of the updater's own buffers by kind (``"staging_host_bytes"``,
        ``"scratch_device_bytes"``); empty when it keeps none. Local."""
        return {}

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def ensure_open(self) -> None:
        """Raise ``RuntimeError`` once :meth:`close` was called."""
        if self._closed:
            raise RuntimeError("this ModelEMA was closed (close() or a with block ended)")


class InlineUpdater(Updater):
    """Applies each step at once: one fused call per group."""

    def run(self, counter: UpdateCounter) -> None:
        self.ensure_open()
        call = counter.host_step()
        if call.step is not None:
            apply_groups_(self.groups, call.step)
        counter.record(call.updates, call.decay)

    def submit(self, step: float, done: Done | None = None) -> None:
        self.ensure_open()
        apply_groups_(self.groups, step)
        if done is not None:
            done()


class CapturableUpdater(Updater):
    """Applies a :class:`~dtensor_ema.update.counter.DeviceStep`: weight ``1 - decay`` (averaged
    groups) or ``1`` (copied groups) on active calls, ``0`` on skipped ones; all on the
    device. Its :meth:`run` counts on the device too (no host sync, compiles whole)."""

    checks_sources = False

    def run(self, counter: UpdateCounter) -> None:
        self.ensure_open()
        counter.device_step(self.submit)

    def submit(self, step: DeviceStep, done: Done | None = None) -> None:
        self.ensure_open()
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

    def buffer_nbytes(self) -> dict[str, int]:
        staged = sum(t.numel() * t.element_size() for g in self._staging for t in g)
        return {"staging_host_bytes": staged}

    def submit(self, step: float, done: Done | None = None) -> None:
        """Stage the sources now and apply ``step`` to the EMA shards in the background."""
        self.ensure_open()
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
            apply_groups_(groups, step, staging)

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

    def close(self) -> None:
        """Join the pending step and shut the worker thread down. Idempotent; raises a
        pending step's error after the thread is gone."""
        self._closed = True
        try:
            self.wait()
        finally:
            self._finalizer.detach()
            self._executor.shutdown(wait=True)  # joins the thread; its job is done


OFFLOAD_CHUNK_BYTES = 128 << 20
"""Bytes of EMA values one chunk of :class:`ChunkedOffloadUpdater` moves (its device
scratch; torchtitan's offloaded checkpoint staging uses the same bound)."""

Slice = tuple[int, int, int, int]
"""``(tensor index, start, stop, scratch offset)``: elements ``[start, stop)`` of a flat
tensor, at ``scratch[offset : offset + stop - start]``."""


def offload_chunks(numels: Sequence[int], chunk_numel: int) -> list[list[Slice]]:
    """Cut flat tensors of ``numels`` elements into chunks of at most ``chunk_numel``.

    Pure. Tensors keep their order; a tensor larger than the room left in a chunk is split
    across chunks; zero-size tensors are skipped. Within a chunk the scratch offsets are
    consecutive from 0, so every chunk fits one scratch buffer of ``chunk_numel`` elements.

    Raises:
        ValueError: ``chunk_numel < 1`` or a negative numel.
    """
    check_int("chunk_numel", chunk_numel, 1)
    chunks: list[list[Slice]] = []
    current: list[Slice] = []
    used = 0
    for index, numel in enumerate(numels):
        if numel < 0:
            raise ValueError(f"numels[{index}] must be >= 0, got {numel}")
        start = 0
        while start < numel:
            take = min(numel - start, chunk_numel - used)
            current.append((index, start, start + take, used))
            used += take
            start += take
            if used == chunk_numel:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def host_runs(
    chunk: Sequence[Slice], host_starts: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """Merge a chunk's slices whose host memory is adjacent into single copies.

    Pure. ``host_starts[i]``: ``(storage key, element offset)`` of flat tensor ``i``'s first
    element in its host storage. Returns ``(storage key, host offset, scratch offset,
    length)`` per run: consecutive slices merge when they continue both the same storage
    and the scratch (EMA shards laid out in one buffer, ``parameters_as_bucket_view``, move
    as one copy per chunk).
    """
    runs: list[tuple[int, int, int, int]] = []
    for index, start, stop, offset in chunk:
        key, base = host_starts[index]
        host = base + start
        if runs:
            k, h, o, n = runs[-1]
            if k == key and h + n == host and o + n == offset:
                runs[-1] = (k, h, o, n + stop - start)
                continue
        runs.append((key, host, offset, stop - start))
    return runs


class ChunkedOffloadUpdater(Updater):
    """Host-resident EMA shards, updated on the device through a bounded scratch buffer.

    Each step, per group and per chunk of at most ``chunk_bytes`` of EMA values
    (:func:`offload_chunks`): copy the EMA slices host -> scratch, lerp the scratch with the
    sources (upcast through a second scratch when the sources are not in the EMA dtype),
    copy the scratch -> host. On CUDA all of it runs on a side stream that first waits for
    the current stream (so it reads the sources after ``optimizer.step()``), from pinned
    host memory, with no host synchronization: ``submit`` returns after the launches and
    the step counts at once (device errors surface at the next synchronization, as for any
    CUDA work). The lerp is the device's ``_foreach_lerp_`` with the inline path's weight,
    so the EMA gets the same bits as an on-device EMA (eager kernel).

    The sources stay in use on the side stream until the pipeline ends: any
    ``torch.optim.Optimizer.step()`` waits for it on the device first (a global step
    pre-hook, no host sync), and every read of the EMA waits for it on the host
    (:meth:`wait`). Code that writes the parameters by other means must call
    ``ema.flush()`` first.

    Memory: host, the EMA shards only (pinned; no staging copy of the sources). Device,
    at most ``chunk_bytes`` of scratch per EMA dtype, plus as much again per EMA dtype whose
    sources are in another dtype (the upcast), plus temporaries for the few tensors that
    are not contiguous (moved whole). Host -> device traffic: the EMA bytes twice per step
    (in and out); sources never leave the device.

    On a device without streams (CPU, used by the tests) the same pipeline runs inline.
    """

    def __init__(self, groups: list[UpdateGroup], chunk_bytes: int = OFFLOAD_CHUNK_BYTES) -> None:
        super().__init__(groups)
        self.chunk_bytes = check_int("chunk_bytes", chunk_bytes, 1)
        self._done: Any = None
        self._hook: Any = None
        self._stage(groups)

    def _stage(self, groups: list[UpdateGroup]) -> None:
        devices = {s.device for g in groups for s in g.source_locals}
        self.device = next(iter(devices), torch.device("cpu"))
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        # Scratch allocated on the side stream belongs to its pool: once freed, only later
        # side-stream work can reuse it, so freeing it never races the pipeline.
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            self._plans = [self._plan_group(g) for g in groups]
        if self._cuda and self._hook is None:
            ref = weakref.ref(self)

            def before_optimizer_step(*_: Any) -> None:
                updater = ref()
                if updater is not None:
                    updater._device_barrier()

            self._hook = torch.optim.optimizer.register_optimizer_step_pre_hook(
                before_optimizer_step
            )
            self._finalizer = weakref.finalize(self, self._hook.remove)

    def _plan_group(self, group: UpdateGroup) -> tuple[Any, ...]:
        """(contiguous pairs as flat views, chunks, host runs per chunk, loose pairs)."""
        flat_ema: list[torch.Tensor] = []
        flat_src: list[torch.Tensor] = []
        loose: list[tuple[torch.Tensor, torch.Tensor]] = []
        for ema, src in zip(group.ema_locals, group.source_locals, strict=True):
            if ema.is_contiguous() and src.is_contiguous():
                flat_ema.append(ema.view(-1))
                flat_src.append(src.view(-1))
            else:
                loose.append((ema, src))
        dtype = group.ema_locals[0].dtype
        chunk_numel = max(1, self.chunk_bytes // torch.empty((), dtype=dtype).element_size())
        chunks = offload_chunks([t.numel() for t in flat_ema], chunk_numel)
        storages: dict[int, torch.Tensor] = {}
        starts = []
        for t in flat_ema:
            key = t.untyped_storage().data_ptr()
            # A flat view of the whole storage, so a run that spans tensors is one copy.
            storages.setdefault(
                key,
                torch.empty(0, dtype=t.dtype).set_(
                    t.untyped_storage(),
                    0,
                    (t.untyped_storage().nbytes() // t.element_size(),),
                    (1,),
                ),
            )
            starts.append((key, int(t.storage_offset())))
        runs = [host_runs(chunk, starts) for chunk in chunks]
        numel = min(chunk_numel, sum(t.numel() for t in flat_ema))
        mixed = bool(flat_src) and flat_src[0].dtype != dtype
        if numel:
            for kind in ("ema", "upcast") if mixed else ("ema",):
                old = self._scratch.get((kind, dtype))
                if old is None or old.numel() < numel:
                    self._scratch[kind, dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return flat_ema, flat_src, chunks, runs, storages, loose

    def _run(self, group: UpdateGroup, plan: tuple[Any, ...], decay: float) -> None:
        _, flat_src, chunks, runs, storages, loose = plan
        dtype = group.ema_locals[0].dtype
        copy = not group.averaged or decay == 0.0
        scratch = self._scratch.get(("ema", dtype))
        upcast = self._scratch.get(("upcast", dtype))
        blocking = not self._cuda
        step = 0.0 if copy else decay
        for chunk, chunk_runs in zip(chunks, runs, strict=True):
            device_ema = [scratch[o : o + b - a] for _, a, b, o in chunk]  # type: ignore[index]
            sources = [flat_src[i][a:b] for i, a, b, _ in chunk]
            if not copy:
                for key, h, o, n in chunk_runs:
                    scratch[o : o + n].copy_(storages[key][h : h + n], non_blocking=not blocking)  # type: ignore[index]
                if upcast is not None:
                    staged = [upcast[o : o + b - a] for _, a, b, o in chunk]
                    torch._foreach_copy_(staged, sources)
                    sources = staged
            lerp_step_(device_ema, sources, step)  # the kernel module's step, on the scratch
            for key, h, o, n in chunk_runs:
                storages[key][h : h + n].copy_(scratch[o : o + n], non_blocking=not blocking)  # type: ignore[index]
        for ema, src in loose:  # not contiguous: whole tensors, temporaries
            if copy:
                ema.copy_(src, non_blocking=not blocking)
                continue
            on_device = ema.to(self.device, non_blocking=not blocking)
            lerp_step_([on_device], [src.to(dtype)], step)
            ema.copy_(on_device, non_blocking=not blocking)

    def buffer_nbytes(self) -> dict[str, int]:
        scratch = sum(t.numel() * t.element_size() for t in self._scratch.values())
        return {"scratch_device_bytes": scratch}

    def submit(self, step: float, done: Done | None = None) -> None:
        """Launch the step (on the side stream on CUDA) and count it (``done``) at once."""
        self.ensure_open()
        if self._stream is None:
            for group, plan in zip(self.groups, self._plans, strict=True):
                self._run(group, plan, step)
        else:
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for group, plan in zip(self.groups, self._plans, strict=True):
                    self._run(group, plan, step)
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
        if done is not None:
            done()

    def _device_barrier(self) -> None:
        """The current stream waits (on the device) for the pipeline's reads of the sources."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)

    def wait(self) -> None:
        """Block the host until the host EMA shards hold the last step."""
        done, self._done = self._done, None
        if done is not None:
            done.synchronize()

    def close(self) -> None:
        """Finish the pending step and remove the optimizer hook. Idempotent."""
        self._closed = True
        self.wait()
        if self._hook is not None:
            self._finalizer()
            self._hook = None


CUDA_OFFLOAD = "worker"
"""Which updater ``offload=True`` uses for CUDA models: the one last proven on a GPU.
``"worker"`` (:class:`OffloadUpdater`, measured exact on an H100, +10.6 ms per GPT-2 step)
until a GPU run proves ``"chunked"`` (:class:`ChunkedOffloadUpdater`, written since and
never run on a GPU) exact; ``benchmarks/gpu_suite.py``'s offload section measures both.
:func:`dtensor_ema.engine.make_updater` reads it at each construction."""
