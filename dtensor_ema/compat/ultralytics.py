"""ultralytics' (and yolov5's) ``ModelEMA`` over a sharded :class:`~dtensor_ema.ModelEMA`.

Swap ``from ultralytics.utils.torch_utils import ModelEMA`` (yolov5: ``from
utils.torch_utils import ModelEMA``) for ``from dtensor_ema.compat.ultralytics import
ModelEMA``. Same constructor ``ModelEMA(model, decay=0.9999, tau=2000, updates=0)``, the
same ``.ema``, ``.updates``, ``.enabled``, ``.decay(x)``, ``update(model)`` and
``update_attr(model, include, exclude)``. The ramp ``decay * (1 - exp(-updates / tau))``
is the engine's default schedule; float buffers of plain/DDP models are replicated
(``replicate_buffers=True``), so each rank's EMA buffers are its own replica's.

``.ema`` has the model's structure; between gathers its parameters hold no storage and
each rank keeps ``1/W`` of the EMA. ultralytics (8.4) validates ``ema.ema`` on every rank
(after broadcasting rank 0's EMA buffers, which, whole on every rank, are the engine's own)
and saves ``deepcopy(ema.ema)`` on rank 0 alone, where no collective can run: call
``ema.materialize()`` (alias ``ema.gather_for_save()``) on every rank before validation
(one line in the trainer, e.g. right after the epoch's last ``optimizer_step``); without
it, a state dict or forward of ``.ema`` after an update raises a ``RuntimeError`` saying so
instead of saving missing weights (a pickle of ``.ema`` made then refuses at load). Peak
while gathered: one full copy of the parameters per rank, freed by the next update; see
:mod:`dtensor_ema.compat._replica`. A single process, or a one-rank group, needs nothing:
``.ema`` then holds the live EMA.

``pickle``/``copy.deepcopy`` of the ``ModelEMA`` object itself work without a process group
(a copy averages its own copy of the model) and raise at W > 1, naming what to save.

FSDP2/TP models (which ultralytics' own ``ModelEMA`` cannot ``deepcopy``): ``.ema`` is the
engine's sharded module (one unit all-gathered per forward, collective), whose
``state_dict()`` holds DTensors: save with DCP (:func:`dtensor_ema.save_checkpoint`).

Differences, deliberate: a tied weight is averaged once (ultralytics lerps it once per
state-dict name, i.e. with ``d**2``). yolov5 computes ``v *= d; v += (1 - d) * m`` where
ultralytics (8.x) and we lerp: at most a few ulp apart per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from dtensor_ema.compat._replica import EmaReplica, fix_message, keeps_buffers_whole
from dtensor_ema.model_ema import ModelEMA as _Engine
from dtensor_ema.plan import unwrap_model

__all__ = ["ModelEMA"]

_FIX = fix_message("ema", also="`ema.materialize()`")


class ModelEMA:
    """ultralytics ``ModelEMA`` with its EMA sharded across ranks (see the module docstring).

    Every rank must construct it (the engine checks the ranks' structure with one small
    all-gather). ``update`` and ``update_attr`` never communicate; ``materialize`` is
    collective over the default group.
    """

    def __init__(
        self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0
    ) -> None:
        whole = keeps_buffers_whole(model)
        self._engine = _Engine(
            model, decay=decay, tau=tau, updates=updates, replicate_buffers=whole
        )
        self._replica = EmaReplica(self._engine, _FIX)
        for p in self._replica.module.parameters():
            p.requires_grad_(False)
        self.enabled = True

    @property
    def engine(self) -> _Engine:
        """The sharded :class:`~dtensor_ema.ModelEMA` doing the work."""
        return self._engine

    @property
    def ema(self) -> nn.Module:
        """The EMA as a module in ``eval()`` mode (parameters gathered by :meth:`materialize`)."""
        return self._replica.module

    @property
    def updates(self) -> int:
        """Number of EMA updates (the ramp's ``x``)."""
        return self._engine.updates

    @updates.setter
    def updates(self, value: int) -> None:
        self._engine.updates = value

    @property
    def decay(self) -> Callable[[int], float]:
        """``x -> decay * (1 - exp(-x / tau))``, from the engine's schedule."""
        return self._engine.get_decay

    def update(self, model: nn.Module) -> None:
        """One EMA step from ``model`` (DDP-wrapped or not) when enabled. Local."""
        if self.enabled:
            self._replica.release()
            self._engine.update(model)
            self._replica.changed(ints=False)  # integer buffers keep their first value

    def update_attr(
        self, model: nn.Module, include: Iterable[str] = (), exclude: Iterable[str] = ()
    ) -> None:
        """Copy the model's public non-tensor attributes onto :attr:`ema` (ultralytics'
        ``copy_attr``: all of them, or only ``include``; never ``exclude`` or ``_``-names)."""
        if not self.enabled:
            return
        include, exclude = tuple(include), tuple(exclude)
        for key, value in unwrap_model(model).__dict__.items():
            if (include and key not in include) or key.startswith("_") or key in exclude:
                continue
            setattr(self.ema, key, value)

    def materialize(self) -> None:
        """Gather the full EMA parameters into :attr:`ema` until the next update.
        **Collective** (every rank). Peak: one full copy of the parameters per rank."""
        self._replica.materialize()

    def gather_for_save(self) -> None:
        """The same as :meth:`materialize` (the name every drop-in shares). **Collective**."""
        self._replica.materialize()
