"""Export the averaged weights for inference: from a live EMA, or offline from a checkpoint.

* :func:`export_ema` gathers the full average to the EMA mesh's first rank on the CPU, one
  bounded bucket at a time, and writes one ``torch.save`` or ``.safetensors`` file keyed
  like the model.
* :func:`convert_checkpoint` turns a DCP checkpoint directory into such a file offline: one
  process, no process group.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtensor_ema._collectives import agree_on_call, entering, is_mesh_first, mesh_agree
from dtensor_ema.checkpoint.reader import (
    UnverifiedCheckpointWarning,
    Verify,
    open_checkpoint,
    verification,
)
from dtensor_ema.checkpoint.storage import storage_for
from dtensor_ema.export.state_file import SUFFIXES, check_destination, write_state_file
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.state import EMA_TENSORS

__all__ = ["DEFAULT_EXPORT_BUCKET_BYTES", "SUFFIXES", "convert_checkpoint", "export_ema"]

DEFAULT_EXPORT_BUCKET_BYTES = 64 * 1024 * 1024
"""Gathered bytes per all-gather during export: bounds the transient buffers of every rank."""

_EMA_TENSORS = EMA_TENSORS


def export_ema(
    ema: ModelEMA,
    path: str | os.PathLike[str],
    *,
    bucket_bytes: int = DEFAULT_EXPORT_BUCKET_BYTES,
    format: Literal["file", "peft"] = "file",
) -> None:
    """Write the full EMA weights to one file for inference. **Collective.**

    ``format="peft"``: write the EMA of a PEFT model's adapter as a PEFT adapter directory
    instead (:func:`dtensor_ema.export.peft.export_peft_adapter`, whose rules apply).
    Untracked tensors (``ModelEMA(track=...)``) are written from the model, so the file is
    a whole state dict; its safetensors metadata lists them (``dtensor_ema.from_model``).

    Every rank of the EMA's mesh (``ema.mesh``, and of every FSDP2 mesh) must call this;
    ranks outside it need not (pipeline stages export their own EMAs to their own files).
    The shards travel in flat all-gathers of at most ``bucket_bytes``; the mesh's first rank
    (coordinate ``(0, ...)``, the "writer") assembles one full copy on the CPU, in the
    model's dtypes,
    keyed like the unwrapped model's ``state_dict()`` (integer buffers from the model), and
    writes it to a temporary file that it renames to ``path``. A ``.safetensors`` suffix
    writes safetensors (needs the ``safetensors`` package; tied weights are stored once:
    load with ``safetensors.torch.load_model``), ``.pt``/``.pth`` ``torch.save`` (load with
    ``torch.load(path, weights_only=True)``); other suffixes are refused, and the parent
    directory must exist (nothing is created), both checked on the writer before any
    gather. With ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>`` a rank that does not call this
    makes the others fail after that many seconds, naming it.

    Raises:
        ValueError: an unknown suffix (on the writer; the other ranks raise ``RuntimeError``
            naming it).
        FileNotFoundError: the parent directory of ``path`` does not exist (likewise).
        ImportError: a ``.safetensors`` path without the ``safetensors`` package.
        RuntimeError: writing failed on the writer (raised on every rank of the mesh).

    Peak extra memory: on the writer one full CPU copy of the EMA plus one bucket; on the
    others one bucket, when the writer is global rank 0. A mesh that excludes global rank 0
    (a pipeline stage) gathers the full copy on every rank of it. Communication: one small
    all-reduce per mesh dim before and after, plus the gathers, after
    :func:`~dtensor_ema._collectives.agree_on_call` (which call, which EMA, which count).
    """
    if format == "peft":
        from dtensor_ema.export.peft import export_peft_adapter

        export_peft_adapter(ema, path, bucket_bytes=bucket_bytes)
        return
    if format != "file":
        raise ValueError(f"format must be 'file' or 'peft', got {format!r}")
    with entering("export_ema", mesh=ema.mesh):
        agree_on_call("export_ema", ema.engine.call_identity, mesh=ema.mesh)
        _export(ema, Path(path), bucket_bytes)


def _export(ema: ModelEMA, path: Path, bucket_bytes: int) -> None:
    mesh = ema.mesh
    writer = is_mesh_first(mesh)
    error: Exception | None = check_destination(path) if writer else None
    if path.suffix == ".safetensors" and error is None:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            error = ImportError(f"writing {path} needs the safetensors package: {e}")
    mesh_agree(mesh, error, f"exporting the EMA to {path}")
    # get_ema_state_dict's only_rank0_receives keeps the result on *global* rank 0; a mesh
    # without it (a pipeline stage) gathers everywhere and only its first rank writes.
    global_first = mesh is None or mesh.mesh.flatten()[0].item() == 0
    state = ema.get_ema_state_dict(
        only_rank0_receives=global_first,
        cpu_offload=True,
        bucket_bytes=bucket_bytes,
        include_untracked=True,
    )
    updates = ema.updates
    metadata = {"updates": str(updates)}
    if ema.untracked:
        metadata["from_model"] = json.dumps(ema.untracked)
    if writer:
        try:
            write_state_file(state, path, metadata)
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    del state
    mesh_agree(mesh, error, f"writing the EMA to {path}")


def convert_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    key: str = "ema",
    dtype: torch.dtype | None = None,
    verify: Verify = True,
) -> dict[str, torch.Tensor]:
    """Turn the EMA in a DCP checkpoint into one file keyed by the model's fqns. Offline.

    Runs in one process and needs no process group (nor the model); the checkpoint may have
    been saved at any world size, from DDP or FSDP2. Holds one full copy of the EMA in
    memory. The file has the averaged tensors only, in the EMA's dtype (or ``dtype``):
    integer buffers and the duplicate names of tied weights are not averaged, and an EMA
    built with ``track=`` (a LoRA run's adapters) saved only the tensors it tracked (the
    checkpoint's ``config`` lists the ``untracked`` ones, which it does not hold), so load
    it with ``model.load_state_dict(sd, strict=False)`` (or export from a live EMA with
    :func:`export_ema` for a strict-loadable file, the untracked tensors from the model).
    ``.safetensors`` paths are written with safetensors (the saved counter and options go
    into its metadata), others with
    ``torch.save`` (``.pt``/``.pth``; other suffixes and missing parent directories are
    refused before anything is read).

    Reads as :func:`~dtensor_ema.load_checkpoint` does (:mod:`dtensor_ema.checkpoint.reader`): no
    code
    from the checkpoint runs (restricted ``.metadata``, ``weights_only`` values; an entry
    that is not a tensor or plain value is refused, naming it); every data file must be a
    plain file name inside ``checkpoint_dir``, and every tensor's chunks must cover it
    exactly once (so no row of the file is left as ``torch.empty`` memory); with
    ``verify=True`` (default) ``.metadata`` and the bytes it reads are checked against the
    checksums :func:`~dtensor_ema.save_checkpoint` recorded, before they are deserialized,
    and a checksum file of another save (or of none) is refused. Without checksum files,
    ``verify=True`` warns once (:class:`~dtensor_ema.checkpoint.reader.UnverifiedCheckpointWarning`)
    and ``verify="require"`` refuses. What it allocates is bounded by the checkpoint's files:
    every tensor's elements must be stored in its data files (checked from ``.metadata``
    before anything is allocated); an entry filed under another entry's name
    (``planner_data``) or holding another dtype than ``.metadata`` says is refused, never
    written under the wrong name or cast.

    Returns:
        The ``fqn -> tensor`` dict that was written.

    Raises:
        FileNotFoundError: no complete checkpoint at ``checkpoint_dir``, or no directory
            for ``path``.
        ValueError: the checkpoint has no EMA tensors under ``key``, or ``path`` has an
            unknown suffix.
        CheckpointError: ``.metadata`` refers to a global that is not DCP metadata (nothing
            was run), is not what DCP writes (other types, sizes beyond its files, an
            aliased entry), names a file outside ``checkpoint_dir`` or leaves part of a
            tensor uncovered; an entry is not a tensor or plain value, corrupted or
            retyped; a checksum differs or belongs to another save (``verify``), or there
            are none (``verify="require"``); or DCP failed.
    """
    error = check_destination(Path(path))
    if error is not None:
        raise error
    checkpoint = open_checkpoint(storage_for(checkpoint_dir).committed())
    check, unverified = verification(checkpoint, verify)
    checkpoint.check_files()
    planner_data = checkpoint.metadata.planner_data or {}
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    for k, md in checkpoint.entries_under((key,)).items():
        where = planner_data.get(k, ())
        if isinstance(md, TensorStorageMetadata) and tuple(where[:2]) == (key, _EMA_TENSORS):
            tensors[".".join(str(p) for p in where[2:])] = torch.empty(
                md.size, dtype=md.properties.dtype
            )
        elif len(where) == 2:
            extras[str(where[1])] = None
    if not tensors:
        raise ValueError(
            f"checkpoint {checkpoint.path} has no EMA tensors under {key!r}; its top-level "
            f"entries are {sorted(checkpoint.top_level_keys())}"
        )
    state = {key: {_EMA_TENSORS: tensors, **extras}}
    if check:
        checkpoint.verify_metadata()
    # Every element of these torch.empty tensors is written: open_checkpoint checked that
    # the saved chunks cover each tensor exactly once.
    checkpoint.load(state, group=None, verify=check)
    if unverified is not None:
        warnings.warn(unverified, UnverifiedCheckpointWarning, stacklevel=2)
    tensors = state[key][_EMA_TENSORS]
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    saved = {
        k: v if isinstance(v, str) else json.dumps(v)
        for k, v in state[key].items()
        if k != _EMA_TENSORS
    }
    write_state_file(tensors, Path(path), saved)
    return tensors
