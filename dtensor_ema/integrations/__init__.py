"""Drop-in EMA for the trainers people already use.

* :mod:`dtensor_ema.integrations.lightning`: a Lightning ``Callback`` (extra ``lightning``).
* :mod:`dtensor_ema.integrations.transformers`: a Hugging Face ``TrainerCallback`` and a
  ``Trainer`` mixin that evaluates with the EMA weights (extra ``transformers``).

Importing this package imports neither trainer; each submodule imports only its own.
"""
