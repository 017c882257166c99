"""Where a checkpoint's bytes go: a local folder or an object store, behind one interface.

:func:`storage_for` picks the storage from the path (as DCP's ``validate_checkpoint_id``
picks a writer); :mod:`~dtensor_ema.checkpoint.save_load` drives either through
``prepare()`` (rank 0: tidy what an interrupted save left), ``writer(save_id)`` (DCP's
writer, recording what it wrote for the checksums), ``commit(save_id)`` (rank 0, once every
rank wrote) and ``committed()`` (what a load reads: a
:class:`~dtensor_ema.checkpoint.files.Files`). :class:`LocalStorage` (a path, ``file://``
too) renames ``<path>.partial`` over ``path``. :class:`ObjectStorage` (any fsspec URL)
cannot rename: each save writes under its own prefix ``<url>/save-<save id>/`` and is made
current by one small object written last, ``<url>/current.json`` (one PUT: whole or
absent); a load reads only the save it names; the next save deletes every other ``save-*``
prefix, a commit the save it replaced. Objects are read by byte range (:class:`ObjectFiles`)
and digested as they stream out (:class:`ObjectWriter`). The promises, what is atomic where,
credentials and costs: ``docs/checkpoints.md`` ("Object storage").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

# DCP's fsspec writer lives in a private module in torch 2.14 (not re-exported).
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFiles
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from dtensor_ema.checkpoint.bounded_json import JsonProblem, parse_json
from dtensor_ema.checkpoint.checksums import (
    METADATA_FILE,
    Digests,
    Recording,
    RecordingWriter,
    digests,
)
from dtensor_ema.checkpoint.files import Url
from dtensor_ema.checkpoint.reader import CheckpointChangedError, CheckpointError, one_line

__all__ = [
    "POINTER",
    "LocalStorage",
    "ObjectFiles",
    "ObjectStorage",
    "ObjectWriter",
    "commit_partial",
    "local_directory",
    "storage_for",
    "tidy_interrupted",
]

PARTIAL_SUFFIX, PREVIOUS_SUFFIX = ".partial", ".previous"
"""Where a save to a folder writes; where the last good one waits while a commit swaps."""
POINTER = "current.json"
"""``<url>/current.json``: the object that makes a save in an object store current."""
SAVE_PREFIX = "save-"
READ_BLOCK = 1 << 16
"""Bytes an object read fetches beyond what it asks (small items come in one request)."""
_POINTER_FORMAT = "dtensor_ema.current"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")
_LOOKS_LIKE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")
_SAVE_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def storage_for(path: str | os.PathLike[str]) -> LocalStorage | ObjectStorage:
    """The storage of ``path``: an :class:`ObjectStorage` for a ``<protocol>://`` URL, else
    (``file://`` too) a :class:`LocalStorage`. Local.

    Raises:
        ValueError: ``path`` looks like a URL with one slash, or has an unknown protocol.
        ImportError: the package of the URL's protocol is not installed.
    """
    text = os.fspath(path)
    if text.startswith("file://"):
        return LocalStorage(Path(text.removeprefix("file://")))
    if _URL.match(text):
        return ObjectStorage(text)
    if _LOOKS_LIKE_URL.match(text):
        raise ValueError(
            f"checkpoint path {text!r} looks like a URL with one slash after its protocol "
            "(pathlib.Path('s3://b/x') makes 's3:/b/x'): pass the URL as a string, with '//'; "
            "nothing was written to a local folder of that name"
        )
    return LocalStorage(Path(path))


def local_directory(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a directory of a file system (``file://`` stripped), for writers that
    need one (post-hoc snapshots). Local.

    Raises:
        ValueError: ``path`` is or looks like an object-store URL, naming ``what``.
    """
    text = os.fspath(path)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if _LOOKS_LIKE_URL.match(text):
        raise ValueError(
            f"{what} {text!r} is an object-store URL: it must be a directory of a file system "
            "every rank sees (nothing was written to a local folder of that name)"
        )
    return Path(path)


class LocalStorage:
    """A checkpoint folder on a file system every rank sees (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.root = path
        self.partial = path.with_name(path.name + PARTIAL_SUFFIX)
        self.previous = path.with_name(path.name + PREVIOUS_SUFFIX)

    def prepare(self) -> None:
        """Refuse a path that is a file, undo what an interrupted save left, make the parent
        folder. Rank 0."""
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"checkpoint path {self.root} exists and is not a directory")
        tidy_interrupted(self.root, self.partial, self.previous)
        self.partial.parent.mkdir(parents=True, exist_ok=True)

    def writer(self, save_id: str) -> RecordingWriter:
        return RecordingWriter(self.partial, save_id=save_id)

    def commit(self, save_id: str) -> None:
        """Swap the finished checkpoint in. Rank 0."""
        commit_partial(self.partial, self.root, self.previous)

    def committed(self) -> Path:
        """``path``, or the ``<path>.previous`` a save interrupted between its renames left
        (with a warning); ``open_checkpoint`` refuses what is not a checkpoint folder."""
        if not self.root.exists() and (self.previous / METADATA_FILE).is_file():
            warnings.warn(
                f"no checkpoint at {self.root}, loading {self.previous}: a save_checkpoint() was "
                "interrupted while it swapped directories; the next save_checkpoint() puts it back",
                stacklevel=4,
            )
            return self.previous
        return self.root

    def exists(self) -> bool:
        return self.root.is_dir()

    def move_to(self, target: LocalStorage) -> None:
        """Move this checkpoint to ``target``, replacing what is there. Rank 0."""
        if target.root.exists():
            shutil.rmtree(target.root)
        os.replace(self.root, target.root)


def tidy_interrupted(path: Path, partial: Path, previous: Path) -> None:
    """Undo what an interrupted save of the directory ``path`` left behind: its
    ``partial`` deleted, its ``previous`` copy deleted or put back. Local (one process)."""
    if partial.exists():
        shutil.rmtree(partial)
    if previous.exists():
        if path.exists():  # the commit finished; only deleting the old copy did not
            shutil.rmtree(previous)
        else:  # died between the two renames: the last good checkpoint goes back
            os.rename(previous, path)


def commit_partial(partial: Path, path: Path, previous: Path) -> None:
    """Swap the finished directory ``partial`` in at ``path`` (an existing one goes to
    ``previous`` until the rename is durable, then is deleted). Local (one process); DCP
    already fsynced the files."""
    if path.exists():
        os.rename(path, previous)
    os.rename(partial, path)
    with contextlib.suppress(OSError):  # make the renames durable, where a folder opens
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if previous.exists():
        shutil.rmtree(previous)


class ObjectStorage:
    """A checkpoint in an object store, any fsspec URL (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.root = Url(url.rstrip("/"))
        try:
            self.fs, self.path = url_to_fs(self.root)
        except (ImportError, ValueError) as e:  # a missing package, an unknown protocol
            raise type(e)(
                f"checkpoint path {url!r}: {e}: install the fsspec implementation of its "
                "protocol (s3://: pip install 'dtensor_ema[object_storage]')"
            ) from None

    def prepare(self) -> None:
        """Delete every save but the current one (what failed saves left). Rank 0."""
        self._keep_only(self._current())

    def writer(self, save_id: str) -> ObjectWriter:
        return ObjectWriter(self.root / f"{SAVE_PREFIX}{save_id}", self.fs, save_id=save_id)

    def commit(self, save_id: str) -> None:
        """Write ``current.json`` naming ``save_id`` (the commit), then delete the save it
        replaced. Rank 0."""
        pointer = {"format": _POINTER_FORMAT, "version": 1, "save_id": save_id}
        with _asking(self.root, f"writing {POINTER}"):
            self.fs.pipe_file(f"{self.path}/{POINTER}", json.dumps(pointer).encode())
        try:
            self._keep_only(save_id)
        except Exception as e:  # committed: what is left is the next save's to delete
            warnings.warn(
                f"{self.root}: save {save_id} is committed, but deleting the save it replaced "
                f"failed ({type(e).__name__}: {e}); the next save deletes it",
                stacklevel=2,
            )

    def committed(self) -> ObjectFiles:
        """The objects of the save ``current.json`` names, listed now."""
        save_id = self._current()
        if save_id is None:
            raise FileNotFoundError(
                f"no checkpoint at {self.root}: it has no {POINTER} (no save_checkpoint() "
                "committed there)"
            )
        name = f"{SAVE_PREFIX}{save_id}"
        return ObjectFiles(self.fs, f"{self.path}/{name}", self.root / name, save_id)

    def exists(self) -> bool:
        return self._current() is not None

    def move_to(self, target: ObjectStorage) -> None:
        """Copy the current save to ``target`` (in the store), commit it there, delete this
        one. Rank 0."""
        save_id = self._current()
        if save_id is None:
            return
        source = f"{self.path}/{SAVE_PREFIX}{save_id}"
        found = self.fs.find(source)
        self.fs.copy(found, [f"{target.path}/{f[len(self.path) + 1 :]}" for f in found])
        target.commit(save_id)
        self.fs.rm(self.path, recursive=True)

    def _current(self) -> str | None:
        """The save id ``current.json`` names (``None``: there is none), read in one bounded
        request and checked."""
        where = self.root / POINTER
        try:
            with _asking(self.root, f"reading {POINTER}"):
                data = self.fs.cat_file(f"{self.path}/{POINTER}", start=0, end=4097)
            payload = parse_json(data) if len(data) <= 4096 else {}
        except FileNotFoundError:
            return None
        except JsonProblem as e:
            raise CheckpointError(f"{where}: not a pointer dtensor_ema writes: {e}") from None
        ours = isinstance(payload, dict) and payload.get("format") == _POINTER_FORMAT
        save_id = str(payload.get("save_id")) if ours else ""
        if not _SAVE_ID.fullmatch(save_id):
            raise CheckpointError(f"{where}: not a pointer dtensor_ema writes (no save id)")
        return save_id

    def _keep_only(self, save_id: str | None) -> None:
        with _asking(self.root, "deleting the saves not current"):
            try:
                listed = self.fs.ls(self.path, detail=False, refresh=True)
            except FileNotFoundError:
                return
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in listed]
            keep = f"{SAVE_PREFIX}{save_id}"
            stale = [f"{self.path}/{n}" for n in names if n.startswith(SAVE_PREFIX) and n != keep]
            if stale:
                self.fs.rm(stale, recursive=True)


@contextlib.contextmanager
def _asking(root: Url, what: str) -> Iterator[None]:
    """The store's client errors as one ``OSError`` line naming the checkpoint."""
    try:
        yield
    except (FileNotFoundError, CheckpointError):
        raise
    except Exception as e:
        raise OSError(f"{root}: {what} failed: {one_line(e)}") from e


class ObjectFiles:
    """One save's objects as listed when a load opened it, read by byte range (read-ahead
    :data:`READ_BLOCK`). Never rewritten (a crafted rewrite fails its checksum), an object
    is its listed size; one deleted since (a later save committed) raises ``changed``."""

    def __init__(self, fs: Any, path: str, location: Url, save_id: str | None) -> None:
        self.fs, self._path, self.path, self.save_id = fs, path, location, save_id
        self.changed: Callable[[str], Exception] = lambda detail: CheckpointChangedError(
            f"{location}: {detail}"
        )
        try:
            with _asking(location, "listing its objects"):
                listed = fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            listed = []
        self._sizes = {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
            for e in listed
            if e.get("type") == "file"
        }

    def names(self) -> list[str]:
        return list(self._sizes)

    def size(self, name: str) -> int | None:
        return self._sizes.get(name)

    @contextlib.contextmanager
    def opened(self, name: str) -> Iterator[BinaryIO]:
        size = self._sizes.get(name)
        if size is None:
            raise FileNotFoundError(f"{self.path / name} does not exist")
        try:
            with self.fs.open(
                f"{self._path}/{name}", "rb", block_size=READ_BLOCK, cache_type="readahead",
                size=size,
            ) as f:  # fmt: skip
                yield f
        except FileNotFoundError:
            raise self.changed(f"{name} was deleted after this load first saw it") from None

    read_once = opened

    def close(self) -> None:
        """Nothing is held between reads."""


class ObjectWriter(Recording, FsspecWriter):
    """DCP's ``FsspecWriter`` over ``fs`` that digests each item as it streams out: DCP asks
    a data file's position before and after each item, so the bytes between two asks are
    one item (an item seen otherwise is read back, as ``.metadata`` is)."""

    def __init__(self, url: Url, fs: Any, *, save_id: str) -> None:
        super().__init__(str(url), save_id=save_id, sync_files=False)  # objects: no fsync
        self.store = fs
        self.found: dict[tuple[str, int, int], dict[str, int]] = {}
        self.fs = _Streams(fs, self.found)  # type: ignore[assignment]

    def digests_of(self, relative: str, places: Sequence[tuple[int, int]]) -> list[dict[str, int]]:
        return [
            self.found.get((relative, o, o + n))
            or digests(self.store.cat_file(f"{self.path}/{relative}", start=o, end=o + n))
            for o, n in places
        ]

    def read_file(self, name: str) -> bytes:
        with _asking(Url(self.path), f"reading {name}"):
            return bytes(self.store.cat_file(f"{self.path}/{name}"))

    def write_file(self, name: str, data: bytes) -> None:
        with _asking(Url(self.path), f"writing {name}"):
            self.store.pipe_file(f"{self.path}/{name}", data)


class _Streams(FsspecFiles):
    """DCP's fsspec file system over ``fs``, its write streams digesting (:class:`_Digesting`).
    A store has no folders to make; a save's fresh prefix holds no earlier ``.metadata``."""

    def __init__(self, fs: Any, found: dict[tuple[str, int, int], dict[str, int]]) -> None:
        super().__init__()
        self.fs, self.found = fs, found

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            yield _Digesting(stream, os.path.basename(path), self.found) if "w" in mode else stream

    def mkdir(self, path: Any) -> None:
        pass

    def exists(self, path: Any) -> bool:
        return False


class _Digesting(io.RawIOBase):
    """A file being written that digests its bytes between consecutive ``tell()`` calls into
    ``found[(name, start, end)]``."""

    def __init__(self, raw: Any, name: str, found: dict[tuple[str, int, int], Any]) -> None:
        super().__init__()
        self.raw, self.name, self.found = raw, name, found
        self.start = self.position = 0
        self.digests = Digests()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.digests.update(view)
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        if self.position > self.start:
            self.found[(self.name, self.start, self.position)] = self.digests.value()
            self.start, self.digests = self.position, Digests()
        return self.position

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.raw.close()
