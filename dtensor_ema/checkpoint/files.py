"""The files of one checkpoint directory, read as they were when a load opened it.

A load reads a checkpoint in several passes: ``.metadata``, the size check, the checksum
pass, the archive checks, then the item reads (twice in
:func:`~dtensor_ema.load_checkpoint`: the counter and options, then the tensors). A
``save_checkpoint`` of another job that commits to the same path meanwhile renames the old
directory away and the new one in: a reader that reopens files by path then reads some
bytes of one save and some of the other (rows 0-7 of save A, 8-15 of save B, each pass
passing its own checks).

:class:`CheckpointFiles` opens the directory once and every file relative to that open
directory (``dir_fd``), so every pass reads the files of the directory it started with,
whatever is renamed over the path, and keeps each data file open from its first use to the
end of the load. Each file's identity (device, inode, size, modification time) is recorded
when it is first seen and compared at every open and after every read: a file written in
place meanwhile (a plain ``dcp.save`` into the same directory), or one the committing save
deleted before this load opened it, is reported as changed by another save, never as
corrupted.

Open files are bounded for the whole process (many snapshots open at once in a post-hoc
synthesis; a one-process load of a checkpoint saved by thousands of ranks): at most
:data:`HELD_FILES` data files stay open (the least recently used is closed; opened again,
it must be the file first seen), and at most :data:`HELD_DIRECTORIES` directories (beyond
that the least recently used checkpoint opens its files by path and checks after each open
that the path still names the directory it first opened). Small files (``.metadata``, the
checksum files) are read once, within the bounds their reader sets, and closed.

Local: nothing here communicates. Where the platform cannot open files relative to a
directory descriptor (Windows), files are opened by path with the same checks.
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

__all__ = ["HELD_DIRECTORIES", "HELD_FILES", "CheckpointFiles", "Files", "Url"]

HELD_FILES = 128
"""How many data files all loads of this process keep open at once (the most recently
used)."""
HELD_DIRECTORIES = 64
"""How many checkpoint directories all loads of this process keep open at once."""

_RELATIVE = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_BINARY = getattr(os, "O_BINARY", 0)

Identity = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns)``: a file as first seen."""

_held_files: collections.OrderedDict[tuple[int, str], tuple[CheckpointFiles, BinaryIO]] = (
    collections.OrderedDict()
)
_held_directories: collections.OrderedDict[int, CheckpointFiles] = collections.OrderedDict()


class Url(str):
    """A URL that joins like a path: ``Url("s3://b/x") / "y"`` is ``"s3://b/x/y"``."""

    def __truediv__(self, name: str) -> Url:
        return Url(f"{self}/{name}")


class Files(Protocol):
    """One checkpoint's files as a load first saw them (a folder's, or a store's)."""

    changed: Callable[[str], Exception]
    save_id: str | None  # the save the storage says these are (a store's current.json)

    @property
    def path(self) -> Path | Url: ...

    def names(self) -> list[str]: ...
    def size(self, name: str) -> int | None: ...
    def read_once(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def opened(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def close(self) -> None: ...


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CheckpointFiles:
    """The directory ``path`` as it was when opened, and its files as first seen.

    Args:
        path: the checkpoint directory.
        changed: builds the error raised when a file changed or vanished since the load
            began (given the detail: which file, what changed); the caller words it.

    Use as a context manager, or call :meth:`close`. Local; one load at a time.
    """

    save_id: str | None = None

    def __init__(self, path: Path, changed: Callable[[str], Exception]) -> None:
        self.path = Path(path)
        self.changed = changed
        self._dir_fd: int | None = None
        if _RELATIVE:
            self._dir_fd = os.open(self.path, os.O_RDONLY | _DIRECTORY)
            self._directory = _identity(os.fstat(self._dir_fd))[:2]
            _held_directories[id(self)] = self
            while len(_held_directories) > HELD_DIRECTORIES:
                _held_directories.popitem(last=False)[1]._release_directory()
        else:
            self._directory = _identity(os.stat(self.path))[:2]
        self._seen: dict[str, Identity] = {}
        self._names: set[str] = set()  # this object's held data files

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every held file and the directory (idempotent)."""
        for name in list(self._names):
            _held_files.pop((id(self), name))[1].close()
        self._names.clear()
        self._release_directory()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _release_directory(self) -> None:
        """From now on, open files by path (checking the path still names the directory)."""
        _held_directories.pop(id(self), None)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    # ------------------------------------------------------------------ listing
    def names(self) -> list[str]:
        """The names in the directory that was opened (not what the path names now)."""
        if self._dir_fd is not None and os.listdir in os.supports_fd:
            return os.listdir(self._dir_fd)
        names = os.listdir(self.path)
        self._check_directory(None)
        return names

    def size(self, name: str) -> int | None:
        """The size of file ``name`` (``None``: missing, or not a plain file); records its
        identity when first seen. Opens nothing."""
        try:
            if self._dir_fd is not None:
                st = os.stat(name, dir_fd=self._dir_fd)
            else:
                st = os.stat(self.path / name)
                self._check_directory(name)
        except FileNotFoundError:
            self._check_directory(name)
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        self._check_same(name, st, "when it was looked at again")
        return st.st_size

    # ------------------------------------------------------------------ reading
    @contextlib.contextmanager
    def read_once(self, name: str) -> Iterator[BinaryIO]:
        """A binary stream over the small file ``name`` (``.metadata``, a checksum file),
        positioned at 0, not held: closed after the body. The body reads it within its own
        bounds (:mod:`dtensor_ema.checkpoint.bounded_json`); afterwards, or when the body raised,
        the
        file is checked to be the one first seen, as :meth:`opened` does.

        Raises:
            FileNotFoundError: the file does not exist and never did in this load.
            Exception: from ``changed``: it changed, or vanished after it was seen.
        """
        with self._open(name) as f:
            try:
                yield f
            except Exception:
                self._check_same(name, os.fstat(f.fileno()), "while this load read it")
                raise
            self._check_same(name, os.fstat(f.fileno()), "while this load read it")

    @contextlib.contextmanager
    def opened(self, name: str) -> Iterator[BinaryIO]:
        """A binary stream over data file ``name`` of the directory that was opened,
        positioned at 0, held open for later passes. Checks the file is the one first seen
        (same device, inode, size, modification time) before and after the body.

        Raises:
            FileNotFoundError: the file does not exist and never did in this load.
            Exception: from ``changed``: it changed, or vanished after it was seen.
        """
        key = (id(self), name)
        held = _held_files.get(key)
        if held is None:
            f = self._open(name)
            _held_files[key] = (self, f)
            self._names.add(name)
            while len(_held_files) > HELD_FILES:
                (_, evicted), (owner, stream) = _held_files.popitem(last=False)
                owner._names.discard(evicted)
                stream.close()
        else:
            f = held[1]
            _held_files.move_to_end(key)
            self.check(name)
        f.seek(0)
        try:
            yield f
        except Exception:
            self.check(name)  # a read that failed on a changed file: say so
            raise
        self.check(name)

    def check(self, name: str) -> None:
        """Raise ``changed`` unless the held file ``name`` is still as first seen."""
        held = _held_files.get((id(self), name))
        if held is not None:
            self._check_same(name, os.fstat(held[1].fileno()), "while this load read it")

    def _open(self, name: str) -> BinaryIO:
        try:
            if self._dir_fd is not None:
                fd = os.open(name, os.O_RDONLY | _BINARY, dir_fd=self._dir_fd)
            else:
                fd = os.open(self.path / name, os.O_RDONLY | _BINARY)
        except FileNotFoundError:
            if name in self._seen:
                raise self.changed(f"{name} was deleted after this load first saw it") from None
            self._check_directory(name)
            raise
        f = open(fd, "rb")  # noqa: SIM115 (held beyond this call)
        try:
            if self._dir_fd is None:
                self._check_directory(name)
            self._check_same(name, os.fstat(fd), "when it was opened again")
        except BaseException:
            f.close()
            raise
        return f

    def _check_directory(self, name: str | None) -> None:
        """Raise ``changed`` if the path now names another directory (or none): a save
        committed there meanwhile (it renames the old directory away and deletes it)."""
        try:
            now = _identity(os.stat(self.path))[:2]
        except FileNotFoundError:
            now = None
        if now != self._directory:
            what = f"{name} is gone and " if name is not None else ""
            raise self.changed(
                f"{what}{self.path} is another directory now (a save that commits renames the "
                "old directory away and deletes it)"
            )

    def _check_same(self, name: str, st: os.stat_result, when: str) -> None:
        now = _identity(st)
        first = self._seen.setdefault(name, now)
        if now == first:
            return
        if now[:2] != first[:2]:
            what = "is another file now (replaced)"
        elif now[2] != first[2]:
            what = f"changed size ({first[2]} -> {now[2]} bytes)"
        else:
            what = "was modified (its modification time changed)"
        raise self.changed(f"{name} {what} {when}")
