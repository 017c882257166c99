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
* **Tensor parallelism** (TP, FSDP2 + TP): the twin's resting parameters are the EMA's own
  DTensors, gathered unit by unit into the model's TP layout just for the forward
  (:mod:`dtensor_ema.tp_module`).

The twin is built from the model's structure on the ``meta`` device (``copy.deepcopy`` with
every tensor pre-mapped to an empty meta tensor), so no weight is ever copied in full.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_ema._collectives import check_all_ranks_enter
from dtensor_ema.materialize import LocalPiece, SplitPiece, gather_full_tensors, iter_unsplit
from dtensor_ema.model_keys import canonical_fqn
from dtensor_ema.plan import EmaPlan, PlanEntry
from dtensor_ema.tp_module import build_tp_twin, needs_tp_twin

__all__ = ["UnitSpec", "build_ema_module", "default_units"]

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
    that FSDP2 alone does not explain (TP, FSDP2 + TP) get the TP twin of
    :func:`~dtensor_ema.tp_module.build_tp_twin` instead: the EMA is not moved, the twin's
    parameters are its DTensors, and each unit (the model's FSDP2 units, else ``units``
    and the root) gathers them into the model's TP layout around its forward.

    Args:
        model: the unwrapped, tracked model.
        plan: the EMA's plan over ``model``.
        mesh: the EMA's 1-D mesh, or ``None`` (no process group: the twin shares the EMA's
            plain tensors).
        units: FSDP units of the twin (see :data:`UnitSpec`); ignored without a mesh.
        compute_dtype: dtype the forward computes in; ``None``: the model's own dtype
            (per unit, so an fp32 EMA of a bf16 model runs its forward in bf16).

    Raises:
        NotImplementedError: FSDP2 models with plain float parameters, an N-D mesh for a
            plain model, or a TP layout the TP twin cannot rebuild (a DTensor buffer, a
            torch whose FSDP2 hides the unsharded layout); each message names the tensor
            and its layout. A callable the twin would share
            with the model and cannot re-bind (see :func:`_rebind_callables`).
        ValueError: bad ``units``, or a unit whose parameters mix dtypes with
            ``compute_dtype=None``.
    """
    integer = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if integer:
        raise NotImplementedError(f"ema.module for models with integer parameters {integer[:5]}")
    if compute_dtype is not None and not (
        isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
    ):
        raise ValueError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
    fsdp_units = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    if needs_tp_twin(plan):
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
    """The model's structure over the EMA's own plain tensors (no weight is copied)."""
    by_fqn = plan.by_fqn()
    memo: dict[int, Any] = {}
    casts: list[tuple[nn.Module, str, str, torch.Tensor, torch.dtype]] = []
    for fqn, tensor, owner, name, kind in _slots(model):
        entry = by_fqn.get(plan.aliases.get(fqn, fqn))
        if id(tensor) in memo:
            continue
        if entry is None:  # integer buffer: a small copy, refreshed before every forward
            memo[id(tensor)] = tensor.detach().clone()
            continue
        shared = entry.ema
        memo[id(tensor)] = nn.Parameter(shared, requires_grad=False) if kind == "param" else shared
        target = compute_dtype or tensor.dtype
        if target != shared.dtype:
            casts.append((owner, name, kind, memo[id(tensor)], target))
    twin = copy.deepcopy(model, memo)
    _rebind_callables(model, twin)
    twin.requires_grad_(False)
    twin.eval()
    twin_slots = {fqn: (owner, name, kind) for fqn, _, owner, name, kind in _slots(twin)}
    # The casts name the source's modules; point them at the twin's.
    fqn_of = {(id(o), n): f for f, _, o, n, _ in _slots(model)}
    twin_casts = [
        (*twin_slots[fqn_of[(id(owner), name)]][:2], kind, master, dtype)
        for owner, name, kind, master, dtype in casts
    ]
    followed = [
        (twin_slots[fqn][0], twin_slots[fqn][1], source) for fqn, source in plan.followed.items()
    ]

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        with torch.no_grad():
            for owner, name, source in followed:
                owner._buffers[name].copy_(source)  # type: ignore[union-attr]
        for owner, name, kind, master, dtype in twin_casts:
            # A temporary cast for this forward; the twin's slot gets the EMA tensor back
            # afterwards, even if the forward raises.
            value = master.detach().to(dtype)
            if kind == "param":
                owner._parameters[name] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[name] = value

    def post_forward(_module: nn.Module, _args: Any, _output: Any) -> None:
        for owner, name, kind, master, _ in twin_casts:
            if kind == "param":
                owner._parameters[name] = master  # type: ignore[assignment]  # a Parameter
            else:
                owner._buffers[name] = master

    twin.register_forward_pre_hook(pre_forward, prepend=True)
    twin.register_forward_hook(post_forward, always_call=True)
    return twin


def _slots(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, str, str]]:
    """``(fqn, tensor, owner, name, "param" | "buffer")`` for every registered tensor,
    shared ones under every name. ``fqn`` is canonical (the plan's key: no
    ``_checkpoint_wrapped_module.`` or ``_orig_mod.`` components)."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, p in owner._parameters.items():
            if p is not None:
                yield canonical_fqn(f"{prefix}.{name}" if prefix else name), p, owner, name, "param"
        for name, b in owner._buffers.items():
            if b is not None:
                yield (
                    canonical_fqn(f"{prefix}.{name}" if prefix else name),
                    b,
                    owner,
                    name,
                    "buffer",
                )


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
    memo: dict[int, Any] = {}
    model_dtypes: dict[str, torch.dtype] = {}
    for fqn, tensor, _, _, kind in _slots(model):
        if id(tensor) in memo:
            continue
        entry = by_fqn.get(plan.aliases.get(fqn, fqn))
        if kind == "param":
            dtype = entry.ema_local.dtype if entry is not None else tensor.dtype
            memo[id(tensor)] = nn.Parameter(
                torch.empty(tensor.shape, dtype=dtype, device="meta"), requires_grad=False
            )
            model_dtypes[fqn] = tensor.dtype
        else:
            dtype = compute_dtype if compute_dtype and entry is not None else tensor.dtype
            memo[id(tensor)] = torch.empty(tensor.shape, dtype=dtype, device="meta")
    twin = copy.deepcopy(model, memo)
    _rebind_callables(model, twin)
    twin.requires_grad_(False)
    twin.eval()
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
    for fqn, tensor, owner, name, kind in _slots(twin):
        if kind != "param" or fqn in plan.aliases:
            continue
        entry = by_fqn[fqn]
        if isinstance(tensor, DTensor):
            tensors[fqn] = tensor
        else:
            owner._parameters[name] = nn.Parameter(entry.ema_local, requires_grad=False)
    param_slots = {fqn: (owner, name) for fqn, _, owner, name, kind in _slots(twin)}
    for fqn in plan.aliases:  # tied 0-dim parameters: the same shared tensor
        if fqn not in param_slots:
            continue
        owner, name = param_slots[fqn]
        if not isinstance(owner._parameters.get(name), DTensor):
            source = by_fqn[plan.aliases[fqn]]
            owner._parameters[name] = nn.Parameter(source.ema_local, requires_grad=False)
    plan.rebind_ema(tensors)
    _install_forward_hooks(model, twin, plan)
    return twin


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


def _install_forward_hooks(model: nn.Module, twin: nn.Module, plan: EmaPlan) -> None:
    """Before a forward: gather the EMA's float buffers into the twin (one flat all-gather
    per bucket over the mesh) and copy the integer ones, and the buffers the EMA does not
    track (non-persistent ones: RoPE tables), from the model. After it (also when it
    raises): reshard every unit, so the root's parameters do not stay gathered and the
    next forward sees the next update()."""
    buffer_slots = {
        fqn: (owner, name) for fqn, _, owner, name, kind in _slots(twin) if kind == "buffer"
    }
    entries = [e for e in plan if not e.is_parameter and not e.is_dtensor_source]
    pieces = [_buffer_piece(e, buffer_slots[e.fqn]) for e in entries]
    followed = [(buffer_slots[fqn], source) for fqn, source in plan.followed.items()]
    tracked = {*plan.by_fqn(), *plan.aliases, *plan.followed}
    followed += [
        (buffer_slots[fqn], source)
        for fqn, source, _, _, kind in _slots(model)
        if kind == "buffer" and fqn not in tracked and fqn in buffer_slots
    ]

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        check_all_ranks_enter(plan.world, "ema.module forward")
        with torch.no_grad():
            for (owner, name), source in followed:
                owner._buffers[name].copy_(source)  # type: ignore[union-attr]
            if pieces:
                full = gather_full_tensors(pieces)
                for entry in entries:
                    owner, name = buffer_slots[entry.fqn]
                    owner._buffers[name].copy_(full[entry.fqn])  # type: ignore[union-attr]

    def post_forward(_module: nn.Module, _args: Any, _output: Any) -> None:
        for module in twin.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    twin.register_forward_pre_hook(pre_forward, prepend=True)
    twin.register_forward_hook(post_forward, always_call=True)


def _buffer_piece(entry: PlanEntry, slot: tuple[nn.Module, str]) -> LocalPiece:
    """How to gather one float buffer's EMA into the twin's (full) buffer: undo the
    replica split (``levels``), in the twin buffer's dtype."""
    owner, name = slot
    buffer = owner._buffers[name]
    assert buffer is not None
    return LocalPiece(
        fqn=entry.fqn,
        local=entry.ema_local,
        shape=entry.source.shape,
        mesh=None,
        placements=(),
        out_dtype=buffer.dtype,
        levels=entry.levels,
        piece_shape=entry.source_piece.shape,
    )


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
    memo: dict[int, Any] = {}
    for fqn, tensor, _, _, kind in _slots(model):
        if id(tensor) in memo:
            continue
        tracked = by_fqn.get(plan.aliases.get(fqn, fqn))
        if kind == "param":
            dtype = tracked.ema_local.dtype if tracked is not None else tensor.dtype
        else:
            dtype = compute_dtype if compute_dtype and tracked is not None else tensor.dtype
        meta = torch.empty(tensor.shape, dtype=dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=False) if kind == "param" else meta
    twin = _clone_without_fsdp(model, memo)
    _rebind_callables(model, twin)
    twin.requires_grad_(False)
    twin.eval()
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
        policy = _student_mp_policy(student)
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
    _install_forward_hooks(model, twin, plan)
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


def _student_mp_policy(module: nn.Module) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` a student unit was sharded with. torch keeps it only on
    the private FSDP state; without it (a torch that renamed it) the default policy."""
    try:
        policy = module._get_fsdp_state()._mp_policy  # type: ignore[operator]
    except AttributeError:
        return MixedPrecisionPolicy()
    return policy if isinstance(policy, MixedPrecisionPolicy) else MixedPrecisionPolicy()


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _clone_without_fsdp(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The module tree with FSDP2 taken off: original classes, FSDP's hooks and state
    dropped, tensors replaced through ``memo``, other attributes shared (shallow).

    FSDP2 modules refuse ``copy.deepcopy``; the twin needs only the structure.
    """
    clones: dict[int, nn.Module] = {}

    def clone(m: nn.Module) -> nn.Module:
        if id(m) in clones:
            return clones[id(m)]
        cls: type[nn.Module] = type(m)
        if isinstance(m, FSDPModule):
            cls = next(b for b in cls.__bases__ if issubclass(b, nn.Module))
        new = cls.__new__(cls)
        clones[id(m)] = new
        state = {k: v for k, v in m.__dict__.items() if not _fsdp_attribute(k, v)}
        state["_parameters"] = {
            k: (memo[id(v)] if v is not None else None) for k, v in m._parameters.items()
        }
        state["_buffers"] = {
            k: (memo[id(v)] if v is not None else None) for k, v in m._buffers.items()
        }
        state["_modules"] = {
            k: (clone(v) if v is not None else None) for k, v in m._modules.items()
        }
        for name in _HOOK_DICTS:
            hooks = m.__dict__.get(name)
            if isinstance(hooks, dict):
                state[name] = type(hooks)((k, h) for k, h in hooks.items() if not _fsdp_hook(h))
        new.__dict__.update(state)
        return new

    return clone(module)


def _fsdp_attribute(name: str, value: Any) -> bool:
    if name in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
        return True
    # fully_shard's composable state and registry live in the module's __dict__.
    return name.startswith("__composable_api")


def _fsdp_hook(hook: Any) -> bool:
    owner = getattr(hook, "__self__", None)
    target = owner if owner is not None else hook
    module = getattr(type(target) if owner is not None else target, "__module__", "") or ""
    if isinstance(hook, functools.partial):
        return _fsdp_hook(hook.func)
    return module.startswith("torch.distributed.fsdp") or module.startswith(
        "torch.distributed._composable"
    )


# ------------------------------------------------------------------------- callables
# Per-instance attributes that hold callables a clone would otherwise share with the model.
_CALLABLE_SLOTS = ("forward", *_HOOK_DICTS[:5])


def _rebind_callables(model: nn.Module, twin: nn.Module) -> None:
    """Point the twin's per-instance callables at the twin, never at ``model``.

    A structural clone inherits what ``model``'s modules hold in their ``__dict__``:

    * ``forward`` set on the instance: torchtitan's ``Module.parallelize`` sets
      ``self.forward`` to a closure over the module, its bound ``forward`` (or a
      ``local_map`` wrapper of it) and the ``ParallelDims``; CP wraps attention the same
      way. Run as is, the twin would call the *training* module's forward.
    * forward hooks: bound methods or closures over modules.
    * ``_compiled_call_impl`` (``module.compile()``, torchtitan's per-block compile): a
      compiled function of the *training* module's ``_call_impl``.

    Bound methods of a module of ``model`` are re-bound to the twin's module of the same
    fqn; closures and ``functools.partial`` objects are rebuilt with every module (or bound
    method) they capture replaced the same way. ``_compiled_call_impl`` is dropped: the
    twin runs eagerly (compile it yourself, e.g. ``block.compile()`` per block of
    ``ema.module``). Local.

    Raises:
        NotImplementedError: a callable captures a module outside ``model``, or is an
            object whose captures cannot be seen (naming the module and attribute).
    """
    twins = dict(twin.named_modules(remove_duplicate=False))
    mapping: dict[int, nn.Module] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        if fqn in twins:
            mapping[id(module)] = twins[fqn]
    for fqn, module in twin.named_modules():
        state = module.__dict__
        if state.get("_compiled_call_impl") is not None:
            state["_compiled_call_impl"] = None
        where = fqn or "<root>"
        if "forward" in state:
            state["forward"] = _remap(state["forward"], mapping, f"{where}.forward", 0)
        for name in _HOOK_DICTS[:5]:
            hooks = state.get(name)
            if isinstance(hooks, dict) and hooks:
                state[name] = type(hooks)(
                    (k, _remap(h, mapping, f"{where}.{name}", 0)) for k, h in hooks.items()
                )


def _remap(obj: Any, mapping: Mapping[int, nn.Module], where: str, depth: int) -> Any:
    """``obj`` with every module of the model it captures replaced by the twin's."""
    if depth > 8:
        raise NotImplementedError(f"ema.module: {where} nests callables too deeply to rebind")
    if isinstance(obj, nn.Module):
        if id(obj) in mapping:
            return mapping[id(obj)]
        if obj in mapping.values():
            return obj
        raise NotImplementedError(
            f"ema.module: {where} captures a {type(obj).__name__} that is not part of the "
            "model; the EMA twin cannot run it. Evaluate with ema.average_parameters()"
        )
    if isinstance(obj, types.MethodType):
        owner = _remap(obj.__self__, mapping, where, depth + 1)
        return obj if owner is obj.__self__ else types.MethodType(obj.__func__, owner)
    if isinstance(obj, functools.partial):
        func = _remap(obj.func, mapping, where, depth + 1)
        args = tuple(_remap(a, mapping, where, depth + 1) for a in obj.args)
        kwargs = {k: _remap(v, mapping, where, depth + 1) for k, v in obj.keywords.items()}
        if (
            func is obj.func
            and all(a is b for a, b in zip(args, obj.args, strict=True))
            and all(kwargs[k] is v for k, v in obj.keywords.items())
        ):
            return obj
        return functools.partial(func, *args, **kwargs)
    if isinstance(obj, types.FunctionType):
        return _remap_function(obj, mapping, where, depth)
    if callable(obj) and not isinstance(obj, (type, types.BuiltinFunctionType)):
        captured = (
            [v for v in vars(obj).values() if isinstance(v, nn.Module)]
            if hasattr(obj, "__dict__")
            else []
        )
        if any(id(v) in mapping for v in captured):
            raise NotImplementedError(
                f"ema.module: {where} is a {type(obj).__name__} holding a module of the "
                "model; the EMA twin cannot rebind it. Evaluate with ema.average_parameters()"
            )
    return obj


def _remap_function(
    fn: types.FunctionType, mapping: Mapping[int, nn.Module], where: str, depth: int
) -> types.FunctionType:
    """``fn`` rebuilt over remapped closure cells, defaults and ``__wrapped__``."""
    cells = fn.__closure__ or ()
    values = []
    changed = False
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later): keep it as is
            values.append(cell)
            continue
        new = _remap(value, mapping, where, depth + 1)
        changed |= new is not value
        values.append(types.CellType(new) if new is not value else cell)
    defaults = fn.__defaults__
    if defaults:
        new_defaults = tuple(_remap(d, mapping, where, depth + 1) for d in defaults)
        changed |= any(a is not b for a, b in zip(new_defaults, defaults, strict=True))
        defaults = new_defaults
    wrapped = fn.__dict__.get("__wrapped__")
    new_wrapped = _remap(wrapped, mapping, where, depth + 1) if wrapped is not None else None
    changed |= new_wrapped is not wrapped
    if not changed:
        return fn
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, tuple(values))
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    out.__dict__.update(fn.__dict__)
    if wrapped is not None:
        out.__dict__["__wrapped__"] = new_wrapped
    return out
