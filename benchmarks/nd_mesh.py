"""N-D meshes: per-rank EMA bytes, collectives, and update time against a replicated EMA.

For each torchtitan layout (HSDP 2x2, FSDP2+TP 2x2, TP with a replicated dp dim 2x2, and
the 3-D HSDP+TP 2x2x2 with ``--w8``), on gloo CPU ranks with one thread each:

* max per-rank EMA bytes / (total / W): dtensor_ema against a torchtitan-style EMA
  (``p.detach().clone()`` of every DTensor parameter, which keeps the parameters' own
  placements and so is replicated on every replicate dim);
* collectives issued by ``update()``, ``average_parameters()`` (enter + exit) and
  ``get_model_state_dict()`` (counted with ``CommDebugMode``);
* per-rank ``update()`` time: ours vs the torchtitan-style ``torch._foreach_lerp_`` on
  DTensor clones, interleaved on the same ranks (median of ``--reps``; the slowest rank).

    python benchmarks/nd_mesh.py [--dim 512] [--hidden 2047] [--layers 4] [--reps 30] [--w8]

Writes a markdown table to stdout and ``--out`` (default benchmarks/results/nd_mesh.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dtensor_ema import ModelEMA

DECAY = 0.999


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(dim, hidden) for i in range(layers)})
        self.out = nn.Linear(dim, 10)


def _tp(model: Net, tp_mesh: DeviceMesh) -> None:
    plan = {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(use_local_output=False),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, plan)


def _fsdp(model: Net, mesh: DeviceMesh) -> None:
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _layouts(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    def net() -> Net:
        torch.manual_seed(0)
        return Net(args.dim, args.hidden, args.layers)

    if world_size == 8:
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))

        def hsdp_tp() -> Net:
            m = net()
            _tp(m, world["tp"])
            _fsdp(m, world["rep", "shard"])
            return m

        return {"HSDP+TP 2x2x2": hsdp_tp}
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))

    def hsdp() -> Net:
        m = net()
        _fsdp(m, hsdp_mesh)
        return m

    def fsdp_tp() -> Net:
        m = net()
        _tp(m, world["tp"])
        _fsdp(m, world["dp"])
        return m

    def tp_dp() -> Net:
        m = net()
        _tp(m, world["tp"])
        return m

    return {"HSDP 2x2": hsdp, "FSDP2+TP 2x2": fsdp_tp, "TP + replicated dp 2x2": tp_dp}


def _count(fn: Any) -> int:
    with CommDebugMode() as comm:
        fn()
    return int(comm.get_total_counts())


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _measure(name: str, build: Any, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    model = build()
    params = dict(model.state_dict(keep_vars=True))
    total = sum(t.numel() * t.element_size() for t in params.values() if t.is_floating_point())
    ema = ModelEMA(model, decay=DECAY, tau=None)
    titan = [p.detach().clone() for p in model.parameters()]
    sources = [p.detach() for p in model.parameters()]
    titan_bytes = sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in titan
    )

    kinds = [isinstance(t, DTensor) for t in titan]
    groups = [
        (
            [t for t, k in zip(titan, kinds, strict=True) if k is kind],
            [p for p, k in zip(sources, kinds, strict=True) if k is kind],
        )
        for kind in (True, False)
        if kind in kinds
    ]

    def titan_update() -> None:
        for emas, params in groups:  # torch refuses DTensors and plain tensors in one call
            torch._foreach_lerp_(emas, params, 1 - DECAY)

    def swap() -> None:
        with ema.average_parameters():
            pass

    row: dict[str, Any] = {"layout": name, "W": world_size}
    row["ours_ratio"] = _max(ema.local_nbytes()) / (total / world_size)
    row["titan_ratio"] = _max(titan_bytes) / (total / world_size)
    row["update_coll"] = _max(_count(ema.update))
    row["swap_coll"] = _max(_count(swap))
    row["gsd_coll"] = _max(_count(ema.get_model_state_dict))
    times: dict[str, list[float]] = {"ours": [], "titan": []}
    impls = {"ours": ema.update, "titan": titan_update}
    for _ in range(args.warmup):
        for fn in impls.values():
            fn()
    for rep in range(args.reps):
        for key in list(impls) if rep % 2 == 0 else list(reversed(impls)):
            dist.barrier()
            start = time.perf_counter()
            impls[key]()
            times[key].append(time.perf_counter() - start)
    row["ours_ms"] = _max(statistics.median(times["ours"]) * 1e3)
    row["titan_ms"] = _max(statistics.median(times["titan"]) * 1e3)
    return row


def rank_main(
    rank: int, world_size: int, store_path: str, args: argparse.Namespace, q: Any
) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=600)
    )
    try:
        rows = [_measure(n, b, world_size, args) for n, b in _layouts(world_size, args).items()]
        q.put((rank, rows, None))
    except BaseException:  # report, never hang the parent
        import traceback

        q.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run(world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, world_size, os.path.join(tmp, "store"), args, q))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results = [q.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
    errors = [err for _, _, err in results if err]
    if errors:
        raise RuntimeError(errors[0])
    return next(rows for rank, rows, _ in results if rank == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512, help="model width")
    parser.add_argument("--hidden", type=int, default=2047, help="MLP width (odd: uneven TP)")
    parser.add_argument("--layers", type=int, default=4, help="number of blocks")
    parser.add_argument("--reps", type=int, default=30, help="timed update() calls per impl")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per impl")
    parser.add_argument("--w8", action="store_true", help="also run the 3-D layout at W=8")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "nd_mesh.md"
    )
    args = parser.parse_args()
    rows = run(4, args)
    if args.w8:
        rows += run(8, args)
    lines = [
        f"N-D meshes, gloo CPU, one thread per rank; blocks dim={args.dim}, "
        f"hidden={args.hidden}, layers={args.layers}, fp32; torch {torch.__version__}.",
        "",
        "| layout | W | EMA bytes / (total/W): ours | torchtitan-style | update() collectives "
        "| swap collectives | get_model_state_dict collectives | update ms: ours | "
        "torchtitan-style | ours / torchtitan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['W']} | {r['ours_ratio']:.3f} | {r['titan_ratio']:.3f} | "
            f"{r['update_coll']:.0f} | {r['swap_coll']:.0f} | {r['gsd_coll']:.0f} | "
            f"{r['ours_ms']:.3f} | {r['titan_ms']:.3f} | {r['ours_ms'] / r['titan_ms']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
