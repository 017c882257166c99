"""Decay schedules: how much of the old average survives an update.

Every schedule maps ``step`` (the number of ``update()`` calls since averaging began, 1 on
the first averaging call) to a **per-step** decay ``d(step)`` in ``[0, 1]``, computed as a
Python float from the counter alone: every rank computes the same number without
communicating, and a resumed run that restores the counter continues on the same curve.

With ``update_every=N`` an averaging update stands for ``N`` steps, so it applies
:meth:`DecaySchedule.decay_for` = ``d(step) ** N`` (exactly ``d(step)`` for ``N = 1``):
the EMA's memory measured in *steps* does not depend on ``N``. :class:`HalfLifeDecay`
computes ``0.5 ** (N / half_life)`` directly instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CallableDecay",
    "ConstantDecay",
    "DecaySchedule",
    "DiffusersDecay",
    "EmaPytorchDecay",
    "HalfLifeDecay",
    "RampDecay",
    "RunningMeanDecay",
    "WarmupDecay",
]


@runtime_checkable
class DecaySchedule(Protocol):
    """What :class:`~dtensor_ema.ModelEMA` needs from a schedule."""

    def __call__(self, step: int) -> float:
        """Per-step decay of averaging step ``step`` (``>= 1``)."""
        ...

    def decay_for(self, step: int, update_every: int) -> float:
        """Decay applied by one averaging update that stands for ``update_every`` steps."""
        ...

    def config(self) -> dict[str, Any]:
        """Plain values identifying the schedule in a checkpoint."""
        ...

    def decay_tensor_for(self, step: torch.Tensor, update_every: int) -> torch.Tensor:
        """:meth:`decay_for` on a float64 tensor ``step``, with no host synchronization."""
        ...


def _check_number(name: str, value: object, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        interval = f"in [{low:g}, {high:g}]" if high != math.inf else f">= {low:g}"
        raise ValueError(f"{name} must be {interval}, got {value}")


class _PowerForEvery:
    __slots__ = ()

    def decay_for(self, step: int, update_every: int) -> float:
        decay = self(step)  # type: ignore[operator]
        return decay if update_every == 1 else decay**update_every

    def decay_tensor_for(self, step: torch.Tensor, update_every: int) -> torch.Tensor:
        decay = self._decay_tensor(step)
        return decay if update_every == 1 else decay**update_every

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class RampDecay(_PowerForEvery):
    """yolov5/ultralytics ramp: ``d(step) = decay * (1 - exp(-step / tau))``.

    Early updates use a small decay so the average forgets the random initialization
    quickly; after a few ``tau`` steps ``d`` approaches ``decay``. ``tau=None`` or ``0``
    means a constant ``d = decay``. The default schedule of :class:`~dtensor_ema.ModelEMA`.
    """

    decay: float = 0.9999
    """Asymptotic decay, in ``[0, 1]``. ``1`` freezes the EMA, ``0`` copies the model."""
    tau: float | None = 2000
    """Ramp time constant in steps, ``>= 0``; ``None`` or ``0`` disables the ramp."""

    def __post_init__(self) -> None:
        _check_number("decay", self.decay, 0.0, 1.0)
        if self.tau is not None:
            _check_number("tau", self.tau, 0.0)

    def __call__(self, step: int) -> float:
        if not self.tau:
            return float(self.decay)
        return self.decay * (1.0 - math.exp(-step / self.tau))

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        if not self.tau:
            return torch.full_like(step, float(self.decay))
        return self.decay * (1.0 - torch.exp(-step / self.tau))

    def config(self) -> dict[str, Any]:
        return {"schedule": "ramp", "decay": float(self.decay), "tau": self.tau}


@dataclass(frozen=True, kw_only=True, slots=True)
class ConstantDecay(_PowerForEvery):
    """``d(step) = decay`` from the first step on (timm ``ModelEmaV2``, torch ``AveragedModel``)."""

    decay: float = 0.9999
    """The decay, in ``[0, 1]``."""

    def __post_init__(self) -> None:
        _check_number("decay", self.decay, 0.0, 1.0)

    def __call__(self, step: int) -> float:
        return float(self.decay)

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        return torch.full_like(step, float(self.decay))

    def config(self) -> dict[str, Any]:
        return {"schedule": "constant", "decay": float(self.decay)}


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupDecay(_PowerForEvery):
    """timm ``ModelEmaV3`` / ema-pytorch warmup:
    ``d = clamp(1 - (1 + s / gamma) ** -power, min_decay, decay)`` with ``s = step - 1``,
    and ``d = 0`` (copy the model) at ``s = 0``.

    With ``update_after_step=K`` on the EMA, ``step`` counts from ``K``, which reproduces
    timm's ``max(0, step - update_after_step - 1)``. ``power=2/3`` suits long runs (half
    the weight from the last ~10% of steps), ``3/4`` shorter ones.
    """

    decay: float = 0.9999
    """Upper clamp, in ``[0, 1]``."""
    gamma: float = 1.0
    """Warmup scale (ema-pytorch ``inv_gamma``), ``> 0``."""
    power: float = 2 / 3
    """Warmup exponent, ``> 0``."""
    min_decay: float = 0.0
    """Lower clamp, in ``[0, decay]``."""

    def __post_init__(self) -> None:
        _check_warmup(self.decay, self.gamma, self.power, self.min_decay, self.decay)

    def __call__(self, step: int) -> float:
        s = step - 1
        if s <= 0:
            return 0.0
        value = 1.0 - (1.0 + s / self.gamma) ** -self.power
        return max(min(value, self.decay), self.min_decay)

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        s = (step - 1).clamp(min=0)
        value = 1.0 - (1.0 + s / self.gamma) ** -self.power
        value = value.clamp(max=self.decay).clamp(min=self.min_decay)
        return torch.where(s <= 0, torch.zeros_like(value), value)

    def config(self) -> dict[str, Any]:
        return _warmup_config("warmup", self)


@dataclass(frozen=True, kw_only=True, slots=True)
class HalfLifeDecay:
    """Constant decay given as a half-life: after ``half_life`` steps a past value's weight
    has halved. One averaging update of ``N`` steps uses ``0.5 ** (N / half_life)``."""

    half_life: float
    """Half-life in steps (``update()`` calls), ``> 0``."""

    def __post_init__(self) -> None:
        _check_number("half_life", self.half_life, 0.0)
        if self.half_life == 0:
            raise ValueError(f"half_life must be > 0, got {self.half_life}")

    def __call__(self, step: int) -> float:
        return 0.5 ** (1 / self.half_life)

    def decay_for(self, step: int, update_every: int) -> float:
        return 0.5 ** (update_every / self.half_life)

    def decay_tensor_for(self, step: torch.Tensor, update_every: int) -> torch.Tensor:
        return torch.full_like(step, 0.5 ** (update_every / self.half_life))

    def config(self) -> dict[str, Any]:
        return {"schedule": "half_life", "half_life": float(self.half_life)}


@dataclass(frozen=True, slots=True)
class CallableDecay(_PowerForEvery):
    """A user function ``step -> decay``; its result is checked to lie in ``[0, 1]``."""

    fn: Callable[[int], float]
    """Called with the step (``>= 1``); must return a float in ``[0, 1]``."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"decay schedule must be callable, got {self.fn!r}")

    def __call__(self, step: int) -> float:
        value = self.fn(step)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"decay function returned {value!r} for step {step}; expected a float")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"decay function returned {value} for step {step}; expected [0, 1]")
        return float(value)

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        """The function is called with a tensor ``step``: for ``capturable`` updates it must
        use torch ops only (a Python float result would need a host sync)."""
        value = self.fn(step)  # type: ignore[arg-type]
        return torch.as_tensor(value, dtype=step.dtype, device=step.device)

    def config(self) -> dict[str, Any]:
        name = getattr(self.fn, "__qualname__", type(self.fn).__qualname__)
        return {"schedule": "callable", "name": f"{getattr(self.fn, '__module__', '')}.{name}"}


@dataclass(frozen=True, kw_only=True, slots=True)
class EmaPytorchDecay:
    """ema-pytorch ``EMA``'s warmup, rounded as ema-pytorch computes it: in float32 torch
    ops on CPU, ``d = clamp(1 - (1 + s / gamma) ** -power, min_decay, decay)`` with
    ``s = step - 1`` and ``d = 0`` (copy) at ``s <= 0``; ``decay == 1`` freezes the EMA
    (``d = 1``) after the copies, as ema-pytorch's ``is_frozen`` does.

    Unlike the other schedules, an averaging update that stands for ``update_every`` steps
    applies ``d(step)`` itself, not ``d(step) ** update_every``: ema-pytorch's
    ``update_every`` skips steps without compensating the decay.
    """

    decay: float = 0.9999
    """Upper clamp (ema-pytorch ``beta``), in ``[0, 1]``."""
    gamma: float = 1.0
    """Warmup scale (``inv_gamma``), ``> 0``."""
    power: float = 2 / 3
    """Warmup exponent, ``> 0``."""
    min_decay: float = 0.0
    """Lower clamp (``min_value``), in ``[0, 1]``."""

    def __post_init__(self) -> None:
        _check_warmup(self.decay, self.gamma, self.power, self.min_decay, 1.0)

    def __call__(self, step: int) -> float:
        return float(self._decay_tensor(torch.tensor(float(step), dtype=torch.float64)))

    def decay_for(self, step: int, update_every: int) -> float:
        return self(step)

    def decay_tensor_for(self, step: torch.Tensor, update_every: int) -> torch.Tensor:
        return self._decay_tensor(step).to(step.dtype)

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        s = (step - 1).clamp(min=0).to(torch.float32)
        value = 1 - (1 + s / self.gamma) ** -self.power
        value = value.clamp(min=self.min_decay, max=self.decay)
        if self.decay == 1:
            value = torch.ones_like(value)
        return torch.where(s <= 0, torch.zeros_like(value), value)

    def config(self) -> dict[str, Any]:
        return _warmup_config("ema_pytorch", self)


@dataclass(frozen=True, kw_only=True, slots=True)
class DiffusersDecay(_PowerForEvery):
    """diffusers ``EMAModel``'s default schedule (``use_ema_warmup=False``):
    ``d = clamp((1 + s) / (10 + s), min_decay, decay)`` with ``s = step - 1`` and ``d = 0``
    at ``s <= 0``. (With ``use_ema_warmup=True`` diffusers computes :class:`WarmupDecay`.)
    """

    decay: float = 0.9999
    """Upper clamp, in ``[0, 1]``."""
    min_decay: float = 0.0
    """Lower clamp, in ``[0, 1]``."""

    def __post_init__(self) -> None:
        _check_number("decay", self.decay, 0.0, 1.0)
        _check_number("min_decay", self.min_decay, 0.0, 1.0)

    def __call__(self, step: int) -> float:
        s = step - 1
        if s <= 0:
            return 0.0
        return max(min((1 + s) / (10 + s), self.decay), self.min_decay)

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        s = (step - 1).clamp(min=0)
        value = ((1 + s) / (10 + s)).clamp(max=self.decay).clamp(min=self.min_decay)
        return torch.where(s <= 0, torch.zeros_like(value), value)

    def config(self) -> dict[str, Any]:
        return {
            "schedule": "diffusers",
            "decay": float(self.decay),
            "min_decay": float(self.min_decay),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class RunningMeanDecay(_PowerForEvery):
    """Equal weights for every averaged step (SWA, torch ``AveragedModel``'s default):
    ``d(step) = 1 - 1 / step``, with ``1 / step`` rounded to float32 as torch's
    ``get_swa_multi_avg_fn`` computes it (so ``1 - d`` is that float32 weight exactly).
    ``step = 1`` copies the model."""

    def __call__(self, step: int) -> float:
        return 1.0 - float(torch.ones((), dtype=torch.float32) / step)

    def _decay_tensor(self, step: torch.Tensor) -> torch.Tensor:
        return 1.0 - (1.0 / step.to(torch.float32)).to(step.dtype)

    def config(self) -> dict[str, Any]:
        return {"schedule": "running_mean"}


def _check_warmup(
    decay: float, gamma: float, power: float, min_decay: float, min_decay_max: float
) -> None:
    """The checks the two warmup schedules share (:class:`WarmupDecay`,
    :class:`EmaPytorchDecay`): ``decay`` in ``[0, 1]``, ``gamma, power > 0``, ``min_decay``
    in ``[0, min_decay_max]``."""
    _check_number("decay", decay, 0.0, 1.0)
    _check_number("gamma", gamma, 0.0)
    _check_number("power", power, 0.0)
    if gamma == 0 or power == 0:
        raise ValueError(f"gamma and power must be > 0, got {gamma}, {power}")
    _check_number("min_decay", min_decay, 0.0, min_decay_max)


def _warmup_config(schedule: str, warmup: WarmupDecay | EmaPytorchDecay) -> dict[str, Any]:
    """The ``config()`` of the two warmup schedules: their four numbers, under ``schedule``."""
    numbers = ("decay", "gamma", "power", "min_decay")
    return {"schedule": schedule, **{name: float(getattr(warmup, name)) for name in numbers}}
