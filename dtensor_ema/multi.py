"""Several EMAs of one model with different decays, updated in one pass.

Diffusion and LM training often keep a fast and a slow EMA (e.g. decays 0.999 and 0.9999)
and pick the better one at evaluation. Building two :class:`~dtensor_ema.ModelEMA` objects
works, but each update would check the model and read every parameter shard once per EMA.
:class:`MultiModelEMA` shares the sharding plan's layout: one model check, then per group of
local tensors one pass over the sources for all EMAs (``kernel="compiled"``: each source
value read once; eager: bf16 sources upcast once per slice into a reused scratch buffer,
then one ``_foreach_lerp_`` per EMA).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema.engine import set_grad_mode
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.options import AveragingFunction, ExcludeSpec, TrackSpec
from dtensor_ema.state import validate_state
from dtensor_ema.update.fused_update import lerp_groups_

__all__ = ["MultiModelEMA"]

# Options that decide which tensors exist and how they are grouped: shared by all EMAs so
# their update groups line up one to one.
_SHARED = ("mesh", "buffers", "exclude", "track", "ema_dtype", "kernel")


class MultiModelEMA(Mapping[str, ModelEMA]):
    """A named set of :class:`ModelEMA` over one model, updated together.

    Args:
        model: as for :class:`ModelEMA`.
        emas: ``name -> options`` per EMA: any of ``decay``, ``tau``, ``half_life``,
            ``schedule``, ``update_every``, ``update_after_step``, ``updates``.
        mesh: shared by every EMA, as for :class:`ModelEMA`.
        buffers: shared by every EMA, as for :class:`ModelEMA`.
        exclude: shared by every EMA, as for :class:`ModelEMA`.
        track: shared by every EMA, as for :class:`ModelEMA`. Change the tracked set with
            :meth:`add_tensors`/:meth:`drop_tensors` here, which change every member: a
            member changed alone is refused by the next :meth:`update` (their update groups
            must line up).
        ema_dtype: shared by every EMA, as for :class:`ModelEMA`.
        kernel: shared by every EMA, as for :class:`ModelEMA`.

    Each EMA keeps its own sharded state (``multi["slow"]`` is a full ``ModelEMA``: evaluate
    with ``multi["slow"].average_parameters()``), and its own entry in checkpoints:
    ``state_dict() == {name: ema.state_dict()}``. Construction and :meth:`update` are local.

    Raises:
        ValueError: no EMAs, or a per-EMA option that must be shared.
    """

    def __init__(
        self,
        model: nn.Module,
        emas: Mapping[str, Mapping[str, Any]],
        mesh: DeviceMesh | None = None,
        *,
        buffers: Literal["average", "copy"] = "average",
        exclude: ExcludeSpec = None,
        track: TrackSpec = "all",
        ema_dtype: torch.dtype | None = None,
        kernel: Literal["eager", "compiled", "auto"] = "auto",
    ) -> None:
        if not emas:
            raise ValueError("emas must name at least one EMA, e.g. {'slow': {'decay': 0.9999}}")
        for name, options in emas.items():
            unsupported = [
                k for k in ("capturable", "offload", "formula", "cuda_graph") if k in options
            ]
            if unsupported:
                raise ValueError(
                    f"EMA {name!r}: {unsupported} not supported by MultiModelEMA; use one "
                    "ModelEMA per decay for capturable or offloaded updates or another formula"
                )
            if isinstance(options.get("schedule"), AveragingFunction):
                raise ValueError(
                    f"EMA {name!r}: an AveragingFunction schedule is not supported by "
                    "MultiModelEMA (it lerps every EMA in one pass); use one ModelEMA"
                )
            shared = [k for k in options if k in _SHARED]
            if shared:
                raise ValueError(
                    f"EMA {name!r} sets {shared}, which all EMAs share: pass them to "
                    "MultiModelEMA itself"
                )
        self._emas = {
            name: ModelEMA(
                model,
                mesh,
                buffers=buffers,
                exclude=exclude,
                track=track,
                ema_dtype=ema_dtype,
                kernel=kernel,
                cuda_graph=False,  # MultiModelEMA applies the steps itself, never update()
                **options,
            )
            for name, options in emas.items()
        }
        first = next(iter(self._emas.values()))
        self.model = first.model
        """The tracked (unwrapped) model; each EMA's own module is ``multi[name].module``."""
        self._aligned_versions = self._tracked_versions()
        self._bindings: list[object] = [None] * len(self._emas)

    def __getitem__(self, name: str) -> ModelEMA:
        return self._emas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._emas)

    def __len__(self) -> int:
        return len(self._emas)

    def add_tensors(self, fqns: Iterable[str]) -> None:
        """:meth:`ModelEMA.add_tensors` on every EMA, in order. **Collective** over the
        mesh, as there (one flag all-reduce and one structure all-gather per mesh dim, per
        EMA): every rank calls it with the same names. Peak extra memory: the new shards of
        one EMA at a time, as there. If a member fails, the members already changed drop
        the new tensors again and it raises: all members keep one tracked set."""
        self._change_every_member(self._names(fqns), add=True)

    def drop_tensors(self, fqns: Iterable[str]) -> None:
        """:meth:`ModelEMA.drop_tensors` on every EMA, in order. **Collective** over the
        mesh, as there: every rank calls it with the same names. Peak extra memory: as
        there, one EMA at a time. If a member fails, the members already changed are
        changed back (dropped tensors re-added from the model's values) and it raises."""
        self._change_every_member(self._names(fqns), add=False)

    def _change_every_member(self, names: list[str], *, add: bool) -> None:
        """Change every member in order; if one fails, undo the members already changed
        (an added tensor dropped; a dropped one added back, from the model's current value)
        so that they stay aligned, then re-raise."""
        done: list[ModelEMA] = []
        try:
            for ema in self._emas.values():
                (ema.add_tensors if add else ema.drop_tensors)(names)
                done.append(ema)
        except Exception:
            for ema in done:
                (ema.drop_tensors if add else ema.add_tensors)(names)
            raise
        self._aligned_versions = self._tracked_versions()

    @staticmethod
    def _names(fqns: Iterable[str]) -> list[str]:
        if isinstance(fqns, str):
            raise TypeError(f"fqns must be a collection of names, got the string {fqns!r}")
        return list(fqns)

    def _tracked_versions(self) -> tuple[int, ...]:
        return tuple(ema.engine.plan.tracked_version for ema in self._emas.values())

    def _check_aligned(self) -> None:
        """Refuse members whose tracked sets differ (one changed alone through
        ``multi[name].add_tensors``): their update groups would pair different tensors.
        Local; a tuple compare per update, the names compared only after a change."""
        versions = self._tracked_versions()
        if versions == self._aligned_versions:
            return
        (first_name, first), *others = self._emas.items()
        want = [entry.fqn for entry in first.engine.plan]
        for name, ema in others:
            have = [entry.fqn for entry in ema.engine.plan]
            if have != want:
                only_first = [k for k in want if k not in have]
                only_this = [k for k in have if k not in want]
                raise ValueError(
                    f"MultiModelEMA members track different tensors: {first_name!r} alone "
                    f"tracks {only_first}, {name!r} alone tracks {only_this}. Change the "
                    "tracked set with multi.add_tensors()/multi.drop_tensors(), which change "
                    "every member; no EMA was updated"
                )
        self._aligned_versions = versions

    def update(self, model: nn.Module | None = None) -> None:
        """Advance every EMA by one step. Local: **no communication**.

        One model check (and, after a change of the tracked set, a check that every member
        tracks the same tensors: ``ValueError`` naming them otherwise, nothing updated);
        for each group of local tensors, one pass over the sources that
        lerps every averaging EMA (see the module docstring); copies and skipped EMAs are
        handled per EMA. Peak extra memory: the reused upcast scratch (at most 64 MiB) for
        bf16 sources with the eager kernel; none otherwise.
        """
        grad = torch.is_grad_enabled()
        set_grad_mode(False)
        try:
            self._update(model)
        finally:
            set_grad_mode(grad)

    def _update(self, model: nn.Module | None) -> None:
        engines = [ema.engine for ema in self._emas.values()]
        for engine in engines:
            engine.check_model_argument(model)
            engine.refuse_while_swapped()
        engines[0].sync_sources()
        # Checked together last time and none re-bound since (alone or with the first): alike.
        if not all(map(operator.is_, (e.plan.binding for e in engines), self._bindings)):
            for engine in engines[1:]:
                engine.sync_sources()
            self._bindings = [e.plan.binding for e in engines]
        self._check_aligned()
        decays = [engine.advance() for engine in engines]
        for groups in zip(*(engine.groups for engine in engines), strict=True):
            averaging = [
                (g, 1.0 - d) for g, d in zip(groups, decays, strict=True) if d and g.averaged
            ]
            for group, decay in zip(groups, decays, strict=True):
                if decay is not None and not (decay and group.averaged):
                    group.apply_(decay)  # a copy
            if averaging:
                lerp_groups_([g for g, _ in averaging], [w for _, w in averaging])

    def state_dict(self) -> dict[str, Any]:
        """``{name: ModelEMA.state_dict()}``. Local; DCP ``Stateful``."""
        return {name: ema.state_dict() for name, ema in self._emas.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore every EMA; the names must match exactly. Local.

        Every member's state is validated (:func:`dtensor_ema.state.validate_state`: names,
        shapes, dtypes, options, a counter that fits an int64) before any is written, so a
        refused state leaves all of them unchanged.
        """
        if set(state_dict) != set(self._emas):
            raise ValueError(
                f"checkpoint EMAs {sorted(state_dict)} != this MultiModelEMA's {sorted(self._emas)}"
            )
        for name, ema in self._emas.items():
            try:
                validate_state(state_dict[name], ema.state_dict())
            except (KeyError, ValueError) as e:
                raise type(e)(f"EMA {name!r}: {e}") from e
        for name, ema in self._emas.items():
            ema.load_state_dict(state_dict[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: decay={e.decay}" for n, e in self._emas.items())
        return f"{type(self).__name__}({type(self.model).__name__}, {{{inner}}})"
