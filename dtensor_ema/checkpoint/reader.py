"""Reading DCP checkpoints and post-hoc snapshots: no code run, memory and time bounded by
the files' real sizes, one clear error for every bad input.

Every reader of the package opens checkpoints here: :func:`~dtensor_ema.load_checkpoint`,
:func:`~dtensor_ema.convert_checkpoint`, :func:`~dtensor_ema.synthesize`,
:func:`~dtensor_ema.merge_snapshots` (and ``python -m dtensor_ema.posthoc``), and the
Lightning drop-in's and callback's loads of sharded checkpoints.

* :func:`open_checkpoint` reads ``.metadata`` (refused when larger than the data files it
  could describe, or when its memo indices exceed its size:
  :mod:`dtensor_ema.checkpoint.pickle_scan`) with a restricted unpickler that builds only
  :data:`METADATA_GLOBALS` and torch dtypes, before anything else of the checkpoint is read
  (why: ``docs/guarantees.md``, "Reading a checkpoint runs no code from it").
* Then, before any data file is opened, every field of the metadata is checked
  (:func:`~dtensor_ema.checkpoint.metadata_check.check_metadata`: types, at most 64 dims, no
  compression transforms, every chunk's storage item at least as long as its elements
  take, ``planner_data`` naming each entry by its own key), every file name it gives is a
  plain name inside the directory (:func:`path_inside`), every data file exists and holds
  its items without overlap (:meth:`Checkpoint.check_files`), and every tensor's chunks
  cover it exactly once (:func:`check_coverage`, ``n log n``). So what a reader allocates
  from a checkpoint is bounded by the bytes of its files, never by what they claim.
* :meth:`Checkpoint.load` is ``dcp.load`` with that metadata and a reader of our own: each
  item is read from its byte range, only if its ``torch.save`` archive stores its records
  uncompressed within that range; tensors and values with ``torch.load(...,
  weights_only=True)``; a tensor must have the dtype and the sizes ``.metadata`` gives its
  chunk (a retyped entry is refused, not cast). A failure names the data file, the entry
  and what is wrong ("is corrupted", "is not a tensor or plain value").
* :meth:`Checkpoint.verify_metadata`, :meth:`Checkpoint.verify_reads`: the digests recorded
  by :func:`~dtensor_ema.save_checkpoint` (:mod:`dtensor_ema.checkpoint.checksums`) of ``.metadata``
  and of every saved item a load reads, checked inside :meth:`Checkpoint.load` on each
  rank's read plan, in one pass over those byte ranges (memory-mapped), before any rank
  reads them. Every checksum file must record the save id of the save that wrote
  ``.metadata`` (:attr:`Checkpoint.save_id`): files of two saves never load together. A
  mismatch names the file and the entry, never a digest of the bytes read. Checksum files
  are JSON read within bounds (:mod:`dtensor_ema.checkpoint.bounded_json`).
* Every file is read from the directory :func:`open_checkpoint` opened, as first seen
  (:class:`~dtensor_ema.checkpoint.files.CheckpointFiles`, :meth:`Checkpoint.opened`): the
  checks, the checksum pass and the item reads see the same bytes, whatever another save
  commits to the path meanwhile; a file that changed is reported as changed
  (:class:`CheckpointChangedError`), never as corrupted.
* :func:`verification`: ``verify=True`` on a checkpoint without checksum files warns
  (:class:`UnverifiedCheckpointWarning`); ``verify="require"`` refuses it.
* :meth:`Checkpoint.entries_under`, :meth:`Checkpoint.top_level_keys`: what the checkpoint
  holds under a key, from the metadata alone.

Nothing here communicates except :meth:`Checkpoint.load` (DCP's collectives).
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dtensor_ema._collectives import MESSAGE_RANKS, describe, quiet_single_process, same_error
from dtensor_ema.checkpoint.bounded_json import JsonProblem, read_at_most, read_json
from dtensor_ema.checkpoint.checksums import (
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
from dtensor_ema.checkpoint.coverage import coverage_problem
from dtensor_ema.checkpoint.files import CheckpointFiles, Files, Url
from dtensor_ema.checkpoint.metadata_check import Facts, MetadataProblem, check_metadata
from dtensor_ema.checkpoint.pickle_scan import memo_problem

__all__ = [
    "METADATA_GLOBALS",
    "Checkpoint",
    "CheckpointChangedError",
    "CheckpointError",
    "ChecksumError",
    "SafeLoadPlanner",
    "UnverifiedCheckpointWarning",
    "Verify",
    "check_coverage",
    "coverage_problem",
    "one_line",
    "open_checkpoint",
    "path_inside",
    "verification",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded: DCP failed (chains its
    ``CheckpointException``, a ``BaseException`` that escapes ``except Exception``), its
    ``.metadata`` holds something other than DCP's metadata (nothing from it was run), or
    its bytes differ from those saved. The message starts with the file (or checkpoint
    directory) and says what is wrong."""


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


METADATA_FLOOR_BYTES = 4 << 20
"""A ``.metadata`` may be as large as the other files of its directory together, or this
(what DCP writes takes about a seventh of the data it describes)."""
_ARCHIVE_RECORDS = 4096
"""Most records a ``torch.save`` archive of one item may have (one per storage, a few more)."""

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
        # As the pickle spells it, but on one line: a name can hold any character.
        self.name = "".join(
            c if c.isprintable() else repr(c)[1:-1] for c in f"{module[:80]}.{name[:80]}"
        )


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only :func:`_allowed` globals. Every way a pickle
    reaches a callable (``GLOBAL``, ``STACK_GLOBAL``, the ``EXT`` codes) goes through
    ``find_class``; persistent ids are refused by ``pickle`` itself."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise _Refused(module, name)
        return super().find_class(module, name)


class _Unreadable(Exception):
    """``.metadata`` could not be unpickled (the exception's type: its message may quote
    the bytes it could not read)."""


def _unpickle_metadata(data: bytes, file: Path | Url) -> object:
    problem = memo_problem(data)  # before the C unpickler sizes its memo by it
    if problem is not None:
        raise MetadataProblem(f"its pickle names {problem}, not a pickle DCP writes")
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise CheckpointError(
            f"{file}: refers to the global {e.name}, which is not part of DCP's checkpoint "
            "metadata: refused (this .metadata was not written by DCP; nothing in it was run "
            "and nothing else of the checkpoint was read)"
        ) from None
    except (Exception, RecursionError) as e:
        raise _Unreadable(type(e).__name__) from None


@dataclass(slots=True)
class Checkpoint:
    """One DCP checkpoint directory (or save in an object store) whose ``.metadata`` was read
    safely and checked (:func:`open_checkpoint`)."""

    path: Path | Url
    metadata: Metadata
    metadata_digests: dict[str, int]
    """Digests of the ``.metadata`` bytes that were read, by algorithm
    (:meth:`verify_metadata`)."""
    has_checksums: bool
    """Whether the directory has checksum files (``__<rank>.checksums.json``)."""
    facts: Facts = field(default_factory=Facts)
    """The chunk each storage item holds and the items of each data file (from the checked
    metadata)."""
    sidecar_bytes: int = 1 << 20
    """The most bytes a checksum file of this checkpoint may have (from its items)."""
    _recorded: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Checksum files read so far, by name."""
    files: Files | None = None
    """The directory as :func:`open_checkpoint` opened it: every file is read from it, as
    first seen (:mod:`dtensor_ema.checkpoint.files`)."""

    @property
    def metadata_file(self) -> Path | Url:
        return self.path / METADATA_FILE

    def opened(self) -> Files:
        """:attr:`files` (opened now if this checkpoint was built without)."""
        if self.files is None:
            self.files = CheckpointFiles(Path(self.path), self.changed)
        return self.files

    def close(self) -> None:
        """Close the files held open (idempotent; garbage collection closes them too)."""
        if self.files is not None:
            self.files.close()

    def changed(self, detail: str) -> CheckpointChangedError:
        """The error for a file that changed since this load began (``detail``: which,
        how), naming this load's save and, where its ``.metadata`` reads within bounds, the
        one now at the path (:func:`_save_id_at`)."""
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
        for relative, items in self.facts.items.items():
            path_inside(self.path, relative, f"{self.metadata_file} (entry {items[0][2]!r})")

    def check_coverage(self) -> None:
        """:func:`check_coverage` of this checkpoint's metadata. Local; opens no file."""
        check_coverage(self.metadata, self.metadata_file)

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
            str(planner_data[k][0]) if planner_data.get(k) else k.split(".", 1)[0]
            for k in self.metadata.state_dict_metadata
        }

    def check_files(self) -> None:
        """Every data file the metadata names exists, is long enough, and holds its items
        in byte ranges that do not overlap (DCP writes each item once). Local; opens no
        file (one ``stat`` per data file, in the directory that was opened: each file is
        recorded as first seen). :func:`open_checkpoint` calls it.

        Raises:
            FileNotFoundError: naming the missing or truncated files.
            CheckpointError: two items of a data file share bytes (naming them).
        """
        missing: list[str] = []
        short: list[str] = []
        files = self.opened()
        for relative, items in sorted(self.facts.items.items()):
            size = files.size(relative)
            if size is None:
                missing.append(relative)
                continue
            items.sort()
            end = max(offset + length for offset, length, _ in items)
            if size < end:
                short.append(f"{relative} ({size} bytes, needs {end})")
            previous = (0, 0, "")
            for item in items:
                if item[0] < previous[0] + previous[1] and item[1]:
                    raise CheckpointError(
                        f"{self.metadata_file}: entries {previous[2]!r} and {item[2]!r} share "
                        f"bytes of {relative}: every item has its own (refused: one file's "
                        "bytes cannot stand for two tensors)"
                    )
                if item[1]:
                    previous = item
        if missing:
            raise FileNotFoundError(
                f"checkpoint {self.path} is incomplete: data files {missing[:5]} named by its "
                ".metadata are missing"
            )
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
        recorded = self._sidecar(0).get("metadata")
        if not isinstance(recorded, dict):
            raise ChecksumError(
                f"{self.metadata_file}: no checksum was recorded for it (rank 0's checksum "
                "file is missing)"
            )
        algorithm = _algorithm(recorded, self.metadata_file, METADATA_FILE)
        if self.metadata_digests[algorithm] != recorded[algorithm]:
            raise ChecksumError(
                f"{self.metadata_file}: does not match the checksum ({algorithm}) recorded "
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
                checksum file is unreadable or malformed, or one belongs to another save
                (another save id than ``.metadata``'s, or none); names the file and the
                tensor or value, never a digest computed over the bytes read.
        """
        if not self.verify_metadata():
            return 0
        storage = self.metadata.storage_data
        wanted = {item_key(index): index for index in indices}
        places = {key: storage[index] for key, index in wanted.items()}
        items = self._recorded_items({info.relative_path for info in places.values()})
        by_file: dict[str, list[tuple[int, int, str, int, str]]] = {}
        for key, index in wanted.items():
            offsets = () if index.offset is None else tuple(index.offset)
            what = f"{index.fqn!r} (chunk at offsets {offsets})"
            entry = items.get(key)
            if entry is None:
                raise ChecksumError(
                    f"{self.metadata_file}: no checksum was recorded for {what}; a checksum "
                    "file is missing"
                )
            saved = (entry["file"], entry["offset"], entry["length"])
            info = places[key]
            place = (info.relative_path, info.offset, info.length)
            if place != saved:
                raise ChecksumError(
                    f"{self.metadata_file}: places {what} at {place} but it was saved to "
                    f"{saved}: the checkpoint's files do not belong together"
                )
            algorithm = _algorithm(entry, self.metadata_file, what)
            by_file.setdefault(saved[0], []).append(
                (saved[1], saved[2], algorithm, entry[algorithm], what)
            )
        for file, chunks in sorted(by_file.items()):
            chunks.sort()
            algorithms = sorted({c[2] for c in chunks})
            try:
                with self.opened().opened(file) as f:  # the bytes the load will read
                    found = digests_of_ranges(
                        self.path / file, [(c[0], c[1]) for c in chunks], algorithms, file=f
                    )
            except (OSError, EOFError) as e:
                raise ChecksumError(
                    f"{self.path / file}: cannot be read, the file is corrupted: {type(e).__name__}"
                ) from e
            for (_, _, algorithm, expected, what), got in zip(chunks, found, strict=True):
                if got[algorithm] != expected:
                    # Never the digest computed: over a few bytes it would reveal them.
                    raise ChecksumError(
                        f"{self.path / file}: {what} does not match the checksum "
                        f"({algorithm}) recorded when it was saved: the file is corrupted"
                    )
        return len(wanted)

    def _sidecar(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s checksum file (``{}`` when it is missing), read once, checked to
        belong to the save that wrote ``.metadata``."""
        name = sidecar_name(rank)
        if name not in self._recorded:
            file = path_inside(self.path, name, f"checkpoint {self.path}")
            files = self.opened()
            payload = (
                _read_sidecar(name, files, self.sidecar_bytes)
                if files.size(name) is not None
                else {}
            )
            if payload:
                self._check_same_save(file, payload)
            self._recorded[name] = payload
        return self._recorded[name]

    def _check_same_save(self, file: Path | Url, payload: Mapping[str, Any]) -> None:
        """A checksum file records the id of its save; it must be ``.metadata``'s."""
        if self.save_id is None:
            raise ChecksumError(
                f"{self.metadata_file}: records no save id, but the checkpoint has checksum "
                "files: it was not written by the save that wrote them (files of different "
                "saves were mixed)"
            )
        if payload["save_id"] != self.save_id:
            raise ChecksumError(
                f"{file}: belongs to another save (save id {payload['save_id']!r}, while "
                f"{METADATA_FILE} was written by save {self.save_id!r}): files of different "
                "saves were mixed"
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
        The ``.metadata`` already read is used (never unpickled again); every item is read
        by :class:`_Reader`: its ``torch.save`` archive must store its records uncompressed
        inside its byte range, tensors must have the dtype and sizes ``.metadata`` gives
        their chunk, and tensors and values are unpickled with ``torch.load(...,
        weights_only=True)``. ``partial=True`` allows ``state`` to name only some of the
        checkpoint's entries.

        With ``verify=True`` and checksum files, each rank checks the items of its read plan
        (:meth:`verify_reads`) in DCP's planning step, whose failures DCP gathers to every
        rank before any rank reads: a mismatch anywhere leaves every rank's ``state``
        untouched, with no extra communication.

        Raises:
            ChecksumError: ``verify=True`` and a checksum differs on some rank (every rank
                raises the same message).
            CheckpointError: an entry is not a tensor or plain value, is corrupted or
                retyped (every rank raises the same message, naming the data file and the
                entry), or DCP failed (missing keys, shape mismatches): one line naming
                the checkpoint, the rank and what DCP raised.
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
            ours = any(isinstance(exc, CheckpointError) for exc in failures.values())
            if len(failures) == 1 and (group is None or dist.get_world_size(group) == 1):
                (exc,) = failures.values()
                if isinstance(exc, CheckpointError):
                    raise exc from None
                raise CheckpointError(f"{self.path}: loading failed: {one_line(exc)}") from None
            # DCP gathered every rank's failure to every rank: the same message everywhere,
            # as agree() would, without DCP's traceback text.
            shown = dict(list(failures.items())[:MESSAGE_RANKS])
            checksums = any(isinstance(exc, ChecksumError) for exc in failures.values())
            what = "verifying the checksums of" if checksums else "loading"
            error = same_error(
                f"{what} {self.path}",
                list(failures),
                {r: (describe(exc)[0], one_line(exc, typed=False)) for r, exc in shown.items()},
            )
            if not ours:
                error = CheckpointError(str(error))
            raise error from None


def one_line(error: BaseException, *, typed: bool = True) -> str:
    """``"Type: first line of the message"`` (at most 300 characters)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(error).__name__}: {text}" if typed else text


def open_checkpoint(path: str | Path | Files) -> Checkpoint:
    """Read and check the ``.metadata`` of the DCP checkpoint directory ``path`` (or of the
    save in an object store that ``path``, its :class:`~dtensor_ema.checkpoint.files.Files`,
    lists), running no code. Local.

    ``.metadata`` may be as large as the directory's other files together (or
    :data:`METADATA_FLOOR_BYTES`): what DCP writes is a fraction of the data it describes.
    It is read once, whole, and unpickled with only :data:`METADATA_GLOBALS` (and torch
    dtypes) allowed. Then, before any other file is opened, every field is checked
    (:func:`~dtensor_ema.checkpoint.metadata_check.check_metadata`), every data file it names must
    be
    a plain file name inside ``path`` (:meth:`Checkpoint.check_paths`), exist and hold its
    items (:meth:`Checkpoint.check_files`), and every tensor's chunks must cover its shape
    exactly once (:meth:`Checkpoint.check_coverage`).

    A ``.metadata`` that cannot be unpickled or checked, and whose bytes differ from the
    digest rank 0's checksum file recorded, is reported as corrupted
    (:class:`ChecksumError`).

    Raises:
        FileNotFoundError: ``path`` is not a directory, has no ``.metadata`` (an interrupted
            save, or not a checkpoint), or misses (parts of) data files.
        CheckpointError: ``.metadata`` refers to any other global (naming it and the
            file; nothing was run, nothing else read), is larger than its data, not DCP
            metadata or not what DCP writes (naming the entry and what is wrong), names a
            data file outside ``path``, places two items on the same bytes, or leaves part
            of a tensor uncovered (or covered twice).
        ChecksumError: ``.metadata`` is corrupted (its digest differs from the recorded one).
    """
    if isinstance(path, str | os.PathLike):
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint path {path} is not a directory (a DCP checkpoint is)"
                if path.exists()
                else f"no checkpoint at {path}: the directory does not exist"
            )
        folder = path
        files: Files = CheckpointFiles(path, lambda d: CheckpointChangedError(f"{folder}: {d}"))
    else:
        files, path = path, path.path
    file = path_inside(path, METADATA_FILE, f"checkpoint {path}")
    try:
        if files.size(METADATA_FILE) is None:
            raise FileNotFoundError(
                f"{path} is not a complete DCP checkpoint: it has no {METADATA_FILE} file (the "
                "save did not finish, or this is not a checkpoint directory)"
            )
        names = files.names()
        limit = _metadata_limit(files.size(n) for n in names if n != METADATA_FILE)
        with files.read_once(METADATA_FILE) as f:
            data = read_at_most(f, limit)
        if data is None:
            raise CheckpointError(
                f"{file}: larger than the {limit} bytes of the checkpoint's other files "
                "together: not what DCP writes (its metadata is a fraction of the data it "
                "describes); refused before it was read"
            )
        try:
            metadata = _unpickle_metadata(data, file)
            facts = check_metadata(metadata)
        except (_Unreadable, MetadataProblem) as e:
            corrupted = _metadata_corruption(files, data)
            if corrupted is not None:
                raise corrupted from None
            if isinstance(e, _Unreadable):
                raise CheckpointError(
                    f"{file}: not a readable DCP .metadata file ({e}: truncated, corrupted, or "
                    "not written by DCP)"
                ) from None
            raise CheckpointError(f"{file}: {e}; refused before anything else was read") from None
        assert isinstance(metadata, Metadata)
        has_checksums = any(fnmatch.fnmatch(n, SIDECAR_GLOB) for n in names)
        checkpoint = Checkpoint(
            path, metadata, digests(data), has_checksums, facts, _sidecar_bytes(metadata)
        )
        checkpoint.files = files
        files.changed = checkpoint.changed
        if files.save_id is not None and checkpoint.save_id != files.save_id:
            raise ChecksumError(
                f"{file}: written by save {checkpoint.save_id!r}, but {path} holds save "
                f"{files.save_id!r}: refused (files of two saves)"
            )
        checkpoint.check_paths()
        checkpoint.check_files()
        checkpoint.check_coverage()
    except BaseException:
        files.close()
        raise
    return checkpoint


def _metadata_limit(sizes: Iterable[int | None]) -> int:
    """The most bytes a ``.metadata`` may have: the other files of its directory together
    (``sizes``; ``None``: not a plain file), or :data:`METADATA_FLOOR_BYTES`."""
    return max(METADATA_FLOOR_BYTES, sum(size or 0 for size in sizes))


def _other_files_sizes(path: Path) -> Iterator[int | None]:
    """The sizes of the regular files of ``path`` besides ``.metadata``, by path."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name != METADATA_FILE and entry.is_file():
                try:
                    yield entry.stat().st_size
                except OSError:
                    continue


def _sidecar_bytes(metadata: Metadata) -> int:
    """The most bytes a checksum file of ``metadata``'s checkpoint may take: about 150 per
    item and its name, with room to spare."""
    return (64 << 10) + sum(
        2 * len(index.fqn) + 32 * len(index.offset or ()) + 512 for index in metadata.storage_data
    )


def _metadata_corruption(files: Files, data: bytes) -> ChecksumError | None:
    """:class:`ChecksumError` when rank 0's checksum file records a digest of ``.metadata``
    that ``data`` does not match (a corrupted file explains the failure better than what
    it happens to hold); ``None`` when nothing can be said."""
    path = files.path
    try:
        if files.size(sidecar_name(0)) is None:
            return None
        payload = _read_sidecar(sidecar_name(0), files, (64 << 10) + 64 * len(data))
    except CheckpointChangedError:
        raise
    except (OSError, CheckpointError):
        return None
    recorded = payload.get("metadata")
    if not isinstance(recorded, dict):
        return None
    algorithm = available(recorded)
    if algorithm is None or digests(data)[algorithm] == recorded[algorithm]:
        return None
    return ChecksumError(
        f"{path / METADATA_FILE}: does not match the checksum ({algorithm}) recorded when it "
        "was saved: the file is corrupted or was replaced"
    )


def _save_id_at(path: Path | Url) -> str | None:
    """The save id of the ``.metadata`` at ``path`` now, ``None`` where there is none or it
    cannot be read (or ``path`` is in an object store): for the message of
    :class:`CheckpointChangedError`. Read by path (the save now there, not the one this load
    opened), within the bounds :func:`open_checkpoint` sets and with the same restricted
    unpickler."""
    if not isinstance(path, Path):
        return None
    try:
        data = read_at_most(path / METADATA_FILE, _metadata_limit(_other_files_sizes(path)))
        metadata = None if data is None else _unpickle_metadata(data, path / METADATA_FILE)
    except Exception:
        return None
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return save_id if isinstance(save_id, str) else None


def path_inside(directory: Path | Url, name: object, what: str) -> Path | Url:
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
        or len(name) > 255
        or any(sep in name for sep in separators)
        or os.path.isabs(name)
    ):
        shown = name[:120] + "..." if isinstance(name, str) and len(name) > 120 else name
        raise CheckpointError(
            f"{what} names {shown!r}, which is not a plain file name inside {directory} (no "
            "separator, no '..', not absolute): refused before any file was opened"
        )
    target = directory / name
    if isinstance(directory, Path) and isinstance(target, Path) and target.is_symlink():
        root = directory.resolve()
        resolved = target.resolve()
        if resolved != root and root not in resolved.parents:
            raise CheckpointError(
                f"{what} names {name!r}, a symbolic link that leaves {directory}: refused "
                "before any file was opened"
            )
    return target


def check_coverage(metadata: Metadata, file: str | Path) -> None:
    """Every tensor of ``metadata`` (read from ``file``) has chunks that cover its shape
    exactly once (:func:`~dtensor_ema.checkpoint.coverage.coverage_problem`, ``n log n`` in the
    chunks): a load then writes every element of its destination, so no ``torch.empty``
    buffer filled from it keeps unwritten rows. Local.

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


# ---------------------------------------------------------------------------- items
def _refused_entry(where: str) -> CheckpointError:
    return CheckpointError(
        f"{where} is not a tensor or plain value: its pickle refers to other objects; refused "
        "(nothing in it was run)"
    )


_GLOBAL = re.compile(r"GLOBAL ([\w.]{1,200})")


def _refers_to_other_objects(error: pickle.UnpicklingError) -> bool:
    """Whether ``weights_only`` refused a global that exists (a pickle that means to build
    another object), rather than one a corrupted byte misspelled."""
    found = _GLOBAL.search(str(error))
    if found is None:
        return False
    module, _, name = found.group(1).rpartition(".")
    loaded = sys.modules.get(module)
    return loaded is not None and hasattr(loaded, name)


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file of its own."""

    def __init__(self, file: IO[bytes], start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._position = file, start, length, 0

    @property
    def length(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._length - self._position)
        size = left if size is None or size < 0 else min(size, left)
        self._file.seek(self._start + self._position)
        data = self._file.read(size)
        self._position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _load_item(stream: _Slice, where: str, *, checked: bool = False) -> object:
    """The object ``torch.save`` stored in ``stream`` (one item's bytes), read with
    ``weights_only``, once its archive is known to store every record uncompressed inside
    the item (:func:`_check_archive`, here unless ``checked``)."""
    if not checked:
        _check_archive(stream, stream.length, where)
    stream.seek(0)
    try:
        return torch.load(cast(IO[bytes], stream), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if _refers_to_other_objects(e):
            raise _refused_entry(where) from None
        raise CheckpointError(f"{where} is corrupted: its pickle cannot be read") from None
    except MemoryError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where} is corrupted: {one_line(e)}") from None


def _check_archive(stream: _Slice, length: int, where: str) -> None:
    """The item in ``stream`` is a zip archive (what ``torch.save`` writes) whose records
    are all stored uncompressed inside it: ``torch.load`` inflates a compressed record to
    the size it claims, so 600 KB could take 600 MB. Reads the central directory only.

    Raises:
        CheckpointError: not an archive (corrupted), too many records, a compressed
            record, or one outside the item.
    """
    try:
        with zipfile.ZipFile(stream) as archive:  # reads the central directory only
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        raise CheckpointError(
            f"{where} is corrupted: not a torch.save archive ({type(e).__name__})"
        ) from None
    if len(records) > _ARCHIVE_RECORDS:
        raise CheckpointError(f"{where} is corrupted: its archive has {len(records)} records")
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.file_size != record.compress_size:
            raise CheckpointError(
                f"{where}: its archive holds a compressed record: refused (torch.save stores "
                "them uncompressed, and a compressed one can inflate far beyond the file)"
            )
        if record.header_offset + record.compress_size > length:
            raise CheckpointError(f"{where} is corrupted: a record of its archive lies outside it")


def _where(file: Path | Url, index: MetadataIndex) -> str:
    chunk = "" if index.offset is None else f" (chunk at offsets {tuple(index.offset)})"
    return f"{file}: entry {index.fqn!r}{chunk}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are unpickled with
    ``torch.load(..., weights_only=True)`` (DCP's default: ``weights_only=False``), after
    their archive is checked; one that holds anything else raises :class:`CheckpointError`
    naming the checkpoint (``checkpoint``) and the entry."""

    def __init__(self, *args: Any, checkpoint: Path | Url | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        where = f"checkpoint {self.checkpoint}: entry {read_item.storage_index.fqn!r}"
        with _Slice(value, 0, len(data)) as stream:
            self.load_value(read_item, _load_item(stream, where))

    def load_value(self, read_item: ReadItem, loaded: object) -> None:
        """Put a value already read into the state dict being loaded."""
        if self.flatten_state_dict:
            # DCP's own helper for writing a value back into the nested state dict; public
            # planners have used it since DCP's flattening appeared (torch 2.1).
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _Reader(FileSystemReader):
    """``FileSystemReader`` that hands DCP the metadata :func:`open_checkpoint` read safely
    instead of unpickling ``.metadata`` itself (with ``pickle.load``); with ``verify``,
    checks the checksums of the items this rank will read while DCP plans the load; and
    reads every item itself (:meth:`read_data`), each checked before it is copied."""

    def __init__(self, checkpoint: Checkpoint, verify: bool) -> None:
        super().__init__(checkpoint.path)
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
        indices = [item.storage_index for item in plan.items]
        if self._verify:
            self._checkpoint.verify_reads(indices)
            self._verified = {item_key(index) for index in indices}
        self._check_archives(indices)
        return super().prepare_local_plan(plan)

    def _check_archives(self, indices: list[MetadataIndex]) -> None:
        """Every item to read is a ``torch.save`` archive that stores its records
        uncompressed inside the item (:func:`_check_archive`; its central directory only,
        a few hundred bytes each), before any item is read."""
        checkpoint = self._checkpoint
        storage = checkpoint.metadata.storage_data
        by_file: dict[str, list[MetadataIndex]] = {}
        for index in indices:
            by_file.setdefault(storage[index].relative_path, []).append(index)
        for relative, found in sorted(by_file.items()):
            file = checkpoint.path / relative
            with checkpoint.opened().opened(relative) as f:  # the file verified
                for index in sorted(found, key=lambda i: storage[i].offset):
                    info = storage[index]
                    with _Slice(f, info.offset, info.length) as stream:
                        stream.seek(-min(info.length, 1 << 16), os.SEEK_END)
                        stream.read()  # the tail, in one request from a store (read ahead)
                        _check_archive(stream, info.length, _where(file, index))

    def _item_stream(self, file: IO[bytes], info: Any) -> _Slice:
        """The bytes of one item to read (``info``: its ``_StorageInfo``) in the held data
        ``file``: where :meth:`read_data` reads from the storage (as DCP's
        ``_slice_file``); from a store, read in one request (one item more in memory)."""
        try:
            file.fileno()
        except OSError:  # an object: torch.load's small reads would each be a request
            file.seek(info.offset)
            return _Slice(io.BytesIO(file.read(info.length)), 0, info.length)
        return _Slice(file, info.offset, info.length)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``, one data file at a time, in file order (their
        archives were checked while DCP planned: :meth:`_check_archives`), each tensor
        checked to have the dtype and sizes ``.metadata`` gives its chunk, then narrowed to
        the part requested and copied into its destination. Peak extra memory: one item."""
        if self._verify:
            unverified = {item_key(item.storage_index) for item in plan.items} - self._verified
            if unverified:  # a planner that changes plans globally: not ours
                raise CheckpointError(
                    f"the read plan changed after its checksums were verified: {unverified}"
                )
        checkpoint = self._checkpoint
        storage = checkpoint.metadata.storage_data
        entries = checkpoint.metadata.state_dict_metadata
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(storage[item.storage_index].relative_path, []).append(item)
        for relative, items in sorted(by_file.items()):
            file = checkpoint.path / relative
            with checkpoint.opened().opened(relative) as f:  # the file verified
                for item in sorted(items, key=lambda i: storage[i.storage_index].offset):
                    info = storage[item.storage_index]
                    where = _where(file, item.storage_index)
                    with self._item_stream(f, info) as stream:
                        loaded = _load_item(stream, where, checked=True)  # in planning
                    if item.type == LoadItemType.BYTE_IO:
                        if isinstance(planner, SafeLoadPlanner):
                            planner.load_value(item, loaded)
                        else:  # pragma: no cover - Checkpoint.load always plans with ours
                            raise CheckpointError(f"{where}: read by an unknown planner")
                        continue
                    md = entries[item.storage_index.fqn]
                    assert isinstance(md, TensorStorageMetadata)  # checked when opened
                    sizes = checkpoint.facts.chunk_sizes[item.storage_index]
                    _copy_chunk(loaded, md, sizes, item, planner, where)
        future: Future[None] = Future()
        future.set_result(None)
        return future


def _copy_chunk(
    loaded: object,
    md: TensorStorageMetadata,
    sizes: tuple[int, ...],
    item: ReadItem,
    planner: LoadPlanner,
    where: str,
) -> None:
    """Copy the requested part of one saved chunk into its destination, once the chunk is
    known to be the tensor ``.metadata`` says."""
    if not isinstance(loaded, torch.Tensor):
        raise CheckpointError(f"{where} is corrupted: it holds a {type(loaded).__name__}")
    dtype = md.properties.dtype
    if loaded.dtype != dtype:
        raise CheckpointError(
            f"{where}: holds {loaded.dtype} data, but .metadata says {dtype}: refused (retyped: "
            "a load would cast it silently)"
        )
    if tuple(loaded.shape) != sizes:
        raise CheckpointError(
            f"{where} is corrupted: it holds a tensor of shape {tuple(loaded.shape)}, its chunk "
            f"in .metadata has sizes {sizes}"
        )
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        if offset != 0 or length != loaded.size(dim):
            loaded = loaded.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != loaded.size():
        raise CheckpointError(
            f"{where}: its part {tuple(loaded.shape)} does not fit the destination "
            f"{tuple(target.size())}"
        )
    target.copy_(loaded)
    planner.commit_tensor(item, target)


# ---------------------------------------------------------------------------- checksum files
_WRITER = re.compile(r"^__(\d{1,9})_")
_SIDECAR = re.compile(r"^__(\d{1,9})\.checksums\.json$")
_DIGEST = (1 << 64) - 1
_BYTES = (1 << 63) - 1


def _read_sidecar(name: str, files: Files, limit: int) -> dict[str, Any]:
    """One rank's checksum file ``name`` of the directory ``files`` opened (as first seen),
    read within ``limit`` bytes and checked field by field: its format and version, its
    save id, each item's file (inside the directory), offset, length and digests (ints),
    the digests of ``.metadata`` (rank 0)."""
    directory = files.path
    file = directory / name
    try:
        with files.read_once(name) as f:
            payload = read_json(f, max_bytes=limit)
    except OSError as e:
        raise ChecksumError(f"{file}: unreadable ({type(e).__name__})") from None
    except JsonProblem as e:
        raise ChecksumError(f"{file}: not a checksum file dtensor_ema writes: {e}") from None
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        raise ChecksumError(f"{file}: not a {FORMAT} file")
    if payload.get("version") != VERSION:
        version = payload.get("version")
        shown = version if isinstance(version, int) and abs(version) < 1 << 31 else "?"
        raise ChecksumError(
            f"{file}: checksum file version {shown}, this dtensor_ema reads version {VERSION} "
            "(an earlier dtensor_ema wrote it): load with verify=False"
        )
    save_id = payload.get("save_id")
    if not (isinstance(save_id, str) and 0 < len(save_id) <= 256):
        raise ChecksumError(
            f"{file}: records no save id: refused (every checksum file names the save that "
            "wrote it, so that files of two saves never load together; this one was edited, "
            "or written before save ids: load with verify=False)"
        )
    items = payload.get("items")
    if not isinstance(items, dict) or not all(_recorded_item(e) for e in items.values()):
        raise ChecksumError(f"{file}: malformed (its items are not file, offset, length, digests)")
    recorded = payload.get("metadata")
    if recorded is not None and not _digests_only(recorded):
        raise ChecksumError(f"{file}: malformed (the digests of {METADATA_FILE})")
    checked: set[str] = set()
    for entry in items.values():  # before any data file is opened
        name = entry["file"]
        if name not in checked:
            path_inside(directory, name, f"{file}")
            checked.add(name)
    return payload


def _recorded_item(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        return False
    if not all(_is_count(entry.get(k), _BYTES) for k in ("offset", "length")):
        return False
    return _digests_only({k: v for k, v in entry.items() if k not in ("file", "offset", "length")})


def _digests_only(recorded: object) -> bool:
    """Every digest an algorithm we know recorded is an int that fits 64 bits."""
    return isinstance(recorded, dict) and all(
        _is_count(recorded[name], _DIGEST) for name in _KNOWN_DIGESTS if name in recorded
    )


_KNOWN_DIGESTS = ("crc32", "xxh3_64")


def _is_count(value: object, most: int) -> bool:
    return type(value) is int and 0 <= value <= most


def _algorithm(recorded: Mapping[str, Any], file: Path | Url, what: str) -> str:
    """The fastest digest algorithm both recorded for ``what`` and available here."""
    algorithm = available(recorded)
    if algorithm is None:
        names = sorted(k for k in recorded if k in _KNOWN_DIGESTS) or "none"
        raise ChecksumError(
            f"{file}: the digests recorded for {what} ({names}) cannot be computed "
            "here: install the package that computes them (xxhash), or load with verify=False"
        )
    return algorithm
