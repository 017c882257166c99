"""Post-hoc EMA snapshots on disk: one sharded DCP checkpoint per snapshot, plus a manifest.

Layout of a snapshot directory::

    run/phema/
        step-000000004096/          # a DCP checkpoint: every rank wrote only its own shards
            .metadata  __0_0.distcp  ...
            manifest.json           # t, profiles (sigma_rel, gamma), dtypes, fqns and shapes
        step-000000008192/
        step-000000012288.partial/  # a snapshot being written (or one that crashed): ignored

A snapshot is written into ``<name>.partial``; only after every rank finished writing does
rank 0 add ``manifest.json`` and rename the directory to ``<name>``. A crash mid-snapshot
therefore leaves at most a ``.partial`` directory, which readers ignore and the next snapshot
deletes; every earlier snapshot stays valid. Readers accept a directory only if it has both
``manifest.json`` and DCP's ``.metadata``.

Inside the checkpoint, profile ``i``'s tensors live under ``p<i>`` (``{"p0": {fqn: tensor},
...}``) and the integer buffers the EMA does not average (BatchNorm's
``num_batches_tracked``) under ``followed``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "MANIFEST", "Snapshot", "check_compatible", "list_snapshots"]

MANIFEST = "manifest.json"
FORMAT = "dtensor_ema.posthoc/1"
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"
_NAME = re.compile(r"^step-(\d+)$")


def snapshot_name(step: int) -> str:
    """Directory name of the snapshot taken after ``step`` updates."""
    return f"step-{step:012d}"


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a snapshot manifest")
    return value


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One complete snapshot: its directory and its parsed manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        """Number of ``update()`` calls when the snapshot was taken."""
        return int(self.manifest["step"])

    @property
    def t(self) -> float:
        """Time of the snapshot in the run's unit (updates, or samples)."""
        return float(self.manifest["t"])

    @property
    def profiles(self) -> list[dict[str, Any]]:
        """``[{"key": "p0", "sigma_rel": 0.05, "gamma": 16.97}, ...]``."""
        return list(self.manifest["profiles"])

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        """``fqn -> {"shape", "dtype" (stored), "ema_dtype", "model_dtype"}``."""
        return dict(self.manifest["tensors"])


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` into ``directory`` by way of a temporary file (never torn)."""
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def prepare(snapshot_dir: Path, name: str) -> Path:
    """Rank 0, before a snapshot: tidy leftovers of a crashed one; return the partial path."""
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    final = snapshot_dir / name
    partial = snapshot_dir / (name + PARTIAL_SUFFIX)
    old = snapshot_dir / (name + OLD_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    if old.exists():
        if final.exists():
            shutil.rmtree(old)
        else:  # died while replacing a snapshot of the same step: put the old one back
            os.rename(old, final)
    return partial


def commit(snapshot_dir: Path, name: str, manifest: dict[str, Any]) -> Path:
    """Rank 0, after every rank wrote: add the manifest, rename ``.partial`` into place."""
    final = snapshot_dir / name
    partial = snapshot_dir / (name + PARTIAL_SUFFIX)
    old = snapshot_dir / (name + OLD_SUFFIX)
    write_manifest(partial, manifest)
    if final.exists():  # the same step again (a resumed run): replace it
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(snapshot_dir)
    if old.exists():
        shutil.rmtree(old)
    return final


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_snapshots(snapshot_dir: str | os.PathLike[str]) -> list[Snapshot]:
    """Every complete snapshot under ``snapshot_dir``, oldest first. Local, one process.

    Raises:
        FileNotFoundError: ``snapshot_dir`` does not exist or is not a directory.
        ValueError: it holds no complete snapshot, or a manifest of another format.
    """
    root = Path(snapshot_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"snapshot directory {root} does not exist"
            if not root.exists()
            else f"snapshot directory {root} is not a directory"
        )
    found: list[Snapshot] = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if not (match and child.is_dir()):
            continue
        if not ((child / MANIFEST).is_file() and (child / ".metadata").is_file()):
            continue  # still being written, or crashed: earlier snapshots stay usable
        with (child / MANIFEST).open() as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise ValueError(
                f"{child / MANIFEST} has format {manifest.get('format')!r}, expected {FORMAT!r}"
            )
        found.append(Snapshot(child, manifest))
    if not found:
        raise ValueError(
            f"snapshot directory {root} holds no complete snapshot (expected subdirectories "
            "step-<N> with manifest.json and .metadata, written by PostHocEMA.snapshot())"
        )
    return sorted(found, key=lambda s: s.step)


def check_compatible(snapshots: Sequence[Snapshot]) -> None:
    """All snapshots describe the same model with the same stored dtypes.

    Raises:
        ValueError: naming the first two snapshots that differ and the first few fqns.
    """
    first = snapshots[0]
    for other in snapshots[1:]:
        a, b = first.tensors, other.tensors
        if a == b and first.manifest.get("time") == other.manifest.get("time"):
            continue
        if first.manifest.get("time") != other.manifest.get("time"):
            raise ValueError(
                f"snapshots {first.path.name} and {other.path.name} count time differently "
                f"({first.manifest.get('time')!r} vs {other.manifest.get('time')!r})"
            )
        only_a = [k for k in a if k not in b]
        only_b = [k for k in b if k not in a]
        differ = [
            f"{k}: {_describe(a[k])} vs {_describe(b[k])}" for k in a if k in b and a[k] != b[k]
        ]
        raise ValueError(
            f"snapshots {first.path} and {other.path} are of different models, shapes or "
            f"dtypes: only in the first {only_a[:5]}, only in the second {only_b[:5]}, "
            f"different {differ[:5]}"
        )


def _describe(spec: dict[str, Any]) -> str:
    text = f"{tuple(spec['shape'])} {spec['dtype']}"
    if spec.get("ema_dtype") not in (None, spec["dtype"]):
        text += f" (EMA {spec['ema_dtype']})"
    return text
