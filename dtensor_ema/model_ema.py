"""ModelEMA: an exponential moving average of a model's weights, sharded across ranks.

Every popular EMA keeps a full replica of the model on every rank and updates all of it
every step. Here each rank keeps only its ``Shard(0)`` piece of every tensor (a DTensor on a
1-D mesh; FSDP2 parameters keep their own mesh and placements), so memory and update work
are about ``1/W`` of a replicated EMA, and ``update()`` never communicates: it is one fused
``lerp`` per (device, dtype) group over cached local views. Full weights are materialized
only on request (evaluation, export), with one flat all-gather per bucket.

The math (yolov5/ultralytics):

    updates += 1
    d = decay * (1 - exp(-updates / tau))        # tau=None or 0: d = decay
    ema = ema.lerp(model.to(ema.dtype), 1 - d)   # i.e. ema = d * ema + (1 - d) * model

for every floating-point entry of the model's state dict (parameters and float buffers
such as BatchNorm running stats). Integer buffers (``num_batches_tracked``) follow the
model. Because ``lerp`` is elementwise, the sharded result equals an unsharded EMA bit for
bit at every world size.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dtensor_ema.decay import DecaySchedule
from dtensor_ema.ema_module import UnitSpec, build_ema_module
from dtensor_ema.fused_update import OffloadPipeline, update_groups
from dtensor_ema.layout import resolve_world_mesh
from dtensor_ema.materialize import (
    DEFAULT_BUCKET_BYTES,
    LocalPiece,
    SplitPiece,
    gather_full_tensors,
    gather_to_rank0,
    iter_unsplit,
)
from dtensor_ema.options import UNSET, EmaOptions, ExcludeSpec, resolve_schedule
from dtensor_ema.plan import (
    EmaPlan,
    PlanEntry,
    build_plan,
    ema_local_from_full,
    model_tensors,
    unwrap_model,
)

__all__ = ["ModelEMA"]

StateDict = dict[str, Any]


class ModelEMA:
    """Sharded exponential moving average of ``model``'s parameters and float buffers.

    Args:
        model: a plain ``nn.Module``, a DDP-wrapped one, or an FSDP2 (``fully_shard``) one.
            The EMA tracks the unwrapped module (``ema.model``); keys never carry a
            ``module.`` prefix. ``ema.module`` is the EMA itself as a module (timm's name).
        mesh: 1-D ``DeviceMesh`` over which replicated tensors are sharded (``Shard(0)``,
            uneven and empty shards included; 0-dim tensors are ``Replicate()``). ``None``
            means the whole default process group when one is initialized, and no sharding
            at all otherwise (single process, no process group needed). FSDP2/DTensor
            parameters ignore ``mesh``: their EMA uses the parameter's own mesh and
            placements, so the update stays local; ``mesh`` then shards only plain
            tensors (buffers). For HSDP pass ``None`` or the shard-dim submesh.
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

    Construction is local (no collective) but must happen on every rank of the mesh, on
    models whose tensors are identical across ranks where they are replicated (DDP
    guarantees this).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh`` is not a ``DeviceMesh``.
        ValueError: an option out of range or conflicting with another (``tau`` with
            ``half_life``), unknown ``exclude`` names, a mesh that is not 1-D or whose
            device type differs from the model's, a model with no float state.
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
        )
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"updates must be an int >= 0, got {updates!r}")
        if not isinstance(parameters_as_bucket_view, bool):
            raise TypeError(
                f"parameters_as_bucket_view must be a bool, got {parameters_as_bucket_view!r}"
            )
        self.model = unwrap_model(model)
        _reshard_fsdp(self.model)
        device = _model_device(self.model)
        self.mesh = resolve_world_mesh(mesh, model_tensors(self.model).values(), device)
        # Capturable updates keep the counter on the device (float64 counts exactly up to
        # 2**53) so that nothing in update() reads a tensor back to the host.
        self._updates = updates
        self._step_t = torch.tensor(float(updates), dtype=torch.float64, device=device)
        self._last_decay_t = torch.tensor(math.nan, dtype=torch.float64, device=device)
        self._plan: EmaPlan = build_plan(
            self.model,
            self.mesh,
            ema_dtype=ema_dtype,
            offload=offload,
            bucket_view=parameters_as_bucket_view,
        )
        self._copied = self.options.copied_fqns(
            {e.fqn: e.source for e in self._plan},
            {e.fqn for e in self._plan if e.is_parameter},
        )
        for entry in self._plan:
            entry.averaged = entry.fqn not in self._copied
        self._groups = update_groups(self._plan, self.options.kernel)
        self._offload = OffloadPipeline(self._groups) if offload else None
        self._last_decay: float | None = None
        self._swapped = False
        self._module: nn.Module | None = None

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
        buffers are the EMA's own tensors.

        Calling the module: its forward is **collective** over the EMA mesh (every rank
        must call it, with the same number of forwards): FSDP all-gathers one unit at a
        time, and the float buffers (BatchNorm statistics) are all-gathered before each
        forward. Peak extra memory: about the largest unit's full weights in the compute
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
            NotImplementedError: FSDP2/TP models, ``offload=True``, N-D meshes.
            ValueError: bad ``units`` or ``compute_dtype``.
        """
        if self._module is not None:
            raise RuntimeError(
                "ema.module was already built (build_module() runs once, before the first "
                "access of ema.module); reuse ema.module"
            )
        if self.options.offload:
            raise NotImplementedError(
                "ema.module with offload=True (EMA shards in host memory) is not implemented"
            )
        self.flush()
        self._sync_sources()  # refuses inside average_parameters()
        module = build_ema_module(
            self.model, self._plan, self.mesh, units=units, compute_dtype=compute_dtype
        )
        # The EMA's local shards may have moved into the module: re-cache them.
        self._groups = update_groups(self._plan, self.options.kernel)
        self._module = module
        return module

    # ------------------------------------------------------------------ properties
    @property
    def updates(self) -> int:
        """Number of ``update()`` calls so far (plus the initial ``updates``).

        With ``capturable=True`` the counter lives on the device and reading it synchronizes.
        """
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
        if self.options.capturable:
            self._refuse_while_swapped()
            self._update_capturable()
            return
        self._sync_sources()
        decay = self._advance()
        if decay is None:
            return
        if self._offload is not None:
            self._offload.submit(decay)
            return
        for group in self._groups:
            group.apply_(decay)

    def flush(self) -> None:
        """Wait until every submitted ``update()`` has been applied (``offload=True`` runs
        them in a worker thread). Every method that reads the EMA calls it. Local."""
        if self._offload is not None:
            self._offload.wait()

    def _update_capturable(self) -> None:
        """The same update computed on the device: no ``.item()``, no branch on a tensor.

        Skipped calls (``update_every``) lerp with weight 0 and copies with weight 1, both
        exact. The decay is computed in float64 and rounded to the EMA dtype, which matches
        the host path's Python float bit for bit for float32 EMAs (a float64 EMA may differ
        in the last bit, as torch's and libm's ``exp`` may). The model must not re-allocate
        its tensors while updates are captured (the host path re-binds; this one cannot).
        """
        self._step_t += 1
        step = self._step_t - self.options.update_after_step
        decay = self.schedule.decay_tensor_for(step, self.options.update_every)
        decay = torch.where(step <= 0, torch.zeros_like(decay), decay)
        active = torch.remainder(self._step_t, self.options.update_every) == 0
        self._last_decay_t.copy_(torch.where(active, decay, self._last_decay_t))
        zero = torch.zeros_like(decay)
        for group in self._groups:
            weight = 1.0 - decay if group.averaged else torch.ones_like(decay)
            group.apply_weight_(torch.where(active, weight, zero))

    @torch.no_grad()
    def set(self, model: nn.Module | None = None) -> None:
        """Re-initialize the EMA from the model's current weights. Local: no communication.

        ``updates`` is unchanged (timm ``ModelEmaV3.set``); use ``load_state_dict`` or
        assign ``ema.updates`` to restart the decay schedule too.
        """
        self._check_model_argument(model)
        self.flush()
        self._sync_sources()
        for group in self._groups:
            group.apply_(0.0)

    def _advance(self) -> float | None:
        """Count one call; return the decay to apply, ``0.0`` to copy, ``None`` to skip."""
        self._updates += 1
        if self._updates % self.options.update_every:
            return None
        decay = self.get_decay(self._updates)
        self._last_decay = decay
        return decay

    # ------------------------------------------------------------------ materialize
    def get_model_state_dict(
        self,
        *,
        rank0_only: bool = False,
        cpu_offload: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> tuple[StateDict, StateDict]:
        """Full EMA weights and a copy of the model's current weights. **Collective.**

        Every rank of the mesh (and of every FSDP2 mesh) must call this. EMA shards travel in
        flat buckets: one all-gather per (mesh, dtype) bucket, not one per tensor.

        Args:
            rank0_only: only global rank 0 gets the tensors; other ranks get two empty dicts.
                The buckets then travel with ``dist.gather`` to rank 0 where the layout
                allows (plain/DDP models on a 1-D mesh, FSDP2 parameters): the other
                ranks receive nothing and hold at most their ``1/W`` share of one bucket.
            cpu_offload: return CPU tensors (for export); device memory stays at ~one bucket.
            bucket_bytes: bound on the bytes one all-gather moves.

        Returns:
            ``(ema_state_dict, original_state_dict)``: full, contiguous tensors keyed like
            the unwrapped model's ``state_dict()``, in the model's dtypes, ready for
            ``load_state_dict(strict=True)``. Integer buffers carry the model's value in
            both. Neither shares memory with the model or the EMA.
        """
        self.flush()
        self._sync_sources()
        options: dict[str, Any] = {
            "rank0_only": rank0_only,
            "cpu_offload": cpu_offload,
            "bucket_bytes": bucket_bytes,
        }
        ema_full = self._materialize([_ema_piece(e) for e in self._plan], **options)
        model_full = self._materialize([_source_piece(e) for e in self._plan], **options)
        return ema_full, model_full

    def get_ema_state_dict(
        self,
        *,
        rank0_only: bool = False,
        cpu_offload: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> StateDict:
        """The first half of :meth:`get_model_state_dict` alone. **Collective.**

        For export: no copy of the model's own weights is gathered, so with ``rank0_only``
        and ``cpu_offload`` rank 0 holds one full copy of the EMA plus one bucket, the other
        ranks one bucket. Arguments and result as in :meth:`get_model_state_dict`.
        """
        self.flush()
        self._sync_sources()
        return self._materialize(
            [_ema_piece(e) for e in self._plan],
            rank0_only=rank0_only,
            cpu_offload=cpu_offload,
            bucket_bytes=bucket_bytes,
        )

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
        _reshard_fsdp(self.model)
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
            _reshard_fsdp(self.model)
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
        """The EMA's own state for DCP: live sharded tensors plus the counter and config.

        Local (no collective). ``{"updates": int, "config": str, "ema": {fqn: DTensor}}``;
        ``config`` is a JSON string of the options that shape the next update (schedule,
        ``update_every``, ``update_after_step``, copied fqns, EMA dtype), one leaf so DCP
        stores it as is. The EMA tensors are the live ones, so ``dcp.load`` fills them in
        place; they must not be updated while an ``async_save`` of them is pending.
        """
        self.flush()
        return {
            "updates": self.updates,
            "config": json.dumps(self.options.config(self._copied), sort_keys=True),
            "ema": {e.fqn: e.ema for e in self._plan},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore from :meth:`state_dict` output, a DCP load, or full (plain) tensors.

        Local (no collective). DTensor values with our placements are copied shard by shard;
        plain full tensors are sliced to this rank's shard.

        Raises:
            KeyError: ``state_dict`` lacks ``"ema"`` or ``"updates"``.
            ValueError: missing/unexpected fqns, shape or dtype mismatches, or options
                (schedule, ``update_every``, ...) different from this EMA's: resuming with
                other options would not continue the saved trajectory.
        """
        self.flush()
        for key in ("ema", "updates"):
            if key not in state_dict:
                raise KeyError(f"EMA state dict has no {key!r} entry (keys: {list(state_dict)})")
        values = state_dict["ema"]
        entries = self._plan.by_fqn()
        missing = [k for k in entries if k not in values]
        unexpected = [k for k in values if k not in entries]
        if missing or unexpected:
            raise ValueError(
                f"EMA state dict does not match the model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}"
            )
        if "config" in state_dict:
            in_place = any(values[e.fqn] is e.ema for e in self._plan)
            self._check_config(state_dict["config"], in_place)
        updates = state_dict["updates"]
        if isinstance(updates, torch.Tensor):
            updates = int(updates.item())
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"checkpoint 'updates' must be an int >= 0, got {updates!r}")
        locals_ = [(e, _local_of(e, values[e.fqn])) for e in entries.values()]
        for entry, local in locals_:
            if local is not entry.ema_local:
                entry.ema_local.copy_(local)
        self.updates = updates

    def __repr__(self) -> str:
        mesh = f"mesh={tuple(self.mesh.shape)}" if self.mesh is not None else "unsharded"
        return (
            f"{type(self).__name__}({type(self.model).__name__}, {mesh}, "
            f"decay={self.decay}, tau={self.tau}, updates={self.updates}, "
            f"tensors={len(self._plan.entries)}, local_numel={self.local_numel()})"
        )

    # ------------------------------------------------------------------ internals
    def _check_model_argument(self, model: nn.Module | None) -> None:
        if model is not None and unwrap_model(model) is not self.model:
            raise ValueError(
                f"got a {type(model).__name__} that is not the model this EMA tracks "
                f"({type(self.model).__name__} at {id(self.model):#x}); create a new "
                "ModelEMA for a different model"
            )

    def _check_config(self, saved: str | dict[str, Any], in_place: bool = False) -> None:
        theirs = json.loads(saved) if isinstance(saved, str) else saved
        ours = self.options.config(self._copied)
        diffs = [
            f"{k}: checkpoint {theirs.get(k)!r}, this EMA {ours.get(k)!r}"
            for k in sorted(set(theirs) | set(ours))
            if theirs.get(k) != ours.get(k)
        ]
        if diffs:
            # A plain dcp.load has already written the checkpoint's tensors into ours.
            damage = (
                " The EMA tensors were already overwritten in place by dcp.load; "
                "dtensor_ema.load_checkpoint validates before it writes."
                if in_place
                else ""
            )
            raise ValueError(
                "checkpoint EMA options differ from this EMA's (construct ModelEMA with the "
                f"checkpoint's options to resume): {'; '.join(diffs)}.{damage}"
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
        return self._ordered(full, followed)

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
        self.flush()
        self._groups = update_groups(self._plan, self.options.kernel)
        if self._offload is not None:
            self._offload = OffloadPipeline(self._groups)


def _model_device(module: nn.Module) -> torch.device:
    for tensor in model_tensors(module).values():
        return tensor.device
    raise ValueError(f"{type(module).__name__} has no parameters or buffers to average")


def _reshard_fsdp(module: nn.Module) -> None:
    """Register FSDP2's sharded parameters again (a forward without backward leaves the
    root, and modules with ``reshard_after_forward=False``, unsharded)."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


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


def _local_of(entry: PlanEntry, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a checkpoint value for ``entry``, validated."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{entry.fqn}: expected a tensor, got {type(value).__name__}")
    if value.shape != entry.ema.shape:
        raise ValueError(
            f"{entry.fqn}: checkpoint shape {tuple(value.shape)} != EMA shape "
            f"{tuple(entry.ema.shape)}"
        )
    if value.dtype != entry.ema_local.dtype:
        raise ValueError(
            f"{entry.fqn}: checkpoint dtype {value.dtype} != EMA dtype {entry.ema_local.dtype}"
        )
    if value is entry.ema:
        return entry.ema_local
    if isinstance(value, DTensor):
        if (value.device_mesh, tuple(value.placements)) == (entry.mesh, entry.placements):
            return value.to_local()
        value = value.full_tensor()  # a different layout: collective on value's mesh
    return ema_local_from_full(entry, value)
