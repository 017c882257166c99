"""Crafted checkpoints: a ``.metadata`` that runs code when ``pickle`` loads it (issue 27),
and ones built only from DCP's own classes that lie about their files, chunks or values
(issue 35).

Shared by ``test_checkpoint_trust.py`` (every reader, one process) and
``test_checkpoint_integrity.py`` (W=2). The payload is ``os.system("touch <marker>")``: a
reader that unpickles ``.metadata`` with plain ``pickle`` creates the marker file.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

REFUSED = f"{os.system.__module__}.system"
"""The global a crafted ``.metadata`` refers to (``posix.system`` on Linux)."""


class RunsCode:
    """Unpickling this runs ``touch <marker>``: what a crafted ``.metadata`` would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def metadata_globals(path: Path) -> set[tuple[str, str]]:
    """The ``(module, name)`` globals a ``.metadata`` refers to (read from a file we wrote)."""
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recording(f).load()
    return seen


def craft(clean: Path, crafted: Path, marker: Path, kind: str) -> Path:
    """A copy of the checkpoint ``clean`` whose ``.metadata`` runs code when unpickled:
    ``inside`` hides the payload in the real metadata's ``planner_data``; ``whole`` is
    nothing but the payload; ``no-data`` is ``inside`` without the data and checksum files
    (the refusal comes before anything else is read)."""
    shutil.copytree(clean, crafted)
    if kind == "whole":
        payload: Any = RunsCode(marker)
    else:
        with open(clean / ".metadata", "rb") as f:
            payload = pickle.load(f)  # our own file
        payload.planner_data = {"payload": RunsCode(marker), **(payload.planner_data or {})}
    (crafted / ".metadata").write_bytes(pickle.dumps(payload))
    if kind == "no-data":
        for f in [*crafted.glob("*.distcp"), *crafted.glob("*.json")]:
            if f.name != "manifest.json":
                f.unlink()
    return crafted


def checkpoints_under(root: Path) -> list[Path]:
    """Every DCP checkpoint directory under ``root`` (those with a ``.metadata``)."""
    return sorted(p.parent for p in root.rglob(".metadata"))


def refused_globals(directory: Path) -> set[tuple[str, str]]:
    """The globals of ``directory``'s ``.metadata`` that the restricted reader would refuse
    (none for every checkpoint we write); also opens it with that reader."""
    import torch

    from dtensor_ema.reader import METADATA_GLOBALS, open_checkpoint

    with contextlib.suppress(FileNotFoundError):  # a test's incomplete copy: still read
        open_checkpoint(directory)
    dtypes = {n for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    return {
        (module, name)
        for module, name in metadata_globals(directory / ".metadata")
        if (module, name) not in METADATA_GLOBALS and not (module == "torch" and name in dtypes)
    }


# ----------------------------------------------------------------- crafted from allowed classes
# Checkpoints whose ``.metadata`` holds only DCP's own classes (which every reader may build)
# but lies: data files outside the folder, chunks that do not cover a tensor, values that
# are pickles of other objects. Built the way someone who rewrites a checkpoint would: the
# checksum files are rewritten to match (CRC-32 with ``zlib``, XXH3-64 with ``xxhash``,
# computed here, independently of the library), or deleted.


def _digests(data: bytes | memoryview, algorithms: list[str]) -> dict[str, int]:
    import zlib

    out: dict[str, int] = {}
    for name in algorithms:
        if name == "crc32":
            out[name] = zlib.crc32(data)
        elif name == "xxh3_64":
            import xxhash

            out[name] = xxhash.xxh3_64_intdigest(data)
        else:
            raise AssertionError(f"unknown digest {name}")
    return out


def read_metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file


def sidecars(directory: Path) -> dict[Path, dict[str, Any]]:
    """``{path: payload}`` of every checksum file of ``directory``."""
    import json

    return {f: json.loads(f.read_text()) for f in sorted(directory.glob("__*.checksums.json"))}


def rewrite(directory: Path, metadata: Any, *, checksums: str = "fix") -> None:
    """Write ``metadata`` as ``directory``'s ``.metadata`` (a plain pickle, as DCP writes
    it). ``checksums="fix"``: rewrite the checksum files to match: rank 0's digest of
    ``.metadata``, and each item's place and digests from the new metadata (read from the
    files it names, inside or outside the folder); ``"drop"``: delete them (a plain
    ``dcp.save`` checkpoint)."""
    import json

    data = pickle.dumps(metadata)
    (directory / ".metadata").write_bytes(data)
    if checksums == "drop":
        for f in directory.glob("__*.checksums.json"):
            f.unlink()
        return
    assert checksums == "fix"
    places = {}
    for index, info in metadata.storage_data.items():
        offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
        places[f"{index.fqn}@{offset}"] = info
    for f, payload in sidecars(directory).items():
        algorithms = payload["algorithms"]
        if "metadata" in payload:
            payload["metadata"] = _digests(data, algorithms)
        for key, entry in payload["items"].items():
            info = places.get(key)
            if info is None:
                continue
            raw = (directory / info.relative_path).read_bytes()[
                info.offset : info.offset + info.length
            ]
            entry.update(
                file=info.relative_path,
                offset=info.offset,
                length=info.length,
                **_digests(raw, algorithms),
            )
        f.write_text(json.dumps(payload))


def index_of(metadata: Any, fqn: str, offset: tuple[int, ...] | None = None) -> Any:
    """The storage index of ``fqn``'s saved item (its chunk at ``offset``; the first)."""
    found = [
        i
        for i in metadata.storage_data
        if i.fqn == fqn and (offset is None or tuple(i.offset) == offset)
    ]
    assert found, (fqn, offset, [i.fqn for i in metadata.storage_data])
    return found[0]


def redirect(
    directory: Path, fqn: str, name: Callable[[str], str], *, checksums: str = "fix"
) -> None:
    """Make ``.metadata`` place every item of ``fqn`` in the file ``name(its file)``
    (relative to ``directory``, or absolute), at the same offsets."""
    metadata = read_metadata(directory)
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            info.relative_path = name(info.relative_path)
    rewrite(directory, metadata, checksums=checksums)


def drop_chunk(directory: Path, fqn: str, offsets: tuple[int, ...], **kwargs: Any) -> None:
    """Remove ``fqn``'s chunk at ``offsets`` from ``.metadata``: those rows are covered by
    no chunk (what a save that lost a rank's part, or a crafted one, looks like)."""
    metadata = read_metadata(directory)
    md = metadata.state_dict_metadata[fqn]
    md.chunks = [c for c in md.chunks if tuple(c.offsets) != offsets]
    rewrite(directory, metadata, **kwargs)


def shrink_chunk(directory: Path, fqn: str, rows: int, **kwargs: Any) -> None:
    """Make ``fqn``'s single saved chunk cover only its first ``rows`` rows (the data stays
    whole: DCP would read rows ``0..rows-1`` of it and leave the rest)."""
    metadata = read_metadata(directory)
    md = metadata.state_dict_metadata[fqn]
    (chunk,) = md.chunks
    chunk.sizes = type(chunk.sizes)((rows, *chunk.sizes[1:]))
    rewrite(directory, metadata, **kwargs)


def duplicate_chunk(directory: Path, fqn: str, **kwargs: Any) -> None:
    """List ``fqn``'s first chunk twice: its rows are covered twice."""
    metadata = read_metadata(directory)
    md = metadata.state_dict_metadata[fqn]
    md.chunks = [md.chunks[0], *md.chunks]
    rewrite(directory, metadata, **kwargs)


def replace_value(directory: Path, fqn: str, payload: Any, **kwargs: Any) -> None:
    """Append ``torch.save(payload)`` to the data file of ``fqn``'s (first) item and point
    ``.metadata`` at it: the entry's pickle now holds ``payload``."""
    import io

    import torch

    metadata = read_metadata(directory)
    info = metadata.storage_data[index_of(metadata, fqn)]
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    file = directory / info.relative_path
    info.offset = file.stat().st_size
    info.length = len(buffer.getvalue())
    with open(file, "ab") as f:
        f.write(buffer.getvalue())
    rewrite(directory, metadata, **kwargs)
