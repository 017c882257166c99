"""Lightning pieces shared by the drop-in tests, in a light module: ``ddp_spawn`` pickles
the callbacks and the module by reference, and each spawned rank imports only this (torch,
Lightning and our callback), not a test module's heavier imports."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import WeightAveraging as RealWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn

from dtensor_ema.compat import lightning as our_lightning


class Decayed:
    """A picklable EMA function object, the pattern Lightning's test recommends for
    ``ddp_spawn`` (the same arithmetic as torch's ``get_ema_avg_fn``)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema: torch.Tensor, current: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.decay * ema + (1 - self.decay) * current


class TinyModule(BoringModel):
    """Lightning's test module shape: Linear, optional BatchNorm1d, ReLU, Linear; SGD."""

    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(32, 32)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(32))
        self.layer = nn.Sequential(*layers, nn.ReLU(), nn.Linear(32, 2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class LateModule(BoringModel):
    """Its layers come from ``configure_model`` (called again by the strategy)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: nn.Module | None = None

    def configure_model(self) -> None:
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Counting:
    """Counts Lightning's hook calls and checks them where Lightning's test does (mixed into
    both callbacks; module-level classes, so ``ddp_spawn`` can pickle them)."""

    _average_model: Any

    def __init__(self, every_epoch: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self.every_epoch = every_epoch
        self.swap_calls = self.copy_calls = 0
        self.in_setup: dict[str, Any] = {}
        self.history: list[tuple[int, int, int]] = []  # (epoch, n_averaged, swap_calls)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if self.every_epoch:
            return epoch_idx in (1, 3)
        return super().should_update(step_idx, epoch_idx)  # type: ignore[misc]

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        average = self._average_model
        self.in_setup = {
            "built": average is not None,
            "bound": average is not None
            and average.module.train_dataloader.__self__ is average.module,
            "no_trainer": average is not None and average.module._trainer is None,
        }

    def _swap_models(self, *args: Any, **kwargs: Any) -> Any:
        self.swap_calls += 1
        return super()._swap_models(*args, **kwargs)  # type: ignore[misc]

    def _copy_average_to_current(self, *args: Any, **kwargs: Any) -> Any:
        self.copy_calls += 1
        return super()._copy_average_to_current(*args, **kwargs)  # type: ignore[misc]

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # type: ignore[misc]
        n = int(self._average_model.n_averaged)
        self.history.append((trainer.current_epoch, n, self.swap_calls))
        if self.copy_calls:
            raise AssertionError("_copy_average_to_current before the end of training")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]
        if self.copy_calls != 1:
            raise AssertionError(f"_copy_average_to_current called {self.copy_calls} times")


class OurCounting(_Counting, our_lightning.WeightAveraging):
    pass


class RealCounting(_Counting, RealWeightAveraging):
    pass


def fit(
    module: pl.LightningModule,
    callback: Any,
    root: Path,
    *,
    strategy: str = "auto",
    devices: int = 1,
    epochs: int = 4,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            strategy=strategy,
            devices=devices,
            logger=False,
            callbacks=callback,
            max_epochs=epochs,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accumulate_grad_batches=2,
            deterministic=True,
            default_root_dir=str(root),
        )
        data = torch.utils.data.DataLoader(RandomDataset(32, 32), batch_size=4)
        trainer.fit(module, data)
