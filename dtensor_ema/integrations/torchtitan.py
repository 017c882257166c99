"""torchtitan's online EMA interface, sharded over the replica dims.

torchtitan 0.3.0 ships no EMA. Its development EMA (``torchtitan/components/ema.py``,
``EMAOptimizersContainer``) keeps a ``p.detach().clone()`` of every parameter: a DTensor
with the parameter's own placements, so every replica (DDP, the HSDP replicate dim, the TP
group for replicated weights) holds a full copy. :class:`TorchtitanEMA` keeps the same
interface and math on :class:`~dtensor_ema.MultiModelEMA`, where every EMA element lives on
exactly one rank.

The math, per EMA, is torchtitan's (read from its development ``ema.py``)::

    if current_step < start_step: skip
    elapsed = current_step - start_step
    if elapsed % update_every_n_steps: skip
    num_updates = max((elapsed + step_bias) // update_every_n_steps, 1)
    decay = fixed decay, or 2 ** (-1 / (half_life_fraction * num_updates))
    ema = torch.lerp(ema, param, 1 - decay)          # elementwise, on local shards

EMAs start as a copy of the weights at construction. Parameters with ``requires_grad`` are
averaged; buffers only when their canonical fqn matches one of ``buffer_patterns``
(``fnmatch``), others follow the model (copied, so a swap leaves them unchanged).
Use it in a training loop as torchtitan does::

    ema = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=[0.999]), model_parts=[m])
    states = {"ema": ema}            # DCP / CheckpointManager(states=...) key ``ema``
    ...; optimizer.step(); ema.step(current_step)
    with ema.average_parameters():   # evaluate through the first EMA
        ...
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.model_keys import canonical_fqn, live_tensors
from dtensor_ema.multi import MultiModelEMA

__all__ = ["TorchtitanEMA"]


class _Fixed:
    """``num_updates -> decay``: a constant (torchtitan's ``decay``)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def __call__(self, num_updates: int) -> float:
        return self.decay


class _HalfLifeFraction:
    """``num_updates -> 2 ** (-1 / (fraction * num_updates))`` (torchtitan's default)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def __call__(self, num_updates: int) -> float:
        return float(2.0 ** (-1.0 / (self.fraction * num_updates)))


class TorchtitanEMA(Mapping[str, ModelEMA]):
    """One or more EMAs of a torchtitan model with torchtitan's EMA interface.

    Args:
        config: a :class:`TorchtitanEMA.Config`.
        model_parts: torchtitan's ``model_parts``; exactly one part (no pipeline parallel).
        mesh: the EMA's world (default: found from the parameters' meshes, which works
            on the meshes torchtitan's ``ParallelDims`` builds; see
            :class:`~dtensor_ema.ModelEMA`).

    Names of the EMAs: ``decay_<d>`` for each entry of ``decays``, else ``hlf_<f>`` for each
    entry of ``half_life_fractions``, with ``_`` for the decimal point (DCP joins keys with
    dots): ``decay_0_999``, ``hlf_0_05``; ``ema[name]`` is a :class:`~dtensor_ema.ModelEMA`.

    Construction is collective over the EMA's mesh (as :class:`~dtensor_ema.ModelEMA`);
    :meth:`step` is local. Memory: each EMA holds ``1/W`` of the averaged bytes per rank.

    Raises:
        ValueError: bad config values (named), or several model parts.
        NotImplementedError: ``offload_to_cpu`` with several EMAs.
    """

    @dataclass(kw_only=True)
    class Config:
        """torchtitan's ``EMA`` config fields."""

        enable: bool = False
        """Whether EMA tracking is active; when False every call is a no-op."""
        decays: list[float] = field(default_factory=list)
        """Fixed decays, one EMA each; when empty, ``half_life_fractions`` decide."""
        half_life_fractions: list[float] = field(default_factory=lambda: [0.05])
        """Per EMA: ``decay = 2 ** (-1 / (fraction * num_updates))``."""
        start_step: int = 0
        """First trainer step at which the EMA updates."""
        step_bias: int = 0
        """Added to the elapsed steps when counting ``num_updates``."""
        update_every_n_steps: int = 1
        """Update on every n-th step after ``start_step`` only."""
        offload_to_cpu: bool = False
        """Keep the EMA shards in host memory (:class:`ModelEMA` ``offload=True``)."""
        buffer_patterns: list[str] = field(default_factory=list)
        """``fnmatch`` patterns of buffer fqns to average too (e.g. ``"*.expert_bias"``)."""

        def __post_init__(self) -> None:
            for d in self.decays:
                if not 0.0 <= d < 1.0:
                    raise ValueError(f"decays must lie in [0, 1), got {d!r} in {self.decays}")
            for f in self.half_life_fractions:
                if not f > 0:
                    raise ValueError(
                        f"half_life_fractions must be > 0, got {f!r} in {self.half_life_fractions}"
                    )
            if not self.decays and not self.half_life_fractions:
                raise ValueError("set decays or half_life_fractions (both are empty)")
            if self.start_step < 0:
                raise ValueError(f"start_step must be >= 0, got {self.start_step}")
            if self.update_every_n_steps < 1:
                raise ValueError(
                    f"update_every_n_steps must be >= 1, got {self.update_every_n_steps}"
                )

    def __init__(
        self,
        config: Config,
        *,
        model_parts: list[nn.Module] | nn.Module,
        mesh: DeviceMesh | None = None,
    ) -> None:
        parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        if len(parts) != 1:
            raise ValueError(
                f"TorchtitanEMA tracks one model part, got {len(parts)} (pipeline parallel "
                "is not supported: build one TorchtitanEMA per stage)"
            )
        self.config = config
        self.model = parts[0]
        schedules: dict[str, Any] = (
            {_name("decay", d): _Fixed(d) for d in config.decays}
            if config.decays
            else {_name("hlf", f): _HalfLifeFraction(f) for f in config.half_life_fractions}
        )
        self._emas: Mapping[str, ModelEMA] = {}
        if not config.enable:
            return
        exclude = _not_averaged(self.model, config.buffer_patterns)
        if config.offload_to_cpu:
            if len(schedules) > 1:
                raise NotImplementedError(
                    f"offload_to_cpu with {len(schedules)} EMAs {sorted(schedules)}: "
                    "use one decay, or offload_to_cpu=False"
                )
            self._emas = {
                name: ModelEMA(
                    self.model, mesh, schedule=fn, exclude=exclude, kernel="eager", offload=True
                )
                for name, fn in schedules.items()
            }
        else:
            self._emas = MultiModelEMA(
                self.model,
                {name: {"schedule": fn} for name, fn in schedules.items()},
                mesh,
                exclude=exclude,
                kernel="eager",
            )

    # ------------------------------------------------------------------ Mapping
    def __getitem__(self, name: str) -> ModelEMA:
        return self._emas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._emas)

    def __len__(self) -> int:
        return len(self._emas)

    # ------------------------------------------------------------------ torchtitan API
    def num_updates(self, current_step: int) -> int | None:
        """torchtitan's ``num_updates`` for ``current_step``; ``None`` when the step is
        skipped (disabled, before ``start_step``, or off the ``update_every_n_steps`` grid)."""
        c = self.config
        if not c.enable or current_step < c.start_step:
            return None
        elapsed = current_step - c.start_step
        if elapsed % c.update_every_n_steps:
            return None
        return max((elapsed + c.step_bias) // c.update_every_n_steps, 1)

    @torch.no_grad()
    def step(self, current_step: int) -> None:
        """Update every EMA for the trainer's ``current_step``. Local: no communication.

        Call after ``optimizer.step()`` on every rank. The decay is a pure function of
        ``current_step`` (torchtitan's rule), so a resume needs nothing but the EMA tensors.
        """
        n = self.num_updates(current_step)
        if n is None:
            return
        for ema in self._emas.values():
            # ModelEMA's schedule is called with its counter + 1: make that num_updates.
            ema.updates = n - 1
        if isinstance(self._emas, MultiModelEMA):
            self._emas.update()
        else:
            for ema in self._emas.values():
                ema.update()

    def zero_grad(self, *args: object, **kwargs: object) -> None:
        """No-op (torchtitan's EMA container is optimizer-shaped)."""

    @contextlib.contextmanager
    def average_parameters(self, name: str | None = None) -> Iterator[nn.Module]:
        """Swap EMA ``name`` (default: the first) into the model; restore on exit.
        **Collective**: see :meth:`dtensor_ema.ModelEMA.average_parameters`."""
        if not self._emas:
            raise RuntimeError("the EMA is disabled (config.enable=False)")
        key = next(iter(self._emas)) if name is None else name
        with self._emas[key].average_parameters() as model:
            yield model

    # ------------------------------------------------------------------ DCP Stateful
    def state_dict(self) -> dict[str, Any]:
        """``{ema name: ModelEMA.state_dict()}`` (sharded DTensors; ``{}`` when disabled).
        Local. Save it under the checkpoint key ``ema``."""
        return {name: ema.state_dict() for name, ema in self._emas.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore every EMA. An empty ``state_dict`` (a checkpoint saved without EMA)
        restarts each EMA from the model's current weights, as torchtitan does. Local.

        Raises:
            ValueError: the EMA names differ from this object's.
        """
        if not self._emas:
            return
        if not state_dict:
            for ema in self._emas.values():
                ema.set()
            return
        if isinstance(self._emas, MultiModelEMA):
            self._emas.load_state_dict(state_dict)
            return
        if set(state_dict) != set(self._emas):
            raise ValueError(f"checkpoint EMAs {sorted(state_dict)} != {sorted(self._emas)}")
        for name, ema in self._emas.items():
            ema.load_state_dict(state_dict[name])


def _name(kind: str, value: float) -> str:
    return f"{kind}_{value:g}".replace(".", "_")


def _not_averaged(model: nn.Module, buffer_patterns: list[str]) -> set[str]:
    """Canonical fqns that follow the model instead of being averaged: frozen parameters
    and float buffers that match no pattern."""
    params = {canonical_fqn(n) for n, p in model.named_parameters(remove_duplicate=False)}
    frozen = {
        canonical_fqn(n)
        for n, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad
    }
    buffers = {
        name
        for name, t in live_tensors(model).items()
        if name not in params and t.is_floating_point()
    }
    matched = {b for b in buffers if any(fnmatch.fnmatch(b, p) for p in buffer_patterns)}
    return frozen | (buffers - matched)
