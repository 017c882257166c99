"""Teacher forward through ``ema.module`` against "gather then forward", on CPU/gloo.

A DINO/BYOL-style teacher runs a forward through the EMA every step. Without ``ema.module``
each rank keeps a full replica of the model for the teacher and, before each forward,
gathers the EMA into it (``get_model_state_dict()[0]`` then ``load_state_dict``). With
it, each rank keeps only its EMA shards and FSDP gathers one unit at a time.

Measured per rank, side by side in the same processes (median of ``--repeats`` rounds,
interleaved): the memory each approach keeps alive between steps (resident size after
building it, minus before), the transient peak of one step above the resident size before
it (``/proc/self/clear_refs`` + ``VmHWM``), and the step's wall time. The model is an
embedding plus ``--blocks`` MLP blocks ``dim -> 2 dim -> dim`` (the issue's 268 MB
workload at the defaults); units are the blocks.

    python benchmarks/teacher_forward.py --world-size 2

Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dtensor_ema import ModelEMA

MIB = 1024 * 1024


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(blocks)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(tokens))


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match is not None, field
    return int(match.group(1))


def _rss_mib() -> float:
    gc.collect()
    return _status_kib("VmRSS") / 1024


def _measure(fn: Callable[[], Any]) -> tuple[float, float]:
    """``(peak MiB above the resident size before, seconds)`` of ``fn()``."""
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    dist.barrier()
    return (peak - before) / 1024, seconds


def _rank(rank: int, world_size: int, store_dir: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=600)
    )
    try:
        torch.manual_seed(0)
        model = Net(args.vocab, args.dim, args.blocks)
        mesh = init_device_mesh("cpu", (world_size,))
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
        base = _rss_mib()
        gather_ema = ModelEMA(model, mesh=mesh)
        module_ema = ModelEMA(model, mesh=mesh)
        with_emas = _rss_mib()
        teacher_replica = copy.deepcopy(model).requires_grad_(False).eval()
        with_replica = _rss_mib()
        teacher = module_ema.module  # built here: the shards move into FSDP's storage
        with_module = _rss_mib()

        def gather_then_forward() -> None:
            state, _ = gather_ema.get_model_state_dict()
            teacher_replica.load_state_dict(state)
            del state
            with torch.no_grad():
                teacher_replica(tokens)

        def module_forward() -> None:
            with torch.no_grad():
                teacher(tokens)

        module_forward()  # FSDP's lazy init, outside the measurement
        rows: dict[str, list[tuple[float, float]]] = {"gather": [], "module": []}
        for _ in range(args.repeats):
            gather_ema.update()
            module_ema.update()
            rows["gather"].append(_measure(gather_then_forward))
            rows["module"].append(_measure(module_forward))
        queue.put(
            {
                "rank": rank,
                "model_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
                "ema_local_mib": module_ema.local_nbytes() / MIB,
                "kept_replica_mib": with_replica - with_emas,
                "kept_module_mib": with_module - with_replica,
                "base_mib": base,
                **{
                    f"{k}_{what}": statistics.median(v[i] for v in rows[k])
                    for k in rows
                    for i, what in enumerate(("peak", "s"))
                },
            }
        )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [
            ctx.Process(target=_rank, args=(r, args.world_size, store_dir, args, queue))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        rows = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    first = rows[0]
    print(
        f"embedding {args.vocab}x{args.dim} + {args.blocks} MLP blocks {args.dim}->"
        f"{2 * args.dim}->{args.dim}, {first['model_mib']:.1f} MiB fp32, W={args.world_size}, "
        f"batch {args.batch}x{args.seq}, median of {args.repeats}, torch {torch.__version__}"
    )
    print(
        "rank  EMA shard  kept: replica  kept: module  "
        "gather+fwd peak+  gather+fwd s  module fwd peak+  module fwd s"
    )
    for r in rows:
        print(
            f"{r['rank']:>4}  {r['ema_local_mib']:>8.1f}M  {r['kept_replica_mib']:>12.1f}M  "
            f"{r['kept_module_mib']:>11.1f}M  {r['gather_peak']:>15.1f}M  {r['gather_s']:>12.3f}  "
            f"{r['module_peak']:>15.1f}M  {r['module_s']:>12.3f}"
        )


if __name__ == "__main__":
    main()
