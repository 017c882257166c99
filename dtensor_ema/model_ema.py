"""ModelEMA: an exponential moving average of a model's weights, sharded across ranks.

Every EMA element lives on exactly one rank: each tensor's local piece (the whole tensor for
plain/DDP models, ``to_local()`` for FSDP2/TP parameters) is split by rows over the mesh
dims it is replicated on (:mod:`dtensor_ema.layout`), so memory and update work are about
``1/W`` of a replicated EMA, and ``update()`` never communicates: one fused ``lerp`` per
(device, dtype) group over cached local views (:mod:`dtensor_ema.update.fused_update`).

The math (:mod:`dtensor_ema.update.counter`): every ``update()`` call counts; every
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

:class:`ModelEMA` is the user-facing face: it resolves the arguments into one
:class:`~dtensor_ema.options.EmaOptions` and delegates to its
:class:`~dtensor_ema.engine.EmaEngine` (``ema.engine``), which owns the EMA's state (what
it owns, and who reads its plan: :mod:`dtensor_ema.engine`, ``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema._collectives import collective
from dtensor_ema.decay import DecaySchedule
from dtensor_ema.engine import EmaEngine
from dtensor_ema.materialize.ema_module import UnitSpec
from dtensor_ema.materialize.full_state import (
    gather_options,
    gather_state,
    iter_state,
    load_full_state,
)
from dtensor_ema.materialize.gather import DEFAULT_BUCKET_BYTES
from dtensor_ema.options import (
    UNSET,
    EmaOptions,
    ExcludeSpec,
    Formula,
    TrackSpec,
)
from dtensor_ema.state import load_local_state, local_state
from dtensor_ema.update.counter import check_count
from dtensor_ema.update.cuda_graph import GraphDecision

__all__ = ["ModelEMA"]

StateDict = dict[str, Any]


class ModelEMA:
    """Sharded exponential moving average of ``model``'s parameters and float buffers.

    Every option is described, with its formula and the library it mimics, in
    ``docs/options.md``; the schedules in :mod:`dtensor_ema.decay`.

    Args:
        model: a plain ``nn.Module``, a DDP-wrapped one, an FSDP2 (``fully_shard``) one, or
            a DeepSpeed engine (or its ``.module``) on ZeRO stage 0-3 (under ZeRO-3 each rank
            averages its own partitions). The EMA tracks the unwrapped module
            (``ema.model``); keys never carry ``module.``.
        mesh: the world ``DeviceMesh`` (any number of dims) whose ranks share the EMA. Each
            tensor's local piece is split by rows over the mesh dims it is replicated on
            (:mod:`dtensor_ema.layout`). ``None``: the DTensor parameters' root mesh, else
            the default process group as a 1-D mesh, else plain unsharded tensors
            (:func:`~dtensor_ema.layout.resolve_world_mesh`).
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
            Untracked tensors are neither stored nor updated; whole-model outputs read them
            from the model. Change the set with :meth:`add_tensors`/:meth:`drop_tensors`
            (with ``"trainable"``, ``update()`` raises once ``requires_grad`` changed).
        ema_dtype: EMA dtype; default float32 for fp16/bf16 tensors, else the model's.
        capturable: counter and decay on the device: ``update()`` never syncs the host and
            compiles with ``torch.compile(ema.update, fullgraph=True)``.
        offload: keep the EMA shards in host memory; a worker applies each step behind the
            next training step (:func:`dtensor_ema.engine.make_updater` picks it). Reads
            wait for it (:meth:`flush`); :meth:`close` stops it.
        kernel: ``"auto"`` (default), ``"eager"`` or ``"compiled"``; same bits.
        parameters_as_bucket_view: keep this rank's shards as views into one flat buffer
            per (device, dtype) in gather order (``ZeroRedundancyOptimizer``'s name).
            Default ``False``: torch 2.14's ``dcp.async_save`` cannot stage such views.
        replicate_buffers: keep plain float buffers (BatchNorm statistics) whole on every
            rank, each averaging its own model's, as a replicated EMA does (costs their
            full bytes per rank; not with :meth:`build_module`). Default ``False``: sharded.
        verify_replicas: check at construction that replicated parameters are identical
            across replicas (default ``True``); ``False`` only if the first update copies.
        cuda_graph: ``True``: on CUDA, replay a captured graph of the update (raises where
            that is not exact); ``None`` (default): eager until replay is proven on hardware;
            ``False``: never (:func:`dtensor_ema.update.cuda_graph.decide`, :attr:`cuda_graph`).
        formula: how an averaging step rounds ``d * ema + (1 - d) * model``: ``"lerp"``
            (default) or another library's (:data:`dtensor_ema.update.fused_update.FORMULAS`;
            eager kernel, one temporary of this rank's shard size per update).

    Construction is **collective** over ``mesh``: every rank of it must construct the EMA
    together (:func:`~dtensor_ema.plan.build_plan`: one all-gather of a structure
    fingerprint per mesh dim, one of one checksum per replicated parameter per replica
    group, one flag all-reduce per mesh dim). Build the EMA after DDP wraps the model:
    replicated parameters that differ across replicas are refused, by name. The EMA tracks
    the model's live parameters and persistent buffers (never ``state_dict()`` copies).
    Peak extra memory: the EMA shards themselves (``1/W`` of the tracked float bytes, in
    the EMA dtype).

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
        options = dict(locals())  # every argument but these four is an option, by name
        for name in ("self", "model", "mesh", "updates"):
            del options[name]
        self._start(model, mesh, EmaOptions.from_arguments(**options), check_count(updates))

    def _start(
        self, model: nn.Module, mesh: DeviceMesh | None, options: EmaOptions, updates: int
    ) -> None:
        """Build the engine over ``model`` (collective); for ``__init__`` and ``__setstate__``."""
        self.options = options
        self.engine = EmaEngine(model, mesh, options, updates=updates)
        """Plan, counter, update groups, updater (:class:`~dtensor_ema.engine.EmaEngine`)."""
        self.model, self.mesh = self.engine.model, self.engine.world

    # ------------------------------------------------------------------ reading
    @property
    def cuda_graph(self) -> GraphDecision:
        """``(use, reason)``: whether ``update()`` replays a captured CUDA graph, and why."""
        return self.engine.graph_decision

    @property
    def updates(self) -> int:
        """Number of ``update()`` calls so far (plus the initial ``updates``). Waits for a
        pending offloaded update; synchronizes with ``capturable=True``."""
        self.flush()
        return self.engine.counter.current()

    @updates.setter
    def updates(self, value: int) -> None:
        self.engine.counter.assign(value)

    @property
    def last_decay(self) -> float | None:
        """Decay of the most recent averaging ``update()`` (``0.0`` for a copy); ``None``
        before the first. Synchronizes with ``capturable=True``."""
        self.flush()
        return self.engine.counter.last_decay()

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
        return self.engine.counter.decay_at(self.updates + 1 if updates is None else updates)

    def ema_tensors(self) -> dict[str, torch.Tensor]:
        """``fqn -> EMA tensor`` (DTensor, or plain without a mesh) for every tracked tensor
        (tied duplicates once). Live tensors: no copy. A ZeRO-3 parameter's is flat (1-D,
        ``Shard(0)``); :meth:`get_ema_state_dict` gives real shapes."""
        self.flush()
        return {e.fqn: e.ema for e in self.engine.plan}

    def local_numel(self) -> int:
        """Number of EMA elements this rank stores (its shards, plus replicated 0-dim ones)."""
        return sum(e.ema_local.numel() for e in self.engine.plan)

    def local_nbytes(self) -> int:
        """Bytes of EMA storage held by this rank."""
        return self.engine.plan.local_nbytes()

    @property
    def untracked(self) -> list[str]:
        """Canonical fqns of the model's floating-point tensors the EMA does not hold
        (``track=``, :meth:`drop_tensors`; tied duplicates once), in state-dict order."""
        return list(self.engine.plan.untracked)

    # ------------------------------------------------------------------ tracked set
    @collective("add_tensors")
    @torch.no_grad()
    def add_tensors(self, fqns: Iterable[str]) -> None:
        """Start averaging untracked tensors (progressive unfreezing, adapters added
        later): each starts from the model's current value, with this EMA's counter and
        schedule. **Collective** over the mesh: every rank calls it with the same names.

        With ``track="trainable"`` it also accepts the model's current trainable set
        (``ema.add_tensors([])`` does only that). ``exclude``/``buffers="copy"`` apply to
        the new tensors as to the others. Collectives: one flag all-reduce and one
        structure all-gather per mesh dim, the replica check of the new parameters
        (:meth:`~dtensor_ema.engine.EmaEngine.change_tracked`). Peak extra memory: the new
        shards (``parameters_as_bucket_view=True``: a second copy of this rank's EMA while
        its flat buffers are rebuilt).

        Raises:
            ValueError: a name that is not an untracked float tensor of the model, ranks
                that passed different names, or ``cuda_graph=True`` and a new tensor's EMA
                dtype rules the graph out; nothing changes then.
            RuntimeError: inside ``average_parameters()``, or after :attr:`module` was
                built (it holds the old set: build it after the change).
        """
        self.engine.change_tracked(fqns, add=True)

    @collective("drop_tensors")
    @torch.no_grad()
    def drop_tensors(self, fqns: Iterable[str]) -> None:
        """Stop averaging tracked tensors and free their EMA shards; they are read from the
        model from then on (as untracked tensors). **Collective** over the mesh, like
        :meth:`add_tensors`, which it mirrors (and with ``track="trainable"`` it accepts
        the current trainable set too). Collectives: one flag all-reduce and one structure
        all-gather per mesh dim. Peak extra memory: none (``parameters_as_bucket_view=True``:
        a copy of the EMA this rank keeps, while its flat buffers are rebuilt).

        Raises:
            ValueError: a name that is not tracked, dropping every tracked tensor, or ranks
                that passed different names; nothing changes then.
            RuntimeError: inside ``average_parameters()``, or after :attr:`module` was built.
        """
        self.engine.change_tracked(fqns, add=False)

    # ------------------------------------------------------------------ update
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
        if model is not None:
            self.engine.check_model_argument(model)
        self.engine.step()

    @torch.no_grad()
    def set(self, model: nn.Module | None = None) -> None:
        """Re-initialize the EMA from the model's current weights. Local: no communication.

        ``updates`` is unchanged (timm ``ModelEmaV3.set``); use ``load_state_dict`` or
        assign ``ema.updates`` to restart the decay schedule too. Peak extra memory: none.
        """
        self.engine.check_model_argument(model)
        self.engine.copy_from_model()

    def flush(self) -> None:
        """Wait until every submitted ``update()`` has been applied (``offload=True``
        applies them behind the training step); every read of the EMA calls it. Local.

        Raises:
            RuntimeError: an offloaded update failed (chained); it is lost and not counted,
                the EMA and ``updates`` stay at the step before it. Raised once.
        """
        self.engine.flush()

    def close(self) -> None:
        """Finish the pending update and stop the ``offload=True`` worker. Local, idempotent.
        Reading the EMA still works afterwards; ``update()`` and ``set()`` raise. ``with
        ModelEMA(...) as ema:`` closes on exit."""
        self.engine.close()

    def __enter__(self) -> ModelEMA:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ evaluation
    @collective("average_parameters", communicates=lambda ema: ema.engine.swap_communicates())
    @contextlib.contextmanager
    def average_parameters(
        self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[nn.Module]:
        """Swap the EMA weights into the model for evaluation; restore them on exit.

        Yields the unwrapped model. Only tracked tensors are swapped. Each rank rebuilds
        only its own local piece of every tensor (:func:`~dtensor_ema.materialize.swap.
        swapped_in`): the full model is never gathered on a rank; under DeepSpeed ZeRO-3
        the EMA goes into each rank's partitions, so the engine's own forward evaluates it.

        **Collective** over the groups of the replica dims (the whole mesh for plain/DDP
        models, HSDP's replicate dim, ``tp`` for TP-replicated weights, the mesh for the
        ZeRO-3 parameters DeepSpeed holds whole; nothing for 1-D FSDP2 parameters), on entry
        and on exit: every rank must enter, between steps. Peak extra memory: the backup
        (``1/W`` of the swapped parameter bytes, full copies of tracked plain buffers) plus
        twice one gathered bucket (at most ``bucket_bytes``).

        Raises:
            RuntimeError: the context is entered again while active. An error while
                swapping in restores the raw weights first; ``update()`` inside raises.
        """
        with self.engine.swapped_in(bucket_bytes) as model:
            yield model

    @property
    def module(self) -> nn.Module:
        """The EMA as a forward-capable ``nn.Module`` (timm's ``ModelEmaV3.module``), built
        on first access with :meth:`build_module`'s defaults. Alias: :attr:`ema_model`.
        Refused for DeepSpeed ZeRO-3 models (evaluate inside :meth:`average_parameters`)."""
        built = self.engine.module
        return self.build_module() if built is None else built

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
        the model's local shard of the parameters split over the replicate dim). See
        :func:`~dtensor_ema.materialize.ema_module.build_ema_module` and ``docs/evaluation.md``.
        Tensors the EMA does not track (``track=``) are the model's own, shared (so the
        module's ``load_state_dict`` refuses a state that holds them:
        :func:`~dtensor_ema.materialize.twin.guard_untracked_loads`).

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
                ``replicate_buffers=True``, those of ``build_ema_module``), naming it.
            ValueError: bad ``units`` or ``compute_dtype``.
        """
        return self.engine.build_module(self.mesh, units, compute_dtype)

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
            ``(ema_state_dict, original_state_dict)``: whole state dicts keyed like the
            unwrapped model's ``state_dict()`` (its post-hooks applied), ready for
            ``load_state_dict(strict=True)`` (:func:`~dtensor_ema.materialize.full_state.
            gather_state`); untracked tensors carry the model's value. Peak extra memory:
            the two results plus one bucket.
        """
        self.engine.settle()
        options = gather_options(rank0_only, only_rank0_receives, cpu_offload, bucket_bytes)
        plan = self.engine.plan
        ema = gather_state(plan, self.model, "ema", **options)
        return ema, gather_state(plan, self.model, "model", **options)

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
        tensors (their tied duplicates too) under the model's keys: a whole state dict,
        equal to ``get_model_state_dict()[0]``, when the EMA tracks every float tensor or
        with ``include_untracked`` (the rest from the model:
        :func:`~dtensor_ema.materialize.full_state.gather_state`).

        For export: with ``only_rank0_receives`` and ``cpu_offload`` rank 0 holds one full
        copy of the EMA plus one bucket, the other ranks one bucket. Arguments as for
        :meth:`get_model_state_dict`.
        """
        self.engine.settle()
        options = gather_options(rank0_only, only_rank0_receives, cpu_offload, bucket_bytes)
        return gather_state(
            self.engine.plan, self.model, "ema", include_untracked=include_untracked, **options
        )

    @collective("iter_state_dict")
    def iter_state_dict(
        self,
        which: Literal["ema", "model"] = "ema",
        *,
        only_rank0_receives: bool = False,
        cpu_offload: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        include_untracked: bool = True,
    ) -> Iterator[StateDict]:
        """:meth:`get_ema_state_dict` (``which="model"``: the model's current weights, as
        :meth:`get_model_state_dict`'s second dict) in pieces, for a writer that streams.
        **Collective**: every rank of the mesh (and of every FSDP2 mesh) must run the
        iterator to its end.

        Each piece holds the full tensors of a run of the model's keys of at most
        ``bucket_bytes``; every key comes once (:func:`~dtensor_ema.materialize.full_state.
        iter_state`). ``include_untracked`` (default ``True`` here): the pieces make a whole
        state dict. Peak extra memory: one piece (and what the model's hooks allocate on
        it), once the caller drops the previous one.
        """
        self.engine.settle()
        return iter_state(
            self.engine.plan, self.model, which,
            rank0_only=only_rank0_receives, cpu_offload=cpu_offload,
            bucket_bytes=bucket_bytes, include_untracked=include_untracked,
        )  # fmt: skip

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: StateDict, *, updates: int | None = None) -> None:
        """Load full EMA weights keyed like the model: :meth:`get_ema_state_dict` output or
        an :func:`~dtensor_ema.export_ema` file. Local: no collective.

        Call it on every rank with the same full tensors: each rank copies its own piece
        (the model's ``load_state_dict`` pre-hooks run first;
        :func:`~dtensor_ema.materialize.full_state.load_full_state`). The counter is set
        to ``updates`` when given. Peak extra memory: none beyond the given tensors.

        Raises:
            ValueError: as ``load_full_state``, or a bad ``updates``. Nothing is written then.
        """
        self.flush()
        if updates is not None:
            check_count(updates)
        load_full_state(self.engine.plan, self.model, state_dict)
        if updates is not None:
            self.engine.restore_count(updates)
        else:
            self.engine.invalidate()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> StateDict:
        """The EMA's own state for DCP: this rank's live EMA shards, the counter and config.

        Local (no collective), no copy: ``{"updates": int, "config": str, "ema": {fqn:
        DTensor}}`` (:mod:`dtensor_ema.state`; ``config`` is the JSON of the options that
        shape the next update). ``"ema"`` holds the tracked tensors only; when some float
        tensor is untracked, ``config`` says so (``"track"`` and the ``"untracked"``
        names). Each DTensor holds **only this rank's piece**: save with DCP on every rank
        (``save_checkpoint``/``dcp.save``), not ``torch.save`` on one rank (for one file
        use :meth:`get_ema_state_dict`). ``dcp.load`` fills the live tensors in place; do
        not update them while an ``async_save`` is pending.
        """
        self.flush()
        return local_state(self.engine.plan, self.engine.counter.current(), self.engine.config())

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict, *, common_subset: bool = False) -> None:
        """Restore from :meth:`state_dict` output (this rank's or a DCP load's).

        Local: no collective, ever. ``"ema"`` values may be this EMA's own live tensors (a
        DCP load filled them in place), DTensors holding **this rank's** piece with this
        EMA's mesh and placements, or full plain tensors (sliced to this rank's piece).
        Everything is checked before anything is written (names, shapes, dtypes, options;
        the counter must fit an int64, the options' numbers be finite): a refused state
        leaves the EMA's tensors, counter, options and tracked set unchanged. Peak extra
        memory: none (shards are copied in place).

        Args:
            state_dict: the state.
            common_subset: accept a state saved with another tracked set of the same model
                (``track=``, :meth:`add_tensors`): load the tensors both track, leave the
                others as they are (the counter is loaded).

        Raises:
            KeyError: ``state_dict`` lacks ``"ema"`` or ``"updates"`` (a full model state
                dict belongs in :meth:`load_full_state_dict`).
            ValueError: as :func:`~dtensor_ema.state.validate_state` (names, shapes,
                dtypes, the tracked set, the counter, the options), or DTensors saved by
                another rank or laid out differently (load those through DCP).
        """
        updates = load_local_state(
            self.engine.plan, state_dict, self.state_dict(), common_subset=common_subset
        )
        self.engine.restore_count(updates)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """``pickle``/``torch.save(ema)``/``copy.deepcopy`` support: the model, the options,
        the counter and the full EMA values; the plan, update groups, updater and EMA module
        are rebuilt on load. Local. Only without a process group or on a one-rank mesh (the
        EMA is whole on this rank), for a model without DTensor parameters.

        Loading it needs ``torch.load(path, weights_only=False)``. A copy tracks its own
        model: the copy of ``ema.model`` made with it. Peak extra memory: one copy of the
        EMA while saving (deepcopy: plus the copy itself).

        Raises:
            RuntimeError: as :meth:`~dtensor_ema.engine.EmaEngine.whole_state` (sharded,
                DTensors, inside ``average_parameters()``), naming what to save instead.
        """
        return {"model": self.model, "options": self.options, **self.engine.whole_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from :meth:`__getstate__`: construct over ``state["model"]`` in this
        process, then load the EMA values and the counter. Collective where construction is."""
        options = _pickled_options(state)
        unchecked = dataclasses.replace(options, verify_replicas=False)  # values loaded next
        self._start(state["model"], None, unchecked, state["updates"])
        self.options = options  # the EMA's own, for the next copy
        self.engine.load_whole_state(state["ema"], state["updates"])

    def __repr__(self) -> str:
        mesh = f"mesh={tuple(self.mesh.shape)}" if self.mesh is not None else "unsharded"
        plan = self.engine.plan
        untracked = f", untracked={len(plan.untracked)}" if plan.untracked else ""
        return (
            f"{type(self).__name__}({type(self.model).__name__}, {mesh}, "
            f"decay={self.decay}, tau={self.tau}, updates={self.engine.counter.current()}, "
            f"tensors={len(plan.entries)}{untracked}, local_numel={self.local_numel()})"
        )


def _pickled_options(state: dict[str, Any]) -> EmaOptions:
    """The options of a pickled :class:`ModelEMA` (one pickled before ``replicate_buffers``
    and ``parameters_as_bucket_view`` joined the options kept them beside it)."""
    options: EmaOptions = state["options"]
    if "replicate_buffers" not in state:
        return options
    return dataclasses.replace(
        options,
        replicate_buffers=state["replicate_buffers"],
        bucket_view=state["parameters_as_bucket_view"],
    )
