"""What a background save needs: a copy of the state, a worker thread, a group of its own.

``save_checkpoint(..., async_=True)`` (:mod:`dtensor_ema.checkpoint.save_load`) blocks training only
while it copies the state; the write runs here:

* :func:`cpu_copy`: every tensor of a (nested) state dict copied to the CPU, a DTensor as a
  DTensor of the same mesh and placements holding a copy of this rank's piece (what
  ``dcp.async_save``'s stager makes, without its detour through ``copy.deepcopy`` of the
  whole DTensor), other values deep-copied; so training may change the live state at once.
  The copies are kept as the staging buffer of the next background save (as DCP's
  ``BlockingAsyncStager(cache_staged_state_dict=True)``).
* :func:`submit`: one worker thread per process runs the writes in call order, and
  :func:`wait_pending` lets the next save (blocking or not) start only once the previous
  background write finished, so two saves never share ``<path>.partial``.
* :func:`background_group`: the writer's collectives (DCP's, and the ranks' agreement before
  the commit) run on a gloo group over the same ranks, created on the first background save
  of each group and kept: collectives issued from two threads on one group could pair up
  differently on different ranks. DCP needs a CPU backend for the staged copies anyway.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ema.flat_chunks import FlatChunks

__all__ = [
    "background_group",
    "cpu_copy",
    "release_staging",
    "staging_nbytes",
    "submit",
    "wait_pending",
]

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_pending: list[concurrent.futures.Future[None]] = []
_groups: dict[Any, dist.ProcessGroup] = {}
_staging: dict[tuple[str, ...], torch.Tensor] = {}


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (a DTensor keeps its mesh, placements,
    global shape and stride; its local piece is copied), mappings and sequences rebuilt,
    other values deep-copied. Local.

    The copies are kept for the next call (the staging buffer): a tensor at the same place
    in the next state, of the same shape, dtype and layout, is copied into its old buffer
    (a copy into memory already mapped: about 5x faster here than into new memory), so only
    the first background save allocates. Buffers the next state does not use are dropped.
    Only call it once the previous background write finished (:func:`wait_pending`). Peak
    extra memory: one CPU copy of the tensors, kept until the next call."""
    used: dict[tuple[str, ...], torch.Tensor] = {}
    copied = _copy(value, (), used)
    _staging.clear()
    _staging.update(used)
    return copied


def _copy(value: Any, where: tuple[str, ...], used: dict[tuple[str, ...], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        buffer = _staging.get(where)
        if buffer is not None and _same_layout(buffer, value):
            with torch.no_grad():
                _local(buffer).copy_(_local(value))
        elif isinstance(value, FlatChunks):  # a ZeRO-3 entry: the same flat range
            buffer = FlatChunks(value.local.detach().to("cpu", copy=True), value.shape, value.start)
        else:  # a DTensor stays one: its local piece is copied, its mesh kept
            buffer = value.detach().to("cpu", copy=True)
        used[where] = buffer
        return buffer
    if isinstance(value, Mapping):
        return {k: _copy(v, (*where, str(k)), used) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v, (*where, str(i)), used) for i, v in enumerate(value))
    return copy.deepcopy(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, FlatChunks):
        return tensor.local
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_layout(buffer: torch.Tensor, value: torch.Tensor) -> bool:
    return _layout(buffer) == _layout(value)


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a staging buffer must share with the tensor it copies."""
    local = _local(tensor)
    key = (type(tensor), tuple(tensor.shape), tuple(local.shape), local.stride(), local.dtype)
    if isinstance(tensor, FlatChunks):
        return (*key, tensor.start)
    if isinstance(tensor, DTensor):
        return (*key, tensor.device_mesh, tuple(tensor.placements))
    return key


def release_staging() -> None:
    """Wait for a pending background write, then free the staging buffer that
    :func:`cpu_copy` keeps for the next background save (the next one allocates again).
    Local."""
    wait_pending()
    _staging.clear()


def staging_nbytes() -> int:
    """Bytes of this rank's pieces held in the staging buffer. Local."""
    return sum(_local(t).numel() * _local(t).element_size() for t in _staging.values())


def background_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group over the ranks of ``group`` for background writes (``None`` for one
    process). **Collective** the first time for each ``group``: every rank of ``group``
    (and only those) creates it, in the same order (``dist.new_group`` with local
    synchronization); later calls are local."""
    if group is None:
        return None
    found = _groups.get(group)
    if found is None:
        ranks = dist.get_process_group_ranks(group)
        created = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        assert isinstance(created, dist.ProcessGroup)
        found = _groups[group] = created
    return found


def submit(work: Callable[[], None]) -> concurrent.futures.Future[None]:
    """Run ``work`` on this process's background writer thread (after any earlier work);
    returns its future."""
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dtensor_ema-save"
        )
    future = _executor.submit(work)
    _pending[:] = [f for f in _pending if not f.done()] + [future]
    return future


def wait_pending() -> None:
    """Wait until every background write of this process has finished (its outcome, an
    error too, is its future's: the caller of that save reads it). Local."""
    concurrent.futures.wait(_pending)
    _pending.clear()
