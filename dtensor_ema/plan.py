"""The sharding plan: which model tensors the EMA tracks, and each rank's piece of them.

The plan is the single owner of the model-to-EMA binding. Built once per
:class:`~dtensor_ema.ModelEMA` from the model's **live** tensors (``named_parameters`` and
persistent ``named_buffers``, ties included), never from ``model.state_dict()`` values:
state-dict hooks may return copies (torchtitan's fused ``wqkv`` is split into fresh
``wq``/``wk``/``wv`` tensors) or communicate. Entries are keyed by their *canonical fqn*:
the module path with wrapper components (``_checkpoint_wrapped_module``, ``_orig_mod``,
``_fsdp_wrapped_module``) removed, which is the key ``torch.distributed.checkpoint``'s
``get_model_state_dict`` uses and the key of the EMA's DCP state. For every
floating-point parameter and buffer it records

* ``source``: the model's own tensor object (a ``Parameter``, a buffer, or for FSDP2/TP the
  sharded ``DTensor`` parameter),
* ``source_piece``: this rank's local piece of it, as a **view**: ``to_local()`` of a
  DTensor parameter, the whole tensor otherwise,
* ``source_local``: the rows of ``source_piece`` this rank averages (a dim-0 view, see
  :mod:`dtensor_ema.layout` for the rule),
* ``ema``: the EMA ``DTensor`` (or a plain tensor when there is no mesh),
* ``ema_local``: ``ema.to_local()``, cached so the update touches no DTensor machinery,
* ``levels``: the replica dims ``source_local`` was split over, to rebuild the piece.

The plan also owns the **tracked set** (``ModelEMA(track=...)``): only tracked
floating-point tensors get an entry. The others are listed in ``untracked`` (canonical fqn
-> the model's live tensor): the EMA neither stores nor updates them, and every consumer
that needs a whole model (full state dicts, ``ema.module``) reads them from the model.
Non-floating-point buffers (``num_batches_tracked``) are not averaged either; they are
listed in ``followed`` and always read from the model. :meth:`EmaPlan.track_` and
:meth:`EmaPlan.untrack_` change the tracked set (collective); :meth:`EmaPlan.sync` re-binds
the views after model surgery and refuses changes that would make the EMA silently wrong,
including (with ``track="trainable"``) a trainable set that changed behind the EMA's back.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dtensor_ema import zero_partition
from dtensor_ema._collectives import entering, mesh_agree
from dtensor_ema.layout import (
    LayoutBuilder,
    PiecePointers,
    PlanEntry,
    agree_on_structure,
    local_rows,
    make_entry,
    model_piece,
    model_piece_ptr,
    model_shape,
    resolve_world_mesh,
    shard_mesh_dim,
)
from dtensor_ema.model_keys import canonical_fqn, live_tensors
from dtensor_ema.options import EmaOptions
from dtensor_ema.replicas import check_replicas
from dtensor_ema.watch import ModuleWatch

__all__ = [
    "EmaPlan",
    "bucket_view_",
    "build_plan",
    "canonical_fqn",
    "check_live",
    "is_averageable",
    "listed",
    "model_tensors",
    "refuse_fsdp1",
    "reshard_fsdp",
    "unwrap_model",
]


@dataclass(slots=True)
class EmaPlan:
    """All averaged entries in state-dict order, plus the buffers that follow the model."""

    module: nn.Module
    world: DeviceMesh | None
    """The mesh whose ranks share the EMA (:func:`~dtensor_ema.layout.resolve_world_mesh`)."""
    device: torch.device
    """The model's device (its first tensor's)."""
    entries: list[PlanEntry]
    keys: list[str]
    """Every canonical fqn of the model's live tensors, in state-dict order (averaged,
    untracked, followed and tied)."""
    followed: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied weights: extra fqn -> the fqn that holds the shared tensor (an entry's, or an
    untracked tensor's)."""
    untracked: dict[str, torch.Tensor] = field(default_factory=dict)
    """Floating-point tensors the EMA does not hold: canonical fqn -> the model's live
    tensor (tied duplicates under ``aliases``), in state-dict order."""
    watch: ModuleWatch | None = None
    options: EmaOptions | None = None
    """The options the entries were made with (:meth:`track_` makes new ones alike)."""
    trainable: dict[str, bool] | None = None
    """With ``track="trainable"``: ``requires_grad`` of every float parameter when the
    tracked set was last decided (construction, :meth:`track_`, :meth:`untrack_`);
    ``None`` otherwise."""
    tracked_version: int = 0
    """How many times :meth:`track_`/:meth:`untrack_` changed the entries (their EMA
    tensors may then be new objects, in new flat buffers): holders of entries' tensors
    (the drop-ins' replica) compare it to re-point theirs."""
    _seen_epoch: int = 0
    _pointers: list[int] = field(default_factory=list)
    _probe: Callable[[], list[int]] = list
    _signatures: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = field(
        default_factory=dict
    )
    _parameters: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    _builder: LayoutBuilder | None = None

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    @property
    def binding(self) -> object:
        """A token replaced whenever the views are bound again (:meth:`sync`, :meth:`track_`,
        :meth:`untrack_`): plans of one model checked together stay alike while it holds."""
        return self._pointers

    def by_fqn(self) -> dict[str, PlanEntry]:
        return {e.fqn: e for e in self.entries}

    def sync(self, *, check_trainable: bool = True) -> bool:
        """Re-bind the cached views if the model re-registered or re-allocated tensors.

        Local. Cost when nothing changed: one integer compare and two passes with no Python
        frame per tensor: one identity check per registered tensor and submodule
        (:meth:`~dtensor_ema.watch.ModuleWatch.intact`, which notices removals) and one
        ``data_ptr`` per tracked tensor (:class:`~dtensor_ema.layout.PiecePointers`, which
        notices ``.data =`` and ``module.to()``); with ``track="trainable"``, plus one
        ``requires_grad`` per parameter.
        Returns ``True`` when views were re-bound (update groups must be rebuilt).

        Raises:
            ValueError: names, global shapes, dtypes or devices changed, tensors were
                removed (or set to ``None``), or tied weights were untied, since the plan
                was built; with ``check_trainable``, the
                trainable set changed (:meth:`check_trainable`). The EMA is left untouched.
        """
        assert self.watch is not None
        if check_trainable and self.trainable is not None:
            self.check_trainable()
        if (
            self.watch.epoch == self._seen_epoch
            and self.watch.intact()
            and self._probe() == self._pointers
        ):
            return False
        current = model_tensors(self.module)
        problems = [f"{k}: missing from the model" for k in self.keys if k not in current]
        for fqn, signature in self._signatures.items():
            tensor = current.get(fqn)
            if tensor is None:
                continue
            shape, dtype, device = signature
            now = model_shape(tensor)
            if (now, tensor.dtype, tensor.device) != (shape, dtype, device):
                problems.append(
                    f"{fqn} (untracked): was {tuple(shape)} {dtype} on {device}, now "
                    f"{tuple(now)} {tensor.dtype} on {tensor.device}"
                )
        for entry in self.entries:
            tensor = current.get(entry.fqn)
            if tensor is None:
                continue
            shape, dtype, device = entry.signature
            now = model_shape(tensor)
            if (now, tensor.dtype) != (shape, dtype):
                problems.append(
                    f"{entry.fqn}: was {tuple(shape)} {dtype}, now {tuple(now)} {tensor.dtype}"
                )
            elif tensor.device != device:
                problems.append(f"{entry.fqn}: moved from {device} to {tensor.device}")
            elif isinstance(tensor, DTensor) and (
                tensor.device_mesh != entry.source.device_mesh  # type: ignore[attr-defined]
                or tuple(tensor.placements) != tuple(entry.source.placements)  # type: ignore[attr-defined]
            ):
                problems.append(f"{entry.fqn}: its mesh or placements changed")
            elif isinstance(tensor, DTensor) != isinstance(entry.source, DTensor):
                problems.append(f"{entry.fqn}: changed between DTensor and plain tensor")
        for alias, target in self.aliases.items():
            if alias in current and target in current and current[alias] is not current[target]:
                problems.append(f"{alias}: was tied to {target}, now a separate tensor")
        known = set(self.keys)
        problems += [f"{k}: new in the model" for k in current if k not in known]
        if not problems:
            problems = self._partition_changes(current)
        if problems:
            raise ValueError(
                "the model's tensors changed since the EMA was created (create a new ModelEMA "
                f"after changing the model): {problems[:5]}{' ...' if len(problems) > 5 else ''}"
            )
        parameter_ids = {id(p) for p in self.module.parameters()}
        self.followed = {
            k: v for k, v in current.items() if not is_averageable(v, id(v) in parameter_ids)
        }
        self.untracked = {k: current[k] for k in self.untracked}
        self._parameters = [(k, current[k]) for k, _ in self._parameters]
        self.watch.rewatch()
        self._seen_epoch = self.watch.epoch
        moved = False
        for entry in self.entries:
            tensor = current[entry.fqn]
            entry.source = tensor
            if model_piece_ptr(tensor) == entry.source_piece.data_ptr():
                continue
            moved = True
            entry.source_piece = model_piece(tensor)
            entry.source_local = local_rows(entry.source_piece, entry.layout)
        self.bind_probe()
        return moved

    def bind_probe(self) -> None:
        """Take the pointers :meth:`sync` compares on every update (views just bound). Local."""
        self._probe = PiecePointers(self.entries)
        self._pointers = self._probe()

    def _partition_changes(self, current: Mapping[str, torch.Tensor]) -> list[str]:
        """ZeRO-3 entries whose partition moved: the layout derived again must be the one
        the EMA was built with (same group, same range), or they are named; so is a tensor
        that became a ZeRO-3 parameter after the EMA was built on it whole."""
        assert self._builder is not None
        problems = []
        for entry in self.entries:
            tensor = current[entry.fqn]
            if model_piece_ptr(tensor) == entry.source_piece.data_ptr():
                continue
            if entry.layout.flat is None:
                if zero_partition.is_partitioned(tensor):
                    problems.append(
                        f"{entry.fqn}: partitioned by DeepSpeed ZeRO-3 after the EMA was "
                        "created on the whole parameter; create the ModelEMA after "
                        "deepspeed.initialize (or inside deepspeed.zero.Init's model)"
                    )
                continue
            try:
                partition = zero_partition.read_partition(entry.fqn, tensor, self.world)
                _, _, layout = self._builder.place(entry.fqn, tensor, partition)
            except ValueError as e:
                problems.append(f"{entry.fqn}: {e}")
                continue
            if layout != entry.layout:
                problems.append(
                    f"{entry.fqn}: its ZeRO-3 partition changed (flat range "
                    f"{entry.layout.flat.start}+{entry.layout.length} on mesh "
                    f"{entry.layout.mesh}, now {layout.flat and layout.flat.start}+"
                    f"{layout.length} on {layout.mesh}); a model re-partitioned after the EMA "
                    "was created needs a new ModelEMA"
                )
        return problems

    def local_nbytes(self) -> int:
        """Bytes of EMA storage held by this rank."""
        return sum(e.ema_local.numel() * e.ema_local.element_size() for e in self.entries)

    def trainable_changes(self) -> tuple[list[str], list[str]]:
        """``(now trainable, frozen)``: the float parameters whose ``requires_grad`` changed
        since the tracked set was last decided (``([], [])`` unless ``track="trainable"``).
        Local; one ``requires_grad`` read per float parameter."""
        if self.trainable is None:
            return [], []
        if all(p.requires_grad == self.trainable[k] for k, p in self._parameters):
            return [], []
        now = [k for k, p in self._parameters if p.requires_grad and not self.trainable[k]]
        frozen = [k for k, p in self._parameters if not p.requires_grad and self.trainable[k]]
        return now, frozen

    def check_trainable(self) -> None:
        """With ``track="trainable"``: refuse a trainable set that changed since the tracked
        set was last decided. Local; one ``requires_grad`` read per float parameter.

        Raises:
            ValueError: naming the parameters that became trainable and those that were
                frozen, and the calls that follow the change.
        """
        now, frozen = self.trainable_changes()
        if not (now or frozen):
            return
        tracked = self.by_fqn()
        parts = []
        if now:
            parts.append(
                f"now trainable {listed(now)} (call ema.add_tensors("
                f"{listed([k for k in now if k not in tracked], 3)}) to average them)"
            )
        if frozen:
            parts.append(
                f"frozen {listed(frozen)} (call ema.drop_tensors("
                f"{listed([k for k in frozen if k in tracked], 3)}) to stop averaging them)"
            )
        raise ValueError(
            "ModelEMA(track='trainable'): the model's trainable parameters changed since the "
            f"EMA chose its tensors: {'; '.join(parts)}. Those calls are collective (every "
            "rank); either one accepts the current trainable set, e.g. ema.add_tensors([]) "
            "keeps averaging frozen parameters"
        )

    def track_(self, fqns: Iterable[str]) -> list[PlanEntry]:
        """Start averaging untracked float tensors, each from the model's current value.

        **Collective** over ``world`` (every rank, the same names): one flag all-reduce per
        mesh dim (so that a name refused on one rank raises everywhere), the construction
        checks of :func:`build_plan` (structure fingerprint with the tracked set; replicas
        of the new parameters). Peak extra memory: the new shards (with ``bucket_view``,
        a second copy of this rank's EMA while the flat buffers are rebuilt). Callers must
        rebuild what they cached from the entries (update groups).

        Returns:
            The new entries.

        Raises:
            ValueError: a name that is not an untracked float tensor of the model (tracked
                ones, aliases and integer buffers named as such), or ranks that disagree.
        """
        names = list(dict.fromkeys(fqns))
        error = self._check_names(names, tracked=False)
        mesh_agree(self.world, error, "adding tensors to the EMA")
        reshard_fsdp(self.module)
        assert self.options is not None and self._builder is not None
        parameter_ids = {id(p) for p in self.module.parameters()}
        new = []
        for fqn in names:
            tensor = self.untracked[fqn]
            partition = zero_partition.read_partition(fqn, tensor, self.world)
            is_parameter = id(tensor) in parameter_ids
            options, builder = self.options, self._builder
            new.append(make_entry(fqn, tensor, builder, options, is_parameter, partition))
        check_live(self.module, new)
        structure = _structure(model_tensors(self.module), set(self.untracked) - set(names))
        agree_on_structure(self.world, structure, self.options.agreement())
        check_replicas(new, self.world)
        order = {k: i for i, k in enumerate(self.keys)}
        self.entries = sorted([*self.entries, *new], key=lambda e: order[e.fqn])
        for fqn in names:
            del self.untracked[fqn]
            del self._signatures[fqn]
        self._decided()
        return new

    def untrack_(self, fqns: Iterable[str]) -> list[PlanEntry]:
        """Stop averaging tracked tensors: their EMA shards are freed (the plan forgets
        them) and the model's tensors take their place wherever a whole model is read.

        **Collective** like :meth:`track_` (one flag all-reduce per mesh dim, the structure
        fingerprint). Callers must rebuild what they cached from the entries.

        Returns:
            The dropped entries.

        Raises:
            ValueError: a name that is not a tracked tensor, dropping every tracked tensor,
                or ranks that disagree.
        """
        names = list(dict.fromkeys(fqns))
        error = self._check_names(names, tracked=True)
        if error is None and len(names) == len(self.entries) and names:
            error = ValueError(
                f"cannot drop all {len(names)} tracked tensors: an EMA needs at least one "
                "(create a new ModelEMA instead)"
            )
        mesh_agree(self.world, error, "dropping tensors from the EMA")
        assert self.options is not None
        structure = _structure(model_tensors(self.module), set(self.untracked) | set(names))
        agree_on_structure(self.world, structure, self.options.agreement())
        dropped = [e for e in self.entries if e.fqn in set(names)]
        self.entries = [e for e in self.entries if e.fqn not in set(names)]
        order = {k: i for i, k in enumerate(self.keys)}
        for entry in dropped:
            self.untracked[entry.fqn] = entry.source
            self._signatures[entry.fqn] = entry.signature
        self.untracked = dict(sorted(self.untracked.items(), key=lambda kv: order[kv[0]]))
        self._decided()
        return dropped

    def _check_names(self, names: list[str], *, tracked: bool) -> ValueError | None:
        entries = self.by_fqn()
        bad = []
        for fqn in names:
            if not tracked and fqn in self.untracked and self.untracked[fqn].is_complex():
                bad.append(f"{fqn!r}: {self.untracked[fqn].dtype}, complex (not averaged)")
                continue
            if fqn in (entries if tracked else self.untracked):
                continue
            if fqn in self.aliases:
                why = f"a tied alias of {self.aliases[fqn]!r}: name that one"
            elif fqn in entries:
                why = "already tracked"
            elif fqn in self.untracked:
                why = "not tracked"
            elif fqn in self.followed:
                why = "an integer buffer (it always follows the model)"
            else:
                why = "not a parameter or persistent buffer of the model"
            bad.append(f"{fqn!r}: {why}")
        if not bad:
            return None
        verb = "drop" if tracked else "add"
        return ValueError(f"cannot {verb} tensors: {'; '.join(bad[:5])}")

    def _decided(self) -> None:
        """After the tracked set changed: bucket views rebuilt, the pointers and the
        trainable snapshot taken again."""
        assert self.options is not None
        self.tracked_version += 1
        if self.options.bucket_view:
            bucket_view_(self.entries)
        self.bind_probe()
        if self.trainable is not None:
            self.trainable = {k: p.requires_grad for k, p in self._parameters}

    @torch.no_grad()
    def rebind_ema(self, tensors: Mapping[str, DTensor]) -> None:
        """Move EMA entries into storage someone else owns (the EMA module's FSDP2
        parameters). Local: no collective.

        For each ``fqn -> tensor``: the tensor must be a DTensor with the entry's global
        shape, dtype, mesh and placements (so its local piece has the shape of
        ``ema_local``). The entry's current values are copied into ``tensor.to_local()``,
        which then becomes ``ema_local``; ``tensor`` becomes ``ema``. Everything is checked
        before anything is written. Callers must rebuild what they cached from the old
        ``ema_local`` tensors (update groups).

        Raises:
            ValueError: an unknown fqn, or a tensor whose layout differs from the entry's.
        """
        entries = self.by_fqn()
        problems = []
        for fqn, tensor in tensors.items():
            entry = entries.get(fqn)
            if entry is None:
                problems.append(f"{fqn}: not an EMA entry")
            elif (
                not isinstance(tensor, DTensor)
                or tensor.shape != entry.ema.shape
                or tensor.dtype != entry.ema_local.dtype
                or (tensor.device_mesh, tuple(tensor.placements)) != (entry.mesh, entry.placements)
                or tensor.to_local().shape != entry.ema_local.shape
            ):
                problems.append(
                    f"{fqn}: expected a DTensor {tuple(entry.ema.shape)} {entry.ema_local.dtype} "
                    f"{entry.placements}, got {type(tensor).__name__} {tuple(tensor.shape)} "
                    f"{tensor.dtype} {getattr(tensor, 'placements', None)}"
                )
        if problems:
            raise ValueError(f"cannot rebind the EMA: {problems[:5]}")
        for fqn, tensor in tensors.items():
            entry = entries[fqn]
            local = tensor.to_local()
            local.copy_(entry.ema_local)
            entry.ema, entry.ema_local = tensor, local


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel, DeepSpeed engine and ``torch.compile`` wrappers so keys
    carry no prefix."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        inner = _deepspeed_engine_module(model)  # its state-dict keys carry "module."
        if inner is not None:
            model = inner
            continue
        # torch.compile's OptimizedModule keeps the user's module here; there is no public
        # accessor, and without unwrapping every key would carry an "_orig_mod." prefix.
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model


def _deepspeed_engine_module(model: nn.Module) -> nn.Module | None:
    """``model.module`` when ``model`` is a ``deepspeed.DeepSpeedEngine``, else ``None``.
    Looks DeepSpeed up only if it is imported."""
    if "deepspeed" not in sys.modules:
        return None
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:  # pragma: no cover - a DeepSpeed without its engine module
        return None
    inner = getattr(model, "module", None)
    return inner if isinstance(model, DeepSpeedEngine) and isinstance(inner, nn.Module) else None


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's live parameters and persistent buffers by canonical fqn, FSDP2
    parameters in sharded form. Local.

    FSDP2 modules are resharded first: a forward without backward leaves the root (and
    modules with ``reshard_after_forward=False``) holding unsharded parameters, which are
    not the objects the optimizer updates. See :func:`~dtensor_ema.model_keys.live_tensors`.
    """
    reshard_fsdp(module)
    return live_tensors(module)


def is_averageable(tensor: torch.Tensor, is_parameter: bool) -> bool:
    """Whether a model tensor is of the kind the EMA tracks, or else reads from the model as
    untracked: real floating-point tensors, and complex parameters (which are never
    averaged: tracking one is refused, see :func:`build_plan`). Integer, bool and complex
    buffers (a persistent ``freqs_cis`` table) follow the model."""
    return tensor.is_floating_point() or (is_parameter and tensor.is_complex())


def _complex_refusal(names: list[str]) -> str:
    return (
        f"the EMA averages real floating-point tensors; {listed(names)} are complex. "
        "Leave them out of the tracked set, e.g. track=lambda fqn, t: not t.is_complex(): "
        "untracked tensors are read from the model wherever a whole model is needed"
    )


def refuse_fsdp1(module: nn.Module) -> None:
    """Refuse a model wrapped with FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``,
    with or without ``use_orig_params``), whose parameters are flat shards (or per-rank
    views of them) that no EMA layout can pair with the model's names. Local.

    Raises:
        ValueError: naming where FSDP1 wraps the model and the way out.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = [
        repr(name) if name else "the root"
        for name, sub in module.named_modules()
        if isinstance(sub, FullyShardedDataParallel)
    ]
    if wrapped:
        raise ValueError(
            f"the model is wrapped with FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, "
            f"at {listed(wrapped, 3)}), whose flat-parameter shards the EMA cannot pair with "
            "the model's tensors. Shard it with FSDP2 instead: "
            "torch.distributed.fsdp.fully_shard(module) per block, then the root; with "
            "accelerate, set fsdp_version: 2 in the FSDP config; with Lightning, use "
            "ModelParallelStrategy (FSDPStrategy is FSDP1) and fully_shard in "
            "configure_model"
        )


def reshard_fsdp(module: nn.Module) -> None:
    """Register FSDP2's sharded parameters again (a forward without backward leaves the
    root, and modules with ``reshard_after_forward=False``, unsharded). Local."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def check_live(module: nn.Module, entries: list[PlanEntry]) -> None:
    """Refuse entries whose source is not a live parameter or buffer of ``module``. Local.

    The EMA must average the tensors the optimizer updates. A tensor that is a copy (what
    a state-dict hook returns, e.g. torchtitan's ``wq``/``wk``/``wv`` split of a fused
    ``wqkv``) would keep its initial value forever, silently.

    Raises:
        ValueError: naming the entries whose source (or its local piece's storage) is not
            one of ``module``'s parameters or buffers.
    """
    live = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    stale = []
    for entry in entries:
        tensor = live.get(id(entry.source))
        if tensor is None:
            stale.append(entry.fqn)
            continue
        piece = model_piece(tensor)
        if piece.untyped_storage().data_ptr() != entry.source_piece.untyped_storage().data_ptr():
            stale.append(entry.fqn)
    if stale:
        raise ValueError(
            f"the EMA would track tensors that are not live parameters or buffers of "
            f"{type(module).__name__} (copies never see the optimizer's updates): "
            f"{stale[:5]}{' ...' if len(stale) > 5 else ''}"
        )


def build_plan(model: nn.Module, mesh: DeviceMesh | None, options: EmaOptions) -> EmaPlan:
    """Bind an EMA to ``model``: unwrap it (:func:`unwrap_model`), find the ranks that
    share the EMA (:func:`~dtensor_ema.layout.resolve_world_mesh`: ``plan.world``) and
    create the EMA tensors.

    The EMA binds to the model's live tensors (:func:`model_tensors`, FSDP2 modules
    resharded first) and refuses any entry that is not one (:func:`check_live`). Each
    ZeRO-3 parameter is read once (:func:`~dtensor_ema.zero_partition.read_partition`,
    which refuses what the EMA cannot follow, tracked or not) and each entry made in one
    call (:func:`~dtensor_ema.layout.make_entry`); this function decides the set.

    **Collective** when the world has a dim of size > 1, so every rank of it must
    build its plan together: one all-gather of one integer per world mesh dim
    (:func:`~dtensor_ema.layout.agree_on_structure`), then one all-gather of one int64 per
    replicated parameter over each replica group and one flag all-reduce per world mesh dim
    (:func:`~dtensor_ema.replicas.check_replicas`, which reads every replicated parameter
    once). Peak extra memory: the EMA shards themselves.

    Args:
        model: the model (DDP, DeepSpeed and ``torch.compile`` wrappers are stripped).
        mesh: the user's ``mesh=`` (``None``: the default, see
            :func:`~dtensor_ema.layout.resolve_world_mesh`; no process group: plain,
            unsharded EMA tensors).
        options: the EMA's options; the plan reads ``track`` (which floating-point
            tensors get an entry, decided once per tensor, tied ones by their first name;
            the others go to ``untracked``, and the ranks' tracked sets are part of the
            structure fingerprint, so ranks that disagree are refused; ``"trainable"``
            also records every float parameter's ``requires_grad`` so that
            :meth:`EmaPlan.check_trainable` refuses a change), ``ema_dtype`` (``None``:
            :func:`~dtensor_ema.layout.default_ema_dtype`), ``offload`` (EMA shards in host
            memory, pinned for CUDA models, on a CPU twin of each mesh), ``bucket_view``
            (every ``ema_local`` a view into one flat buffer per (device, dtype) in gather
            order, :func:`bucket_view_`), ``replicate_buffers`` (plain float buffers whole
            on every rank, each averaging its own model's) and ``verify_replicas``
            (:func:`~dtensor_ema.replicas.check_replicas` and its collectives; off only
            where the first update is known to copy the model).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``mesh`` not a ``DeviceMesh``.
        ValueError: the model has no tracked floating-point state, has tensors on the meta
            device, a DTensor uses a placement the EMA cannot mirror, the world's ranks
            track different models, or replicated parameters differ across their replicas.
    """
    module = unwrap_model(model)
    tensors = model_tensors(module)
    if not tensors:
        raise ValueError(f"{type(module).__name__} has no parameters or buffers to average")
    device = next(iter(tensors.values())).device
    world = resolve_world_mesh(mesh, tensors.values(), device)
    with entering("ModelEMA", mesh=world):  # its collectives, named after the user's call
        return _bind(module, tensors, world, device, options)


def _bind(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    world: DeviceMesh | None,
    device: torch.device,
    options: EmaOptions,
) -> EmaPlan:
    """:func:`build_plan` over the resolved world: the entries, the checks the ranks share
    (collective), the plan."""
    refuse_fsdp1(module)
    on_meta = [k for k, t in tensors.items() if t.device.type == "meta"]
    if on_meta:
        raise ValueError(
            f"{type(module).__name__} has tensors on the meta device ({on_meta[:5]}): "
            "materialize the model (module.to_empty(device=...) and initialize it) before "
            "creating its EMA"
        )
    entries: list[PlanEntry] = []
    parameter_ids = {id(p) for p in module.parameters()}
    followed = {k: t for k, t in tensors.items() if not is_averageable(t, id(t) in parameter_ids)}
    untracked: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    builder = LayoutBuilder(world)
    complex_tracked: list[str] = []
    for fqn, tensor in tensors.items():
        if fqn in followed:
            continue
        if id(tensor) in seen:
            aliases[fqn] = seen[id(tensor)]
            continue
        seen[id(tensor)] = fqn
        is_parameter = id(tensor) in parameter_ids
        tracked = options.track == "all" or options.tracks(fqn, tensor, is_parameter)
        # Asked of every tensor: whole-model outputs read the untracked ones too.
        partition = zero_partition.read_partition(fqn, tensor, world)
        if not tracked:
            untracked[fqn] = tensor
        elif tensor.is_complex():
            complex_tracked.append(f"{fqn} ({tensor.dtype})")
        else:
            entries.append(make_entry(fqn, tensor, builder, options, is_parameter, partition))
    if complex_tracked:
        raise ValueError(_complex_refusal(complex_tracked))
    if not entries:
        floats = [k for k in tensors if k not in followed and k not in aliases]
        if floats:
            raise ValueError(
                f"track= selects none of {type(module).__name__}'s {len(floats)} "
                f"floating-point tensors (e.g. {floats[:3]}; with track='trainable': is "
                "every parameter frozen?); the EMA needs at least one"
            )
        raise ValueError(
            f"{type(module).__name__} has no floating-point parameters or buffers to average "
            f"(state dict keys: {list(followed)[:5]})"
        )
    check_live(module, entries)
    structure = _structure(tensors, set(untracked))
    signatures = {k: (model_shape(t), t.dtype, t.device) for k, t in untracked.items()}
    agree_on_structure(world, structure, options.agreement())
    if options.verify_replicas:
        check_replicas(entries, world)
    options.check_exclude([e.fqn for e in entries], untracked)
    if options.bucket_view:
        bucket_view_(entries)
    plan = EmaPlan(
        module=module,
        world=world,
        device=device,
        entries=entries,
        keys=list(tensors),
        followed=followed,
        aliases=aliases,
        untracked=untracked,
        watch=ModuleWatch(module),
        options=options,
    )
    plan._builder = builder
    plan._signatures = signatures
    plan._parameters = [
        (k, t)
        for k, t in tensors.items()
        if id(t) in parameter_ids and k not in aliases and k not in followed
    ]
    if options.track == "trainable":
        plan.trainable = {k: p.requires_grad for k, p in plan._parameters}
    plan.bind_probe()
    return plan


def _structure(tensors: Mapping[str, torch.Tensor], untracked: set[str]) -> dict[str, str]:
    """``fqn -> "shape dtype"`` of every tensor, marked where the EMA leaves it untracked:
    the fingerprint every rank of the world must share."""
    return {
        k: f"{tuple(model_shape(t))} {t.dtype}" + (" untracked" if k in untracked else "")
        for k, t in tensors.items()
    }


def listed(names: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` names and how many more, for error messages."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{list(names[:limit])}{more}"


def bucket_view_(entries: list[PlanEntry]) -> list[torch.Tensor]:
    """Move every entry's ``ema_local`` into one flat buffer per (device, dtype). Local.

    Laid out in the order :mod:`dtensor_ema.materialize.gather` gathers in, so that the local
    shards of one gather bucket are adjacent and the bucket's send buffer is a view of the
    flat buffer (no packing): first the entries split over replica levels, grouped by their
    levels, those gathered on their own (large and evenly split) last; then DTensor entries
    sharded on dim 0 over one mesh dim, grouped by (mesh, mesh dim); then the rest (0-dim,
    other layouts). Each buffer ends with room for the padding of its last bucket (the sum
    over its tensors of the padded rows minus this rank's rows), sent but never read. Each
    entry's ``ema`` is rebuilt around the view (same mesh, placements, shape and stride).

    Returns:
        The flat buffers (held alive by the views).
    """
    from dtensor_ema.materialize.gather import DIRECT_BYTES

    groups: dict[tuple[Any, ...], int] = {}
    keyed = []
    for index, entry in enumerate(entries):
        local = entry.ema_local
        slack = 0
        if entry.levels:
            level = entry.levels[-1]
            piece_bytes = math.prod(entry.source_piece.shape) * local.element_size()
            direct = (
                len(entry.levels) == 1
                and level.rows % level.size == 0
                and piece_bytes >= DIRECT_BYTES
            )
            group: tuple[Any, ...] = (0, tuple(lv.key for lv in entry.levels), direct)
            row = math.prod(local.shape[1:]) if local.dim() > 1 else 1
            slack = math.ceil(level.rows / level.size) * row - local.numel()
        else:
            mesh_dim = shard_mesh_dim(entry.placements) if entry.mesh is not None else None
            if mesh_dim is not None and entry.mesh is not None and entry.ema.dim() > 0:
                group = (1, id(entry.mesh), mesh_dim)
                n = entry.ema.shape[0]
                chunk = math.ceil(n / entry.mesh.size(mesh_dim)) if n else 0
                slack = chunk * math.prod(entry.ema.shape[1:]) - local.numel()
            else:
                group = (2,)
        rank = groups.setdefault(group, len(groups))
        keyed.append(((group[0], rank, index), entry, max(slack, 0)))
    keyed.sort(key=lambda item: item[0])
    by_buffer: dict[tuple[torch.device, torch.dtype], list[tuple[PlanEntry, int]]] = {}
    for _, entry, slack in keyed:
        local = entry.ema_local
        by_buffer.setdefault((local.device, local.dtype), []).append((entry, slack))
    flats = []
    for (device, dtype), items in by_buffer.items():
        total = sum(e.ema_local.numel() for e, _ in items)
        pinned = any(e.ema_local.is_pinned() for e, _ in items)
        flat = torch.empty(
            total + sum(slack for _, slack in items), dtype=dtype, device=device, pin_memory=pinned
        )
        cursor = 0
        for entry, _ in items:
            local = entry.ema_local
            view = flat[cursor : cursor + local.numel()].view(local.shape)
            view.copy_(local)
            cursor += local.numel()
            entry.ema_local = view
            if isinstance(entry.ema, DTensor):
                entry.ema = DTensor.from_local(
                    view,
                    entry.ema.device_mesh,
                    entry.ema.placements,
                    run_check=False,
                    shape=entry.ema.shape,
                    stride=entry.ema.stride(),
                )
            else:
                entry.ema = view
        flats.append(flat)
    return flats
