"""Running an update: the count, the kernels, who applies a step and when.

* :mod:`~dtensor_ema.update.counter`: the number of ``update()`` calls and the decay it implies.
* :mod:`~dtensor_ema.update.fused_update`: the update groups and their fused kernels
  (:mod:`~dtensor_ema.update.compiled_lerp`: the compiled single-pass kernel).
* :mod:`~dtensor_ema.update.updater`: inline, capturable, offloaded and chunked updaters;
  :mod:`~dtensor_ema.update.cuda_graph`: graph replay of any of them.

Each module is imported by its own path; nothing here imports the engine or ``ModelEMA``.
"""
