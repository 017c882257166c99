"""The files of one checkpoint directory, read as they were when a load opened it.

A load reads a checkpoint in several passes: ``.metadata``, the size check, the checksum
pass, then DCP's reads (twice in :func:`~dtensor_ema.load_checkpoint`: the counter and
options, then the tensors). A ``save_checkpoint`` of another job that commits to the same
path meanwhile renames the old directory away and the new one in: a reader that reopens
files by path then reads some bytes of one save and some of the other (rows 0-7 of save A,
8-15 of save B, each pass passing its own checks).

:class:`CheckpointFiles` opens the directory once and every file relative to that open
directory (``dir_fd``), so every pass reads the files of the directory it started with,
whatever is renamed over the path; a file is kept open from its first use to the end of the
load (the most recently used :data:`HELD_FILES`; others are opened again and must be the
same file). Each file's identity (device, inode, size, modification time) is recorded when
it is first seen and compared at every open and after every read: a file written in place
meanwhile (a plain ``dcp.save`` into the same directory), or one the committing save deleted
before this load opened it, is reported as changed by another save, never as corrupted.

Local: nothing here communicates. Where the platform cannot open files relative to a
directory descriptor (Windows), files are opened by path and only the identity check holds.
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["HELD_FILES", "CheckpointFiles"]

HELD_FILES = 128
"""How many data files a load keeps open at once (the most recently used): a rank reads a
few files, but a one-process load of a checkpoint saved by thousands of ranks must not run
out of file descriptors. A file opened again must be the one first seen."""

_RELATIVE = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_BINARY = getattr(os, "O_BINARY", 0)

Identity = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns)``: a file as first seen."""


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CheckpointFiles:
    """The directory ``path`` as it was when opened, and its files as first seen.

    Args:
        path: the checkpoint directory.
        changed: builds the error raised when a file changed or vanished since the load
            began (given the detail: which file, what changed); the caller words it.

    Use as a context manager, or call :meth:`close`. Local; not thread-safe (one load).
    """

    def __init__(self, path: Path, changed: Callable[[str], Exception]) -> None:
        self.path = Path(path)
        self.changed = changed
        self._dir_fd: int | None = None
        if _RELATIVE:
            self._dir_fd = os.open(self.path, os.O_RDONLY | _DIRECTORY)
            self._directory = _identity(os.fstat(self._dir_fd))[:2]
        else:
            self._directory = _identity(os.stat(self.path))[:2]
        self._seen: dict[str, Identity] = {}
        self._held: collections.OrderedDict[str, BinaryIO] = collections.OrderedDict()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every held file and the directory (idempotent)."""
        while self._held:
            self._held.popitem()[1].close()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ listing
    def names(self) -> list[str]:
        """The names in the directory that was opened (not what the path names now)."""
        if self._dir_fd is not None and os.listdir in os.supports_fd:
            return os.listdir(self._dir_fd)
        return os.listdir(self.path)

    def size(self, name: str) -> int | None:
        """The size of file ``name`` (``None``: missing, or not a plain file); records its
        identity when first seen. Opens nothing."""
        try:
            if self._dir_fd is not None:
                st = os.stat(name, dir_fd=self._dir_fd)
            else:
                st = os.stat(self.path / name)
        except FileNotFoundError:
            self._check_directory(name)
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        self._check_same(name, st, "when it was opened again")
        return st.st_size

    # ------------------------------------------------------------------ reading
    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name`` (small files: ``.metadata``, checksum files)."""
        with self.opened(name) as f:
            return f.read()

    @contextlib.contextmanager
    def opened(self, name: str) -> Iterator[BinaryIO]:
        """A binary stream over file ``name`` of the directory that was opened, positioned
        at 0; the file is held open for later passes. Checks the file is the one first seen
        (same device, inode, size, modification time) before and after the body.

        Raises:
            FileNotFoundError: the file does not exist and never did in this load.
            Exception: from ``changed``: it changed, or vanished after it was seen.
        """
        f = self._held.get(name)
        if f is None:
            f = self._open(name)
        else:
            self._held.move_to_end(name)
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
        f = self._held.get(name)
        if f is not None:
            self._check_same(name, os.fstat(f.fileno()), "while this load read it")

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
        f = open(fd, "rb")  # noqa: SIM115 (held beyond this call; closed by close())
        try:
            self._check_same(name, os.fstat(fd), "when it was opened again")
        except BaseException:
            f.close()
            raise
        self._held[name] = f
        if len(self._held) > HELD_FILES:
            self._held.popitem(last=False)[1].close()
        return f

    def _check_directory(self, name: str) -> None:
        """A file is missing: if the path now names another directory (or none), a save
        committed there meanwhile (it renames the old directory away and deletes it)."""
        try:
            now = _identity(os.stat(self.path))[:2]
        except FileNotFoundError:
            now = None
        if now != self._directory:
            raise self.changed(
                f"{name} is gone and {self.path} is another directory now (a save that "
                "commits renames the old directory away and deletes it)"
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
