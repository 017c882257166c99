"""DeepSpeed ZeRO-3 parameters as the EMA sees them: read from the attributes DeepSpeed sets.

Under ZeRO stage 3 (``deepspeed.initialize`` with ``zero_optimization.stage = 3``, or a
model built inside ``deepspeed.zero.Init``) every parameter ``p`` of the module keeps

* ``p.ds_shape`` / ``p.ds_numel``: the real shape and size (``p`` itself is a ``(0,)``
  placeholder between gathers),
* ``p.ds_tensor``: this rank's *partition*, the flat range ``[r * c, (r + 1) * c)`` of the
  flattened tensor with ``c = ceil(ds_numel / W)`` over ``p.ds_process_group`` (``W`` ranks,
  this one ``r``); the last ranks' ranges run past ``ds_numel`` and are padding,
* ``p.ds_persist``: small parameters (``stage3_param_persistence_threshold``) that stay
  whole on every rank beside their partition once trained (DeepSpeed gathers them after
  every optimizer step); ``p.ds_status`` is ``AVAILABLE`` then and ``p`` has its real
  shape. A forward without backward (an evaluation) leaves every parameter whole that
  way until the next step,
* ``p.ds_secondary_tensor``: with ZeRO++ hpZ (``zero_hpz_partition_size > 1``), a second,
  node-local partition that backward gathers from; DeepSpeed drops it after each step.

The optimizer writes the partition (and gathers persistent parameters from it after each
step), so the partition is what the EMA reads, before and after any forward: the padding
excluded, it is exactly DTensor ``Shard(0)`` of the flattened tensor over that group
(:func:`dtensor_ema.layout.chunk_range`). This module only reads those attributes (read in
DeepSpeed 0.19.8's ``runtime/zero/partition_parameters.py``), and removes DeepSpeed's
gather hooks from a plain copy of a ZeRO-3 module (:func:`drop_partition_hooks`, for the
drop-ins' replica). The plan asks it once per model tensor (:func:`read_partition`: the
piece, its range, the real shape, or why the EMA cannot follow it) and hands the answer to
:mod:`dtensor_ema.layout`, which turns it into a layout. It never imports DeepSpeed: a model
without ZeRO-3 parameters costs one ``getattr`` per tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ZeroPartition",
    "drop_partition_hooks",
    "drop_secondary",
    "is_partitioned",
    "partition_piece",
    "read_partition",
    "real_shape",
    "whole_view",
]


@dataclass(frozen=True, slots=True)
class ZeroPartition:
    """What the EMA needs of one ZeRO-3 parameter on this rank, read in one call
    (:func:`read_partition`) and checked to be one it can follow."""

    piece: torch.Tensor
    """This rank's partition without its padding: a 1-D view of ``ds_tensor``."""
    start: int
    """Where ``piece`` starts in the flattened parameter (``Shard(0)`` of its ``ds_numel``
    elements over the EMA's mesh, which is DeepSpeed's group)."""
    shape: torch.Size
    """The parameter's real shape (``ds_shape``)."""


def is_partitioned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter (it carries DeepSpeed's ``ds_tensor``)."""
    return hasattr(tensor, "ds_tensor") and hasattr(tensor, "ds_numel")


def real_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's real shape (``ds_shape``), whatever ``param`` holds right now."""
    return torch.Size(param.ds_shape)  # type: ignore[attr-defined]


def _partition_range(param: torch.Tensor) -> tuple[int, int]:
    """``(start, length)`` of this rank's partition in the flattened tensor, padding
    excluded, by DeepSpeed's rule (``_partition_param``: ``c = ceil(ds_numel / W)``, rank
    ``r`` holds ``[r * c, (r + 1) * c)``)."""
    group = param.ds_process_group  # type: ignore[attr-defined]
    numel = int(param.ds_numel)  # type: ignore[attr-defined]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = math.ceil(numel / size) if numel else 0
    start = min(rank * chunk, numel)
    return start, max(0, min(numel, start + chunk) - start)


def partition_piece(param: torch.Tensor) -> torch.Tensor:
    """This rank's partition without its padding: a 1-D view of ``ds_tensor``."""
    _, length = _partition_range(param)
    return param.ds_tensor.detach().narrow(0, 0, length)  # type: ignore[attr-defined]


def whole_view(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's whole value when DeepSpeed holds one beside the partition (a
    persistent parameter after a step, any parameter after a forward without backward):
    a view of
    ``param`` in its real shape, which the next forward reads instead of the partition.
    ``None`` between gathers."""
    status = getattr(param, "ds_status", None)
    whole = param.numel() == int(param.ds_numel) and param.numel() > 0  # type: ignore[attr-defined]
    if getattr(status, "name", None) == "AVAILABLE" and whole:
        return param.detach().view(real_shape(param))
    return None


def drop_secondary(param: torch.Tensor) -> None:
    """Forget the ZeRO++ hpZ secondary partition (``zero_hpz_partition_size > 1``: a copy
    of the partition that backward gathers from), as DeepSpeed does after each optimizer
    step, so that nothing reads it after the partition was written; the next release
    builds it again from the whole parameter. Local."""
    if getattr(param, "ds_secondary_tensor", None) is not None:
        param.ds_secondary_tensor = None  # type: ignore[attr-defined]


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_HOOK_ID_SETS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _from_deepspeed(hook: object) -> bool:
    function = getattr(hook, "func", hook)  # functools.partial
    function = getattr(function, "hook", function)  # torch's _WrappedHook
    return str(getattr(function, "__module__", "") or "").startswith("deepspeed.")


def drop_partition_hooks(module: nn.Module) -> int:
    """Remove, from ``module`` and every submodule, the hooks DeepSpeed defined (ZeRO-3
    registers a gather before and a release after every submodule's forward, and the
    backward hooks that partition gradients; each is a function of a ``deepspeed.`` module).
    For a *copy* of a ZeRO-3 module whose parameters are plain tensors: DeepSpeed's hooks
    would gather partitions it does not hold. Hooks of any other origin stay. Local;
    returns how many were removed."""
    removed = 0
    for sub in module.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(sub, name, None)
            if not hooks:
                continue
            for key in [k for k, hook in hooks.items() if _from_deepspeed(hook)]:
                del hooks[key]
                removed += 1
                for id_set in _HOOK_ID_SETS:
                    getattr(sub, id_set, {}).pop(key, None)
    return removed


def read_partition(fqn: str, param: torch.Tensor, world: DeviceMesh | None) -> ZeroPartition | None:
    """Everything the EMA needs about ``param`` as a ZeRO-3 parameter, in one call: ``None``
    when it is not one (one ``getattr``), else this rank's partition of it over ``world``
    (the EMA's mesh), checked to be one the EMA can follow. The plan asks it for every
    model tensor, tracked or not (whole-model outputs read the untracked ones). Local.

    Raises:
        ValueError: ``cannot average ...``, naming the tensor, the DeepSpeed setting (or
            the mesh) and the way out.
    """
    if not is_partitioned(param):
        return None
    if world is None or world.ndim != 1:
        raise ValueError(
            f"cannot average {fqn!r}, a ZeRO-3 parameter: its partitions are 1-D over "
            "DeepSpeed's data-parallel group, so the EMA's mesh must be that group "
            f"(mesh=None does it); got {'no mesh' if world is None else tuple(world.shape)}"
        )
    why = _refusal(fqn, param, world.mesh.tolist(), world.device_type)
    if why is not None:
        raise ValueError(f"cannot average {why}")
    start, _ = _partition_range(param)
    return ZeroPartition(partition_piece(param), start, real_shape(param))


def _refusal(fqn: str, param: torch.Tensor, ranks: list[int], device_type: str) -> str | None:
    """Why the EMA cannot follow this ZeRO-3 parameter over a 1-D mesh of ``ranks`` (in
    order) on ``device_type``, or ``None`` when it can; each reason names the DeepSpeed
    setting and the way out."""
    ds_tensor = getattr(param, "ds_tensor", None)
    if ds_tensor is None:
        return (
            f"{fqn!r} is a ZeRO-3 parameter that DeepSpeed has not partitioned yet "
            "(ds_tensor is None); create the EMA after deepspeed.initialize"
        )
    location = getattr(ds_tensor, "final_location", None)
    if getattr(location, "value", location) == "nvme":
        return (
            f"{fqn!r}: ZeRO-3 parameter offload to NVMe (offload_param.device='nvme') keeps "
            "the partitions on disk between uses, where the EMA cannot read them in place; "
            "set offload_param.device to 'cpu' or 'none'"
        )
    if hasattr(ds_tensor, "ds_quant_scale"):
        return (
            f"{fqn!r}: its ZeRO-3 partition is quantized (zero_quantized_nontrainable_weights)"
            ": it holds int8 codes, not weights; set zero_quantized_nontrainable_weights to "
            "false"
        )
    group_ranks = dist.get_process_group_ranks(param.ds_process_group)  # type: ignore[attr-defined]
    if group_ranks != ranks:
        return (
            f"{fqn!r} is partitioned over the ranks {group_ranks} (its ds_process_group), but "
            f"the EMA's mesh has the ranks {ranks}; pass mesh= a 1-D mesh over DeepSpeed's "
            "data-parallel group, e.g. DeviceMesh.from_group(group, device_type)"
        )
    numel = int(param.ds_numel)  # type: ignore[attr-defined]
    expected = math.ceil(numel / len(group_ranks)) if numel else 0
    if ds_tensor.dim() != 1 or ds_tensor.numel() != expected:
        return (
            f"{fqn!r}: its ZeRO-3 partition has shape {tuple(ds_tensor.shape)}, not "
            f"({expected},) = ceil({numel} / {len(group_ranks)}) as DeepSpeed 0.19 lays "
            "it out; this DeepSpeed version partitions differently, please report it"
        )
    if ds_tensor.device.type != device_type:
        return (
            f"{fqn!r}: its ZeRO-3 partition lives on {ds_tensor.device.type} "
            f"(offload_param.device='cpu'?) while the EMA's mesh is on {device_type!r}: "
            "the EMA's gathers would run on that group with tensors of the other device; "
            "set offload_param.device to 'none'"
        )
    if not ds_tensor.is_floating_point() or ds_tensor.dtype != param.dtype:
        return (
            f"{fqn!r}: its ZeRO-3 partition is {ds_tensor.dtype}, the parameter "
            f"{param.dtype}; the EMA averages the parameter's own values"
        )
    return None
