"""Per-rank EMA memory of models too large to build: the real plan, on the ``meta`` device.

``ModelEMA`` refuses a meta model (its EMA would hold no values). :func:`plan_bytes` runs
the plan's own layout rule (:class:`~dtensor_ema.layout.LayoutBuilder`: which rows of each
tensor's local piece this rank averages) on a meta model on purpose, so the bytes it reports
are the library's layout, not arithmetic. Pair it with a fake process group
(``torch.testing._internal.distributed.fake_pg``) to be any rank of any world size in one
process, and with ``fully_shard`` on the meta model for FSDP2/HSDP layouts (or DeepSpeed
ZeRO-3's partition attributes on its parameters, :func:`zero3_partitioned`: the layout
reads ``ds_numel`` and the partition's length, as for a real ZeRO-3 model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_ema import zero_partition
from dtensor_ema.layout import LayoutBuilder, default_ema_dtype, resolve_world_mesh
from dtensor_ema.plan import model_tensors, unwrap_model

__all__ = ["PlanBytes", "plan_bytes", "zero3_partitioned"]


@dataclass(frozen=True, slots=True)
class PlanBytes:
    """What one rank's EMA would hold."""

    local_bytes: int
    """EMA bytes on this rank (its shards, plus replicated 0-dim tensors)."""
    local_numel: int
    """EMA elements on this rank."""
    replicated_bytes: int
    """EMA bytes of a full, unsharded replica (what timm/AveragedModel keep on every rank)."""
    tensors: int
    """Averaged tensors (tied ones once)."""


def plan_bytes(
    model: nn.Module, mesh: DeviceMesh | None = None, *, ema_dtype: torch.dtype | None = None
) -> PlanBytes:
    """Lay out the EMA of a ``meta``-device ``model`` and count this rank's bytes.

    Args:
        model: every tensor on the ``meta`` device (plain, ``fully_shard``-ed on meta, or
            with ZeRO-3 partition attributes whose ``ds_tensor`` holds no memory).
        mesh: as for :class:`~dtensor_ema.ModelEMA` (``None``: the DTensor parameters'
            root mesh, else the default process group, else no sharding).
        ema_dtype: as for :class:`~dtensor_ema.ModelEMA`.

    Local: no collective (``ModelEMA`` also all-gathers a structure fingerprint; the
    layout does not depend on it), and no memory: meta tensors hold none.

    Raises:
        ValueError: a tensor of ``model`` is not on the meta device.
    """
    module = unwrap_model(model)
    tensors = model_tensors(module)
    real = [k for k, v in tensors.items() if v.device.type != "meta"]
    if real:
        raise ValueError(
            f"plan_bytes needs a meta-device model (no memory); {real[:3]} are on "
            f"{tensors[real[0]].device}: build it under `with torch.device('meta'):`"
        )
    # Meta tensors carry no device type: take the mesh's (the parameters' or the default
    # group's, "cpu" when there is none to copy).
    meshes = [mesh] + [t.device_mesh for t in tensors.values() if isinstance(t, DTensor)]
    device_type = next((m.device_type for m in meshes if m is not None), "cpu")
    world = resolve_world_mesh(mesh, tensors.values(), torch.device(device_type))
    builder = LayoutBuilder(world)
    seen: set[int] = set()
    local = numel = replicated = count = 0
    for fqn, tensor in tensors.items():
        if not tensor.is_floating_point() or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = torch.empty((), dtype=ema_dtype or default_ema_dtype(tensor.dtype)).element_size()
        partition = zero_partition.read_partition(fqn, tensor, world)
        piece, shape, layout = builder.place(fqn, tensor, partition)
        n = piece.numel() if piece.dim() == 0 else layout.length * math.prod(piece.shape[1:])
        numel += n
        local += n * size
        replicated += math.prod(shape) * size  # a ZeRO-3 placeholder's ds_shape
        count += 1
    return PlanBytes(local, numel, replicated, count)


def zero3_partitioned(model: nn.Module) -> nn.Module:
    """Give every parameter of a ``meta``-device ``model`` what DeepSpeed ZeRO-3 sets on it
    between gathers (deepspeed 0.19.8, ``runtime/zero/partition_parameters.py``), so that
    :func:`plan_bytes` lays it out as a ZeRO-3 model of ``dist.get_world_size()`` ranks:
    ``ds_shape``, ``ds_numel``, ``ds_process_group`` (the default group),
    ``ds_persist = False`` and this rank's partition ``ds_tensor``, the flat range of
    ``ceil(ds_numel / W)`` elements DeepSpeed gives each rank; the parameter itself becomes
    a ``(0,)`` placeholder. Returns ``model``, changed in place.

    The partition is a CPU tensor of that length over one element of storage (an expanded
    view): the EMA's layout rule (:mod:`dtensor_ema.layout`,
    :mod:`dtensor_ema.zero_partition`) reads its length, dtype and device, never its
    values, so a 405B model costs nothing. Not a DeepSpeed model (no forward, no
    optimizer): for :func:`plan_bytes` only. Local; needs a process group (a fake one
    will do).

    Raises:
        ValueError: a parameter is not on the meta device.
    """
    world = dist.get_world_size()
    for param in {id(p): p for p in model.parameters()}.values():
        if param.device.type != "meta":
            raise ValueError(f"zero3_partitioned needs a meta-device model, got {param.device}")
        numel = param.numel()
        param.ds_shape, param.ds_numel = param.shape, numel  # type: ignore[attr-defined]
        param.ds_process_group = dist.group.WORLD  # type: ignore[attr-defined]
        param.ds_persist = False  # type: ignore[attr-defined]
        partition = torch.zeros(1, dtype=param.dtype).expand(math.ceil(numel / world))
        param.ds_tensor = partition  # type: ignore[attr-defined]
        param.data = torch.empty(0, dtype=param.dtype, device="meta")
    return model
