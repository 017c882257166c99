"""Small collective helpers shared by the checkpoint, export and materialize paths.

* :func:`agree` / :func:`mesh_agree`: every rank learns whether any rank failed a step, so
  all raise or none does (one all-reduce of a flag per rank; per mesh dim on N-D meshes).
* :func:`collective`: marks a ``ModelEMA`` method as a collective over the EMA's mesh. It
  names the call when a rank is missing: always when the backend's timeout fires, and
  early with ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>`` (a monitored barrier over the
  mesh before each such call; gloo groups only; costs one barrier per call).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CHECK_ENV",
    "agree",
    "check_all_ranks_enter",
    "collective",
    "group_of",
    "is_mesh_first",
    "mesh_agree",
    "quiet_single_process",
    "rank_of",
]

CHECK_ENV = "DTENSOR_EMA_CHECK_COLLECTIVES"
"""Seconds every rank of the mesh has to enter a collective call before it fails loudly."""

F = TypeVar("F", bound=Callable[..., Any])


def group_of(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to coordinate on, or ``None`` for one process with no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return process_group if process_group is not None else dist.group.WORLD


def rank_of(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _reduce_device(group: dist.ProcessGroup) -> torch.device:
    """A device the group's backend can all-reduce on (CPU for gloo, else the accelerator)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree(group: dist.ProcessGroup | None, error: BaseException | None, what: str) -> None:
    """All ranks of ``group`` learn which ranks failed ``what``; every rank raises if any did.

    One all-reduce of a flag per rank (no pickling). A failed rank re-raises its own error;
    the others raise a ``RuntimeError`` naming the failed ranks.
    """
    if group is None:
        if error is not None:
            raise error
        return
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=_reduce_device(group))
    flags[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(flags, group=group)
    failed = flags.nonzero().flatten().tolist()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; their errors say why")


def mesh_agree(mesh: DeviceMesh | None, error: BaseException | None, what: str) -> None:
    """:func:`agree` over every rank of ``mesh`` (any number of dims), with no new group:
    one all-reduce per mesh dim sums the flags over the whole mesh. Failed ranks are named
    by their global rank. ``mesh=None``: this process alone."""
    if mesh is None:
        agree(None, error, what)
        return
    ranks = mesh.mesh.flatten().tolist()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "mesh_agree called on a rank outside the mesh"
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    flags = torch.zeros(len(ranks), dtype=torch.int32, device=_reduce_device(groups[0]))
    flags[ranks.index(dist.get_rank())] = int(error is not None)
    for group in groups:
        dist.all_reduce(flags, group=group)
    failed = [ranks[i] for i in flags.nonzero().flatten().tolist()]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; their errors say why")


def is_mesh_first(mesh: DeviceMesh | None) -> bool:
    """Whether this rank is the mesh's first (coordinate ``(0, ..., 0)``); ``True`` without
    a mesh."""
    if mesh is None:
        return True
    coordinate = mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c in coordinate)


def check_all_ranks_enter(mesh: DeviceMesh | None, name: str) -> None:
    """With ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>``: a monitored barrier over each dim
    of ``mesh`` (gloo groups), so a rank that never calls ``name`` makes the others fail
    after that many seconds, naming the call and the missing ranks, instead of hanging."""
    seconds = os.environ.get(CHECK_ENV)
    if not seconds or mesh is None:
        return
    timeout = timedelta(seconds=float(seconds))
    for mesh_dim in range(mesh.ndim):
        group = mesh.get_group(mesh_dim)
        if "gloo" not in str(dist.get_backend(group)):
            warnings.warn(
                f"{CHECK_ENV} checks only gloo groups; {name}() runs unchecked on "
                f"{dist.get_backend(group)}",
                stacklevel=3,
            )
            return
        try:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise RuntimeError(
                f"{name}() is a collective: every rank of the EMA's mesh (global ranks "
                f"{mesh.mesh.flatten().tolist()}) must call it, but not all did within "
                f"{seconds} s ({CHECK_ENV}): {e}"
            ) from e


_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed")


def collective(name: str) -> Callable[[F], F]:
    """Decorate a ``ModelEMA`` method that is a collective over ``self.mesh``.

    Runs :func:`check_all_ranks_enter` first, and turns a backend timeout inside the call
    (a rank never joined) into a ``RuntimeError`` that names the call.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            mesh = getattr(self, "mesh", None)
            check_all_ranks_enter(mesh, name)
            try:
                return fn(self, *args, **kwargs)
            except RuntimeError as e:
                text = str(e).lower()
                if mesh is None or not any(w in text for w in _TIMEOUT_WORDS):
                    raise
                raise RuntimeError(
                    f"{name}() timed out in a collective: every rank of the EMA's mesh (global "
                    f"ranks {mesh.mesh.flatten().tolist()}) must call it; set {CHECK_ENV}="
                    "<seconds> to find the missing ranks early"
                ) from e

        return call  # type: ignore[return-value]

    return wrap


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*assuming the intent is to", UserWarning)
        yield
