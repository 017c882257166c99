"""A Lightning ``Callback`` that keeps a sharded EMA of the ``LightningModule``'s weights::

    trainer = Trainer(..., callbacks=[EMACallback(decay=0.9999)])

Every rank runs every hook. ``on_fit_start`` builds a :class:`~dtensor_ema.ModelEMA` once
the strategy has set the module up (DDP, FSDP2 through ``ModelParallelStrategy``, DeepSpeed
ZeRO: at stage 3 each rank averages its own partitions), each rank holding ``1/W`` of it;
``on_train_batch_end`` updates it after every ``update_every_n_steps``-th optimizer step
(local), following the trainable set first with ``track="trainable"``; validation and test
run with the EMA swapped in (``evaluate_with_ema``); checkpoints carry it
(:meth:`EMACallback.on_save_checkpoint`) and ``ckpt_path`` resumes it exactly;
``copy_to_model_on_train_end`` leaves the final EMA in the module. Requires ``lightning``.
The guide: ``docs/trainers.md#lightning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_ema._collectives import group_gather_rows, group_of
from dtensor_ema.checkpoint.reader import CheckpointError, open_checkpoint
from dtensor_ema.flat_chunks import FlatChunks
from dtensor_ema.integrations._common import (
    EvalSwap,
    StepGate,
    check_ema_options,
    copy_ema_into_model,
    follow_trainable,
    full_ema_tensors,
)
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.state import CONFIG, EMA_TENSORS, UPDATES, wrapped_like

__all__ = ["EMA_KEY_PREFIX", "EMACallback"]

EMA_KEY_PREFIX = "_dtensor_ema."
"""Prefix of the EMA tensors' keys inside a sharded checkpoint's ``state_dict`` entry."""

_STATE_VERSION = 1
_UNSUPPORTED_STRATEGIES = {
    "FSDPStrategy": "FSDP1 flattens parameters; use ModelParallelStrategy with fully_shard "
    "(FSDP2) in configure_model()",
}

MeshSpec = DeviceMesh | Callable[["pl.Trainer"], DeviceMesh | None] | None


class EMACallback(Callback):
    """Sharded EMA of the module's weights, updated after optimizer steps, used for
    validation/test, and saved in Lightning checkpoints.

    Args:
        name: identifies this callback's state in checkpoints; give each ``EMACallback``
            of a trainer its own name (several EMAs with different decays).
        update_every_n_steps: call ``ema.update()`` after every ``N``-th optimizer step
            only (as Lightning's ``EMAWeightAveraging``: the decay applies per call). For
            an EMA whose memory in *steps* does not depend on ``N``, pass ModelEMA's
            ``update_every=N`` instead (the call is then made every step and is free on
            skipped ones).
        start_step: no update during the first ``start_step`` optimizer steps; the EMA
            restarts from the model's weights at its first update.
        start_epoch: no update before epoch ``start_epoch`` (0-based); same restart.
        evaluate_with_ema: run ``validate`` and ``test`` (including the validation inside
            ``fit`` and the sanity check) with the EMA weights swapped in. Before the EMA
            has started (``start_step``/``start_epoch``) the module's own weights are used.
        copy_to_model_on_train_end: at ``on_train_end`` leave the EMA weights in the module
            (the training weights are then gone from it; the last checkpoint keeps them).
        mesh: passed to ``ModelEMA``: ``None`` (the whole default process group), a
            ``DeviceMesh``, or a function ``trainer -> mesh`` called once the strategy is
            set up (e.g. ``lambda t: t.strategy.device_mesh``).
        **ema_options: any :class:`~dtensor_ema.ModelEMA` keyword (``decay``, ``tau``, ...),
            checked here.

    Raises:
        TypeError: an unknown ``ModelEMA`` keyword.
        ValueError: a value out of range (``update_every_n_steps=0``, ``decay=2``, ...).

    Communication: ``update()`` none; the swap for evaluation is collective for replicated
    (DDP, DeepSpeed ZeRO 0-2) tensors, free for FSDP2 parameters and, under ZeRO-3, free for
    the partitions plus bucketed all-gathers of the parameters DeepSpeed holds whole; saving
    a DDP or ZeRO 0-2 checkpoint gathers the EMA (one ``full_tensor()`` per EMA tensor, on
    every rank), a ZeRO-3 one gathers nothing (each rank saves its own pieces), and under
    ``DeepSpeedStrategy`` the ranks first all-gather one flag over the world group; loading
    is local for DDP and DeepSpeed checkpoints and DCP's collectives for sharded ones.
    """

    def __init__(
        self,
        *,
        name: str = "ema",
        update_every_n_steps: int = 1,
        start_step: int = 0,
        start_epoch: int = 0,
        evaluate_with_ema: bool = True,
        copy_to_model_on_train_end: bool = False,
        mesh: MeshSpec = None,
        **ema_options: Any,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        for flag, value in (
            ("evaluate_with_ema", evaluate_with_ema),
            ("copy_to_model_on_train_end", copy_to_model_on_train_end),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        if mesh is not None and not (isinstance(mesh, DeviceMesh) or callable(mesh)):
            raise TypeError(
                f"mesh must be None, a DeviceMesh or a function trainer -> mesh, got "
                f"{type(mesh).__name__}"
            )
        check_ema_options(ema_options)
        self.name = name
        self.gate = StepGate(update_every_n_steps, start_step, start_epoch)
        self.evaluate_with_ema = evaluate_with_ema
        self.copy_to_model_on_train_end = copy_to_model_on_train_end
        self.ema_options = ema_options
        self._mesh = mesh
        self._ema: ModelEMA | None = None
        self._module: torch.nn.Module | None = None
        self._swap = EvalSwap()
        self._last_step = 0
        self._started = False
        self._pending: dict[str, Any] | None = None
        self._ckpt_path: str | None = None
        self._warned_no_ema = False

    # ------------------------------------------------------------------ public
    @property
    def ema(self) -> ModelEMA:
        """The :class:`~dtensor_ema.ModelEMA` (exists from ``on_fit_start`` on)."""
        if self._ema is None:
            raise RuntimeError(
                f"{type(self).__name__}({self.name!r}) has no EMA yet: it is created when "
                "trainer.fit() starts (or when validate/test loads one from ckpt_path)"
            )
        return self._ema

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self.name}]"

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse configurations that cannot work, on every rank, before anything runs."""
        strategy = type(trainer.strategy).__name__
        if strategy in _UNSUPPORTED_STRATEGIES:
            raise ValueError(
                f"EMACallback does not support {strategy}: {_UNSUPPORTED_STRATEGIES[strategy]}"
            )
        # Lightning itself refuses two callbacks with one state_key (the same name=).
        ours = [cb for cb in trainer.callbacks if isinstance(cb, EMACallback)]  # type: ignore[attr-defined]
        evaluating = [cb.name for cb in ours if cb.evaluate_with_ema]
        if len(evaluating) > 1:
            raise ValueError(
                f"EMACallbacks {evaluating} all have evaluate_with_ema=True: only one EMA can "
                "be swapped into the module at a time; set evaluate_with_ema=False on the others"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure_ema(trainer, pl_module)

    def _ensure_ema(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ema is not None:
            if self._module is not pl_module:
                raise ValueError(
                    f"EMACallback({self.name!r}) tracks another LightningModule "
                    f"({type(self._module).__name__} at {id(self._module):#x}); use a new "
                    "EMACallback for a new module"
                )
            self._apply_pending()
            return
        mesh = self._mesh(trainer) if callable(self._mesh) else self._mesh
        self._ema = ModelEMA(pl_module, mesh=mesh, **self.ema_options)
        self._module = pl_module
        self._started = not self.gate.delayed
        self._apply_pending()

    # ------------------------------------------------------------------ training
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """With ``track="trainable"``: follow what an unfreezing callback changed at the
        start of the epoch, before this step moves it (collective only when it changed)."""
        if self._ema is not None:
            follow_trainable(self._ema, rank_zero_info)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Update after an optimizer step (not after accumulation-only batches)."""
        step = trainer.global_step
        if step <= self._last_step:
            return
        self._last_step = step
        if not self.gate.should_update(step, trainer.current_epoch):
            return
        ema = self.ema
        follow_trainable(ema, rank_zero_info)
        if not self._started:
            ema.set()  # a delayed start averages from the weights at the start, not at init
            self._started = True
        ema.update()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.copy_to_model_on_train_end and self._ema is not None and self._started:
            copy_ema_into_model(self._ema, pl_module)

    # ------------------------------------------------------------------ evaluation
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap.exit()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap.exit()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._swap.exit()  # never leave the EMA weights in the module

    def _swap_in(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.evaluate_with_ema:
            return
        if self._ema is None and self._pending is not None:
            self._ensure_ema(trainer, pl_module)  # validate/test(ckpt_path=...) without fit
        if self._ema is None:
            if not self._warned_no_ema:
                self._warned_no_ema = True
                warnings.warn(
                    f"EMACallback({self.name!r}): no EMA to evaluate with (none trained in this "
                    "process and none in the checkpoint); evaluating the module's own weights",
                    stacklevel=2,
                )
            return
        self._ensure_ema(trainer, pl_module)
        if self._started:
            self._swap.enter(self._ema)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Counter, options and step bookkeeping (local). The tensors are added by
        :meth:`on_save_checkpoint`, which sees the checkpoint."""
        if self._ema is None:
            return {}
        ema_state = self._ema.state_dict()
        return {
            "version": _STATE_VERSION,
            UPDATES: ema_state[UPDATES],
            CONFIG: ema_state[CONFIG],
            "last_step": self._last_step,
            "started": self._started,
        }

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Put the EMA tensors into the checkpoint. Every rank runs this.

        A sharded (``ModelParallelStrategy``) checkpoint gets each rank's EMA shards under
        ``_dtensor_ema.<fqn>`` in its ``state_dict``, a DeepSpeed ZeRO-3 one each rank's own
        EMA pieces in that rank's file (resumed at the same world size and stage): nothing
        gathered. Otherwise (DDP, one device, ZeRO 0-2) the EMA is gathered into full CPU
        tensors in its own dtype (**collective**), kept on rank 0. Under
        ``DeepSpeedStrategy`` the ranks first all-gather one flag over the world group (ZeRO++
        hpZ and MiCS raise on every rank). The layouts: ``docs/trainers.md#checkpoints`` and
        ``docs/trainers.md#deepspeed``.
        """
        if self._ema is None:
            return
        if self._swap.active:
            raise RuntimeError(
                f"EMACallback({self.name!r}): a checkpoint is being saved while the EMA "
                "weights are swapped into the module, so it would store them as the training "
                "weights; save outside validation/test (ModelCheckpoint does)"
            )
        state = checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {})
        model_state = checkpoint.get("state_dict", {})
        if any(isinstance(v, DTensor) for v in model_state.values()):
            for fqn, tensor in self._ema.state_dict()[EMA_TENSORS].items():
                key = EMA_KEY_PREFIX + fqn
                if key in model_state:
                    raise ValueError(f"the module's state_dict already has a key {key!r}")
                model_state[key] = tensor
            state["format"] = "dcp"
        elif _every_rank_writes(trainer):
            state["format"] = "rank"
            state["rank"] = (dist.get_rank(), dist.get_world_size())
            state[EMA_TENSORS] = _own_pieces(self._ema)
        else:
            state["format"] = "full"
            state[EMA_TENSORS] = full_ema_tensors(self._ema)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._ckpt_path = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        if self.state_key not in checkpoint.get("callbacks", {}):
            warnings.warn(
                f"EMACallback({self.name!r}): the checkpoint has no state for this callback "
                f"(its callbacks: {sorted(checkpoint.get('callbacks', {}))}); the EMA starts "
                "from the restored weights",
                stacklevel=2,
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved state; it is applied as soon as the EMA exists (right away under
        ``ModelParallelStrategy``, which restores after setup; at ``on_fit_start`` for DDP,
        which restores before the module is wrapped)."""
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"EMACallback({self.name!r}): checkpoint state version "
                f"{state_dict.get('version')!r}, expected {_STATE_VERSION}"
            )
        self._pending = dict(state_dict)
        if self._ema is not None:
            self._apply_pending()

    def _apply_pending(self) -> None:
        state, self._pending = self._pending, None
        if state is None:
            return
        ema = self.ema
        saved = {UPDATES: state[UPDATES], CONFIG: state[CONFIG]}
        if state.get("format") == "dcp":
            saved[EMA_TENSORS] = self._read_sharded(ema)
        elif state.get("format") == "full":
            saved[EMA_TENSORS] = state[EMA_TENSORS]
        elif state.get("format") == "rank":
            saved[EMA_TENSORS] = self._own_pieces_back(ema, state)
        else:
            raise ValueError(
                f"EMACallback({self.name!r}): checkpoint has EMA format "
                f"{state.get('format')!r}, expected 'full', 'rank' or 'dcp'"
            )
        ema.load_state_dict(saved)  # refuses other options/names/shapes before writing
        self._last_step = int(state["last_step"])
        self._started = bool(state["started"])

    def _own_pieces_back(self, ema: ModelEMA, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The ``"rank"`` format's plain pieces as values ``ModelEMA.load_state_dict`` takes
        (each wrapped like the live EMA tensor it belongs to), once the checkpoint is known
        to be this rank's own. Local."""
        here = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        saved_by = tuple(state.get("rank", ()))
        if saved_by != here:
            raise ValueError(
                f"EMACallback({self.name!r}): this checkpoint file holds the EMA pieces of rank "
                f"{saved_by[0] if saved_by else '?'} of {saved_by[1] if saved_by else '?'} "
                f"(DeepSpeed ZeRO-3 writes one per rank), but it is loaded on rank {here[0]} of "
                f"{here[1]}; resume at the world size it was saved at, as DeepSpeed's ZeRO-3 "
                "checkpoint itself requires"
            )
        live = ema.state_dict()[EMA_TENSORS]
        pieces = state[EMA_TENSORS]
        return {
            fqn: _like(live[fqn], piece) if fqn in live else piece for fqn, piece in pieces.items()
        }

    def _read_sharded(self, ema: ModelEMA) -> dict[str, torch.Tensor]:
        """This rank's EMA shards from the DCP checkpoint being restored (collective). Runs
        no code from the checkpoint: a ``.metadata`` that is not DCP's raises
        ``CheckpointError`` (:mod:`dtensor_ema.checkpoint.reader`)."""
        if self._ckpt_path is None or not Path(self._ckpt_path).is_dir():
            raise ValueError(
                f"EMACallback({self.name!r}): the checkpoint's EMA is sharded (DCP) but the "
                f"checkpoint path {self._ckpt_path!r} is not a directory"
            )
        fresh = {fqn: torch.empty_like(t) for fqn, t in ema.state_dict()[EMA_TENSORS].items()}
        checkpoint = open_checkpoint(self._ckpt_path)  # .metadata read safely
        try:
            checkpoint.load(
                {"state_dict": {EMA_KEY_PREFIX + k: v for k, v in fresh.items()}},
                group=group_of(None),
            )
        except CheckpointError as e:
            raise ValueError(
                f"EMACallback({self.name!r}): cannot read the EMA shards from "
                f"{self._ckpt_path} (a different model, or a checkpoint without them): {e}"
            ) from e
        return fresh


def _every_rank_writes(trainer: pl.Trainer) -> bool:
    """Whether every rank writes its own copy of the callbacks' state (DeepSpeed ZeRO-3,
    whose engine saves its client state on every rank: ``save_non_zero_checkpoint``), as
    opposed to rank 0 alone (every other strategy). **Collective** under
    ``DeepSpeedStrategy`` with several ranks (one all-gather of a flag over the world
    group); local otherwise.

    Raises:
        ValueError: (on every rank) DeepSpeed writes the state on some ranks other than
            rank 0 but not on all of them.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = trainer.strategy
    group = group_of(None)
    if not isinstance(strategy, DeepSpeedStrategy) or group is None:
        return False
    writes = bool(getattr(strategy.deepspeed_engine, "save_non_zero_checkpoint", False))
    writers = [rank for rank, flag in group_gather_rows(group, [int(writes)]) if flag]
    if writers == [0]:
        return False
    if len(writers) == dist.get_world_size(group):
        return True
    raise ValueError(
        f"EMACallback: DeepSpeed writes the callbacks' state on ranks {writers} only (ZeRO++ "
        "hpZ or MiCS?), so neither the full EMA on rank 0 nor each rank's own pieces would "
        "come back on every rank; use plain ZeRO stage 3 (no hpZ/MiCS) or stages 0-2"
    )


def _own_pieces(ema: ModelEMA) -> dict[str, torch.Tensor]:
    """This rank's pieces of the EMA as plain CPU tensors, copies (a DTensor's local shard,
    a ZeRO-3 flat range's values): DeepSpeed reads its checkpoint files with a callable
    ``map_location``, with which ``torch.load`` cannot rebuild a tensor subclass. Local."""
    out = {}
    for fqn, value in ema.state_dict()[EMA_TENSORS].items():
        if isinstance(value, DTensor):
            value = value.to_local()
        elif isinstance(value, FlatChunks):
            value = value.local
        out[fqn] = value.detach().to("cpu", copy=True)
    return out


def _like(live: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (plain, from :func:`_own_pieces`) wrapped as ``live`` is: a DTensor on its
    mesh and placements, or a ZeRO-3 flat range at its offset; shapes are checked by
    ``ModelEMA.load_state_dict``. Local."""
    if isinstance(live, DTensor):
        return wrapped_like(live, piece.to(live.to_local().device))
    if isinstance(live, FlatChunks):
        return wrapped_like(live, piece.to(live.local.device))
    return piece
