"""Export the EMA of a PEFT model's adapter as a PEFT adapter directory.

A LoRA (or other PEFT) fine-tune trains a few MB of adapters on a frozen base; with
``ModelEMA(peft_model, track="trainable")`` the EMA holds exactly those adapters, ``1/W`` of
their bytes per rank. :func:`export_peft_adapter` gathers them to one rank and writes what
``peft_model.save_pretrained`` writes (``adapter_model.safetensors`` and
``adapter_config.json``, through peft's own ``save_pretrained`` so the keys, the config and
its ``base_model_name_or_path`` are peft's), with the EMA's weights in place of the
training weights. ``PeftModel.from_pretrained(base_model, path)`` loads it.
``export_ema(ema, path, format="peft")`` calls it.

:func:`save_peft_adapter` writes the same directory from a state dict in one process: the
EMA that :func:`~dtensor_ema.synthesize` rebuilds from the snapshots of
``PostHocEMA(peft_model, track="trainable")``, or any ``fqn -> tensor`` dict of the adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema._collectives import agree_on_call, entering, is_mesh_first, mesh_agree
from dtensor_ema.model_ema import ModelEMA

__all__ = ["ADAPTER_FILES", "export_peft_adapter", "save_peft_adapter"]

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
"""What :func:`export_peft_adapter` writes into its directory (peft's file names)."""

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def export_peft_adapter(
    ema: ModelEMA,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[str, torch.Tensor] | None:
    """Write the EMA of ``adapter_name``'s weights as a PEFT adapter directory.
    **Collective.**

    Every rank of the EMA's mesh (and of every FSDP2 mesh) must call this. ``ema`` must
    track a ``peft`` ``PeftModel`` (``get_peft_model``; DDP- or FSDP2-wrapped is fine) and
    every tensor of the adapter (``track="trainable"`` does, while the adapter trains). The
    EMA's tracked tensors travel in flat all-gathers of at most ``bucket_bytes`` to the
    mesh's first rank (coordinate ``(0, ...)``), which writes :data:`ADAPTER_FILES` into
    ``path`` (created if missing; its parent must exist) with peft's own
    ``save_pretrained(..., state_dict=...)``: keys without the adapter name, the adapter's
    config with ``inference_mode=True``. The tensors are in the model's dtypes; the
    safetensors metadata also carries ``dtensor_ema.updates`` and ``dtensor_ema.tensors``
    (``"adapter"``: the base model's weights are not in the file). Files are written into a
    temporary sibling directory and then moved into ``path``, each replaced whole.
    ``PeftModel.from_pretrained(base_model, path)`` loads the adapter (whatever its name
    was).

    Returns:
        On the writer, the ``key -> tensor`` dict that was written (peft's keys); ``None``
        on the other ranks.

    Raises:
        ImportError: ``peft`` or ``safetensors`` is not installed.
        TypeError: the EMA's model is not a ``PeftModel``.
        ValueError: an unknown ``adapter_name``, or adapter tensors the EMA does not track
            (naming them: track them with ``add_tensors`` first), raised on every rank
            before any gather.
        FileNotFoundError: the parent directory of ``path`` does not exist (on the writer;
            the other ranks raise ``RuntimeError`` naming it).
        RuntimeError: writing failed on the writer (raised on every rank of the mesh).

    Peak extra memory: on the writer one full CPU copy of the tracked tensors plus one
    bucket; on the others one bucket (a mesh without global rank 0, a pipeline stage:
    the full copy on every rank of it). Communication: one small all-reduce per mesh dim
    before and after, plus the gathers, after
    :func:`~dtensor_ema._collectives.agree_on_call` (which call, which EMA, which count).
    """
    with entering("export_peft_adapter", mesh=ema.mesh):
        agree_on_call("export_peft_adapter", ema.engine.call_identity, mesh=ema.mesh)
        return _export(ema, Path(path), adapter_name, bucket_bytes)


def _export(
    ema: ModelEMA, path: Path, adapter_name: str, bucket_bytes: int
) -> dict[str, torch.Tensor] | None:
    peft_model = _peft_model(ema.model, adapter_name)
    missing = _untracked_adapter_tensors(ema, peft_model, adapter_name)
    if missing:
        raise ValueError(
            f"the EMA does not track {len(missing)} tensors of adapter {adapter_name!r}: "
            f"{missing[:5]}; export_peft_adapter writes the EMA of every adapter tensor. "
            "Track them (ModelEMA(..., track='trainable'), or ema.add_tensors([...]) on "
            "every rank) before exporting"
        )
    mesh = ema.mesh
    writer = is_mesh_first(mesh)
    error: Exception | None = None
    if writer and not path.parent.is_dir():
        error = FileNotFoundError(
            f"cannot export the adapter to {path}: the directory {path.parent} does not exist"
        )
    mesh_agree(mesh, error, f"exporting the EMA adapter to {path}")
    global_first = mesh is None or mesh.mesh.flatten()[0].item() == 0
    state = ema.get_ema_state_dict(
        only_rank0_receives=global_first, cpu_offload=True, bucket_bytes=bucket_bytes
    )
    info = {"dtensor_ema.updates": str(ema.updates)}
    written: dict[str, torch.Tensor] | None = None
    if writer:
        try:
            written = _write(peft_model, adapter_name, state, path, info)
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    del state
    mesh_agree(mesh, error, f"writing the EMA adapter to {path}")
    return written


def save_peft_adapter(
    peft_model: nn.Module,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    metadata: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write ``state``'s values of ``adapter_name``'s tensors as a PEFT adapter directory.
    Local (one process; no communication).

    For an EMA that is a state dict rather than a live :class:`~dtensor_ema.ModelEMA`: the
    result of :func:`~dtensor_ema.synthesize` or :func:`~dtensor_ema.merge_snapshots` on
    the snapshots of ``PostHocEMA(peft_model, track="trainable")``. ``state`` is keyed like
    ``peft_model.state_dict()`` (extra keys, such as base weights, are ignored) and must
    hold every tensor of the adapter, as full tensors (a distributed synthesis returns
    ``Shard(0)`` DTensors: call ``full_tensor()`` on every rank, then write from one).
    Writes what :func:`export_peft_adapter` writes (peft's own ``save_pretrained``;
    :data:`ADAPTER_FILES`; the tensors in ``state``'s dtypes), with ``metadata`` added to
    the safetensors metadata (``dtensor_ema.tensors = "adapter"`` always).
    ``PeftModel.from_pretrained(base_model, path)`` loads it.

    Returns:
        The ``key -> tensor`` dict that was written (peft's keys).

    Raises:
        ImportError: ``peft`` or ``safetensors`` is not installed.
        TypeError: ``peft_model`` is not a ``PeftModel``, or ``state`` holds DTensors.
        ValueError: an unknown ``adapter_name``, or adapter tensors missing from ``state``
            (naming them).
        FileNotFoundError: the parent directory of ``path`` does not exist.

    Peak extra memory: one copy of the adapter's tensors (peft's selection, re-read once to
    add the metadata).
    """
    model = _peft_model(peft_model, adapter_name)
    sharded = [k for k, v in state.items() if isinstance(v, DTensor)]
    if sharded:
        raise TypeError(
            f"save_peft_adapter needs full tensors, got DTensors {sharded[:3]}: call "
            "full_tensor() on each (on every rank), then save from one rank"
        )
    needed = _adapter_fqns(model, adapter_name)
    missing = [k for k in needed if k not in state]
    if missing:
        raise ValueError(
            f"state lacks {len(missing)} tensors of adapter {adapter_name!r}: {missing[:5]}; "
            "it must hold every adapter tensor (snapshots of PostHocEMA(model, "
            "track='trainable') do, while the adapter trains)"
        )
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(
            f"cannot write the adapter to {target}: the directory {target.parent} does not exist"
        )
    chosen = {k: state[k] for k in needed}
    return _write(model, adapter_name, chosen, target, dict(metadata or {}))


def _adapter_fqns(peft_model: Any, adapter_name: str) -> list[str]:
    """Model keys of ``adapter_name``'s tensors, in state-dict order. Local.

    Peft decides which tensors form the adapter: it is asked to select from meta
    placeholders of every model tensor, and its picks are traced back by identity.
    """
    shapes = {k: v.shape for k, v in peft_model.state_dict(keep_vars=True).items()}
    placeholders = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    owner = {id(v): k for k, v in placeholders.items()}
    selected = _adapter_keys(peft_model, adapter_name, placeholders)
    picked = {owner.get(id(v)) for v in selected.values()}
    return [k for k in placeholders if k in picked]


def _peft_model(model: nn.Module, adapter_name: str) -> Any:
    try:
        from peft import PeftModel
    except ImportError as e:
        raise ImportError(f"exporting a PEFT adapter needs the peft package: {e}") from e
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"export_peft_adapter needs the EMA of a peft PeftModel (get_peft_model(...)), got "
            f"a {type(model).__name__}; for other models use export_ema(ema, 'file.safetensors')"
        )
    if adapter_name not in model.peft_config:
        raise ValueError(
            f"adapter {adapter_name!r} is not one of the model's adapters "
            f"{sorted(model.peft_config)}"
        )
    return model


def _adapter_keys(peft_model: Any, adapter_name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Peft's selection of ``adapter_name``'s tensors out of ``tensors`` (model keys)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(
        peft_model, state_dict=tensors, adapter_name=adapter_name, save_embedding_layers=False
    )


def _untracked_adapter_tensors(ema: ModelEMA, peft_model: Any, adapter_name: str) -> list[str]:
    """Model fqns of the adapter's tensors that the EMA does not hold. Local.

    Peft decides which tensors form the adapter: it is asked to select from meta
    placeholders of every model tensor, and its picks are traced back by identity.
    """
    plan = ema.engine.plan
    shapes = {e.fqn: e.shape for e in plan}
    shapes.update((k, t.shape) for k, t in plan.untracked.items())
    placeholders = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    owner = {id(v): k for k, v in placeholders.items()}
    for alias, target in plan.aliases.items():
        if target in placeholders:
            placeholders[alias] = placeholders[target]
    selected = _adapter_keys(peft_model, adapter_name, placeholders)
    picked = [owner.get(id(v)) for v in selected.values()]
    return [k for k in dict.fromkeys(picked) if k is not None and k in plan.untracked]


def _write(
    peft_model: Any,
    adapter_name: str,
    state: dict[str, torch.Tensor],
    path: Path,
    info: dict[str, str],
) -> dict[str, torch.Tensor]:
    """Peft's ``save_pretrained`` into a temporary sibling, metadata added, files moved in."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        peft_model.save_pretrained(
            str(staging),
            selected_adapters=[adapter_name],
            save_embedding_layers=False,
            state_dict=state,
        )
        out = staging if adapter_name == "default" else staging / adapter_name
        weights = out / ADAPTER_FILES[0]
        with safe_open(str(weights), "pt") as f:
            written = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)
            metadata = dict(f.metadata() or {})
        metadata.update(
            {
                **info,
                "dtensor_ema.tensors": "adapter",
                "dtensor_ema.adapter_name": adapter_name,
            }
        )
        save_file(written, str(weights), metadata=metadata)
        config = json.loads((out / ADAPTER_FILES[1]).read_text())
        if not written:
            raise ValueError(f"peft selected no tensors of adapter {adapter_name!r}: {config}")
        path.mkdir(exist_ok=True)
        for name in ADAPTER_FILES:
            os.replace(out / name, path / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
