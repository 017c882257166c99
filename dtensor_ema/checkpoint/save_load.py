"""Checkpoints that survive a crash mid-save and refuse the wrong, corrupted or crafted
checkpoint before touching anything.

``ModelEMA`` already implements DCP's ``Stateful`` protocol, so plain ``dcp.save`` /
``dcp.load`` work and reshard across world sizes and between DDP and FSDP2. This module adds
what plain DCP does not do:

* :func:`save_checkpoint` commits only after every rank finished writing, to a local folder
  or an object store (:mod:`dtensor_ema.checkpoint.storage`), so a save that dies halfway (a
  rank raises, a process is killed) leaves the previous checkpoint intact; it records
  checksums of every byte range DCP wrote (:mod:`dtensor_ema.checkpoint.checksums`); with
  ``async_=True`` it copies the state and writes in the background
  (:mod:`dtensor_ema.checkpoint.background`), with the same promises.
* :func:`load_checkpoint` checks the checkpoint against every ``ModelEMA`` it will fill (the
  data files exist and are long enough; the checksums; tensor names, shapes and dtypes; the
  counter and the options that shape the next update) **before** DCP writes into the live
  EMA tensors, so a refused checkpoint leaves the EMA as it was. Plain ``dcp.load`` checks
  names and shapes first too, but casts other dtypes silently, ignores extra tensors, and
  only learns that the decay options differ after it has overwritten the EMA in place.
  Then every EMA reads into staging buffers and is swapped in only when every rank read and
  checked everything: whatever fails during the load (a read, a refused entry, an
  out-of-range value), every EMA is exactly as before. It reads the files it verified, as
  they were when it opened them (:mod:`dtensor_ema.checkpoint.files`): a save committed to
  the same path meanwhile gives one save's data or an error naming it, never a mix.

Reading runs no code from the checkpoint: ``.metadata`` is unpickled with a restricted
unpickler and non-tensor values with ``torch.load(..., weights_only=True)``
(:mod:`dtensor_ema.checkpoint.reader`, which every reader of the package shares). Plain
``dcp.load`` unpickles both unrestricted. The inventory: ``docs/guarantees.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import uuid
import warnings
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from dtensor_ema._collectives import (
    agree,
    agree_on_call,
    all_reduce,
    entering,
    group_gather_rows,
    group_of,
    quiet_single_process,
    rank_of,
    reduce_device,
)
from dtensor_ema.checkpoint import background
from dtensor_ema.checkpoint.checksums import write_checksums
from dtensor_ema.checkpoint.reader import (
    Checkpoint,
    CheckpointChangedError,
    CheckpointError,
    UnverifiedCheckpointWarning,
    Verify,
    one_line,
    open_checkpoint,
    verification,
)
from dtensor_ema.checkpoint.same_path import agree_on_path
from dtensor_ema.checkpoint.storage import LocalStorage, ObjectStorage, storage_for
from dtensor_ema.engine import EmaEngine
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.multi import MultiModelEMA
from dtensor_ema.state import (
    EMA_TENSORS,
    TensorSpec,
    common_names,
    compare_tensors,
    deferred_names,
    staging_state,
    tracked_difference,
    validate_state,
)

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


# ---------------------------------------------------------------------------------- save
def save_checkpoint(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = True,
    async_: bool = False,
) -> concurrent.futures.Future[None] | None:
    """Save ``state`` with DCP so that a failed save never damages the checkpoint at ``path``.

    **Collective**: every rank of ``process_group`` (default: the whole default group) must
    call this with the same keys and the same ``path``, after the same number of updates
    of each EMA in ``state``: the ranks agree that every one can reach ``path`` (a folder
    every rank sees, or the URL of a folder in an object store, ``s3://bucket/run/ema``, any
    fsspec protocol: one flag all-reduce; a path that only looks like a URL, ``s3:/b``, or
    a protocol whose package is missing is refused), compare a digest of their resolved
    ``path`` in one small all-reduce that also hands every rank rank 0's save id (a
    differing path raises ``ValueError`` on every rank before anything is written), then
    agree on the EMAs and their counts (one small all-gather over the group, then one per
    mesh dim of each EMA's mesh, :func:`~dtensor_ema._collectives.agree_on_call`; pipeline
    stages' EMAs each over their own mesh), and on their state dicts having been collected.
    Without a process group it saves from one process. What each step guarantees:
    ``docs/checkpoints.md`` ("What ``save_checkpoint`` adds to DCP", "Object storage").

    ``state`` is what ``dcp.save`` takes, e.g. ``{"ema": ema, "model": model_sd, "optim":
    optim_sd}``. DCP writes into ``<path>.partial``; only when every rank's write succeeded
    does rank 0 swap it in (``path -> <path>.previous``, ``<path>.partial -> path``, delete
    ``<path>.previous``; a crash between the renames leaves the last good checkpoint in
    ``<path>.previous``, which the next save puts back and :func:`load_checkpoint` falls back
    to; in a store, the save's own prefix ``<url>/save-<save id>/``, made current by one
    object ``<url>/current.json``, then the replaced save deleted). With
    ``checksums=True`` (default) every rank records digests of the byte ranges it wrote in
    ``__<rank>.checksums.json`` (local; CRC-32, and XXH3-64 with ``xxhash``), then one more
    flag all-reduce, so rank 0 commits only once every checksum file is written. Peak extra
    memory (blocking): DCP's write buffers; nothing is copied.

    **Background saves** (``async_=True``): the call agrees as above, collects the state
    dicts and copies every tensor of ``state`` to the CPU, then returns a
    ``concurrent.futures.Future`` while a background thread writes that copy with every
    promise above; ``update()`` may run meanwhile. The writes' collectives run on a gloo
    group over the ranks of ``process_group``, created by the first background save of each
    group (``dist.new_group``: every rank of that group) and kept. A later save first waits
    for a pending one; call ``future.result()`` before loading what it wrote and before
    destroying the process group. Peak extra memory: one CPU copy of ``state``'s tensors
    (an EMA's local shards: ``1/W`` of its tracked tensors), kept for the next background
    save (:func:`dtensor_ema.checkpoint.background.release_staging` frees it).

    Returns:
        ``None``; with ``async_=True`` the future of the background write.

    Raises:
        ValueError: ``path`` exists and is not a directory, only looks like a URL, or the
            ranks were given different paths (nothing written).
        ImportError: ``path`` is a URL whose fsspec package is not installed.
        RuntimeError: a rank failed; the message says which. ``path`` is unchanged.
    """
    group = group_of(process_group)
    background.wait_pending()
    with entering("save_checkpoint", group=group):
        storage, save_id = _storage(group, path, "save_checkpoint")
        _agree_on_emas("save_checkpoint", state, group, counted=True)
        _prepare(storage, group)
        path = storage.root
        error: Exception | None = None
        staged: dict[str, Any] = {}
        try:
            staged = _state_dicts(state)
            if async_:
                staged = background.cpu_copy(staged)
        except (Exception, CheckpointException) as e:
            error = _ordinary(e, f"collecting the state to save to {path}")
        agree(group, error, f"collecting the state to save to {path}")
        if not async_:
            _write_and_commit(staged, storage, group, checksums, save_id)
            return None
        writer_group = background.background_group(group)
        # No quiet_single_process() there: warnings.catch_warnings is not thread-safe.
        return background.submit(
            functools.partial(
                _write_and_commit, staged, storage, writer_group, checksums, save_id,
                quiet=False,
            )
        )  # fmt: skip


def _storage(
    group: dist.ProcessGroup | None, path: str | os.PathLike[str], call: str
) -> tuple[LocalStorage | ObjectStorage, str]:
    """The storage of ``path``, once every rank found it (a URL needs its package on every
    rank), and the save id drawn as the ranks agree on it (:func:`agree_on_path`)."""
    error: Exception | None = None
    storage = None
    try:
        storage = storage_for(path)
    except (ImportError, ValueError) as e:
        error = e
    agree(group, error, f"{call}() of {os.fspath(path)!r}")
    assert storage is not None
    return storage, agree_on_path(group, storage.root, call)


def _state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    # Stateful values are turned into plain state dicts here, not inside dcp.save, so a
    # rank whose state_dict() raises is seen by all ranks before any DCP collective.
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _prepare(storage: LocalStorage | ObjectStorage, group: dist.ProcessGroup | None) -> None:
    """Rank 0 refuses a path that is a file and tidies what an interrupted save left; the
    ranks agree."""
    error: Exception | None = None
    if rank_of(group) == 0:
        try:
            storage.prepare()
        except Exception as e:  # an object store's client raises its own types
            error = e
    agree(group, error, f"preparing to save {storage.root}")


def _write_and_commit(
    staged: dict[str, Any],
    storage: LocalStorage | ObjectStorage,
    group: dist.ProcessGroup | None,
    checksums: bool,
    save_id: str,
    *,
    quiet: bool = True,
) -> None:
    """DCP writes ``staged`` through the storage's writer; every rank records its
    checksums; rank 0 commits once every rank succeeded. **Collective** over ``group``.
    ``quiet``: hide DCP's warning that one process saves alone (the foreground only)."""
    path = storage.root
    error: Exception | None = None
    writer = storage.writer(save_id)
    try:
        with quiet_single_process() if quiet else contextlib.nullcontext():
            dcp.save(staged, storage_writer=writer, process_group=group, no_dist=group is None)
    except CheckpointException as e:  # a BaseException: one line of each rank's failure
        failures = sorted(e.failures.items())
        raise CheckpointError(
            f"saving {path} failed, the checkpoint there is unchanged: "
            + "; ".join(f"rank {r}: {one_line(exc)}" for r, (exc, _) in failures[:4])
        ) from e
    if checksums:
        try:
            write_checksums(writer, rank_of(group), save_id=save_id)
        except Exception as e:
            error = e
        agree(group, error, f"writing the checksums of {writer.path}")
    if rank_of(group) == 0:
        try:
            storage.commit(save_id)
        except Exception as e:
            error = e
    agree(group, error, f"committing {writer.path} to {path}")


def _ordinary(error: BaseException, what: str) -> Exception:
    """``error`` itself if it is an ``Exception``; else a :class:`CheckpointError` chaining it
    (DCP's ``CheckpointException`` is a ``BaseException``)."""
    if isinstance(error, Exception):
        return error
    wrapped = CheckpointError(f"{what} failed: {error}")
    wrapped.__cause__ = error
    return wrapped


# ---------------------------------------------------------------------------------- load
def load_checkpoint(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    verify: Verify = True,
    common_subset: bool = False,
) -> None:
    """Load ``state`` in place from the DCP checkpoint at ``path`` (a folder, or the URL of
    one in an object store: the save its ``current.json`` names), checking it first.

    **Collective**: every rank of ``process_group`` (default: the whole default group) must
    call this with the same keys, the same EMAs and the same ``path`` (agreed first: one
    small all-reduce of the resolved path's digest, then small all-gathers over the group
    and each EMA's mesh, :func:`~dtensor_ema._collectives.agree_on_call`). Without a process
    group it loads in one process. The checkpoint may come from any world size, and from DDP
    or FSDP2 (DCP reshards). What each step checks, with every refusal's message:
    ``docs/checkpoints.md`` ("What ``save_checkpoint`` adds to DCP").

    Nothing from the checkpoint is run (:mod:`dtensor_ema.checkpoint.reader`: ``.metadata``
    through a restricted unpickler, every entry with ``torch.load(..., weights_only=True)``,
    every file name inside ``path``, every size checked against the files, or objects,
    before anything is allocated, every tensor's chunks covering it exactly once). Before
    anything is written, the ranks agree that the checkpoint is complete and that it holds
    exactly the tensors and accepted options of every :class:`~dtensor_ema.ModelEMA` in
    ``state`` (a top-level value, or a member of a top-level
    :class:`~dtensor_ema.MultiModelEMA`): all raise or none does, with one message naming
    which rank saw what. Other entries (model, optimizer) get DCP's own checks.

    **A failed load changes no EMA.** Every EMA reads into staging buffers of its own layout
    (:func:`~dtensor_ema.state.staging_state`) and is swapped in only when every rank has
    read and checked everything (one more flag all-reduce); a failure anywhere, on any rank,
    leaves every EMA's tensors, count, options and tracked set as they were. Peak extra
    memory: one more copy of each loaded EMA's local shards (``1/W`` of its tracked
    tensors), plus what DCP holds while it reads one item. Model and optimizer entries are
    read in place, as DCP does (a failed load may leave them partly written). The directory
    is opened once and every file read as first seen, so a save that commits to ``path``
    meanwhile is not seen (where that cannot hold: :class:`~dtensor_ema.checkpoint.reader.
    CheckpointChangedError`, one all-gather of four int64s per rank comparing the saves).

    ``common_subset=True``: an EMA that tracks other tensors than the checkpoint's
    (``track=``, ``add_tensors``) loads the tensors both track (without it: refused, naming
    the tensors each side tracks alone). ``verify=True`` (default): ``.metadata`` and every
    item the rank reads are checked against the digests :func:`save_checkpoint` recorded
    (one memory-mapped pass, no copy); a checkpoint without checksum files loads with an
    :class:`~dtensor_ema.checkpoint.reader.UnverifiedCheckpointWarning`; ``"require"``
    refuses it; ``False`` skips the pass. If ``path`` is missing but ``<path>.previous``
    exists (a save interrupted between its renames) the previous checkpoint is loaded, with
    a warning. In an object store a load reads the save ``current.json`` names, by byte
    range; its ``.metadata`` must carry that save id.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (a store: no ``current.json``), or one
            that misses ``.metadata`` or data files (an interrupted plain ``dcp.save``).
        ValueError: the ranks were given different paths, ``path`` only looks like a URL,
            the checkpoint does not match an EMA (names, shapes, dtypes, options), or has no
            EMA state under that EMA's key.
        ImportError: ``path`` is a URL whose fsspec package is not installed.
        CheckpointError: ``.metadata`` refers to a global that is not DCP metadata (a
            crafted checkpoint; nothing was run), is not what DCP writes or claims more
            than its files hold, names a file outside ``path``, leaves part of a tensor
            uncovered; an entry is not a tensor or plain value, or is corrupted or retyped;
            a checksum differs from the saved one or belongs to another save, or a checksum
            file names no save (``verify``), the checkpoint has no checksums
            (``verify="require"``); or DCP failed (one line naming what it raised).
        CheckpointChangedError: another save wrote to ``path`` while this load read it.

    When ranks fail differently, every rank raises the same message, of the first failing
    rank's exception type (``RuntimeError`` where that type is not a builtin or ours).
    """
    group = group_of(process_group)
    with entering("load_checkpoint", group=group):
        storage, _ = _storage(group, path, "load_checkpoint")
        _agree_on_emas("load_checkpoint", state, group, counted=False)
        _load(state, storage, group, verify, common_subset)


def _load(
    state: dict[str, Any],
    storage: LocalStorage | ObjectStorage,
    group: dist.ProcessGroup | None,
    verify: Verify,
    common_subset: bool = False,
) -> None:
    path = storage.root
    emas = _emas_in(state)
    error: Exception | None = None
    checkpoint: Checkpoint | None = None
    unverified: str | None = None
    check = False
    try:
        checkpoint = open_checkpoint(storage.committed())
        check, unverified = verification(checkpoint, verify)
        if check:  # first: a corrupted .metadata must not pass for another model
            checkpoint.verify_metadata()
        checkpoint.check_files()
    except (OSError, ValueError, CheckpointError) as e:
        error = e
    except Exception as e:  # anything else: still tell the other ranks
        error = RuntimeError(f"reading the checkpoint at {path} failed: {e!r}")
        error.__cause__ = e
    try:
        agree(group, error, f"checking the checkpoint at {path}")
        assert checkpoint is not None
        _agree_on_save(group, checkpoint)
        others = {w: _other_stages(checkpoint, w, ema, group) for w, ema in emas.items()}
        try:
            for where, ema in emas.items():
                _check_ema_tensors(checkpoint, where, ema, others[where])
        except (ValueError, CheckpointError) as e:
            error = e
        agree(group, error, f"checking the checkpoint at {path}")
        if unverified is not None:
            warnings.warn(unverified, UnverifiedCheckpointWarning, stacklevel=3)
        subsets = _judge_saved(checkpoint, emas, group, check, common_subset, others)
        _load_staged(state, checkpoint, group, check, subsets)
    finally:
        if checkpoint is not None:
            checkpoint.close()


def _judge_saved(
    checkpoint: Checkpoint,
    emas: Mapping[tuple[str, ...], ModelEMA],
    group: dist.ProcessGroup | None,
    check: bool,
    common_subset: bool,
    others: Mapping[tuple[str, ...], frozenset[str]],
) -> dict[tuple[str, ...], list[str]]:
    """Read each EMA's saved counter and options alone (small) and let the EMA judge them
    (:func:`_judge_saved_values`; ``others``: each EMA's tensors that other pipeline stages
    saved) while nothing is written; the ranks agree. Returns the tensors to load of each
    EMA that loads only those both track (``common_subset``). **Collective** (a DCP load of
    the values, then one flag all-reduce)."""
    if not emas:
        return {}
    saved: dict[str, Any] = {}
    for where, ema in emas.items():
        _set_nested(saved, where, _without_tensors(ema.state_dict()))
    checkpoint.load(saved, group=group, verify=check)
    subsets: dict[tuple[str, ...], list[str]] = {}
    error: Exception | None = None
    try:
        for where, ema in emas.items():
            names = _judge_saved_values(
                checkpoint, where, ema, _get_nested(saved, where), common_subset, others[where]
            )
            if names is not None:
                subsets[where] = names
    except (KeyError, ValueError) as e:
        error = e
    except Exception as e:  # a malformed value: still tell the other ranks
        error = ValueError(f"checkpoint {checkpoint.path}: the saved EMA state is malformed: {e!r}")
    agree(group, error, f"checking the EMA options saved in {checkpoint.path}")
    return subsets


class _Stage:
    """One EMA's part of a load, read into buffers of its own layout
    (:func:`~dtensor_ema.state.staging_state`) and swapped in only once every rank has read
    and checked everything (:func:`_load_staged`)."""

    def __init__(self, ema: ModelEMA, names: list[str] | None) -> None:
        self.ema = ema
        self.common_subset = names is not None
        self.state = staging_state(ema.state_dict(), names)

    def validate(self) -> None:
        """What was read, checked against the EMA as :meth:`swap_in` will (nothing written)."""
        validate_state(self.state, self.ema.state_dict(), common_subset=self.common_subset)

    def swap_in(self) -> None:
        """Copy the staged pieces into the live EMA and set its counter (local)."""
        self.ema.load_state_dict(self.state, common_subset=self.common_subset)


def _load_staged(
    state: dict[str, Any],
    checkpoint: Checkpoint,
    group: dist.ProcessGroup | None,
    check: bool,
    subsets: Mapping[tuple[str, ...], list[str]],
) -> None:
    """The DCP load of ``state``: every EMA reads into its own staging buffers, every other
    entry as ``dcp.load`` reads it (in place; a ``Stateful`` gets its ``load_state_dict``).
    The EMAs are swapped in only when every rank has read everything and checked what it
    read: whatever fails before (a read, a refused entry, an out-of-range value, a
    ``Stateful``'s ``load_state_dict`` on any rank), every EMA keeps its tensors, counter,
    options and tracked set. **Collective** over ``group``: DCP's, and two flag all-reduces.
    Peak extra memory: one more copy of each loaded EMA's local shards."""
    path = checkpoint.path
    stages: dict[tuple[str, ...], _Stage] = {}
    staged: dict[str, Any] = {}
    error: Exception | None = None
    try:
        for key, value in state.items():
            if isinstance(value, ModelEMA):
                stages[(key,)] = _Stage(value, subsets.get((key,)))
                staged[key] = stages[(key,)].state
            elif isinstance(value, MultiModelEMA):
                for name, ema in value.items():
                    stages[(key, name)] = _Stage(ema, subsets.get((key, name)))
                staged[key] = {name: stages[(key, name)].state for name in value}
            else:  # as dcp.load does: a Stateful's state dict, loaded in place
                staged[key] = value.state_dict() if isinstance(value, Stateful) else value
    except Exception as e:
        error = e
    agree(group, error, f"collecting the state to load from {path}")
    checkpoint.load(staged, group=group, verify=check)  # DCP: every rank raises alike
    try:
        for stage in stages.values():
            stage.validate()
        for key, value in state.items():
            if isinstance(value, (ModelEMA, MultiModelEMA)):
                continue
            if isinstance(value, Stateful):
                value.load_state_dict(staged[key])
            else:
                state[key] = staged[key]
    except Exception as e:
        error = e
    agree(group, error, f"loading {path}")
    for stage in stages.values():
        stage.swap_in()


def _agree_on_save(group: dist.ProcessGroup | None, checkpoint: Checkpoint) -> None:
    """Every rank opened the same save: a save that committed to the path while the ranks
    opened it would have some read the old one and some the new one. **Collective**: one
    all-gather of four int64s per rank (nothing in one process).

    Raises:
        CheckpointChangedError: on every rank, naming which ranks read which save.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    high, low = _id_words(checkpoint.save_id)
    rows = group_gather_rows(group, [checkpoint.metadata_digests["crc32"], high, low])
    by_save: dict[tuple[int, ...], list[int]] = {}
    for rank, *values in rows:
        by_save.setdefault(tuple(values), []).append(rank)
    if len(by_save) == 1:
        return
    seen = "; ".join(
        f"ranks {ranks} read save {_id_text(values[1], values[2])}"
        for values, ranks in by_save.items()
    )
    raise CheckpointChangedError(
        f"checkpoint {checkpoint.path} changed while the ranks opened it: {seen}. Another "
        "save committed to this path meanwhile; nothing was loaded: load again once that "
        "save has finished"
    )


def _id_words(save_id: str | None) -> tuple[int, int]:
    """A save id (a UUID) as two int64s; ``(0, 0)`` for none or another form."""
    try:
        value = uuid.UUID(save_id or "").int
    except ValueError:
        return 0, 0
    high, low = value >> 64, value & (2**64 - 1)
    return high - 2**64 * (high >= 2**63), low - 2**64 * (low >= 2**63)


def _id_text(high: int, low: int) -> str:
    if (high, low) == (0, 0):
        return "(no id)"
    return repr(str(uuid.UUID(int=((high % 2**64) << 64) | (low % 2**64))))


def _emas_in(state: Mapping[str, Any]) -> dict[tuple[str, ...], ModelEMA]:
    """The EMAs among ``state``'s top-level values, by their path in the checkpoint."""
    emas: dict[tuple[str, ...], ModelEMA] = {}
    for key, value in state.items():
        if isinstance(value, ModelEMA):
            emas[(key,)] = value
        elif isinstance(value, MultiModelEMA):
            emas.update({(key, name): ema for name, ema in value.items()})
    return emas


def _agree_on_emas(name: str, state: Mapping[str, Any], group: Any, *, counted: bool) -> None:
    """Before a save or load: the ranks of ``group`` agree that they make this call with
    EMAs under the same keys, then the ranks of each EMA's own mesh agree that it is the
    same EMA (its digest) and, for a save, at the same update count. Pipeline stages, whose
    EMAs differ by design, each agree over their own mesh. **Collective**: one small
    all-gather over ``group``, then one per mesh dim of each EMA's mesh (in ``state``'s
    order, the same on every rank)."""
    emas = _emas_in(state)
    keys = " ".join("/".join(where) for where in emas)
    agree_on_call(name, lambda: (zlib.crc32(keys.encode()), 0), group=group)
    for ema in emas.values():
        engine = ema.engine
        identity = engine.call_identity if counted else functools.partial(_uncounted, engine)
        agree_on_call(name, identity, mesh=ema.mesh)


def _uncounted(engine: EmaEngine) -> tuple[int, int]:
    """Which EMA, without its count (a load replaces it)."""
    return engine.identity(), 0


def _set_nested(root: dict[str, Any], where: tuple[str, ...], value: Any) -> None:
    for part in where[:-1]:
        root = root.setdefault(part, {})
    root[where[-1]] = value


def _get_nested(root: dict[str, Any], where: tuple[str, ...]) -> Any:
    for part in where:
        root = root[part]
    return root


def _other_stages(
    checkpoint: Checkpoint, where: tuple[str, ...], ema: ModelEMA, group: Any
) -> frozenset[str]:
    """The saved EMA tensors under ``where`` that another rank's EMA holds and this one
    does not: pipeline stages save one EMA each under one key, so each stage's checkpoint
    entries are the other stages' extra tensors. **Collective** over ``group``: one
    all-reduce of one byte per saved tensor (every rank reads the same metadata, so the
    same list). A saved tensor no rank holds stays unexpected."""
    prefix = f"{'.'.join(where)}.{EMA_TENSORS}."
    names = sorted(
        k[len(prefix) :] for k in checkpoint.entries_under(where) if k.startswith(prefix)
    )
    ours = set(ema.state_dict()[EMA_TENSORS])
    if group is None or not names:
        return frozenset()
    held = torch.tensor([n in ours for n in names], dtype=torch.uint8, device=reduce_device(group))
    all_reduce(held, group)
    return frozenset(
        n for n, count in zip(names, held.tolist(), strict=True) if count and n not in ours
    )


def _check_ema_tensors(
    checkpoint: Checkpoint,
    where: tuple[str, ...],
    ema: ModelEMA,
    others: frozenset[str] = frozenset(),
) -> None:
    """The checkpoint holds this EMA's entries, with its shapes and dtypes; names a
    tracked-set difference may explain are left to :func:`_judge_saved_values`, which has
    read the saved config; ``others``, the tensors of other pipeline stages, are theirs."""
    key = ".".join(where)
    path = checkpoint.path
    saved = checkpoint.entries_under(where)
    if not saved:
        raise ValueError(
            f"checkpoint {path} has no EMA state under {key!r}; its top-level entries are "
            f"{sorted(checkpoint.top_level_keys())}"
        )
    own = ema.state_dict()
    ours = {_short(k, key): v for k, v in _flatten(own, where)}
    specs = {_short(k, key): _spec(md) for k, md in saved.items()}
    specs = {k: v for k, v in specs.items() if k not in others}
    deferred = deferred_names([k for k, v in specs.items() if v is not None], own)
    problems = compare_tensors(specs, ours, ignore=deferred)
    if problems:
        raise ValueError(
            f"checkpoint {path} does not match the EMA under {key!r} (a different model?): "
            + problems
        )


def _spec(md: Any) -> TensorSpec | None:
    if isinstance(md, TensorStorageMetadata):
        return TensorSpec(tuple(md.size), md.properties.dtype)
    return None


def _judge_saved_values(
    checkpoint: Checkpoint,
    where: tuple[str, ...],
    ema: ModelEMA,
    saved: dict[str, Any],
    common_subset: bool = False,
    others: frozenset[str] = frozenset(),
) -> list[str] | None:
    """Validate the saved counter and options, with the tensors' metadata, against the EMA
    (:func:`~dtensor_ema.state.validate_state`); nothing is written. Returns the tensors to
    load when the tracked sets differ (``common_subset``), else ``None``. ``others``, the
    tensors of other pipeline stages, are left out."""
    key = ".".join(where)
    prefix = f"{key}.{EMA_TENSORS}."
    tensors = {
        k[len(prefix) :]: _spec(md)
        for k, md in checkpoint.entries_under(where).items()
        if k.startswith(prefix) and k[len(prefix) :] not in others
    }
    candidate = {**saved, EMA_TENSORS: tensors}
    ours = ema.state_dict()
    diff = tracked_difference(tensors, saved.get("config"), ours)
    problems = compare_tensors(
        {k: v for k, v in tensors.items() if k not in diff.only_saved},
        {k: v for k, v in ours[EMA_TENSORS].items() if k not in diff.only_ours},
    )
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint.path} does not match the EMA under {key!r} (a different "
            f"model?): {problems}"
        )
    try:
        validate_state(candidate, ours, common_subset=common_subset)
    except (KeyError, ValueError) as e:
        raise type(e)(
            f"checkpoint {checkpoint.path} cannot resume the EMA under {key!r}: {e}"
        ) from e
    if not (common_subset and diff):
        return None
    return common_names(candidate, ours)


def _flatten(value: Any, prefix: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """``(dcp_key, leaf)`` pairs of a nested dict, keyed the way DCP flattens them."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flatten(v, (*prefix, str(k)))
    else:
        yield ".".join(prefix), value


def _without_tensors(value: Any) -> Any:
    """The non-tensor part of a nested dict (tensors, and dicts left empty, dropped)."""
    out = {}
    for k, v in value.items():
        if isinstance(v, Mapping):
            v = _without_tensors(v)
            if v:
                out[k] = v
        elif not isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _short(dcp_key: str, key: str) -> str:
    """``ema.ema.blocks.0.w`` -> ``blocks.0.w``; ``ema.updates`` -> ``updates``."""
    for prefix in (f"{key}.{EMA_TENSORS}.", f"{key}."):
        if dcp_key.startswith(prefix):
            return dcp_key[len(prefix) :]
    return dcp_key
