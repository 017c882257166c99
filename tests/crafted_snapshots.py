"""Crafted post-hoc snapshot folders (issue 35): altered or malformed manifests, DCP data
that does not match its manifest, chunks that leave rows uncovered, symlinks leading out.

Each crafter copies a clean snapshot directory written by ``PostHocEMA`` and changes one
thing. ``.metadata`` files are rewritten from our own (plain ``pickle`` of DCP's objects,
so only the classes the restricted reader allows); the manifest checksum is recomputed here
(SHA-256 of compact sorted JSON without the ``checksum`` field) where a case must get past
it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"


def snapshot_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and p.is_dir())


def reseal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its checksum recomputed (the reference, written here)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return {**body, "checksum": "sha256:" + hashlib.sha256(text.encode()).hexdigest()}


def copy_run(clean: Path, dest: Path) -> Path:
    shutil.copytree(clean, dest, symlinks=True)
    return dest


def edit_manifest(
    folder: Path, change: Callable[[dict[str, Any]], Any], *, sealed: bool = True
) -> Path:
    """Apply ``change`` to ``folder``'s manifest (in place); recompute the checksum when
    ``sealed``. Returns the manifest's path."""
    file = folder / MANIFEST
    manifest = json.loads(file.read_text())
    change(manifest)
    if sealed and isinstance(manifest, dict):
        manifest = reseal(manifest)
    file.write_text(json.dumps(manifest, indent=1))
    return file


def write_text(folder: Path, text: str) -> Path:
    (folder / MANIFEST).write_text(text)
    return folder / MANIFEST


def _rewrite_metadata(folder: Path, change: Callable[[Any], None]) -> None:
    path = folder / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own file
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def drop_last_chunk(folder: Path, key: str, *, duplicate: bool = False) -> None:
    """Remove the last saved chunk of the DCP entry ``key`` from ``folder``'s ``.metadata``
    (with ``duplicate``: list the first chunk twice instead)."""

    def change(metadata: Any) -> None:
        md = metadata.state_dict_metadata[key]
        chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
        if duplicate:
            md.chunks = [*chunks, copy.deepcopy(chunks[0])]
            return
        removed = chunks[-1]
        md.chunks = chunks[:-1]
        metadata.storage_data = {
            index: info
            for index, info in metadata.storage_data.items()
            if not (index.fqn == key and tuple(index.offset) == tuple(removed.offsets))
        }

    _rewrite_metadata(folder, change)


def shrink_chunk(folder: Path, key: str, rows: int) -> None:
    """Make the one saved chunk of ``key`` list only its first ``rows`` rows (a
    ``.metadata`` listing rows 0-7 of a 13-row tensor): the other rows are in no chunk."""

    def change(metadata: Any) -> None:
        (chunk,) = metadata.state_dict_metadata[key].chunks
        chunk.sizes = torch.Size([rows, *chunk.sizes[1:]])

    _rewrite_metadata(folder, change)


def foreign_data(folder: Path, other: Path) -> None:
    """Put another run's DCP data (``.metadata`` and data files) under ``folder``'s
    manifest: another run written into the same folder."""
    for f in [folder / ".metadata", *folder.glob("*.distcp")]:
        f.unlink()
    for f in [other / ".metadata", *other.glob("*.distcp")]:
        shutil.copy(f, folder / f.name)


def link_outside(run: Path, outside: Path, name: str) -> Path:
    """Replace ``run/name`` by a symlink to ``outside/name`` (a copy of it, moved out)."""
    shutil.move(str(run / name), str(outside / name))
    os.symlink(outside / name, run / name)
    return run / name


_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextmanager
def files_opened() -> Iterator[list[str]]:
    """Records every path this process opens meanwhile (Python's ``open`` audit event)."""
    global _OPENED
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None
