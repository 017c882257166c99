"""JSON read from a checkpoint or snapshot folder, in memory and time bounded by its size.

``json.loads`` builds a Python object for every value: two bytes of ``[]`` become a
56-byte list, so a 60 MiB file of nested brackets takes gigabytes and half a minute, and a
few thousand levels of nesting raise ``RecursionError``. :func:`read_json` refuses, before
parsing: a file larger than the caller's limit (which it derives from what the file may
hold), nesting deeper than :data:`MAX_DEPTH`, and more than one value per
:data:`MIN_BYTES_PER_VALUE` bytes (the files dtensor_ema writes have one per 15 bytes or
more). Duplicate keys and ``NaN``/``Infinity`` are refused while parsing, in linear time.
What remains costs a few times its size. Local; every check is a C-speed pass over the
bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import IO, Any, NoReturn

__all__ = [
    "MAX_DEPTH",
    "MIN_BYTES_PER_VALUE",
    "JsonProblem",
    "parse_json",
    "read_at_most",
    "read_json",
]

MAX_DEPTH = 8
"""Deepest nesting of objects and lists accepted (the files we write nest 4 deep)."""
MIN_BYTES_PER_VALUE = 8
"""Fewest bytes per value (object, list, or item after a comma) accepted, on average."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}:"\\')


class JsonProblem(ValueError):
    """The file is not JSON this reader accepts; the message says why (never its bytes)."""


def read_json(file: Path | IO[bytes], *, max_bytes: int) -> Any:
    """The JSON value in ``file`` (a path, or a binary file already open at its start),
    refused unless it stays within the bounds above.

    Reads at most ``max_bytes + 1`` bytes. Local.

    Raises:
        OSError: the file cannot be read.
        JsonProblem: larger than ``max_bytes``, nested too deep, too many values for its
            size, not valid UTF-8 JSON, a duplicate key, or ``NaN``/``Infinity``.
    """
    data = read_at_most(file, max_bytes)
    if data is None:
        _bad(f"larger than {max_bytes} bytes, the most this file may hold")
    return parse_json(data)


def read_at_most(file: Path | IO[bytes], max_bytes: int) -> bytes | None:
    """The bytes of ``file`` (a path, or a binary file already open at its start), or
    ``None`` when it holds more than ``max_bytes`` (its size is looked at first: ``read(n)``
    sizes its buffer by ``n``, not by the file)."""
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(file, "rb")) if isinstance(file, Path) else file
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError:  # no descriptor (an object in a store): its size, from a seek
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
        if size > max_bytes:
            return None
        data = f.read(size + 1)  # one more: a file that grew since is refused, not cut
    return data if len(data) <= max_bytes else None


def parse_json(data: bytes) -> Any:
    """:func:`read_json` of bytes already read (bounded by the caller)."""
    structure = _structure(data)
    brackets = structure.replace(b":", b"")
    for _ in range(MAX_DEPTH):
        if not brackets:
            break
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    if b"[]" in brackets or b"{}" in brackets:
        _bad(f"nested more than {MAX_DEPTH} levels deep")
    values = data.count(b",") + data.count(b"[") + data.count(b"{")
    if values > len(data) // MIN_BYTES_PER_VALUE + 64:
        _bad(f"{values} values in {len(data)} bytes: not a file dtensor_ema writes")
    try:
        # The keys each object kept are counted against the colons of the text (cheaper
        # than a hook over each object's pairs); only a file with fewer keys than colons
        # (a duplicate, kept once) is parsed again, to name the duplicate.
        keys = [0]

        def count(obj: dict[str, Any]) -> dict[str, Any]:
            keys[0] += len(obj)
            return obj

        value = json.loads(data, object_hook=count, parse_constant=_no_constant)
        if keys[0] != structure.count(b":"):
            json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        return value
    except UnicodeDecodeError as e:
        _bad(f"not UTF-8 text (byte {e.start})")
    except RecursionError:  # unbalanced brackets can hide depth from the count above
        _bad(f"nested more than {MAX_DEPTH} levels deep")
    except ValueError as e:  # JSONDecodeError, and ours: no bytes of the file are quoted
        _bad(f"not valid JSON: {e}")


def _structure(data: bytes) -> bytes:
    """The brackets and colons of ``data`` outside its strings, in order."""
    kept = data.translate(None, _NOT_STRUCTURE)
    if b"\\" in kept:  # escaped characters: find the strings the slow way
        return _STRING.sub(b"", data).translate(None, _NOT_STRUCTURE)
    return b"".join(kept.split(b'"')[::2])  # without escapes, quotes pair up in order


def _bad(what: str) -> NoReturn:
    raise JsonProblem(what)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated = sorted({k for k, _ in pairs if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
        shown = [k if len(k) <= 80 else k[:80] + "..." for k in repeated[:5]]
        raise ValueError(f"duplicate keys {shown}")
    return out


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number these files may hold")
