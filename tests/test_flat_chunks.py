"""A flat range of a row-major tensor as DCP chunks of its real shape (``dtensor_ema.flat_chunks``),
the checkpoint form of a ZeRO-3 partition's EMA: the boxes, the reader's coverage check over
every rank's boxes, and DCP saving from and loading into such ranges in one process.
DeepSpeed itself is exercised in ``tests/test_deepspeed_distributed.py``."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dtensor_ema.checkpoint.reader import coverage_problem
from dtensor_ema.flat_chunks import FlatChunks, flat_boxes
from dtensor_ema.layout import chunk_range

SHAPES = [(), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (4, 0, 2), (1, 1, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_hold_exactly_the_flat_range(shape: tuple[int, ...]) -> None:
    """Every flat range of every shape: at most ``2n - 1`` boxes, each the contiguous run of
    memory a view of the range shows, together every element of the range once."""
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for length in range(numel - start + 1):
            boxes = flat_boxes(shape, start, length)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            chunks = FlatChunks(torch.arange(start, start + length), shape, start)
            seen = torch.zeros(shape, dtype=torch.int64)
            for (offsets, sizes), view in chunks.views():
                index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
                assert torch.equal(full[index], view)
                seen[index] += 1
            expected = torch.zeros(numel, dtype=torch.int64)
            expected[start : start + length] = 1
            assert torch.equal(seen.reshape(-1), expected)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_ranks_boxes_pass_the_coverage_check(world: int) -> None:
    """The chunks of all ranks' partitions (``Shard(0)`` of the flattened tensor) cover the
    tensor exactly once, as the reader checks before any load; one rank's chunks missing,
    or one of them twice, is named."""
    for shape in [(3, 4), (2, 3, 4), (7, 5), (1, 9), (13,)]:
        numel = math.prod(shape)
        chunks = [
            box
            for rank in range(world)
            for box in flat_boxes(shape, *chunk_range(numel, world, rank))
        ]
        assert coverage_problem(shape, chunks) is None, (shape, world)
        assert coverage_problem(shape, chunks[:-1]) is not None
        assert coverage_problem(shape, [*chunks, chunks[0]]) is not None


def test_anything_but_a_checkpoint_read_is_refused() -> None:
    """A ``FlatChunks`` is the global shape to DCP and to shape checks, but never passes for
    a full tensor: arithmetic raises naming what to use; pickling keeps the range."""
    chunks = FlatChunks(torch.arange(3.0, 9.0), (3, 4), 3)
    assert chunks.shape == (3, 4) and chunks.size() == (3, 4) and chunks.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="get_ema_state_dict"):
        chunks + 1
    back = pickle.loads(pickle.dumps(chunks))
    assert (back.start, back.shape, back.local.tolist()) == (3, (3, 4), chunks.local.tolist())
    half = chunks.to(dtype=torch.bfloat16, copy=True)
    assert half.dtype == torch.bfloat16 and half.local.data_ptr() != chunks.local.data_ptr()


def test_dcp_saves_and_loads_flat_ranges_in_real_shapes(tmp_path: Path) -> None:
    """DCP (one process) saves a flat range as chunks of the real shape, with the tensor's
    metadata a stranger expects; a full tensor saved elsewhere loads into a flat range
    (resharding), in place."""
    full = torch.randn(5, 3, 2)
    whole = FlatChunks(full.reshape(-1).clone(), full.shape, 0)
    dcp.save({"t": whole}, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    metadata = dcp.FileSystemReader(str(tmp_path / "a")).read_metadata()
    assert tuple(metadata.state_dict_metadata["t"].size) == (5, 3, 2)
    into = {"t": torch.zeros(5, 3, 2)}
    dcp.load(into, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    assert torch.equal(into["t"], full)

    dcp.save({"t": full}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    local = torch.zeros(16)
    part = FlatChunks(local, full.shape, 7)  # elements 7..22: two boxes, a row, two boxes
    assert len(part.boxes) == 5
    dcp.load({"t": part}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert torch.equal(local, full.reshape(-1)[7:23])
