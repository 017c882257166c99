"""The sharding plan: which model tensors the EMA tracks, and each rank's piece of them.

Built once per :class:`~dtensor_ema.ModelEMA`. For every floating-point entry of the
unwrapped model's state dict it records

* ``source``: the model's own tensor object (a ``Parameter``, a buffer, or for FSDP2 the
  sharded ``DTensor`` parameter),
* ``source_local``: the piece of it this rank averages, read as a **view** (no copy): the
  dim-0 slice of a replicated tensor, or ``to_local()`` of a DTensor parameter,
* ``ema``: the EMA tensor, a ``DTensor`` (``Shard(0)`` over the EMA mesh for replicated
  tensors, ``Replicate()`` for 0-dim ones, the parameter's own mesh and placements for
  DTensor parameters), or a plain tensor when there is no mesh,
* ``ema_local``: ``ema.to_local()``, cached so the update touches no DTensor machinery.

Non-floating-point buffers (``num_batches_tracked``) are not averaged; they are listed in
``followed`` and always read from the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from dtensor_ema.layout import chunk_range, contiguous_stride, cpu_mesh_like, shard_mesh_dim

__all__ = [
    "EmaPlan",
    "PlanEntry",
    "bucket_view_",
    "build_plan",
    "default_ema_dtype",
    "source_local_view",
    "unwrap_model",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class PlanEntry:
    """One averaged tensor: the model's tensor, this rank's view of it, and its EMA."""

    fqn: str
    source: torch.Tensor
    source_local: torch.Tensor
    ema: torch.Tensor
    ema_local: torch.Tensor
    is_parameter: bool
    averaged: bool = True
    """``False``: the EMA copies the model's value instead (excluded tensors, copied buffers)."""

    @property
    def is_dtensor_source(self) -> bool:
        return isinstance(self.source, DTensor)

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.ema.device_mesh if isinstance(self.ema, DTensor) else None

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(self.ema.placements) if isinstance(self.ema, DTensor) else ()


@dataclass(slots=True)
class EmaPlan:
    """All averaged entries in state-dict order, plus the buffers that follow the model."""

    entries: list[PlanEntry]
    followed: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied weights: extra fqn -> the fqn of the entry that holds the shared tensor."""

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    def by_fqn(self) -> dict[str, PlanEntry]:
        return {e.fqn: e for e in self.entries}

    @torch.no_grad()
    def rebind_ema(self, tensors: Mapping[str, DTensor]) -> None:
        """Move EMA entries into storage someone else owns (the EMA module's FSDP2
        parameters). Local: no collective.

        For each ``fqn -> tensor``: the tensor must be a DTensor with the entry's global
        shape, dtype, mesh and placements (so its local piece has the shape of
        ``ema_local``). The entry's current values are copied into ``tensor.to_local()``,
        which then becomes ``ema_local``; ``tensor`` becomes ``ema``. Everything is checked
        before anything is written. Callers must rebuild what they cached from the old
        ``ema_local`` tensors (update groups).

        Raises:
            ValueError: an unknown fqn, or a tensor whose layout differs from the entry's.
        """
        entries = self.by_fqn()
        problems = []
        for fqn, tensor in tensors.items():
            entry = entries.get(fqn)
            if entry is None:
                problems.append(f"{fqn}: not an EMA entry")
            elif (
                not isinstance(tensor, DTensor)
                or tensor.shape != entry.ema.shape
                or tensor.dtype != entry.ema_local.dtype
                or (tensor.device_mesh, tuple(tensor.placements)) != (entry.mesh, entry.placements)
                or tensor.to_local().shape != entry.ema_local.shape
            ):
                problems.append(
                    f"{fqn}: expected a DTensor {tuple(entry.ema.shape)} {entry.ema_local.dtype} "
                    f"{entry.placements}, got {type(tensor).__name__} {tuple(tensor.shape)} "
                    f"{tensor.dtype} {getattr(tensor, 'placements', None)}"
                )
        if problems:
            raise ValueError(f"cannot rebind the EMA: {problems[:5]}")
        for fqn, tensor in tensors.items():
            entry = entries[fqn]
            local = tensor.to_local()
            local.copy_(entry.ema_local)
            entry.ema, entry.ema_local = tensor, local


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel and ``torch.compile`` wrappers so keys carry no prefix."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        # torch.compile's OptimizedModule keeps the user's module here; there is no public
        # accessor, and without unwrapping every key would carry an "_orig_mod." prefix.
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model


def default_ema_dtype(dtype: torch.dtype) -> torch.dtype:
    """EMA dtype for a tensor of ``dtype``: float32 for fp16/bf16, unchanged otherwise.

    A bf16 EMA with decay 0.9999 stops moving: ``(1 - d) * (p - ema)`` rounds to zero
    against ``ema`` for any update smaller than ~1/256 of it.
    """
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors (``keep_vars``), FSDP2 parameters in sharded form.

    FSDP2's state-dict hooks register the sharded DTensor parameters before the walk, so a
    module left unsharded by a forward without backward still reports its sharded objects.
    """
    return dict(module.state_dict(keep_vars=True))


def build_plan(
    module: nn.Module,
    mesh: DeviceMesh | None,
    *,
    ema_dtype: torch.dtype | None = None,
    offload: bool = False,
    bucket_view: bool = False,
) -> EmaPlan:
    """Create the EMA tensors for ``module`` (already unwrapped). Local only: no collective.

    Args:
        module: the unwrapped model; FSDP2 modules must be resharded by the caller.
        mesh: 1-D mesh that replicated tensors are sharded over, or ``None`` for plain
            (unsharded) EMA tensors. DTensor parameters ignore it and keep their own mesh.
        ema_dtype: dtype of every EMA tensor, or ``None`` for :func:`default_ema_dtype`.
        offload: keep the EMA shards in host memory (pinned when the model is on CUDA) on
            a CPU twin of each mesh.
        bucket_view: make every ``ema_local`` a view into one flat buffer per (device,
            dtype), laid out in gather order (see :func:`bucket_view_`).

    Raises:
        ValueError: the model has no floating-point state, or a DTensor uses a placement
            the EMA cannot mirror.
    """
    entries: list[PlanEntry] = []
    followed: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    parameter_ids = {id(p) for p in module.parameters()}
    for fqn, tensor in model_tensors(module).items():
        if not torch.is_floating_point(tensor):
            followed[fqn] = tensor
            continue
        if id(tensor) in seen:
            aliases[fqn] = seen[id(tensor)]
            continue
        seen[id(tensor)] = fqn
        dtype = ema_dtype or default_ema_dtype(tensor.dtype)
        if isinstance(tensor, DTensor):
            source_local, ema = _ema_for_dtensor(fqn, tensor, dtype, offload)
        else:
            source_local, ema = _ema_for_replicated(tensor, mesh, dtype, offload)
        ema_local = ema.to_local() if isinstance(ema, DTensor) else ema
        entries.append(
            PlanEntry(
                fqn=fqn,
                source=tensor,
                source_local=source_local,
                ema=ema,
                ema_local=ema_local,
                is_parameter=id(tensor) in parameter_ids,
            )
        )
    if not entries:
        raise ValueError(
            f"{type(module).__name__} has no floating-point parameters or buffers to average "
            f"(state dict keys: {list(followed)[:5]})"
        )
    if bucket_view:
        bucket_view_(entries)
    return EmaPlan(entries=entries, followed=followed, aliases=aliases)


def bucket_view_(entries: list[PlanEntry]) -> list[torch.Tensor]:
    """Move every entry's ``ema_local`` into one flat buffer per (device, dtype). Local.

    Entries that materialize with a flat all-gather (dim-0 sharded over one mesh dim) come
    first, grouped by (mesh, mesh dim) in plan order, so that the local shards of one
    gather bucket are adjacent in memory and the bucket's send buffer is a view of the
    flat buffer (no packing; see :mod:`dtensor_ema.materialize`). Each buffer ends with
    room for the padding of its last bucket (the sum over its tensors of ``ceil(n / W)``
    rows minus this rank's rows), sent but never read. Other entries (0-dim, other
    layouts) follow. Each entry's ``ema`` is rebuilt around the view (same mesh,
    placements, shape and stride).

    Returns:
        The flat buffers (held alive by the views).
    """
    order: dict[tuple[Any, ...], int] = {}
    keyed = []
    for index, entry in enumerate(entries):
        mesh_dim = shard_mesh_dim(entry.placements) if entry.mesh is not None else None
        group = (id(entry.mesh), mesh_dim) if mesh_dim is not None else None
        rank = order.setdefault(group, len(order)) if group is not None else 1 << 30
        keyed.append((rank, index, entry, mesh_dim))
    keyed.sort(key=lambda item: item[:2])
    by_buffer: dict[tuple[torch.device, torch.dtype], list[tuple[PlanEntry, int]]] = {}
    for _, _, entry, mesh_dim in keyed:
        local = entry.ema_local
        slack = 0
        if mesh_dim is not None and entry.mesh is not None and entry.ema.dim() > 0:
            n = entry.ema.shape[0]
            chunk = math.ceil(n / entry.mesh.size(mesh_dim)) if n else 0
            slack = chunk * math.prod(entry.ema.shape[1:]) - local.numel()
        by_buffer.setdefault((local.device, local.dtype), []).append((entry, slack))
    flats = []
    for (device, dtype), items in by_buffer.items():
        total = sum(e.ema_local.numel() for e, _ in items)
        pinned = any(e.ema_local.is_pinned() for e, _ in items)
        flat = torch.empty(
            total + sum(slack for _, slack in items), dtype=dtype, device=device, pin_memory=pinned
        )
        cursor = 0
        for entry, _ in items:
            local = entry.ema_local
            view = flat[cursor : cursor + local.numel()].view(local.shape)
            view.copy_(local)
            cursor += local.numel()
            entry.ema_local = view
            if isinstance(entry.ema, DTensor):
                entry.ema = DTensor.from_local(
                    view,
                    entry.ema.device_mesh,
                    entry.ema.placements,
                    run_check=False,
                    shape=entry.ema.shape,
                    stride=entry.ema.stride(),
                )
            else:
                entry.ema = view
        flats.append(flat)
    return flats


def _ema_for_dtensor(
    fqn: str, param: DTensor, dtype: torch.dtype, offload: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirror an FSDP2/TP parameter: same mesh, placements, global shape and stride."""
    for placement in param.placements:
        if isinstance(placement, Partial) or not isinstance(placement, (Shard, Replicate)):
            raise ValueError(
                f"cannot average {fqn!r}: placement {placement} is not Shard or Replicate"
            )
    source_local = source_local_view(param, None)
    mesh = cpu_mesh_like(param.device_mesh) if offload else param.device_mesh
    ema = DTensor.from_local(
        _fresh_copy(source_local, dtype, offload),
        mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return source_local, ema


def _ema_for_replicated(
    tensor: torch.Tensor, mesh: DeviceMesh | None, dtype: torch.dtype, offload: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard a tensor every rank holds in full: this rank keeps its dim-0 chunk."""
    full = tensor.detach()
    source_local = source_local_view(full, mesh)
    if mesh is None:
        return source_local, _fresh_copy(full, dtype, offload)
    placements: list[Placement] = [Replicate()] if full.dim() == 0 else [Shard(0)]
    ema = DTensor.from_local(
        _fresh_copy(source_local, dtype, offload),
        cpu_mesh_like(mesh) if offload else mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=contiguous_stride(full.shape),
    )
    return source_local, ema


def source_local_view(tensor: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """This rank's piece of a model tensor, as a view (never a copy).

    DTensor (FSDP2/TP) parameters: ``to_local()``. Replicated tensors: the dim-0 chunk of
    this rank on ``mesh`` (``Shard(0)`` semantics), or the whole tensor for 0-dim tensors
    and without a mesh.
    """
    if isinstance(tensor, DTensor):
        return tensor.to_local().detach()
    full = tensor.detach()
    if mesh is None or full.dim() == 0:
        return full
    offset, length = chunk_range(full.shape[0], mesh.size(), mesh.get_local_rank())
    return full.narrow(0, offset, length)


def _fresh_copy(tensor: torch.Tensor, dtype: torch.dtype, offload: bool = False) -> torch.Tensor:
    """A contiguous copy in ``dtype`` that shares no memory with the model; in (pinned, for
    CUDA sources) host memory with ``offload``."""
    if not offload:
        return tensor.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    out = torch.empty(
        tensor.shape, dtype=dtype, device="cpu", pin_memory=tensor.device.type == "cuda"
    )
    return out.copy_(tensor)
