"""Post-hoc EMA snapshots on disk: one sharded DCP checkpoint per snapshot, plus a manifest.

Layout of a snapshot directory::

    run/phema/
        step-000000004096/          # a DCP checkpoint: every rank wrote only its own shards
            .metadata  __0_0.distcp  ...
            __0.checksums.json ...  # every rank's checksums of what it wrote (as save_checkpoint)
            manifest.json           # t, profiles (sigma_rel, gamma), dtypes, fqns and shapes,
                                    # the save id of the DCP data
        step-000000008192/
        step-000000012288.partial/  # a snapshot being written (or one that crashed): ignored

A snapshot is written into ``<name>.partial``; only after every rank finished writing does
rank 0 add ``manifest.json`` and rename the directory to ``<name>``. A crash mid-snapshot
therefore leaves at most a ``.partial`` directory, which readers ignore and the next snapshot
deletes; every earlier snapshot stays valid. Readers accept a directory only if it has both
``manifest.json`` and DCP's ``.metadata``.

Inside the checkpoint, profile ``i``'s tensors live under ``p<i>`` (``{"p0": {fqn: tensor},
...}``) and, when every float tensor of the model is tracked, the integer buffers the EMA
does not average (BatchNorm's ``num_batches_tracked``) under ``followed``.

A snapshot is bound like a checkpoint of :func:`~dtensor_ema.save_checkpoint` (one save id
in ``.metadata``, every rank's checksum file and the manifest), so a reader refuses a folder
whose data, checksums and manifest are not of one save, and verifies every byte it reads.
Reading is strict (:func:`read_manifest`): a plain ``step-<12 digits>`` entry of the
directory read, no link leading out, a manifest of :data:`FORMAT`'s schema (at most
:data:`MAX_MANIFEST_BYTES`, read within bounds) naming its own step and carrying the SHA-256
of its content; every problem raises :class:`SnapshotError` before any tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from dtensor_ema.checkpoint.bounded_json import JsonProblem, read_json
from dtensor_ema.checkpoint.metadata_check import MAX_DIMS, MAX_ELEMENTS
from dtensor_ema.checkpoint.storage import commit_partial, local_directory, tidy_interrupted

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Snapshot",
    "SnapshotError",
    "check_compatible",
    "list_snapshots",
    "manifest_checksum",
    "read_manifest",
]

MANIFEST = "manifest.json"
FORMAT = "dtensor_ema.posthoc/3"
"""The manifest format this version writes and reads (``/3``: names the save id of its
data, whose checksums the snapshot records; ``/2`` and ``/1`` manifests, from before, are
refused)."""
MAX_MANIFEST_BYTES = 32 << 20
"""The largest manifest read: about 130,000 tensors (a 50,000-tensor manifest takes 12 MB)."""
MAX_PROFILES = 64
"""Most profiles a snapshot may hold (EDM2 tracks 2)."""
_INT64 = (1 << 63) - 1
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"
METADATA_FILE = ".metadata"
_NAME = re.compile(r"^step-(\d+)$")
_CHECKSUM = re.compile(r"^sha256:[0-9a-f]{64}$")
_SIGMA_REL_MAX = 1.0 / math.sqrt(12.0)
_TRACK = ("all", "trainable", "predicate")
_FIELDS = frozenset(
    {
        "format",
        "step",
        "t",
        "time",
        "profiles",
        "tensors",
        "followed",
        "aliases",
        "model_keys",
        "world_size",
        "track",
        "untracked",
        "save_id",
        "checksum",
    }
)


class SnapshotError(ValueError):
    """A snapshot folder or its ``manifest.json`` is malformed, altered, or leads outside
    the directory being read. The message is ``"<file>: <what is wrong>"``."""

    def __init__(self, file: Path | str, what: str | None = None) -> None:
        super().__init__(str(file) if what is None else f"{file}: {what}")
        self.file = file
        self.what = what


def snapshot_name(step: int) -> str:
    """Directory name of the snapshot taken after ``step`` updates."""
    return f"step-{step:012d}"


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    value = _DTYPES.get(name) if isinstance(name, str) else None
    if value is None:
        raise ValueError(f"unknown dtype {_show(name)} in a snapshot manifest")
    return value


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One complete snapshot: its directory and its parsed, validated manifest."""

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
        """``fqn -> {"shape", "dtype" (stored), "ema_dtype", "model_dtype"}``: the tracked
        tensors, tied duplicates once."""
        return dict(self.manifest["tensors"])

    @property
    def untracked(self) -> list[str]:
        """The model's float tensors the EMA did not track (``track=``): not in the
        snapshot, nor in what :func:`~dtensor_ema.synthesize` returns."""
        return list(self.manifest["untracked"])


# ----------------------------------------------------------------------------- writing
def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the manifest's content without its ``checksum`` field (compact
    JSON with sorted keys, so whitespace and key order do not matter)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` (checksum added) into ``directory`` by way of a temporary file
    (never torn). The manifest is validated first, as a reader would.

    Raises:
        SnapshotError: the manifest does not follow the schema (a bug of the writer).
    """
    sealed = {**manifest, "checksum": manifest_checksum(manifest)}
    tmp = directory / (MANIFEST + ".tmp")
    _validate(sealed, directory / MANIFEST, sealed.get("step"))
    with tmp.open("w") as f:
        json.dump(sealed, f, indent=1, sort_keys=True, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def prepare(snapshot_dir: Path, name: str) -> Path:
    """Rank 0, before a snapshot: tidy leftovers of a crashed one; return the partial path."""
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    partial = snapshot_dir / (name + PARTIAL_SUFFIX)
    tidy_interrupted(snapshot_dir / name, partial, snapshot_dir / (name + OLD_SUFFIX))
    return partial


def commit(snapshot_dir: Path, name: str, manifest: dict[str, Any]) -> Path:
    """Rank 0, after every rank wrote: add the manifest, rename ``.partial`` into place."""
    final = snapshot_dir / name
    partial = snapshot_dir / (name + PARTIAL_SUFFIX)
    write_manifest(partial, manifest)
    # The same step again (a resumed run) replaces it.
    commit_partial(partial, final, snapshot_dir / (name + OLD_SUFFIX))
    return final


# ----------------------------------------------------------------------------- reading
def list_snapshots(snapshot_dir: str | os.PathLike[str]) -> list[Snapshot]:
    """Every complete snapshot under ``snapshot_dir``, oldest first. Local, one process.

    Entries named ``step-<N>`` are snapshot folders; one without both ``manifest.json`` and
    ``.metadata`` is still being written (or crashed) and is skipped. Each folder's place is
    checked before any file in it is opened, then its manifest is read with
    :func:`read_manifest`.

    Raises:
        FileNotFoundError: ``snapshot_dir`` does not exist or is not a directory.
        SnapshotError: a ``step-<N>`` entry, its ``manifest.json`` or its ``.metadata`` is a
            symlink leading outside the folder it belongs to; a folder name that is not
            ``step-`` and 12 digits; a manifest that is not valid JSON, does not follow the
            schema, names another step than its folder, or whose checksum differs.
        ValueError: it holds no complete snapshot, or it is an object-store URL.
    """
    root = local_directory(snapshot_dir, "snapshot_dir")
    if not root.is_dir():
        raise FileNotFoundError(
            f"snapshot directory {root} does not exist"
            if not root.exists()
            else f"snapshot directory {root} is not a directory"
        )
    found: list[Snapshot] = []
    for child in sorted(root.iterdir()):
        match = _NAME.match(child.name)
        if match is None:
            continue
        _check_inside(child, root, "snapshot folder", "the snapshot directory")
        if not child.is_dir():
            continue
        if child.name != snapshot_name(int(match.group(1))):
            raise SnapshotError(
                child,
                f"not a snapshot folder name: expected {snapshot_name(int(match.group(1)))!r} "
                "(step- and 12 digits, as PostHocEMA writes them)",
            )
        for name in (MANIFEST, METADATA_FILE):
            _check_inside(child / name, child, name, "its snapshot folder")
        if not ((child / MANIFEST).is_file() and (child / METADATA_FILE).is_file()):
            continue  # still being written, or crashed: earlier snapshots stay usable
        found.append(Snapshot(child, read_manifest(child)))
    if not found:
        raise ValueError(
            f"snapshot directory {root} holds no complete snapshot (expected subdirectories "
            "step-<N> with manifest.json and .metadata, written by PostHocEMA.snapshot())"
        )
    return sorted(found, key=lambda s: s.step)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the snapshot folder ``folder``, validated. Local.

    Checks, in order: valid JSON (no duplicate keys, no NaN), an object of :data:`FORMAT`
    with exactly the schema's fields, each of the right type and range (profiles keyed
    ``p0, p1, ...``; shapes; floating-point dtypes; every named tensor a model key), the
    folder's own step, and the checksum.

    Raises:
        SnapshotError: naming the file and the first problem.
    """
    file = folder / MANIFEST
    try:
        manifest = read_json(file, max_bytes=MAX_MANIFEST_BYTES)
    except JsonProblem as e:
        raise SnapshotError(file, f"not a valid JSON manifest: {e}") from None
    match = _NAME.match(folder.name)
    _validate(manifest, file, int(match.group(1)) if match else None)
    return manifest


def _check_inside(path: Path, folder: Path, what: str, where: str) -> None:
    """Refuse ``path`` (an entry of ``folder``) when it is a symlink leading out of it."""
    if not path.is_symlink():
        return
    target = path.resolve()
    home = folder.resolve()
    if target == home or not target.is_relative_to(home):
        raise SnapshotError(
            path,
            f"the {what} is a symlink to {target}, outside {where} {folder}: refused (nothing "
            "was opened)",
        )


def _validate(m: Any, file: Path, folder_step: int | None) -> None:
    """Check the manifest ``m`` against the schema; raise on the first problem."""

    def bad(what: str) -> NoReturn:
        raise SnapshotError(file, what)

    if not isinstance(m, dict):
        bad(f"expected a JSON object, got {_kind(m)}")
    if m.get("format") != FORMAT:
        bad(
            f"format {m.get('format')!r}, expected {FORMAT!r} (not a PostHocEMA manifest, or "
            "one written by another version of dtensor_ema)"
        )
    missing, unknown = sorted(_FIELDS - m.keys()), sorted(m.keys() - _FIELDS)
    if missing or unknown:
        bad(f"missing fields {missing}, unknown fields {unknown}")
    step = m["step"]
    if not _is_int(step, 0):
        bad(f"'step' must be an int in [0, 2**63), got {_show(step)}")
    if folder_step is not None and step != folder_step:
        bad(f"'step' is {step} but the folder is {snapshot_name(folder_step)}")
    if not _is_int(m["t"], 1):
        bad(f"'t' must be an int in [1, 2**63), got {_show(m['t'])}")
    if m["time"] not in ("steps", "samples"):
        bad(f"'time' must be 'steps' or 'samples', got {_show(m['time'])}")
    if not _is_int(m["world_size"], 1):
        bad(f"'world_size' must be an int in [1, 2**63), got {_show(m['world_size'])}")
    if m["track"] not in _TRACK:
        bad(f"'track' must be one of {list(_TRACK)}, got {_show(m['track'])}")
    save_id = m["save_id"]
    if not (isinstance(save_id, str) and 0 < len(save_id) <= 256):
        bad(f"'save_id' must be the id of the save that wrote the data, got {_show(save_id)}")
    profiles = m["profiles"]
    if not isinstance(profiles, list) or not profiles:
        bad(f"'profiles' must be a non-empty list, got {_kind(profiles)}")
    if len(profiles) > MAX_PROFILES:
        bad(f"'profiles' lists {len(profiles)} profiles, more than {MAX_PROFILES}")
    for i, p in enumerate(profiles):
        where = f"profiles[{i}]"
        if not isinstance(p, dict) or set(p) != {"key", "sigma_rel", "gamma"}:
            bad(f"{where} must be an object with 'key', 'sigma_rel' and 'gamma', got {_show(p)}")
        if p["key"] != f"p{i}":
            got = _show(p["key"])
            bad(f"{where}['key'] must be 'p{i}' (where profile {i} is stored), got {got}")
        if not (_is_number(p["sigma_rel"]) and 0.0 < p["sigma_rel"] < _SIGMA_REL_MAX):
            bad(f"{where}['sigma_rel'] must lie in (0, 0.2887), got {_show(p['sigma_rel'])}")
        if not (_is_number(p["gamma"]) and 0.0 <= p["gamma"] <= _GAMMA_MAX):
            bad(f"{where}['gamma'] must be a number in [0, 1e9], got {_show(p['gamma'])}")
    model_keys = m["model_keys"]
    if not (isinstance(model_keys, list) and all(isinstance(k, str) for k in model_keys)):
        bad(f"'model_keys' must be a list of names, got {_kind(model_keys)}")
    if len(set(model_keys)) != len(model_keys):
        bad("'model_keys' names a tensor twice")
    known = set(model_keys)
    tensors = _mapping(m["tensors"], "tensors", bad)
    if not tensors:
        bad("'tensors' is empty: a snapshot holds at least one tensor")
    fields = {"shape", "dtype", "ema_dtype", "model_dtype"}
    dtypes_seen: set[tuple[str, str, str | None]] = set()  # each combination checked once
    for k, spec in tensors.items():
        _spec(spec, k, "tensors", fields, bad)
        dtypes = (spec["dtype"], spec["ema_dtype"], spec["model_dtype"])
        if all(isinstance(d, str) for d in dtypes[:2]) and dtypes in dtypes_seen:
            continue
        for field in ("ema_dtype", "dtype"):
            _dtype(spec[field], f"tensors[{k!r}][{field!r}]", bad, floating=True)
        if spec["model_dtype"] is not None:
            _dtype(spec["model_dtype"], f"tensors[{k!r}]['model_dtype']", bad, floating=False)
        dtypes_seen.add(dtypes)
    followed = _mapping(m["followed"], "followed", bad)
    for k, spec in followed.items():
        _spec(spec, k, "followed", {"shape", "dtype"}, bad)
        _dtype(spec["dtype"], f"followed[{k!r}]['dtype']", bad, floating=False)
    aliases = _mapping(m["aliases"], "aliases", bad)
    wrong = {k: v for k, v in aliases.items() if v not in tensors or k in tensors}
    if wrong:
        bad(f"'aliases' must map other names to tracked tensors, got {_show(wrong)}")
    untracked = m["untracked"]
    if not (isinstance(untracked, list) and all(isinstance(k, str) for k in untracked)):
        bad(f"'untracked' must be a list of names, got {_kind(untracked)}")
    for field, names in (
        ("tensors", list(tensors)),
        ("followed", list(followed)),
        ("aliases", list(aliases)),
        ("untracked", untracked),
    ):
        strangers = [k for k in names if k not in known]
        if strangers:
            bad(f"'{field}' names tensors that are not model keys: {strangers[:5]}")
    tracked, rest = set(tensors), set(followed) | set(untracked)
    both = sorted((tracked & rest) | (set(followed) & set(untracked)))
    if both:
        bad(f"tensors {both[:5]} are listed as more than one of tracked, followed, untracked")
    checksum = m["checksum"]
    if not (isinstance(checksum, str) and _CHECKSUM.match(checksum)):
        bad(f"'checksum' must be 'sha256:' and 64 hex digits, got {checksum!r}")
    if checksum != manifest_checksum(m):
        bad(
            "its checksum does not match its content: the manifest was altered after it was "
            "written (its t, profiles or tensors can no longer be trusted)"
        )


def _mapping(value: Any, field: str, bad: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        bad(f"'{field}' must be an object, got {_kind(value)}")
    return value


def _spec(spec: Any, key: str, field: str, fields: set[str], bad: Any) -> None:
    """``spec`` (``m[field][key]``) has ``fields`` and a shape of at most 64 dims of ints
    >= 0, at most 2**62 elements (the place named only when it is wrong: 50,000 of these
    are checked per manifest)."""
    if not isinstance(spec, dict) or spec.keys() != fields:
        where = f"{field}[{key!r}]"
        bad(f"{where} must be an object with the fields {sorted(fields)}, got {_show(spec)}")
    shape = spec["shape"]
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS):
        got = _show(shape)
        bad(f"{field}[{key!r}]['shape'] must be a list of at most {MAX_DIMS} ints, got {got}")
    elements = 1
    for n in shape:
        if type(n) is not int or n < 0:
            bad(f"{field}[{key!r}]['shape'] must be a list of ints >= 0, got {_show(shape)}")
        elements *= n
        if elements > MAX_ELEMENTS:
            bad(f"{field}[{key!r}]['shape'] claims more than 2**62 elements")


def _dtype(name: Any, where: str, bad: Any, *, floating: bool) -> None:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        bad(f"{where} is not a torch dtype: {_show(name)}")
        return
    if floating and not dtype.is_floating_point:
        bad(f"{where} must be a floating-point dtype, got {_show(name)}")


_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
"""``"torch.float32" -> torch.float32``: a manifest names dtypes as ``str(dtype)`` does."""
_GAMMA_MAX = 1e9
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlevel = 3


def _show(value: Any) -> str:
    """``repr(value)``, shortened: a manifest can put megabytes (or deep nesting) anywhere."""
    return _SHOWN.repr(value)


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= _INT64


def _is_number(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _INT64


def _kind(value: Any) -> str:
    kinds: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
    return kinds.get(type(value), _show(value))


def check_compatible(snapshots: Sequence[Snapshot]) -> None:
    """All snapshots describe the same model, tracked set and stored dtypes.

    Raises:
        ValueError: naming the first two snapshots that differ and the first few fqns.
    """
    first = snapshots[0]
    for other in snapshots[1:]:
        a, b = first.tensors, other.tensors
        if first.manifest.get("time") != other.manifest.get("time"):
            raise ValueError(
                f"snapshots {first.path.name} and {other.path.name} count time differently "
                f"({first.manifest.get('time')!r} vs {other.manifest.get('time')!r})"
            )
        if first.untracked != other.untracked and set(first.manifest["model_keys"]) == set(
            other.manifest["model_keys"]
        ):
            only_a = [k for k in a if k not in b]
            only_b = [k for k in b if k not in a]
            raise ValueError(
                f"snapshots {first.path} and {other.path} track different tensors of the "
                f"model (track={first.manifest['track']!r} vs {other.manifest['track']!r}): "
                f"tracked only in the first {only_a[:5]}, only in the second {only_b[:5]}. "
                "The tracked set changed between them (add_tensors/drop_tensors, or "
                "requires_grad with track='trainable'); synthesize from the snapshots on one "
                "side of the change (steps=...)"
            )
        if a == b:
            continue
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
