"""Drop-in EMA for the trainers people already use.

* :mod:`dtensor_ema.integrations.lightning`: a Lightning ``Callback`` (extra ``lightning``).
* :mod:`dtensor_ema.integrations.transformers`: a Hugging Face ``TrainerCallback`` and a
  ``Trainer`` mixin that evaluates with the EMA weights (extra ``transformers``).
* :mod:`dtensor_ema.integrations.torchtitan`: torchtitan's ``Trainer`` with the EMA, and
  ``TorchtitanEMA`` for a hand-written loop (torchtitan 0.3.0).
* :mod:`dtensor_ema.integrations.torchft`: ``register_ema``, the EMA in torchft's live
  recovery (extra ``torchft``).

Importing this package imports none of them; each submodule imports only its own.
"""
