"""DeepSpeed ZeRO-3 partitions on the device: the ``zero3`` rows of the ``multirank`` section.

The GPU machine has no DeepSpeed (and DeepSpeed's engine wants NCCL, which refuses several
ranks on one device), but the EMA never calls DeepSpeed: it reads the attributes DeepSpeed
0.19.8 sets on every ZeRO-3 parameter (:mod:`dtensor_ema.zero_partition`). These rows set
exactly those attributes on the suite's transformer, on the device, so that every CUDA path
of the ZeRO-3 entries runs: the layout (``FlatPartition``), the fused update of each
partition (eager, CUDA-graph replay, the offload updaters), the swap into the partitions,
the real-shape gathers of ``get_model_state_dict``, and a DCP save (W = 4, ``FlatChunks``)
loaded at W = 2 (a resharding) and in one process with no process group into a plain model.

Emulation (``deepspeed 0.19.8``, ``runtime/zero/partition_parameters.py``): each parameter
``p`` gets ``ds_shape``, ``ds_numel``, ``ds_process_group`` (the default group),
``ds_persist = False`` and ``ds_tensor``, rank ``r``'s flat range ``[r*c, (r+1)*c)`` of the
flattened tensor with ``c = ceil(numel / W)``, zero-padded past ``numel``, on the device;
``p`` itself becomes a ``(0,)`` placeholder as between DeepSpeed's gathers. Training is a
seeded perturbation written into each rank's partition (no forward: the placeholders
cannot run one without DeepSpeed's hooks); the full weights it leads to are kept on the CPU,
where the reference (``lerp_`` on full tensors, written here) takes every step.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_checks import (
    DECAY,
    DTYPES,
    STEPS,
    TAU,
    attempt,
    differing,
    failed_load,
    full_cpu,
    load_and_compare,
    ramp,
    save_in_background,
    verdict,
    with_chunked,
)
from torch import nn

LAYOUT = "zero3 (DeepSpeed's attributes)"


def _deepspeed_note() -> str:
    try:
        import deepspeed
    except Exception as err:  # not installed on the GPU machine
        return f"not importable here ({type(err).__name__}); attributes as 0.19.8 sets them"
    return f"deepspeed {deepspeed.__version__} importable; attributes as 0.19.8 sets them"


def _unique(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())  # tied parameters once, under their first name


def partition(model: nn.Module, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Make every parameter of ``model`` a ZeRO-3 parameter of ``world`` ranks (this one
    ``rank``) as DeepSpeed lays it out; returns the full weights (CPU copies) it held."""
    full = {}
    with torch.no_grad():
        for name, p in _unique(model).items():
            full[name] = p.detach().to("cpu", copy=True)
            numel = p.numel()
            chunk = math.ceil(numel / world)
            padded = torch.zeros(chunk * world, dtype=p.dtype, device=p.device)
            padded[:numel] = p.detach().flatten()
            p.ds_shape, p.ds_numel = p.shape, numel  # type: ignore[attr-defined]
            p.ds_process_group = dist.group.WORLD  # type: ignore[attr-defined]
            p.ds_persist = False  # type: ignore[attr-defined]
            p.ds_tensor = padded[rank * chunk : (rank + 1) * chunk].clone()  # type: ignore[attr-defined]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return full


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value from the partitions (``all_gather_into_tensor`` of
    ``ds_tensor``, padding cut, in ``ds_shape``), on the CPU. Collective (default group)."""
    out = {}
    for name, p in _unique(model).items():
        part = p.ds_tensor.detach().contiguous()  # type: ignore[attr-defined]
        rows = torch.empty(
            dist.get_world_size() * part.numel(), dtype=part.dtype, device=part.device
        )
        dist.all_gather_into_tensor(rows, part)
        out[name] = rows[: p.ds_numel].view(p.ds_shape).cpu()  # type: ignore[attr-defined]
    return out


@torch.no_grad()
def perturb(model: nn.Module, full: dict[str, torch.Tensor], step: int) -> None:
    """A seeded step on the full weights (``full``, CPU, in place) and the same step on this
    rank's partition of each parameter (local: no collective)."""
    g = torch.Generator().manual_seed(2000 + step)
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, p in _unique(model).items():
        noise = (torch.randn(full[name].shape, generator=g) * 0.01).to(full[name].dtype)
        full[name].add_(noise)
        chunk = math.ceil(p.ds_numel / world)  # type: ignore[attr-defined]
        start = min(rank * chunk, p.ds_numel)  # type: ignore[attr-defined]
        end = min(p.ds_numel, start + chunk)  # type: ignore[attr-defined]
        p.ds_tensor[: end - start].copy_(full[name].flatten()[start:end])  # type: ignore[attr-defined]


def build(
    dtype: torch.dtype, device: torch.device, world: int, rank: int
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from models import make_model

    model = make_model("transformer").to(device=device, dtype=dtype)
    return model, partition(model, world, rank)


def run_case(
    dt: str, rank: int, world: int, device: torch.device, save_dir: Path | None
) -> dict[str, Any]:
    """One dtype at this world size: updates of every EMA flavour against the reference,
    the swap, the full state dicts, bytes per rank, and (W = 4) a save."""
    from dtensor_ema import ModelEMA, save_checkpoint

    start = time.perf_counter()
    cuda = device.type == "cuda"
    dtype = DTYPES[dt]
    row: dict[str, Any] = {"world": world, "layout": LAYOUT, "dtype": dt, "device": device.type}
    row["training"] = "perturb (partitions written in place)"
    row["deepspeed"] = _deepspeed_note()
    model, full = build(dtype, device, world, rank)
    opts: dict[str, Any] = {"decay": DECAY, "tau": TAU}
    emas: dict[str, Any] = {"eager": ModelEMA(model, cuda_graph=False, **opts)}
    flavours = {"offload": lambda: ModelEMA(model, offload=True, **opts)}
    if cuda:
        flavours["graph"] = lambda: ModelEMA(model, cuda_graph=True, **opts)
        flavours["offload_chunked"] = lambda: with_chunked(ModelEMA(model, offload=True, **opts))
    else:
        row["update_graph"] = row["update_offload_chunked"] = "skipped: no CUDA"
    for name, make in flavours.items():
        made = attempt(row, f"{name}_built", make)
        if not isinstance(made, str):
            emas[name] = made
            row[f"{name}_built"] = True
    ref = {k: v.to(torch.float32, copy=True) for k, v in full.items()}
    failed: dict[str, Any] = {}
    for step in range(1, STEPS + 1):
        perturb(model, full, step)
        for name, ema in emas.items():
            if name not in failed:
                attempt(failed, name, ema.update)
                if failed.get(name) is None:
                    failed.pop(name, None)
        for k, v in ref.items():
            v.lerp_(full[k].to(v.dtype), 1 - ramp(step))
    for name, ema in emas.items():
        if name in failed:
            row[f"update_{name}"] = failed[name]
            continue
        attempt(
            row,
            f"update_{name}",
            lambda ema=ema: verdict(differing(_full_ema(ema, _shapes(model)), ref)),
        )
    if "graph" in emas:
        graph = emas["graph"].engine.graph
        row["graph_uses"] = emas["graph"].cuda_graph.use
        row["graph_captures"] = None if graph is None else graph.captures
    for name in ("offload", "offload_chunked"):
        if name in emas:
            emas[name].close()
    eager = emas["eager"]
    expected = {k: v.to(dtype) for k, v in ref.items()}

    def swap() -> dict[str, Any]:
        before = gathered(model)
        with eager.average_parameters():
            inside = gathered(model)
        return {
            "weights": verdict(differing(inside, expected)),
            "restored": verdict(differing(gathered(model), before)),
        }

    attempt(row, "swap", swap)

    def materialize() -> dict[str, Any]:
        ema_sd, model_sd = eager.get_model_state_dict()
        return {
            "ema_sd": verdict(differing(_cpu(ema_sd), _with_aliases(expected, ema_sd))),
            "model_sd": verdict(differing(_cpu(model_sd), _with_aliases(full, model_sd))),
        }

    attempt(row, "materialize", materialize)
    row["ema_bytes_rank"] = eager.local_nbytes()
    row["ema_bytes_total"] = sum(v.numel() * v.element_size() for v in ref.values())
    if save_dir is not None:

        def save() -> str:
            save_checkpoint({"ema": eager}, save_dir / f"zero3_{dt}")
            if rank == 0:
                torch.save({"ref": ref, "updates": eager.updates}, save_dir / f"zero3_{dt}.ref.pt")
            return "ok"

        attempt(row, "dcp_save", save)
        attempt(row, "dcp_save_async", lambda: save_in_background(eager, save_dir / f"zero3_{dt}"))
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _full_ema(ema: Any, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The EMA's own tensors (fp32 for bf16 parameters), full, in real shapes, on the CPU
    (``full_tensor`` of the flat ``Shard(0)`` DTensors: collective)."""
    return {k: full_cpu(v).view(shapes[k]) for k, v in ema.ema_tensors().items()}


def _shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {k: torch.Size(p.ds_shape) for k, p in _unique(model).items()}  # type: ignore[attr-defined]


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items() if v.is_floating_point()}


def _with_aliases(values: dict[str, torch.Tensor], keys: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``values`` under every key of ``keys`` (a tied parameter's second name maps to the
    first's tensor; the model's state dict lists both)."""
    from models import make_model

    tied = {}
    seen: dict[int, str] = {}
    for name, p in make_model("transformer").named_parameters(remove_duplicate=False):
        tied[name] = seen.setdefault(id(p), name)
    return {k: values[tied.get(k, k)] for k in keys if tied.get(k, k) in values}


def load_case(dt: str, world: int, device: torch.device, save_dir: Path) -> dict[str, Any]:
    """Load the W = 4 ZeRO-3 checkpoints (blocking and background saves) into this world's
    ZeRO-3 model (the flat ranges cut anew: DCP reshards the real-shape tensors), then a
    corrupted copy, which must change nothing."""
    from dtensor_ema import ModelEMA

    row: dict[str, Any] = {"world": world, "layout": f"load {LAYOUT} W=4 -> W={world}", "dtype": dt}
    model, _ = build(DTYPES[dt], device, world, dist.get_rank())
    ema = ModelEMA(model, decay=DECAY, tau=TAU, cuda_graph=False)
    name, shapes = f"zero3_{dt}", _shapes(model)

    def full(e: Any) -> dict[str, torch.Tensor]:
        return _full_ema(e, shapes)

    attempt(row, "dcp_load", lambda: load_and_compare(ema, save_dir, name, full=full))
    if (save_dir / f"{name}_async").exists():
        attempt(
            row, "dcp_load_async", lambda: load_and_compare(ema, save_dir, name, "_async", full)
        )
    attempt(
        row, "failed_load_unchanged", lambda: failed_load(row, ema, save_dir, name, world, full)
    )
    return row


def load_one_process(dt: str, device: torch.device, save_dir: Path) -> dict[str, Any]:
    """Load the W = 4 ZeRO-3 checkpoint in this process, no process group, into the plain
    model on ``device``."""
    from gpu_checks import load_one_process as load_plain

    row = load_plain("zero3", dt, device, save_dir)
    row["layout"] = f"load {LAYOUT} W=4 -> one process"
    return row
