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
import random
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

    from dtensor_ema.checkpoint.reader import METADATA_GLOBALS, open_checkpoint

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


def rewrite(
    directory: Path, metadata: Any, *, checksums: str = "fix", data: bytes | None = None
) -> None:
    """Write ``metadata`` as ``directory``'s ``.metadata`` (a plain pickle, as DCP writes
    it). ``checksums="fix"``: rewrite the checksum files to match: rank 0's digest of
    ``.metadata``, and each item's place and digests from the new metadata (read from the
    files it names, inside or outside the folder); ``"drop"``: delete them (a plain
    ``dcp.save`` checkpoint). ``data``: the bytes to write instead of ``metadata``'s pickle
    (items still placed by ``metadata``)."""
    import json

    if data is None:
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
    files = sidecars(directory)
    recorded = {key for payload in files.values() for key in payload["items"]}
    for f, payload in files.items():
        algorithms = payload["algorithms"]
        if "metadata" in payload:
            payload["metadata"] = _digests(data, algorithms)
            # items the checksum files do not know yet (new chunks): rank 0's records them
            payload["items"].update({k: {} for k in places if k not in recorded})
        for key, entry in payload["items"].items():
            info = places.get(key)
            if info is None or not all(isinstance(v, int) for v in (info.offset, info.length)):
                continue  # not an item of this metadata, or one with crafted fields
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


def replace_value(
    directory: Path, fqn: str, payload: Any, *, at: tuple[int, ...] | None = None, **kwargs: Any
) -> None:
    """Append ``torch.save(payload)`` to the data file of ``fqn``'s item (its chunk at
    offsets ``at``; the first) and point ``.metadata`` at it: the entry's pickle now holds
    ``payload``."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    replace_item(directory, fqn, buffer.getvalue(), at=at, **kwargs)


def replace_item(
    directory: Path, fqn: str, data: bytes, *, at: tuple[int, ...] | None = None, **kwargs: Any
) -> None:
    """Append ``data`` to the data file of ``fqn``'s item (its chunk at offsets ``at``; the
    first) and point ``.metadata`` at it."""
    metadata = read_metadata(directory)
    info = metadata.storage_data[index_of(metadata, fqn, at)]
    file = directory / info.relative_path
    info.offset = file.stat().st_size
    info.length = len(data)
    with open(file, "ab") as f:
        f.write(data)
    rewrite(directory, metadata, **kwargs)


# ----------------------------------------------------------------- crafted sizes (issue 42)
# ``.metadata`` fields that claim more than the files hold, or hold what DCP never writes;
# each built from DCP's own classes (what the restricted reader may build).


def edit_metadata(directory: Path, change: Callable[[Any], Any], **kwargs: Any) -> None:
    """Apply ``change`` to ``directory``'s metadata and write it back (checksums fixed)."""
    metadata = read_metadata(directory)
    change(metadata)
    rewrite(directory, metadata, **kwargs)


def claim_shape(directory: Path, fqn: str, shape: tuple[int, ...], **kwargs: Any) -> None:
    """Make ``fqn`` a tensor of ``shape`` saved as one chunk, whose storage item is its first
    (a few bytes): the claim of ``10**12`` elements in a 100 KB checkpoint."""
    import torch

    def change(metadata: Any) -> None:
        md = metadata.state_dict_metadata[fqn]
        first = index_of(metadata, fqn)
        info = metadata.storage_data[first]
        metadata.storage_data = {i: v for i, v in metadata.storage_data.items() if i.fqn != fqn}
        zeros = torch.Size([0] * len(shape))
        metadata.storage_data[type(first)(fqn, zeros)] = info
        md.size = torch.Size(shape)
        md.chunks = [type(md.chunks[0])(offsets=zeros, sizes=torch.Size(shape))]

    edit_metadata(directory, change, **kwargs)


def deflated_archive(numel: int) -> bytes:
    """A ``torch.save`` archive of a float32 tensor of ``numel`` zeros whose storage record is
    deflated: about ``numel / 250`` bytes that ``torch.load`` inflates to ``4 * numel``.

    Built by hand (zip headers and a deflate stream of repeated, byte-aligned blocks):
    compressing gigabytes of zeros with ``zlib`` would take seconds."""
    import collections
    import io
    import struct
    import zipfile
    import zlib

    import torch

    class Storage:  # stands for the tensor's storage: a persistent id, as torch.save writes
        pass

    storage = Storage()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if obj is storage:
                return ("storage", torch.FloatStorage, "0", "cpu", numel)
            return None

    class Tensor:
        def __reduce__(self) -> tuple[Any, ...]:
            args = (storage, 0, (numel,), (1,), False, collections.OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args)

    pkl = io.BytesIO()
    Pickler(pkl, protocol=2).dump(Tensor())
    reference = io.BytesIO()
    torch.save(torch.zeros(1), reference)
    with zipfile.ZipFile(reference) as archive:
        records = {i.filename: archive.read(i.filename) for i in archive.infolist()}
    prefix = next(n for n in records if n.endswith("data.pkl"))[: -len("data.pkl")]
    block_bytes = 1 << 20
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(bytes(block_bytes)) + compressor.flush(zlib.Z_FULL_FLUSH)
    blocks, rest = divmod(4 * numel, block_bytes)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15)
    deflated = block * blocks + tail.compress(bytes(rest)) + tail.flush()
    crc = 0
    zeros = bytes(block_bytes)
    for _ in range(blocks):
        crc = zlib.crc32(zeros, crc)
    crc = zlib.crc32(bytes(rest), crc)
    out = io.BytesIO()
    central = []
    for name, content in records.items():
        if name.endswith("data.pkl"):
            content = pkl.getvalue()
        if name == f"{prefix}data/0":
            method, body, size, digest = 8, deflated, 4 * numel, crc
        else:
            method, body, size, digest = 0, content, len(content), zlib.crc32(content)
        encoded = name.encode()
        offset = out.tell()
        # flags, method, time, date, crc, sizes, name length, extra length: in both headers
        fields = struct.pack(
            "<HHHHIIIHH", 0, method, 0, 0x21, digest, len(body), size, len(encoded), 0
        )
        out.write(struct.pack("<IH", 0x04034B50, 20) + fields + encoded + body)
        tail = struct.pack("<HHHII", 0, 0, 0, 0, offset)  # comment, disk, attributes, offset
        central.append(struct.pack("<IHH", 0x02014B50, 20, 20) + fields + tail + encoded)
    start = out.tell()
    for entry in central:
        out.write(entry)
    out.write(
        struct.pack(
            "<IHHHHIIH", 0x06054B50, 0, 0, len(central), len(central), out.tell() - start, start, 0
        )
    )
    return out.getvalue()


# ----------------------------------------------------------------- random structural edits
_ODD_VALUES: list[Any] = [
    None,
    -1,
    0,
    2**63,
    10**30,
    1e308,
    "",
    "x" * 300,
    [],
    {},
    [[[[[[[[[[]]]]]]]]]],
    True,
    3.5,
    "../x",
    [10**6, 10**6],
]


def _torch() -> Any:
    import torch

    return torch


def mutate_object(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` (an unpickled ``.metadata``, parsed JSON) with one field, item or attribute,
    chosen by ``rng``, replaced by an odd value (another type, a huge or negative number,
    nested lists), removed, or mutated itself; at most 6 levels down. In place where it
    can be: pass a copy. Used by the fuzzers (``fuzz_readers.py``, ``test_fuzz.py``)."""
    children: list[tuple[Any, Any]] = []
    if isinstance(value, dict):
        children = [("key", k) for k in value]
    elif isinstance(value, list):
        children = [("index", i) for i in range(len(value))]
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        children = [("attr", k) for k in vars(value)]
    elif isinstance(value, tuple) and value:
        items = list(value)
        i = rng.randrange(len(items))
        items[i] = mutate_object(items[i], rng, depth + 1)
        return type(value)(items) if type(value) is not _torch().Size else _size(items, value)
    if not children or depth > 6 or rng.random() < 0.2:
        return rng.choice(_ODD_VALUES + ([_torch().Size([2**40, 3])] if depth else []))
    how, key = rng.choice(children)
    if how == "attr":
        if rng.random() < 0.15:
            delattr(value, key)
        else:
            setattr(value, key, mutate_object(getattr(value, key), rng, depth + 1))
    elif how == "key" and rng.random() < 0.15:
        del value[key]
    else:
        value[key] = mutate_object(value[key], rng, depth + 1)
    return value


def _size(items: list[Any], fallback: Any) -> Any:
    try:
        return _torch().Size(items)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return fallback
