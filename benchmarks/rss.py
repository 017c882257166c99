"""Resident memory of this process on Linux (``/proc/self/status``), for the memory
benchmarks: the current size and the peak since a reset."""

from __future__ import annotations

import re
from pathlib import Path


def status_kib(field: str) -> int:
    """``VmRSS``, ``VmHWM``, ... of this process, in KiB."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match is not None, field
    return int(match.group(1))


def reset_peak() -> int:
    """Make the peak (``VmHWM``) the current size; return that size in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")
