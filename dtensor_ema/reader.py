"""Reading DCP checkpoints and post-hoc snapshots without running any code from them.

Every reader of the package opens checkpoints here: :func:`~dtensor_ema.load_checkpoint`,
:func:`~dtensor_ema.convert_checkpoint`, :func:`~dtensor_ema.synthesize`,
:func:`~dtensor_ema.merge_snapshots` (and ``python -m dtensor_ema.posthoc``), and the
Lightning drop-in's and callback's loads of sharded checkpoints.

* :func:`open_checkpoint` reads ``.metadata`` with a restricted unpickler. torch's
  ``FileSystemReader.read_metadata`` calls ``pickle.load``, so a crafted ``.metadata`` runs
  its code in plain ``dcp.load`` before any check. Here only the globals DCP's metadata is
  made of (:data:`METADATA_GLOBALS`, and torch dtypes) can be built; any other global raises
  :class:`CheckpointError` naming it and the file, before anything else of the checkpoint
  is read.
* :meth:`Checkpoint.load` is ``dcp.load`` with that metadata (a ``FileSystemReader`` that
  never unpickles ``.metadata`` itself) and a planner that reads non-tensor values with
  ``torch.load(..., weights_only=True)``; DCP reads tensors with ``weights_only=True``
  already. DCP's default planner unpickles values unrestricted.
* :func:`path_inside`: every file name a checkpoint gives (a data file in ``.metadata``,
  ``file`` in a checksum file; a snapshot folder in a post-hoc manifest) is a plain name
  inside the directory read, and no symbolic link leaves it; :func:`open_checkpoint` checks
  every data file ``.metadata`` names before any is opened.
* :func:`check_coverage`: every tensor's saved chunks cover its shape exactly once (no gap,
  no overlap), checked by :func:`open_checkpoint` before anything is read, so a load never
  leaves rows of a destination unwritten.
* :meth:`Checkpoint.check_files`: every data file the metadata names exists and is long
  enough.
* :meth:`Checkpoint.verify_metadata`, :meth:`Checkpoint.verify_reads`: the CRC-32 recorded
  by :func:`~dtensor_ema.save_checkpoint` (:mod:`dtensor_ema.checksums`) of ``.metadata``
  and of every saved item a load reads, checked inside :meth:`Checkpoint.load` on each
  rank's read plan, in one pass over those byte ranges (memory-mapped), before any rank
  reads them; each checksum file must belong to the save that wrote ``.metadata`` (its
  save id, :attr:`Checkpoint.save_id`). A mismatch names the file and the entry, never a
  digest of the bytes read.
* :func:`verification`: ``verify=True`` on a checkpoint without checksum files warns
  (:class:`UnverifiedCheckpointWarning`); ``verify="require"`` refuses it.
* :meth:`Checkpoint.entries_under`, :meth:`Checkpoint.top_level_keys`: what the checkpoint
  holds under a key, from the metadata alone.

Nothing here communicates except :meth:`Checkpoint.load` (DCP's collectives).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import itertools
import json
import os
import pickle
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dtensor_ema._collectives import MESSAGE_RANKS, describe, quiet_single_process, same_error
from dtensor_ema.checkpoint_files import CheckpointFiles
from dtensor_ema.checksums import (
    FORMAT,
    METADATA_FILE,
    SIDECAR_GLOB,
    VERSION,
    available,
    digests,
    digests_of_ranges,
    item_key,
    sidecar_name,
)

__all__ = [
    "METADATA_GLOBALS",
    "PREVIOUS_SUFFIX",
    "Checkpoint",
    "CheckpointChangedError",
    "CheckpointError",
    "ChecksumError",
    "SafeLoadPlanner",
    "UnverifiedCheckpointWarning",
    "Verify",
    "check_coverage",
    "coverage_problem",
    "existing_checkpoint",
    "open_checkpoint",
    "path_inside",
    "verification",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded: DCP failed (chains its
    ``CheckpointException``, a ``BaseException`` that escapes ``except Exception``), its
    ``.metadata`` holds something other than DCP's metadata (nothing from it was run), or
    its bytes differ from those saved."""


class ChecksumError(CheckpointError):
    """A saved item's (or ``.metadata``'s) bytes differ from those saved, or cannot be read,
    or a checksum file belongs to another save; the message names the file and, for an
    item, the tensor or value (never a digest of the bytes read)."""


class CheckpointChangedError(CheckpointError):
    """Another save wrote to a checkpoint's path while a load read it (a concurrent
    :func:`~dtensor_ema.save_checkpoint` committed there, or a ``dcp.save`` wrote into the
    directory): the message names the file, what changed and, where it can be read, the
    other save's id. Nothing was mixed; load again once that save has finished."""


class UnverifiedCheckpointWarning(UserWarning):
    """``verify=True`` was asked of a checkpoint without checksum files (plain ``dcp.save``,
    or ``save_checkpoint(checksums=False)``): it loads, but nothing was verified. Filter
    this category to load such checkpoints quietly; ``verify="require"`` refuses them."""


Verify = bool | Literal["require"]
"""``verify=`` of :func:`~dtensor_ema.load_checkpoint` and
:func:`~dtensor_ema.convert_checkpoint`: ``True`` (verify the checksums where the checkpoint
has them, warn where it has none), ``"require"`` (refuse a checkpoint without them),
``False`` (skip)."""


PREVIOUS_SUFFIX = ".previous"
"""``<path>.previous``: the last good checkpoint while a
:func:`~dtensor_ema.save_checkpoint` commit swaps the directories."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # an Enum: built from its value
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "WindowsPath"),  # ... saved on Windows
    }
)
"""The ``(module, name)`` globals a DCP ``.metadata`` may refer to, besides the torch dtypes
(``torch.float32`` ...). Derived from what :func:`~dtensor_ema.save_checkpoint`,
``dcp.save``, ``dcp.async_save`` and ``PostHocEMA`` snapshots write (torch 2.14; pinned by
``tests/test_checkpoint_trust.py``). Every one builds plain data: DCP's metadata
dataclasses, ``torch.Size``, a layout or dtype looked up by name, a path."""

_TORCH_DTYPES = frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))


def _allowed(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS:
        return True
    if module == "pathlib._local" and name in ("PosixPath", "WindowsPath"):
        return True  # Python 3.13 names pathlib's classes after their new home
    return module == "torch" and name in _TORCH_DTYPES


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.name = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only :func:`_allowed` globals. Every way a pickle
    reaches a callable (``GLOBAL``, ``STACK_GLOBAL``, the ``EXT`` codes) goes through
    ``find_class``; persistent ids are refused by ``pickle`` itself."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise _Refused(module, name)
        return super().find_class(module, name)


def _unpickle_metadata(data: bytes, file: Path) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise CheckpointError(
            f"{file} refers to the global {e.name}, which is not part of DCP's checkpoint "
            "metadata: refused (this .metadata was not written by DCP; nothing in it was run "
            "and nothing else of the checkpoint was read)"
        ) from None
    except Exception as e:
        # Only the exception's type: pickle's messages quote the bytes it could not read.
        raise CheckpointError(
            f"{file} is not a readable DCP .metadata file ({type(e).__name__}: truncated, "
            "corrupted, or not written by DCP)"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{file} holds a {type(metadata).__name__}, not DCP's Metadata: not a DCP checkpoint"
        )
    return metadata


@dataclass(slots=True)
class Checkpoint:
    """One DCP checkpoint directory whose ``.metadata`` was read safely
    (:func:`open_checkpoint`)."""

    path: Path
    metadata: Metadata
    metadata_digests: dict[str, int]
    """Digests of the ``.metadata`` bytes that were read, by algorithm
    (:meth:`verify_metadata`)."""
    has_checksums: bool
    """Whether the directory has checksum files (``__<rank>.checksums.json``)."""
    _recorded: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Checksum files read so far, by name."""
    files: CheckpointFiles | None = None
    """The directory as :func:`open_checkpoint` opened it: every file is read from it, as
    first seen (:mod:`dtensor_ema.checkpoint_files`)."""

    def opened(self) -> CheckpointFiles:
        """:attr:`files` (opened now if this checkpoint was built without)."""
        if self.files is None:
            self.files = CheckpointFiles(self.path, self.changed)
        return self.files

    def close(self) -> None:
        """Close the files held open (idempotent; garbage collection closes them too)."""
        if self.files is not None:
            self.files.close()

    def changed(self, detail: str) -> CheckpointChangedError:
        """The error for a file that changed since this load began (``detail``: which,
        how), naming this load's save and, where readable, the one now at the path."""
        ours = f" (save {self.save_id!r})" if self.save_id else ""
        now = _save_id_at(self.path)
        other = f"another save (save {now!r})" if now and now != self.save_id else "another save"
        return CheckpointChangedError(
            f"checkpoint {self.path}{ours} changed while it was read: {detail}; {other} was "
            f"written to {self.path} meanwhile. Nothing was mixed: load again once that save "
            "has finished"
        )

    @property
    def save_id(self) -> str | None:
        """The id of the save that wrote ``.metadata`` (DCP's ``StorageMeta.save_id``):
        the id all ranks of a :func:`~dtensor_ema.save_checkpoint` agreed on, which its
        checksum files record too; ``None`` where the metadata has none."""
        storage_meta = getattr(self.metadata, "storage_meta", None)
        save_id = getattr(storage_meta, "save_id", None)
        return save_id if isinstance(save_id, str) else None

    def check_paths(self) -> None:
        """Every data file ``.metadata`` names is a plain file name inside the checkpoint
        directory, not a symbolic link that leaves it (:func:`path_inside`). Local; opens
        no file. :func:`open_checkpoint` calls it.

        Raises:
            CheckpointError: naming the entry and the file name.
        """
        seen: set[str] = set()
        for index, info in (self.metadata.storage_data or {}).items():
            relative = getattr(info, "relative_path", None)
            if relative is None or (isinstance(relative, str) and relative in seen):
                continue
            path_inside(self.path, relative, f"{self.path / METADATA_FILE} (entry {index.fqn!r})")
            seen.add(relative)

    def check_coverage(self) -> None:
        """:func:`check_coverage` of this checkpoint's metadata. Local; opens no file."""
        check_coverage(self.metadata, self.path / METADATA_FILE)

    # -------------------------------------------------------------------- metadata
    def entries_under(self, where: tuple[str, ...]) -> dict[str, Any]:
        """``{DCP key: storage metadata}`` of every entry saved under the nested key
        ``where`` (``("ema",)``, ``("emas", "fast")``)."""
        planner_data = self.metadata.planner_data or {}
        prefix = ".".join(where) + "."
        return {
            k: v
            for k, v in self.metadata.state_dict_metadata.items()
            if (
                tuple(str(p) for p in planner_data[k][: len(where)]) == where
                if k in planner_data
                else k.startswith(prefix)
            )
        }

    def top_level_keys(self) -> set[str]:
        """The keys of the saved state dict (``{"ema", "model", ...}``)."""
        planner_data = self.metadata.planner_data or {}
        return {
            str(planner_data[k][0]) if k in planner_data else k.split(".", 1)[0]
            for k in self.metadata.state_dict_metadata
        }

    def check_files(self) -> None:
        """Every data file the metadata names exists and is long enough. Local.

        Raises:
            FileNotFoundError: naming the missing or truncated files.
        """
        needed: dict[str, int] = {}
        for info in (self.metadata.storage_data or {}).values():
            relative = getattr(info, "relative_path", None)
            if relative is None:  # not a FileSystemWriter checkpoint: let DCP read it
                return
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
        files = self.opened()
        sizes = {f: files.size(f) for f in sorted(needed)}
        missing = [f for f, size in sizes.items() if size is None]
        if missing:
            raise FileNotFoundError(
                f"checkpoint {self.path} is incomplete: data files {missing[:5]} named by its "
                ".metadata are missing"
            )
        short = [
            f"{f} ({sizes[f]} bytes, needs {n})"
            for f, n in sorted(needed.items())
            if (sizes[f] or 0) < n
        ]
        if short:
            raise FileNotFoundError(
                f"checkpoint {self.path} is incomplete: truncated data files {short[:5]}"
            )

    # -------------------------------------------------------------------- checksums
    def verify_metadata(self) -> bool:
        """Compare the digest of the ``.metadata`` bytes that were read with the one
        :func:`~dtensor_ema.save_checkpoint` recorded (in rank 0's checksum file). Local.

        Returns:
            Whether it was checked (``False``: the checkpoint has no checksum files).

        Raises:
            ChecksumError: it differs (a corrupted or replaced ``.metadata``), the
                checkpoint has checksum files but not rank 0's, or none of the recorded
                algorithms is available here.
        """
        if not self.has_checksums:
            return False
        where = f"checkpoint {self.path}"
        recorded = self._sidecar(0).get("metadata")
        if not isinstance(recorded, dict):
            raise ChecksumError(
                f"{where}: no checksum was recorded for {METADATA_FILE} (rank 0's checksum "
                "file is missing)"
            )
        algorithm = _algorithm(recorded, where, METADATA_FILE)
        if self.metadata_digests[algorithm] != int(recorded[algorithm]):
            raise ChecksumError(
                f"{where}: {METADATA_FILE} does not match the checksum ({algorithm}) recorded "
                "when it was saved: the file is corrupted or was replaced"
            )
        return True

    def verify_reads(self, indices: Iterable[MetadataIndex]) -> int:
        """Check the saved items at ``indices`` (those a load reads) and ``.metadata``
        against the digests recorded when they were saved. Local.

        One pass over the items' byte ranges, one data file at a time, memory-mapped (no
        copy, no extra memory); nothing is deserialized. Uses XXH3-64 where it was recorded
        and ``xxhash`` is installed, else CRC-32. Reads only the checksum files of the
        ranks that wrote those data files. :meth:`load` calls it with each rank's read
        plan, so exactly the bytes the load reads are checked, whole and as saved (a
        resharding load too), before DCP reads any of them. A checkpoint without checksum
        files is not checked.

        Returns:
            The number of saved items checked.

        Raises:
            ChecksumError: ``.metadata`` or an item differs from the recorded digest,
                cannot be read, has no recorded checksum (a checksum file is missing), a
                checksum file is unreadable, or one belongs to another save (another save
                id than ``.metadata``'s); names the file and the tensor or value, never a
                digest computed over the bytes read.
        """
        if not self.verify_metadata():
            return 0
        where = f"checkpoint {self.path}"
        storage = self.metadata.storage_data or {}
        wanted = {item_key(index): index for index in indices}
        places = {key: storage.get(index) for key, index in wanted.items()}
        items = self._recorded_items({getattr(i, "relative_path", "") for i in places.values()})
        by_file: dict[str, list[tuple[int, int, str, int, str]]] = {}
        for key, index in wanted.items():
            offsets = () if index.offset is None else tuple(int(o) for o in index.offset)
            what = f"{index.fqn!r} (chunk at offsets {offsets})"
            entry = items.get(key)
            if entry is None:
                raise ChecksumError(
                    f"{where}: no checksum was recorded for {what}; a checksum file is missing"
                )
            saved = (entry["file"], entry["offset"], entry["length"])
            info = places[key]
            place = tuple(getattr(info, a, None) for a in ("relative_path", "offset", "length"))
            if place != saved:
                raise ChecksumError(
                    f"{where}: {METADATA_FILE} places {what} at {place} but it was saved to "
                    f"{saved}: the checkpoint's files do not belong together"
                )
            algorithm = _algorithm(entry, where, what)
            by_file.setdefault(saved[0], []).append(
                (int(saved[1]), int(saved[2]), algorithm, int(entry[algorithm]), what)
            )
        for file, chunks in sorted(by_file.items()):
            chunks.sort()
            algorithms = sorted({c[2] for c in chunks})
            try:
                with self.opened().opened(file) as f:
                    digests = digests_of_ranges(
                        self.path / file, [(c[0], c[1]) for c in chunks], algorithms, file=f
                    )
            except (OSError, EOFError) as e:
                raise ChecksumError(
                    f"{where}, data file {file} cannot be read, the file is corrupted: {e!r}"
                ) from e
            for (_, _, algorithm, expected, what), got in zip(chunks, digests, strict=True):
                if got[algorithm] != expected:
                    # Never the digest computed: over a few bytes it would reveal them.
                    raise ChecksumError(
                        f"{where}, data file {file}: {what} does not match the checksum "
                        f"({algorithm}) recorded when it was saved: the file is corrupted"
                    )
        return len(wanted)

    def _sidecar(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s checksum file (``{}`` when it is missing), read once, checked to
        belong to the save that wrote ``.metadata``."""
        name = sidecar_name(rank)
        if name not in self._recorded:
            path_inside(self.path, name, f"checkpoint {self.path}")
            files = self.opened()
            payload = _read_sidecar(name, files) if files.size(name) is not None else {}
            if payload:
                self._check_same_save(rank, name, payload)
            self._recorded[name] = payload
        return self._recorded[name]

    def _check_same_save(self, rank: int, name: str, payload: Mapping[str, Any]) -> None:
        """A checksum file records the id of its save; it must be ``.metadata``'s. Files
        written before save ids (none recorded) are accepted only beside a rank 0 checksum
        file without one too: a checkpoint saved wholly before save ids."""
        where = f"checkpoint {self.path}"
        recorded = payload.get("save_id")
        if recorded is None:
            if rank != 0 and self._sidecar(0).get("save_id") is not None:
                raise ChecksumError(
                    f"{where}: checksum file {name} records no save id, but this checkpoint's "
                    "other checksum files do: it was written by another (older) save; files "
                    "of different saves were mixed"
                )
            return
        if recorded != self.save_id:
            raise ChecksumError(
                f"{where}: checksum file {name} belongs to another save (save id "
                f"{recorded!r}, while {METADATA_FILE} was written by save {self.save_id!r}): "
                "files of different saves were mixed"
            )

    def _recorded_items(self, files: set[str]) -> dict[str, dict[str, Any]]:
        """The recorded items of the ranks that wrote ``files`` (DCP names a rank's data
        files ``__<rank>_<n>.distcp``); every rank's when a name does not follow that."""
        matches = [_WRITER.match(f) for f in files]
        if all(matches):
            ranks = sorted({int(m.group(1)) for m in matches if m is not None})
        else:
            ranks = sorted(
                int(m.group(1))
                for name in self.opened().names()
                if (m := _SIDECAR.match(name)) is not None
            )
        items: dict[str, dict[str, Any]] = {}
        for rank in ranks:
            items.update(self._sidecar(rank).get("items", {}))
        return items

    # -------------------------------------------------------------------- load
    def load(
        self,
        state: dict[str, Any],
        *,
        group: dist.ProcessGroup | None,
        partial: bool = False,
        verify: bool = True,
    ) -> None:
        """``dcp.load(state)`` from this checkpoint, in place, running no code from it.

        **Collective** over ``group`` (DCP's planning and barriers; ``None``: one process).
        The ``.metadata`` already read is used (never unpickled again); non-tensor values
        are read with ``torch.load(..., weights_only=True)``. ``partial=True`` allows
        ``state`` to name only some of the checkpoint's entries.

        With ``verify=True`` and checksum files, each rank checks the items of its read plan
        (:meth:`verify_reads`) in DCP's planning step, whose failures DCP gathers to every
        rank before any rank reads: a mismatch anywhere leaves every rank's ``state``
        untouched, with no extra communication.

        A value or tensor whose pickle holds anything but tensors and plain values is
        refused (``weights_only``), naming the checkpoint and the entry.

        Raises:
            ChecksumError: ``verify=True`` and a checksum differs on some rank (every rank
                raises the same message).
            CheckpointError: an entry is not a tensor or plain value (every rank raises the
                same message, naming it), or DCP failed (missing keys, shape mismatches, an
                unreadable value); chains DCP's exception.
        """
        reader = _Reader(self, verify and self.has_checksums)
        try:
            with quiet_single_process():
                dcp.load(
                    state,
                    storage_reader=reader,
                    planner=SafeLoadPlanner(allow_partial_load=partial, checkpoint=self.path),
                    process_group=group,
                    no_dist=group is None,
                )
        except CheckpointException as e:  # a BaseException: make it an ordinary error
            failures = {r: exc for r, (exc, _) in sorted(e.failures.items())}
            if any(isinstance(exc, CheckpointError) for exc in failures.values()):
                # Our own refusals (a checksum, a value that is not plain), which DCP
                # gathered to every rank: the same message everywhere, as agree() would,
                # without DCP's traceback text.
                shown = dict(list(failures.items())[:MESSAGE_RANKS])
                checksums = any(isinstance(exc, ChecksumError) for exc in failures.values())
                what = "verifying the checksums of" if checksums else "loading"
                if len(failures) == 1 and (group is None or dist.get_world_size(group) == 1):
                    raise next(iter(failures.values())) from None
                raise same_error(
                    f"{what} {self.path}",
                    list(failures),
                    {r: describe(exc) for r, exc in shown.items()},
                ) from None
            raise CheckpointError(f"loading {self.path} failed: {e}") from e


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read the ``.metadata`` of the DCP checkpoint directory ``path``, running no code.

    Reads ``.metadata`` once, whole, and unpickles it with only :data:`METADATA_GLOBALS`
    (and torch dtypes) allowed. Local.

    Then, before any other file is opened, every data file it names must be a plain file
    name inside ``path`` (:meth:`Checkpoint.check_paths`) and every tensor's chunks must
    cover its shape exactly once (:meth:`Checkpoint.check_coverage`).

    Raises:
        FileNotFoundError: ``path`` is not a directory, or has no ``.metadata`` (an
            interrupted save, or not a checkpoint).
        CheckpointError: ``.metadata`` refers to any other global (naming it and the
            file; nothing was run, nothing else read), is not DCP metadata, names a data
            file outside ``path``, or leaves part of a tensor uncovered (or covered twice).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint path {path} is not a directory (a DCP checkpoint is)"
            if path.exists()
            else f"no checkpoint at {path}: the directory does not exist"
        )
    file = path_inside(path, METADATA_FILE, f"checkpoint {path}")
    files = CheckpointFiles(path, lambda detail: CheckpointChangedError(f"{path}: {detail}"))
    try:
        if files.size(METADATA_FILE) is None:
            raise FileNotFoundError(
                f"{path} is not a complete DCP checkpoint: it has no {METADATA_FILE} file (the "
                "save did not finish, or this is not a checkpoint directory)"
            )
        data = files.read_bytes(METADATA_FILE)
        metadata = _unpickle_metadata(data, file)
        has_checksums = any(fnmatch.fnmatch(n, SIDECAR_GLOB) for n in files.names())
        checkpoint = Checkpoint(path, metadata, digests(data), has_checksums, files=files)
        files.changed = checkpoint.changed
        checkpoint.check_paths()
        checkpoint.check_coverage()
    except BaseException:
        files.close()
        raise
    return checkpoint


def path_inside(directory: Path, name: object, what: str) -> Path:
    """``directory / name`` for a file name read from a file of the checkpoint (or snapshot
    directory) ``directory``, refused unless it stays inside.

    ``name`` must be a plain name: a non-empty string without a path separator, not ``.``
    or ``..``, not absolute; and if ``directory / name`` is a symbolic link, its target must
    lie inside ``directory`` (resolved). Local; opens nothing (one ``lstat``).

    Args:
        directory: the directory being read.
        name: the name as read (``relative_path`` in ``.metadata``, ``file`` in a checksum
            file, a snapshot folder in a post-hoc manifest).
        what: where the name was read, for the message (``"ckpt/.metadata (entry 'x')"``).

    Raises:
        CheckpointError: naming ``what``, the name and why, before anything is opened.
    """
    separators = {"/", "\\", os.sep, *((os.altsep,) if os.altsep else ())}
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "\0" in name
        or any(sep in name for sep in separators)
        or os.path.isabs(name)
    ):
        raise CheckpointError(
            f"{what} names {name!r}, which is not a plain file name inside {directory} (no "
            "separator, no '..', not absolute): refused before any file was opened"
        )
    target = directory / name
    if target.is_symlink():
        root = directory.resolve()
        resolved = target.resolve()
        if resolved != root and root not in resolved.parents:
            raise CheckpointError(
                f"{what} names {name!r}, a symbolic link that leaves {directory}: refused "
                "before any file was opened"
            )
    return target


def coverage_problem(shape: Sequence[int], chunks: Iterable[tuple[Any, Any]]) -> str | None:
    """What is wrong with the ``(offsets, sizes)`` chunks of a tensor of ``shape``, or
    ``None`` when they cover every element exactly once.

    Problems: a chunk outside the shape; rows (indices of dim 0; the one element of a
    0-dim tensor) that some element of is not covered, or covered more than once. Exact for
    any boxes. The layouts sharding makes (each dim cut into intervals, one chunk per cell
    of their product) are recognized in ``O(chunks log chunks)``; any other layout, and
    every faulty one, is swept dim by dim (each dim-0 slab recurses into the chunks that
    span it), which also finds the rows to name.
    """
    shape = tuple(int(s) for s in shape)
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in chunks:
        box = (tuple(offsets), tuple(sizes))
        if not _fits(box, shape):
            return f"a chunk at offsets {box[0]} of sizes {box[1]} lies outside the shape"
        boxes.append(box)
    boxes = [b for b in boxes if 0 not in b[1]]  # empty chunks cover nothing
    if 0 in shape or _is_grid(shape, boxes):
        return None
    gaps, overlaps = _cover(shape, boxes)
    if not gaps and not overlaps:
        return None
    if not shape:
        return "its one element is " + ("not covered" if gaps else "covered more than once")
    parts = []
    if gaps:
        parts.append(f"{_rows(gaps)} not covered")
    if overlaps:
        parts.append(f"{_rows(overlaps)} covered more than once")
    return " and ".join(parts)


def check_coverage(metadata: Metadata, file: str | Path) -> None:
    """Every tensor of ``metadata`` (read from ``file``) has chunks that cover its shape
    exactly once (:func:`coverage_problem`): a load then writes every element of its
    destination, so no ``torch.empty`` buffer filled from it keeps unwritten rows. Local.

    Raises:
        CheckpointError: naming the file, the tensor, its shape and the rows.
    """
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        problem = coverage_problem(md.size, ((c.offsets, c.sizes) for c in md.chunks))
        if problem is not None:
            raise CheckpointError(
                f"{file}: the saved chunks of tensor {fqn!r} (shape {tuple(md.size)}) do not "
                f"cover it exactly once: {problem}; refused before anything was read"
            )


def _fits(box: tuple[tuple[int, ...], tuple[int, ...]], shape: tuple[int, ...]) -> bool:
    """Non-negative int offsets and sizes, one per dim, inside ``shape``; an empty chunk
    (an uneven shard's) covers nothing, wherever it says it is."""
    offsets, sizes = box
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        return False
    for offset, size in zip(offsets, sizes, strict=True):
        if type(offset) is not int or type(size) is not int or offset < 0 or size < 0:
            return False
    return 0 in sizes or all(o + n <= s for o, n, s in zip(offsets, sizes, shape, strict=True))


def _is_grid(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether the (non-empty) boxes are exactly the cells of a grid over ``shape``: in
    every dim their intervals partition it, and each cell of the product is one box."""
    cells = 1
    for d, size in enumerate(shape):
        position = 0
        intervals = sorted({(o[d], n[d]) for o, n in boxes})
        for offset, length in intervals:
            if offset != position:
                return False
            position += length
        if position != size:
            return False
        cells *= len(intervals)
    return len(boxes) == cells and len(set(boxes)) == cells


def _cover(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(gaps, overlaps)``: the ``[start, stop)`` row ranges with an element covered by no
    box, or by more than one (boxes inside ``shape``)."""
    if not shape:
        return ([(0, 1)] if not boxes else []), ([(0, 1)] if len(boxes) > 1 else [])
    if 0 in shape:
        return [], []
    boxes = sorted((b for b in boxes if 0 not in b[1]), key=lambda b: b[0][0])
    bounds = sorted({0, shape[0], *(o[0] for o, _ in boxes), *(o[0] + n[0] for o, n in boxes)})
    gaps: list[tuple[int, int]] = []
    overlaps: list[tuple[int, int]] = []
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    following = 0
    for lo, hi in itertools.pairwise(bounds):
        active = [b for b in active if b[0][0] + b[1][0] > lo]
        while following < len(boxes) and boxes[following][0][0] <= lo:
            active.append(boxes[following])
            following += 1
        # Every active box spans the whole slab [lo, hi): the slab is covered exactly once
        # when their cross-sections cover the remaining dims exactly once.
        sub_gaps, sub_overlaps = _cover(shape[1:], [(o[1:], n[1:]) for o, n in active])
        for found, ranges in ((sub_gaps, gaps), (sub_overlaps, overlaps)):
            if not found:
                continue
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
    return gaps, overlaps


def _rows(ranges: list[tuple[int, int]], shown: int = 5) -> str:
    """``"rows 8-15 are"``, ``"row 3 is"``, ``"rows 0, 4-5 are"`` (the first ``shown``)."""
    text = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in ranges[:shown])
    if len(ranges) > shown:
        text += f" and {len(ranges) - shown} more ranges"
    one = len(ranges) == 1 and ranges[0][1] == ranges[0][0] + 1
    return f"row {text} is" if one else f"rows {text} are"


def verification(checkpoint: Checkpoint, verify: Verify) -> tuple[bool, str | None]:
    """Whether a load of ``checkpoint`` verifies checksums, and the warning to give.

    ``verify=True``: where the checkpoint has checksum files; where it has none, the load
    goes on unverified and the caller warns once with the returned text
    (:class:`UnverifiedCheckpointWarning`). ``"require"``: refuse a checkpoint without
    checksum files. ``False``: no verification, no warning. Local.

    Returns:
        ``(verify, warning)``: ``warning`` is ``None`` unless there is nothing to verify.

    Raises:
        ValueError: ``verify`` is not ``True``, ``False`` or ``"require"``.
        ChecksumError: ``"require"`` and the checkpoint has no checksum files.
    """
    if not (verify is True or verify is False or verify == "require"):
        raise ValueError(f"verify must be True, False or 'require', got {verify!r}")
    if verify is False:
        return False, None
    if checkpoint.has_checksums:
        return True, None
    why = (
        f"checkpoint {checkpoint.path} has no checksum files ({SIDECAR_GLOB}: written by "
        "plain dcp.save, or save_checkpoint(checksums=False))"
    )
    if verify == "require":
        raise ChecksumError(f"{why}: nothing can be verified, and verify='require' refuses it")
    return False, (
        f"{why}: it was loaded, but nothing was verified; pass verify=False to load it without "
        "this warning, or verify='require' to refuse it"
    )


def existing_checkpoint(path: Path) -> Path:
    """``path``, or, when it is missing, its ``<path>.previous`` left by a
    :func:`~dtensor_ema.save_checkpoint` interrupted while it swapped directories (with a
    warning).

    Raises:
        FileNotFoundError: neither exists, or ``path`` is not a directory.
    """
    if path.is_dir():
        return path
    previous = path.with_name(path.name + PREVIOUS_SUFFIX)
    if not path.exists() and (previous / METADATA_FILE).is_file():
        warnings.warn(
            f"no checkpoint at {path}, loading {previous}: a save_checkpoint() was "
            "interrupted while it swapped directories; the next save_checkpoint() puts it back",
            stacklevel=4,
        )
        return previous
    if path.exists():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory (a DCP checkpoint is)")
    raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist")


def _refused_entry(checkpoint: Path | None, fqn: str) -> CheckpointError:
    where = f"checkpoint {checkpoint}: " if checkpoint is not None else ""
    return CheckpointError(
        f"{where}entry {fqn!r} is not a tensor or plain value: its pickle refers to other "
        "objects; refused (nothing in it was run)"
    )


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are unpickled with
    ``torch.load(..., weights_only=True)`` (DCP's default: ``weights_only=False``); one
    that holds anything else raises :class:`CheckpointError` naming the checkpoint
    (``checkpoint``) and the entry."""

    def __init__(self, *args: Any, checkpoint: Path | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:  # torch's weights_only refusal
            raise _refused_entry(self.checkpoint, read_item.storage_index.fqn) from None
        if self.flatten_state_dict:
            # DCP's own helper for writing a value back into the nested state dict; public
            # planners have used it since DCP's flattening appeared (torch 2.1).
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _Reader(FileSystemReader):
    """``FileSystemReader`` that hands DCP the metadata :func:`open_checkpoint` read safely
    instead of unpickling ``.metadata`` itself (with ``pickle.load``), and, with ``verify``,
    checks the checksums of the items this rank will read while DCP plans the load."""

    def __init__(self, checkpoint: Checkpoint, verify: bool) -> None:
        super().__init__(checkpoint.path)
        self.fs = _HeldFileSystem(checkpoint.opened())  # read what was verified
        self._checkpoint = checkpoint
        self._verify = verify
        self._verified: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._checkpoint.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # DCP's planning step: every rank runs it before any rank reads, and DCP gathers
        # its failures to every rank. Our planner's global plan changes nothing, so these
        # are exactly the items read_data will read.
        if self._verify:
            indices = [item.storage_index for item in plan.items]
            self._checkpoint.verify_reads(indices)
            self._verified = {item_key(index) for index in indices}
        return super().prepare_local_plan(plan)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._verify:
            unverified = {item_key(item.storage_index) for item in plan.items} - self._verified
            if unverified:  # a planner that changes plans globally: not ours
                raise CheckpointError(
                    f"the read plan changed after its checksums were verified: {unverified}"
                )
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError:  # DCP's torch.load(weights_only=True) of a tensor
            raise _refused_entry(self._checkpoint.path, self._refused_tensor(plan)) from None

    def _refused_tensor(self, plan: LoadPlan) -> str:
        """The first tensor of ``plan`` whose pickle ``weights_only`` refuses (DCP's error
        does not say which): each is read again, on this failure path only."""
        storage = self._checkpoint.metadata.storage_data or {}
        for item in plan.items:
            info = storage.get(item.storage_index)
            if item.type == LoadItemType.BYTE_IO or info is None:
                continue
            with self._checkpoint.opened().opened(info.relative_path) as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            try:
                torch.load(data, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                return str(item.storage_index.fqn)
            except Exception:  # another failure: not the refused one
                continue
        return "(a tensor)"


class _HeldFileSystem(FileSystem):
    """DCP's ``FileSystem``, but files of the checkpoint directory are read through
    :class:`~dtensor_ema.checkpoint_files.CheckpointFiles`: the files the checksum pass
    verified, never whatever the path names by the time DCP reads."""

    def __init__(self, files: CheckpointFiles) -> None:
        super().__init__()
        self.files = files

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        path = Path(path)
        if mode != "rb" or path.parent != self.files.path:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self.files.opened(path.name) as f:
            yield f


def _save_id_at(path: Path) -> str | None:
    """The save id of the ``.metadata`` at ``path`` now (read safely), ``None`` where there
    is none or it cannot be read: for the message of :class:`CheckpointChangedError`."""
    try:
        metadata = _unpickle_metadata((path / METADATA_FILE).read_bytes(), path / METADATA_FILE)
    except Exception:
        return None
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return save_id if isinstance(save_id, str) else None


_WRITER = re.compile(r"^__(\d+)_")
_SIDECAR = re.compile(r"^__(\d+)\.checksums\.json$")


def _read_sidecar(name: str, files: CheckpointFiles) -> dict[str, Any]:
    """One rank's checksum file, checked to be of this format and version."""
    directory = files.path
    where = f"checkpoint {directory}"
    file = directory / name
    try:
        payload = json.loads(files.read_bytes(name))
    except (OSError, ValueError) as e:  # the type only: a decoding error quotes bytes
        raise ChecksumError(
            f"{where}: checksum file {file.name} is unreadable ({type(e).__name__})"
        ) from None
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        raise ChecksumError(f"{where}: {file.name} is not a {FORMAT} file")
    if payload.get("version") != VERSION:
        raise ChecksumError(
            f"{where}: checksum file {file.name} has version {payload.get('version')!r}, this "
            f"dtensor_ema reads version {VERSION} (an earlier dtensor_ema wrote it): load with "
            "verify=False"
        )
    items = payload.get("items")
    fields = ("file", "offset", "length")
    if not isinstance(items, dict) or not all(
        isinstance(e, dict) and all(f in e for f in fields) for e in items.values()
    ):
        raise ChecksumError(f"{where}: checksum file {file.name} is malformed")
    checked: set[str] = set()
    for entry in items.values():  # before any data file is opened
        name = entry["file"]
        if not (isinstance(name, str) and name in checked):
            path_inside(directory, name, f"{where}: checksum file {file.name}")
            checked.add(name)
    if not isinstance(payload.get("save_id", ""), str):
        raise ChecksumError(f"{where}: checksum file {file.name} is malformed (save_id)")
    return payload


def _algorithm(recorded: Mapping[str, Any], where: str, what: str) -> str:
    """The fastest digest algorithm both recorded for ``what`` and available here."""
    algorithm = available(recorded)
    if algorithm is None:
        raise ChecksumError(
            f"{where}: the digests recorded for {what} "
            f"({sorted(set(recorded) - {'file', 'offset', 'length'})}) cannot be computed "
            "here: install the package that computes them (xxhash), or load with verify=False"
        )
    return algorithm
