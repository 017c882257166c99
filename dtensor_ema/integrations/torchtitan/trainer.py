"""torchtitan's own ``Trainer``, with a sharded EMA stepped, checkpointed, validated, exported.

:class:`EMATrainer` subclasses torchtitan 0.3.0's ``Trainer`` with an ``ema`` section in its
``Config`` (:class:`~dtensor_ema.integrations.torchtitan.TorchtitanEMA` ``.Config``), so
``torchtitan.train`` runs it unchanged (:mod:`dtensor_ema.integrations.torchtitan.
config_registry`). Once the model parts are built, it keeps one EMA per part (over
``ParallelDims``' world, or the stage's mesh with pipeline parallelism), steps it in a
post-hook of the ``OptimizersContainer``, saves and loads it through torchtitan's
``CheckpointManager`` under the key ``ema`` (:class:`EMACheckpointManager`: DCP, resharding,
model-only loads re-copy the model), evaluates through it in torchtitan's validator
(:class:`EMAValidator`: ``validation_metrics/ema_loss/<name>``) and exports it in Hugging
Face format (:meth:`EMATrainer.export_hf`). Importing it registers one parsing rule in
torchtitan's ``ConfigManager``: a ``list[float]`` flag (``--ema.decays``) takes one
comma-separated value, as its ``list[str]`` rule does (torchtitan has no ``list[float]``
field of its own). The guide: ``docs/trainers.md#torchtitan``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.checkpointer import MODEL, TRAIN_STATE, CheckpointManager
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.validate import Validator
from torchtitan.config.manager import custom_registry
from torchtitan.trainer import Trainer

from dtensor_ema._collectives import agree, group_of
from dtensor_ema.checkpoint.reader import Checkpoint, open_checkpoint
from dtensor_ema.integrations._common import is_rank0
from dtensor_ema.integrations.torchtitan.ema import TorchtitanEMA
from dtensor_ema.integrations.torchtitan.hf import (
    EXPORT_BUCKET_BYTES,
    check_to_hf_keys,
    stream_hf,
)
from dtensor_ema.integrations.torchtitan.resume import EMALoad, saved_emas

__all__ = ["EMA", "EMACheckpointManager", "EMATrainer", "EMAValidator", "stage_mesh", "with_ema"]

logger = logging.getLogger(__name__)

EMA = "ema"
"""The key of the EMA in the checkpoint manager's ``states`` (and so in the checkpoint)."""

EMA_LOSS = "validation_metrics/ema_loss"
"""Prefix of the validator's EMA metrics: ``validation_metrics/ema_loss/<name>``."""

THEIR_EMA = "ema_weights"
"""The field of torchtitan's development ``Trainer.Config`` that holds its own EMA
(``EMAOptimizersContainer``, checkpoint entry ``ema_optimizer``)."""


def _float_list_rule(type_info: Any) -> Any:
    """torchtitan's comma-separated list convention (its ``list_str_rule``) for
    ``list[float]``: one value, ``"0.999,0.9999"``; an empty value is the empty list."""
    if type_info.type != list[float]:
        return None
    import tyro

    def parse(args: list[str]) -> list[float]:
        items = [item.strip() for item in args[0].split(",")]
        try:
            return [float(item) for item in items if item]
        except ValueError:
            raise ValueError(
                f"expected comma-separated numbers such as 0.999,0.9999, got {args[0]!r}"
            ) from None

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="A,B,C,...",
        instance_from_str=parse,
        is_instance=lambda value: (
            isinstance(value, list) and all(isinstance(v, float | int) for v in value)
        ),
        str_from_instance=lambda value: [",".join(f"{v:g}" for v in value)],
    )


def _register_float_list_rule() -> None:
    """Add :func:`_float_list_rule` to torchtitan's ``ConfigManager`` registry; also to the
    copy ``python -m torchtitan.config.manager`` (torchtitan's config printer) runs as
    ``__main__``, which parses with its own registry."""
    registries = [custom_registry]
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.config.manager":
        registries.append(main.custom_registry)  # type: ignore[union-attr]
    for registry in registries:
        registry.primitive_rule(_float_list_rule)


_register_float_list_rule()  # once per process: the module runs once


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
      (:meth:`TorchtitanEMA.reset`); after one that restored it, rank 0 logs so once (from
      which step, each EMA's ``updates``);
    * the ``ema`` entry holds ``ema.<name>.{updates,config,ema.<fqn>}`` with the EMA's own
      parameter names (a fused ``wqkv`` stays fused, unlike the model entry's
      ``wq``/``wk``/``wv``); a load reads it through
      :class:`~dtensor_ema.integrations.torchtitan.resume.EMALoad`: into pipeline stages at
      any layout, with ``--ema.load_common_subset`` into another tracked set, and across
      the fused/unfused Q/K/V settings (converted bit for bit, logged);
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
        """torchtitan's load of ``state_dict`` from ``checkpoint_id``, the EMA entry read
        through :class:`~dtensor_ema.integrations.torchtitan.resume.EMALoad`: each pipeline
        stage's EMA reads its own tensors, at any layout; with ``ema.load_common_subset``
        only the tensors both sides hold; attention projections saved in the other Q/K/V
        layout (fused ``wqkv`` <-> ``wq``/``wk``/``wv``) are converted afterwards, bit for
        bit (logged on rank 0). When it held no EMA (no ``ema`` entry asked for, HF weights,
        or none in the checkpoint's metadata: a warning), the EMA restarts from the loaded
        weights; when it held one, rank 0 logs that the EMA was restored, from which step,
        with each EMA's ``updates``. Collective (DCP's load; the conversion's reads, one
        per bucket; one flag all-reduce before anything is read).

        Raises:
            ValueError: before anything is loaded (on every rank), when a projection saved
                in the other Q/K/V layout has a head layout this model does not tell
                (no ``head_dim``: the message names the way out, the model-only
                ``step-N/ema/<name>`` folder in torchtitan's keys).
            CheckpointError: the checkpoint's ``.metadata`` would run code when unpickled
                (read by dtensor_ema's restricted reader before torchtitan's plain DCP).
        """
        ema = self.states.get(EMA)
        reseed = ema is not None and (from_hf or EMA not in state_dict)
        load: EMALoad | None = None
        if ema is not None and not reseed:
            assert isinstance(ema, TorchtitanEMA)
            checkpoint = _local_checkpoint(checkpoint_id)
            if checkpoint is not None and not saved_emas(checkpoint):
                logger.warning(
                    "checkpoint %s holds no EMA: the EMA restarts from its model weights",
                    checkpoint_id,
                )
                state_dict = {k: v for k, v in state_dict.items() if k != EMA}
                reseed = True
            elif checkpoint is not None:
                error: Exception | None = None
                try:
                    load = EMALoad(ema, checkpoint, common_subset=ema.config.load_common_subset)
                except ValueError as e:
                    error = e
                agree(group_of(None), error, f"reading the EMA of {checkpoint_id}")
                assert load is not None
                state_dict = {**state_dict, EMA: load}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if ema is None:
            return
        assert isinstance(ema, TorchtitanEMA)
        if load is not None:
            load.convert(group_of(None))
        if reseed:
            ema.reset()
            logger.info("EMA restarted from the weights loaded from %s", checkpoint_id)
        elif is_rank0():
            trainer = self.states.get(TRAIN_STATE) if TRAIN_STATE in state_dict else None
            step = getattr(trainer, "step", None)
            logger.info(
                "EMA restored from %s (step %s): %s",
                checkpoint_id,
                "unknown" if step is None else step,
                ", ".join(f"{n} {ema.parts[0][n].updates} updates" for n in ema.names),
            )

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

    Raises:
        ValueError: the config also enables torchtitan's own EMA (``ema_weights.enable``,
            on torchtitan's development ``Trainer.Config``): refused before anything is
            built, naming the flag that turns either off.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's ``Trainer.Config`` plus the ``ema`` section; ``validator`` and
        ``checkpoint`` take torchtitan's plain configs and become this module's
        subclasses of them."""

        ema: TorchtitanEMA.Config = field(default_factory=lambda: TorchtitanEMA.Config(enable=True))
        """The sharded EMA, on by default: one EMA, ``hlf_0_05`` (``decay = 2 ** (-1 /
        (0.05 * num_updates))``, torchtitan's default). List flags take one
        comma-separated value, as torchtitan's own: ``--ema.decays 0.999,0.9999`` (one EMA
        per decay, in place of the half-life fractions), ``--ema.half_life_fractions
        0.05,0.1``, ``--ema.buffer_patterns "*.expert_bias_E"``; ``--ema.no-enable`` turns
        it off."""
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
        _refuse_two_emas(config)
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
        each = sum(emas[self.ema.names[0]].local_numel() for emas in self.ema.parts)
        count = len(self.ema.names)
        logger.info(
            "EMA %s: %d elements on this rank per EMA (%d in all over %d EMA%s; %d model part%s)",
            self.ema.names,
            each,
            each * count,
            count,
            "" if count == 1 else "s",
            len(self.ema.parts),
            "" if len(self.ema.parts) == 1 else "s",
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
        bucket_bytes: int = EXPORT_BUCKET_BYTES,
    ) -> Path | None:
        """Write EMA ``name`` (default: the first), or with ``raw=True`` the model's own
        weights, in Hugging Face format to ``path/model.safetensors`` through the model
        spec's ``state_dict_adapter``, streamed: no rank ever holds the whole model
        (:func:`~dtensor_ema.integrations.torchtitan.hf.stream_hf`, with one writer per
        pipeline stage; every rank calls it). Peak extra memory per rank: one bucket
        (``bucket_bytes`` of full tensors, or the largest tensor when larger) plus one
        tensor in flight.

        Returns:
            The written file on rank 0, ``None`` elsewhere.

        Raises:
            NotImplementedError: a model spec without ``state_dict_adapter``; see
                :func:`~dtensor_ema.integrations.torchtitan.hf.stream_hf` for the others.
        """
        spec = self.config.model_spec
        assert spec is not None
        if spec.state_dict_adapter is None:
            raise NotImplementedError(f"model {spec.name} has no state_dict_adapter (no HF format)")
        adapter = spec.state_dict_adapter(self.model_config, self.config.hf_assets_path)
        stage = stage_mesh(self.parallel_dims)
        return stream_hf(
            self.ema,
            self.model_parts,
            adapter,
            path,
            stage_ranks=None if stage is None else stage.mesh.flatten().tolist(),
            name=name,
            raw=raw,
            dtype=dtype,
            bucket_bytes=bucket_bytes,
        )


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
    out: EMATrainer.Config = _checked_copy(
        config, EMATrainer.Config, ema=TorchtitanEMA.Config(enable=True) if ema is None else ema
    )
    out.validator = _retype(out.validator, EMAValidator.Config, "validator")
    out.checkpoint = _retype(out.checkpoint, EMACheckpointManager.Config, "checkpoint")
    return out


def _refuse_two_emas(config: Any) -> None:
    """Refuse a config with both EMAs on: dtensor_ema's (``ema``) and torchtitan's own
    (``ema_weights``, on its development ``Trainer.Config``). Local, before anything is
    built.

    Raises:
        ValueError: both are enabled, saying which flag turns either off.
    """
    theirs = getattr(config, THEIR_EMA, None)
    if config.ema.enable and getattr(theirs, "enable", False):
        raise ValueError(
            f"two EMAs are enabled: torchtitan's own ({THEIR_EMA}.enable: a replicated copy "
            "of every trainable parameter, checkpoint entry 'ema_optimizer') and "
            "dtensor_ema's (ema.enable, on by default with --module "
            "dtensor_ema.integrations.torchtitan: 1/W of the weights per rank); two EMAs "
            f"by accident double the EMA memory. Turn one off: --{THEIR_EMA}.no-enable "
            "keeps dtensor_ema's, --ema.no-enable keeps torchtitan's"
        )


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
    return _checked_copy(value, cls)


def _checked_copy(source: Any, cls: type[Any], **values: Any) -> Any:
    """A ``cls`` holding ``source``'s field values (shared, not copied), then ``values``,
    built without running ``__post_init__`` again: ``source``'s own checks ran when it was
    built, and running them twice would repeat torchtitan's warnings."""
    out = object.__new__(cls)
    for f in fields(source):
        setattr(out, f.name, getattr(source, f.name))
    for name, value in values.items():
        setattr(out, name, value)
    return out


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


def _local_checkpoint(checkpoint_id: str) -> Checkpoint | None:
    """The DCP checkpoint at ``checkpoint_id`` read by
    :func:`dtensor_ema.checkpoint.reader.open_checkpoint` (no code run); ``None`` where there is no
    local checkpoint folder to read (a remote path): the load decides.

    Raises:
        CheckpointError: ``.metadata`` would run code when unpickled, names a data file
            outside the folder, or leaves rows of a tensor uncovered (before torchtitan's
            plain DCP load reads it).
    """
    try:
        return open_checkpoint(checkpoint_id)
    except FileNotFoundError:
        return None


def _saved_ema(checkpoint_id: str) -> dict[str, set[str]] | None:
    """The EMAs of the DCP checkpoint at ``checkpoint_id`` (``name -> fqns`` of its ``ema``
    entry; ``{}`` when it has none); ``None`` where there is no local checkpoint folder.
    Raises as :func:`_local_checkpoint`."""
    checkpoint = _local_checkpoint(checkpoint_id)
    return None if checkpoint is None else saved_emas(checkpoint)
