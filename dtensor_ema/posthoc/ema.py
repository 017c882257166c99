"""Post-hoc EMA (EDM2): track a few power-function EMAs sharded, snapshot them periodically,
and choose the EMA length after training with :func:`~dtensor_ema.synthesize`.

Karras et al. 2024 ("Analyzing and Improving the Training Dynamics of Diffusion Models")
showed that the EMA length matters a great deal and can be picked after training: keep two
power-function EMAs (``sigma_rel`` 0.05 and 0.10), save both every few thousand steps, and
reconstruct any other ``sigma_rel`` as a least-squares combination of the snapshots
(:mod:`dtensor_ema.posthoc.phema_math` has the formulas).

:class:`PostHocEMA` tracks the profiles as a :class:`~dtensor_ema.MultiModelEMA` (the same
sharded plan as :class:`~dtensor_ema.ModelEMA`, one pass over the parameters for all
profiles, no communication in ``update()``) whose schedules are power functions of the time
``t``, and writes each snapshot as a sharded DCP checkpoint (every rank writes only its own
shards) with a manifest (:mod:`dtensor_ema.snapshots`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema._collectives import agree as _agree
from dtensor_ema._collectives import agree_on_call
from dtensor_ema._collectives import group_of as _group
from dtensor_ema._collectives import quiet_single_process as _quiet_single_process
from dtensor_ema._collectives import rank_of as _rank
from dtensor_ema.checkpoint.checksums import RecordingWriter, write_checksums
from dtensor_ema.checkpoint.same_path import agree_on_path
from dtensor_ema.checkpoint.storage import local_directory
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.multi import MultiModelEMA
from dtensor_ema.options import ExcludeSpec, TrackSpec, check_int
from dtensor_ema.plan import model_tensors
from dtensor_ema.posthoc import snapshots as snap
from dtensor_ema.posthoc.phema_math import (
    check_sigma_rel,
    gamma_to_sigma_rel,
    power_beta,
    sigma_rel_to_gamma,
)
from dtensor_ema.state import CONFIG, EMA_TENSORS

__all__ = ["PostHocEMA", "PowerDecay"]

StateDict = dict[str, Any]
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class _Clock:
    """The time the next update brings the run to, shared by every profile's schedule."""

    __slots__ = ("delta", "t")

    def __init__(self) -> None:
        self.t = 0
        self.delta = 1


class PowerDecay:
    """Power-function EMA schedule (EDM2 eq. 127): ``beta = (1 - delta/t) ** (gamma + 1)``.

    ``t`` is read from a clock that :class:`PostHocEMA` advances before each update (in
    updates, or in samples with ``update(samples=n)``); ``delta`` is what the update adds.
    The first update (``t == delta``) returns 0: it copies the model. ``config()`` names only
    ``gamma``, so a checkpoint resumes with the same profile whatever the clock's unit.
    """

    __slots__ = ("_clock", "gamma")

    def __init__(self, gamma: float, clock: _Clock) -> None:
        self.gamma = float(gamma)
        self._clock = clock

    def __call__(self, step: int) -> float:
        return power_beta(self.gamma, self._clock.t, self._clock.delta)

    def decay_for(self, step: int, update_every: int) -> float:
        if update_every != 1:
            raise ValueError("a power-function EMA averages on every update (update_every=1)")
        return self(step)

    def decay_tensor_for(self, step: torch.Tensor, update_every: int) -> torch.Tensor:
        raise NotImplementedError("PostHocEMA does not support capturable updates")

    def config(self) -> dict[str, Any]:
        return {"schedule": "power", "gamma": self.gamma}

    def __repr__(self) -> str:
        return f"PowerDecay(gamma={self.gamma:.6g})"


class PostHocEMA:
    """Power-function EMAs of ``model``, sharded, snapshotted for post-hoc EMA synthesis.

    Args:
        model: as for :class:`~dtensor_ema.ModelEMA` (plain, DDP, FSDP2); so are ``mesh``,
            ``buffers``, ``exclude`` and ``ema_dtype``, shared by every profile.
        sigma_rels: relative widths of the tracked profiles, each in ``(0, 0.2887)``; EDM2
            tracks ``(0.05, 0.10)``.
        snapshot_every: take a snapshot on every ``snapshot_every``-th ``update()`` call
            (``None``: only on explicit :meth:`snapshot` calls).
        snapshot_dir: where snapshots go (a directory of a file system every rank sees, not
            an object-store URL; needed to snapshot).
        track: which floating-point tensors the profiles hold, as for
            :class:`~dtensor_ema.ModelEMA`: ``"all"`` (default), ``"trainable"`` (a LoRA
            model's adapters), or a predicate ``(fqn, tensor) -> bool``. Snapshots then
            hold the tracked tensors only (``1/W`` of their bytes per rank; integer buffers
            are followed only when every float tensor is tracked), the manifest lists the
            ``untracked`` ones, and :func:`~dtensor_ema.synthesize` returns the tracked
            tensors (export a PEFT adapter with
            :func:`~dtensor_ema.export.peft.save_peft_adapter`). Change the set with
            ``ph.emas.add_tensors``/``drop_tensors``; snapshots on both sides of a change are
            not synthesized together.
        snapshot_dtype: dtype the snapshots store floating-point tensors in (``bfloat16`` or
            ``float16`` halve the files); default: each EMA tensor's own dtype.
        async_save: write snapshots with ``dcp.async_save`` behind training: the call
            returns once the shards are copied, and the snapshot is committed (renamed into
            place) by the next :meth:`snapshot`, :meth:`state_dict` or :meth:`wait`.
        process_group: the ranks that write snapshots together (default: the whole default
            group; an asynchronous save uses a dedicated gloo group over those ranks,
            created at the first asynchronous snapshot, which every rank of the default
            group must then take part in). With pipeline stages (a different model per
            stage) give each stage its own ``snapshot_dir`` and ``process_group``: rank 0 of
            the group writes the manifest.
        gammas: the profiles' exponents instead of ``sigma_rels`` (keyword only; each
            ``>= 0``); ``sigma_rels`` is then derived from them (eq. 125) and ignored.

    Time is counted in updates, or in samples when every ``update()`` passes ``samples=``
    (EDM2 counts images): the averaging horizon then survives batch-size and world-size
    changes. The first update decides; mixing the two raises.

    Construction communicates as :class:`~dtensor_ema.ModelEMA`'s does and must happen on
    every rank.

    Peak extra memory: one EMA shard per profile (``len(sigma_rels) / W`` of the model's
    tracked floats, in ``ema_dtype``); an asynchronous snapshot holds one more copy of the shards
    (in ``snapshot_dtype``) until it is written.

    Raises:
        ValueError: a ``sigma_rel`` outside ``(0, 0.2887)``, duplicate ``sigma_rels``,
            ``snapshot_every`` that is not a positive int, ``snapshot_every`` without
            ``snapshot_dir``, a ``snapshot_dir`` that is an object-store URL, or a
            ``snapshot_dtype`` that is not a floating dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        sigma_rels: Sequence[float] = (0.05, 0.10),
        snapshot_every: int | None = None,
        snapshot_dir: str | Path | None = None,
        mesh: DeviceMesh | None = None,
        *,
        buffers: Literal["average", "copy"] = "average",
        exclude: ExcludeSpec = None,
        track: TrackSpec = "all",
        ema_dtype: torch.dtype | None = None,
        snapshot_dtype: torch.dtype | None = None,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
        gammas: Sequence[float] | None = None,
    ) -> None:
        if gammas is not None:
            # Exponents given exactly (ema-pytorch's constructor takes them): sigma_rels are
            # derived from them, never the other way round, so no gamma is re-rounded.
            if isinstance(gammas, (int, float)) or not gammas:
                raise ValueError(f"gammas must be a non-empty sequence, got {gammas!r}")
            bad = [g for g in gammas if isinstance(g, bool) or not float(g) >= 0.0]
            if bad:
                raise ValueError(f"gammas must be numbers >= 0, got {list(gammas)}")
            sigma_rels = tuple(gamma_to_sigma_rel(float(g)) for g in gammas)
        if isinstance(sigma_rels, (int, float)):
            raise TypeError(f"sigma_rels must be a sequence, e.g. (0.05, 0.10), got {sigma_rels}")
        self.sigma_rels = tuple(
            check_sigma_rel(s, f"sigma_rels[{i}]") for i, s in enumerate(sigma_rels)
        )
        if not self.sigma_rels:
            raise ValueError("sigma_rels must name at least one profile, e.g. (0.05, 0.10)")
        if len(set(self.sigma_rels)) != len(self.sigma_rels):
            raise ValueError(f"sigma_rels has duplicates: {self.sigma_rels}")
        if snapshot_every is not None and (
            isinstance(snapshot_every, bool)
            or not isinstance(snapshot_every, int)
            or snapshot_every < 1
        ):
            raise ValueError(f"snapshot_every must be an int >= 1 or None, got {snapshot_every!r}")
        if snapshot_every is not None and snapshot_dir is None:
            raise ValueError(f"snapshot_every={snapshot_every} needs a snapshot_dir")
        if snapshot_dtype is not None and not (
            isinstance(snapshot_dtype, torch.dtype) and snapshot_dtype.is_floating_point
        ):
            raise ValueError(
                f"snapshot_dtype must be a floating-point torch.dtype, got {snapshot_dtype!r}"
            )
        self.gammas = (
            tuple(float(g) for g in gammas)
            if gammas is not None
            else tuple(sigma_rel_to_gamma(s) for s in self.sigma_rels)
        )
        self.snapshot_every = snapshot_every
        self.snapshot_dir = (
            None if snapshot_dir is None else local_directory(snapshot_dir, "snapshot_dir")
        )
        self.snapshot_dtype = snapshot_dtype
        self.async_save = bool(async_save)
        self._process_group = process_group
        self._async_group: dist.ProcessGroup | None = None
        self._pending: tuple[Future[Any] | Any, RecordingWriter, str, dict[str, Any]] | None = None
        self._clock = _Clock()
        self._steps = 0
        self._time: Literal["steps", "samples"] | None = None
        self.emas = MultiModelEMA(
            model,
            {f"p{i}": {"schedule": PowerDecay(g, self._clock)} for i, g in enumerate(self.gammas)},
            mesh,
            buffers=buffers,
            exclude=exclude,
            track=track,
            ema_dtype=ema_dtype,
        )

    # ----------------------------------------------------------------------- tracking
    @property
    def steps(self) -> int:
        """Number of ``update()`` calls so far."""
        return self._steps

    @property
    def t(self) -> int:
        """Current time: ``steps``, or the number of samples seen with ``update(samples=)``."""
        return self._clock.t

    @property
    def time_unit(self) -> Literal["steps", "samples"] | None:
        """``"steps"`` or ``"samples"`` once the first update decided; ``None`` before."""
        return self._time

    @property
    def untracked(self) -> list[str]:
        """The model's floating-point tensors the profiles do not hold (``track=``), in
        state-dict order: not in the snapshots, nor in what they synthesize."""
        return self.emas["p0"].untracked

    def profile(self, sigma_rel: float) -> ModelEMA:
        """The :class:`~dtensor_ema.ModelEMA` tracking ``sigma_rel`` (evaluate it with
        ``ph.profile(0.10).average_parameters()``)."""
        if sigma_rel not in self.sigma_rels:
            raise KeyError(f"sigma_rel {sigma_rel} is not tracked; tracked: {self.sigma_rels}")
        return self.emas[f"p{self.sigma_rels.index(sigma_rel)}"]

    @torch.no_grad()
    def update(self, samples: int | None = None) -> None:
        """Advance every profile by one update; snapshot every ``snapshot_every`` calls.

        Local (**no communication**) except on snapshot calls, which are collective (see
        :meth:`snapshot`). Call after ``optimizer.step()`` on every rank.

        Args:
            samples: samples (images, tokens) this update stands for, summed over all ranks
                (the same number on every rank). Time then counts samples and the decay is
                ``(1 - samples/t) ** (gamma + 1)``; without it, time counts updates.

        Raises:
            ValueError: ``samples`` not a positive int, or mixed with sample-less calls.
        """
        unit: Literal["steps", "samples"] = "steps" if samples is None else "samples"
        if samples is not None:
            check_int("samples", samples, 1)
        if self._time is not None and unit != self._time:
            raise ValueError(
                f"update(samples={samples}) but this PostHocEMA counts time in {self._time}: "
                "pass samples= on every update() call or on none"
            )
        delta = 1 if samples is None else samples
        self._clock.t, self._clock.delta = self._clock.t + delta, delta
        try:
            self.emas.update()
        except Exception:
            self._clock.t -= delta
            raise
        self._time = unit
        self._steps += 1
        if self.snapshot_every is not None and self._steps % self.snapshot_every == 0:
            self.snapshot()

    @torch.no_grad()
    def update_at(self, steps: int, t: int | None = None, delta: int = 1) -> None:
        """Count update call ``steps``; with ``t``, also update at that explicit time. Local.

        For facades whose clock is not :meth:`update`'s (ema-pytorch counts calls, averages
        on every ``update_every``-th one with ``beta = (1 - 1/(calls + 1)) ** (gamma + 1)``,
        and names snapshots by calls): the decay is ``power_beta(gamma, t, delta)``
        (``delta == t`` copies the model). Takes no snapshot.

        Raises:
            ValueError: ``delta`` not in ``(0, t]``; nothing changed.
        """
        if t is not None:
            power_beta(0.0, t, delta)  # validates 0 < delta <= t before anything changes
            saved = (self._clock.t, self._clock.delta)
            self._clock.t, self._clock.delta = t, delta
            try:
                self.emas.update()
            except Exception:
                self._clock.t, self._clock.delta = saved
                raise
            self._time = "steps"
        self._steps = steps

    # ----------------------------------------------------------------------- snapshots
    def snapshot(self) -> Path | None:
        """Save every profile as one sharded DCP checkpoint under ``snapshot_dir``.

        **Collective** over ``process_group``: the ranks first agree that each takes this
        snapshot at the same step (one small all-gather over ``process_group``), and each
        profile's ranks that it is the same profile (one per mesh dim of its mesh,
        :func:`~dtensor_ema._collectives.agree_on_call`), then on the folder and one save
        id (one all-reduce of 16 bytes per rank, as :func:`~dtensor_ema.save_checkpoint`);
        then every rank writes only its own shards (plus DCP's metadata on rank 0) and the
        checksums of what it wrote (``__<rank>.checksums.json``, recording the save id).
        Written into ``step-<N>.partial`` and renamed to ``step-<N>`` with its
        ``manifest.json`` (which names the save id) only once every rank has written, so a
        crash leaves every earlier snapshot valid, and a reader refuses a folder whose
        files are not all of this save. With ``async_save`` the write continues in the
        background and the checksums and the commit happen at the next
        :meth:`snapshot`/:meth:`wait`.

        Peak extra memory: none for a synchronous save in the EMA dtype (DCP writes the live
        shards); a copy of this rank's shards in ``snapshot_dtype`` otherwise.

        Returns:
            The committed snapshot's path (``None`` for an asynchronous save, still pending).

        Raises:
            ValueError: no ``snapshot_dir``, no update yet (``t == 0``), or the ranks
                disagree (another step or other profiles on some rank; on every rank).
            RuntimeError: a rank failed to write; earlier snapshots are unchanged.
        """
        if self.snapshot_dir is None:
            raise ValueError("PostHocEMA was created without a snapshot_dir; pass one to snapshot")
        if self._clock.t == 0:
            raise ValueError("nothing to snapshot before the first update()")
        self.wait()
        group = _group(self._process_group)
        agree_on_call("snapshot", lambda: (0, self._steps), group=group)
        for ema in self.emas.values():  # each profile over its own mesh (pipeline stages)
            agree_on_call("snapshot", ema.engine.call_identity, mesh=ema.mesh)
        name = snap.snapshot_name(self._steps)
        partial = self.snapshot_dir / (name + snap.PARTIAL_SUFFIX)
        save_id = agree_on_path(group, partial, "PostHocEMA.snapshot")
        error: Exception | None = None
        if _rank(group) == 0:
            try:
                snap.prepare(self.snapshot_dir, name)
            except OSError as e:
                error = e
        _agree(group, error, f"preparing snapshot {self.snapshot_dir / name}")
        state, manifest = self._snapshot_state(copy=self.async_save, world=group)
        manifest["save_id"] = save_id
        writer = RecordingWriter(partial, save_id=save_id)
        if self.async_save:
            self._pending = (self._save_async(state, writer, group), writer, name, manifest)
            return None
        with _quiet_single_process():
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
        return self._commit(name, manifest, group, writer)

    def wait(self) -> Path | None:
        """Finish and commit a pending asynchronous snapshot. **Collective** when one is
        pending (every rank must call it); returns its path, or ``None`` if none was."""
        if self._pending is None:
            return None
        future, writer, name, manifest = self._pending
        self._pending = None
        group = _group(self._process_group)
        error: Exception | None = None
        try:
            future.result()
        except BaseException as e:  # DCP raises CheckpointException, a BaseException
            error = RuntimeError(f"asynchronous snapshot {name} failed: {e}")
        _agree(group, error, f"writing snapshot {name}")
        return self._commit(name, manifest, group, writer)

    def _save_async(
        self, state: StateDict, writer: RecordingWriter, group: dist.ProcessGroup | None
    ) -> Future[Any] | Any:
        if group is not None and self._async_group is None:
            # DCP's background thread runs collectives; on the training group they could
            # interleave with the training's own. A dedicated gloo group keeps them apart.
            new = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
            assert isinstance(new, dist.ProcessGroup)  # every rank is a member
            self._async_group = new
        with _quiet_single_process():
            return dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._async_group,
                no_dist=group is None,
            )

    def _commit(
        self,
        name: str,
        manifest: dict[str, Any],
        group: dist.ProcessGroup | None,
        writer: RecordingWriter,
    ) -> Path:
        """Every rank records the checksums of what it wrote; then rank 0 adds the manifest
        and renames the folder into place."""
        assert self.snapshot_dir is not None
        partial = self.snapshot_dir / (name + snap.PARTIAL_SUFFIX)
        error: Exception | None = None
        rank = _rank(group)
        try:
            write_checksums(writer, rank, save_id=manifest["save_id"])
        except OSError as e:
            error = e
        _agree(group, error, f"writing the checksums of snapshot {partial}")
        if rank == 0:
            try:
                snap.commit(self.snapshot_dir, name, manifest)
            except (OSError, ValueError) as e:  # ValueError: a manifest off its own schema
                error = e
        _agree(group, error, f"committing snapshot {self.snapshot_dir / name}")
        return self.snapshot_dir / name

    def _snapshot_state(
        self, *, copy: bool, world: dist.ProcessGroup | None
    ) -> tuple[StateDict, dict[str, Any]]:
        """The DCP state ``{"p<i>": {fqn: tensor}, "followed": {...}}`` and the manifest."""
        state: StateDict = {}
        tensors_meta: dict[str, dict[str, Any]] = {}
        model_sd = model_tensors(_tracked_module(self.emas["p0"]))
        for i in range(len(self.sigma_rels)):
            profile: dict[str, Any] = {}
            # The checkpoint values: ZeRO-3 entries as chunks of their real shapes.
            for fqn, ema in self.emas[f"p{i}"].state_dict()[EMA_TENSORS].items():
                dtype = self.snapshot_dtype or ema.dtype
                value = ema.detach()
                if dtype != value.dtype or copy:
                    value = value.to(dtype=dtype, copy=True)  # local per shard, no collective
                profile[fqn] = value
                if i == 0:
                    tensors_meta[fqn] = {
                        "shape": list(ema.shape),
                        "dtype": str(dtype),
                        "ema_dtype": str(ema.dtype),
                        "model_dtype": str(model_sd[fqn].dtype) if fqn in model_sd else None,
                    }
            state[f"p{i}"] = profile
        untracked = self.untracked
        # Integer buffers complete a whole state dict; with part of the model untracked the
        # output is not whole anyway, and a LoRA run's snapshots hold the adapters only.
        followed = {
            k: v.detach().clone() if copy else v.detach()
            for k, v in model_sd.items()
            if not untracked
            and not v.is_floating_point()
            and not isinstance(v, torch.distributed.tensor.DTensor)
        }
        if followed:
            state["followed"] = followed
        aliases = _aliases(model_sd, tensors_meta)
        manifest = {
            "format": snap.FORMAT,
            "step": self._steps,
            "t": self._clock.t,
            "time": self._time,
            "profiles": [
                {"key": f"p{i}", "sigma_rel": s, "gamma": g}
                for i, (s, g) in enumerate(zip(self.sigma_rels, self.gammas, strict=True))
            ],
            "tensors": tensors_meta,
            "followed": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in followed.items()
            },
            "aliases": aliases,
            "model_keys": list(model_sd),
            "world_size": dist.get_world_size(world) if world is not None else 1,
            "track": self.emas["p0"].options.track_label(),
            "untracked": untracked,
        }
        return state, manifest

    # ----------------------------------------------------------------------- checkpoint
    def state_dict(self) -> StateDict:
        """Profiles, counters and config for DCP (``Stateful``). Local, except that a
        pending asynchronous snapshot is committed first (collective, see :meth:`wait`).

        ``{"emas": {"p<i>": ModelEMA.state_dict()}, "steps": int, "t": int, "time": str,
        "config": json}``; the EMA tensors are the live sharded ones, so ``dcp.save``
        writes each rank's shards and ``dcp.load`` (at any world size) fills them in place.
        """
        self.wait()
        return {
            "emas": self.emas.state_dict(),
            "steps": self._steps,
            "t": self._clock.t,
            "time": self._time or "",
            CONFIG: json.dumps(self._config(), sort_keys=True),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore profiles and counters (from :meth:`state_dict` or a DCP load). Local.

        Raises:
            KeyError: a missing entry.
            ValueError: the checkpoint tracked other ``sigma_rels``, or bad counters.
        """
        for key in ("emas", "steps", "t", "time"):
            if key not in state_dict:
                raise KeyError(f"PostHocEMA state dict has no {key!r} entry")
        if CONFIG in state_dict:
            theirs = json.loads(state_dict[CONFIG])
            if theirs != self._config():
                raise ValueError(
                    f"checkpoint PostHocEMA config {theirs} != this one's {self._config()}: "
                    "construct PostHocEMA with the checkpoint's sigma_rels to resume"
                )
        steps, t = (_as_int(state_dict[k], k) for k in ("steps", "t"))
        time = state_dict["time"]
        if time not in ("", "steps", "samples"):
            raise ValueError(f"checkpoint 'time' must be 'steps' or 'samples', got {time!r}")
        self.emas.load_state_dict(state_dict["emas"])
        self._steps, self._clock.t = steps, t
        self._time = time or None

    def _config(self) -> dict[str, Any]:
        return {"sigma_rels": list(self.sigma_rels)}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sigma_rels={self.sigma_rels}, steps={self._steps}, "
            f"t={self._clock.t}, snapshot_every={self.snapshot_every}, "
            f"snapshot_dir={self.snapshot_dir})"
        )


def _tracked_module(ema: ModelEMA) -> nn.Module:
    """The unwrapped model the EMA tracks (``ema.model``; ``ema.module`` before it existed)."""
    model = getattr(ema, "model", None)
    return model if isinstance(model, nn.Module) else ema.module


def _aliases(model_sd: Mapping[str, torch.Tensor], tracked: Mapping[str, Any]) -> dict[str, str]:
    """Tied names (``head.weight`` sharing ``tok.weight``) -> the name the EMA tracks."""
    by_id = {id(model_sd[k]): k for k in tracked if k in model_sd}
    return {
        k: by_id[id(v)]
        for k, v in model_sd.items()
        if k not in tracked and v.is_floating_point() and id(v) in by_id
    }


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor):
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"checkpoint {name!r} must be an int >= 0, got {value!r}")
    return value
