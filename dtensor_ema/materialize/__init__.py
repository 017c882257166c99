"""Full weights and evaluation copies built from the EMA's shards.

* :mod:`~dtensor_ema.materialize.gather`: local pieces to full tensors in flat bucketed
  all-gathers (as few collectives as the bytes allow).
* :mod:`~dtensor_ema.materialize.full_state`: full state dicts keyed like the model, out of
  the EMA and back into it.
* :mod:`~dtensor_ema.materialize.swap`: the EMA swapped into the model's own tensors
  (``average_parameters``).
* :mod:`~dtensor_ema.materialize.ema_module`, :mod:`~dtensor_ema.materialize.tp_module`,
  :mod:`~dtensor_ema.materialize.twin`: ``ema.module``, the EMA as a module you can call.

Each module is imported by its own path; nothing here imports the engine or ``ModelEMA``.
"""
