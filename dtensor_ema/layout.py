"""Where each rank's piece of a tensor lives: dim-0 chunk ranges, meshes, placements.

DTensor's ``Shard(0)`` splits dim 0 like :func:`torch.chunk`: every rank gets
``ceil(n / W)`` rows except the last ones, which get fewer or none. FSDP2 uses the same
layout. The torch helpers that compute it are private and were renamed between releases,
so we keep our own three-line version (checked against DTensor for n = 0..64, W = 1..9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = [
    "chunk_range",
    "contiguous_stride",
    "cpu_mesh_like",
    "resolve_mesh",
    "shard_mesh_dim",
]


def chunk_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return ``(offset, length)`` of ``rank``'s dim-0 chunk of ``n`` rows over ``world_size``.

    Matches DTensor ``Shard(0)``: chunk ``c = ceil(n / W)``; an empty shard's offset is
    clamped to ``n``. For ``W = 4``: ``n = 10 -> 3,3,3,1``; ``n = 1 -> 1,0,0,0``.
    """
    chunk = math.ceil(n / world_size) if n else 0
    offset = min(rank * chunk, n)
    length = max(0, min(n, offset + chunk) - offset)
    return offset, length


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``shape`` (what the EMA stores)."""
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def shard_mesh_dim(placements: Sequence[Placement]) -> int | None:
    """Mesh dim that shards tensor dim 0, if every other mesh dim replicates.

    ``(Shard(0),)`` -> 0; HSDP ``(Replicate(), Shard(0))`` -> 1; all-``Replicate`` or any
    other layout (``Shard(1)``, two shard dims) -> ``None``. Layouts with a shard mesh dim can
    be gathered with one flat all-gather over that dim's process group.
    """
    found: int | None = None
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard) and placement.dim == 0 and found is None:
            found = mesh_dim
            continue
        return None
    return found


def resolve_mesh(mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh | None:
    """Validate the user's mesh, or build the default one.

    ``mesh=None`` means the whole default process group when one is initialized, and no
    sharding at all otherwise (one plain process). Building the default mesh is local
    (``init_device_mesh`` over an existing group does not communicate on CPU/gloo).

    Raises:
        ValueError: the mesh is not 1-D, or its device type is not the parameters'.
    """
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be 1-D (the ranks the EMA is sharded over), got a {mesh.ndim}-D mesh "
            f"of shape {tuple(mesh.shape)}; pass e.g. init_device_mesh(device, (world_size,)). "
            "FSDP2/HSDP parameters always keep their own mesh."
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"mesh device type {mesh.device_type!r} does not match the model's tensors on "
            f"{device.type!r}; build the mesh with init_device_mesh({device.type!r}, ...)"
        )
    return mesh


def cpu_mesh_like(mesh: DeviceMesh) -> DeviceMesh:
    """The same ranks and shape as ``mesh``, with device type ``cpu`` (for host-resident EMA
    shards). A CUDA mesh's twin needs a CPU backend in the process group
    (``init_process_group("cpu:gloo,cuda:nccl")``); building one is collective where the
    mesh has sub-groups, so every rank must build the same meshes in the same order."""
    if mesh.device_type == "cpu":
        return mesh
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), mesh.mesh_dim_names)
    if key not in _CPU_MESHES:
        _CPU_MESHES[key] = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
    return _CPU_MESHES[key]


_CPU_MESHES: dict[tuple[object, ...], DeviceMesh] = {}
