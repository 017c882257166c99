"""The ``LightningModule`` every Lightning EMA test trains, in a light module (torch and
Lightning only): our ``EMACallback`` under DDP, FSDP2 and DeepSpeed ZeRO
(``test_integration_lightning.py``, ``fixtures/deepspeed_trainers.py``) and the
``EMAWeightAveraging`` drop-in under ``ModelParallelStrategy``
(``test_compat_lightning_model_parallel.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full float tensors of the module (``full_tensor()`` for DTensors: collective)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
        if v.is_floating_point()
    }


class Net(pl.LightningModule):
    """Odd sizes (uneven shards, padded ZeRO-3 partitions; biases small enough to stay
    whole under ZeRO-3) and a float buffer that changes every step (averaged too, never
    partitioned). Each validation records what the module holds (``snapshot``, at its
    first batch) in ``val_seen``.

    ``shard=True``: ``configure_model`` applies Lightning's TP + FSDP2 recipe on the
    strategy's ``device_mesh``: TP on ``tensor_parallel`` when it has more than one rank
    (colwise then rowwise: one all-reduce per forward), then FSDP2 on ``data_parallel``.
    ``hidden`` must divide by the TP degree: ``RowwiseParallel`` rebuilds its input from the
    colwise layer's local output assuming even shards (at ``hidden=6`` on a 2x2 mesh the
    FSDP2 shards stay uneven: 3 rows per TP rank split 2 + 1 over dp).
    """

    def __init__(
        self,
        hidden: int = 7,
        *,
        shard: bool = False,
        snapshot: Callable[[nn.Module], dict[str, torch.Tensor]] = full_state,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        self.register_buffer("seen", torch.zeros(3))
        self.shard = shard
        self.snapshot = snapshot
        self.val_seen: list[dict[str, torch.Tensor]] = []

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        tp_mesh = self.device_mesh["tensor_parallel"]
        if tp_mesh.size() > 1:
            parallelize_module(self.body, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.body[0], mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.add_(0.25)
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.val_seen.append(self.snapshot(self))
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
