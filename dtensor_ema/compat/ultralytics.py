"""ultralytics' (and yolov5's) ``ModelEMA`` over a sharded :class:`~dtensor_ema.ModelEMA`:
``from dtensor_ema.compat.ultralytics import ModelEMA``.

Same constructor ``ModelEMA(model, decay=0.9999, tau=2000, updates=0)``, ``.ema``,
``.updates``, ``.enabled``, ``.decay(x)``, ``update(model)`` and ``update_attr``; the ramp
is the engine's default schedule, float buffers of plain/DDP models are whole on every rank
(each rank's are its own replica's). ``.ema`` is a replica
(:mod:`dtensor_ema.compat._replica`): ultralytics validates it on every rank and saves it on
rank 0 alone, so ``ema.materialize()`` (alias ``gather_for_save()``) on every rank gathers
its parameters first (**collective**; peak one full copy of the parameters per rank, freed
by the next update); without it a state dict or forward of ``.ema`` raises naming it. FSDP2/TP
models: ``.ema`` is the engine's sharded module (save with DCP). The guide, with what
differs (tied weights averaged once, yolov5's rounding): ``docs/migration-ultralytics.md``.
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
