"""What a DCP ``.metadata`` may say, checked field by field before any of it is used.

:func:`dtensor_ema.checkpoint.reader.open_checkpoint` unpickles ``.metadata`` with only DCP's
metadata
classes allowed, but their fields can still hold anything a pickle can build: ``None`` where
a list belongs, a shape of 3000 dims or ``10**12`` elements, a chunk whose storage item is
a few bytes long, a compression transform that inflates a few kilobytes into gigabytes, a
``planner_data`` path that files one tensor under another's name. :func:`check_metadata`
walks the metadata once, in time linear in its size, checking exact types and ranges, and
the sizes it claims against each other:

* every entry is a tensor (a strided layout, a torch dtype, a shape of at most
  :data:`MAX_DIMS` dims and at most :data:`MAX_ELEMENTS` elements, chunks inside it) or a
  bytes value;
* every chunk has its storage item, at least as long as the chunk's elements take
  (``torch.save`` stores them uncompressed), and no item is transformed (compressed);
* ``planner_data`` names each entry by its own key (``"a.b.0"`` is ``("a", "b", 0)``).

It returns the facts a reader needs to check the items against the files on disk
(:class:`Facts`). Pure: reads no file, runs in one process, nothing allocated in proportion
to a claimed size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

__all__ = ["MAX_DIMS", "MAX_ELEMENTS", "Facts", "MetadataProblem", "check_metadata"]

MAX_DIMS = 64
"""Most dims a saved tensor may have (torch's own limit for most operations)."""
MAX_ELEMENTS = 1 << 62
"""Most elements a saved tensor may claim (before its bytes are checked against its files)."""
_INT64 = (1 << 63) - 1
_NAME_SHOWN = 120
_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)


class MetadataProblem(ValueError):
    """``.metadata`` says something DCP never writes; the message names the entry and what."""


@dataclass(slots=True)
class Facts:
    """What :func:`check_metadata` learned, for the reader's checks of the files."""

    chunk_sizes: dict[MetadataIndex, tuple[int, ...]] = field(default_factory=dict)
    """The sizes of the tensor chunk each storage item holds (bytes values: absent)."""
    items: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)
    """``relative_path -> [(offset, length, entry), ...]``: every storage item, by file."""


def check_metadata(metadata: object) -> Facts:
    """Check every field of ``metadata`` (as unpickled from a ``.metadata``) against what
    DCP writes, and the sizes it claims against each other. Local, linear in its size.

    Returns:
        The chunk each storage item holds, and the items of each file.

    Raises:
        MetadataProblem: naming the first entry that is wrong and what is wrong with it.
    """
    if type(metadata) is not Metadata:
        _bad(f"holds a {type(metadata).__name__}, not DCP's Metadata: not a DCP checkpoint")
    entries = _attribute(metadata, "state_dict_metadata")
    if type(entries) is not dict:
        _bad(f"its state_dict_metadata is a {type(entries).__name__}, not a dict")
    facts = Facts()
    # ``(fqn, offsets) -> (sizes, bytes)`` of every non-empty or empty chunk; bytes values
    # under ``(fqn, None)``.
    expected: dict[tuple[str, Any], tuple[tuple[int, ...], int]] = {}
    for key, md in entries.items():
        if type(key) is not str:
            _bad(f"it has an entry keyed by a {type(key).__name__}, not a name")
        if type(md) is TensorStorageMetadata:
            _tensor(key, md, expected)
        elif type(md) is BytesStorageMetadata:
            expected[(key, None)] = ((), 0)
        else:
            _bad(f"entry {_name(key)} is a {type(md).__name__}, not a tensor or a value")
    _planner_data(_attribute(metadata, "planner_data"))
    _storage_data(_attribute(metadata, "storage_data"), expected, facts)
    _storage_meta(_attribute(metadata, "storage_meta"))
    version = _attribute(metadata, "version")
    if version is not None and type(version) is not str:
        _bad(f"its version is a {type(version).__name__}, not a string")
    return facts


def _bad(what: str) -> NoReturn:
    raise MetadataProblem(what)


_MISSING = object()


def _attribute(obj: object, name: str) -> Any:
    """``obj.name``, or its class's default; refused when neither exists (a pickle can
    build an object without calling its ``__init__``)."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        _bad(f"a {type(obj).__name__} without its field {name!r}")
    return value


def _name(key: str) -> str:
    """``repr(key)``, shortened: a crafted key can be megabytes long."""
    return repr(key) if len(key) <= _NAME_SHOWN else repr(key[:_NAME_SHOWN]) + "..."


def _is_index(value: object, least: int = 0, most: int = _INT64) -> bool:
    return type(value) is int and least <= value <= most


def _size(value: object, where: str, what: str, dims: int | None = None) -> tuple[int, ...]:
    """A ``torch.Size`` of non-negative ints (of ``dims`` of them) as a tuple."""
    if type(value) is not torch.Size:
        _bad(f"{where}: its {what} is a {type(value).__name__}, not a torch.Size")
    if dims is None and len(value) > MAX_DIMS:
        _bad(f"{where}: its {what} has {len(value)} dims, more than {MAX_DIMS}")
    if dims is not None and len(value) != dims:
        _bad(f"{where}: its {what} has {len(value)} dims, the tensor {dims}")
    if not all(_is_index(v) for v in value):
        _bad(f"{where}: its {what} holds a negative or oversized number")
    return tuple(value)


def _elements(sizes: tuple[int, ...], where: str) -> int:
    count = 1
    for n in sizes:
        count *= n
        if count > MAX_ELEMENTS:
            _bad(f"{where}: claims more than 2**62 elements")
    return count


def _tensor(
    key: str,
    md: TensorStorageMetadata,
    expected: dict[tuple[str, Any], tuple[tuple[int, ...], int]],
) -> None:
    where = f"entry {_name(key)}"
    properties = _attribute(md, "properties")
    if type(properties) is not TensorProperties:
        _bad(f"{where}: its properties are a {type(properties).__name__}, not TensorProperties")
    dtype = _attribute(properties, "dtype")
    if not isinstance(dtype, torch.dtype):
        _bad(f"{where}: its dtype is a {type(dtype).__name__}, not a torch dtype")
    if _attribute(properties, "layout") is not torch.strided:
        _bad(f"{where}: its layout is not torch.strided (dense tensors only)")
    if _attribute(properties, "memory_format") not in _MEMORY_FORMATS:
        _bad(f"{where}: its memory format is not one torch has")
    shape = _size(_attribute(md, "size"), where, "shape")
    _elements(shape, where)
    chunks = _attribute(md, "chunks")
    if type(chunks) is not list:
        _bad(f"{where}: its chunks are a {type(chunks).__name__}, not a list")
    for chunk in chunks:
        if type(chunk) is not ChunkStorageMetadata:
            _bad(f"{where}: a chunk is a {type(chunk).__name__}, not ChunkStorageMetadata")
        offsets = _size(_attribute(chunk, "offsets"), where, "chunk offsets", len(shape))
        sizes = _size(_attribute(chunk, "sizes"), where, "chunk sizes", len(shape))
        at = f"{where}, chunk at offsets {offsets}"
        if 0 not in sizes and any(o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)):
            _bad(f"{at}: of sizes {sizes} lies outside the shape {shape}")
        nbytes = math.prod(sizes) * dtype.itemsize
        # A chunk listed twice is one storage item: the coverage check names the overlap.
        if expected.get((key, offsets), ((), -1))[1] < nbytes:
            expected[(key, offsets)] = (sizes, nbytes)


def _planner_data(planner_data: object) -> None:
    """DCP's flattening map ``{key: path}``: each path must spell its own key, so that no
    entry is filed under another's name."""
    if planner_data is None:
        return
    if type(planner_data) is not dict:
        _bad(f"its planner_data is a {type(planner_data).__name__}, not a dict")
    for key, path in planner_data.items():
        if type(key) is not str:
            _bad(f"its planner_data has a key that is a {type(key).__name__}, not a name")
        if type(path) not in (tuple, list) or not all(
            type(p) is str or _is_index(p, -_INT64) for p in path
        ):
            _bad(f"its planner_data gives entry {_name(key)} a path that is not names and ints")
        if ".".join(map(str, path)) != key:
            _bad(
                f"its planner_data files entry {_name(key)} under another name: aliased "
                "(DCP names every entry by its own path)"
            )


def _storage_data(
    storage_data: object,
    expected: dict[tuple[str, Any], tuple[tuple[int, ...], int]],
    facts: Facts,
) -> None:
    """Every chunk and value has its storage item, untransformed and long enough (items of
    no listed chunk are never read, and ignored)."""
    if type(storage_data) is not dict:
        _bad(f"its storage_data is a {type(storage_data).__name__}, not a dict")
    for index, info in storage_data.items():
        if type(index) is not MetadataIndex:
            _bad(f"its storage_data is keyed by a {type(index).__name__}, not MetadataIndex")
        fqn = _attribute(index, "fqn")
        offset = _attribute(index, "offset")
        if type(fqn) is not str:
            _bad(f"a storage item names its entry with a {type(fqn).__name__}")
        where = f"entry {_name(fqn)}"
        if offset is not None:
            offset = _size(offset, where, "storage item's offsets")
        wanted = expected.pop((fqn, offset), None)
        if wanted is None:  # an item of no listed chunk or value: never read
            continue
        if not _is_storage_info(info):
            _bad(f"{where}: its storage item is a {type(info).__name__}, not _StorageInfo")
        relative = _attribute(info, "relative_path")
        start, length = _attribute(info, "offset"), _attribute(info, "length")
        if type(relative) is not str:
            _bad(f"{where}: its storage item's file is a {type(relative).__name__}, not a name")
        if not (_is_index(start) and _is_index(length) and start + length <= _INT64):
            _bad(f"{where}: its storage item's offset and length are not byte counts")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and (type(transforms) not in (list, tuple) or transforms):
            listed = type(transforms) in (list, tuple)
            shown = [t[:40] for t in transforms if type(t) is str][:3] if listed else []
            _bad(
                f"{where}: its storage item is transformed ({shown or type(transforms).__name__}): "
                "compressed or encoded items are refused (dtensor_ema never writes them, and "
                "they can inflate far beyond the file)"
            )
        sizes, nbytes = wanted
        if length < nbytes:
            _bad(
                f"{where}, chunk at offsets {offset}: its storage item holds {length} bytes, "
                f"but its {math.prod(sizes)} elements take {nbytes}"
            )
        if offset is not None:
            facts.chunk_sizes[index] = sizes
        facts.items.setdefault(relative, []).append((start, length, fqn))
    if expected:
        (fqn, offset), _ = next(iter(expected.items()))
        what = "its value" if offset is None else f"its chunk at offsets {offset}"
        _bad(f"entry {_name(fqn)}: {what} has no storage item")


def _is_storage_info(info: object) -> bool:
    # DCP's file system writer's item class is private (``filesystem._StorageInfo``): it is
    # named, not imported, as the restricted unpickler names it.
    kind = type(info)
    return (kind.__module__, kind.__qualname__) == (
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
    )


def _storage_meta(storage_meta: object) -> None:
    if storage_meta is None:
        return
    if type(storage_meta) is not StorageMeta:
        _bad(f"its storage_meta is a {type(storage_meta).__name__}, not StorageMeta")
    save_id = getattr(storage_meta, "save_id", None)
    if save_id is not None and not (type(save_id) is str and len(save_id) <= 256):
        _bad("its save id is not a short string")
    modules = getattr(storage_meta, "modules", [])
    if type(modules) is not list or not all(type(m) is str for m in modules):
        _bad("its storage_meta's modules are not a list of names")
