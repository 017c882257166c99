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

import json
import math
import os
import shutil
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dtensor_ema._collectives import agree, all_reduce, reduce_device
from dtensor_ema.model_keys import live_tensors, to_model_keys

if TYPE_CHECKING:
    from dtensor_ema.integrations.torchtitan.ema import TorchtitanEMA

__all__ = [
    "EXPORT_BUCKET_BYTES",
    "HF_FILE",
    "SafetensorsFile",
    "StateDictAdapter",
    "check_to_hf_keys",
    "copy_hf_configs",
    "export_hf",
    "hf_layout",
    "keys_mapped_jointly",
    "stream_hf",
    "write_hf_tensors",
]

HF_FILE = "model.safetensors"
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


Spec = tuple[tuple[int, ...], torch.dtype]
"""A tensor's global shape and dtype."""

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def _meta(specs: Mapping[str, Spec]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in specs.items()}


def _spec(t: torch.Tensor) -> Spec:
    return tuple(t.shape), t.dtype


def hf_layout(
    sd_adapter: StateDictAdapter, specs: Mapping[str, Spec], dtype: torch.dtype | None = None
) -> dict[str, Spec]:
    """``HF key -> (shape, dtype)`` of ``sd_adapter.to_hf`` of a state dict of ``specs``
    (``model key -> (shape, dtype)``), floating-point dtypes cast to ``dtype`` when given.
    Runs on meta tensors: local, no tensor memory."""
    out = {}
    for key, value in sd_adapter.to_hf(_meta(specs)).items():
        shape, dt = _spec(value)
        if dtype is not None and value.is_floating_point():
            dt = dtype
        out[key] = (shape, dt)
    return out


def keys_mapped_jointly(sd_adapter: StateDictAdapter, specs: Mapping[str, Spec]) -> list[str]:
    """The model keys that ``to_hf`` does not map on their own as it maps them in the whole
    state dict (a key whose HF tensors need another key): the export streams key by key,
    so it needs none. Local, on meta tensors. torchtitan 0.3.0's adapters (llama3, qwen3,
    deepseek_v3, gpt_oss) map every key on its own."""
    whole = {k: _spec(v) for k, v in sd_adapter.to_hf(_meta(specs)).items()}
    seen: dict[str, Spec] = {}
    joint = []
    for key, spec in specs.items():
        alone = {k: _spec(v) for k, v in sd_adapter.to_hf(_meta({key: spec})).items()}
        if any(k in seen or whole.get(k) != v for k, v in alone.items()):
            joint.append(key)
        seen.update(alone)
    if set(seen) != set(whole):  # HF tensors only keys together give
        joint += [k for k in specs if k not in joint and not sd_adapter.to_hf(_meta({k: specs[k]}))]
    return joint or ([] if set(seen) == set(whole) else list(specs))


class SafetensorsFile:
    """One ``.safetensors`` file written tensor by tensor, by one or several processes.

    ``layout`` (``key -> (shape, dtype)``, in file order) fixes the header and every
    tensor's byte range up front: :meth:`create` (one process) writes the header and sizes
    the file; then any process may :meth:`write` any tensor of the layout at its offset
    (``os.pwrite``: the file must be on a file system every writer sees). The result is a
    plain safetensors file (``safetensors.torch.load_file`` reads it).
    """

    def __init__(self, path: str | os.PathLike[str], layout: Mapping[str, Spec]) -> None:
        self.path = Path(path)
        self.layout = dict(layout)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for key, (shape, dt) in self.layout.items():
            if dt not in _DTYPES:
                raise ValueError(f"{key}: safetensors has no dtype {dt}")
            size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            self.offsets[key] = (start, start + size)
            header[key] = {
                "dtype": _DTYPES[dt],
                "shape": list(shape),
                "data_offsets": [start, start + size],
            }
            start += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._header = struct.pack("<Q", len(raw)) + raw
        self.size = len(self._header) + start
        self.written: list[str] = []

    def create(self) -> None:
        """Write the header and size the file (truncating an existing one). Local."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            f.write(self._header)
            f.truncate(self.size)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (a CPU tensor of the layout's shape and dtype) as ``key``. Local.

        Raises:
            KeyError: ``key`` is not in the layout.
            ValueError: another shape or dtype.
        """
        if key not in self.offsets:
            raise KeyError(f"{key!r} is not a tensor of {self.path}")
        shape, dt = self.layout[key]
        if tuple(tensor.shape) != shape or tensor.dtype != dt:
            raise ValueError(
                f"{key}: expected {shape} {dt} for {self.path}, got {tuple(tensor.shape)} "
                f"{tensor.dtype}"
            )
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
        position = len(self._header) + self.offsets[key][0]
        fd = os.open(self.path, os.O_WRONLY)
        try:
            while data:
                done = os.pwrite(fd, data, position)
                data, position = data[done:], position + done
        finally:
            os.close(fd)
        self.written.append(key)


def write_hf_tensors(
    out: SafetensorsFile,
    state_dict: dict[str, torch.Tensor],
    sd_adapter: StateDictAdapter,
) -> None:
    """Convert ``state_dict`` (full tensors keyed like the model; consumed: each entry is
    popped) key by key with ``sd_adapter.to_hf`` and write the results into ``out``, cast
    to its layout's dtypes. Local. Peak extra memory: what ``to_hf`` and the cast allocate
    for one tensor."""
    while state_dict:
        key = next(iter(state_dict))
        hf = sd_adapter.to_hf({key: state_dict.pop(key)})
        while hf:
            hf_key, value = hf.popitem()
            target = out.layout[hf_key][1] if hf_key in out.layout else value.dtype
            out.write(hf_key, value.detach().to(target))
            del value


def copy_hf_configs(sd_adapter: StateDictAdapter, out: Path) -> None:
    """Copy ``config.json`` and ``generation_config.json`` from the adapter's
    ``hf_assets_path`` (when there) into ``out``, so ``from_pretrained(out)`` works."""
    assets = sd_adapter.hf_assets_path
    for name in _CONFIG_FILES:
        source = Path(assets, name) if assets else None
        if source is not None and source.is_file():
            shutil.copyfile(source, out / name)


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

    Local: call it on one rank. The file is written tensor by tensor (:class:`SafetensorsFile`):
    peak extra memory is what ``to_hf`` and the cast allocate for one tensor (torchtitan's
    Llama adapter copies Q and K), when the adapter maps each key on its own
    (:func:`keys_mapped_jointly`; else ``to_hf`` of the whole dict first).
    :meth:`~dtensor_ema.integrations.torchtitan.trainer.EMATrainer.export_hf` gathers and
    writes bucket by bucket on top of this, with no full copy of the model on any rank.

    Returns:
        The written ``model.safetensors`` file.

    Raises:
        ValueError: ``to_hf`` would drop keys (:func:`check_to_hf_keys`), or a value is a
            DTensor (gather it first).
    """
    distributed = [k for k, v in state_dict.items() if hasattr(v, "full_tensor")]
    if distributed:
        raise ValueError(
            f"export_hf takes full tensors; {distributed[:3]} are DTensors: gather them "
            "(get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)) first"
        )
    check_to_hf_keys(sd_adapter, state_dict)
    specs = {k: _spec(v) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    out = Path(path)
    stream = SafetensorsFile(out / HF_FILE, hf_layout(sd_adapter, specs, dtype))
    stream.create()
    if keys_mapped_jointly(sd_adapter, specs):
        for key, value in sd_adapter.to_hf(dict(state_dict)).items():
            stream.write(key, value.detach().to(stream.layout[key][1]))
    else:
        write_hf_tensors(stream, dict(state_dict), sd_adapter)
    missing = sorted(set(stream.layout) - set(stream.written))
    if missing:  # pragma: no cover - to_hf of the parts gave what to_hf of the whole gave
        raise RuntimeError(f"{stream.path}: {missing[:5]} were not written")
    copy_hf_configs(sd_adapter, out)
    return stream.path


EXPORT_BUCKET_BYTES = 256 * 1024 * 1024
"""Default bound on the full tensors one bucket of :func:`stream_hf` gathers."""


def stream_hf(
    ema: TorchtitanEMA,
    model_parts: list[nn.Module],
    sd_adapter: StateDictAdapter,
    path: str | os.PathLike[str],
    *,
    stage_ranks: Sequence[int] | None = None,
    name: str | None = None,
    raw: bool = False,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = EXPORT_BUCKET_BYTES,
) -> Path | None:
    """Write EMA ``name`` of ``ema`` (default: the first), or with ``raw=True`` the weights
    of ``model_parts``, as ``path/model.safetensors`` in Hugging Face format, streamed.

    **Collective**: every rank of the default process group calls it. The header (every HF
    tensor's name, shape, dtype and byte range, from ``to_hf`` on meta tensors of the whole
    model: one ``all_gather_object`` of the ranks' key lists) is written by rank 0 first;
    then each model part is gathered bucket by bucket
    (:meth:`dtensor_ema.ModelEMA.iter_state_dict`: at most ``bucket_bytes`` of full
    tensors, or one larger tensor, per bucket) to one writer per pipeline stage, which
    converts each tensor with ``to_hf`` and writes it at its offset in the file
    (:class:`SafetensorsFile`). Without pipeline parallelism (``stage_ranks=None``) rank 0
    writes everything, the buckets gathered to it alone; with it (``stage_ranks``: the
    global ranks of this rank's stage) the stage holding rank 0 writes through rank 0,
    every other stage through its first rank (the stage all-gathers each bucket), so
    ``path`` must be on a file system every rank sees. Then one sum all-reduce of the
    tensors written (each exactly once) and one flag all-reduce, so that a failed write
    raises on every rank, with the failing rank's message.

    Peak extra memory per rank: one bucket (``bucket_bytes``, or the largest tensor when
    that is larger) plus one tensor in flight (what ``to_hf`` and the cast to ``dtype``
    allocate for it: torchtitan's Llama adapter permutes Q and K into a copy); a bucket of
    many small tensors is held twice while it is unpacked, so with ``bucket_bytes`` at most
    the largest tensor the peak is at most the largest tensor plus one bucket. Measured in
    ``benchmarks/export_hf_memory.py``: 0.90-0.96 x (largest tensor + bucket) for Llama-3
    8B shapes, the same for 2 and 4 blocks. Ranks that receive no bucket hold their send buffer
    only. ``raw=True`` with the EMA disabled reads each part's own ``state_dict()`` (its
    hooks gather every fused ``wqkv`` first), one gathered tensor at a time.

    Args:
        ema: the EMA (its model parts are ``model_parts``).
        model_parts: this rank's model parts (one per pipeline stage it holds).
        sd_adapter: the model spec's adapter; its ``hf_assets_path``'s ``config.json`` and
            ``generation_config.json`` are copied beside the weights.
        path: output folder (created).
        stage_ranks: the global ranks of this rank's pipeline stage; ``None`` without
            pipeline parallelism.
        name: the EMA to write (default: the first).
        raw: write the model's weights instead.
        dtype: cast floating-point tensors to it; ``None`` keeps the model's.
        bucket_bytes: bound on one bucket's full tensors.

    Returns:
        The written file on rank 0, ``None`` elsewhere.

    Raises:
        NotImplementedError: an adapter whose ``to_hf`` maps some keys only together
            (:func:`keys_mapped_jointly`), with pipeline parallelism; without it each
            model part is then converted whole on rank 0.
        KeyError: no EMA is called ``name``.
        ValueError: ``to_hf`` would drop keys (on every rank).
        OSError: a writer could not write ``path`` (on every rank).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = list(stage_ranks) if stage_ranks is not None else [0]
    writer, with_rank0 = min(ranks), 0 in ranks
    specs: dict[str, Spec] = {}
    for part_specs in _all_ranks(_model_key_specs(model_parts)):
        specs.update(part_specs)
    check_to_hf_keys(sd_adapter, _meta(specs))
    joint = keys_mapped_jointly(sd_adapter, specs)
    if joint and stage_ranks is not None:
        raise NotImplementedError(
            f"{type(sd_adapter).__name__}.to_hf maps {joint[:3]} only together with other "
            "keys: a streamed export under pipeline parallelism converts key by key"
        )
    key = _ema_name(ema, name, raw)
    out = SafetensorsFile(Path(path) / HF_FILE, hf_layout(sd_adapter, specs, dtype))
    group = dist.group.WORLD if dist.is_initialized() else None
    what = f"exporting to {path} in Hugging Face format"
    error: Exception | None = None
    if rank == 0:
        try:
            out.create()
        except OSError as e:
            error = e
    agree(group, error, what)
    pieces = _pieces(
        ema, model_parts, key, raw, with_rank0=with_rank0,
        bucket_bytes=sys.maxsize if joint else bucket_bytes,
    )  # fmt: skip
    for piece in pieces:  # every rank drains every gather, also after a failed write
        if rank == writer and error is None:
            try:
                if joint:
                    for hf_key, value in sd_adapter.to_hf(piece).items():
                        out.write(hf_key, value.detach().to(out.layout[hf_key][1]))
                else:
                    write_hf_tensors(out, piece, sd_adapter)
            except Exception as e:  # the other ranks must not wait for this one
                error = e
        piece.clear()
    written = torch.tensor([len(out.written)], dtype=torch.int64)
    if group is not None:
        written = written.to(reduce_device(group))
        all_reduce(written, group)
    if rank == 0 and error is None:
        try:
            if int(written.item()) != len(out.layout) or len(set(out.written)) != len(out.written):
                raise RuntimeError(
                    f"{out.path}: {int(written.item())} tensors written, {len(out.layout)} in "
                    "its header"
                )
            copy_hf_configs(sd_adapter, out.path.parent)
        except (OSError, RuntimeError) as e:
            error = e
    agree(group, error, what)
    return out.path if rank == 0 else None


def _ema_name(ema: TorchtitanEMA, name: str | None, raw: bool) -> str | None:
    """The EMA to read (for ``raw``, any: its plan reads the model); ``None`` when
    disabled (raw only)."""
    if not ema.names:
        if not raw:
            raise RuntimeError("the EMA is disabled (config.enable=False)")
        return None
    key = ema.names[0] if name is None else name
    if key not in ema.names:
        raise KeyError(f"no EMA named {key!r}; the EMAs are {ema.names}")
    return key


def _pieces(
    ema: TorchtitanEMA,
    model_parts: list[nn.Module],
    key: str | None,
    raw: bool,
    *,
    with_rank0: bool,
    bucket_bytes: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """Full CPU tensors of this rank's model parts, keyed like the model, bucket by bucket
    (gathered to rank 0 alone in its stage, to every rank of the others). Collective over
    each part's mesh."""
    if key is None:
        keep = not with_rank0 or not dist.is_initialized() or dist.get_rank() == 0
        for part in model_parts:
            for k, value in part.state_dict().items():
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                yield {k: full.detach().to("cpu", copy=True)} if keep else {}
        return
    for emas in ema.parts:
        yield from emas[key].iter_state_dict(
            "model" if raw else "ema",
            only_rank0_receives=with_rank0,
            cpu_offload=True,
            bucket_bytes=bucket_bytes,
        )


def _model_key_specs(parts: list[nn.Module]) -> dict[str, Spec]:
    """``model key -> (global shape, dtype)`` of the parts' ``state_dict()`` (their hooks
    run on meta tensors: torchtitan's fused ``wqkv`` gives ``wq``/``wk``/``wv``). Local."""
    out: dict[str, Spec] = {}
    for part in parts:
        meta = {
            k: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            for k, t in live_tensors(part).items()
        }
        out.update({k: _spec(v) for k, v in to_model_keys(part, meta).items()})
    return out


def _all_ranks(value: Any) -> list[Any]:
    """``value`` of every rank (``all_gather_object`` over the default group; ``[value]``
    without one). Collective."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
