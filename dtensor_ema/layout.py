"""Which piece of each model tensor this rank averages, and over which ranks it is replicated.

The rule: **every EMA element lives on exactly one rank**. A tensor's *local piece* is what
this rank holds of it in the model (``to_local()`` of an FSDP2/TP DTensor parameter, or the
whole tensor for plain/DDP tensors). That piece is identical on every rank that differs
from this one only along a *replica dim*: a mesh dim where the parameter is ``Replicate()``
(the HSDP replicate dim, ``tp`` for a TP-replicated norm weight) or a dim of the world mesh
that the parameter's own mesh does not cover (``tp`` for FSDP-only parameters in a 2-D world,
``dp`` for a TP-only model, every dim for a plain tensor). The EMA splits the local piece
further along its dim 0 over every replica dim, nested like ``torch.chunk`` (outer replica
dim first), so the update reads a contiguous slice of the local piece and never communicates.

The EMA stays a ``DTensor``: its mesh is the world mesh with the dims permuted so that the
parameter's sharding dims come first and the replica dims last (built from existing process
groups with ``DeviceMesh.from_group``: no new groups), and its placements are the
parameter's own followed by ``Shard(0)`` on each replica dim. DTensor applies placements in
mesh-dim order, so this is exactly "the parameter's local piece, then chunked over the
replicas", and DCP, ``full_tensor()`` and resharding see an ordinary DTensor.

**ZeRO-3 partitions** (DeepSpeed stage 3, :mod:`dtensor_ema.zero_partition`) are one more
way to own elements: each rank holds a flat range of the flattened parameter, which is
``Shard(0)`` of the flattened tensor over DeepSpeed's group. Their EMA is a 1-D DTensor of
``ds_numel`` elements, ``Shard(0)`` on the world mesh (which must be that group), whose
local shard averages the partition without its padding; the layout records the real shape
(:class:`FlatPartition`), which full tensors and checkpoints use
(:meth:`PlanEntry.checkpoint_value`: DCP chunks of the real shape, :mod:`dtensor_ema.
flat_chunks`). Everything else (update, gathers, swap) treats the entry like a 1-D FSDP2
parameter.

``chunk_range`` is our own three-line version of DTensor's private ``Shard(0)`` helper
(checked against DTensor for n = 0..64, W = 1..9).
"""

from __future__ import annotations

import itertools
import math
import operator
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtensor_ema import zero_partition
from dtensor_ema._collectives import mesh_gather_rows
from dtensor_ema.flat_chunks import FlatChunks
from dtensor_ema.options import EmaOptions

__all__ = [
    "FlatPartition",
    "LayoutBuilder",
    "PiecePointers",
    "PlanEntry",
    "ReplicaLevel",
    "TensorLayout",
    "agree_on_structure",
    "chunk_range",
    "contiguous_stride",
    "cpu_mesh_like",
    "default_ema_dtype",
    "ema_local_from_full",
    "local_rows",
    "make_entry",
    "model_geometry",
    "model_piece",
    "model_piece_ptr",
    "model_shape",
    "plain_tensor",
    "refine_world_mesh",
    "resolve_world_mesh",
    "shard_mesh_dim",
]


def chunk_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return ``(offset, length)`` of ``rank``'s dim-0 chunk of ``n`` rows over ``world_size``.

    Matches DTensor ``Shard(0)``: chunk ``c = ceil(n / W)``; an empty shard's offset is
    clamped to ``n``. For ``W = 4``: ``n = 10 -> 3,3,3,1``; ``n = 1 -> 1,0,0,0``.
    """
    chunk = math.ceil(n / world_size) if n else 0
    offset = min(rank * chunk, n)
    length = max(0, min(n, offset + chunk) - offset)
    return offset, length


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``shape`` (what the EMA stores)."""
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def shard_mesh_dim(placements: Sequence[Placement]) -> int | None:
    """Mesh dim that shards tensor dim 0, if every other mesh dim replicates.

    ``(Shard(0),)`` -> 0; HSDP ``(Replicate(), Shard(0))`` -> 1; all-``Replicate`` or any
    other layout (``Shard(1)``, two shard dims) -> ``None``. Layouts with a shard mesh dim can
    be gathered with one flat all-gather over that dim's process group.
    """
    found: int | None = None
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Shard) and placement.dim == 0 and found is None:
            found = mesh_dim
            continue
        return None
    return found


@dataclass(frozen=True, slots=True)
class ReplicaLevel:
    """One replica dim the local piece is split over: ``rows`` rows of the piece (at this
    nesting level) are chunked over the ``size`` ranks of ``group``; this rank is ``rank``."""

    group: dist.ProcessGroup
    size: int
    rank: int
    rows: int

    @property
    def key(self) -> str:
        return self.group.group_name


@dataclass(frozen=True, slots=True)
class FlatPartition:
    """A tensor the EMA averages flattened (a ZeRO-3 partition): its real ``shape``, and
    the flat index where this rank's piece starts."""

    shape: torch.Size
    start: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where this rank's EMA piece of one model tensor lives.

    ``mesh``/``placements``: the EMA DTensor's (``None``/``()`` without a world mesh).
    ``offset``/``length``: the rows of the local piece (dim 0) this rank averages.
    ``levels``: the replica dims the piece is split over, outermost first; gathering over
    them innermost first rebuilds the local piece from the EMA shards.
    ``flat``: set when the EMA DTensor is the flattened tensor (a ZeRO-3 partition), which
    full tensors and checkpoints turn back into the real shape.
    """

    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]
    offset: int
    length: int
    levels: tuple[ReplicaLevel, ...]
    flat: FlatPartition | None = None


def resolve_world_mesh(
    mesh: DeviceMesh | None, tensors: Iterable[torch.Tensor], device: torch.device
) -> DeviceMesh | None:
    """The mesh whose ranks share the EMA: the user's, or a default. Local (no collective),
    except when the world needs a process group no existing mesh has (see below).

    ``mesh=None``: the world is found from the model's DTensor parameters when it has any:

    1. their meshes' common *root* (the mesh they were sliced, flattened or unflattened
       from; they must all have the same one);
    2. if some parameter mesh is not a sub-grid of that root (torchtitan's ``ParallelDims``
       unflattens a 1-D ``("world",)`` mesh into ``(dp_replicate, fsdp, tp)``, ``(efsdp,
       ep)``...), the root *refined*: the same ranks in the same order, split into the
       finest dims that every parameter mesh dim is made of (:func:`refine_world_mesh`).

    Without DTensor parameters: the whole default process group as a 1-D mesh; without a
    process group: ``None`` (plain, unsharded EMA tensors). A user's ``mesh=`` is refined
    the same way when a parameter mesh is a sub-grid neither of it nor of its root.

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        ValueError: its device type is not the model's, the DTensor parameters live on
            meshes with different roots, or their dims do not nest (pass ``mesh=``
            explicitly).
    """
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        meshes = _unique_meshes(t.device_mesh for t in tensors if isinstance(t, DTensor))
        # By value: fully_shard() without mesh= builds an equal new default mesh per call.
        roots = {_mesh_key(_root_mesh(m)): m for m in meshes}
        if len(roots) > 1:
            raise ValueError(
                "the model's DTensor parameters live on meshes with different roots "
                f"({[tuple(m.shape) for m in roots.values()]}); pass mesh= the world mesh "
                "that covers all of them"
            )
        if roots:
            return refine_world_mesh(_root_mesh(next(iter(roots.values()))), meshes)
        return init_device_mesh(device.type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.device_type != device.type:
        raise ValueError(
            f"mesh device type {mesh.device_type!r} does not match the model's tensors on "
            f"{device.type!r}; build the mesh with init_device_mesh({device.type!r}, ...)"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}; every "
            "rank that constructs the EMA must be part of its mesh"
        )
    meshes = _unique_meshes(t.device_mesh for t in tensors if isinstance(t, DTensor))
    if any(_misfit(m, mesh) for m in meshes):
        # The same ranks as a coarser mesh (torchtitan's 1-D world): refine it. Where that
        # fails, LayoutBuilder names the parameter that does not fit.
        try:
            return refine_world_mesh(mesh, meshes)
        except ValueError:
            return mesh
    return mesh


def _misfit(pmesh: DeviceMesh, world: DeviceMesh) -> bool:
    """Whether :class:`LayoutBuilder` can place a parameter of ``pmesh`` on ``world``
    neither directly nor through ``pmesh``'s root."""
    if _sub_grid_dims(pmesh, world) is not None:
        return False
    root = _root_mesh(pmesh)
    return _sub_grid_dims(pmesh, root) is None or _sub_grid_dims(world, root) is None


def refine_world_mesh(world: DeviceMesh, meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """``world`` split into dims fine enough that every mesh in ``meshes`` is a sub-grid.

    Every rank's *position* is its row-major index in ``world``. A mesh dim whose ranks
    (through this rank) sit at positions ``base + k * stride`` for ``k < size`` is a
    *mode* ``(size, stride)``; a flattened dim is several modes. The cut points ``stride``
    and ``stride * size`` of every mode (and of ``world``'s own dims) must form a chain
    ``1 = c_0 | c_1 | ... | c_n = W``; the refined world then has dims of sizes
    ``c_{i+1} / c_i``, outermost first, over ``world``'s ranks in the same order (the
    ``_unflatten`` that built them, undone and redone as finely as needed). Returns
    ``world`` itself when every mesh already is a sub-grid of it.

    Each dim reuses the process group of a parameter mesh dim with exactly its ranks; a dim
    that none has gets new groups, which is **collective** over the default group (every
    rank must call: the EMA constructor does). Otherwise local.

    Raises:
        ValueError: a mesh has ranks outside ``world`` or dims that are not strided runs
            of its positions, or the meshes cut ``world`` in ways that do not nest (e.g.
            ``(2, 6)`` and ``(3, 4)`` on 12 ranks).
    """
    meshes = _unique_meshes([world, *meshes])
    if all(_sub_grid_dims(m, world) is not None for m in meshes):
        return world
    flat = world.mesh.reshape(-1).tolist()
    position = {rank: i for i, rank in enumerate(flat)}
    size = len(flat)
    cuts = {1, size}
    owners: list[tuple[tuple[int, int], DeviceMesh, int]] = []
    for m in meshes:
        coord = m.get_coordinate()
        for i in range(m.ndim):
            if m.size(i) == 1:
                continue
            line = _ranks_along(m.mesh, coord, [i]) if coord is not None else []
            if coord is None or any(r not in position for r in line):
                raise ValueError(
                    f"the mesh {m.mesh.tolist()} has ranks outside the world mesh "
                    f"{world.mesh.tolist()}; pass mesh= the world mesh the model was "
                    "parallelized on"
                )
            modes = _modes([position[r] for r in line])
            if modes is None:
                raise ValueError(
                    f"dim {i} of the mesh {m.mesh.tolist()} is not a strided run of the world "
                    f"mesh {world.mesh.tolist()}; pass mesh= the world mesh the model was "
                    "parallelized on"
                )
            for mode_size, stride in modes:
                cuts.update((stride, stride * mode_size))
            if len(modes) == 1:
                owners.append((modes[0], m, i))
    chain = sorted(cuts)
    if any(b % a for a, b in itertools.pairwise(chain)):
        raise ValueError(
            f"the model's parameter meshes {[tuple(m.shape) for m in meshes]} split the world "
            f"mesh {world.mesh.tolist()} into dims that do not nest (strides {chain}); pass "
            "mesh= the world mesh the model was parallelized on"
        )
    modes = [(b // a, a) for a, b in itertools.pairwise(chain)][::-1]  # outermost first
    ranks = world.mesh.reshape([n for n, _ in modes])
    here = [position[dist.get_rank()] // stride % n for n, stride in modes]
    groups: list[dist.ProcessGroup | None] = []
    for k, mode in enumerate(modes):
        line = _ranks_along(ranks, here, [k])
        found = [
            m.get_group(i)
            for owned, m, i in owners
            if owned == mode and _ranks_along(m.mesh, m.get_coordinate() or (), [i]) == line
        ]
        groups.append(found[0] if found else None)
    for k, group in enumerate(groups):
        if group is None:
            groups[k] = _new_dim_groups(ranks, k)
    names = tuple(f"world{k}" for k in range(len(modes)))
    return DeviceMesh.from_group(
        [g for g in groups if g is not None], world.device_type, ranks, mesh_dim_names=names
    )


def _modes(positions: Sequence[int]) -> list[tuple[int, int]] | None:
    """``positions`` as nested strided runs ``[(size, stride), ...]``, innermost first
    (row-major: the last index moves fastest), or ``None`` if they are not."""
    n = len(positions)
    offsets = [p - positions[0] for p in positions]
    modes: list[tuple[int, int]] = []
    block = 1
    while block < n:
        stride = offsets[block]
        if stride <= 0:
            return None
        run = 1
        while block * run < n and offsets[block * run] == run * stride:
            run += 1
        while run > 1 and n % (block * run):
            run -= 1
        if run == 1:
            return None
        modes.append((run, stride))
        block *= run
    for k, offset in enumerate(offsets):
        rest, expected = k, 0
        for run, stride in modes:
            expected += rest % run * stride
            rest //= run
        if offset != expected:
            return None
    return modes


def _new_dim_groups(ranks: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's process group along ``dim`` of ``ranks``; every rank creates every
    group of that dim (collective over the default group)."""
    lines = ranks.movedim(dim, -1).reshape(-1, ranks.size(dim)).tolist()
    group, _ = dist.new_subgroups_by_enumeration(lines)
    assert isinstance(group, dist.ProcessGroup)
    return group


def _unique_meshes(meshes: Iterable[DeviceMesh]) -> list[DeviceMesh]:
    out: dict[tuple[object, ...], DeviceMesh] = {}
    for m in meshes:
        out.setdefault((*_mesh_key(m), m.mesh_dim_names), m)
    return list(out.values())


def _mesh_key(mesh: DeviceMesh) -> tuple[object, ...]:
    return (mesh.device_type, tuple(mesh.shape), tuple(mesh.mesh.reshape(-1).tolist()))


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The N-D mesh a submesh was sliced from. Torch has no public accessor; the private
    one has existed since 2.4 (``_get_root_mesh``); without it the mesh is its own root."""
    getter = getattr(mesh, "_get_root_mesh", None)
    root = getter() if callable(getter) else None
    return root if isinstance(root, DeviceMesh) else mesh


def _ranks_along(mesh_ranks: torch.Tensor, coordinate: Sequence[int], dims: Sequence[int]) -> list:
    """Global ranks of the sub-grid over ``dims`` through ``coordinate``, row-major."""
    index: list[Any] = list(coordinate)
    for dim in dims:
        index[dim] = slice(None)
    return mesh_ranks[tuple(index)].reshape(-1).tolist()


class LayoutBuilder:
    """Computes :class:`TensorLayout` for the tensors of one model on one world mesh.

    One instance per plan, so tensors with the same layout share one EMA mesh object.
    Local: no collective (EMA meshes reuse the world's and the parameters' process groups).
    """

    def __init__(self, world: DeviceMesh | None) -> None:
        self.world = world
        self._meshes: dict[tuple[object, ...], DeviceMesh] = {}

    def layout(self, fqn: str, tensor: torch.Tensor, piece_shape: Sequence[int]) -> TensorLayout:
        """Layout of ``tensor`` (a plain tensor or a DTensor parameter) whose local piece on
        this rank has ``piece_shape``.

        The geometry is the world mesh when the parameter's mesh is a sub-grid of it, else
        the parameter's root mesh (the user passed a submesh of it, e.g. HSDP's shard dim or
        a pipeline stage's ``dp``): then only the root dims the world spans are split over,
        and the parameter's other replicate dims stay ``Replicate()``.

        Raises:
            ValueError: a ``Partial`` or unknown placement, a parameter mesh that is not a
                sub-grid of the world mesh or of a mesh containing it, or a layout torch
                computes differently.
        """
        world = self.world
        if world is None:
            return TensorLayout(None, (), 0, piece_shape[0] if piece_shape else 0, ())
        pmesh: DeviceMesh | None = None
        placements: tuple[Placement, ...] = ()
        param_dims: list[list[int]] | None = []
        geometry = world
        if isinstance(tensor, DTensor):
            pmesh, placements = tensor.device_mesh, tuple(tensor.placements)
            for placement in placements:
                if placement.is_partial():
                    raise ValueError(
                        f"cannot average {fqn!r}: placement {placement} is Partial (a pending "
                        "reduction); the EMA needs the parameter's actual values"
                    )
            param_dims = _sub_grid_dims(pmesh, geometry)
            if param_dims is None:
                geometry = _root_mesh(pmesh)
                param_dims = _sub_grid_dims(pmesh, geometry)
            if param_dims is None:
                raise ValueError(
                    f"cannot average {fqn!r}: its mesh {pmesh.mesh.tolist()} is not a sub-grid "
                    f"of the EMA's mesh {world.mesh.tolist()}; pass mesh= the world mesh the "
                    "model was parallelized on"
                )
        world_dims = _sub_grid_dims(world, geometry)
        if world_dims is None:
            raise ValueError(
                f"cannot average {fqn!r}: the EMA's mesh {world.mesh.tolist()} is not a sub-grid "
                f"of its parameter's root mesh {geometry.mesh.tolist()}"
            )
        allowed = {d for dims in world_dims for d in dims}
        # EMA mesh dims (group, geometry dims, placement): the parameter's sharding dims in
        # its order, its replicate dims outside the world (kept), then the split dims.
        kept: list[tuple[dist.ProcessGroup, list[int], Placement, str]] = []
        split: list[tuple[dist.ProcessGroup, list[int], str]] = []
        covered: set[int] = set()
        assert param_dims is not None
        for i, dims in enumerate(param_dims):
            covered.update(dims)
            if not dims:
                continue  # a size-1 parameter mesh dim: nothing is split or replicated
            assert pmesh is not None
            name = _dim_name(pmesh, i, "param")
            if not placements[i].is_replicate():
                kept.append((pmesh.get_group(i), dims, placements[i], name))
            elif set(dims) <= allowed:
                split.append((pmesh.get_group(i), dims, name))
            else:
                kept.append((pmesh.get_group(i), dims, Replicate(), name))
        for j, dims in enumerate(world_dims):
            if dims and not set(dims) & covered:
                split.append((world.get_group(j), dims, _dim_name(world, j, "world")))
            elif dims and not set(dims) <= covered:
                raise ValueError(
                    f"cannot average {fqn!r}: dim {j} of the EMA's mesh is only partly covered "
                    "by the parameter's mesh; pass mesh= the world mesh the model was "
                    "parallelized on"
                )
        coord = geometry.get_coordinate()
        assert coord is not None
        # Nested chunks of dim 0 over the split dims, outermost first.
        offset, length = 0, piece_shape[0] if piece_shape else 0
        levels = []
        for group, dims, _ in split:
            size = math.prod(geometry.size(j) for j in dims)
            rank = _ranks_along(geometry.mesh, coord, dims).index(dist.get_rank())
            if dist.get_rank(group) != rank:
                raise ValueError(
                    f"cannot average {fqn!r}: process group {group.group_name} orders its ranks "
                    f"{dist.get_process_group_ranks(group)} unlike the mesh; build meshes with "
                    "init_device_mesh"
                )
            if piece_shape:
                levels.append(ReplicaLevel(group, size, rank, length))
                chunk_offset, length = chunk_range(length, size, rank)
                offset += chunk_offset
        if not split:
            if pmesh is not None:
                return TensorLayout(pmesh, placements, 0, length, ())
            return TensorLayout(world, _default_placements(world, piece_shape), 0, length, ())
        # Plain tensors split over the world's dims in its own order keep the world mesh.
        is_world = (
            geometry is world
            and not kept
            and [d for _, d, _ in split] == [[j] for j in range(world.ndim) if world.size(j) > 1]
        )
        if is_world and world.ndim == len(split):
            mesh = world
        else:
            mesh = self._ema_mesh(geometry, kept, split)
        tail: Placement = Shard(0) if piece_shape else Replicate()
        ema_placements = tuple(p for _, _, p, _ in kept) + (tail,) * len(split)
        layout = TensorLayout(mesh, ema_placements, offset, length, tuple(levels))
        _check_with_torch(fqn, tensor.shape, layout, piece_shape)
        return layout

    def place(
        self, fqn: str, tensor: torch.Tensor, partition: zero_partition.ZeroPartition | None
    ) -> tuple[torch.Tensor, torch.Size, TensorLayout]:
        """``(piece, shape, layout)`` of a model tensor: this rank's local piece of it (a
        view), its real global shape, and its layout. ``partition``: what
        :func:`~dtensor_ema.zero_partition.read_partition` read of it (``None``: not a
        ZeRO-3 parameter), whose flat range is ``Shard(0)`` of the flattened tensor over the
        world mesh (checked there to be DeepSpeed's group, in its order). Local.

        Raises:
            ValueError: as :meth:`layout`.
        """
        if partition is not None:
            flat = FlatPartition(partition.shape, partition.start)
            length = partition.piece.numel()
            return (
                partition.piece,
                partition.shape,
                TensorLayout(self.world, (Shard(0),), 0, length, (), flat),
            )
        piece = plain_tensor(_local(tensor)).detach()  # a wrapper subclass: its plain tensor
        return piece, tensor.shape, self.layout(fqn, tensor, piece.shape)

    def _ema_mesh(
        self,
        geometry: DeviceMesh,
        kept: list[tuple[dist.ProcessGroup, list[int], Placement, str]],
        split: list[tuple[dist.ProcessGroup, list[int], str]],
    ) -> DeviceMesh:
        """The sub-grid of ``geometry`` through this rank over the EMA dims, in EMA order,
        as a DeviceMesh over existing groups (no new process group)."""
        dims = [(g, d, n) for g, d, _, n in kept] + split
        order = [j for _, geometry_dims, _ in dims for j in geometry_dims]
        coord = geometry.get_coordinate()
        assert coord is not None
        index: list[Any] = list(coord)
        for j in order:
            index[j] = slice(None)
        sub = geometry.mesh[tuple(index)]  # remaining dims in geometry order
        position = {j: k for k, j in enumerate(sorted(order))}
        shape = [math.prod(geometry.size(j) for j in gdims) for _, gdims, _ in dims]
        ranks = sub.permute([position[j] for j in order]).reshape(shape)
        groups = [g for g, _, _ in dims]
        names = tuple(f"ema_{n}_{k}" for k, (_, _, n) in enumerate(dims))
        key = (tuple(g.group_name for g in groups), tuple(ranks.reshape(-1).tolist()), tuple(shape))
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(
                groups, geometry.device_type, ranks, mesh_dim_names=names
            )
        return self._meshes[key]


def _sub_grid_dims(mesh: DeviceMesh, geometry: DeviceMesh) -> list[list[int]] | None:
    """For each dim of ``mesh``, the dims of ``geometry`` it spans (row-major, size-1 dims
    left out), or ``None`` if ``mesh`` is not a sub-grid of ``geometry`` through this rank."""
    coord, gcoord = mesh.get_coordinate(), geometry.get_coordinate()
    if coord is None or gcoord is None:
        return None
    out: list[list[int]] = []
    for i in range(mesh.ndim):
        group_ranks = _ranks_along(mesh.mesh, coord, [i])
        if len(group_ranks) == 1:
            out.append([])
            continue
        dims = [
            j
            for j in range(geometry.ndim)
            if geometry.size(j) > 1
            and set(_ranks_along(geometry.mesh, gcoord, [j])) <= set(group_ranks)
        ]
        if _ranks_along(geometry.mesh, gcoord, dims) != group_ranks:
            return None
        out.append(dims)
    return out


def _default_placements(world: DeviceMesh, piece_shape: Sequence[int]) -> tuple[Placement, ...]:
    """A plain tensor on a world whose dims are all size 1: nothing to split."""
    return tuple(Shard(0) if piece_shape else Replicate() for _ in range(world.ndim))


def _dim_name(mesh: DeviceMesh, dim: int, prefix: str) -> str:
    names = mesh.mesh_dim_names
    return names[dim] if names else f"{prefix}{dim}"


def _check_with_torch(
    fqn: str, shape: torch.Size, layout: TensorLayout, piece_shape: Sequence[int]
) -> None:
    """Refuse a layout whose local shape torch's DTensor computes differently from ours.

    Nested sharding (``_StridedShard`` from FSDP2 over TP, then our ``Shard(0)`` split) is
    read through torch's own helper; a torch release that changed its semantics would
    otherwise give DCP wrong offsets silently.
    """
    assert layout.mesh is not None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - renamed in a future torch: skip the check
        return
    local_shape, _ = compute_local_shape_and_global_offset(shape, layout.mesh, layout.placements)
    ours = (layout.length, *piece_shape[1:]) if piece_shape else ()
    if tuple(local_shape) != tuple(ours):
        raise ValueError(
            f"cannot average {fqn!r}: splitting its local piece {tuple(piece_shape)} over the "
            f"replica dims gives {ours}, but DTensor computes {tuple(local_shape)} for "
            f"placements {layout.placements}; please report this layout"
        )


def agree_on_structure(
    world: DeviceMesh | None,
    structure: Mapping[str, str],
    options: Mapping[str, str] | None = None,
) -> None:
    """Refuse a world mesh whose ranks do not build the same EMA: the same model (tensor
    names, shapes, dtypes, tracked set) with the same options. **Collective**: one
    all-gather of a few int64 digests per world mesh dim of size > 1 (every rank learns
    every rank's: :func:`~dtensor_ema._collectives.mesh_gather_rows`); only when they
    differ, one ``all_gather_object`` of ``structure`` and ``options`` over each dim's
    group whose ranks differ, to name the differences.

    Args:
        world: the EMA's world mesh (``None``: one process, nothing to compare).
        structure: ``fqn -> "shape dtype"`` of every tensor on this rank.
        options: ``option -> value`` (:meth:`~dtensor_ema.options.EmaOptions.agreement`).

    Raises:
        ValueError: on every rank of the mesh when any two ranks differ, naming the first
            differing options or tensors and the ranks that hold them (a rank that shares
            no mesh dim group with a differing rank names those ranks).
    """
    if world is None or world.size() == 1:
        return
    options = dict(options or {})
    digests = (
        zlib.crc32("\n".join(f"{k} {v}" for k, v in structure.items()).encode()),
        zlib.crc32("\n".join(f"{k}={v}" for k, v in options.items()).encode()),
    )
    rows = mesh_gather_rows(world, digests)
    if len({row[1:] for row in rows}) == 1:
        return
    ranks = world.mesh.flatten().tolist()
    table = {row[0]: row[1:] for row in rows}
    seen = [table.get(r) for r in ranks]
    found: list[str] = []  # every differing group gathers (a rank may be in several)
    for j in [j for j in range(world.ndim) if world.size(j) > 1]:
        group = world.get_group(j)
        members = dist.get_process_group_ranks(group)
        if len({seen[ranks.index(r)] for r in members}) == 1:
            continue
        theirs: list[Any] = [None] * len(members)
        dist.all_gather_object(theirs, (dict(structure), options), group=group)
        where = f"the ranks {members} of the EMA's mesh dim {_dim_name(world, j, 'dim')!r}"
        option_lines = _differences(members, [t[1] for t in theirs])
        if option_lines:
            found.append(
                f"{where} construct the EMA with different options: {option_lines}. Every "
                "rank of the mesh must construct it with the same options (each rank holds "
                "1/W of every tensor: two decays would stitch rows of two EMAs together)"
            )
        else:
            tensors = _structure_differences(members, [t[0] for t in theirs])
            found.append(
                f"{where} track different models: {tensors}. Every rank of the mesh must "
                "construct the EMA from the same model (same parameter and buffer names, "
                "shapes and dtypes). One possible cause: pipeline stages, which hold "
                "different layers, need one ModelEMA per stage over that stage's own mesh, "
                "e.g. ModelEMA(stage_module, mesh=world['dp'])"
            )
    if found:
        raise ValueError(found[0])
    mine = seen[ranks.index(dist.get_rank())]
    others = [r for r, d in zip(ranks, seen, strict=True) if d != mine]
    raise ValueError(
        f"ranks {others} of the EMA's mesh construct a different EMA than rank "
        f"{dist.get_rank()} (another model, tracked set or options; the ranks that share a "
        "mesh dim with them name the differences). Every rank of the mesh must construct "
        "the EMA from the same model with the same options"
    )


def _differences(ranks: list[int], values: list[dict[str, str]]) -> str:
    """The first few keys whose value is not the same on every rank."""
    lines = []
    for key in dict.fromkeys(k for v in values for k in v):
        seen = [v.get(key) for v in values]
        if len(set(seen)) > 1:
            held = ", ".join(f"{x} on rank {r}" for r, x in zip(ranks, seen, strict=True))
            lines.append(f"{key}: {held}")
    more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
    return "; ".join(lines[:3]) + more


def _structure_differences(ranks: list[int], structures: list[dict[str, str]]) -> str:
    """The first few tensors whose name, shape or dtype is not the same on every rank."""
    names = list(dict.fromkeys(k for s in structures for k in s))
    lines = []
    for name in names:
        seen = [s.get(name) for s in structures]
        if len(set(seen)) == 1:
            continue
        held = ", ".join(
            f"{v} on rank {r}" if v is not None else f"absent on rank {r}"
            for r, v in zip(ranks, seen, strict=True)
        )
        lines.append(f"{name!r}: {held}")
    if not lines:  # gathers lay buckets out in this order, so it must match too
        return "the same tensors, registered in a different order"
    more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
    return "; ".join(lines[:3]) + more


def cpu_mesh_like(mesh: DeviceMesh) -> DeviceMesh:
    """The same ranks, shape and process groups as ``mesh``, with device type ``cpu`` (for
    host-resident EMA shards). Reuses ``mesh``'s groups, so they need a CPU backend
    (``init_process_group("cpu:gloo,cuda:nccl")``). Local: no new process group."""
    if mesh.device_type == "cpu":
        return mesh
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    if mesh.ndim == 1:
        return DeviceMesh.from_group(groups[0], "cpu", mesh.mesh, mesh_dim_names=names)
    return DeviceMesh.from_group(groups, "cpu", mesh.mesh, mesh_dim_names=names)


# --------------------------------------------------------------------------- one tensor
# [Note: one tensor, one entry] A PlanEntry is everything the EMA knows about one model
# tensor on this rank: its layout (above), the views of the model's tensor, and the EMA
# shard. It is made here, from the layout, in one call (make_entry); the set of entries and
# its changes belong to dtensor_ema.plan.

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class PlanEntry:
    """One averaged tensor: the model's tensor, this rank's views of it, and its EMA."""

    fqn: str
    source: torch.Tensor
    source_piece: torch.Tensor
    source_local: torch.Tensor
    ema: torch.Tensor
    ema_local: torch.Tensor
    layout: TensorLayout
    is_parameter: bool
    signature: tuple[torch.Size, torch.dtype, torch.device]
    """Global shape, dtype and device of the source when the plan was built."""
    averaged: bool = True
    """``False``: the EMA copies the model's value instead (excluded tensors, copied buffers)."""
    inner: tuple[str, ...] = ()
    """A wrapper subclass's attributes down to the plain tensor the EMA reads
    (:func:`inner_path`; ``()`` for other tensors)."""

    @property
    def is_dtensor_source(self) -> bool:
        return isinstance(self.source, DTensor)

    @property
    def is_sharded_source(self) -> bool:
        """The model holds only a piece of the tensor on this rank (a DTensor parameter,
        a ZeRO-3 partition)."""
        return self.is_dtensor_source or self.layout.flat is not None

    @property
    def shape(self) -> torch.Size:
        """The tensor's real global shape (a ZeRO-3 entry's EMA DTensor is flat)."""
        return self.signature[0]

    def checkpoint_value(self) -> Any:
        """What a checkpoint saves and loads in place for this entry: the EMA DTensor, or
        for a flattened (ZeRO-3) entry its local shard as DCP chunks of the real shape
        (:class:`~dtensor_ema.flat_chunks.FlatChunks`). Local, no copy."""
        flat = self.layout.flat
        if flat is None:
            return self.ema
        return FlatChunks(self.ema_local, flat.shape, flat.start + self.layout.offset)

    def whole_view(self) -> torch.Tensor | None:
        """The model's whole value of a tensor it also holds in pieces, when it holds one
        now (a ZeRO-3 parameter between a gather and its release: persistent ones after a
        step, every one after a forward without backward), which a swap must keep equal to
        the pieces; else ``None``. Local."""
        if self.layout.flat is None:
            return None
        return zero_partition.whole_view(self.source)

    def drop_cached_copies(self) -> None:
        """Forget the model's cached copies of the piece after it was written (ZeRO++ hpZ's
        secondary partition, rebuilt by DeepSpeed from the whole parameter on its next
        release). Local."""
        if self.layout.flat is not None:
            zero_partition.drop_secondary(self.source)

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.ema.device_mesh if isinstance(self.ema, DTensor) else None

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(self.ema.placements) if isinstance(self.ema, DTensor) else ()

    @property
    def levels(self) -> tuple[ReplicaLevel, ...]:
        return self.layout.levels


def default_ema_dtype(dtype: torch.dtype) -> torch.dtype:
    """EMA dtype for a tensor of ``dtype``: float32 for fp16/bf16, unchanged otherwise.

    A bf16 EMA with decay 0.9999 stops moving: ``(1 - d) * (p - ema)`` rounds to zero
    against ``ema`` for any update smaller than ~1/256 of it.
    """
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def make_entry(
    fqn: str,
    tensor: torch.Tensor,
    builder: LayoutBuilder,
    options: EmaOptions,
    is_parameter: bool,
    partition: zero_partition.ZeroPartition | None = None,
) -> PlanEntry:
    """One entry: this rank's layout of ``tensor`` (:meth:`LayoutBuilder.place`; a ZeRO-3
    parameter's from ``partition``, the plan's one reading of it), a fresh EMA shard of its
    current value, and whether it is averaged or copied (:meth:`~dtensor_ema.options.
    EmaOptions.is_copied`). Local."""
    dtype = options.ema_dtype or default_ema_dtype(tensor.dtype)
    if partition is None and type(plain := plain_tensor(_local(tensor))) is not torch.Tensor:
        kind = f"{type(plain).__module__}.{type(plain).__qualname__}"
        raise ValueError(
            f"cannot average {fqn!r}, a {kind}: the EMA holds plain tensors and this tensor "
            "subclass wraps no plain tensor of its shape and dtype (docs/options.md, tensor "
            "subclasses); leave it out with track='trainable' if it is frozen, or track=lambda"
            f" fqn, t: fqn != {fqn!r} (exclude= still stores a copy)"
        )
    if options.replicate_buffers and not is_parameter and not isinstance(tensor, DTensor):
        piece, shape = plain_tensor(tensor).detach(), tensor.shape
        layout = TensorLayout(None, (), 0, piece.shape[0] if piece.dim() else 0, ())
    else:
        piece, shape, layout = builder.place(fqn, tensor, partition)
    source_local = local_rows(piece, layout)
    ema = _ema_tensor(tensor, source_local, layout, dtype, options.offload)
    return PlanEntry(
        fqn=fqn,
        source=tensor,
        source_piece=piece,
        source_local=source_local,
        ema=ema,
        ema_local=ema.to_local() if isinstance(ema, DTensor) else ema,
        layout=layout,
        is_parameter=is_parameter,
        signature=(shape, tensor.dtype, tensor.device),
        averaged=not options.is_copied(fqn, tensor, is_parameter),
        inner=() if layout.flat is not None else inner_path(_local(tensor)),
    )


def ema_local_from_full(entry: PlanEntry, full: torch.Tensor) -> torch.Tensor:
    """This rank's EMA rows of a full (global-shape) tensor, as a view. Local.

    For a DTensor source, the rank's local piece is cut out at the global offset torch's
    DTensor computes for the source's placements, then the replica split is applied.

    Raises:
        ValueError: ``full`` has another shape than the source, or the source's layout
            has no contiguous local piece (``_StridedShard`` layouts torch places apart).
    """
    source = entry.source
    if full.shape != entry.shape:
        raise ValueError(
            f"{entry.fqn}: full tensor of shape {tuple(full.shape)}, expected {tuple(entry.shape)}"
        )
    flat = entry.layout.flat
    if flat is not None:
        return full.reshape(-1).narrow(0, flat.start + entry.layout.offset, entry.layout.length)
    piece = full
    if isinstance(source, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            source.shape, source.device_mesh, source.placements
        )
        if tuple(shape) != tuple(entry.source_piece.shape):
            raise ValueError(
                f"{entry.fqn}: cannot cut the local piece of placements {source.placements} "
                "out of a full tensor; load it through torch.distributed.checkpoint instead"
            )
        for dim, (start, length) in enumerate(zip(offset, shape, strict=True)):
            piece = piece.narrow(dim, start, length)
    return local_rows(piece, entry.layout)


def model_piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of a model tensor, as a view: ``to_local()`` of a DTensor,
    the partition without padding of a ZeRO-3 parameter (1-D), the whole (detached)
    tensor otherwise; a tensor subclass as the plain tensor it wraps (:func:`plain_tensor`)."""
    if zero_partition.is_partitioned(tensor):
        return zero_partition.partition_piece(tensor)
    return plain_tensor(_local(tensor)).detach()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def inner_path(tensor: torch.Tensor) -> tuple[str, ...]:
    """[Note: tensor subclasses] The attributes that lead from a wrapper subclass (no storage
    of its own) to the plain tensor that holds its values, for :func:`plain_tensor`.

    A wrapper is averaged through the one tensor among its ``__tensor_flatten__`` inner
    tensors that has its shape and dtype, when any others are scalars (a cached scale),
    unwrapped as often as needed: torchao's float8 weights (``WeightWithDynamicFloat8CastTensor``
    under ``enable_fsdp_float8_all_gather``, with its precomputed scale or without). Any other
    wrapper (torchao's ``NF4Tensor``: codes and scales) ends the path. Local, no copy.
    """
    path: list[str] = []
    while type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        flatten = getattr(tensor, "__tensor_flatten__", None)
        names = flatten()[0] if flatten is not None else ()
        inner = {n: t for n in names if isinstance(t := getattr(tensor, n, None), torch.Tensor)}
        same = [n for n, t in inner.items() if (t.shape, t.dtype) == (tensor.shape, tensor.dtype)]
        if (
            len(same) != 1
            or len(inner) != len(names)
            or any(t.dim() for n, t in inner.items() if n != same[0])
        ):
            break
        path.append(same[0])
        tensor = inner[same[0]]
    return tuple(path)


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds a model tensor's values (:func:`inner_path`); a subclass
    with storage of its own (``as_subclass``) as a plain view. Any other subclass comes back
    unchanged, and :func:`make_entry` refuses to average it. Local, no copy."""
    for name in inner_path(tensor):
        tensor = getattr(tensor, name)
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or hasattr(tensor, "__tensor_flatten__"):
        return tensor
    return tensor.as_subclass(torch.Tensor) if tensor.numel() == 0 or tensor.data_ptr() else tensor


def model_shape(tensor: torch.Tensor) -> torch.Size:
    """A model tensor's real global shape (a ZeRO-3 parameter's ``ds_shape``, whatever
    the parameter holds between gathers)."""
    if zero_partition.is_partitioned(tensor):
        return zero_partition.real_shape(tensor)
    return tensor.shape


def model_piece_ptr(tensor: torch.Tensor) -> int:
    """Where this rank's piece of a model tensor lives (``data_ptr`` of the DTensor's
    local tensor, of a ZeRO-3 partition, of the tensor): a change means cached views of
    it are stale. Local (:class:`PiecePointers` is the per-update form)."""
    if isinstance(tensor, DTensor):
        return _dtensor_local(tensor).data_ptr() or model_piece(tensor).data_ptr()
    ds_tensor = getattr(tensor, "ds_tensor", None)
    if isinstance(ds_tensor, torch.Tensor):
        return ds_tensor.data_ptr()
    return tensor.data_ptr() or model_piece(tensor).data_ptr()  # 0: a wrapper subclass


def _dtensor_local(tensor: DTensor) -> torch.Tensor:
    # DTensor.to_local() builds a fresh view for parameters (~2.5 us each, ~0.4 ms per
    # update for ResNet-50); reading the private attribute is ~10x cheaper. Fall back to
    # the public call if a torch release renames it.
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


class PiecePointers:
    """:func:`model_piece_ptr` of every entry's source (in an order of its own) with no Python
    frame per tensor, for ``update()`` to compare every step. Local. DTensors are read through
    their local tensor (FSDP2's ``module.to()`` swaps it inside the same DTensor), ZeRO-3
    parameters through their partition (``ds_tensor``). Lists, no closure: copies follow."""

    __slots__ = ("dtensors", "flat", "local", "plain", "wrapped")

    def __init__(self, entries: Sequence[PlanEntry]) -> None:
        self.flat = [e.source for e in entries if e.layout.flat is not None]
        kept = [e for e in entries if e.layout.flat is None and not e.inner]
        self.dtensors = [e.source for e in kept if e.is_dtensor_source]
        self.plain = [e.source for e in kept if not e.is_sharded_source]
        # a wrapper subclass has no storage of its own: its plain tensor's (PlanEntry.inner)
        self.wrapped = [
            (e.source, operator.attrgetter(".".join(e.inner))) for e in entries if e.inner
        ]
        readable = all(hasattr(t, "_local_tensor") for t in self.dtensors)
        self.local: Callable[[Any], torch.Tensor] = (
            operator.attrgetter("_local_tensor") if readable else _dtensor_local
        )

    def __call__(self) -> list[int]:
        ptr = torch.Tensor.data_ptr
        if self.wrapped:
            local = [_dtensor_local(t) if isinstance(t, DTensor) else t for t, _ in self.wrapped]
            inners = [inner(t) for t, (_, inner) in zip(local, self.wrapped, strict=True)]
            return [*self.plain_and_sharded(), *map(ptr, inners)]
        return self.plain_and_sharded()

    def plain_and_sharded(self) -> list[int]:
        ptr = torch.Tensor.data_ptr
        if not (self.dtensors or self.flat):  # one kind (the common cases): one list
            return list(map(ptr, self.plain))
        if not (self.plain or self.flat):
            return list(map(ptr, map(self.local, self.dtensors)))
        pieces = map(operator.attrgetter("ds_tensor"), self.flat)
        return [*map(ptr, self.plain), *map(ptr, map(self.local, self.dtensors)), *map(ptr, pieces)]


def model_geometry(
    tensor: torch.Tensor, world: DeviceMesh | None
) -> tuple[torch.Tensor, torch.Size, DeviceMesh | None, tuple[Placement, ...]]:
    """``(piece, shape, mesh, placements)``: this rank's piece of a model tensor
    (:func:`model_piece`) as a shard of a global tensor of ``shape`` laid out by
    ``mesh``/``placements`` (``None``/``()``: the piece is the whole tensor). A ZeRO-3
    parameter is ``Shard(0)`` of its flattened ``(ds_numel,)`` tensor on ``world`` (which
    construction checked to be DeepSpeed's group). Local."""
    piece = model_piece(tensor)
    if isinstance(tensor, DTensor):
        return piece, tensor.shape, tensor.device_mesh, tuple(tensor.placements)
    if zero_partition.is_partitioned(tensor):
        numel = int(tensor.ds_numel)  # type: ignore[attr-defined]
        return piece, torch.Size([numel]), world, (Shard(0),)
    return piece, tensor.shape, None, ()


def local_rows(piece: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """The rows of ``piece`` this rank averages (a view)."""
    if piece.dim() == 0 or (layout.offset == 0 and layout.length == piece.shape[0]):
        return piece
    return piece.narrow(0, layout.offset, layout.length)


def _ema_tensor(
    source: torch.Tensor,
    source_local: torch.Tensor,
    layout: TensorLayout,
    dtype: torch.dtype,
    offload: bool,
) -> torch.Tensor:
    """A fresh EMA shard, wrapped as a DTensor of the source's global shape."""
    local = _fresh_copy(source_local, dtype, offload)
    if layout.mesh is None:
        return local
    if layout.flat is not None:  # the flattened tensor
        shape = torch.Size([math.prod(layout.flat.shape)])
        stride: tuple[int, ...] = (1,)
    else:
        shape = source.shape
        stride = source.stride() if isinstance(source, DTensor) else contiguous_stride(source.shape)
    return DTensor.from_local(
        local,
        cpu_mesh_like(layout.mesh) if offload else layout.mesh,
        layout.placements,
        run_check=False,
        shape=shape,
        stride=stride,
    )


def _fresh_copy(tensor: torch.Tensor, dtype: torch.dtype, offload: bool = False) -> torch.Tensor:
    """A contiguous copy in ``dtype`` that shares no memory with the model; in (pinned, for
    CUDA sources) host memory with ``offload``."""
    if not offload:
        return tensor.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    out = torch.empty(
        tensor.shape, dtype=dtype, device="cpu", pin_memory=tensor.device.type == "cuda"
    )
    return out.copy_(tensor)
