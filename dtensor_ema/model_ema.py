"""ModelEMA: an exponential moving average of a model's weights, sharded across ranks.

Every popular EMA keeps a full replica of the model on every rank and updates all of it
every step. Here every EMA element lives on exactly one rank: each tensor's local piece
(the whole tensor for plain/DDP models, ``to_local()`` for FSDP2/TP parameters) is split
by rows over the mesh dims it is replicated on (see :mod:`dtensor_ema.layout`), so memory
and update work are about ``1/W`` of a replicated EMA, and ``update()`` never
communicates: it is one fused ``lerp`` per (device, dtype) group over cached local views.
Full weights are materialized only on request (evaluation, export), with one flat
all-gather per bucket.

The math: every ``update()`` call counts (``updates += 1``); every ``update_every``-th call
averages, with ``step = updates - update_after_step``:

    d = 0                                        # step <= 0: copy the model
    d = schedule(step) ** update_every           # otherwise (see dtensor_ema.decay)
    ema = ema.lerp(model.to(ema.dtype), 1 - d)   # i.e. ema = d * ema + (1 - d) * model

for every floating-point entry of the model's state dict (parameters and float buffers
such as BatchNorm running stats); ``exclude=`` names and ``buffers="copy"`` copy instead.
Schedules: the default yolov5 ramp ``decay * (1 - exp(-step / tau))`` (``tau=None``:
constant), ``half_life`` (``0.5 ** (update_every / half_life)`` per averaging call),
``WarmupDecay`` (timm/ema-pytorch power warm-up), or any ``step -> decay`` callable.
Integer buffers (``num_batches_tracked``) follow the model. Because ``lerp`` is
elementwise, the sharded result equals an unsharded EMA bit for bit at every world size.

Where the work happens: inline (default), on the device with no host sync
(``capturable=True``), or through host-resident shards (``offload=True``); see
:mod:`dtensor_ema.updater`. On CUDA, ``update()`` replays a captured CUDA graph of the
device-side update where that gives the same bits (``cuda_graph``; see
:mod:`dtensor_ema.cuda_graph`). ``state_dict()`` holds this rank's shards only (see
:mod:`dtensor_ema.state`).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_ema import cuda_graph as _graphs
from dtensor_ema._collectives import collective, entering
from dtensor_ema.decay import DecaySchedule
from dtensor_ema.ema_module import UnitSpec, build_ema_module
from dtensor_ema.fused_update import update_groups
from dtensor_ema.layout import resolve_world_mesh
from dtensor_ema.materialize import (
    DEFAULT_BUCKET_BYTES,
    LocalPiece,
    SplitPiece,
    gather_full_tensors,
    gather_to_rank0,
    iter_unsplit,
)
from dtensor_ema.model_keys import from_model_keys, to_model_keys
from dtensor_ema.options import UNSET, EmaOptions, ExcludeSpec, resolve_schedule
from dtensor_ema.plan import (
    EmaPlan,
    PlanEntry,
    build_plan,
    ema_local_from_full,
    model_tensors,
    reshard_fsdp,
    unwrap_model,
)
from dtensor_ema.state import (
    CONFIG,
    EMA_TENSORS,
    UPDATES,
    compare_tensors,
    local_piece,
    tag_rank,
    validate_state,
)
from dtensor_ema.updater import CapturableUpdater, DeviceStep, Updater, make_updater

__all__ = ["ModelEMA"]

StateDict = dict[str, Any]


class ModelEMA:
    """Sharded exponential moving average of ``model``'s parameters and float buffers.

    Args:
        model: a plain ``nn.Module``, a DDP-wrapped one, or an FSDP2 (``fully_shard``) one.
            The EMA tracks the unwrapped module (``ema.model``); keys never carry a
            ``module.`` prefix. ``ema.module`` is the EMA itself as a module (timm's name).
        mesh: the world ``DeviceMesh`` (any number of dims) whose ranks share the EMA.
            Each tensor's local piece is split by rows (``Shard(0)``-like, uneven and empty
            shards included; 0-dim tensors are replicated) over the mesh dims on which the
            piece is replicated: the whole mesh for plain/DDP tensors, the replicate dim of
            HSDP, ``tp`` for TP-replicated weights; FSDP2/TP-sharded dims keep the
            parameter's own placements, so the update stays local. ``None``: the root mesh
            of the model's DTensor parameters, else the whole default process group as a
            1-D mesh, else (no process group) plain unsharded tensors. See
            :func:`~dtensor_ema.layout.resolve_world_mesh`.
        decay: asymptotic decay in ``[0, 1]`` of the default ramp (default ``0.9999``).
        tau: ramp time constant in steps (``>= 0``, default ``2000``); ``None`` or ``0``
            for a constant decay.
        updates: initial value of the update counter (``>= 0``).
        schedule: instead of ``decay``/``tau``: a :mod:`dtensor_ema.decay` schedule
            (``RampDecay``, ``ConstantDecay``, ``WarmupDecay``, ``HalfLifeDecay``) or a
            callable ``step -> decay``.
        half_life: instead of ``decay``/``tau``: constant decay ``0.5 ** (update_every /
            half_life)``, i.e. a past value's weight halves every ``half_life`` steps.
        update_every: average only on every ``update_every``-th ``update()`` call; the
            decay is raised to this power so the EMA's memory in steps does not change.
        update_after_step: the first ``update_after_step`` calls copy the model.
        buffers: ``"average"`` float buffers (default, like yolov5) or ``"copy"`` them
            (timm ``exclude_buffers``). Integer buffers always follow the model.
        exclude: fqns, or a predicate ``(fqn, tensor) -> bool``, of tensors that are copied
            from the model instead of averaged.
        ema_dtype: dtype of the EMA tensors. Default: float32 for fp16/bf16 tensors, the
            model's dtype otherwise. A bf16 EMA with decay 0.9999 silently stops moving.
        capturable: keep the counter and decay on the device, so ``update()`` never
            synchronizes with the host and compiles with ``torch.compile(ema.update,
            fullgraph=True)`` / CUDA graphs. The model must not re-allocate its tensors
            while updates are captured.
        offload: keep the EMA shards in host memory. CUDA models
            (:class:`~dtensor_ema.updater.ChunkedOffloadUpdater`): the shards are pinned;
            each ``update()`` launches, on a side stream, a pipeline that moves the EMA
            through a device scratch of at most 128 MiB per EMA dtype (as much again to
            upcast bf16/fp16 sources), lerps it there with the sources (same bits as an
            on-device EMA) and copies it back; no host sync, no host copy of the sources
            (host memory: the EMA shards only). The next ``optimizer.step()`` (any
            ``torch.optim.Optimizer``) waits for it on the device; code that writes the
            parameters otherwise must call :meth:`flush` first. CPU models: each
            ``update()`` snapshots the source shards (host memory: the EMA shards plus one
            copy of the source shards) and a worker thread applies the step behind the
            next training step; a step that fails in the worker is not counted and its
            error is raised by the next call. Every read waits for the pending step
            (:meth:`flush`). :meth:`close` (or ``with ModelEMA(...) as ema:``) stops the
            thread / removes the optimizer hook.
        kernel: ``"auto"`` (default), ``"eager"`` or ``"compiled"``: see
            :attr:`dtensor_ema.options.EmaOptions.kernel`. Same results bit for bit.
        parameters_as_bucket_view: keep this rank's EMA shards as views into one flat
            buffer per (device, dtype), laid out in gather order, so that materializing
            (``get_model_state_dict``, ``export_ema``, ``average_parameters``) all-gathers
            straight from the EMA storage instead of packing a send buffer first (when the
            EMA dtype is the model's). Same memory (plus a few padding rows); the name and
            meaning follow ``ZeroRedundancyOptimizer``. Gains: in ``export_ema`` a rank other
            than 0 peaks at 0.2 MiB instead of 30 MiB (ResNet-50, W=2,
            ``benchmarks/export_memory.py``); materialization time is unchanged within
            noise now that large tensors are gathered straight into their outputs
            (``benchmarks/bucket_view.py``). Default ``False``: on torch 2.14
            ``dcp.async_save`` cannot stage a DTensor whose local tensor is a view at a
            nonzero storage offset ("Attempted to call copy_() on an invalid python
            storage"). ``dcp.save``/``dcp.load`` work. Building :attr:`module` moves the shards into
            FSDP's storage, which ends the view.
        replicate_buffers: keep the plain float buffers (BatchNorm statistics) whole on
            every rank, each rank averaging (or, with ``buffers="copy"``, copying) its own
            model's buffers, exactly as a replicated EMA (timm, ultralytics) does. Default
            ``False``: buffers are sharded like parameters and a buffer's EMA rows come from
            the rank that owns them, which equals no replicated EMA under DDP. With ``True``
            a cross-rank reduce of :meth:`ema_tensors`' buffers (timm's ``distribute_bn``
            on ``dtensor_ema.compat.timm``) reproduces timm's mean, and
            :meth:`get_model_state_dict` returns each rank's own values (rank 0's where
            only rank 0 receives). ``update()`` still never communicates. Costs the
            buffers' full bytes on every rank (ResNet-50: 0.2 MiB). ``dcp.save`` stores one
            rank's value of a replicated tensor: reduce or broadcast them first if ranks
            differ. Not with :meth:`build_module`.
        verify_replicas: check at construction that replicated parameters are identical
            on their replica ranks (default ``True``; see :mod:`dtensor_ema.replicas`).
            ``False`` skips the check and its collectives: only for EMAs whose first
            update copies the model (timm's ``update(model, step=1)``), which makes the
            starting weights irrelevant.
        cuda_graph: ``None`` (default, auto): on CUDA, ``update()`` captures the
            device-side update (counter and decay on the device, as ``capturable=True``)
            in a CUDA graph on its first call and replays it afterwards, where that is
            safe and gives the same bits as eager (float32 EMA, a built-in schedule, no
            ``offload``; see :func:`dtensor_ema.cuda_graph.decide`); eager otherwise. The
            decision and its reason are logged once (logger ``dtensor_ema``) and kept in
            :attr:`cuda_graph`. ``False``: never. ``True``: required, raises if unsafe.
            The graph reads the model's tensors at fixed addresses: every call checks
            the plan (one ``data_ptr`` per tensor) and re-captures after the model
            re-allocated or re-registered tensors, after :meth:`build_module` and after a
            load. Extra device memory: the graph's pool, the temporaries of one update
            (0-dim tensors, plus for bf16/fp16 models the reused upcast scratch, at most
            64 MiB per mixed-dtype group). The first call costs one eager step plus the
            capture (a device synchronize and a garbage collection; ``gpu_suite`` reports
            it, not yet measured).
        formula: how an averaging step rounds ``d * ema + (1 - d) * model``: ``"lerp"``
            (default), ``"weighted_sum"``, ``"subtract"`` or ``"subtract_alpha"``, to
            reproduce another library's last bits (see
            :data:`dtensor_ema.fused_update.FORMULAS`); the others use the eager kernel and
            one temporary of this rank's shard size per update, and refuse
            ``capturable=True`` and ``kernel="compiled"``.

    Construction is **collective** over ``mesh``: every rank of it must construct the EMA
    together (one all-gather of a structure fingerprint per mesh dim, one all-gather of one
    checksum per replicated parameter per replica group, one flag all-reduce per mesh
    dim). With ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>`` a rank that does not construct
    it makes the others fail after that many seconds, naming the missing ranks (see
    :data:`dtensor_ema._collectives.CHECK_ENV`). Replicated parameters must be identical
    across their replicas (build the EMA after DDP wraps the model): a mismatch raises, naming
    the tensors. The EMA tracks the
    model's live parameters and persistent buffers (never ``state_dict()`` copies), keyed
    by canonical fqns (see :mod:`dtensor_ema.model_keys`). Peak extra memory: the EMA
    shards themselves (``1/W`` of the model's float bytes, in the EMA dtype).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh`` is not a ``DeviceMesh``.
        ValueError: an option out of range or conflicting with another (``tau`` with
            ``half_life``), unknown ``exclude`` names, a mesh whose device type differs
            from the model's or that does not cover the parameters' meshes, a model with
            no float state, ranks that track different models, or replicated parameters
            that differ across ranks, ``cuda_graph=True`` where a graph is unsafe (the
            message names the reason).
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
        ema_dtype: torch.dtype | None = None,
        capturable: bool = False,
        offload: bool = False,
        kernel: Literal["eager", "compiled", "auto"] = "auto",
        parameters_as_bucket_view: bool = False,
        replicate_buffers: bool = False,
        verify_replicas: bool = True,
        cuda_graph: bool | None = None,
        formula: Literal["lerp", "weighted_sum", "subtract", "subtract_alpha"] = "lerp",
    ) -> None:
        self.options = EmaOptions(
            schedule=resolve_schedule(decay, tau, half_life, schedule),
            update_every=update_every,
            update_after_step=update_after_step,
            buffers=buffers,
            exclude=exclude,
            ema_dtype=ema_dtype,
            capturable=capturable,
            offload=offload,
            kernel=kernel,
            cuda_graph=cuda_graph,
            formula=formula,
        )
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"updates must be an int >= 0, got {updates!r}")
        if not isinstance(parameters_as_bucket_view, bool):
            raise TypeError(
                f"parameters_as_bucket_view must be a bool, got {parameters_as_bucket_view!r}"
            )
        self.model = unwrap_model(model)
        reshard_fsdp(self.model)
        device = _model_device(self.model)
        self.mesh = resolve_world_mesh(mesh, model_tensors(self.model).values(), device)
        # Capturable updates keep the counter on the device (float64 counts exactly up to
        # 2**53) so that nothing in update() reads a tensor back to the host.
        self._updates = updates
        self._step_t = torch.tensor(float(updates), dtype=torch.float64, device=device)
        self._last_decay_t = torch.tensor(math.nan, dtype=torch.float64, device=device)
        self._last_decay_from_counter = False  # set by loading a state
        with entering("ModelEMA", mesh=self.mesh):
            self._plan: EmaPlan = build_plan(
                self.model,
                self.mesh,
                ema_dtype=ema_dtype,
                offload=offload,
                bucket_view=parameters_as_bucket_view,
                replicate_buffers=replicate_buffers,
                verify_replicas=verify_replicas,
            )
        self.replicate_buffers = replicate_buffers
        self._copied = self.options.copied_fqns(
            {e.fqn: e.source for e in self._plan},
            {e.fqn for e in self._plan if e.is_parameter},
        )
        for entry in self._plan:
            entry.averaged = entry.fqn not in self._copied
        self._groups = update_groups(self._plan, self.options.kernel, self.options.formula)
        # Decided (and refused, for cuda_graph=True) before any thread or stream exists.
        self._graph_decision = _graphs.resolve(
            cuda_graph,
            device,
            offload=offload,
            schedule=self.options.schedule,
            ema_dtypes={e.ema_local.dtype for e in self._plan},
            formula=self.options.formula,
        )
        self._updater: Updater = make_updater(self._groups, capturable=capturable, offload=offload)
        self._last_decay: float | None = None
        self._swapped = False
        self._module: nn.Module | None = None
        _graphs.log_decision(self._graph_decision, device.type)
        self._graph = _graphs.GraphedStep(device) if self._graph_decision.use else None
        self._step_t_stale = False  # a host-path update ran in graph mode: _step_t lags

    @property
    def cuda_graph(self) -> _graphs.GraphDecision:
        """``(use, reason)``: whether ``update()`` replays a captured CUDA graph, and why."""
        return self._graph_decision

    # ------------------------------------------------------------------ the EMA module
    @property
    def module(self) -> nn.Module:
        """The EMA as a forward-capable ``nn.Module`` (timm's ``ModelEmaV3.module``), built
        on first access with :meth:`build_module`'s defaults. The tracked model is
        :attr:`model`. Alias: :attr:`ema_model` (ema-pytorch's name)."""
        if self._module is None:
            return self.build_module()
        return self._module

    @property
    def ema_model(self) -> nn.Module:
        """Alias of :attr:`module` (ema-pytorch's name)."""
        return self.module

    def build_module(
        self, *, units: UnitSpec = None, compute_dtype: torch.dtype | None = None
    ) -> nn.Module:
        """Build :attr:`module`, the EMA as an ``nn.Module`` whose parameters ARE the EMA.

        Local: no collective. Call it (with options) before the first access of
        :attr:`module`, on every rank; once built, the module is reused.

        No second copy of the EMA is kept. With a mesh (plain or DDP model) the module is
        the model's structure sharded with FSDP2 (``fully_shard``) over the EMA's 1-D mesh,
        and the EMA's shards move into its sharded parameters (one local copy, then the
        old shards are freed): ``update()`` writes where the forward reads, so the module
        always shows the latest average. Without a process group its parameters and float
        buffers are the EMA's own tensors. An FSDP2 model is mirrored (its units, meshes
        and mixed precision); where the EMA splits an FSDP2 shard further over a replica
        dim (HSDP with ``mesh=None``: the replicate dim), the module keeps its own shard of
        that parameter (extra memory: the model's local shard of it), rebuilt from the EMA
        before each forward (one all-gather per bucket over the replica group).

        Wrapped and compiled models: parameter names with ``_checkpoint_wrapped_module`` /
        ``_orig_mod`` pair with the EMA's canonical fqns; a ``forward`` or forward hook set
        on a module instance (torchtitan's ``Module.parallelize`` closures) is re-bound to
        the module's twin; ``module.compile()`` per block is dropped (the twin runs
        eagerly; compile its blocks yourself). See ``docs/evaluation.md``.

        Calling the module: its forward is **collective** over the EMA mesh (every rank
        must call it, with the same number of forwards; with
        ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>`` a forward that some ranks skip fails
        after that many seconds, naming them): FSDP all-gathers one unit at a time, and the
        float buffers (BatchNorm statistics) are all-gathered before each forward. Peak
        extra memory: about the largest unit's full weights in the compute
        dtype (plus FSDP's prefetch of the next unit) plus activations. Call the module
        itself (its ``forward``); other methods of the root see sharded parameters unless
        registered with ``torch.distributed.fsdp.register_fsdp_forward_method``. Its
        parameters have ``requires_grad=False``; it starts in ``eval()`` mode (in
        ``train()`` mode BatchNorm updates the module's gathered buffers, or, without a
        process group, the EMA's buffers themselves). Outputs equal those of an unsharded
        model loaded with ``get_model_state_dict()[0]`` (rel. error <= 1e-5; exact where
        the kernels do not depend on the layout).

        Args:
            units: FSDP units of the module: ``None`` (default) makes a unit of every child
                of an ``nn.ModuleList``/``nn.Sequential`` (the repeated blocks); or an
                iterable of module fqns; or a predicate ``(fqn, module) -> bool``. The rest
                belongs to the root unit. A child whose parent reads its weights without
                calling it (``nn.MultiheadAttention.out_proj``) is refused.
            compute_dtype: dtype the forward computes in. ``None`` (default): the model's
                own dtype, so an fp32 EMA of a bf16 model all-gathers bf16 weights and runs
                in bf16 like the model (FSDP ``MixedPrecisionPolicy(param_dtype=...)``);
                pass ``torch.float32`` to evaluate the fp32 average itself. Float buffers
                follow it too.

        Raises:
            RuntimeError: the module was already built.
            NotImplementedError: ``offload=True``, a plain/DDP model on an N-D mesh, a TP
                layout the module cannot rebuild (each message names the layout).
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
            raise NotImplementedError(
                "ema.module with offload=True is not implemented: the EMA shards live in host "
                f"memory on a CPU twin of the mesh {self.mesh.mesh.tolist() if self.mesh else None}"
                ", where no forward can read them; evaluate with ema.average_parameters()"
            )
        self.flush()
        self._sync_sources()  # refuses inside average_parameters()
        module = build_ema_module(
            self.model, self._plan, self.mesh, units=units, compute_dtype=compute_dtype
        )
        # The EMA's local shards may have moved into the module: re-cache them.
        self._rebind_groups()
        self._module = module
        return module

    # ------------------------------------------------------------------ properties
    @property
    def updates(self) -> int:
        """Number of ``update()`` calls so far (plus the initial ``updates``).

        Counts applied steps only: with ``offload=True`` reading it waits for the pending
        update (and raises its error if the worker failed). With ``capturable=True`` the
        counter lives on the device and reading it synchronizes.
        """
        self.flush()
        if self.options.capturable:
            return int(self._step_t.item())
        return self._updates

    @updates.setter
    def updates(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"updates must be an int >= 0, got {value!r}")
        self._updates = value
        self._step_t.fill_(float(value))

    @property
    def last_decay(self) -> float | None:
        """Decay used by the most recent averaging ``update()`` (``0.0`` for a copy);
        ``None`` before the first. Reading it synchronizes when ``capturable=True``."""
        self.flush()
        if self._last_decay_from_counter:
            return self._decay_of_last_averaging_call()
        if self.options.capturable:
            value = float(self._last_decay_t.item())
            return None if math.isnan(value) else value
        return self._last_decay

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
        """Decay an averaging update applies when the counter reaches ``updates``.

        Default: the next ``update()`` call's (``self.updates + 1``). ``0.0`` means a copy
        (within ``update_after_step``). Calls skipped by ``update_every`` apply nothing.
        """
        updates = self.updates + 1 if updates is None else updates
        step = updates - self.options.update_after_step
        if step <= 0:
            return 0.0
        return self.schedule.decay_for(step, self.options.update_every)

    def ema_tensors(self) -> dict[str, torch.Tensor]:
        """``fqn -> EMA tensor`` (DTensor, or plain without a mesh). Live tensors: no copy."""
        self.flush()
        return {e.fqn: e.ema for e in self._plan}

    def local_numel(self) -> int:
        """Number of EMA elements this rank stores (its shards, plus replicated 0-dim ones)."""
        return sum(e.ema_local.numel() for e in self._plan)

    def local_nbytes(self) -> int:
        """Bytes of EMA storage held by this rank."""
        return sum(e.ema_local.numel() * e.ema_local.element_size() for e in self._plan)

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, model: nn.Module | None = None) -> None:
        """Advance the average by one step. Local: **no communication**.

        Call after ``optimizer.step()`` on every rank. Increments ``updates``; on averaging
        calls (every ``update_every``-th) reads only this rank's piece of each tracked
        tensor and runs one fused ``torch._foreach_lerp_`` per (device, dtype) group
        (``torch._foreach_copy_`` for copied tensors and within ``update_after_step``).

        Args:
            model: optional, for timm-style ``ema.update(model)`` calls; must be the model
                (or a wrapper of it) the EMA was created from.

        Raises:
            ValueError: ``model`` is not the tracked model, or the tracked model's tensor
                names, shapes or dtypes changed since construction.
        """
        self._check_model_argument(model)
        # An earlier offloaded update that failed raises here, before this call is counted.
        self.flush()
        if (
            self._graph is not None
            and self._graph.failed is None
            and not _graphs.stream_is_capturing()
        ):
            self._update_graphed()
            return
        if self.options.capturable:
            self._refuse_while_swapped()
            self._update_capturable()
            return
        self._sync_sources()
        updates, decay = self._next_step()
        self._step_t_stale = True
        if decay is None:
            self._count(updates, None)
            return
        self._updater.submit(decay, lambda: self._count(updates, decay))

    def _update_graphed(self) -> None:
        """The device-side update (:meth:`_device_step`), captured on the first call and
        replayed afterwards; re-captured after the plan re-binds. The host keeps its own
        counter beside the device one (unless ``capturable``), so reading ``updates`` or
        ``last_decay`` does not synchronize."""
        assert self._graph is not None
        self._updater._check_open()
        self._sync_sources()  # refuses while swapped; drops the graph if tensors moved
        if self._step_t_stale:
            self._step_t.fill_(float(self._updates))
            self._step_t_stale = False
        if self.options.capturable:
            self._graph(self._device_step_fn)
        else:
            updates, decay = self._next_step()
            self._graph(self._device_step_fn)
            self._count(updates, decay)
        if self._graph.failed is not None:
            # The step ran eagerly once; from now on the host path (its counter is
            # the host one).
            self._graph_decision = _graphs.GraphDecision(
                False, f"capturing failed: {self._graph.failed}"
            )
            if self.options.cuda_graph is True:
                raise RuntimeError(
                    f"cuda_graph=True, but capturing the update failed ({self._graph.failed}); "
                    "this call's update was applied eagerly and counted"
                )

    def _device_step_fn(self) -> Callable[[], None]:
        """The step the graph captures, bound to the current groups."""
        updater = CapturableUpdater(self._groups)
        return lambda: self._device_step(updater)

    def flush(self) -> None:
        """Wait until every submitted ``update()`` has been applied (``offload=True``
        applies them behind the training step: a worker thread on CPU, a side stream on
        CUDA). Every method that reads the EMA calls it. Local.

        Raises:
            RuntimeError: an offloaded update failed in the worker thread (chained). That
                update is lost and not counted; the EMA and ``updates`` stay at the step
                before it. Raised once, by whichever call comes next.
        """
        self._updater.wait()

    def close(self) -> None:
        """Finish the pending update and stop the ``offload=True`` worker thread. Local.

        Idempotent. Reading the EMA (``state_dict()``, ``get_model_state_dict()``, ...)
        still works afterwards; ``update()`` and ``set()`` raise. ``with ModelEMA(...) as
        ema:`` closes on exit.

        Raises:
            RuntimeError: the pending offloaded update failed (as :meth:`flush`).
        """
        self._updater.close()

    def __enter__(self) -> ModelEMA:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _update_capturable(self) -> None:
        """The same update computed on the device: no ``.item()``, no branch on a tensor.

        Skipped calls (``update_every``) lerp with weight 0 and copies with weight 1, both
        exact. The decay is computed in float64 and rounded to the EMA dtype, which matches
        the host path's Python float bit for bit for float32 EMAs (a float64 EMA may differ
        in the last bit, as torch's and libm's ``exp`` may). The model must not re-allocate
        its tensors while updates are captured (the host path re-binds; this one cannot).
        """
        self._device_step(self._updater)

    def _device_step(self, updater: Updater) -> None:
        """Count and apply one step on the device (what a CUDA graph captures)."""
        # Counted up front, as in the host path's inline mode: a device step cannot fail
        # later in a worker. (Counting in a callback after the lerp compiled to wrong values
        # on torch 2.13.)
        self._step_t += 1
        step = self._step_t - self.options.update_after_step
        decay = self.schedule.decay_tensor_for(step, self.options.update_every)
        decay = torch.where(step <= 0, torch.zeros_like(decay), decay)
        active = torch.remainder(self._step_t, self.options.update_every) == 0
        self._last_decay_t.copy_(torch.where(active, decay, self._last_decay_t))
        updater.submit(DeviceStep(decay=decay, active=active))

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

    def _next_step(self) -> tuple[int, float | None]:
        """The counter after this call, and its decay (``0.0``: copy; ``None``: skipped)."""
        updates = self._updates + 1
        if updates % self.options.update_every:
            return updates, None
        return updates, self.get_decay(updates)

    def _count(self, updates: int, decay: float | None) -> None:
        """Record a call once its step has been applied."""
        self._updates = updates
        if decay is not None:
            self._last_decay = decay
            self._last_decay_from_counter = False

    def _advance(self) -> float | None:
        """Count one call now (for callers that apply the step themselves); return its
        decay, ``0.0`` to copy, ``None`` to skip."""
        updates, decay = self._next_step()
        self._count(updates, decay)
        return decay

    # ------------------------------------------------------------------ materialize
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

        Every rank of the mesh (and of every FSDP2 mesh) must call this. EMA shards travel in
        flat buckets: one all-gather per (mesh, dtype) bucket, not one per tensor.

        Args:
            only_rank0_receives: every rank still calls; only global rank 0 gets the
                tensors, the others two empty dicts. The buckets then travel with
                ``dist.gather`` to rank 0 where the layout allows (plain/DDP models on a 1-D
                mesh, FSDP2 parameters): the other ranks receive nothing and hold at most
                their ``1/W`` share of one bucket.
            cpu_offload: return CPU tensors (for export); device memory stays at ~one bucket.
            bucket_bytes: bound on the bytes one all-gather moves.
            rank0_only: deprecated name of ``only_rank0_receives``.

        Returns:
            ``(ema_state_dict, original_state_dict)``: full, contiguous tensors keyed like
            the unwrapped model's ``state_dict()`` (canonical fqns, without wrapper
            components such as ``_checkpoint_wrapped_module``, then the model's own
            state-dict post-hooks: torchtitan's fused ``wqkv`` comes out as
            ``wq``/``wk``/``wv``), in the model's dtypes, ready for
            ``load_state_dict(strict=True)``. Integer buffers carry the model's value in
            both. Neither shares memory with the model or the EMA.
        """
        self.flush()
        self._sync_sources()
        options: dict[str, Any] = {
            "rank0_only": _renamed(rank0_only, only_rank0_receives),
            "cpu_offload": cpu_offload,
            "bucket_bytes": bucket_bytes,
        }
        ema_full = self._materialize([_ema_piece(e) for e in self._plan], **options)
        model_full = self._materialize([_source_piece(e) for e in self._plan], **options)
        return ema_full, model_full

    @collective("get_ema_state_dict")
    def get_ema_state_dict(
        self,
        *,
        only_rank0_receives: bool = False,
        cpu_offload: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        rank0_only: bool | None = None,
    ) -> StateDict:
        """The first half of :meth:`get_model_state_dict` alone. **Collective.**

        For export: no copy of the model's own weights is gathered, so with
        ``only_rank0_receives`` and ``cpu_offload`` rank 0 holds one full copy of the EMA plus
        one bucket, the other ranks one bucket. Arguments and result as in
        :meth:`get_model_state_dict`.
        """
        self.flush()
        self._sync_sources()
        return self._materialize(
            [_ema_piece(e) for e in self._plan],
            rank0_only=_renamed(rank0_only, only_rank0_receives),
            cpu_offload=cpu_offload,
            bucket_bytes=bucket_bytes,
        )

    @collective("average_parameters")
    @contextlib.contextmanager
    def average_parameters(
        self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[nn.Module]:
        """Swap the EMA weights into the model for evaluation; restore them on exit.

        Yields the unwrapped model. Each rank rebuilds only its own local piece of every
        tensor: for an FSDP2/TP parameter the EMA shard is gathered over the replica dims
        only (none on a 1-D FSDP mesh), so the full model is never gathered on a rank
        (FSDP's own all-gather in forward serves the evaluation); replicated (plain/DDP)
        tensors are gathered in buckets straight into the model's tensors.

        **Collective** over the groups of the replica dims (the whole mesh for plain/DDP
        models, the HSDP replicate dim, ``tp`` for TP-replicated weights; nothing for 1-D
        FSDP2 parameters), on entry and on exit: every rank of the mesh must enter the
        context, between training steps (FSDP2 modules are resharded on entry and exit).

        Peak extra memory: this rank's EMA-sized slice of the raw parameters (the backup,
        ``1/W`` of the swapped bytes), full copies of plain buffers (which DDP does not keep
        identical across ranks), plus one gathered bucket (at most ``bucket_bytes``, twice:
        the received rows and the rebuilt tensors).

        Raises:
            RuntimeError: the context is entered again while it is active. Any error while
                swapping in restores the raw weights before it propagates; calling
                :meth:`update` inside the context raises.
        """
        if self._swapped:
            raise RuntimeError(
                "average_parameters() is already active for this EMA; exit it before "
                "entering it again"
            )
        self.flush()
        self._sync_sources()
        reshard_fsdp(self.model)
        backups = [_backup(e) for e in self._plan]
        self._swapped = True
        try:
            with torch.no_grad():
                self._write_pieces([e.ema_local for e in self._plan], bucket_bytes)
        except BaseException:
            with torch.no_grad():
                self._restore(backups, bucket_bytes)
            self._swapped = False
            raise
        try:
            yield self.model
        finally:
            reshard_fsdp(self.model)
            try:
                with torch.no_grad():
                    self._restore(backups, bucket_bytes)
            finally:
                self._swapped = False

    def _write_pieces(self, rows: list[torch.Tensor], bucket_bytes: int) -> None:
        """Rebuild every tensor's local piece from ``rows`` (this rank's EMA-sized rows, one
        per plan entry) and copy it into the model. Collective over the replica dims."""
        entries = self._plan.entries
        split = [
            SplitPiece(r, e.source_piece.shape, e.levels, e.source_piece.dtype)
            for r, e in zip(rows, entries, strict=True)
        ]
        for bucket in iter_unsplit(split, bucket_bytes=bucket_bytes):
            for i, piece in bucket:
                entries[i].source_piece.copy_(piece)

    def _restore(self, backups: list[tuple[bool, torch.Tensor]], bucket_bytes: int) -> None:
        """Put the raw weights back from :func:`_backup`'s copies (collective for the
        entries backed up by their EMA-sized rows only)."""
        rows = [b for full, b in backups if not full]
        entries = [e for e, (full, _) in zip(self._plan, backups, strict=True) if not full]
        split = [
            SplitPiece(r, e.source_piece.shape, e.levels, e.source_piece.dtype)
            for r, e in zip(rows, entries, strict=True)
        ]
        for bucket in iter_unsplit(split, bucket_bytes=bucket_bytes):
            for i, piece in bucket:
                entries[i].source_piece.copy_(piece)
        for entry, (full, backup) in zip(self._plan, backups, strict=True):
            if full:
                entry.source_piece.copy_(backup)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> StateDict:
        """The EMA's own state for DCP: this rank's live EMA shards, the counter and config.

        Local (no collective), no copy. ``{"updates": int, "config": str, "ema": {fqn:
        DTensor}}`` (see :mod:`dtensor_ema.state`); ``config`` is a JSON string of the
        options that shape the next update (schedule, ``update_every``,
        ``update_after_step``, copied fqns, EMA dtype), one leaf so DCP stores it as is.

        Each DTensor holds **only this rank's piece** of its EMA tensor: save the state with
        DCP (``save_checkpoint`` or ``dcp.save``, on every rank), not ``torch.save`` on one
        rank (another rank refuses to load that file; for one file use
        :meth:`get_ema_state_dict` and :meth:`load_full_state_dict`). The tensors are the
        live ones, so ``dcp.load`` fills them in place; they must not be updated while an
        ``async_save`` of them is pending.
        """
        self.flush()
        for entry in self._plan:
            tag_rank(entry.ema)
        return {
            UPDATES: self._counter_no_wait(),
            CONFIG: json.dumps(self.options.config(self._copied), sort_keys=True),
            EMA_TENSORS: {e.fqn: e.ema for e in self._plan},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore from :meth:`state_dict` output (this rank's or a DCP load's).

        Local: no collective, ever. ``"ema"`` values may be this EMA's own live tensors (a
        DCP load filled them in place), DTensors holding **this rank's** piece with this
        EMA's mesh and placements, or full plain tensors (sliced to this rank's piece).
        Everything is checked before anything is written (:func:`dtensor_ema.state.
        validate_state`): a refused state leaves the EMA and its counter unchanged.
        Peak extra memory: none (shards are copied in place).

        Raises:
            KeyError: ``state_dict`` lacks ``"ema"`` or ``"updates"`` (a full model state
                dict belongs in :meth:`load_full_state_dict`).
            ValueError: missing/unexpected fqns, shape or dtype mismatches, options
                (schedule, ``update_every``, ...) different from this EMA's (resuming with
                other options would not continue the saved trajectory), or DTensors saved
                by another rank (``torch.save`` of one rank's ``state_dict()``) or laid out
                differently (load those through DCP).
        """
        self.flush()
        ours = self.state_dict()
        values = state_dict.get(EMA_TENSORS) if isinstance(state_dict, dict) else None
        in_place = isinstance(values, dict) and any(values.get(e.fqn) is e.ema for e in self._plan)
        try:
            updates = validate_state(state_dict, ours)
        except ValueError as e:
            if in_place and "options differ" in str(e):
                # A plain dcp.load has already written the checkpoint's tensors into ours.
                raise ValueError(
                    f"{e} The EMA tensors were already overwritten in place by dcp.load; "
                    "dtensor_ema.load_checkpoint validates before it writes."
                ) from None
            raise
        assert isinstance(values, dict)
        pieces = [(e.ema_local, local_piece(e, values[e.fqn])) for e in self._plan]
        for target, piece in pieces:
            if piece is not target:
                target.copy_(piece)
        self._restore_counter(updates)
        self._invalidate_graph()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: StateDict, *, updates: int | None = None) -> None:
        """Load full EMA weights keyed like the model: :meth:`get_ema_state_dict` output or
        an :func:`~dtensor_ema.export_ema` file. Local: no collective.

        Call it on every rank with the same full tensors (e.g. ``torch.load`` of one file
        on each rank): each rank copies its own piece. Keys are the model's state-dict keys
        (the model's own ``load_state_dict`` pre-hooks run first, e.g. to fuse torchtitan's
        ``wq``/``wk``/``wv`` into ``wqkv``). Values are cast to the EMA dtype
        (an export in the model's bf16 loses the fp32 EMA's low bits). Integer buffers
        (they follow the model) and the duplicate names of tied weights may be present or
        absent. The counter is set to ``updates`` when given, else left as it is (full
        state dicts carry none). Peak extra memory: none beyond the given tensors.

        Raises:
            ValueError: missing or unexpected names, shape mismatches, non-float values for
                averaged tensors. Nothing is written then.
        """
        self.flush()
        if updates is not None and (
            isinstance(updates, bool) or not isinstance(updates, int) or updates < 0
        ):
            raise ValueError(f"updates must be an int >= 0, got {updates!r}")
        state_dict = from_model_keys(self.model, state_dict)
        ours = {e.fqn: e.ema for e in self._plan}
        saved = {
            k: (
                v.to(ours[k].dtype)
                if isinstance(v, torch.Tensor) and k in ours and v.is_floating_point()
                else v
            )
            for k, v in state_dict.items()
        }
        ignore = [*self._plan.followed, *self._plan.aliases]
        problems = compare_tensors(saved, ours, ignore=ignore)
        if problems:
            raise ValueError(f"full EMA state dict does not match the model: {problems}")
        pieces = [(e.ema_local, ema_local_from_full(e, saved[e.fqn])) for e in self._plan]
        for target, piece in pieces:
            target.copy_(piece)
        if updates is not None:
            self._restore_counter(updates)
        self._invalidate_graph()

    def __repr__(self) -> str:
        mesh = f"mesh={tuple(self.mesh.shape)}" if self.mesh is not None else "unsharded"
        return (
            f"{type(self).__name__}({type(self.model).__name__}, {mesh}, "
            f"decay={self.decay}, tau={self.tau}, updates={self._counter_no_wait()}, "
            f"tensors={len(self._plan.entries)}, local_numel={self.local_numel()})"
        )

    def _invalidate_graph(self) -> None:
        """A load writes in place (the addresses hold), but re-capturing after one costs a
        capture and rules out any state the graph baked in."""
        if self._graph is not None:
            self._graph.invalidate()

    def _restore_counter(self, updates: int) -> None:
        """Set the counter; ``last_decay`` then follows from it (a state stores only the
        counter), computed when read: a stateful schedule (``PostHocEMA``'s) may restore
        its own state after this EMA's."""
        self.updates = updates
        self._last_decay_from_counter = True

    def _decay_of_last_averaging_call(self) -> float | None:
        updates = self._counter_no_wait()
        last = updates - updates % self.options.update_every
        return self.get_decay(last) if last > 0 else None

    def _counter_no_wait(self) -> int:
        if self.options.capturable:
            return int(self._step_t.item())
        return self._updates

    # ------------------------------------------------------------------ internals
    def _check_model_argument(self, model: nn.Module | None) -> None:
        if model is not None and unwrap_model(model) is not self.model:
            raise ValueError(
                f"got a {type(model).__name__} that is not the model this EMA tracks "
                f"({type(self.model).__name__} at {id(self.model):#x}); create a new "
                "ModelEMA for a different model"
            )

    def _materialize(
        self, pieces: list[LocalPiece], *, rank0_only: bool, cpu_offload: bool, bucket_bytes: int
    ) -> StateDict:
        """Gather ``pieces`` (collective) into a state dict in the model's key order, with
        the integer buffers and tied aliases filled in; ``{}`` off rank 0 with rank0_only."""
        if rank0_only:  # a gather to rank 0: the other ranks receive nothing
            full = gather_to_rank0(pieces, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes)
        else:
            full = gather_full_tensors(pieces, cpu_offload=cpu_offload, bucket_bytes=bucket_bytes)
        if rank0_only and not full:
            return {}
        device = torch.device("cpu") if cpu_offload else None
        followed = {
            k: v.detach().to(device=device, copy=True) for k, v in self._plan.followed.items()
        }
        return to_model_keys(self.model, self._ordered(full, followed))

    def _ordered(self, tensors: StateDict, followed: StateDict) -> StateDict:
        out: StateDict = {}
        for key in self._plan.keys:
            if key in tensors:
                out[key] = tensors[key]
            elif key in followed:
                out[key] = followed[key]
            elif key in self._plan.aliases:
                out[key] = tensors[self._plan.aliases[key]]
        return out

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
        if not self._plan.sync():
            return
        self._rebind_groups()

    def _rebind_groups(self) -> None:
        """Rebuild the update groups from the plan; a captured graph read the old
        addresses, so it is dropped (the next ``update()`` captures again)."""
        self.flush()
        self._groups = update_groups(self._plan, self.options.kernel, self.options.formula)
        self._updater.rebind(self._groups)
        if self._graph is not None:
            self._graph.invalidate()


def _renamed(rank0_only: bool | None, only_rank0_receives: bool) -> bool:
    """``rank0_only`` read as "only rank 0 calls", which hangs the collective: renamed."""
    if rank0_only is None:
        return only_rank0_receives
    warnings.warn(
        "rank0_only= is deprecated: every rank must still call; use only_rank0_receives=",
        DeprecationWarning,
        stacklevel=4,
    )
    return rank0_only or only_rank0_receives


def _model_device(module: nn.Module) -> torch.device:
    for tensor in model_tensors(module).values():
        return tensor.device
    raise ValueError(f"{type(module).__name__} has no parameters or buffers to average")


def _backup(entry: PlanEntry) -> tuple[bool, torch.Tensor]:
    """What the swap saves of one tensor: ``(True, full local piece)`` for buffers, which
    ranks need not hold identically (BatchNorm statistics under DDP), ``(False, this rank's
    EMA-sized rows)`` for parameters, whose replicas are identical by construction."""
    if entry.levels and not entry.is_parameter:
        return True, entry.source_piece.clone()
    return False, entry.source_local.clone()


def _ema_piece(entry: PlanEntry) -> LocalPiece:
    source = entry.source
    return LocalPiece(
        fqn=entry.fqn,
        local=entry.ema_local,
        shape=source.shape,
        mesh=source.device_mesh if isinstance(source, DTensor) else None,
        placements=tuple(source.placements) if isinstance(source, DTensor) else (),
        out_dtype=source.dtype,
        levels=entry.levels,
        piece_shape=entry.source_piece.shape,
    )


def _source_piece(entry: PlanEntry) -> LocalPiece:
    source = entry.source
    return LocalPiece(
        fqn=entry.fqn,
        local=entry.source_piece,
        shape=source.shape,
        mesh=source.device_mesh if isinstance(source, DTensor) else None,
        placements=tuple(source.placements) if isinstance(source, DTensor) else (),
        out_dtype=source.dtype,
    )
