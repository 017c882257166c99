"""timm's ``ModelEmaV3``/``ModelEmaV2`` over a sharded :class:`~dtensor_ema.ModelEMA`:
``from dtensor_ema.compat.timm import ModelEmaV3``.

Same constructor, attributes and verbs (``update(model, step=None)``, ``set``,
``get_decay``, ``forward``, ``.module``); every number comes from the engine: ``use_warmup``
is :class:`~dtensor_ema.WarmupDecay` with ``update_after_step``, without it
:class:`~dtensor_ema.ConstantDecay` with ``update_after_step + 1`` (timm copies the model on
the first step past it); ``update(model, step=s)`` sets the engine's counter to ``s - 1``
first, so a resumed run lands on the same curve. ``exclude_buffers`` is ``buffers="copy"``;
buffers are whole on every rank (each rank's are what timm's replica holds there, so
``timm.utils.distribute_bn`` gives timm's values). Construction does not check that the
ranks' weights agree (timm's ``train.py`` builds the EMA before DDP broadcasts): the first
``update(model, step=1)`` copies the model.

``.module`` has the model's structure; evaluation and the rank-0 save
(``unwrap_model(model_ema).state_dict()``) follow the drop-ins' shared rules
(:class:`~dtensor_ema.compat._replica.ReplicaFacade`): ``eval()`` or ``gather_for_save()``
gathers its parameters (**collective**: every rank validates, as timm's ``train.py`` does;
peak one full copy per rank, what timm's replica keeps always) until the next ``update()``
or ``set()``. ``evaluation="sharded"`` (and any FSDP2 model) evaluates through the engine's
FSDP2 module instead, whose ``state_dict()`` holds DTensors. The guide, with what differs
(a tied weight averaged once; no ``device=``, no bf16 stochastic rounding):
``docs/migration-timm.md``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from dtensor_ema.compat._replica import ReplicaFacade, fix_message, keeps_buffers_whole
from dtensor_ema.decay import ConstantDecay, WarmupDecay
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.options import check_int

__all__ = ["ModelEmaV2", "ModelEmaV3"]

_FIX = fix_message("model_ema", also="`model_ema.eval()`, as timm's validate() calls it")


class ModelEmaV3(ReplicaFacade):
    """timm ``ModelEmaV3`` with its EMA sharded across ranks (see the module docstring).

    Construction is **collective** over the default group when one is initialized (the
    engine's structure check: one small all-gather and one flag all-reduce; the replica
    check is off, since timm's first update copies the model): every rank must construct
    it. ``update``, ``set``, ``train()`` and the replica's forward never communicate;
    ``eval()``, ``materialize()`` and ``gather_for_save()`` all-gather the parameters once
    (collective over the default group; with ``evaluation="sharded"``, ``eval()`` gathers
    nothing, each forward is collective, and ``gather_for_save()`` gathers to rank 0).
    """

    _FORMULA: Literal["lerp", "weighted_sum"] = "lerp"  # timm's _foreach_lerp_
    ALWAYS_REGISTERED = True

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        foreach: bool = True,
        exclude_buffers: bool = False,
        *,
        evaluation: Literal["replica", "sharded"] = "replica",
    ) -> None:
        super().__init__()
        self.check_evaluation(evaluation)
        if device is not None and torch.device(device) != next(model.parameters()).device:
            raise NotImplementedError(
                f"device={device!r} (an EMA on another device than the model) is not "
                "supported by the sharded EMA: pass device=None"
            )
        if dtype in (torch.bfloat16, torch.float16):
            raise NotImplementedError(
                f"dtype={dtype}: timm's low-precision EMA (stochastic rounding) is not "
                "reproduced; keep dtype=None (float32 EMA for a bf16 model)"
            )
        if use_warmup:
            schedule: Any = WarmupDecay(
                decay=decay, gamma=warmup_gamma, power=warmup_power, min_decay=min_decay
            )
            after = update_after_step
        else:
            schedule, after = ConstantDecay(decay=decay), update_after_step + 1
        engine = ModelEMA(
            model,
            schedule=schedule,
            update_after_step=after,
            buffers="copy" if exclude_buffers else "average",
            ema_dtype=dtype,
            replicate_buffers=keeps_buffers_whole(model, evaluation),
            # timm's train.py builds the EMA before DDP with a per-rank seed; its first
            # update(model, step=1) copies the synchronized model, as timm's does.
            verify_replicas=False,
            formula=self._FORMULA,
        )
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_warmup, self.warmup_gamma, self.warmup_power = (
            use_warmup,
            warmup_gamma,
            warmup_power,
        )
        self.device, self.dtype, self.foreach = device, dtype, foreach
        self.stochastic_rounding = stochastic_rounding
        self.stochastic_rounding_seed = stochastic_rounding_seed
        self.exclude_buffers = exclude_buffers
        self.attach(engine, _FIX, evaluation)

    def get_decay(self, step: int | None = None) -> float:
        """timm's decay for ``step`` (``decay`` when ``step`` is None), from the engine."""
        if step is None:
            return self.decay
        return self._engine.get_decay(step)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        """One EMA step from ``model`` (``step``: timm's global step). Local, no collective.

        Raises:
            ValueError: ``step`` is not a positive int, or ``use_warmup`` without ``step``
                (timm then ignores the warmup; pass ``step``).
        """
        engine = self._engine
        if step is None:
            if self.use_warmup:
                raise ValueError(
                    "update(model) without step= and use_warmup=True: timm then skips the "
                    "warmup; pass step= (the global step) or use_warmup=False"
                )
            engine.updates = max(engine.updates, engine.options.update_after_step)
        else:
            engine.updates = check_int("step", step, 1) - 1
        self._change(lambda: engine.update(model))

    @torch.no_grad()
    def set(self, model: nn.Module) -> None:
        """Copy ``model`` into the EMA. Local."""
        self._change(lambda: self._engine.set(model))


class ModelEmaV2(ModelEmaV3):
    """timm ``ModelEmaV2(model, decay=0.9999, device=None)``: constant decay from the first
    ``update(model)``, buffers averaged, rounded as timm's ``decay * ema + (1 - decay) *
    model`` (the engine's ``formula="weighted_sum"``). Integer buffers follow the model
    (timm truncates their average)."""

    _FORMULA: Literal["lerp", "weighted_sum"] = "weighted_sum"

    def __init__(
        self, model: nn.Module, decay: float = 0.9999, device: torch.device | str | None = None
    ) -> None:
        super().__init__(model, decay=decay, device=device)

    def update(self, model: nn.Module, step: int | None = None) -> None:
        super().update(model)
