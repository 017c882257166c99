"""Lightning + dtensor_ema: a sharded EMA in two lines, on a tiny model and offline data.

    python examples/lightning_ema.py                                  # one process
    torchrun --standalone --nproc_per_node=2 examples/lightning_ema.py  # DDP, 2 ranks
    torchrun --standalone --nproc_per_node=2 examples/lightning_ema.py --strategy fsdp

The task is a noisy regression (a fixed random teacher network plus label noise) trained
with a large learning rate, so the raw weights keep jittering while their average settles.
Validation runs with the EMA weights (the callback's default). At the end the script
validates once more with the raw weights, prints both losses, and shows where the
checkpoint with the EMA went: ``--resume PATH`` continues from it (at any number of ranks).
``--strategy fsdp`` shards the model with FSDP2 (``fully_shard`` in ``configure_model``,
Lightning's ``ModelParallelStrategy``); the EMA is then sharded like each parameter and
checkpointed as DCP shards. CPU/gloo by default, ``--accelerator gpu`` on GPUs.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from dtensor_ema.integrations.lightning import EMACallback

FEATURES, OUTPUTS = 16, 4


def make_data(n: int, noise: float, seed: int) -> torch.utils.data.TensorDataset:
    """``y = teacher(x) + noise``; the teacher is the same for every split and run."""
    teacher = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, OUTPUTS))
    torch.manual_seed(0)
    for p in teacher.parameters():
        nn.init.normal_(p, std=0.5)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    with torch.no_grad():
        y = teacher(x) + noise * torch.randn(n, OUTPUTS, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int, lr: float, fsdp: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU()
        )
        self.head = nn.Linear(hidden, OUTPUTS)
        self.lr = lr
        self.fsdp = fsdp

    def configure_model(self) -> None:
        if self.fsdp:  # only under ModelParallelStrategy (--strategy fsdp)
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class EpochTable(pl.Callback):
    """One printed row per validation (rank 0): the EMA's validation loss."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking or not trainer.is_global_zero:
            return
        loss = trainer.callback_metrics.get("val_loss")
        train = trainer.callback_metrics.get("train_loss")
        print(
            f"epoch {trainer.current_epoch:3d} | step {trainer.global_step:5d} | "
            f"train loss {float(train) if train is not None else float('nan'):.4f} | "
            f"EMA val loss {float(loss) if loss is not None else float('nan'):.4f}",
            flush=True,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="ddp: replicate the model (EMA sharded 1/W per rank); fsdp: FSDP2 via "
        "ModelParallelStrategy (EMA sharded like each parameter)",
    )
    p.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu or gpu")
    p.add_argument("--epochs", type=int, default=6, help="training epochs")
    p.add_argument("--train-size", type=int, default=2048, help="training samples (offline)")
    p.add_argument("--val-size", type=int, default=512, help="validation samples")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=61, help="hidden width (odd: uneven shards)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (large on purpose)")
    p.add_argument("--noise", type=float, default=0.5, help="label noise standard deviation")
    p.add_argument("--decay", type=float, default=0.995, help="EMA decay (ramped up, yolov5 style)")
    p.add_argument(
        "--ckpt-dir",
        default="lightning_ema_ckpt",
        help="where ModelCheckpoint writes (EMA included); '' to disable",
    )
    p.add_argument("--resume", default=None, help="checkpoint to resume from (ckpt_path=)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    strategy: Any = "auto" if devices == 1 else "ddp"
    if args.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    ema = EMACallback(decay=args.decay, tau=100)  # line 2 (line 1: the import)
    callbacks: list[pl.Callback] = [ema, EpochTable()]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_dir),
        num_sanity_val_steps=0,
    )
    torch.manual_seed(1)
    model = Regressor(args.hidden, args.lr, fsdp=args.strategy == "fsdp")
    train = torch.utils.data.DataLoader(
        make_data(args.train_size, args.noise, seed=1), batch_size=args.batch_size, shuffle=True
    )
    val = torch.utils.data.DataLoader(make_data(args.val_size, 0.0, seed=2), batch_size=256)
    if trainer.is_global_zero:
        print(f"{args.strategy} on {devices} x {args.accelerator}; EMA decay {args.decay}")
    trainer.fit(model, train, val, ckpt_path=args.resume)

    ema_loss = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    ema.evaluate_with_ema = False
    raw_loss = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    if trainer.is_global_zero:
        share = ema.ema.local_numel() / sum(p.numel() for p in model.state_dict().values())
        print(
            f"final: raw val loss {raw_loss:.4f}  EMA val loss {ema_loss:.4f}  "
            f"(EMA updates: {ema.ema.updates}; this rank holds {share:.2f} of the EMA)"
        )
        if args.ckpt_dir:
            print(f"checkpoints with the EMA in {args.ckpt_dir}/ (resume: --resume PATH)")


if __name__ == "__main__":
    main()
