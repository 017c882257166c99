"""torchtitan's online EMA interface, sharded over the replica dims.

torchtitan 0.3.0 ships no EMA. Its development EMA (``EMAOptimizersContainer``) keeps a
``p.detach().clone()`` of every parameter: a DTensor with the parameter's own placements,
so every replica (DDP, the HSDP replicate dim, the TP group for replicated weights) holds a
full copy. :class:`TorchtitanEMA` keeps the same step rule on
:class:`~dtensor_ema.MultiModelEMA`, where every EMA element lives on exactly one rank.

The math, per EMA, is torchtitan's (read from its development branch)::

    if current_step < start_step: skip
    elapsed = current_step - start_step
    if elapsed % update_every_n_steps: skip
    num_updates = max((elapsed + step_bias) // update_every_n_steps, 1)
    decay = fixed decay, or 2 ** (-1 / (half_life_fraction * num_updates))
    ema = torch.lerp(ema, param, 1 - decay)          # elementwise, on local shards

EMAs start as a copy of the weights at construction. Parameters with ``requires_grad`` are
averaged; buffers only when their canonical fqn matches one of ``buffer_patterns``
(``fnmatch``); the others follow the model (``track=``: no EMA memory). With pipeline
parallelism each model part (stage) gets its own EMAs over the stage's mesh. A loop of
one's own uses it as torchtitan does (``docs/trainers.md``, "In a hand-written loop");
:mod:`dtensor_ema.integrations.torchtitan.trainer` wires it into torchtitan's ``Trainer``.
This module does not import torchtitan.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema.integrations._common import decay_name
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.model_keys import canonical_fqn, live_tensors
from dtensor_ema.multi import MultiModelEMA
from dtensor_ema.state import CONFIG, EMA_TENSORS, UPDATES, validate_state

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
        model_parts: torchtitan's ``model_parts`` (one module, or a list: one per pipeline
            stage held by this rank). Parts must not share a canonical fqn.
        mesh: the world of every part's EMAs (default ``None``: found from each part's
            parameters' meshes, which works on the meshes torchtitan's ``ParallelDims``
            builds; see :class:`~dtensor_ema.ModelEMA`). With pipeline parallelism pass
            the stage's own mesh (the world without its ``pp`` dim): an EMA whose mesh
            spans ranks holding other stages is refused.

    Names of the EMAs: ``decay_<d>`` for each entry of ``decays``, else ``hlf_<f>`` for each
    entry of ``half_life_fractions``, with ``_`` for the decimal point (DCP joins keys with
    dots): ``decay_0_999``, ``hlf_0_05``. With one model part ``ema[name]`` is a
    :class:`~dtensor_ema.ModelEMA`; :attr:`parts` holds one ``name -> ModelEMA`` mapping
    per part.

    Construction is collective over the EMA's mesh (as :class:`~dtensor_ema.ModelEMA`),
    once per part; :meth:`step` is local. Memory: each EMA holds ``1/W`` of the averaged
    bytes per rank (``W``: the ranks of its mesh).

    Raises:
        ValueError: bad config values (named), no model part, or two parts with a common
            fqn.
        NotImplementedError: ``offload_to_cpu`` with several EMAs.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """torchtitan's development ``EMA`` config fields (``--ema.<field>`` on the command
        line of :mod:`dtensor_ema.integrations.torchtitan.config_registry`)."""

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
        """``fnmatch`` patterns of buffer fqns to average too (e.g. ``"*.expert_bias_E"``)."""
        load_common_subset: bool = False
        """Resume from a checkpoint whose EMA tracked other tensors (other
        ``buffer_patterns``, parameters frozen or unfrozen since): load the tensors both
        hold, keep this EMA's others (:meth:`TorchtitanEMA.load_state_dict`'s
        ``common_subset``; the trainer's checkpoint manager reads it)."""

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
        if not parts:
            raise ValueError("model_parts is empty: pass torchtitan's model_parts")
        _check_disjoint(parts)
        self.config = config
        self.model_parts = parts
        schedules: dict[str, Any] = (
            {decay_name("decay", d): _Fixed(d) for d in config.decays}
            if config.decays
            else {decay_name("hlf", f): _HalfLifeFraction(f) for f in config.half_life_fractions}
        )
        self.names: list[str] = list(schedules) if config.enable else []
        """The EMAs' names (empty when disabled)."""
        self.parts: list[Mapping[str, ModelEMA]] = []
        """Per model part: ``name -> ModelEMA`` (empty when disabled)."""
        if not config.enable:
            return
        if config.offload_to_cpu and len(schedules) > 1:
            raise NotImplementedError(
                f"offload_to_cpu with {len(schedules)} EMAs {sorted(schedules)}: "
                "use one decay, or offload_to_cpu=False"
            )
        for part in parts:
            track = _Averaged(frozenset(_not_averaged(part, config.buffer_patterns)))
            if config.offload_to_cpu:
                self.parts.append(
                    {
                        name: ModelEMA(
                            part, mesh, schedule=fn, track=track, kernel="eager", offload=True
                        )
                        for name, fn in schedules.items()
                    }
                )
            else:
                self.parts.append(
                    MultiModelEMA(
                        part,
                        {name: {"schedule": fn} for name, fn in schedules.items()},
                        mesh,
                        track=track,
                        kernel="eager",
                    )
                )

    # ------------------------------------------------------------------ Mapping
    def __getitem__(self, name: str) -> ModelEMA:
        if len(self.parts) > 1:
            raise ValueError(
                f"this TorchtitanEMA tracks {len(self.parts)} model parts (pipeline stages): "
                f"use ema.parts[i][{name!r}] for part i"
            )
        if not self.parts:
            raise KeyError(name)
        return self.parts[0][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

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
        """Update every EMA of every part for the trainer's ``current_step``. Local: no
        communication.

        Call after ``optimizer.step()`` on every rank. The decay is a pure function of
        ``current_step`` (torchtitan's rule), so a resume needs nothing but the EMA tensors.
        """
        n = self.num_updates(current_step)
        if n is None:
            return
        for emas in self.parts:
            for ema in emas.values():
                # ModelEMA's schedule is called with its counter + 1: make that num_updates.
                ema.updates = n - 1
            if isinstance(emas, MultiModelEMA):
                emas.update()
            else:
                for ema in emas.values():
                    ema.update()

    def zero_grad(self, *args: object, **kwargs: object) -> None:
        """No-op (torchtitan's EMA container is optimizer-shaped)."""

    @torch.no_grad()
    def reset(self) -> None:
        """Copy the model's current weights into every EMA (after a model-only load, the
        weights the EMA was built from are gone). Local; counters unchanged."""
        for emas in self.parts:
            for ema in emas.values():
                ema.set()

    @contextlib.contextmanager
    def average_parameters(self, name: str | None = None) -> Iterator[list[nn.Module]]:
        """Swap EMA ``name`` (default: the first) into every model part; restore on exit.

        Yields the model parts. **Collective**: see
        :meth:`dtensor_ema.ModelEMA.average_parameters` (per part, over its EMA's mesh).
        Peak extra memory: that method's, for every part at once.

        Raises:
            RuntimeError: the EMA is disabled.
            KeyError: no EMA is called ``name``.
        """
        key = self._key(name)
        with contextlib.ExitStack() as stack:
            for emas in self.parts:
                stack.enter_context(emas[key].average_parameters())
            yield self.model_parts

    def get_ema_state_dict(self, name: str | None = None, **options: Any) -> dict[str, Any]:
        """EMA ``name`` (default: the first) as full tensors keyed like the model parts'
        ``state_dict()`` (their post-hooks applied: torchtitan's fused ``wqkv`` comes out as
        ``wq``/``wk``/``wv``), all parts of this rank merged. **Collective** over each part's
        EMA mesh; ``options`` go to :meth:`dtensor_ema.ModelEMA.get_ema_state_dict`
        (``only_rank0_receives``, ``cpu_offload``, ``bucket_bytes``; ``include_untracked``
        defaults to ``True`` here: the tensors that follow the model, frozen parameters and
        buffers outside ``buffer_patterns`` such as MoE's ``expert_bias_E``, come from the
        model, so the dict is whole, as ``export_hf`` needs). With pipeline parallelism a
        rank gets its own stages' tensors only.

        Raises:
            RuntimeError: the EMA is disabled.
            KeyError: no EMA is called ``name``.
        """
        key = self._key(name)
        options.setdefault("include_untracked", True)
        merged: dict[str, Any] = {}
        for emas in self.parts:
            merged.update(emas[key].get_ema_state_dict(**options))
        return merged

    # ------------------------------------------------------------------ DCP Stateful
    def state_dict(self) -> dict[str, Any]:
        """``{name: {"updates": int, "config": str, "ema": {fqn: tensor}}}`` over every part
        (sharded DTensors; ``{}`` when disabled). Local, no copy. Save it under the checkpoint
        key ``ema``.

        The fqns of all parts share one ``"ema"`` dict, so the state does not depend on how
        the model was split into pipeline stages: DCP reshards it to any other layout.
        ``"config"`` holds the settings a resume must keep (the EMAs and
        ``buffer_patterns``); ``start_step``, ``step_bias`` and ``update_every_n_steps``
        may change between runs (torchtitan's ``step_bias`` exists for that).
        """
        out: dict[str, Any] = {}
        for name in self.names:
            states = [emas[name].state_dict() for emas in self.parts]
            tensors: dict[str, Any] = {}
            for state in states:
                tensors.update(state[EMA_TENSORS])
            out[name] = {
                UPDATES: states[0][UPDATES],
                CONFIG: self._resume_config(),
                EMA_TENSORS: tensors,
            }
        return out

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        *,
        common_subset: bool = False,
        leave: Mapping[str, Collection[str]] | None = None,
    ) -> None:
        """Restore every EMA of every part from :meth:`state_dict` output (a DCP load's
        included). An empty ``state_dict`` (a checkpoint saved without EMA) restarts each
        EMA from the model's current weights, as torchtitan does. Local. Everything is
        checked before anything is written.

        Args:
            state_dict: the state.
            common_subset: accept a state saved with another tracked set of the same model
                (other ``buffer_patterns``, parameters frozen or unfrozen since), as
                :meth:`dtensor_ema.ModelEMA.load_state_dict` does: load the tensors both
                hold, leave this EMA's others as they are (the counters are loaded); at
                least one tensor must be common. The EMA names must still match.
            leave: per EMA name, fqns the state need not hold: left as they are (a
                fused/unfused Q/K/V conversion fills them next, see
                :class:`~dtensor_ema.integrations.torchtitan.resume.EMALoad`).

        Raises:
            ValueError: the EMA names, ``config`` or tensors differ from this object's
                (each message names them; with ``common_subset``, the names or the
                shapes/dtypes of common tensors differ, or no tensor is common).
            KeyError: a state lacks ``"ema"`` or ``"updates"``.
        """
        if not self.parts:
            return
        if not state_dict:
            self.reset()
            return
        if set(state_dict) != set(self.names):
            raise ValueError(f"checkpoint EMAs {sorted(state_dict)} != {sorted(self.names)}")
        plan: list[tuple[ModelEMA, dict[str, Any]]] = []
        for name in self.names:
            saved = state_dict[name]
            for key in (EMA_TENSORS, UPDATES):
                if key not in saved:
                    raise KeyError(f"EMA {name!r}: the checkpoint state has no {key!r} entry")
            self._check_resume_config(name, saved.get(CONFIG), common_subset)
            left = set((leave or {}).get(name, ()))
            known: set[str] = set(left)
            common = 0
            for emas in self.parts:
                ema = emas[name]
                ours = ema.state_dict()
                known |= set(ours[EMA_TENSORS])
                present = {k: v for k, v in saved[EMA_TENSORS].items() if k in ours[EMA_TENSORS]}
                common += len(present)
                # Tensors that keep their values are loaded onto themselves.
                tensors = {
                    k: present.get(k, v)
                    for k, v in ours[EMA_TENSORS].items()
                    if k in present or common_subset or k in left
                }
                part_state = {
                    UPDATES: saved[UPDATES],
                    CONFIG: ours[CONFIG],
                    EMA_TENSORS: tensors,
                }
                try:
                    validate_state(part_state, ours)
                except (KeyError, ValueError) as e:
                    raise type(e)(f"EMA {name!r}: {e}") from e
                plan.append((ema, part_state))
            unexpected = sorted(set(saved[EMA_TENSORS]) - known)
            if unexpected and not common_subset:
                raise ValueError(
                    f"EMA {name!r}: unexpected fqns {unexpected[:5]} (load the tensors both "
                    "hold with common_subset=True)"
                )
            if not common:
                raise ValueError(f"EMA {name!r}: the checkpoint and this EMA share no tensor")
        for ema, part_state in plan:
            ema.load_state_dict(part_state)

    def _check_resume_config(self, name: str, config: str | None, common_subset: bool) -> None:
        """Refuse a saved ``config`` (:meth:`_resume_config`) this run does not continue:
        other EMAs, or (unless ``common_subset``) other ``buffer_patterns``."""
        if config is None or config == self._resume_config():
            return
        if common_subset:
            try:
                emas = json.loads(config).get("emas")
            except (ValueError, AttributeError):
                emas = None
            if emas == self.names:
                return
        raise ValueError(
            f"EMA {name!r}: saved with {config}, this run has "
            f"{self._resume_config()}; resuming would not continue the saved average"
            + ("" if common_subset else " (other buffer_patterns: common_subset=True)")
        )

    def _key(self, name: str | None) -> str:
        """``name``, or the first EMA's, checked; raises as the public methods document."""
        if not self.parts:
            raise RuntimeError("the EMA is disabled (config.enable=False)")
        key = self.names[0] if name is None else name
        if key not in self.names:
            raise KeyError(f"no EMA named {key!r}; the EMAs are {self.names}")
        return key

    def _resume_config(self) -> str:
        c = self.config
        return json.dumps(
            {"emas": self.names, "buffer_patterns": sorted(c.buffer_patterns)}, sort_keys=True
        )


def _check_disjoint(parts: list[nn.Module]) -> None:
    seen: dict[str, int] = {}
    for i, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise TypeError(f"model_parts[{i}] is a {type(part).__name__}, not an nn.Module")
        for fqn in live_tensors(part):
            if fqn in seen:
                raise ValueError(
                    f"model parts {seen[fqn]} and {i} both hold {fqn!r}: pipeline stages must "
                    "not share tensors"
                )
            seen[fqn] = i


@dataclass(frozen=True)
class _Averaged:
    """The ``track=`` predicate: every float tensor but the ones that follow the model
    (which the EMA then neither stores nor updates: they are read from the model)."""

    follow_the_model: frozenset[str]

    def __call__(self, fqn: str, tensor: torch.Tensor) -> bool:
        return fqn not in self.follow_the_model


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
