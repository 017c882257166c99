"""Per-rank EMA memory of models too large to build: the real plan, on the ``meta`` device.

``ModelEMA`` refuses a meta model (its EMA would hold no values). :func:`plan_bytes` builds
the same sharding plan on purpose from a meta model, so the bytes it reports are the
library's own layout, not arithmetic. Pair it with a fake process group
(``torch.testing._internal.distributed.fake_pg``) to be any rank of any world size in one
process, and with ``fully_shard`` on the meta model for FSDP2/HSDP layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema.plan import build_plan, default_ema_dtype, model_tensors, unwrap_model

__all__ = ["PlanBytes", "plan_bytes"]


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
    """Build the EMA plan for a ``meta``-device ``model`` and count this rank's bytes.

    Args:
        model: every tensor on the ``meta`` device (plain, or ``fully_shard``-ed on meta).
        mesh: as for :class:`~dtensor_ema.ModelEMA` (``None``: no sharding of plain
            tensors).
        ema_dtype: as for :class:`~dtensor_ema.ModelEMA`.

    Local: no collective, no memory beyond the plan's bookkeeping (meta tensors hold none).

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
    plan = build_plan(module, mesh, ema_dtype=ema_dtype)
    local = sum(e.ema_local.numel() * e.ema_local.element_size() for e in plan)
    numel = sum(e.ema_local.numel() for e in plan)
    replicated = 0
    for e in plan:
        dtype = ema_dtype or default_ema_dtype(e.source.dtype)
        replicated += e.source.numel() * torch.empty((), dtype=dtype).element_size()
    return PlanBytes(local, numel, replicated, len(plan.entries))
