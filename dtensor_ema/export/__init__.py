"""Averaged weights out of the EMA for inference, in the formats other tools read.

* :mod:`~dtensor_ema.export.full_weights`: :func:`export_ema` (a live EMA) and
  :func:`convert_checkpoint` (a checkpoint, offline) to one ``torch.save`` or
  ``.safetensors`` file keyed like the model.
* :mod:`~dtensor_ema.export.peft`: the EMA of a PEFT model's adapter as a PEFT adapter
  directory.
* :mod:`~dtensor_ema.export.state_file`: the one-file writer both (and the post-hoc
  synthesis) share.
"""

from dtensor_ema.export.full_weights import convert_checkpoint, export_ema
from dtensor_ema.export.peft import export_peft_adapter, save_peft_adapter

__all__ = ["convert_checkpoint", "export_ema", "export_peft_adapter", "save_peft_adapter"]
