"""The EMA (or the raw weights) in Hugging Face format, through torchtitan's own adapter.

A torchtitan model spec carries a ``state_dict_adapter`` whose ``to_hf`` maps the model's
``state_dict()`` keys to the Hugging Face checkpoint's (permuting Llama's Q/K rows for
RoPE, splitting grouped experts, ...) and whose ``from_hf`` maps them back. ``to_hf``
silently skips keys it does not know, so :func:`check_to_hf_keys` runs both directions on
shape-only (meta) tensors first and refuses a state dict that would lose a key.

Feed :func:`export_hf` the model's own keys, e.g. ``ema.get_ema_state_dict()`` (the model's
state-dict hooks applied: torchtitan's fused ``wqkv`` comes out as ``wq``/``wk``/``wv``, the
keys ``to_hf`` knows). No torchtitan import: the adapter is any object with ``to_hf`` and
``from_hf``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["StateDictAdapter", "check_to_hf_keys", "export_hf"]

_CONFIG_FILES = ("config.json", "generation_config.json")


class StateDictAdapter(Protocol):
    """What :func:`export_hf` needs of torchtitan's ``BaseStateDictAdapter``."""

    hf_assets_path: str | None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]: ...

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]: ...


def check_to_hf_keys(sd_adapter: StateDictAdapter, state_dict: Mapping[str, Any]) -> None:
    """Refuse a ``state_dict`` that ``sd_adapter.to_hf`` would not carry whole.

    Runs ``from_hf(to_hf(...))`` on meta tensors of the same shapes and dtypes (DTensors:
    their global shapes) and compares the keys. Local, no communication; no tensor memory.

    Raises:
        ValueError: ``to_hf`` dropped keys (or ``from_hf`` does not give them back), naming
            the first few; usually a state dict in other keys than the model's own (canonical
            fqns of a fused parameter, an EMA's internal names), or a model the adapter does
            not describe.
    """
    meta = {
        k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor)
    }
    back = sd_adapter.from_hf(dict(sd_adapter.to_hf(dict(meta))))
    lost = sorted(set(meta) - set(back))
    if lost:
        raise ValueError(
            f"{type(sd_adapter).__name__}.to_hf drops {len(lost)} of {len(meta)} keys, e.g. "
            f"{lost[:5]}: pass the model's own state_dict() keys (get_ema_state_dict() gives "
            "them), for the model this adapter was built for"
        )


def export_hf(
    state_dict: Mapping[str, torch.Tensor],
    sd_adapter: StateDictAdapter,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write full weights in Hugging Face format: ``path/model.safetensors``.

    Args:
        state_dict: full (plain) tensors keyed like the model's ``state_dict()``: an EMA's
            ``get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)`` on rank 0, or
            the raw model's full state dict.
        sd_adapter: the model spec's adapter, e.g. ``spec.state_dict_adapter(spec.model,
            hf_assets_path)``. When its ``hf_assets_path`` holds ``config.json`` (and
            ``generation_config.json``), they are copied beside the weights, so
            ``from_pretrained(path)`` loads the folder.
        path: output folder (created).
        dtype: cast floating-point tensors to it (torchtitan's ``export_dtype``); ``None``
            keeps theirs.

    Local: call it on one rank. Peak extra memory: what ``to_hf`` allocates (torchtitan's
    Llama adapter copies Q and K), plus copies of tensors that share storage (safetensors
    refuses shared storage) and of cast ones.

    Returns:
        The written ``model.safetensors`` file.

    Raises:
        ValueError: ``to_hf`` would drop keys (:func:`check_to_hf_keys`), or a value is a
            DTensor (gather it first).
    """
    from safetensors.torch import save_file

    distributed = [k for k, v in state_dict.items() if hasattr(v, "full_tensor")]
    if distributed:
        raise ValueError(
            f"export_hf takes full tensors; {distributed[:3]} are DTensors: gather them "
            "(get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)) first"
        )
    check_to_hf_keys(sd_adapter, state_dict)
    hf = sd_adapter.to_hf(dict(state_dict))
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in hf.items():
        t = value.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        storages.add(ptr)
        tensors[key] = t
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    save_file(tensors, str(target), metadata={"format": "pt"})
    assets = sd_adapter.hf_assets_path
    for name in _CONFIG_FILES:
        source = Path(assets, name) if assets else None
        if source is not None and source.is_file():
            shutil.copyfile(source, out / name)
    return target
