"""What every rank runs: the measurements, interleaved, returned as plain values.

One spawn per world size runs every model and every measurement (a spawn costs ~10 s on
this machine). Within a measurement all implementations take turns, rotating the order each
repeat, after a barrier so that every rank runs the same implementation at the same time
(the ranks share the memory bus; on this 2-core machine, at W=4, also the cores).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from workloads import DECAY, GPT, ModelSpec, build_model, get_spec, replicated_baselines

from dtensor_ema import ModelEMA

GiB = 1024**3
# Per-process footprint of torch + timm + torchvision before any model (measured ~0.4 GiB).
PROCESS_OVERHEAD = int(0.5 * GiB)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class Config:
    """What to run; identical on every rank."""

    models: tuple[str, ...]
    fsdp_models: tuple[str, ...]
    param_dtype: str
    device: str
    warmup: int
    reps: int
    mat_reps: int
    mem_budget_gib: float


# --------------------------------------------------------------------------- timing
def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def interleaved(
    impls: dict[str, Callable[[], object]], *, warmup: int, reps: int, sync: Callable[[], None]
) -> dict[str, dict[str, list[float]]]:
    """Wall and thread-CPU seconds of each call, ``reps`` per implementation, interleaved.

    Collective implementations are safe here: every rank walks the same order.
    """
    names = list(impls)
    for _ in range(warmup):
        for name in names:
            impls[name]()
    sync()
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            sync()
            w0, c0 = time.perf_counter(), time.thread_time()
            impls[name]()
            sync()
            out[name]["wall"].append(time.perf_counter() - w0)
            out[name]["cpu"].append(time.thread_time() - c0)
    return out


def count_collectives(fn: Callable[[], object]) -> int:
    """c10d collectives ``fn`` issues (DTensor's CommDebugMode sees the c10d ops at the
    dispatcher, direct ``dist.*`` calls included; the flat all-gather reference shows 1)."""
    with CommDebugMode() as comm:
        fn()
    return comm.get_total_counts()


# --------------------------------------------------------------------------- helpers
def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unique_float(model: nn.Module) -> list[torch.Tensor]:
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return [t for t in unique.values() if t.is_floating_point()]


COPY_REF_CAP = 256 * 1024**2
"""Largest ``copy_`` reference buffer: 8x the 32 MiB L3 here, so still a DRAM-bound copy."""


def _copy_ref(touched: int, device: torch.device) -> tuple[Callable[[], object], int]:
    """A flat ``copy_`` reading and writing ``touched / 2`` bytes each way (capped); the
    bandwidth ratio compares bytes per second, so the cap only bounds memory."""
    numel = min(touched // 2, COPY_REF_CAP) // 4
    src = torch.empty(numel, dtype=torch.float32, device=device).normal_()
    dst = torch.zeros_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()


def _fits(per_rank: int, world_size: int, cfg: Config, device: torch.device) -> str | None:
    """``None`` if ``world_size`` ranks of ``per_rank`` bytes fit the host budget, else why."""
    if device.type != "cpu":
        return None
    need = world_size * (per_rank + PROCESS_OVERHEAD)
    if need <= cfg.mem_budget_gib * GiB:
        return None
    return f"needs ~{need / GiB:.1f} GiB of host memory > --mem-budget-gib {cfg.mem_budget_gib}"


def _all_agree(reason: str | None) -> str | None:
    """Every rank takes the same branch (a skip on one rank must not hang the others)."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r), None)


# --------------------------------------------------------------------------- measurements
def bench_update_and_materialize(
    spec: ModelSpec, cfg: Config, mesh: DeviceMesh, device: torch.device
) -> dict[str, Any]:
    """Items 1-4: update time, bandwidth vs copy_, EMA memory, materialization."""
    world_size = mesh.size()
    dtype = getattr(torch, cfg.param_dtype)
    sync = _sync_fn(device)
    with torch.device("meta"):
        shape_only = spec.build().to(dtype)
    floats = _unique_float(shape_only)
    model_bytes = _nbytes(floats)
    ema_total = sum(
        t.numel() * 4 if t.element_size() < 4 else t.numel() * t.element_size() for t in floats
    )
    max_tensor = max(t.numel() * 4 for t in floats)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in shape_only.parameters()),
        "n_tensors": len(floats),
        "model_bytes": model_bytes,
        "ema_total_bytes": ema_total,
    }
    del shape_only, floats
    shard = ema_total // world_size
    resident = model_bytes + shard
    # + the shared baseline replica, the copy_ buffers, and the fresh EMA copy that the
    # re-plan path allocates.
    update_peak = resident + ema_total + 2 * min(3 * shard // 2, COPY_REF_CAP) + shard
    skip = _all_agree(_fits(update_peak, world_size, cfg, device))
    if skip:
        out["skipped"] = skip
        return out

    model = build_model(spec, dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ema = ModelEMA(model, mesh=mesh, decay=DECAY)
    if device.type == "cuda":
        out["cuda_ema_allocated"] = torch.cuda.memory_allocated() - before
        out["cuda_ema_peak"] = torch.cuda.max_memory_allocated() - before
    out["local_nbytes"] = ema.local_nbytes()
    out["local_numel"] = ema.local_numel()
    # Bytes the update moves: EMA shard read + write, model shard read (model dtype).
    touched = (
        2 * ema.local_nbytes() + ema.local_numel() * torch.empty((), dtype=dtype).element_size()
    )
    out["touched_bytes"] = touched
    copy_ref, out["copy_ref_bytes"] = _copy_ref(touched, device)
    baselines = replicated_baselines(model, fp32_ema=dtype != torch.float32)
    stranger = nn.Module()
    stranger_buffer = torch.zeros(1)

    def update_after_registration() -> None:
        # Any module registering a tensor bumps the epoch that update() watches.
        stranger.register_buffer("b", stranger_buffer)
        ema.update()

    impls: dict[str, Callable[[], object]] = {
        "dtensor_ema": ema.update,
        "dtensor_ema_replan": update_after_registration,
        **baselines,
        "copy_ref": copy_ref,
    }
    out["update_comms"] = count_collectives(ema.update)
    out["update"] = interleaved(impls, warmup=cfg.warmup, reps=cfg.reps, sync=sync)
    del impls, baselines, copy_ref
    gc.collect()

    # Materialization: everything below is collective and run in the same order on all ranks.
    bucket = min(512 * 1024**2, ema_total)
    mat_peak = resident + ema_total + shard  # + the reference's kept output and input
    mat_peak += max(
        ema_total + model_bytes + bucket + bucket // world_size,  # get_model_state_dict
        ema_total + 2 * max_tensor,  # full_tensor() per tensor (pads uneven shards)
    )
    skip = _all_agree(_fits(mat_peak, world_size, cfg, device))
    if skip:
        out["materialize_skipped"] = skip
        return out
    dtensors = [t for t in ema.ema_tensors().values() if isinstance(t, DTensor)]
    chunk = -(-ema_total // 4 // world_size)  # fp32 elements per rank, padded
    send = torch.zeros(chunk, dtype=torch.float32, device=device)
    group = mesh.get_group()

    recv_kept = torch.zeros(world_size * chunk, dtype=torch.float32, device=device)

    def flat_all_gather() -> None:
        # The reference allocates its output like every materialization must.
        recv = torch.empty(world_size * chunk, dtype=torch.float32, device=device)
        _all_gather_flat(recv, send, group=group)

    mat_impls: dict[str, Callable[[], object]] = {
        "get_model_state_dict": ema.get_model_state_dict,
        "ema_flat_buckets": ema.get_ema_state_dict,  # the EMA half alone
        "full_tensor_each": lambda: [t.full_tensor() for t in dtensors],
        "all_gather_flat_ref": flat_all_gather,
        # What the two numbers above are made of: the wire alone, and fresh memory alone
        # (on CPU the first touch of newly mapped pages costs more than a copy).
        "all_gather_prealloc": lambda: _all_gather_flat(recv_kept, send, group=group),
        "alloc_touch_ref": lambda: torch.empty(world_size * chunk, device=device).fill_(0),
    }
    out["materialize_comms"] = {name: count_collectives(fn) for name, fn in mat_impls.items()}
    out["materialize"] = interleaved(mat_impls, warmup=1, reps=cfg.mat_reps, sync=sync)
    return out


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, GPT):
        return list(model.blocks)
    return [
        block for name in ("layer1", "layer2", "layer3", "layer4") for block in getattr(model, name)
    ]


def bench_fsdp2_swap(
    spec: ModelSpec, cfg: Config, mesh: DeviceMesh, device: torch.device
) -> dict[str, Any]:
    """Item 5: collectives and time of ``average_parameters()`` enter+exit under FSDP2."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(spec, getattr(torch, cfg.param_dtype), device)
    for unit in _fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ema = ModelEMA(model, mesh=mesh, decay=DECAY)
    sharded = [t for t in model.parameters() if isinstance(t, DTensor)]
    replicated_floats = [
        t for t in model.buffers() if t.is_floating_point() and not isinstance(t, DTensor)
    ]
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "dtensor_params": len(sharded),
        "replicated_float_buffers": len(replicated_floats),
        "local_nbytes": ema.local_nbytes(),
    }
    # Move the model away from the EMA so the swap check below can fail.
    with torch.no_grad():
        for p in sharded:
            p.to_local().add_(1.0)
    ema.update()
    fqn, param = max(
        ((k, v) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, DTensor)),
        key=lambda kv: kv[1].numel(),
    )
    before = param.to_local().clone()

    def swap() -> None:
        with ema.average_parameters():
            pass

    with ema.average_parameters():
        inside = param.to_local().clone()
    ema_param = ema.ema_tensors()[fqn]
    assert isinstance(ema_param, DTensor)
    expected = ema_param.to_local().to(param.dtype)
    out["swap_ok"] = bool(
        torch.equal(inside, expected)
        and not torch.equal(inside, before)
        and torch.equal(param.to_local(), before)
    )
    out["swap_comms"] = count_collectives(swap)
    out["update_comms"] = count_collectives(ema.update)
    impls: dict[str, Callable[[], object]] = {
        "update": ema.update,
        "swap_enter_exit": swap,
        "get_model_state_dict": ema.get_model_state_dict,
    }
    out["times"] = interleaved(impls, warmup=1, reps=cfg.mat_reps, sync=_sync_fn(device))
    return out


def rank_main(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    """Body of one rank: every model, every measurement; plain values back."""
    device = torch.device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, (world_size,))
    result: dict[str, Any] = {"rank": rank, "config": asdict(cfg), "models": {}, "fsdp2": {}}
    for name in cfg.models:
        result["models"][name] = bench_update_and_materialize(get_spec(name), cfg, mesh, device)
        gc.collect()
    for name in cfg.fsdp_models:
        result["fsdp2"][name] = bench_fsdp2_swap(get_spec(name), cfg, mesh, device)
        gc.collect()
    dist.barrier()
    return result


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    return {
        "wall_median": statistics.median(samples["wall"]),
        "cpu_median": statistics.median(samples["cpu"]),
        "wall_min": min(samples["wall"]),
    }
