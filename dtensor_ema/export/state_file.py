"""One ``fqn -> tensor`` file for inference: ``.safetensors`` or ``torch.save``, never torn.

The writer shared by :func:`~dtensor_ema.export_ema`, :func:`~dtensor_ema.convert_checkpoint`
and :func:`~dtensor_ema.synthesize` / :func:`~dtensor_ema.merge_snapshots`. Local (one
process); nothing here communicates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["SUFFIXES", "check_destination", "write_state_file"]

SUFFIXES = (".pt", ".pth", ".safetensors")
"""File suffixes written: ``torch.save`` for ``.pt``/``.pth``, safetensors for
``.safetensors``."""

_TMP_SUFFIX = ".partial"


def check_destination(path: Path) -> ValueError | FileNotFoundError | None:
    """The error writing ``path`` would meet, or ``None``: a known suffix (:data:`SUFFIXES`)
    and an existing parent directory. Creates nothing, so callers check before any work.
    """
    if path.suffix not in SUFFIXES:
        return ValueError(
            f"cannot export to {path}: unknown suffix {path.suffix!r}; use one of {SUFFIXES} "
            "(.pt/.pth are written with torch.save, .safetensors with safetensors)"
        )
    if not path.parent.is_dir():
        return FileNotFoundError(
            f"cannot export to {path}: the directory {path.parent} does not exist (create it "
            "first; export does not create directories)"
        )
    return None


def write_state_file(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write ``state`` to ``path`` by way of a temporary sibling renamed into place.

    ``.safetensors``: tensors that share memory (tied weights) are stored once, the other
    names listed in the metadata entry ``dtensor_ema.tied``; ``metadata`` goes in as
    ``dtensor_ema.<key>``. Other suffixes: ``torch.save(state)`` (``metadata`` is not
    written). Peak extra memory: a contiguous copy of each non-contiguous tensor
    (safetensors).

    Raises:
        ImportError: a ``.safetensors`` path without the ``safetensors`` package.
        OSError: the file system refused the write (the temporary file may remain).
    """
    tmp = path.with_name(path.name + _TMP_SUFFIX)
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
