"""Crafted checkpoints: a ``.metadata`` that runs code when ``pickle`` loads it (issue 27).

Shared by ``test_checkpoint_trust.py`` (every reader, one process) and
``test_checkpoint_integrity.py`` (W=2). The payload is ``os.system("touch <marker>")``: a
reader that unpickles ``.metadata`` with plain ``pickle`` creates the marker file.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
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

    open_checkpoint(directory)
    dtypes = {n for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    return {
        (module, name)
        for module, name in metadata_globals(directory / ".metadata")
        if (module, name) not in METADATA_GLOBALS and not (module == "torch" and name in dtypes)
    }
