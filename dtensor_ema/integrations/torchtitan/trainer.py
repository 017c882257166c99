"""torchtitan's own ``Trainer``, with a sharded EMA stepped, checkpointed, validated, exported.

:class:`EMATrainer` is a subclass of torchtitan 0.3.0's ``Trainer`` with its own
``Config`` (an ``ema`` section: :class:`~dtensor_ema.integrations.torchtitan.TorchtitanEMA`
``.Config``, on by default). ``config.build()`` makes it, so ``torchtitan.train`` runs it
unchanged (see :mod:`dtensor_ema.integrations.torchtitan.config_registry`). After
torchtitan builds, parallelizes and initializes the model parts, it:

* builds one EMA per model part with ``mesh=None`` (the world torchtitan's
  ``ParallelDims`` built: FSDP2, HSDP, TP, EP, CP), or over the stage's own mesh (the world
  without ``pp``) with pipeline parallelism; every EMA element lives on exactly one rank;
* steps it in a post-hook of torchtitan's ``OptimizersContainer`` (after every
  ``optimizer.step()``, with the trainer's step; ``start_step`` and
  ``update_every_n_steps`` decide which steps average);
* saves and loads it through torchtitan's own ``CheckpointManager`` under the key ``ema``
  of its ``states`` (:class:`EMACheckpointManager`): DCP, so a checkpoint reshards to any
  other layout, ``async_mode`` included; a model-only load (``initial_load_model_only``,
  a seed checkpoint, HF weights) or a checkpoint without EMA re-copies the loaded model
  into the EMA; with ``last_save_model_only`` (torchtitan's default) the final checkpoint
  holds the model only, so the EMA is written beside it, in the same format, under
  ``step-N/ema/<name>``;
* evaluates through it in torchtitan's own validator (:class:`EMAValidator`): the EMA loss
  is logged under ``validation_metrics/ema_loss/<name>`` beside ``validation_metrics/loss``;
* exports it (or the raw weights) in Hugging Face format (:meth:`EMATrainer.export_hf`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer import MODEL, CheckpointManager
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.validate import Validator
from torchtitan.trainer import Trainer

from dtensor_ema._collectives import agree, group_of
from dtensor_ema.integrations.torchtitan.ema import TorchtitanEMA
from dtensor_ema.integrations.torchtitan.hf import check_to_hf_keys, export_hf
from dtensor_ema.reader import open_checkpoint

__all__ = ["EMA", "EMACheckpointManager", "EMATrainer", "EMAValidator", "stage_mesh", "with_ema"]

logger = logging.getLogger(__name__)

EMA = "ema"
"""The key of the EMA in the checkpoint manager's ``states`` (and so in the checkpoint)."""

EMA_LOSS = "validation_metrics/ema_loss"
"""Prefix of the validator's EMA metrics: ``validation_metrics/ema_loss/<name>``."""


class _Captured:
    """Stands in for the metrics processor while the validator runs: keeps the loss."""

    def __init__(self) -> None:
        self.ntokens_since_last_log = 0
        self.loss: float | None = None

    def log_validation(
        self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None
    ) -> None:
        self.loss = loss


class EMAValidator(Validator):
    """torchtitan's ``Validator``, run once with the raw weights and once through each EMA.

    The raw loss is logged as torchtitan does (``validation_metrics/loss``); each EMA's loss
    goes in the same log call under ``validation_metrics/ema_loss/<name>``, and into
    :attr:`last_losses`. Every pass reads the same validation batches (torchtitan rebuilds
    the validation dataloader per call). **Collective**: the validator's own collectives,
    plus the swap of :meth:`TorchtitanEMA.average_parameters` per EMA. Without an EMA
    (``ema`` is ``None`` or disabled) it is torchtitan's validator.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        """torchtitan's ``Validator.Config``: the same fields."""

    metrics_processor: Any

    def __init__(self, config: Validator.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.ema: TorchtitanEMA | None = None
        """The EMA to evaluate through (set by :class:`EMATrainer`)."""
        self.last_losses: dict[str, float] = {}
        """The last validation's losses: ``"raw"`` and one per EMA name."""

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        """torchtitan's validation of ``model_parts`` at ``step``, then the same through
        each EMA; one log call with all the losses. Collective (see the class). Peak extra
        memory: the swap's backup, ``1/W`` of the swapped weights per part. The raw weights
        come back after each EMA's pass, also when it raises."""
        ema = self.ema
        if ema is None or not ema.names:
            super().validate(model_parts, step)
            return
        metrics = self.metrics_processor
        losses: dict[str, float] = {}
        try:
            raw, tokens = self._captured(model_parts, step)
            for name in ema.names:
                with ema.average_parameters(name):
                    losses[name], _ = self._captured(model_parts, step)
        finally:
            self.metrics_processor = metrics
        metrics.ntokens_since_last_log += tokens
        extra = {f"{EMA_LOSS}/{name}": loss for name, loss in losses.items()}
        metrics.log_validation(loss=raw, step=step, extra_metrics=extra)
        logger.info(
            "validate step %d: EMA loss %s",
            step,
            "  ".join(f"{name} {loss:7.4f}" for name, loss in losses.items()),
        )
        self.last_losses = {"raw": raw, **losses}

    def _captured(self, model_parts: list[nn.Module], step: int) -> tuple[float, int]:
        captured = _Captured()
        self.metrics_processor = captured
        super().validate(model_parts, step)
        assert captured.loss is not None, "torchtitan's validator logged no loss"
        return captured.loss, captured.ntokens_since_last_log


class EMACheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` that keeps an EMA under ``states["ema"]``.

    Saving is torchtitan's (the EMA is one more ``Stateful``: sharded DTensors, async modes
    included). On top of it:

    * after a load that restored no EMA (model-only: ``initial_load_model_only``, the step-0
      seed checkpoint, HF weights; a checkpoint saved without EMA; ``ema`` in
      ``exclude_from_loading``), the EMA restarts from the loaded weights
      (:meth:`TorchtitanEMA.reset`);
    * with ``last_save_model_only`` (torchtitan's default), the final checkpoint holds the
      model only: each EMA is then written beside it the same way (DCP, or HF with
      ``last_save_in_hf``; ``export_dtype``) under ``<folder>/step-N/ema/<name>``, swapped
      into the model (collective, peak extra memory ``1/W`` of the weights).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config``: the same fields."""

    def attach_ema(self, ema: TorchtitanEMA) -> None:
        """Save and load ``ema`` under ``states["ema"]`` (nothing when disabled)."""
        if self.enable and ema.names:
            self.states[EMA] = ema

    def ema_checkpoint_id(self, step: int, name: str) -> str:
        """Where the final save writes EMA ``name`` when ``last_save_model_only``."""
        return os.path.join(self._create_checkpoint_id(step), EMA, name)

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """torchtitan's load of ``state_dict`` from ``checkpoint_id``; then, when it held no
        EMA (no ``ema`` entry asked for, HF weights, or none in the checkpoint's metadata:
        a warning), the EMA restarts from the loaded weights. Collective (DCP's load).

        Raises:
            CheckpointError: the checkpoint's ``.metadata`` would run code when unpickled
                (read by dtensor_ema's restricted reader before torchtitan's plain DCP).
        """
        ema = self.states.get(EMA)
        reseed = ema is not None and (from_hf or EMA not in state_dict)
        if ema is not None and not reseed and not _holds(checkpoint_id, EMA):
            logger.warning(
                "checkpoint %s holds no EMA: the EMA restarts from its model weights",
                checkpoint_id,
            )
            state_dict = {k: v for k, v in state_dict.items() if k != EMA}
            reseed = True
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if reseed:
            assert isinstance(ema, TorchtitanEMA)
            ema.reset()
            logger.info("EMA restarted from the weights loaded from %s", checkpoint_id)

    def _save_last_step(self, curr_step: int) -> None:
        super()._save_last_step(curr_step)
        ema = self.states.get(EMA)
        if ema is None or not self.last_save_model_only or curr_step == 0:
            return
        assert isinstance(ema, TorchtitanEMA)
        for name in ema.names:
            with ema.average_parameters(name):
                states = {
                    k: v.to(self.export_dtype)
                    if isinstance(v, torch.Tensor)
                    and v.is_floating_point()
                    and v.dtype != self.export_dtype
                    else v
                    for k, v in self.states[MODEL].state_dict().items()
                }
                if self.last_save_in_hf:
                    _check_keys(self.sd_adapter, states)
                checkpoint_id = self.ema_checkpoint_id(curr_step, name)
                self.dcp_save(
                    states,
                    checkpoint_id=checkpoint_id,
                    async_mode=AsyncMode.DISABLED,
                    enable_garbage_collection=True,
                    to_hf=self.last_save_in_hf,
                )
            logger.info("Saved EMA %s of step %d to %s", name, curr_step, checkpoint_id)


class EMATrainer(Trainer):
    """torchtitan's ``Trainer`` with a sharded EMA (see the module docstring).

    Build it from a config of
    :mod:`~dtensor_ema.integrations.torchtitan.config_registry` or :func:`with_ema`
    (``config.build()``); run ``train()`` as torchtitan does. ``self.ema`` is the
    :class:`~dtensor_ema.integrations.torchtitan.TorchtitanEMA`. Construction is
    collective (torchtitan's, then the EMA's over each part's mesh).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's ``Trainer.Config`` plus the ``ema`` section; ``validator`` and
        ``checkpoint`` take torchtitan's plain configs and become this module's
        subclasses of them."""

        ema: TorchtitanEMA.Config = field(default_factory=lambda: TorchtitanEMA.Config(enable=True))
        """The EMA (on by default: ``--ema.decays 0.999``, ``--ema.half_life_fractions``,
        ``--ema.start_step``, ``--ema.update_every_n_steps``, ``--ema.buffer_patterns``...;
        ``--ema.no_enable`` turns it off)."""
        validator: EMAValidator.Config = field(default_factory=EMAValidator.Config)
        checkpoint: EMACheckpointManager.Config = field(default_factory=EMACheckpointManager.Config)

        def __post_init__(self) -> None:
            self.validator = _retype(self.validator, EMAValidator.Config, "validator")
            self.checkpoint = _retype(self.checkpoint, EMACheckpointManager.Config, "checkpoint")
            Trainer.Config.__post_init__(self)

    config: Config
    ema: TorchtitanEMA
    checkpointer: EMACheckpointManager
    validator: EMAValidator

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.ema = TorchtitanEMA(
            config.ema, model_parts=self.model_parts, mesh=stage_mesh(self.parallel_dims)
        )
        if not self.ema.names:
            return
        self._ema_hook = self.optimizers.register_step_post_hook(self._step_ema)
        self.checkpointer.attach_ema(self.ema)
        if config.validator.enable:
            self.validator.ema = self.ema
        total = sum(ema.local_numel() for emas in self.ema.parts for ema in emas.values())
        logger.info(
            "EMA %s: %d elements on this rank (%d model part(s))",
            self.ema.names,
            total,
            len(self.ema.parts),
        )

    def _step_ema(self, *args: Any, **kwargs: Any) -> None:
        self.ema.step(self.step)

    def export_hf(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        raw: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Path | None:
        """Write EMA ``name`` (default: the first), or with ``raw=True`` the model's own
        weights, in Hugging Face format to ``path`` through the model spec's
        ``state_dict_adapter`` (:func:`~dtensor_ema.integrations.torchtitan.export_hf`).

        **Collective**: every rank calls it; the weights are gathered to rank 0, on the CPU,
        and rank 0 writes (returns the file; other ranks ``None``); then one flag
        all-reduce, so that a failed write raises on every rank, with rank 0's message.
        Peak extra memory on rank 0: one full copy of the weights in host memory, plus
        ``to_hf``'s copies; other ranks: one bucket (EMA) or one gathered tensor (``raw``)
        at a time.

        Raises:
            NotImplementedError: pipeline parallelism (each stage would hold part of the
                weights), or a model spec without ``state_dict_adapter``.
            ValueError: ``to_hf`` would drop keys (on every rank).
            OSError: rank 0 could not write ``path`` (on every rank).
        """
        if self.parallel_dims.pp_enabled:
            raise NotImplementedError(
                "export_hf with pipeline parallelism: each stage holds part of the weights; "
                "use checkpoint.last_save_model_only (the EMA is saved beside the final "
                "checkpoint) and convert that"
            )
        spec = self.config.model_spec
        assert spec is not None
        if spec.state_dict_adapter is None:
            raise NotImplementedError(f"model {spec.name} has no state_dict_adapter (no HF format)")
        adapter = spec.state_dict_adapter(self.model_config, self.config.hf_assets_path)
        if raw:
            state = _full_model_state(self.model_parts[0])
        else:
            state = self.ema.get_ema_state_dict(name, only_rank0_receives=True, cpu_offload=True)
        out = None
        error: Exception | None = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                out = export_hf(state, adapter, path, dtype=dtype)
            except Exception as e:  # the other ranks must not wait for rank 0 forever
                error = e
        del state
        agree(group_of(None), error, f"exporting to {path} in Hugging Face format")
        return out


def with_ema(
    config: Any, *, ema: TorchtitanEMA.Config | None = None, source: str = "the config"
) -> EMATrainer.Config:
    """torchtitan's plain ``Trainer.Config`` as an :class:`EMATrainer.Config` (the same
    values, shared, not copied), with ``ema`` (default: enabled, torchtitan's default
    half-life fraction 0.05).

    Raises:
        TypeError: ``config`` is not exactly torchtitan's ``Trainer.Config`` (flux's
            ``FluxTrainer.Config`` builds its own trainer, kimi's config subclass has
            checks of its own): naming the class.
    """
    if type(config) is not Trainer.Config:
        owner = getattr(type(config), "_owner", None)
        why = (
            f"it builds {owner.__module__}.{owner.__qualname__}"
            if owner is not None and owner is not Trainer
            else "a subclass of it with its own checks"
        )
        raise TypeError(
            f"{source} is a {type(config).__module__}.{type(config).__qualname__}, not "
            f"torchtitan's plain Trainer.Config ({why}): dtensor_ema's EMATrainer extends "
            "torchtitan's own Trainer only. For this model, build TorchtitanEMA in its "
            "trainer by hand (docs/trainers.md#torchtitan)"
        )
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    values["ema"] = TorchtitanEMA.Config(enable=True) if ema is None else ema
    return EMATrainer.Config(**values)


def stage_mesh(parallel_dims: Any) -> DeviceMesh | None:
    """The mesh an EMA of one model part spans: ``None`` (found from the parameters:
    torchtitan's whole world) without pipeline parallelism; with it, the stage's own mesh:
    the data/context/tensor-parallel dims of torchtitan's dense mesh, without ``pp``.
    Local (torchtitan built the meshes)."""
    if not parallel_dims.pp_enabled:
        return None
    if parallel_dims.spmd_backend in ("spmd_types", "full_dtensor"):
        axes = {
            "dp_replicate": parallel_dims.dp_replicate,
            "dp_shard": parallel_dims.dp_shard,
            "cp": parallel_dims.cp,
            "tp": parallel_dims.tp,
        }
        always = "dp_shard"  # kept with a real process group at size 1
    else:
        axes = {
            "dp_replicate": parallel_dims.dp_replicate,
            "fsdp": parallel_dims.dp_shard * parallel_dims.cp,
            "tp": parallel_dims.tp,
        }
        always = "fsdp"
    # Size-1 dims other than these run on torchtitan's "fake" backend: leave them out.
    names = [n for n, size in axes.items() if size > 1] or [always]
    mesh: DeviceMesh | None = parallel_dims.get_optional_mesh(names, include_singleton_axes=True)
    return mesh


def _retype(value: Any, cls: type, section: str) -> Any:
    """``value`` as ``cls`` (a subclass of its own class adding no fields)."""
    if isinstance(value, cls):
        return value
    base = cls.__mro__[1]
    if type(value) is not base:
        raise TypeError(
            f"{section} is a {type(value).__qualname__}; EMATrainer takes torchtitan's "
            f"{base.__qualname__} there (it becomes {cls.__qualname__})"
        )
    source: Any = value
    return cls(**{f.name: getattr(source, f.name) for f in fields(source) if f.init})


def _check_keys(sd_adapter: Any, states: dict[str, Any]) -> None:
    """:func:`check_to_hf_keys` before the final HF save: a lost key raises; an adapter
    whose ``from_hf`` cannot take this rank's part of the weights (a pipeline stage of a
    model with tied embeddings) only leaves the check undone, with a warning."""
    assert sd_adapter is not None
    try:
        check_to_hf_keys(sd_adapter, states)
    except ValueError:
        raise
    except Exception as error:
        logger.warning("could not check that to_hf keeps every EMA key: %r", error)


def _holds(checkpoint_id: str, key: str) -> bool:
    """Whether the DCP checkpoint at ``checkpoint_id`` has entries under ``key``, from its
    metadata read by :func:`dtensor_ema.reader.open_checkpoint` (no code run); ``True``
    where there is no local checkpoint folder to read (a remote path): the load decides.

    Raises:
        CheckpointError: ``.metadata`` would run code when unpickled, names a data file
            outside the folder, or leaves rows of a tensor uncovered (before torchtitan's
            plain DCP load reads it).
    """
    try:
        checkpoint = open_checkpoint(checkpoint_id)
    except FileNotFoundError:
        return True
    return key in checkpoint.top_level_keys()


def _full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` (its hooks applied, as torchtitan's checkpoints see it)
    as full CPU tensors on rank 0, empty elsewhere. Collective: one ``full_tensor()`` per
    DTensor, over its mesh, in the same order on every rank; a rank holds one gathered
    tensor at a time beyond what the model's hooks return. (torch's
    ``get_model_state_dict`` cannot: it looks the hook-made keys up as attributes.)"""
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[key] = full.detach().to("cpu", copy=True)
    return out
