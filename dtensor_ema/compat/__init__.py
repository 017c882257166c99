"""Drop-in replacements for other libraries' EMA classes: ``import dtensor_ema.compat.<library>``."""
