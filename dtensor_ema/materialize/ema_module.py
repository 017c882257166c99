"""The EMA as a module you can call: evaluation and teacher forwards with no second copy.

timm's ``ModelEmaV3.module`` and ema-pytorch's ``ema_model`` are full replicas of the model
on every rank. Here :attr:`ModelEMA.module <dtensor_ema.ModelEMA.module>` is a *twin* of the
model whose parameter storage is the EMA itself:

* **With a mesh** (plain or DDP model): the twin is the model's module tree with every
  parameter sharded by FSDP2 (``fully_shard``) over the EMA's 1-D mesh. FSDP2's ``Shard(0)``
  chunks are the EMA's ``Shard(0)`` chunks, so the EMA is re-pointed at the twin's sharded
  parameters (:meth:`EmaPlan.rebind_ema <dtensor_ema.plan.EmaPlan.rebind_ema>`) and the
  update writes straight into the storage the forward all-gathers from. A forward gathers
  one unit at a time: peak extra memory is about the largest unit's full weights (in the
  compute dtype, plus FSDP's prefetch of the next unit) plus activations.
* **Without a process group**: the twin's parameters and float buffers *are* the EMA's
  (plain, full) tensors.
* **Tensor parallelism** (TP, FSDP2 + TP), and any mesh when the EMA tracks a subset
  (``track=``): the twin's resting parameters are the EMA's own DTensors and the model's
  own untracked tensors, gathered unit by unit into the model's layout just for the
  forward (:mod:`dtensor_ema.materialize.tp_module`); untracked tensors are never sharded in the
  twin.
  Without a process group the untracked slots are views of the model's storage.

The pieces shared by these twins (structural clone, callables, buffer hooks, shared slots)
live in :mod:`dtensor_ema.materialize.twin`.

The twin is built from the model's structure on the ``meta`` device (``copy.deepcopy`` with
every tensor pre-mapped to an empty meta tensor), so no weight is ever copied in full.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_ema.layout import PlanEntry
from dtensor_ema.materialize.gather import SplitPiece, iter_unsplit
from dtensor_ema.materialize.tp_module import build_tp_twin, needs_tp_twin
from dtensor_ema.materialize.twin import (
    SharedSlots,
    clone_without_fsdp,
    install_forward_hooks,
    prepare_twin,
    slots,
    student_mp_policy,
)
from dtensor_ema.model_keys import canonical_fqn
from dtensor_ema.options import EmaOptions
from dtensor_ema.plan import EmaPlan

__all__ = [
    "UnitSpec",
    "build_ema_module",
    "default_units",
    "refuse_unmirrored_options",
]

UnitSpec = Iterable[str] | Callable[[str, nn.Module], bool] | None
"""Which submodules become FSDP units of the twin: ``None`` (the children of every
``nn.ModuleList``/``nn.Sequential``), an iterable of module fqns, or a predicate
``(fqn, module) -> bool``."""

# Parents that read a child's weights without calling the child's forward: sharding the
# child on its own would hand the parent a sharded DTensor (nn.MultiheadAttention passes
# out_proj.weight to F.multi_head_attention_forward).
_BYPASSED_CHILDREN: tuple[tuple[type[nn.Module], str], ...] = ((nn.MultiheadAttention, "out_proj"),)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def default_units(model: nn.Module) -> list[str]:
    """Fqns of the default FSDP units: every child of an ``nn.ModuleList`` or
    ``nn.Sequential`` (the repeated blocks of most models) that holds parameters and whose
    forward is called (``ModuleList``/``ModuleDict`` children are searched, not sharded)."""
    units: list[str] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for name, child in _callable_children(module):
            child_fqn = f"{fqn}.{name}" if fqn else name
            if _has_parameters(child) and not _bypassed(model, child_fqn):
                units.append(child_fqn)
    return units


def _callable_children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            for sub_name, sub in _callable_children(child):
                yield f"{name}.{sub_name}", sub
        else:
            yield name, child


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _bypassed(model: nn.Module, fqn: str) -> bool:
    parent_fqn, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    return any(isinstance(parent, cls) and name == child for cls, child in _BYPASSED_CHILDREN)


def _resolve_units(model: nn.Module, units: UnitSpec) -> list[str]:
    """Unit fqns, validated, deepest first (``fully_shard`` must wrap children before
    parents)."""
    modules = dict(model.named_modules())
    if units is None:
        chosen = default_units(model)
    elif callable(units):
        chosen = [fqn for fqn, m in modules.items() if fqn and units(fqn, m)]
    elif isinstance(units, str):
        raise TypeError(f"units must be an iterable of module names, got the string {units!r}")
    else:
        chosen = list(dict.fromkeys(units))
        unknown = [fqn for fqn in chosen if fqn not in modules or not fqn]
        if unknown:
            raise ValueError(
                f"units {unknown[:5]} are not submodules of {type(model).__name__} "
                f"(some submodules: {[k for k in modules if k][:5]})"
            )
    for fqn in chosen:
        module = modules[fqn]
        if isinstance(module, _CONTAINERS):
            raise ValueError(
                f"unit {fqn!r} is a {type(module).__name__}, which has no forward; pass its "
                "children instead"
            )
        if _bypassed(model, fqn):
            parent = type(model.get_submodule(fqn.rpartition(".")[0])).__name__
            raise ValueError(
                f"unit {fqn!r} cannot be sharded on its own: its parent {parent} reads its "
                "weights without calling its forward; make the parent the unit instead"
            )
    return sorted(chosen, key=lambda fqn: -fqn.count("."))


def refuse_unmirrored_options(options: EmaOptions, mesh: DeviceMesh | None) -> None:
    """Refuse the options whose EMA no twin can read: ``replicate_buffers`` on a mesh, and
    ``offload`` (shards in host memory). Local.

    Raises:
        NotImplementedError: naming the option and how to evaluate instead.
    """
    if options.replicate_buffers and mesh is not None:
        raise NotImplementedError(
            "ema.module with replicate_buffers=True is not implemented; use "
            "average_parameters() or get_model_state_dict() to evaluate"
        )
    if options.offload:
        ranks = mesh.mesh.tolist() if mesh is not None else None
        raise NotImplementedError(
            "ema.module with offload=True is not implemented: the EMA shards live in host "
            f"memory on a CPU twin of the mesh {ranks}, where no forward can read them; "
            "evaluate with ema.average_parameters()"
        )


def build_ema_module(
    model: nn.Module,
    plan: EmaPlan,
    mesh: DeviceMesh | None,
    *,
    units: UnitSpec = None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build the EMA's forward-capable twin of ``model``. Local: no collective.

    With a mesh, every EMA entry of a parameter is re-pointed at the twin's FSDP2
    parameters (their values are copied once); the caller must rebuild anything cached from
    the plan's ``ema_local`` tensors. See :attr:`ModelEMA.module <dtensor_ema.ModelEMA.module>`.
    FSDP2 models are mirrored: the twin has the student's units, meshes, shard dims and
    ``MixedPrecisionPolicy`` (``units`` is then ignored). Models with DTensor parameters
    that FSDP2 alone does not explain (TP, FSDP2 + TP), and every plan with untracked
    tensors on a mesh, get the gathered twin of
    :func:`~dtensor_ema.materialize.tp_module.build_tp_twin` instead: the EMA is not moved, the
    twin's
    parameters are its DTensors (and the model's untracked tensors), and each unit (the
    model's FSDP2 units, else ``units`` and the root) gathers them into the model's layout
    around its forward.

    Args:
        model: the unwrapped, tracked model.
        plan: the EMA's plan over ``model``.
        mesh: the EMA's 1-D mesh, or ``None`` (no process group: the twin shares the EMA's
            plain tensors).
        units: FSDP units of the twin (see :data:`UnitSpec`); ignored without a mesh.
        compute_dtype: dtype the forward computes in; ``None``: the model's own dtype
            (per unit, so an fp32 EMA of a bf16 model runs its forward in bf16).

    Raises:
        NotImplementedError: a DeepSpeed ZeRO-3 model (the message names what to use
            instead), FSDP2 models with plain float parameters, an N-D mesh for a
            plain model, or a TP layout the TP twin cannot rebuild (a DTensor buffer, a
            torch whose FSDP2 hides the unsharded layout); each message names the tensor
            and its layout. A callable the twin would share
            with the model and cannot re-bind (see
            :func:`~dtensor_ema.materialize.twin.rebind_callables`).
        ValueError: bad ``units``, or a unit whose parameters mix dtypes with
            ``compute_dtype=None``.
    """
    integer = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if integer:
        raise NotImplementedError(f"ema.module for models with integer parameters {integer[:5]}")
    partitioned = [e.fqn for e in plan if e.layout.flat is not None]
    if partitioned:
        raise NotImplementedError(
            f"ema.module for a DeepSpeed ZeRO-3 model ({partitioned[:3]} are partitioned): "
            "evaluate the EMA with DeepSpeed's own engine inside `with "
            "ema.average_parameters(): engine(batch)` (the EMA goes into the partitions: no "
            "full copy), or load ema.get_ema_state_dict() into a plain model"
        )
    if compute_dtype is not None and not (
        isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
    ):
        raise ValueError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
    fsdp_units = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    if needs_tp_twin(plan) or (plan.untracked and mesh is not None):
        chosen = fsdp_units or _resolve_units(model, units)
        unit_order = sorted((u for u in chosen if u), key=lambda fqn: -fqn.count("."))
        return build_tp_twin(model, plan, unit_order, compute_dtype)
    if fsdp_units:
        return _fsdp_mirror(model, plan, compute_dtype)
    if mesh is None:
        return _shared_twin(model, plan, compute_dtype)
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"ema.module for a plain/DDP model on a {mesh.ndim}-D mesh {tuple(mesh.shape)}: "
            f"its EMA is split over every mesh dim (placements {plan.entries[0].placements}), "
            "a nested split FSDP2 cannot hold; use a 1-D mesh or ema.average_parameters()"
        )
    return _sharded_twin(model, plan, mesh, _resolve_units(model, units), compute_dtype)


# ------------------------------------------------------------------------- no process group
def _shared_twin(model: nn.Module, plan: EmaPlan, compute_dtype: torch.dtype | None) -> nn.Module:
    """The model's structure over the EMA's own plain tensors, and over the model's own
    tensors where the EMA tracks none (no weight is copied)."""
    by_fqn = plan.by_fqn()
    shared = SharedSlots(plan)
    memo: dict[int, Any] = {}
    casts: list[tuple[nn.Module, str, str, torch.dtype]] = []
    for fqn, tensor, owner, name, kind in slots(model):
        if id(tensor) in memo:
            continue
        target = plan.aliases.get(fqn, fqn)
        entry = by_fqn.get(target)
        if target in plan.untracked:
            memo[id(tensor)] = shared.value(target, kind)
        elif entry is None:  # integer buffer: a small copy, refreshed before every forward
            memo[id(tensor)] = tensor.detach().clone()
            continue
        else:
            memo[id(tensor)] = (
                nn.Parameter(entry.ema, requires_grad=False) if kind == "param" else entry.ema
            )
        dtype = compute_dtype or tensor.dtype
        if dtype != memo[id(tensor)].dtype:
            casts.append((owner, name, kind, dtype))
    twin = prepare_twin(model, copy.deepcopy(model, memo))
    twin_slots = {fqn: (owner, name, kind) for fqn, _, owner, name, kind in slots(twin)}
    for fqn, (owner, name, kind) in twin_slots.items():
        untracked = shared.untracked_fqn(fqn)
        if untracked is not None:
            shared.add(owner, name, kind, untracked)
    # The casts name the source's modules; point them at the twin's.
    fqn_of = {(id(o), n): f for f, _, o, n, _ in slots(model)}
    twin_casts = [
        (*twin_slots[fqn_of[(id(owner), name)]][:2], kind, dtype)
        for owner, name, kind, dtype in casts
    ]
    followed = [
        (twin_slots[fqn][0], twin_slots[fqn][1], source) for fqn, source in plan.followed.items()
    ]
    masters: list[torch.Tensor] = []

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        shared.refresh()
        with torch.no_grad():
            for owner, name, source in followed:
                owner._buffers[name].copy_(source)  # type: ignore[union-attr]
        masters.clear()
        for owner, name, kind, dtype in twin_casts:
            # A temporary cast for this forward; the twin's slot gets the EMA's (or the
            # model's) tensor back afterwards, even if the forward raises.
            master = owner._parameters[name] if kind == "param" else owner._buffers[name]
            assert master is not None
            masters.append(master)
            value = master.detach().to(dtype)
            if kind == "param":
                owner._parameters[name] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[name] = value

    def post_forward(_module: nn.Module, _args: Any, _output: Any) -> None:
        for (owner, name, kind, _), master in zip(twin_casts, masters, strict=False):
            if kind == "param":
                owner._parameters[name] = master  # type: ignore[assignment]  # a Parameter
            else:
                owner._buffers[name] = master
        masters.clear()

    twin.register_forward_pre_hook(pre_forward, prepend=True)
    twin.register_forward_hook(post_forward, always_call=True)
    return twin


# ------------------------------------------------------------------------- FSDP2 twin
def _sharded_twin(
    model: nn.Module,
    plan: EmaPlan,
    mesh: DeviceMesh,
    units: list[str],
    compute_dtype: torch.dtype | None,
) -> nn.Module:
    """FSDP2 over the EMA mesh; the plan's replicated entries are re-pointed at its
    parameters."""
    by_fqn = plan.by_fqn()
    memo, model_dtypes = _meta_memo(model, plan, compute_dtype)
    twin = prepare_twin(model, copy.deepcopy(model, memo))
    # fully_shard refuses 0-dim parameters: they stay plain and share the EMA's
    # (replicated) tensor.
    scalars = {p for p in twin.parameters() if p.dim() == 0}
    for fqn in [*units, ""]:
        unit = twin.get_submodule(fqn)
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=_mp_policy(twin, fqn, units, model_dtypes, compute_dtype),
            ignored_params=scalars or None,
        )
    twin.to_empty(device=mesh.device_type)
    tensors: dict[str, DTensor] = {}
    for fqn, tensor, owner, name, kind in slots(twin):
        if kind != "param" or fqn in plan.aliases:
            continue
        entry = by_fqn[fqn]
        if isinstance(tensor, DTensor):
            tensors[fqn] = tensor
        else:
            owner._parameters[name] = nn.Parameter(entry.ema_local, requires_grad=False)
    param_slots = {fqn: (owner, name) for fqn, _, owner, name, kind in slots(twin)}
    for fqn in plan.aliases:  # tied 0-dim parameters: the same shared tensor
        if fqn not in param_slots:
            continue
        owner, name = param_slots[fqn]
        if not isinstance(owner._parameters.get(name), DTensor):
            source = by_fqn[plan.aliases[fqn]]
            owner._parameters[name] = nn.Parameter(source.ema_local, requires_grad=False)
    plan.rebind_ema(tensors)
    install_forward_hooks(model, twin, plan)
    return twin


def _meta_memo(
    model: nn.Module, plan: EmaPlan, compute_dtype: torch.dtype | None
) -> tuple[dict[int, Any], dict[str, torch.dtype]]:
    """The copy memo of a twin on the meta device (parameters in their EMA's dtype, tracked
    buffers in ``compute_dtype`` if given, the rest in their own), and the model's dtype of
    each parameter by fqn."""
    by_fqn = plan.by_fqn()
    memo: dict[int, Any] = {}
    model_dtypes: dict[str, torch.dtype] = {}
    for fqn, tensor, _, _, kind in slots(model):
        if id(tensor) in memo:
            continue
        tracked = by_fqn.get(plan.aliases.get(fqn, fqn))
        if kind == "param":
            dtype = tracked.ema_local.dtype if tracked is not None else tensor.dtype
            model_dtypes[fqn] = tensor.dtype
        else:
            dtype = compute_dtype if compute_dtype and tracked is not None else tensor.dtype
        meta = torch.empty(tensor.shape, dtype=dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=False) if kind == "param" else meta
    return memo, model_dtypes


def _mp_policy(
    twin: nn.Module,
    unit_fqn: str,
    units: list[str],
    model_dtypes: Mapping[str, torch.dtype],
    compute_dtype: torch.dtype | None,
) -> MixedPrecisionPolicy:
    """Cast to the compute dtype on all-gather when it is not the EMA's dtype."""
    inner = [u for u in units if u != unit_fqn and (not unit_fqn or u.startswith(unit_fqn + "."))]
    prefix = f"{unit_fqn}." if unit_fqn else ""
    owned = [
        (prefix + name, p)
        for name, p in twin.get_submodule(unit_fqn).named_parameters()
        if not any((prefix + name).startswith(u + ".") for u in inner)
    ]
    if not owned:
        return MixedPrecisionPolicy()
    if compute_dtype is None:
        canonical = [canonical_fqn(fqn) for fqn, _ in owned]
        dtypes = {model_dtypes[fqn] for fqn in canonical if fqn in model_dtypes}
        if len(dtypes) > 1:
            raise ValueError(
                f"unit {unit_fqn or '<root>'!r} holds parameters of dtypes "
                f"{sorted(str(d) for d in dtypes)}; pass compute_dtype= or split it into units"
            )
        compute_dtype = dtypes.pop() if dtypes else owned[0][1].dtype
    if all(p.dtype == compute_dtype for _, p in owned):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype)


# ------------------------------------------------------------------------- FSDP2 models
def _fsdp_mirror(model: nn.Module, plan: EmaPlan, compute_dtype: torch.dtype | None) -> nn.Module:
    """Mirror an FSDP2 student: same units, meshes, shard dims and mixed precision."""
    by_fqn = plan.by_fqn()
    plain = [e.fqn for e in plan if e.is_parameter and not e.is_dtensor_source]
    if plain:
        raise NotImplementedError(
            f"ema.module for an FSDP2 model with parameters outside fully_shard {plain[:5]}: "
            "apply fully_shard to the root module too, or use ema.average_parameters()"
        )
    layouts: dict[str, tuple[DeviceMesh, Shard]] = {}
    for entry in plan:
        if not entry.is_dtensor_source:
            continue
        source = entry.source
        assert isinstance(source, DTensor)
        placements = tuple(source.placements)
        expected = (Replicate(),) * (len(placements) - 1)
        last = placements[-1]
        if not isinstance(last, Shard) or placements[:-1] != expected or type(last) is not Shard:
            raise NotImplementedError(
                f"ema.module for {entry.fqn!r} with placements {placements} on a "
                f"{source.device_mesh.ndim}-D mesh: only FSDP2's own layouts ((Shard(d),) and "
                "HSDP's (Replicate(), Shard(d))) are mirrored; use ema.average_parameters()"
            )
        layouts[entry.fqn] = (source.device_mesh, last)
    memo, _ = _meta_memo(model, plan, compute_dtype)
    twin = prepare_twin(model, clone_without_fsdp(model, memo))
    twin_fqn = {id(p): canonical_fqn(fqn) for fqn, p in twin.named_parameters()}
    units = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    for fqn in sorted(units, key=lambda f: -f.count(".") if f else 1):
        student = model.get_submodule(fqn)
        managed = [
            layouts[name]
            for name in map(canonical_fqn, _directly_managed(model, fqn, units))
            if name in layouts
        ]
        if not managed:
            continue
        mesh = managed[0][0]
        policy = student_mp_policy(student)
        if compute_dtype is not None:
            policy = MixedPrecisionPolicy(param_dtype=compute_dtype)
        fully_shard(
            twin.get_submodule(fqn),
            mesh=mesh,
            mp_policy=policy,
            shard_placement_fn=(
                (lambda p: layouts[twin_fqn[id(p)]][1])
                if any(shard.dim != 0 for _, shard in managed)
                else None
            ),
        )
    twin.to_empty(device=next(iter(layouts.values()))[0].device_type)
    tensors: dict[str, DTensor] = {}
    refreshed: list[tuple[PlanEntry, torch.Tensor]] = []
    for fqn, tensor in twin.named_parameters():
        assert isinstance(tensor, DTensor), fqn
        entry = by_fqn[canonical_fqn(fqn)]
        if entry.levels:
            # The EMA splits the FSDP2 shard further over replica dims (HSDP's replicate
            # dim, a tp dim of an FSDP-only parameter): FSDP2 cannot hold that, so the
            # twin keeps its own shard, refreshed from the EMA before every forward.
            refreshed.append((entry, tensor.to_local()))
        else:
            tensors[entry.fqn] = tensor
    plan.rebind_ema(tensors)
    install_forward_hooks(model, twin, plan)
    if refreshed:
        _install_refresh_hook(twin, refreshed)
    return twin


def _install_refresh_hook(twin: nn.Module, refreshed: list[tuple[PlanEntry, torch.Tensor]]) -> None:
    """Before a forward: rebuild the twin's FSDP2 shards of ``refreshed`` from the EMA's
    rows (one all-gather per bucket over each replica dim's group)."""

    def refresh(_module: nn.Module, _args: Any) -> None:
        pieces = [  # read ema_local now: the plan may have re-bound it since
            SplitPiece(e.ema_local, e.source_piece.shape, e.levels, e.ema_local.dtype)
            for e, _ in refreshed
        ]
        with torch.no_grad():
            for bucket in iter_unsplit(pieces):
                for index, piece in bucket:
                    refreshed[index][1].copy_(piece)

    twin.register_forward_pre_hook(refresh, prepend=True)


def _directly_managed(model: nn.Module, unit: str, units: list[str]) -> list[str]:
    """Parameter fqns that ``unit`` manages itself (not through a nested unit)."""
    prefix = f"{unit}." if unit else ""
    inner = [u for u in units if u != unit and u.startswith(prefix)]
    return [
        prefix + name
        for name, _ in model.get_submodule(unit).named_parameters()
        if not any((prefix + name).startswith(u + ".") for u in inner)
    ]
