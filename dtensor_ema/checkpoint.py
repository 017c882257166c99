"""Checkpoints that survive a crash mid-save, refuse the wrong checkpoint before touching
anything, and export the average for inference.

``ModelEMA`` already implements DCP's ``Stateful`` protocol, so plain ``dcp.save`` /
``dcp.load`` work and reshard across world sizes and between DDP and FSDP2. This module adds
what plain DCP does not do:

* :func:`save_checkpoint` writes into a sibling ``<path>.partial`` directory and renames it
  over ``path`` only after every rank finished writing, so a save that dies halfway (a rank
  raises, a process is killed) leaves the previous checkpoint at ``path`` intact.
* :func:`load_checkpoint` checks the checkpoint against every ``ModelEMA`` it will fill (the
  data files exist and are long enough; tensor names, shapes and dtypes; the counter and the
  options that shape the next update) **before** DCP writes into the live EMA tensors, so a
  refused checkpoint leaves the EMA as it was. Plain ``dcp.load`` checks names and shapes
  first too, but casts other dtypes silently, ignores extra tensors, and only learns that the
  decay options differ after it has overwritten the EMA in place.
* :func:`export_ema` gathers the full average to rank 0 on the CPU, one bounded bucket at a
  time, and writes one ``torch.save`` or ``.safetensors`` file keyed like the model.
* :func:`convert_checkpoint` turns a DCP checkpoint directory into such a file offline: one
  process, no process group.

Non-tensor values (the update counter, the options) are read with
``torch.load(..., weights_only=True)``; DCP's default planner unpickles them unrestricted.
DCP's own ``.metadata`` file is still read by DCP (``pickle``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.stateful import Stateful

from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.multi import MultiModelEMA

__all__ = [
    "DEFAULT_EXPORT_BUCKET_BYTES",
    "convert_checkpoint",
    "export_ema",
    "load_checkpoint",
    "save_checkpoint",
]

DEFAULT_EXPORT_BUCKET_BYTES = 64 * 1024 * 1024
"""Gathered bytes per all-gather during export: bounds the transient buffers of every rank."""

PARTIAL_SUFFIX = ".partial"
"""``<path>.partial``: where :func:`save_checkpoint` writes before it commits."""
PREVIOUS_SUFFIX = ".previous"
"""``<path>.previous``: the last good checkpoint while a commit swaps the directories."""

_EMA_TENSORS = "ema"
"""Key of the ``fqn -> tensor`` dict inside ``ModelEMA.state_dict()``."""


# ---------------------------------------------------------------------------------- save
def save_checkpoint(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save ``state`` with DCP so that a failed save never damages the checkpoint at ``path``.

    **Collective**: every rank of ``process_group`` (default: the whole default group) must
    call this with the same keys. Without a process group it saves from one process.

    ``state`` is what ``dcp.save`` takes, e.g. ``{"ema": ema, "model": model_sd, "optim":
    optim_sd}``; ``Stateful`` values (``ModelEMA`` is one) are asked for their state dict
    first, on every rank, and all ranks agree that this worked before DCP starts, so an
    error on one rank cannot leave the others waiting in DCP's collectives.

    DCP writes into ``<path>.partial``. Only when every rank's write succeeded does rank 0
    swap it in: ``path -> <path>.previous``, ``<path>.partial -> path``, then delete
    ``<path>.previous``; a crash between the two renames leaves the last good checkpoint in
    ``<path>.previous``, which the next :func:`save_checkpoint` puts back and
    :func:`load_checkpoint` falls back to. Leftovers of an interrupted save are deleted by
    the next save. ``path`` and its siblings must be on a filesystem every rank sees.

    Raises:
        ValueError: ``path`` exists and is not a directory.
        RuntimeError: a rank failed; the message says which. ``path`` is unchanged.
    """
    group = _group(process_group)
    path = Path(path)
    partial, previous = _siblings(path)
    error: Exception | None = None
    if _rank(group) == 0:
        try:
            if path.exists() and not path.is_dir():
                raise ValueError(f"checkpoint path {path} exists and is not a directory")
            _tidy_after_interrupted_save(path, partial, previous)
            partial.parent.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as e:
            error = e
    _agree(group, error, f"preparing to save {path}")
    try:
        # Stateful values are turned into plain state dicts here, not inside dcp.save, so a
        # rank whose state_dict() raises is seen by all ranks before any DCP collective.
        staged = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    except Exception as e:
        error = e
    _agree(group, error, f"collecting the state to save to {path}")
    try:
        with _quiet_single_process():
            dcp.save(staged, checkpoint_id=str(partial), process_group=group, no_dist=group is None)
    except CheckpointException as e:  # a BaseException: make it an ordinary error
        raise RuntimeError(f"saving {path} failed, the checkpoint there is unchanged: {e}") from e
    if _rank(group) == 0:
        try:
            _commit(partial, path, previous)
        except OSError as e:
            error = e
    _agree(group, error, f"committing {partial} to {path}")


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + PARTIAL_SUFFIX), path.with_name(path.name + PREVIOUS_SUFFIX)


def _tidy_after_interrupted_save(path: Path, partial: Path, previous: Path) -> None:
    """Undo what an interrupted save left behind (rank 0 only)."""
    if partial.exists():
        shutil.rmtree(partial)
    if previous.exists():
        if path.exists():  # the commit finished; only deleting the old copy did not
            shutil.rmtree(previous)
        else:  # died between the two renames: the last good checkpoint goes back
            os.rename(previous, path)


def _commit(partial: Path, path: Path, previous: Path) -> None:
    """Swap the finished checkpoint in (rank 0 only). DCP already fsynced the files."""
    if path.exists():
        os.rename(path, previous)
    os.rename(partial, path)
    _fsync_dir(path.parent)
    if previous.exists():
        shutil.rmtree(previous)


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable; not every platform can open a directory."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------- load
def load_checkpoint(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load ``state`` in place from the DCP checkpoint at ``path``, checking it first.

    **Collective**: every rank of ``process_group`` (default: the whole default group) must
    call this with the same keys. Without a process group it loads in one process. The
    checkpoint may come from any world size, and from DDP or FSDP2 (DCP reshards).

    Before anything is written, every rank checks that the checkpoint is complete (its
    ``.metadata`` and every data file it names exist and are long enough) and, for every
    :class:`~dtensor_ema.ModelEMA` in ``state`` (a top-level value, or one of a top-level
    :class:`~dtensor_ema.MultiModelEMA`'s), that the checkpoint holds exactly
    its tensors (no missing or extra names, same global shapes and dtypes) and options the
    EMA accepts (``ModelEMA.load_state_dict`` decides, on the saved counter and options).
    The ranks agree on the outcome, so all of them raise or none does, and a refused
    checkpoint leaves every EMA exactly as it was. Other entries (model, optimizer) get
    DCP's own checks: missing keys and shape mismatches raise before anything is written.

    If ``path`` is missing but ``<path>.previous`` exists (a :func:`save_checkpoint`
    interrupted while it swapped directories) the previous checkpoint is loaded, with a
    warning.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or one that misses ``.metadata`` or
            data files (an interrupted plain ``dcp.save``).
        ValueError: the checkpoint does not match an EMA (names, shapes, dtypes, options),
            or has no EMA state under that EMA's key.
        RuntimeError: another rank refused the checkpoint (its own error says why).
    """
    group = _group(process_group)
    emas = _emas_in(state)
    error: Exception | None = None
    checkpoint_dir = Path(path)
    try:
        checkpoint_dir = _existing_checkpoint(Path(path))
        metadata = _read_metadata(checkpoint_dir)
        _check_files(checkpoint_dir, metadata)
        for where, ema in emas.items():
            _check_ema_tensors(checkpoint_dir, where, ema, metadata)
    except (OSError, ValueError) as e:
        error = e
    _agree(group, error, f"checking the checkpoint at {path}")

    if emas:
        # The counter and options are small: read them alone, then let the EMA judge them
        # while its tensors are still untouched.
        saved: dict[str, Any] = {}
        for where, ema in emas.items():
            _set_nested(saved, where, _without_tensors(ema.state_dict()))
        _dcp_load(saved, checkpoint_dir, group)
        counters = {where: ema.updates for where, ema in emas.items()}
        try:
            for where, ema in emas.items():
                _judge_saved_values(checkpoint_dir, where, ema, _get_nested(saved, where))
        except (KeyError, ValueError) as e:
            for where, ema in emas.items():
                ema.updates = counters[where]
            error = e
        _agree(group, error, f"checking the EMA options saved in {checkpoint_dir}")
    _dcp_load(state, checkpoint_dir, group)


def _existing_checkpoint(path: Path) -> Path:
    if path.is_dir():
        return path
    _, previous = _siblings(path)
    if not path.exists() and (previous / ".metadata").is_file():
        warnings.warn(
            f"no checkpoint at {path}, loading {previous}: a save_checkpoint() was "
            "interrupted while it swapped directories; the next save_checkpoint() puts it back",
            stacklevel=3,
        )
        return previous
    if path.exists():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory (a DCP checkpoint is)")
    raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist")


def _read_metadata(path: Path) -> Metadata:
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete DCP checkpoint: it has no .metadata file (the save did "
            "not finish, or this is not a checkpoint directory)"
        )
    return FileSystemReader(str(path)).read_metadata()


def _check_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata names exists and is long enough."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:  # not a FileSystemWriter checkpoint: let DCP read it
            return
        needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    missing = sorted(f for f in needed if not (path / f).is_file())
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} is incomplete: data files {missing[:5]} named by its "
            ".metadata are missing"
        )
    short = [
        f"{f} ({(path / f).stat().st_size} bytes, needs {n})"
        for f, n in sorted(needed.items())
        if (path / f).stat().st_size < n
    ]
    if short:
        raise FileNotFoundError(
            f"checkpoint {path} is incomplete: truncated data files {short[:5]}"
        )


def _emas_in(state: Mapping[str, Any]) -> dict[tuple[str, ...], ModelEMA]:
    """The EMAs among ``state``'s top-level values, by their path in the checkpoint."""
    emas: dict[tuple[str, ...], ModelEMA] = {}
    for key, value in state.items():
        if isinstance(value, ModelEMA):
            emas[(key,)] = value
        elif isinstance(value, MultiModelEMA):
            emas.update({(key, name): ema for name, ema in value.items()})
    return emas


def _set_nested(root: dict[str, Any], where: tuple[str, ...], value: Any) -> None:
    for part in where[:-1]:
        root = root.setdefault(part, {})
    root[where[-1]] = value


def _get_nested(root: dict[str, Any], where: tuple[str, ...]) -> Any:
    for part in where:
        root = root[part]
    return root


def _check_ema_tensors(
    path: Path, where: tuple[str, ...], ema: ModelEMA, metadata: Metadata
) -> None:
    """The checkpoint holds exactly this EMA's entries, with its shapes and dtypes."""
    key = ".".join(where)
    saved = _entries_under(where, metadata)
    if not saved:
        raise ValueError(
            f"checkpoint {path} has no EMA state under {key!r}; its top-level entries are "
            f"{sorted(_top_level_keys(metadata))}"
        )
    ours = dict(_flatten(ema.state_dict(), where))
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k not in ours]
    mismatched = []
    for k, value in ours.items():
        md = saved.get(k)
        if not isinstance(value, torch.Tensor) or md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            mismatched.append(f"{_short(k, key)}: saved a non-tensor, this EMA has a tensor")
        elif tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
            mismatched.append(
                f"{_short(k, key)}: saved {tuple(md.size)} {md.properties.dtype}, this EMA "
                f"{tuple(value.shape)} {value.dtype}"
            )
    if missing or unexpected or mismatched:
        problems = [
            f"{label} {_listed([_short(k, key) for k in names])}"
            for label, names in (("missing", missing), ("unexpected", unexpected))
            if names
        ]
        if mismatched:
            problems.append(f"mismatched {_listed(mismatched)}")
        raise ValueError(
            f"checkpoint {path} does not match the EMA under {key!r} (a different model?): "
            + "; ".join(problems)
        )


def _judge_saved_values(
    path: Path, where: tuple[str, ...], ema: ModelEMA, saved: dict[str, Any]
) -> None:
    """Hand the saved counter and options to ``ema.load_state_dict`` with the EMA's own live
    tensors: it validates them, sets the counter, and copies nothing."""
    live = ema.state_dict()
    try:
        ema.load_state_dict({**live, **saved, _EMA_TENSORS: live[_EMA_TENSORS]})
    except (KeyError, ValueError) as e:
        key = ".".join(where)
        raise type(e)(f"checkpoint {path} cannot resume the EMA under {key!r}: {e}") from e


def _entries_under(where: tuple[str, ...], metadata: Metadata) -> dict[str, Any]:
    planner_data = metadata.planner_data or {}
    prefix = ".".join(where) + "."
    return {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if (
            tuple(str(p) for p in planner_data[k][: len(where)]) == where
            if k in planner_data
            else k.startswith(prefix)
        )
    }


def _top_level_keys(metadata: Metadata) -> set[str]:
    planner_data = metadata.planner_data or {}
    return {
        str(planner_data[k][0]) if k in planner_data else k.split(".", 1)[0]
        for k in metadata.state_dict_metadata
    }


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
    for prefix in (f"{key}.{_EMA_TENSORS}.", f"{key}."):
        if dcp_key.startswith(prefix):
            return dcp_key[len(prefix) :]
    return dcp_key


def _listed(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values are unpickled with ``weights_only``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            # DCP's own helper for writing a value back into the nested state dict; public
            # planners have used it since DCP's flattening appeared (torch 2.1).
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _dcp_load(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    try:
        with _quiet_single_process():
            dcp.load(
                state,
                checkpoint_id=str(path),
                planner=_SafeLoadPlanner(),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as e:  # a BaseException: make it an ordinary error
        raise RuntimeError(f"loading {path} failed: {e}") from e


# -------------------------------------------------------------------------------- export
def export_ema(
    ema: ModelEMA,
    path: str | os.PathLike[str],
    *,
    bucket_bytes: int = DEFAULT_EXPORT_BUCKET_BYTES,
) -> None:
    """Write the full EMA weights to one file for inference. **Collective.**

    Every rank of the EMA's mesh (and of every FSDP2 mesh) must call this. The shards travel
    to rank 0 in flat gathers (``dist.gather``) of at most ``bucket_bytes``: the other ranks
    receive nothing and hold at most their ``1/W`` share of one bucket; rank 0 assembles one
    full copy on the CPU, in the model's dtypes, keyed like the unwrapped model's
    ``state_dict()`` (integer buffers from the model), and writes it to a temporary file
    that it renames to ``path``. A ``.safetensors`` suffix writes safetensors (needs the
    ``safetensors`` package; tied weights are stored once: load with
    ``safetensors.torch.load_model``), any other suffix ``torch.save`` (load with
    ``torch.load(path, weights_only=True)``).

    Raises:
        ImportError: a ``.safetensors`` path without the ``safetensors`` package.
        RuntimeError: writing failed on rank 0 (raised on every rank).
    """
    path = Path(path)
    error: Exception | None = None
    if path.suffix == ".safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            error = ImportError(f"writing {path} needs the safetensors package: {e}")
    group = _group(None)
    _agree(group, error, f"exporting the EMA to {path}")
    state = ema.get_ema_state_dict(rank0_only=True, cpu_offload=True, bucket_bytes=bucket_bytes)
    if _rank(group) == 0:
        try:
            _write_file(state, path, {"updates": str(ema.updates)})
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    del state
    _agree(group, error, f"writing the EMA to {path}")


def convert_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    key: str = "ema",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Turn the EMA in a DCP checkpoint into one file keyed by the model's fqns. Offline.

    Runs in one process and needs no process group (nor the model); the checkpoint may have
    been saved at any world size, from DDP or FSDP2. Holds one full copy of the EMA in
    memory. The file has the averaged tensors only, in the EMA's dtype (or ``dtype``):
    integer buffers and the duplicate names of tied weights are not averaged, so load it
    with ``model.load_state_dict(sd, strict=False)`` (or export from a live EMA with
    :func:`export_ema` for a strict-loadable file). ``.safetensors`` paths are written with
    safetensors (the saved counter and options go into its metadata), others with
    ``torch.save``.

    Returns:
        The ``fqn -> tensor`` dict that was written.

    Raises:
        FileNotFoundError: no complete checkpoint at ``checkpoint_dir``.
        ValueError: the checkpoint has no EMA tensors under ``key``.
    """
    checkpoint_dir = _existing_checkpoint(Path(checkpoint_dir))
    metadata = _read_metadata(checkpoint_dir)
    _check_files(checkpoint_dir, metadata)
    planner_data = metadata.planner_data or {}
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    for k, md in _entries_under((key,), metadata).items():
        where = planner_data.get(k, ())
        if isinstance(md, TensorStorageMetadata) and tuple(where[:2]) == (key, _EMA_TENSORS):
            tensors[".".join(str(p) for p in where[2:])] = torch.empty(
                md.size, dtype=md.properties.dtype
            )
        elif len(where) == 2:
            extras[str(where[1])] = None
    if not tensors:
        raise ValueError(
            f"checkpoint {checkpoint_dir} has no EMA tensors under {key!r}; its top-level "
            f"entries are {sorted(_top_level_keys(metadata))}"
        )
    state = {key: {_EMA_TENSORS: tensors, **extras}}
    _dcp_load(state, checkpoint_dir, None)
    tensors = state[key][_EMA_TENSORS]
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    saved = {
        k: v if isinstance(v, str) else json.dumps(v)
        for k, v in state[key].items()
        if k != _EMA_TENSORS
    }
    _write_file(tensors, Path(path), saved)
    return tensors


def _write_file(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write ``state`` to ``path`` by way of a temporary sibling (never a torn file)."""
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        unique, aliases = _dedup_shared(state)
        meta = {"format": "pt", **{f"dtensor_ema.{k}": v for k, v in metadata.items()}}
        if aliases:
            meta["dtensor_ema.tied"] = json.dumps(aliases)
        save_file(unique, str(tmp), metadata=meta)
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)


def _dedup_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory: keep the first name of each."""
    seen: dict[tuple[int, int], str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for k, v in state.items():
        ident = (
            (v.untyped_storage().data_ptr(), int(v.storage_offset())) if v.numel() else (id(v), 0)
        )
        if ident in seen:
            aliases[k] = seen[ident]
        else:
            seen[ident] = k
            unique[k] = v.contiguous()
    return unique, aliases


# ----------------------------------------------------------------------- process groups
def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to coordinate on, or ``None`` for one process with no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return process_group if process_group is not None else dist.group.WORLD


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _agree(group: dist.ProcessGroup | None, error: Exception | None, what: str) -> None:
    """All ranks learn which ranks failed ``what``; every rank raises if any did.

    One all-reduce of a flag per rank (no pickling). A failed rank re-raises its own error;
    the others raise a ``RuntimeError`` naming the failed ranks.
    """
    if group is None:
        if error is not None:
            raise error
        return
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=_device(group))
    flags[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(flags, group=group)
    failed = flags.nonzero().flatten().tolist()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; their errors say why")


def _device(group: dist.ProcessGroup) -> torch.device:
    """A device the group's backend can all-reduce on (CPU for gloo, else the accelerator)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*assuming the intent is to", UserWarning)
        yield
