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
* :meth:`Checkpoint.check_files`: every data file the metadata names exists and is long
  enough.
* :meth:`Checkpoint.verify_metadata`, :meth:`Checkpoint.verify_reads`: the CRC-32 recorded
  by :func:`~dtensor_ema.save_checkpoint` (:mod:`dtensor_ema.checksums`) of ``.metadata``
  and of every saved item a load reads, checked inside :meth:`Checkpoint.load` on each
  rank's read plan, in one pass over those byte ranges (memory-mapped), before any rank
  reads them.
* :meth:`Checkpoint.entries_under`, :meth:`Checkpoint.top_level_keys`: what the checkpoint
  holds under a key, from the metadata alone.

Nothing here communicates except :meth:`Checkpoint.load` (DCP's collectives).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dtensor_ema._collectives import MESSAGE_RANKS, describe, quiet_single_process, same_error
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
    "CheckpointError",
    "ChecksumError",
    "SafeLoadPlanner",
    "existing_checkpoint",
    "open_checkpoint",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded: DCP failed (chains its
    ``CheckpointException``, a ``BaseException`` that escapes ``except Exception``), its
    ``.metadata`` holds something other than DCP's metadata (nothing from it was run), or
    its bytes differ from those saved."""


class ChecksumError(CheckpointError):
    """A saved item's (or ``.metadata``'s) bytes differ from those saved, or cannot be read;
    the message names the file and, for an item, the tensor or value."""


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
        raise CheckpointError(f"{file} is not a readable DCP .metadata file: {e!r}") from e
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
        missing = sorted(f for f in needed if not (self.path / f).is_file())
        if missing:
            raise FileNotFoundError(
                f"checkpoint {self.path} is incomplete: data files {missing[:5]} named by its "
                ".metadata are missing"
            )
        short = [
            f"{f} ({(self.path / f).stat().st_size} bytes, needs {n})"
            for f, n in sorted(needed.items())
            if (self.path / f).stat().st_size < n
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
        got = self.metadata_digests[algorithm]
        if got != int(recorded[algorithm]):
            raise ChecksumError(
                f"{where}: {METADATA_FILE} has {algorithm} {got:#x}, but "
                f"{int(recorded[algorithm]):#x} was recorded when it was saved: the file is "
                "corrupted or was replaced"
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
                cannot be read, has no recorded checksum (a checksum file is missing), or a
                checksum file is unreadable; names the file and the tensor or value.
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
                digests = digests_of_ranges(
                    self.path / file, [(c[0], c[1]) for c in chunks], algorithms
                )
            except (OSError, EOFError) as e:
                raise ChecksumError(
                    f"{where}, data file {file} cannot be read, the file is corrupted: {e!r}"
                ) from e
            for (_, _, algorithm, expected, what), got in zip(chunks, digests, strict=True):
                if got[algorithm] != expected:
                    raise ChecksumError(
                        f"{where}, data file {file}: {what} has {algorithm} "
                        f"{got[algorithm]:#x}, but {expected:#x} was recorded when it was "
                        "saved: the file is corrupted"
                    )
        return len(wanted)

    def _sidecar(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s checksum file (``{}`` when it is missing), read once."""
        name = sidecar_name(rank)
        if name not in self._recorded:
            file = self.path / name
            self._recorded[name] = _read_sidecar(file, self.path) if file.exists() else {}
        return self._recorded[name]

    def _recorded_items(self, files: set[str]) -> dict[str, dict[str, Any]]:
        """The recorded items of the ranks that wrote ``files`` (DCP names a rank's data
        files ``__<rank>_<n>.distcp``); every rank's when a name does not follow that."""
        matches = [_WRITER.match(f) for f in files]
        if all(matches):
            ranks = sorted({int(m.group(1)) for m in matches if m is not None})
        else:
            ranks = sorted(
                int(m.group(1))
                for f in self.path.glob(SIDECAR_GLOB)
                if (m := _SIDECAR.match(f.name)) is not None
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

        Raises:
            ChecksumError: ``verify=True`` and a checksum differs on some rank (every rank
                raises the same message).
            CheckpointError: DCP failed (missing keys, shape mismatches, an unreadable or
                disallowed value); chains DCP's exception.
        """
        reader = _Reader(self, verify and self.has_checksums)
        try:
            with quiet_single_process():
                dcp.load(
                    state,
                    storage_reader=reader,
                    planner=SafeLoadPlanner(allow_partial_load=partial),
                    process_group=group,
                    no_dist=group is None,
                )
        except CheckpointException as e:  # a BaseException: make it an ordinary error
            failures = {r: exc for r, (exc, _) in sorted(e.failures.items())}
            if any(isinstance(exc, ChecksumError) for exc in failures.values()):
                # DCP gathered every rank's planning failures to every rank: raise the same
                # message everywhere, as agree() would.
                shown = dict(list(failures.items())[:MESSAGE_RANKS])
                raise same_error(
                    f"verifying the checksums of {self.path}",
                    list(failures),
                    {r: describe(exc) for r, exc in shown.items()},
                ) from e
            raise CheckpointError(f"loading {self.path} failed: {e}") from e


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read the ``.metadata`` of the DCP checkpoint directory ``path``, running no code.

    Reads ``.metadata`` once, whole, and unpickles it with only :data:`METADATA_GLOBALS`
    (and torch dtypes) allowed. Local.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or has no ``.metadata`` (an
            interrupted save, or not a checkpoint).
        CheckpointError: ``.metadata`` refers to any other global (naming it and the
            file; nothing was run, nothing else read), or is not DCP metadata.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint path {path} is not a directory (a DCP checkpoint is)"
            if path.exists()
            else f"no checkpoint at {path}: the directory does not exist"
        )
    file = path / METADATA_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete DCP checkpoint: it has no {METADATA_FILE} file (the "
            "save did not finish, or this is not a checkpoint directory)"
        )
    data = file.read_bytes()
    metadata = _unpickle_metadata(data, file)
    has_checksums = next(iter(path.glob(SIDECAR_GLOB)), None) is not None
    return Checkpoint(path, metadata, digests(data), has_checksums)


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


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are unpickled with
    ``torch.load(..., weights_only=True)`` (DCP's default: ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
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
        return super().read_data(plan, planner)


_WRITER = re.compile(r"^__(\d+)_")
_SIDECAR = re.compile(r"^__(\d+)\.checksums\.json$")


def _read_sidecar(file: Path, directory: Path) -> dict[str, Any]:
    """One rank's checksum file, checked to be of this format and version."""
    where = f"checkpoint {directory}"
    try:
        payload = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ChecksumError(f"{where}: checksum file {file.name} is unreadable: {e!r}") from e
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
