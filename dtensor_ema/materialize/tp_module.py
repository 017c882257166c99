"""``ema.module`` gathered per unit: tensor-parallel models, and EMAs of a tracked subset.

A TP model's EMA keeps the parameter's TP sharding and splits what the model replicates
(the FSDP2 shard of a TP-replicated norm, a plain parameter) further over the replica dims
(:mod:`dtensor_ema.layout`). FSDP2 cannot hold that nested split, and a second shard per
tp rank would double those parameters' bytes. So the twin built here holds **no storage of
its own for parameters**: at rest each of its parameter slots *is* the EMA's DTensor (the
same local storage ``update()`` writes), or, for a tensor the EMA does not track
(``track=``: a LoRA model's frozen base), the model's own tensor (shared, never copied, and
never part of any sharding of the twin); and every *unit* (the model's FSDP2 units, or the
repeated blocks and the root) gathers its parameters just before its forward, into the
layout the model's forward computes with, and drops them right after:

* the replica split is undone (one flat all-gather per bucket over each replica group),
* the FSDP2 shard dims are gathered (one flat all-gather per bucket over the dp group),
* the result is wrapped as the model's *unsharded* parameter: a DTensor with the model's
  TP mesh and placements (for FSDP2 + TP, the layout FSDP2 itself unshards to), or a plain
  full tensor for a parameter that was plain before ``fully_shard``.

Untracked tensors take the same path from the model's own local pieces (an FSDP2 shard is
gathered over the dp group, as the model's own forward would; a plain or TP-local piece is
read in place). This is the twin of every EMA with untracked tensors on a mesh (DDP,
FSDP2, HSDP, TP): the FSDP2 twin of :mod:`dtensor_ema.materialize.ema_module` would have to shard
them.

The TP forward hooks and torchtitan's forward closures are carried over from the model
(see :func:`~dtensor_ema.materialize.twin.rebind_callables`), so the twin runs the model's own
TP forward. Idle memory: the EMA (1/W of the model per rank) plus the twin's float buffers;
peak extra memory in a forward: one unit's parameters in the compute layout (the model's
TP-local size, in the compute dtype) plus the gather's flat buffers, plus activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtensor_ema.layout import (
    PlanEntry,
    ReplicaLevel,
    chunk_range,
    contiguous_stride,
    model_piece,
)
from dtensor_ema.materialize.gather import LocalPiece, gather_full_tensors
from dtensor_ema.materialize.twin import (
    SharedSlots,
    clone_without_fsdp,
    install_forward_hooks,
    prepare_twin,
    slots,
    student_mp_policy,
)
from dtensor_ema.model_keys import canonical_fqn
from dtensor_ema.plan import EmaPlan

__all__ = ["build_tp_twin", "needs_tp_twin"]


@dataclass(frozen=True, slots=True)
class _Compute:
    """How the model's forward reads a DTensor parameter: a DTensor of ``mesh`` and
    ``placements``, or with ``local`` its local piece as a plain tensor (FSDP2's
    ``spmd_types`` path, torchtitan's default). ``None`` stands for a plain full tensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    local: bool = False


ComputeSpec = _Compute | None


def needs_tp_twin(plan: EmaPlan) -> bool:
    """Whether the model has a DTensor parameter FSDP2 alone does not explain: one outside
    ``fully_shard`` or with placements other than ``(Replicate()*, Shard(d))``."""
    fsdp_owned = _fsdp_managed(plan.module)
    for entry in plan:
        source = entry.source
        if not entry.is_parameter or not isinstance(source, DTensor):
            continue
        if id(source) not in fsdp_owned:
            return True
        *outer, last = tuple(source.placements)
        if type(last) is not Shard or any(not p.is_replicate() for p in outer):
            return True
    return False


@dataclass(frozen=True, slots=True)
class _Tracked:
    """A parameter the EMA holds: its EMA rows are gathered."""

    entry: PlanEntry

    @property
    def fqn(self) -> str:
        return self.entry.fqn

    @property
    def source(self) -> torch.Tensor:
        return self.entry.source

    @property
    def levels(self) -> tuple[ReplicaLevel, ...]:
        return self.entry.levels

    @property
    def piece_shape(self) -> torch.Size:
        return self.entry.source_piece.shape

    def local(self) -> torch.Tensor:
        return self.entry.ema_local  # read now: the plan may have re-bound it

    def resting(self) -> torch.Tensor:
        return self.entry.ema


@dataclass(frozen=True, slots=True)
class _Untracked:
    """A parameter the EMA does not hold: the model's own local piece is gathered."""

    plan: EmaPlan
    fqn: str
    levels: tuple[ReplicaLevel, ...] = ()

    @property
    def source(self) -> torch.Tensor:
        return self.plan.untracked[self.fqn]  # read now: the plan may have re-bound it

    @property
    def piece_shape(self) -> torch.Size:
        return self.local().shape

    def local(self) -> torch.Tensor:
        return model_piece(self.source)

    def resting(self) -> torch.Tensor:
        return self.source


_Source = _Tracked | _Untracked


@dataclass(frozen=True, slots=True)
class _Gather:
    """How one parameter (the EMA's, or the model's own) becomes what the forward reads."""

    entry: _Source
    mesh: DeviceMesh | None
    """The model parameter's mesh (its FSDP2 dims are gathered over it), or ``None``."""
    placements: tuple[Placement, ...]
    """``Shard(d)`` on the FSDP2 dims to gather, ``Replicate()`` elsewhere."""
    shape: torch.Size
    """This rank's piece in the compute layout (the TP-local shape)."""
    compute: ComputeSpec
    dtype: torch.dtype

    def in_place(self) -> bool:
        """The local piece already is the compute-layout piece, in the compute dtype."""
        local = self.entry.local()
        return (
            not self.entry.levels
            and all(p.is_replicate() for p in self.placements)
            and local.dtype == self.dtype
            and tuple(local.shape) == tuple(self.shape)
        )

    def piece(self) -> LocalPiece:
        entry = self.entry
        return LocalPiece(
            fqn=entry.fqn,
            local=entry.local(),
            shape=self.shape,
            mesh=self.mesh,
            placements=self.placements,
            out_dtype=self.dtype,
            levels=entry.levels,
            piece_shape=entry.piece_shape,
        )

    def wrap(self, local: torch.Tensor) -> nn.Parameter:
        if self.compute is None or self.compute.local:
            return nn.Parameter(local, requires_grad=False)
        shape = self.entry.source.shape
        value = DTensor.from_local(
            local,
            self.compute.mesh,
            self.compute.placements,
            run_check=False,
            shape=shape,
            stride=contiguous_stride(shape),
        )
        return nn.Parameter(value, requires_grad=False)


def build_tp_twin(
    model: nn.Module, plan: EmaPlan, units: list[str], compute_dtype: torch.dtype | None
) -> nn.Module:
    """The EMA twin of a TP (or FSDP2 + TP) model. Local: no collective.

    Args:
        model: the unwrapped, tracked model.
        plan: the EMA's plan over ``model`` (its entries are not moved).
        units: module fqns that gather their own parameters around their forward, deepest
            first (the model's FSDP2 units if it has any); the root is always one.
        compute_dtype: dtype of the gathered parameters and float buffers; ``None``: the
            FSDP2 unit's ``param_dtype`` if set, else the model parameter's dtype.

    Untracked parameters (``plan.untracked``) are gathered from the model's own pieces;
    untracked float buffers are the model's own
    (:class:`~dtensor_ema.materialize.twin.SharedSlots`).

    Raises:
        NotImplementedError: a DTensor buffer, or a parameter whose layout the twin cannot
            rebuild (naming it and its placements).
    """
    by_fqn = plan.by_fqn()
    shared = SharedSlots(plan)
    dtensor_buffers = [
        f for f, t, _, _, k in slots(model) if k == "buffer" and isinstance(t, DTensor)
    ]
    if dtensor_buffers:
        raise NotImplementedError(
            f"ema.module for a tensor-parallel model with DTensor buffers {dtensor_buffers[:5]}"
            ": evaluate with ema.average_parameters()"
        )
    specs = _fsdp_compute_specs(model)
    policies = _unit_policies(model)
    unit_dtypes = {u: p.param_dtype for u, p in policies.items() if p.param_dtype is not None}
    memo: dict[int, Any] = {}
    for fqn, tensor, _, _, kind in slots(model):
        if id(tensor) in memo:
            continue
        tracked = by_fqn.get(plan.aliases.get(fqn, fqn))
        untracked = shared.untracked_fqn(fqn)
        if kind == "param":
            memo[id(tensor)] = nn.Parameter(
                torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), requires_grad=False
            )
        elif untracked is not None:  # the model's own buffer
            memo[id(tensor)] = shared.value(untracked, kind)
        elif tracked is None:  # never averaged: copied from the model before each forward
            memo[id(tensor)] = torch.empty_like(tensor)
        else:
            memo[id(tensor)] = torch.empty(
                tensor.shape, dtype=compute_dtype or tensor.dtype, device=tensor.device
            )
    twin = prepare_twin(model, clone_without_fsdp(model, memo))
    for fqn, _, owner, name, kind in slots(twin):
        target = shared.untracked_fqn(fqn)
        if kind == "buffer" and target is not None:
            shared.add(owner, name, kind, target)

    unit_of = _assign_units(model, [*units, ""])
    gathers: dict[str, _Gather] = {}
    by_unit: dict[str, list[tuple[nn.Module, str, _Gather]]] = {u: [] for u in [*units, ""]}
    seen_slots: set[tuple[int, str]] = set()
    for prefix, owner in twin.named_modules(remove_duplicate=False):
        for name in list(owner._parameters):
            if (id(owner), name) in seen_slots or owner._parameters[name] is None:
                continue
            seen_slots.add((id(owner), name))
            raw = f"{prefix}.{name}" if prefix else name
            fqn = canonical_fqn(raw)
            target = plan.aliases.get(fqn, fqn)
            if target not in gathers:
                source: _Source = (
                    _Untracked(plan, target)
                    if target in plan.untracked
                    else _Tracked(by_fqn[target])
                )
                unit = unit_of[raw]
                dtype = compute_dtype or unit_dtypes.get(unit) or source.source.dtype
                gathers[target] = _gather_for(source, specs, dtype)
            by_unit[unit_of[raw]].append((owner, name, gathers[target]))
    rest = _RestingParameters()
    for owner, name, gather in (s for unit_slots in by_unit.values() for s in unit_slots):
        owner._parameters[name] = rest.get(gather.entry)
    for unit, unit_slots in by_unit.items():
        policy = policies.get(unit, MixedPrecisionPolicy())
        inputs = compute_dtype or (policy.param_dtype if policy.cast_forward_inputs else None)
        if unit_slots or inputs is not None or policy.output_dtype is not None:
            _install_unit_hooks(
                twin.get_submodule(unit), unit_slots, rest, inputs, policy.output_dtype
            )
    install_forward_hooks(model, twin, plan, shared)
    return twin


class _RestingParameters:
    """One ``nn.Parameter`` per parameter wrapping its current resting tensor (the EMA's
    ``ema`` DTensor, or the model's own untracked tensor: shared storage either way),
    rebuilt when the plan re-binds it."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[torch.Tensor, nn.Parameter]] = {}

    def get(self, entry: _Source) -> nn.Parameter:
        held = self._cache.get(entry.fqn)
        resting = entry.resting()
        if held is None or held[0] is not resting:
            held = (resting, nn.Parameter(resting.detach(), requires_grad=False))
            self._cache[entry.fqn] = held
        return held[1]


def _install_unit_hooks(
    unit: nn.Module,
    slots: list[tuple[nn.Module, str, _Gather]],
    rest: _RestingParameters,
    inputs: torch.dtype | None,
    output: torch.dtype | None,
) -> None:
    """Before ``unit``'s forward: gather its parameters into their compute layout. After it
    (also when it raises): put the EMA's DTensors back, freeing the gathered copies.
    **Collective** (when anything is gathered) over the replica and dp groups involved.
    Like FSDP2's ``MixedPrecisionPolicy``, floating-point inputs are cast to ``inputs`` and
    outputs to ``output`` where set."""
    unique = list({id(g): g for _, _, g in slots}.values())

    def pre_forward(_module: nn.Module, args: Any, kwargs: Any) -> Any:
        # A TP-sharded parameter the EMA does not split further is read in place (no copy).
        direct = [g for g in unique if g.in_place()]
        gathered = [g for g in unique if not g.in_place()]
        with torch.no_grad():
            full = gather_full_tensors([g.piece() for g in gathered]) if gathered else {}
            full.update((g.entry.fqn, g.entry.local()) for g in direct)
            params = {g.entry.fqn: g.wrap(full[g.entry.fqn]) for g in unique}
        for owner, name, gather in slots:
            owner._parameters[name] = params[gather.entry.fqn]
        return (_cast(args, inputs), _cast(kwargs, inputs)) if inputs is not None else None

    def post_forward(_module: nn.Module, _args: Any, result: Any) -> Any:
        for owner, name, gather in slots:
            owner._parameters[name] = rest.get(gather.entry)
        return _cast(result, output) if output is not None else None

    unit.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
    unit.register_forward_hook(post_forward, always_call=True)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (tuples, lists, dicts) cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_cast(v, dtype) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _gather_for(entry: _Source, specs: dict[int, ComputeSpec], dtype: torch.dtype) -> _Gather:
    """Match the model parameter's (sharded) layout against the layout its forward reads.

    The model's mesh is the compute mesh, or the FSDP2 dp dims followed by it (FSDP2 + TP
    through separate meshes). A dim where the compute layout replicates and the model
    shards is an FSDP2 dim and is gathered; every other dim must agree.
    """
    source = entry.source
    compute = specs.get(id(source)) if id(source) in specs else _own_spec(source)
    global_shape = source.shape
    if not isinstance(source, DTensor):
        return _Gather(entry, None, (), global_shape, None, dtype)
    mesh, placements = source.device_mesh, tuple(source.placements)
    cplacements = compute.placements if compute is not None else ()
    extra = len(placements) - len(cplacements)
    aligned = (Replicate(),) * extra + tuple(cplacements)
    gathered: list[Placement] = []
    for have, want in zip(placements, aligned[-len(placements) :], strict=False):
        if have == want and (want.is_replicate() or type(want) is Shard):
            gathered.append(Replicate())
        elif want.is_replicate() and (dim := _shard_dim(have)) is not None:
            gathered.append(Shard(dim))  # FSDP2 chunks the TP-local piece
    shape = (
        _local_shape(global_shape, compute.mesh, cplacements)
        if compute is not None
        else global_shape
    )
    if (
        extra < 0
        or len(gathered) != len(placements)
        or shape is None
        or _local_shape(shape, mesh, tuple(gathered)) != tuple(entry.piece_shape)
    ):
        raise NotImplementedError(
            f"ema.module for {entry.fqn!r} with placements {placements} on mesh "
            f"{mesh.mesh.tolist()}: its forward layout "
            f"{cplacements if compute is not None else 'a plain tensor'} cannot be rebuilt "
            "from it; evaluate with ema.average_parameters()"
        )
    return _Gather(entry, mesh, tuple(gathered), torch.Size(shape), compute, dtype)


def _shard_dim(placement: Placement) -> int | None:
    """The tensor dim a ``Shard`` or FSDP2's ``_StridedShard`` (not a ``Shard`` subclass
    in torch 2.14; ``split_factor`` only says how TP had split that dim first) shards."""
    if isinstance(placement, Shard) or hasattr(placement, "split_factor"):
        return int(placement.dim)  # type: ignore[attr-defined]
    return None


def _own_spec(source: torch.Tensor) -> ComputeSpec:
    """A parameter outside FSDP2 is read as it is."""
    if isinstance(source, DTensor):
        return _Compute(source.device_mesh, tuple(source.placements))
    return None


def _local_shape(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[int, ...] | None:
    """This rank's local shape under ``Shard``/``Replicate`` placements (``torch.chunk``
    per mesh dim, in mesh-dim order, as DTensor does), or ``None`` for other placements."""
    out = list(shape)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim % len(out)
        out[dim] = chunk_range(out[dim], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))[1]
    return tuple(out)


def _assign_units(model: nn.Module, units: list[str]) -> dict[str, str]:
    """Raw parameter fqn (every name of a shared tensor) -> the deepest unit holding it."""
    out = {}
    for prefix, owner in model.named_modules(remove_duplicate=False):
        for name in owner._parameters:
            raw = f"{prefix}.{name}" if prefix else name
            out[raw] = max((u for u in units if not u or raw.startswith(u + ".")), key=len)
    return out


def _unit_policies(model: nn.Module) -> dict[str, MixedPrecisionPolicy]:
    """FSDP2 unit fqn -> the ``MixedPrecisionPolicy`` it was sharded with."""
    return {
        fqn: student_mp_policy(module)  # type: ignore[arg-type]
        for fqn, module in model.named_modules()
        if isinstance(module, FSDPModule)
    }


def _fsdp_managed(model: nn.Module) -> set[int]:
    """Ids of the sharded parameters FSDP2 manages (every parameter under an FSDP2 unit)."""
    return {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}


def _fsdp_compute_specs(model: nn.Module) -> dict[int, ComputeSpec]:
    """id(sharded parameter) -> the layout FSDP2 unshards it to for the forward.

    torch keeps it only on the private ``FSDPParam`` (``_unsharded_dtensor_spec`` in 2.14,
    ``_tp_spec`` before): the DTensor spec the parameter had when ``fully_shard`` was
    applied (TP mesh and placements, or the full SPMD mesh with ``Replicate()`` on the dp
    dims), ``None`` for a plain parameter. Under ``spmd_types`` (``is_spmd_types``,
    torchtitan's default backend) FSDP2 hands the forward that spec's *local* piece as a
    plain tensor. Read here only, through ``getattr``.

    Raises:
        NotImplementedError: a torch whose FSDP2 keeps it elsewhere, with a DTensor
            parameter under ``fully_shard``.
    """
    out: dict[int, ComputeSpec] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = state._fsdp_param_group
                groups = [group] if group is not None else []
            params = [fp for group in groups for fp in group.fsdp_params]
        except AttributeError as error:
            raise NotImplementedError(
                "ema.module for FSDP2 + TP models needs FSDP2's unsharded parameter layout, "
                f"which this torch {torch.__version__} keeps elsewhere ({error}); evaluate "
                "with ema.average_parameters()"
            ) from None
        for fp in params:
            sharded = fp.sharded_param
            if not getattr(fp, "is_dtensor", False):
                out[id(sharded)] = None
                continue
            spec = getattr(fp, "_unsharded_dtensor_spec", None) or getattr(fp, "_tp_spec", None)
            if spec is None:
                raise NotImplementedError(
                    f"ema.module for FSDP2 + TP models: torch {torch.__version__} keeps the "
                    "unsharded layout of a DTensor parameter where it cannot be read; "
                    "evaluate with ema.average_parameters()"
                )
            local = bool(getattr(fp, "is_spmd_types", False))  # FSDP2 unshards to the local
            out[id(sharded)] = _Compute(spec.mesh, tuple(spec.placements), local)
    return out
