"""CRC-32 checksums of the bytes a DCP save writes: the save side and the file format.

DCP checks that its files exist and are long enough, but not what they hold: a flipped byte
inside a ``.distcp`` file loads silently (a NaN in the EMA), and a flipped byte in
``.metadata`` may change a shape or an offset. Here:

* :class:`RecordingWriter` is DCP's ``FileSystemWriter`` that remembers where it wrote each
  item: its data file, offset and length (DCP's own ``WriteResult``\\ s). Local.
* :func:`record_checksums` then reads those byte ranges back (from the page cache, just
  written) and computes their ``zlib.crc32``: every item this rank wrote, each tensor chunk
  (its local shard; a replicated tensor only on the rank DCP picked to write it) and each
  non-tensor value, as the bytes on disk. Rank 0 adds the CRC-32 of ``.metadata``.
* :func:`write_sidecar` stores them in ``__<rank>.checksums.json`` beside DCP's files
  (format ``dtensor_ema.checksums`` version 2). DCP ignores the file, so plain ``dcp.load``
  works.

Verification is on the reading side (:meth:`dtensor_ema.reader.Checkpoint.verify`): one
streaming pass over the byte ranges that the load will read, before DCP reads them.

Cost (``python benchmarks/checksums.py``, see ``docs/checkpoints.md``): the save reads back
and checksums the bytes it wrote; a verified load reads the ranges it loads once more, raw
(no deserialization).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = [
    "FORMAT",
    "SIDECAR_GLOB",
    "VERSION",
    "RecordingWriter",
    "crc32_of_range",
    "item_key",
    "record_checksums",
    "sidecar_name",
    "write_sidecar",
]

SIDECAR_GLOB = "__*.checksums.json"
"""The per-rank checksum files of a checkpoint directory."""
FORMAT = "dtensor_ema.checksums"
VERSION = 2
"""Version 2: CRC-32 of byte ranges of the files (version 1, before any release, hashed
tensor values and cannot be verified by this reader)."""
METADATA_FILE = ".metadata"
_BLOCK = 8 * 1024 * 1024


def sidecar_name(rank: int) -> str:
    return f"__{rank}.checksums.json"


def item_key(index: MetadataIndex) -> str:
    """``"<DCP key>@<chunk offsets>"``: one saved item (a tensor chunk or a value)."""
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}@{offset}"


def crc32_of_range(stream: IO[bytes], offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of ``stream`` from ``offset``, read in 8 MiB blocks (peak
    extra memory: one block).

    Raises:
        EOFError: the stream ends before ``offset + length``.
    """
    stream.seek(offset)
    crc = 0
    left = length
    while left:
        block = stream.read(min(left, _BLOCK))
        if not block:
            raise EOFError(f"the file ends {left} bytes short of {offset} + {length}")
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


class RecordingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that keeps this rank's ``WriteResult``\\ s (where each item
    went: data file, offset, length) in ``results``. Writes exactly what it would."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.results: list[WriteResult] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        self.results = list(future.wait())  # FileSystemWriter writes before it returns
        return future


def record_checksums(
    directory: Path, results: Iterable[WriteResult], *, metadata: bool
) -> dict[str, Any]:
    """The CRC-32 of every item in ``results`` (the bytes on disk), and of ``.metadata`` if
    ``metadata``; the payload :func:`write_sidecar` writes. Local: reads this rank's own
    ranges back, one file at a time."""
    by_file: dict[str, list[WriteResult]] = {}
    for result in results:
        by_file.setdefault(result.storage_data.relative_path, []).append(result)
    items: dict[str, list[Any]] = {}
    for relative, written in sorted(by_file.items()):
        with open(directory / relative, "rb") as f:
            for result in sorted(written, key=lambda r: r.storage_data.offset):
                info = result.storage_data
                crc = crc32_of_range(f, info.offset, info.length)
                items[item_key(result.index)] = [relative, info.offset, info.length, crc]
    payload: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "algorithm": "crc32",
        "items": dict(sorted(items.items())),
    }
    if metadata:
        payload["metadata"] = zlib.crc32((directory / METADATA_FILE).read_bytes())
    return payload


def write_sidecar(directory: Path, rank: int, payload: Mapping[str, Any]) -> None:
    """Write this rank's checksums beside DCP's files (a few dozen bytes per item)."""
    (directory / sidecar_name(rank)).write_text(json.dumps(payload))
