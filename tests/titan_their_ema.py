"""A torchtitan ``--module`` whose config also has torchtitan's own EMA (for the tests).

torchtitan's development branch adds ``Trainer.Config.ema_weights``
(``EMAOptimizersContainer.Config``: ``enable``, ``decay``, ``half_life_fraction``, ...;
checkpoint entry ``ema_optimizer``); torchtitan 0.3.0 has no such field. This module
stands in for that future: :class:`ConfigWithTheirEMA` is
:class:`~dtensor_ema.integrations.torchtitan.trainer.EMATrainer.Config` (a subclass of 0.3.0's
``Trainer.Config``) plus an ``ema_weights`` section of the same shape, and
:func:`llama3_debugmodel` returns it with both EMAs on, so that
``python -m torchtitan.train --module titan_their_ema --config llama3_debugmodel`` (run from
``tests/``) is what a user of a torchtitan with its own EMA would type. Imports torchtitan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dtensor_ema.integrations.torchtitan import config_registry
from dtensor_ema.integrations.torchtitan.trainer import EMATrainer


@dataclass(kw_only=True, slots=True)
class TheirEMA:
    """The fields of torchtitan's development ``EMAOptimizersContainer.Config``."""

    enable: bool = False
    """Whether torchtitan's own EMA is on."""
    decay: float | None = None
    """Fixed decay, else the half-life fraction decides."""
    half_life_fraction: float = 0.05
    """``decay = 2 ** (-1 / (half_life_fraction * num_updates))``."""


@dataclass(kw_only=True, slots=True)
class ConfigWithTheirEMA(EMATrainer.Config):
    """``EMATrainer.Config`` with torchtitan's own EMA section, as its ``Trainer.Config``
    will have it."""

    ema_weights: TheirEMA = field(default_factory=TheirEMA)
    """torchtitan's own EMA."""


def llama3_debugmodel() -> ConfigWithTheirEMA:
    """dtensor_ema's ``llama3_debugmodel`` config with torchtitan's own EMA on too."""
    ours = config_registry.llama3_debugmodel()
    values = {f.name: getattr(ours, f.name) for f in fields(ours) if f.init}
    return ConfigWithTheirEMA(**values, ema_weights=TheirEMA(enable=True))
