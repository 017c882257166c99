"""Lightning 2.6's ``WeightAveraging``/``EMAWeightAveraging``, sharded:
``from dtensor_ema.compat.lightning import EMAWeightAveraging``.

Same arguments, the same overridable ``should_update(step_idx, epoch_idx)``, the same hooks
(``_swap_models`` for validation, ``_copy_average_to_current`` at the end of training) and
the same checkpoint layout (``state_dict`` the average, ``current_model_state`` the raw
weights, ``averaging_state`` ``n_averaged``), over this package's
:class:`~dtensor_ema.compat.swa_utils.AveragedModel` (``EMAWeightAveraging``: torch's
``get_ema_avg_fn`` rounding, ``formula="weighted_sum"``), with each rank holding ``1/W`` of
the average. The average is built in ``setup`` as Lightning builds it where the module
already sits on its training device, else at ``on_fit_start`` (it tracks the module's own
tensors, which must not move after). Under ``ModelParallelStrategy`` (where Lightning's own
callback cannot run) the checkpoint stays sharded: every rank writes its own shards of the
average as ``state_dict`` and of the raw weights under ``current_model_state.<fqn>`` in the
same DCP checkpoint. Other keywords go to :class:`~dtensor_ema.ModelEMA` (``track=
"trainable"`` follows an unfreezing callback, :func:`~dtensor_ema.integrations._common.
follow_trainable`). The guide, with the numbers checked against Lightning's callback and
what differs: ``docs/migration-lightning.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor

from dtensor_ema._collectives import group_of
from dtensor_ema.checkpoint.reader import CheckpointError, open_checkpoint
from dtensor_ema.compat.swa_utils import AveragedModel, get_ema_avg_fn
from dtensor_ema.integrations._common import (
    EvalSwap,
    copy_ema_into_model,
    follow_trainable,
    is_rank0,
)
from dtensor_ema.state import CONFIG, EMA_TENSORS, UPDATES

__all__ = ["CURRENT_PREFIX", "EMAWeightAveraging", "WeightAveraging"]

CURRENT_PREFIX = "current_model_state."
"""Key prefix of the raw weights inside a sharded checkpoint's ``state_dict`` (DCP) entry."""


class WeightAveraging(Callback):
    """Lightning's ``WeightAveraging`` over a sharded :class:`AveragedModel`.

    Communication: updates none; the validation swap and ``on_train_end`` are collective
    over the EMA's mesh (every rank runs them); saving a checkpoint gathers the average to
    rank 0 (collective; peak extra memory on rank 0: one full CPU copy), except a sharded
    (``ModelParallelStrategy``) checkpoint, where every rank writes its own shards (no
    gather, no extra memory) and a resume reads them back (collective).
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        AveragedModel.check_kwargs(**kwargs)
        self._average_model: AveragedModel | None = None
        self._latest_update_step = 0
        self._latest_update_epoch = -1
        self._fitting = False
        self._pending: dict[str, Any] | None = None
        self._pending_sharded: tuple[str, int] | None = None
        self._swap = EvalSwap()

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Lightning's rule: after every optimizer step. Override to change it."""
        return step_idx is not None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's: for ``fit``, build the average here (calling ``configure_model``
        first, with Lightning's warning) when the strategy allows: the module already sits
        on the training device and no sharding strategy will replace its parameters. Else
        (GPU: the strategy moves the module after ``setup``; ``ModelParallelStrategy``/
        ``FSDPStrategy``: it shards it) the average is built at ``on_fit_start``.
        Collective where the build is (every rank runs ``setup``)."""
        self._fitting = stage == "fit"
        if not self._fitting or self._average_model is not None:
            return
        if isinstance(trainer.strategy, _SHARDING) or not _on_training_device(
            trainer, pl_module, self._device
        ):
            return
        if is_overridden("configure_model", pl_module):
            rank_zero_warn(
                "You're using the WeightAveraging callback with a model that overrides the "
                "configure_model callback. WeightAveraging doesn't support sharding model "
                "layers, so you may run out of memory."
            )
            pl_module.configure_model()
        # Before DDP broadcasts rank 0's weights: the ranks may differ, and the first
        # update copies the model anyway (on_fit_start re-reads it if nothing ran yet).
        self._build(pl_module, verify_replicas=False)

    def _build(self, pl_module: pl.LightningModule, **engine: Any) -> AveragedModel:
        self._average_model = AveragedModel(
            pl_module,
            device=self._device,
            use_buffers=self._use_buffers,
            **self._kwargs,
            **engine,
        )
        return self._average_model

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        average = self._average_model
        if average is None:
            average = self._build(pl_module)
        elif average.engine.updates == 0 and self._pending is None:
            if any(average.engine.engine.plan.trainable_changes()):
                # track="trainable" and a callback set up after this one froze some (e.g.
                # BaseFinetuning.freeze_before_training): nothing averaged yet, so choose
                # the tensors again instead of keeping the frozen ones' bytes.
                average.engine.close()
                average = self._build(pl_module)
            else:
                # Built in setup and nothing averaged or loaded yet: start from the weights
                # the strategy left (DDP broadcast rank 0's), as every later update reads.
                average.reset_to(pl_module)
        if self._pending is not None:
            average.load_state_dict(self._pending)
            self._pending = None
        if self._pending_sharded is not None:
            path, n_averaged = self._pending_sharded
            self._pending_sharded = None
            self._load_sharded(pl_module, path, n_averaged)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """With ``track="trainable"``: follow what an unfreezing callback changed at the
        start of the epoch before this step moves it, so a parameter unfrozen there starts
        from the value Lightning's own average holds for it (it never moved while frozen).
        Collective only when the set changed."""
        if self._average_model is not None:
            follow_trainable(self._average_model.engine, rank_zero_info)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            assert self._average_model is not None
            follow_trainable(self._average_model.engine, rank_zero_info)
            self._average_model.update_parameters(pl_module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            assert self._average_model is not None
            follow_trainable(self._average_model.engine, rank_zero_info)
            self._average_model.update_parameters(pl_module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._average_model is not None
        self._copy_average_to_current(pl_module)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._average_model is not None:
            self._swap_models(pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._average_model is not None:
            self._swap_models(pl_module)

    def _swap_models(self, pl_module: pl.LightningModule) -> None:
        """Lightning's hook, called at the start and at the end of every validation epoch:
        the first call swaps the average into ``pl_module``, the second swaps the raw
        weights back. Collective over the EMA's mesh on the way in (each rank rebuilds
        only its own local piece, :meth:`~dtensor_ema.ModelEMA.average_parameters`);
        peak extra memory: ``1/W`` of the parameters as the backup, plus one bucket."""
        assert self._average_model is not None
        if self._swap.active:
            self._swap.exit()
        else:
            self._swap.enter(self._average_model.engine)

    def _copy_average_to_current(self, pl_module: pl.LightningModule) -> None:
        """Lightning's hook at the end of training: the average stays in ``pl_module``.
        Collective over the EMA's mesh, as the swap."""
        assert self._average_model is not None
        copy_ema_into_model(self._average_model.engine, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._swap.exit()

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning's layout. Every rank runs this: the average is gathered to rank 0."""
        if self._average_model is None:
            return
        if self._swap.active:
            raise RuntimeError("a checkpoint is being saved while the average is swapped in")
        model_state = checkpoint.get("state_dict", {})
        if any(isinstance(v, DTensor) for v in model_state.values()):
            self._save_sharded(checkpoint, model_state)
            return
        self._average_model.gather_for_save()
        if not is_rank0():
            return  # only rank 0 writes the file
        average = self._average_model.state_dict()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k[7:]: v for k, v in average.items() if k.startswith("module.")}
        checkpoint["averaging_state"] = {
            k: v for k, v in average.items() if not k.startswith("module.")
        }

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._fitting:
            rank_zero_warn(
                "WeightAveraging: loading a checkpoint outside 'fit'; its state is not restored."
            )
        elif _is_sharded_marker(checkpoint.get("current_model_state")):
            path = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
            if path is None or not Path(path).is_dir():
                raise ValueError(
                    f"{type(self).__name__}: the checkpoint's weights are sharded (DCP) but the "
                    f"checkpoint path {path!r} is not a directory"
                )
            n_averaged = int(checkpoint["averaging_state"]["n_averaged"])
            if self._average_model is None:
                self._pending_sharded = (path, n_averaged)
            else:
                self._load_sharded(pl_module, path, n_averaged)
        elif "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            state = {"module." + k: v for k, v in checkpoint["state_dict"].items()}
            self._pending = state | checkpoint["averaging_state"]
            pl_module.load_state_dict(checkpoint["current_model_state"])
            if self._average_model is not None:
                self._average_model.load_state_dict(self._pending)
                self._pending = None
        else:
            rank_zero_warn(
                "The checkpoint was not created with WeightAveraging. Both the current and the "
                "average model will be initialized with state_dict."
            )

    def _save_sharded(self, checkpoint: dict[str, Any], model_state: dict[str, Any]) -> None:
        """Lightning's layout for a sharded (DCP) checkpoint, with no gather.

        ``ModelParallelStrategy`` writes only ``checkpoint["state_dict"]`` (and the
        optimizers) with DCP, every rank its own shards, and pickles the rest into
        ``meta.pt`` on rank 0. So ``state_dict`` gets the average keyed like the module (what
        Lightning's load puts into the module) plus the raw weights under
        ``current_model_state.<fqn>``; ``checkpoint["current_model_state"]`` names them.
        """
        assert self._average_model is not None
        ema = self._average_model.engine.state_dict()[EMA_TENSORS]
        clash = [k for k in model_state if k.startswith(CURRENT_PREFIX)]
        if clash:
            raise ValueError(f"the module's state_dict already has keys {clash[:3]}")
        tied = {id(model_state[k]): t for k, t in ema.items() if k in model_state}
        # A tied name shares its twin's EMA; integer buffers follow the model.
        average = {k: ema.get(k, tied.get(id(v), v)) for k, v in model_state.items()}
        raw = {CURRENT_PREFIX + k: v for k, v in model_state.items()}
        checkpoint["state_dict"] = average | raw
        checkpoint["current_model_state"] = {"format": "dcp", "prefix": CURRENT_PREFIX}
        checkpoint["averaging_state"] = {"n_averaged": self._average_model.n_averaged}

    def _load_sharded(self, pl_module: pl.LightningModule, path: str, n_averaged: int) -> None:
        """Read this rank's shards of the raw weights (into the module) and of the average
        (into the EMA) from the DCP checkpoint at ``path``. **Collective** (every rank).
        Peak extra memory: one copy of this rank's shards of the module and of the EMA.
        Runs no code from the checkpoint (:mod:`dtensor_ema.checkpoint.reader`): a ``.metadata``
        that is
        not DCP's raises ``CheckpointError``."""
        assert self._average_model is not None
        engine = self._average_model.engine
        ema_state = engine.state_dict()
        average = {k: torch.empty_like(v) for k, v in ema_state[EMA_TENSORS].items()}
        raw = {k: torch.empty_like(v) for k, v in pl_module.state_dict().items()}
        dest = {CURRENT_PREFIX + k: v for k, v in raw.items()} | average
        checkpoint = open_checkpoint(path)  # .metadata read safely: a crafted one raises
        try:
            checkpoint.load({"state_dict": dest}, group=group_of(None))
        except CheckpointError as e:
            raise ValueError(
                f"{type(self).__name__}: cannot read the average and the raw weights from "
                f"{path} (a different model, or a checkpoint without them): {e}"
            ) from e
        engine.load_state_dict(
            {EMA_TENSORS: average, UPDATES: n_averaged, CONFIG: ema_state[CONFIG]}
        )
        pl_module.load_state_dict(raw)


_SHARDING = (ModelParallelStrategy, FSDPStrategy)
"""Strategies that replace the module's parameters after ``setup`` (the average is built at
``on_fit_start``, over the sharded parameters)."""


def _on_training_device(
    trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device | int | None
) -> bool:
    """Whether the module already sits where it will train (and where ``device`` asks the
    average to live): the engine tracks the module's own tensors, which must not move."""
    root = trainer.strategy.root_device
    here = pl_module.device
    wanted = root if device is None else torch.device(device)
    return here == root and here == wanted


def _is_sharded_marker(value: Any) -> bool:
    return isinstance(value, dict) and value.get("format") == "dcp"


class EMAWeightAveraging(WeightAveraging):
    """Lightning's ``EMAWeightAveraging`` (``decay=0.999``, torch's ``get_ema_avg_fn``)."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay)
        )
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Lightning's rule for ``update_every_n_steps`` and the two start thresholds."""
        if step_idx is not None:
            start = self.update_starting_at_step
            if (start is None or step_idx >= start) and (
                self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0
            ):
                return True
        start_epoch = self.update_starting_at_epoch
        return epoch_idx is not None and start_epoch is not None and epoch_idx >= start_epoch
