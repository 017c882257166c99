"""A flat range of a row-major tensor, saved and loaded by DCP as chunks of its real shape.

DeepSpeed ZeRO-3 keeps each rank's piece of a parameter as a flat range of the flattened
tensor (:mod:`dtensor_ema.zero_partition`), and the EMA of it is a 1-D ``Shard(0)`` DTensor
over those ranges. A checkpoint must not show that: it stores every EMA tensor in its real
shape, so that a ZeRO-3 EMA, an FSDP2 or DDP EMA and a single process read each other's
checkpoints. A flat range ``[start, start + length)`` of a tensor of ``n`` dims
is the union of at most ``2n - 1`` boxes, each a contiguous run of memory (at most three for
a matrix: the end of one row, whole rows, the start of another), which DCP's chunks
(``offsets``, ``sizes``) describe exactly (:func:`flat_boxes`).

:class:`FlatChunks` is that range as DCP sees it. DCP has no public way for a value to be
several chunks of one tensor on one rank (its public ``CheckpointableTensor`` protocol needs
the local tensor to have the global tensor's dims); it consults three hooks on any tensor it
saves or loads into (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``: what ``DTensor`` implements in torch 2.4-2.14), and the value must
be a tensor of the global shape, made here as ``DTensor`` is made (a wrapper subclass with
no storage of its own, ``torch.Tensor._make_wrapper_subclass``). This module is the one
place that uses those private pieces. If a torch release stops consulting the hooks, DCP
treats the value as a plain tensor, and reading its data raises ``NotImplementedError``
(it holds none), so nothing wrong is ever written; ``tests/test_flat_chunks.py`` and
``tests/test_deepspeed_distributed.py`` pin the behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["Box", "FlatChunks", "flat_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of a box of a tensor (DCP's ``ChunkStorageMetadata``)."""


def flat_boxes(shape: Sequence[int], start: int, length: int) -> list[Box]:
    """The boxes of ``shape`` (row-major) that hold its flat elements ``[start, start +
    length)``, in memory order. Each box is contiguous in memory: a run of whole
    sub-tensors along one dim, with every earlier dim fixed (size 1). At most ``2n - 1``
    boxes for ``n`` dims (``n >= 1``); none for ``length == 0``; a 0-dim tensor is one box
    ``((), ())``.

    Raises:
        ValueError: the range is not inside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if start < 0 or length < 0 or start + length > numel:
        raise ValueError(f"flat range [{start}, {start + length}) is outside a tensor of {numel}")
    if length == 0:
        return []
    if not shape:
        return [((), ())]
    return _boxes(shape, start, start + length)


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes of the non-empty flat range ``[lo, hi)`` of ``shape`` (at least 1-D)."""
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    rest = shape[1:]
    if first == last:  # inside one row: fix dim 0, recurse
        return [((first, *o), (1, *s)) for o, s in _boxes(rest, lo - first * row, hi - first * row)]
    out: list[Box] = []
    if lo % row:  # the tail of row `first`
        out += [((first, *o), (1, *s)) for o, s in _boxes(rest, lo % row, row)]
        first += 1
    whole_end = last + 1 if hi % row == 0 else last
    if whole_end > first:  # whole rows
        out.append(((first, *(0,) * len(rest)), (whole_end - first, *rest)))
    if hi % row:  # the head of row `last`
        out += [((last, *o), (1, *s)) for o, s in _boxes(rest, 0, hi % row)]
    return out


def _flat_offset(offsets: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major flat index of the element at ``offsets``."""
    index = 0
    for offset, size in zip(offsets, shape, strict=True):
        index = index * size + offset
    return index


class FlatChunks(torch.Tensor):
    """This rank's flat range ``[start, start + local.numel())`` of a tensor of ``shape``,
    held in the 1-D tensor ``local``, as DCP's chunks of the real shape.

    A tensor of the global ``shape`` and ``local``'s dtype and device that holds no data
    of its own (a wrapper subclass, as DTensor is): DCP saves it as one chunk per box
    (:func:`flat_boxes`) and loads into it in place (each box is a view of ``local``),
    resharding from any layout of the same global shape. Only ``detach()`` (itself),
    ``to(dtype=..., copy=...)`` (a range over a cast ``local``) and pickling (of ``local``
    and the range) work; any other operation raises ``NotImplementedError``, so nothing can
    mistake it for a full tensor. Local: no communication.
    """

    local: torch.Tensor
    start: int
    boxes: list[Box]

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: Sequence[int], start: int) -> FlatChunks:
        if local.dim() != 1:
            raise ValueError(f"the local range must be 1-D, got shape {tuple(local.shape)}")
        boxes = flat_boxes(shape, start, local.numel())
        out = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=local.dtype, device=local.device
        )
        out.local, out.start, out.boxes = local, start, boxes
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise NotImplementedError(
            f"{func} on a FlatChunks (a ZeRO-3 EMA shard as checkpoint chunks of shape "
            f"{tuple(args[0].shape) if args else '?'}): use ema.get_ema_state_dict() for full "
            "tensors, or its .local for this rank's flat range"
        )

    def detach(self) -> FlatChunks:
        """Itself (the local range is never part of an autograd graph)."""
        return self

    def to(
        self, *args: Any, dtype: torch.dtype | None = None, copy: bool = False, **kwargs: Any
    ) -> FlatChunks:
        """The same range over ``local`` cast to ``dtype`` (a copy with ``copy``). Local."""
        if args or kwargs:
            raise NotImplementedError("FlatChunks.to takes only dtype= and copy=")
        local = self.local.to(dtype=dtype or self.dtype, copy=copy)
        return FlatChunks(local, self.shape, self.start)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return FlatChunks, (self.local, tuple(self.shape), self.start)

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatChunks:
        return FlatChunks(self.local.clone(), self.shape, self.start)

    def box_view(self, box: Box) -> torch.Tensor:
        """The view of ``local`` that holds ``box`` (in the box's own shape)."""
        offsets, sizes = box
        begin = _flat_offset(offsets, self.shape) - self.start
        return self.local.narrow(0, begin, math.prod(sizes)).view(sizes)

    def views(self) -> list[tuple[Box, torch.Tensor]]:
        """Every box with its view of ``local``."""
        return [(box, self.box_view(box)) for box in self.boxes]

    # DCP's chunk hooks (see the module docstring): the one place that implements them.
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets), k),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for k, (offsets, sizes) in enumerate(self.boxes)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            for offsets, sizes in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes in self.boxes:
            if index.offset is not None and tuple(index.offset) == offsets:
                return self.box_view((offsets, sizes))
        raise ValueError(
            f"{index.fqn}: no local chunk at offsets {index.offset} (this rank holds {self.boxes})"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FlatChunks(shape={tuple(self.shape)}, dtype={self.dtype}, start={self.start}, "
            f"numel={self.local.numel()}, boxes={len(self.boxes)})"
        )
