"""ModelEMA: an exponential moving average of a model's weights, sharded across ranks.

Every EMA element lives on exactly one rank: each tensor's local piece (the whole tensor for
plain/DDP models, ``to_local()`` for FSDP2/TP parameters) is split by rows over the mesh
dims it is replicated on (:mod:`dtensor_ema.layout`), so memory and update work are about
``1/W`` of a replicated EMA, and ``update()`` never communicates: one fused ``lerp`` per
(device, dtype) group over cached local views (:mod:`dtensor_ema.fused_update`).

The math (:mod:`dtensor_ema.counter`): every ``update()`` call counts; every
``update_every``-th call averages, with ``step = updates - update_after_step``::

    d = 0                                        # step <= 0: copy the model
    d = schedule(step) ** update_every           # otherwise (see dtensor_ema.decay)
    ema = ema.lerp(model.to(ema.dtype), 1 - d)   # i.e. ema = d * ema + (1 - d) * model

for every tracked floating-point parameter and buffer (``track=``: all of them by default,
or the trainable ones, or a predicate; untracked ones are neither stored nor updated and
are read from the model); ``exclude=`` names and ``buffers="copy"`` copy instead; integer
buffers follow the model. Schedules: the yolov5 ramp (default),
``half_life``, ``WarmupDecay`` (timm/ema-pytorch), or any ``step -> decay`` callable.
Because ``lerp`` is elementwise, the sharded result equals an unsharded EMA bit for bit.

:class:`ModelEMA` orchestrates; each piece of state has one owner: the plan (the
model-to-EMA binding, :mod:`dtensor_ema.plan`), the counter, the updater (inline, device,
offloaded: :mod:`dtensor_ema.updater`; CUDA graphs: :mod:`dtensor_ema.cuda_graph`), the
swap (:mod:`dtensor_ema.swap`), full state dicts (:mod:`dtensor_ema.full_state`), the
local checkpoint state (:mod:`dtensor_ema.state`) and the EMA module
(:mod:`dtensor_ema.ema_module`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema import cuda_graph as _graphs
from dtensor_ema._collectives import collective, entering
from dtensor_ema.counter import UpdateCounter, check_count
from dtensor_ema.decay import DecaySchedule
from dtensor_ema.ema_module import UnitSpec, build_ema_module
from dtensor_ema.full_state import gather_state, load_full_state, rank0_flag
from dtensor_ema.fused_update import CountedStep, UpdateGroup, update_groups
from dtensor_ema.layout import resolve_world_mesh
from dtensor_ema.materialize import DEFAULT_BUCKET_BYTES
from dtensor_ema.options import (
    UNSET,
    EmaOptions,
    ExcludeSpec,
    Formula,
    TrackSpec,
    resolve_schedule,
)
from dtensor_ema.plan import (
    EmaPlan,
    build_plan,
    ema_local_from_full,
    model_tensors,
    reshard_fsdp,
    unwrap_model,
)
from dtensor_ema.state import load_local_state, local_state
from dtensor_ema.swap import swapped_in
from dtensor_ema.twin import guard_untracked_loads
from dtensor_ema.updater import CapturableUpdater, Updater, make_updater

__all__ = ["ModelEMA"]

StateDict = dict[str, Any]


class ModelEMA:
    """Sharded exponential moving average of ``model``'s parameters and float buffers.

    Every option is described, with its formula and the library it mimics, in
    ``docs/options.md``; the schedules in :mod:`dtensor_ema.decay`.

    Args:
        model: a plain ``nn.Module``, a DDP-wrapped one, or an FSDP2 (``fully_shard``) one.
            The EMA tracks the unwrapped module (``ema.model``); keys never carry ``module.``.
        mesh: the world ``DeviceMesh`` (any number of dims) whose ranks share the EMA. Each
            tensor's local piece is split by rows over the mesh dims it is replicated on
            (the whole mesh for plain/DDP tensors, HSDP's replicate dim, ``tp`` for
            TP-replicated weights); sharded dims keep the parameter's own placements.
            ``None``: the DTensor parameters' root mesh, else the default process group as
            a 1-D mesh, else plain unsharded tensors (:func:`~dtensor_ema.layout.
            resolve_world_mesh`).
        decay: asymptotic decay in ``[0, 1]`` of the default yolov5 ramp (``0.9999``).
        tau: ramp time constant in steps (``>= 0``, default ``2000``); ``None``/``0``: constant.
        updates: initial value of the update counter (``>= 0``).
        schedule: instead of ``decay``/``tau``: a :mod:`dtensor_ema.decay` schedule, a
            callable ``step -> decay``, or an :class:`~dtensor_ema.options.AveragingFunction`
            (torch's ``avg_fn``/``multi_avg_fn``, applied to this rank's pieces; it must be
            elementwise, which construction checks).
        half_life: instead of ``decay``/``tau``: constant ``0.5 ** (update_every / half_life)``.
        update_every: average on every ``update_every``-th call only, with the decay raised
            to this power (the EMA's memory in steps does not change).
        update_after_step: the first ``update_after_step`` calls copy the model.
        buffers: ``"average"`` float buffers (default) or ``"copy"`` them (timm
            ``exclude_buffers``).
        exclude: fqns, or a predicate ``(fqn, tensor) -> bool``, of tracked tensors copied
            instead of averaged (still stored: ``exclude`` applies within the tracked set).
        track: which floating-point tensors the EMA holds: ``"all"`` parameters and
            buffers (default), ``"trainable"`` (parameters with ``requires_grad=True``: a
            LoRA/PEFT model's adapters), or a predicate ``(fqn, tensor) -> bool`` (canonical
            fqn, the model's live tensor; tied tensors are decided by their first name).
            Untracked tensors are neither stored nor updated: memory is the tracked bytes
            / W, swaps and :meth:`state_dict` cover the tracked tensors only, and whole-model
            outputs (:meth:`get_model_state_dict`, :attr:`module`, ``export_ema``) read them
            from the model. Change the set later with :meth:`add_tensors` /
            :meth:`drop_tensors`; with ``"trainable"``, an ``update()`` after
            ``requires_grad`` changed raises, naming the parameters.
        ema_dtype: EMA dtype; default float32 for fp16/bf16 tensors, else the model's.
        capturable: counter and decay on the device: ``update()`` never syncs the host and
            compiles with ``torch.compile(ema.update, fullgraph=True)``.
        offload: keep the EMA shards in host memory; a worker thread applies each step
            behind the next training step, from a host snapshot of the source shards
            (CUDA: pinned, copied on a side stream that the current stream waits for; the
            path last proven on a GPU, :data:`dtensor_ema.updater.CUDA_OFFLOAD`; the
            chunked device pipeline is opt-in until proven there). Reads wait for it
            (:meth:`flush`); :meth:`close` stops it.
        kernel: ``"auto"`` (default), ``"eager"`` or ``"compiled"``; same bits.
        parameters_as_bucket_view: keep this rank's shards as views into one flat buffer
            per (device, dtype) in gather order, so materializing sends without packing
            (``ZeroRedundancyOptimizer``'s name). Default ``False``: torch 2.14's
            ``dcp.async_save`` cannot stage such views (``dcp.save`` can).
        replicate_buffers: keep plain float buffers (BatchNorm statistics) whole on every
            rank, each averaging its own model's, as a replicated EMA does (costs their
            full bytes per rank; not with :meth:`build_module`). Default ``False``: sharded.
        verify_replicas: check at construction that replicated parameters are identical
            across replicas (default ``True``, :mod:`dtensor_ema.replicas`); ``False`` only
            for EMAs whose first update copies the model.
        cuda_graph: ``True``: on CUDA, replay a captured graph of the update (raises
            where that is not exact, see :func:`dtensor_ema.cuda_graph.decide`); ``None``
            (default): eager, since replay is opt-in until proven on hardware
            (:data:`dtensor_ema.cuda_graph.AUTO_REPLAY`); ``False``: never. The decision
            and its reason are in :attr:`cuda_graph`.
        formula: how an averaging step rounds ``d * ema + (1 - d) * model``: ``"lerp"``
            (default), ``"weighted_sum"``, ``"subtract"``, ``"subtract_alpha"``, or torch
            SWA's ``"divide"``/``"swa"`` (with ``RunningMeanDecay``)
            (:data:`dtensor_ema.fused_update.FORMULAS`; eager kernel, one temporary of this
            rank's shard size per update).

    Construction is **collective** over ``mesh``: every rank of it must construct the EMA
    together (one all-gather of a structure fingerprint per mesh dim, one of one checksum
    per replicated parameter per replica group, one flag all-reduce per mesh dim; with
    ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>`` a missing rank is named after that long).
    Build the EMA after DDP wraps the model: replicated parameters that differ across
    replicas are refused, by name. The EMA tracks the model's live parameters and
    persistent buffers (never ``state_dict()`` copies), keyed by canonical fqns
    (:mod:`dtensor_ema.model_keys`). Peak extra memory: the EMA shards themselves (``1/W``
    of the tracked float bytes, in the EMA dtype).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh`` is not a ``DeviceMesh``.
        ValueError: an option out of range or conflicting with another, unknown or
            untracked ``exclude`` names, a mesh whose device type differs from the model's
            or that does not cover the parameters' meshes, a model with no tracked float
            state, ranks that track different models, tensors or replicas,
            ``cuda_graph=True`` where a graph is unsafe (each message names the value).
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh | None = None,
        decay: float = UNSET,
        tau: float | None = UNSET,
        updates: int = 0,
        *,
        schedule: DecaySchedule | Callable[[int], float] | None = None,
        half_life: float | None = None,
        update_every: int = 1,
        update_after_step: int = 0,
        buffers: Literal["average", "copy"] = "average",
        exclude: ExcludeSpec = None,
        track: TrackSpec = "all",
        ema_dtype: torch.dtype | None = None,
        capturable: bool = False,
        offload: bool = False,
        kernel: Literal["eager", "compiled", "auto"] = "auto",
        parameters_as_bucket_view: bool = False,
        replicate_buffers: bool = False,
        verify_replicas: bool = True,
        cuda_graph: bool | None = None,
        formula: Formula = "lerp",
    ) -> None:
        self.options = EmaOptions(
            schedule=resolve_schedule(decay, tau, half_life, schedule),
            update_every=update_every,
            update_after_step=update_after_step,
            buffers=buffers,
            exclude=exclude,
            track=track,
            ema_dtype=ema_dtype,
            capturable=capturable,
            offload=offload,
            kernel=kernel,
            cuda_graph=cuda_graph,
            formula=formula,
        )
        check_count(updates)
        if not isinstance(parameters_as_bucket_view, bool):
            raise TypeError(
                f"parameters_as_bucket_view must be a bool, got {parameters_as_bucket_view!r}"
            )
        self.model = unwrap_model(model)
        reshard_fsdp(self.model)
        device = _model_device(self.model)
        self.mesh = resolve_world_mesh(mesh, model_tensors(self.model).values(), device)
        self._counter = UpdateCounter(self.options, updates, device)
        with entering("ModelEMA", mesh=self.mesh):
            self._plan: EmaPlan = build_plan(
                self.model,
                self.mesh,
                ema_dtype=ema_dtype,
                offload=offload,
                bucket_view=parameters_as_bucket_view,
                replicate_buffers=replicate_buffers,
                verify_replicas=verify_replicas,
                track=None if track == "all" else self.options.tracks,
                watch_trainable=track == "trainable",
            )
        self.replicate_buffers = replicate_buffers
        self._bucket_view = parameters_as_bucket_view
        self._copied = self.options.copied_fqns(
            {e.fqn: e.source for e in self._plan},
            {e.fqn for e in self._plan if e.is_parameter},
            self._plan.untracked,
        )
        for entry in self._plan:
            entry.averaged = entry.fqn not in self._copied
        self._groups = self._build_groups()
        # Decided (and refused, for cuda_graph=True) before any thread or stream exists.
        self._graph_request = (cuda_graph, device, offload)
        self._graph_decision = self._resolve_graph()
        self._updater: Updater = make_updater(self._groups, capturable=capturable, offload=offload)
        self._swapped = False
        self._module: nn.Module | None = None
        self._use_graph_decision()

    def _resolve_graph(self) -> _graphs.GraphDecision:
        """The CUDA-graph decision for the current tracked set (its EMA dtypes decide).

        Raises:
            ValueError: ``cuda_graph=True`` where the decision is no.
        """
        requested, device, offload = self._graph_request
        fn = self.options.function
        return _graphs.resolve(
            requested,
            device,
            offload=offload,
            schedule=self.options.schedule,
            ema_dtypes={e.ema_local.dtype for e in self._plan},
            formula=self.options.formula if fn is None else fn.kind,
        )

    def _use_graph_decision(self) -> None:
        _graphs.log_decision(self._graph_decision, self._graph_request[1].type)
        use = self._graph_decision.use
        self._graph = _graphs.GraphedStep(self._graph_request[1]) if use else None

    # ------------------------------------------------------------------ reading
    @property
    def cuda_graph(self) -> _graphs.GraphDecision:
        """``(use, reason)``: whether ``update()`` replays a captured CUDA graph, and why."""
        return self._graph_decision

    @property
    def updates(self) -> int:
        """Number of ``update()`` calls so far (plus the initial ``updates``). Waits for a
        pending offloaded update; synchronizes with ``capturable=True``."""
        self.flush()
        return self._counter.current()

    @updates.setter
    def updates(self, value: int) -> None:
        self._counter.assign(value)

    @property
    def last_decay(self) -> float | None:
        """Decay of the most recent averaging ``update()`` (``0.0`` for a copy); ``None``
        before the first. Synchronizes with ``capturable=True``."""
        self.flush()
        return self._counter.last_decay()

    @property
    def schedule(self) -> DecaySchedule:
        """The decay schedule (see :mod:`dtensor_ema.decay`)."""
        return self.options.schedule

    @property
    def decay(self) -> float | None:
        """Asymptotic decay of the schedule, where it has one."""
        return getattr(self.schedule, "decay", None)

    @property
    def tau(self) -> float | None:
        """Ramp time constant in steps, where the schedule has one."""
        return getattr(self.schedule, "tau", None)

    def get_decay(self, updates: int | None = None) -> float:
        """Decay an averaging update applies when the counter reaches ``updates`` (default:
        the next call's). ``0.0`` means a copy; calls skipped by ``update_every`` apply
        nothing."""
        return self._counter.decay_at(self.updates + 1 if updates is None else updates)

    def ema_tensors(self) -> dict[str, torch.Tensor]:
        """``fqn -> EMA tensor`` (DTensor, or plain without a mesh) for every tracked tensor
        (tied duplicates once). Live tensors: no copy."""
        self.flush()
        return {e.fqn: e.ema for e in self._plan}

    def local_numel(self) -> int:
        """Number of EMA elements this rank stores (its shards, plus replicated 0-dim ones)."""
        return sum(e.ema_local.numel() for e in self._plan)

    def local_nbytes(self) -> int:
        """Bytes of EMA storage held by this rank."""
        return sum(e.ema_local.numel() * e.ema_local.element_size() for e in self._plan)

    @property
    def untracked(self) -> list[str]:
        """Canonical fqns of the model's floating-point tensors the EMA does not hold
        (``track=``, :meth:`drop_tensors`; tied duplicates once), in state-dict order."""
        return list(self._plan.untracked)

    # ------------------------------------------------------------------ tracked set
    @collective("add_tensors")
    @torch.no_grad()
    def add_tensors(self, fqns: Iterable[str]) -> None:
        """Start averaging untracked tensors (progressive unfreezing, adapters added
        later): each starts from the model's current value, with this EMA's counter and
        schedule. **Collective** over the mesh: every rank calls it with the same names.

        With ``track="trainable"`` it also accepts the model's current trainable set
        (``ema.add_tensors([])`` does only that), so the next ``update()`` no longer
        raises about it. ``exclude``/``buffers="copy"`` apply to the new tensors as to the
        others (a name in an ``exclude`` list is copied). Collectives: one flag all-reduce
        and one structure all-gather per mesh dim, the replica check of the new parameters.
        Peak extra memory: the new shards (``parameters_as_bucket_view=True``: a second
        copy of this rank's EMA while its flat buffers are rebuilt).

        Raises:
            ValueError: a name that is not an untracked float tensor of the model (each
                named with the reason), ranks that passed different names, or
                ``cuda_graph=True`` and a new tensor's EMA dtype rules the graph out (as
                at construction; auto falls back to eager, and returns to the graph when
                the set allows it again); nothing changes then.
            RuntimeError: inside ``average_parameters()``, or after :attr:`module` was
                built (it holds the old set: build it after the change).
        """
        self._change_tracked(fqns, add=True)

    @collective("drop_tensors")
    @torch.no_grad()
    def drop_tensors(self, fqns: Iterable[str]) -> None:
        """Stop averaging tracked tensors and free their EMA shards; they are read from the
        model from then on (as untracked tensors). **Collective** over the mesh, like
        :meth:`add_tensors`, which it mirrors (and with ``track="trainable"`` it accepts
        the current trainable set too). Collectives: one flag all-reduce and one structure
        all-gather per mesh dim. Peak extra memory: none
        (``parameters_as_bucket_view=True``: a copy of the EMA this rank keeps, while its
        flat buffers are rebuilt).

        Raises:
            ValueError: a name that is not tracked, dropping every tracked tensor, or ranks
                that passed different names; nothing changes then.
            RuntimeError: inside ``average_parameters()``, or after :attr:`module` was built.
        """
        self._change_tracked(fqns, add=False)

    def _change_tracked(self, fqns: Iterable[str], *, add: bool) -> None:
        if isinstance(fqns, str):
            raise TypeError(f"fqns must be a collection of names, got the string {fqns!r}")
        self.flush()
        self._refuse_while_swapped()
        verb = "add_tensors" if add else "drop_tensors"
        if self._module is not None:
            raise RuntimeError(
                f"{verb}() after ema.module was built: the module holds the old tracked set. "
                "Change the tracked set before the first access of ema.module"
            )
        if self._plan.sync(check_trainable=False):
            self._rebind_groups()
        names = list(fqns)
        if add:
            trainable_before = self._plan.trainable
            added = self._plan.track_(names)
            try:  # the new EMA dtypes may rule out the CUDA graph (cuda_graph=True raises)
                decision = self._resolve_graph()
            except ValueError:
                self._plan.untrack_([entry.fqn for entry in added])  # as before the call,
                self._plan.trainable = trainable_before  # the trainable-set check included
                self._rebind_groups()
                raise
            for entry in added:
                if self.options.is_copied(entry.fqn, entry.source, entry.is_parameter):
                    self._copied.add(entry.fqn)
        else:
            self._plan.untrack_(names)
            self._copied -= set(names)
            decision = self._resolve_graph()
        for entry in self._plan:
            entry.averaged = entry.fqn not in self._copied
        self._rebind_groups()
        failed_capture = self._graph_decision.reason.startswith(_graphs.CAPTURE_FAILED)
        if decision != self._graph_decision and not failed_capture:  # a failure stays eager
            self._graph_decision = decision
            self._use_graph_decision()

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, model: nn.Module | None = None) -> None:
        """Advance the average by one step. Local: **no communication**.

        Call after ``optimizer.step()`` on every rank. Increments ``updates``; on averaging
        calls reads only this rank's piece of each tracked tensor and runs one fused
        ``torch._foreach_lerp_`` per (device, dtype) group (``_foreach_copy_`` for copies).
        Peak extra memory: none for float32 sources (bf16/fp16: one reused upcast scratch;
        an :class:`~dtensor_ema.AveragingFunction` schedule: one copy of this rank's EMA
        shard, its results computed before any is written).

        Args:
            model: optional, for timm-style ``ema.update(model)``; must be the tracked model
                (or a wrapper of it).

        Raises:
            ValueError: ``model`` is not the tracked model, or the tracked model's tensor
                names, shapes or dtypes changed since construction (EMA untouched).
        """
        self._check_model_argument(model)
        self.flush()  # an earlier offloaded update that failed raises before this one counts
        if (
            self._graph is not None
            and self._graph.failed is None
            and not _graphs.stream_is_capturing()
        ):
            self._update_graphed()
        elif self.options.capturable:
            self._refuse_while_swapped()
            self._counter.device_step(self._updater)
        else:
            self._sync_sources()
            updates, decay = self._counter.next_step()
            self._counter.device_stale = True
            if decay is None:
                self._counter.record(updates, None)
            else:
                step = decay
                if decay and self.options.counted:  # not a copy: the formula reads the count
                    step = CountedStep(decay, updates - self.options.update_after_step)
                self._updater.submit(step, lambda: self._counter.record(updates, decay))

    def _update_graphed(self) -> None:
        """The device-side update, captured on the first call and replayed afterwards
        (re-captured after the plan re-binds). The host counts beside the device (unless
        ``capturable``), so reading ``updates`` does not synchronize."""
        assert self._graph is not None
        self._updater._check_open()
        self._sync_sources()  # refuses while swapped; drops the graph if tensors moved
        self._counter.refresh_device()
        if self.options.capturable:
            self._graph(self._device_step_fn)
        else:
            updates, decay = self._counter.next_step()
            self._graph(self._device_step_fn)
            self._counter.record(updates, decay)
        if self._graph.failed is not None:  # the step ran eagerly; the host path from now on
            self._graph_decision = _graphs.GraphDecision(
                False, f"{_graphs.CAPTURE_FAILED}: {self._graph.failed}"
            )
            if self.options.cuda_graph is True:
                raise RuntimeError(
                    f"cuda_graph=True, but capturing the update failed ({self._graph.failed}); "
                    "this call's update was applied eagerly and counted"
                )

    def _device_step_fn(self) -> Callable[[], None]:
        """The step a graph captures, bound to the current groups."""
        return functools.partial(self._counter.device_step, CapturableUpdater(self._groups))

    @torch.no_grad()
    def set(self, model: nn.Module | None = None) -> None:
        """Re-initialize the EMA from the model's current weights. Local: no communication.

        ``updates`` is unchanged (timm ``ModelEmaV3.set``); use ``load_state_dict`` or
        assign ``ema.updates`` to restart the decay schedule too.
        """
        self._check_model_argument(model)
        self.flush()
        self._sync_sources()
        self._updater._check_open()
        for group in self._groups:
            group.copy_()

    def flush(self) -> None:
        """Wait until every submitted ``update()`` has been applied (``offload=True``
        applies them behind the training step). Every method that reads the EMA calls it.
        Local.

        Raises:
            RuntimeError: an offloaded update failed (chained); it is lost and not counted,
                the EMA and ``updates`` stay at the step before it. Raised once.
        """
        self._updater.wait()

    def close(self) -> None:
        """Finish the pending update and stop the ``offload=True`` worker. Local, idempotent.
        Reading the EMA still works afterwards; ``update()`` and ``set()`` raise. ``with
        ModelEMA(...) as ema:`` closes on exit."""
        self._updater.close()

    def __enter__(self) -> ModelEMA:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _advance(self) -> float | None:
        """Count one call now, for callers that apply the step themselves
        (:class:`~dtensor_ema.MultiModelEMA`); its decay, ``0.0`` to copy, ``None`` to skip."""
        return self._counter.advance()

    # ------------------------------------------------------------------ evaluation
    @collective("average_parameters")
    @contextlib.contextmanager
    def average_parameters(
        self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[nn.Module]:
        """Swap the EMA weights into the model for evaluation; restore them on exit.

        Yields the unwrapped model. Only tracked tensors are swapped (untracked ones are
        the model's own already). Each rank rebuilds only its own local piece of every
        tensor (:mod:`dtensor_ema.swap`): the full model is never gathered on a rank.

        **Collective** over the groups of the replica dims (the whole mesh for plain/DDP
        models, HSDP's replicate dim, ``tp`` for TP-replicated weights; nothing for 1-D
        FSDP2 parameters), on entry and on exit: every rank must enter, between steps.

        Peak extra memory: the backup (``1/W`` of the swapped (tracked) parameter bytes,
        full copies of tracked plain buffers) plus twice one gathered bucket (at most
        ``bucket_bytes``).

        Raises:
            RuntimeError: the context is entered again while active. An error while
                swapping in restores the raw weights first; ``update()`` inside raises.
        """
        if self._swapped:
            raise RuntimeError(
                "average_parameters() is already active for this EMA; exit it before "
                "entering it again"
            )
        self.flush()
        self._sync_sources()
        self._swapped = True
        try:
            with swapped_in(self._plan, self.model, bucket_bytes):
                yield self.model
        finally:
            self._swapped = False

    @property
    def module(self) -> nn.Module:
        """The EMA as a forward-capable ``nn.Module`` (timm's ``ModelEmaV3.module``), built
        on first access with :meth:`build_module`'s defaults. Alias: :attr:`ema_model`."""
        return self.build_module() if self._module is None else self._module

    @property
    def ema_model(self) -> nn.Module:
        """Alias of :attr:`module` (ema-pytorch's name)."""
        return self.module

    def build_module(
        self, *, units: UnitSpec = None, compute_dtype: torch.dtype | None = None
    ) -> nn.Module:
        """Build :attr:`module`, a twin of the model whose parameters ARE the EMA.

        Local: no collective. Call it (with options) on every rank before the first access
        of :attr:`module`; once built, the module is reused and ``update()`` writes where
        its forward reads. No second copy of the EMA is kept (HSDP with ``mesh=None``: plus
        the model's local shard of the parameters split over the replicate dim). Works on
        wrapped (activation checkpointing), compiled and torchtitan-parallelized models;
        see :func:`~dtensor_ema.ema_module.build_ema_module` and ``docs/evaluation.md``.
        Tensors the EMA does not track (``track=``) are the model's own, shared, never
        copied nor sharded in the twin (with a mesh, each unit gathers them from the
        model's pieces around its forward, as the model's own forward would); so the
        module's ``load_state_dict`` refuses a state that holds them (``ValueError``,
        nothing written), which would write into the model.

        Calling the module is **collective** over the EMA mesh (every rank calls it, the
        same number of times): FSDP all-gathers one unit at a time. Peak extra memory:
        about the largest unit's full weights in the compute dtype (plus FSDP's prefetch)
        plus activations. It starts in ``eval()`` mode with ``requires_grad=False``;
        outputs equal an unsharded model loaded with ``get_model_state_dict()[0]`` (rel.
        error <= 1e-5).

        Args:
            units: FSDP units: ``None`` (each child of an ``nn.ModuleList``/
                ``nn.Sequential``), module fqns, or a predicate ``(fqn, module) -> bool``.
            compute_dtype: dtype the forward computes in (``None``: the model's own).

        Raises:
            RuntimeError: the module was already built.
            NotImplementedError: a layout the twin cannot mirror (``offload=True``,
                ``replicate_buffers=True``, and those named by
                :func:`~dtensor_ema.ema_module.build_ema_module`), naming it.
            ValueError: bad ``units`` or ``compute_dtype``.
        """
        if self._module is not None:
            raise RuntimeError(
                "ema.module was already built (build_module() runs once, before the first "
                "access of ema.module); reuse ema.module"
            )
        if self.replicate_buffers and self.mesh is not None:
            raise NotImplementedError(
                "ema.module with replicate_buffers=True is not implemented; use "
                "average_parameters() or get_model_state_dict() to evaluate"
            )
        if self.options.offload:
            mesh = self.mesh.mesh.tolist() if self.mesh is not None else None
            raise NotImplementedError(
                "ema.module with offload=True is not implemented: the EMA shards live in host "
                f"memory on a CPU twin of the mesh {mesh}, where no forward can read them; "
                "evaluate with ema.average_parameters()"
            )
        self.flush()
        self._sync_sources()  # refuses inside average_parameters()
        module = build_ema_module(
            self.model, self._plan, self.mesh, units=units, compute_dtype=compute_dtype
        )
        if self._plan.untracked:
            guard_untracked_loads(module, self._plan)
        self._rebind_groups()  # the EMA's local shards may have moved into the module
        self._module = module
        return module

    # ------------------------------------------------------------------ full state dicts
    @collective("get_model_state_dict")
    def get_model_state_dict(
        self,
        *,
        only_rank0_receives: bool = False,
        cpu_offload: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        rank0_only: bool | None = None,
    ) -> tuple[StateDict, StateDict]:
        """Full EMA weights and a copy of the model's current weights. **Collective.**

        Every rank of the mesh (and of every FSDP2 mesh) must call this. Shards travel in
        flat buckets: one all-gather per (mesh, dtype) bucket, not one per tensor.

        Args:
            only_rank0_receives: only global rank 0 gets the tensors (every rank still
                calls; the others get two empty dicts and, where the layout allows a
                ``dist.gather``, hold at most their ``1/W`` share of one bucket).
            cpu_offload: return CPU tensors; device memory stays at about one bucket.
            bucket_bytes: bound on the bytes one all-gather moves.
            rank0_only: deprecated name of ``only_rank0_receives``.

        Returns:
            ``(ema_state_dict, original_state_dict)``: whole state dicts, full contiguous
            tensors keyed like the unwrapped model's ``state_dict()`` (canonical fqns, then
            the model's own state-dict post-hooks: torchtitan's fused ``wqkv`` comes out as
            ``wq``/``wk``/``wv``), in the model's dtypes, ready for
            ``load_state_dict(strict=True)``. Integer buffers, and in the first dict the
            tensors the EMA does not track (``track=``), carry the model's value. Neither
            shares memory with the model or the EMA. Peak extra memory: the two results
            plus one bucket.
        """
        options = self._gather_options(rank0_only, only_rank0_receives, cpu_offload, bucket_bytes)
        ema = gather_state(self._plan, self.model, "ema", **options)
        return ema, gather_state(self._plan, self.model, "model", **options)

    @collective("get_ema_state_dict")
    def get_ema_state_dict(
        self,
        *,
        only_rank0_receives: bool = False,
        cpu_offload: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        rank0_only: bool | None = None,
        include_untracked: bool = False,
    ) -> StateDict:
        """The EMA's tensors, full, keyed like the model. **Collective.**

        Every rank of the mesh (and of every FSDP2 mesh) must call this. Holds the tracked
        tensors only (their tied duplicates too), under the model's keys; when the EMA
        tracks every float tensor (the default ``track="all"``) that is a whole state dict,
        integer buffers (the model's values) included, equal to
        ``get_model_state_dict()[0]``. With ``include_untracked`` it always is: untracked
        tensors and integer buffers come from the model, as in
        :meth:`get_model_state_dict`, for a plain model's ``load_state_dict(strict=True)``.

        For export: with ``only_rank0_receives`` and ``cpu_offload`` rank 0 holds one full
        copy of the EMA plus one bucket, the other ranks one bucket. Arguments as for
        :meth:`get_model_state_dict`.
        """
        options = self._gather_options(rank0_only, only_rank0_receives, cpu_offload, bucket_bytes)
        return gather_state(
            self._plan, self.model, "ema", include_untracked=include_untracked, **options
        )

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: StateDict, *, updates: int | None = None) -> None:
        """Load full EMA weights keyed like the model: :meth:`get_ema_state_dict` output or
        an :func:`~dtensor_ema.export_ema` file. Local: no collective.

        Call it on every rank with the same full tensors: each rank copies its own piece.
        The model's ``load_state_dict`` pre-hooks run first (torchtitan's ``wq``/``wk``/
        ``wv`` fuse into ``wqkv``); values are cast to the EMA dtype; integer buffers, tied
        duplicates and untracked tensors may be absent (present ones are ignored). The counter
        is set to ``updates`` when given. Peak extra memory: none beyond the given tensors.

        Raises:
            ValueError: missing or unexpected names, shape mismatches, non-float values for
                averaged tensors, a bad ``updates``. Nothing is written then.
        """
        self.flush()
        if updates is not None:
            check_count(updates)
        load_full_state(self._plan, self.model, state_dict)
        if updates is not None:
            self._counter.restore(updates)
        self._invalidate_graph()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> StateDict:
        """The EMA's own state for DCP: this rank's live EMA shards, the counter and config.

        Local (no collective), no copy: ``{"updates": int, "config": str, "ema": {fqn:
        DTensor}}`` (:mod:`dtensor_ema.state`; ``config`` is the JSON of the options that
        shape the next update). ``"ema"`` holds the tracked tensors only; when some float
        tensor is untracked, ``config`` says so (``"track"`` and the ``"untracked"``
        names). Each DTensor holds **only this rank's piece**: save with
        DCP on every rank (``save_checkpoint``/``dcp.save``), not ``torch.save`` on one
        rank (for one file use :meth:`get_ema_state_dict`). ``dcp.load`` fills the live
        tensors in place; do not update them while an ``async_save`` is pending.
        """
        self.flush()
        config = json.dumps(self.options.config(self._copied, self._plan.untracked), sort_keys=True)
        return local_state(self._plan, self._counter.current(), config)

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict, *, common_subset: bool = False) -> None:
        """Restore from :meth:`state_dict` output (this rank's or a DCP load's).

        Local: no collective, ever. ``"ema"`` values may be this EMA's own live tensors (a
        DCP load filled them in place), DTensors holding **this rank's** piece with this
        EMA's mesh and placements, or full plain tensors (sliced to this rank's piece).
        Everything is checked before anything is written: a refused state leaves the EMA
        and its counter unchanged. Peak extra memory: none (shards are copied in place).

        Args:
            state_dict: the state.
            common_subset: accept a state saved with another tracked set of the same model
                (``track=``, :meth:`add_tensors`): load the tensors both track, leave the
                others as they are (the counter is loaded).

        Raises:
            KeyError: ``state_dict`` lacks ``"ema"`` or ``"updates"`` (a full model state
                dict belongs in :meth:`load_full_state_dict`).
            ValueError: missing/unexpected fqns, shape or dtype mismatches, another tracked
                set (naming the tensors each side tracks alone; unless ``common_subset``),
                options different from this EMA's (resuming with other options would not
                continue the saved trajectory), or DTensors saved by another rank or laid
                out differently (load those through DCP).
        """
        updates = load_local_state(
            self._plan, state_dict, self.state_dict(), common_subset=common_subset
        )
        self._counter.restore(updates)
        self._invalidate_graph()

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """``pickle``/``torch.save(ema)``/``copy.deepcopy`` support: the model, the options,
        the counter and the full EMA values; the plan, update groups, updater and EMA module
        are rebuilt on load. Local. Only without a process group or on a one-rank mesh (the
        EMA is whole on this rank), for a model without DTensor parameters.

        Loading a pickled ``ModelEMA`` needs ``torch.load(path, weights_only=False)`` (it
        is a whole object, as for any pickled module). A copy tracks its own model: the
        copy of ``ema.model`` made with it (``copy.deepcopy(ema)`` copies the model, as
        ``copy.deepcopy`` of any object holding it does). Peak extra memory: one copy of the
        EMA while saving (deepcopy: plus the copy itself).

        Raises:
            RuntimeError: the EMA is sharded over several ranks, or tracks DTensors (the
                message says what to save instead), or it is swapped into the model
                (inside ``average_parameters()``: the copy's model would hold the EMA
                weights in place of the training weights).
        """
        if self._swapped:
            raise RuntimeError(
                "cannot pickle, torch.save or deepcopy a ModelEMA inside average_parameters(): "
                "its model holds the EMA weights there, so the copy's model would start from "
                "them instead of the training weights. Copy it after the context exits"
            )
        world = self.mesh.size() if self.mesh is not None else 1
        dtensors = [e.fqn for e in self._plan if e.is_dtensor_source]
        if world > 1 or dtensors:
            what = (
                f"sharded over {world} ranks (each holds 1/{world} of it)"
                if world > 1
                else f"tracking DTensor parameters ({dtensors[:3]})"
            )
            raise RuntimeError(
                f"cannot pickle, torch.save or deepcopy a ModelEMA {what}: it would hold one "
                "rank's piece. Save its state instead: dtensor_ema.save_checkpoint(path, ema) "
                "(DCP, every rank writes its own shards; reshards on load), or the full EMA "
                "with ema.get_ema_state_dict() (collective) and torch.save on one rank; the "
                "drop-ins' state_dict() after gather_for_save() on every rank"
            )
        self.flush()
        return {
            "model": self.model,
            "options": self.options,
            "updates": self._counter.current(),
            "ema": {e.fqn: e.ema_local.detach().clone() for e in self._plan},
            "replicate_buffers": self.replicate_buffers,
            "parameters_as_bucket_view": self._bucket_view,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from :meth:`__getstate__`: construct over ``state["model"]`` in this
        process (its process group decides the layout, as for a new ``ModelEMA``), then
        load the EMA values and the counter. Collective where construction is."""
        options: EmaOptions = state["options"]
        kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        ModelEMA.__init__(
            self,
            state["model"],
            updates=state["updates"],
            replicate_buffers=state["replicate_buffers"],
            parameters_as_bucket_view=state["parameters_as_bucket_view"],
            verify_replicas=False,  # the saved values are loaded next
            **kwargs,
        )
        # The saved tracked set wins over what track= picks now (add_tensors/drop_tensors
        # before the save); this EMA is whole on this rank, so the changes are local.
        tracked = {e.fqn for e in self._plan}
        missing = [k for k in state["ema"] if k not in tracked]
        extra = [k for k in tracked if k not in state["ema"]]
        if missing:
            self._change_tracked(missing, add=True)
        if extra:
            self._change_tracked(extra, add=False)
        with torch.no_grad():
            for entry in self._plan:
                entry.ema_local.copy_(ema_local_from_full(entry, state["ema"][entry.fqn]))
        self._counter.restore(state["updates"])

    def __repr__(self) -> str:
        mesh = f"mesh={tuple(self.mesh.shape)}" if self.mesh is not None else "unsharded"
        untracked = f", untracked={len(self._plan.untracked)}" if self._plan.untracked else ""
        return (
            f"{type(self).__name__}({type(self.model).__name__}, {mesh}, "
            f"decay={self.decay}, tau={self.tau}, updates={self._counter.current()}, "
            f"tensors={len(self._plan.entries)}{untracked}, local_numel={self.local_numel()})"
        )

    # ------------------------------------------------------------------ internals
    def _gather_options(
        self, rank0_only: bool | None, only_rank0: bool, cpu_offload: bool, bucket_bytes: int
    ) -> dict[str, Any]:
        self.flush()
        self._sync_sources()
        return {
            "rank0_only": rank0_flag(rank0_only, only_rank0),
            "cpu_offload": cpu_offload,
            "bucket_bytes": bucket_bytes,
        }

    def _check_model_argument(self, model: nn.Module | None) -> None:
        if model is not None and unwrap_model(model) is not self.model:
            raise ValueError(
                f"got a {type(model).__name__} that is not the model this EMA tracks "
                f"({type(self.model).__name__} at {id(self.model):#x}); create a new "
                "ModelEMA for a different model"
            )

    def _refuse_while_swapped(self) -> None:
        if self._swapped:
            raise RuntimeError(
                "the EMA weights are swapped into the model (inside average_parameters()); "
                "update, set or materialize the EMA after the context exits"
            )

    def _sync_sources(self) -> None:
        """Let the plan re-bind its views after model surgery; rebuild the update groups
        when a tensor moved. Raises ``ValueError`` (EMA untouched) if the model changed."""
        self._refuse_while_swapped()
        if self._plan.sync():
            self._rebind_groups()

    def _build_groups(self) -> list[UpdateGroup]:
        options = self.options
        return update_groups(self._plan, options.kernel, options.formula, options.function)

    def _rebind_groups(self) -> None:
        """Rebuild the update groups from the plan; a captured graph read the old
        addresses, so it is dropped (the next ``update()`` captures again)."""
        self.flush()
        self._groups = self._build_groups()
        self._updater.rebind(self._groups)
        self._invalidate_graph()

    def _invalidate_graph(self) -> None:
        """Loads write in place (addresses hold), but a re-capture rules out any state the
        graph baked in; plan re-binds move addresses."""
        if self._graph is not None:
            self._graph.invalidate()


def _model_device(module: nn.Module) -> torch.device:
    for tensor in model_tensors(module).values():
        return tensor.device
    raise ValueError(f"{type(module).__name__} has no parameters or buffers to average")
