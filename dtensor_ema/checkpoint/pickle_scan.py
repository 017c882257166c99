"""A pass over a pickle's opcodes before the C unpickler reads it: no memo index beyond the
pickle's own size.

CPython's C unpickler keeps its memo in an array that ``PUT``/``LONG_BINPUT`` grow to twice
the index they name, zero-filled: ``LONG_BINPUT 688482452`` (five bytes) makes it allocate
and touch 11 GB before any check (found by ``tests/fuzz_readers.py``). Every memoized object
costs at least one byte of the pickle, so a legitimate index is below its length (DCP's
protocol-4 pickles use ``MEMOIZE``, which numbers them in order). :func:`memo_problem` walks
the opcodes (their argument lengths, not their values) in one pass and names the first
index beyond that; other malformations are left to the unpickler, which refuses them.
Local, about a tenth of the time of unpickling DCP's metadata.
"""

from __future__ import annotations

import pickletools

__all__ = ["memo_problem"]

_STOP = ord(".")
_PUT = ord("p")
_LONG_BINPUT = ord("r")
_FIXED = [-1] * 256
"""Bytes of an opcode's argument when fixed (``-1``: it is not)."""
_PREFIX = [0] * 256
"""Bytes of the length before an opcode's argument (0: none)."""
_KNOWN = [False] * 256
for _op in pickletools.opcodes:
    _code = ord(_op.code)
    _KNOWN[_code] = True
    _n = 0 if _op.arg is None else _op.arg.n
    if _n >= 0:
        _FIXED[_code] = _n
    elif _n == pickletools.TAKEN_FROM_ARGUMENT1:
        _PREFIX[_code] = 1
    elif _n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
        _PREFIX[_code] = 4
    elif _n == pickletools.TAKEN_FROM_ARGUMENT8U:
        _PREFIX[_code] = 8
    # else: up to a newline


def memo_problem(data: bytes) -> str | None:
    """What is wrong with the memo indices of the pickle ``data`` (a ``PUT`` or
    ``LONG_BINPUT`` beyond ``len(data)``), or ``None``. Stops at ``STOP``, at an unknown
    opcode or at the end of the data (the unpickler refuses those)."""
    limit = len(data)
    i, n = 0, len(data)
    while i < n:
        op = data[i]
        i += 1
        size = _FIXED[op]
        if size >= 0:
            if op == _LONG_BINPUT and int.from_bytes(data[i : i + 4], "little") > limit:
                return f"a memo index beyond its {limit} bytes (LONG_BINPUT at byte {i - 1})"
            i += size
            continue
        if op == _STOP or not _KNOWN[op]:
            return None
        width = _PREFIX[op]
        if width:
            i += width + int.from_bytes(data[i : i + width], "little")
            continue
        end = data.find(b"\n", i)
        if end < 0:
            return None
        if op == _PUT and (end - i > 19 or not data[i:end].isdigit() or int(data[i:end]) > limit):
            return f"a memo index beyond its {limit} bytes (PUT at byte {i - 1})"
        i = end + 1
    return None
