"""A sharded EMA for torchtitan: two flags on its own trainer, or a class for your own loop.

On torchtitan's entry point, the module is the opt-in::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module dtensor_ema.integrations.torchtitan --config llama3_8b --ema.decays 0.999

``ConfigManager`` imports :mod:`dtensor_ema.integrations.torchtitan.config_registry`,
whose functions are torchtitan's registered configs with an ``ema`` section; their
trainer is :class:`~dtensor_ema.integrations.torchtitan.trainer.EMATrainer` (steps,
checkpoints, validates and exports the EMA). In a hand-written loop use
:class:`TorchtitanEMA` (torchtitan's EMA interface) and :func:`export_hf`.

Importing this package does not import torchtitan; the ``config_registry`` and ``trainer``
submodules do.
"""

from dtensor_ema.integrations.torchtitan.ema import TorchtitanEMA
from dtensor_ema.integrations.torchtitan.hf import check_to_hf_keys, export_hf

__all__ = ["TorchtitanEMA", "check_to_hf_keys", "export_hf"]
