"""Whether a tensor's saved chunks cover its shape exactly once: no gap, no overlap.

A DCP load fills its destination from the saved chunks that overlap it: rows no chunk
holds keep whatever the destination held (``torch.empty`` memory in an offline
conversion), and rows held twice are written twice, from whichever is read last. So every
reader of :mod:`dtensor_ema.checkpoint.reader` checks every tensor's chunks first, in time that
grows
as ``n log n`` in the number of chunks ``n``, however they are laid out:

* The layouts sharding makes (each dim cut into intervals, one chunk per cell of their
  product) are recognized by sorting the intervals of each dim.
* Any other layout is checked exactly by its signed corners: the number of chunks that hold
  an element ``x`` is the sum, over the chunks' corners ``p <= x``, of ``+1`` or ``-1`` (by the
  number of upper bounds among ``p``'s coordinates), so the chunks cover the shape exactly
  once if and only if their signed corners add up to the shape's own. A sweep along dim 0
  keeps that sum for the cross-section at each row and the area its chunks add up to, which
  says, row range by row range, whether elements are missing (less area than the
  cross-section), held twice (more), or both. Only the dims that some chunk cuts count:
  ``n * 2 ** cut_dims`` steps, refused above :data:`MAX_CORNER_STEPS` (no sharding cuts
  that many dims into that many pieces).

Local, pure Python, nothing allocated in proportion to the shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MAX_CORNER_STEPS", "coverage_problem"]

MAX_CORNER_STEPS = 1 << 21
"""Most corner updates the exact check of a layout that is not a grid may take (about a
second): ``chunks * 2 ** (dims some chunk cuts)``."""

Box = tuple[tuple[int, ...], tuple[int, ...]]


def coverage_problem(shape: Sequence[int], chunks: Iterable[tuple[Any, Any]]) -> str | None:
    """What is wrong with the ``(offsets, sizes)`` chunks of a tensor of ``shape``, or
    ``None`` when they cover every element exactly once.

    Problems: a chunk outside the shape (or with offsets and sizes that are not one
    non-negative int per dim); rows (indices of dim 0; the one element of a 0-dim tensor)
    that some element of is not covered, or covered more than once; a layout that is not
    a grid and cuts more dims into more chunks than :data:`MAX_CORNER_STEPS` allows. Exact
    for any boxes; ``O(chunks log chunks)`` for grids, ``O(chunks * 2 ** cut_dims)`` else.
    """
    shape = tuple(int(s) for s in shape)
    boxes: list[Box] = []
    for offsets, sizes in chunks:
        box = (tuple(offsets), tuple(sizes))
        if not _fits(box, shape):
            where = f"offsets {_show(box[0])} of sizes {_show(box[1])}"
            return f"a chunk at {where} lies outside the shape"
        if 0 not in box[1]:  # empty chunks cover nothing
            boxes.append(box)
    if not shape:
        if len(boxes) == 1:
            return None
        return "its one element is " + ("not covered" if not boxes else "covered more than once")
    if 0 in shape or _is_grid(shape, boxes):
        return None
    cut = [d for d in range(1, len(shape)) if any(b[0][d] or b[1][d] != shape[d] for b in boxes)]
    if len(boxes) * (1 << len(cut)) > MAX_CORNER_STEPS:
        return (
            f"its {len(boxes)} chunks are not a grid and cut {len(cut) + 1} dims: too many to "
            "check (no sharding writes such a layout)"
        )
    gaps, overlaps = _sweep(shape, boxes, cut)
    if not gaps and not overlaps:
        return None
    parts = []
    if gaps:
        parts.append(f"{_rows(gaps)} not covered")
    if overlaps:
        parts.append(f"{_rows(overlaps)} covered more than once")
    return " and ".join(parts)


def _show(values: tuple[Any, ...]) -> str:
    """``values`` for a message, without printing a huge int (or anything else) whole."""
    shown = [v if type(v) is int and abs(v) < 1 << 64 else "?" for v in values[:8]]
    return str(tuple(shown)) if len(values) <= 8 else f"({', '.join(map(str, shown))}, ...)"


def _fits(box: Box, shape: tuple[int, ...]) -> bool:
    """Non-negative int offsets and sizes, one per dim, inside ``shape``; an empty chunk
    (an uneven shard's) covers nothing, wherever it says it is."""
    offsets, sizes = box
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        return False
    for offset, size in zip(offsets, sizes, strict=True):
        if type(offset) is not int or type(size) is not int or offset < 0 or size < 0:
            return False
    return 0 in sizes or all(o + n <= s for o, n, s in zip(offsets, sizes, shape, strict=True))


def _is_grid(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether the (non-empty) boxes are exactly the cells of a grid over ``shape``: in
    every dim their intervals partition it, and each cell of the product is one box."""
    cells = 1
    for d, size in enumerate(shape):
        position = 0
        intervals = sorted({(o[d], n[d]) for o, n in boxes})
        for offset, length in intervals:
            if offset != position:
                return False
            position += length
        if position != size:
            return False
        cells *= len(intervals)
        if cells > len(boxes):
            return False
    return len(boxes) == cells and len(set(boxes)) == cells


def _sweep(
    shape: tuple[int, ...], boxes: list[Box], cut: list[int]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(gaps, overlaps)``: the ``[start, stop)`` row ranges with an element covered by no
    box, or by more than one (boxes inside ``shape``, non-empty; ``cut``: the dims other
    than 0 that some box does not span whole)."""
    # The signed corners, over the cut dims, of the cross-section the active boxes must add
    # up to; ``balance`` holds (active boxes' corners - the cross-section's), nonzero only
    # where they differ: the active boxes cover the cross-section exactly once iff empty.
    target = _corners(tuple(0 for _ in cut), tuple(shape[d] for d in cut))
    balance: dict[tuple[int, ...], int] = {p: -s for p, s in target.items()}
    area = 1
    for d in cut:
        area *= shape[d]
    events: dict[int, list[tuple[int, Box]]] = {}
    for box in boxes:
        offsets, sizes = box
        events.setdefault(offsets[0], []).append((1, box))
        events.setdefault(offsets[0] + sizes[0], []).append((-1, box))
    bounds = sorted({0, shape[0], *events})
    covered = 0  # the active boxes' cross-sections, added up
    gaps: list[tuple[int, int]] = []
    overlaps: list[tuple[int, int]] = []
    for lo, hi in itertools.pairwise(bounds):
        for sign, (offsets, sizes) in events.get(lo, ()):
            low = tuple(offsets[d] for d in cut)
            high = tuple(offsets[d] + sizes[d] for d in cut)
            part = 1
            for d in cut:
                part *= sizes[d]
            covered += sign * part
            for p, s in _corners(low, high).items():
                value = balance.get(p, 0) + sign * s
                if value:
                    balance[p] = value
                else:
                    balance.pop(p, None)
        if not balance:
            continue
        for found, ranges in ((covered <= area, gaps), (covered >= area, overlaps)):
            if not found:
                continue
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
    return gaps, overlaps


def _corners(low: tuple[int, ...], high: tuple[int, ...]) -> dict[tuple[int, ...], int]:
    """The signed corners of the box ``[low, high)``: ``+1`` or ``-1`` by the parity of the
    upper bounds among each corner's coordinates."""
    corners: dict[tuple[int, ...], int] = {}
    for choice in itertools.product((0, 1), repeat=len(low)):
        point = tuple(h if c else lo for c, lo, h in zip(choice, low, high, strict=True))
        corners[point] = -1 if sum(choice) % 2 else 1
    return corners


def _rows(ranges: list[tuple[int, int]], shown: int = 5) -> str:
    """``"rows 8-15 are"``, ``"row 3 is"``, ``"rows 0, 4-5 are"`` (the first ``shown``)."""
    text = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in ranges[:shown])
    if len(ranges) > shown:
        text += f" and {len(ranges) - shown} more ranges"
    one = len(ranges) == 1 and ranges[0][1] == ranges[0][0] + 1
    return f"row {text} is" if one else f"rows {text} are"
