"""Materialization time with and without ``parameters_as_bucket_view``, ResNet-50 on CPU/gloo.

Both EMAs live in the same processes and are timed interleaved (``--repeats`` rounds of
``get_ema_state_dict()``, median), beside one flat ``all_gather_into_tensor`` of the same
bytes, so the ratios compare like with like:

    python benchmarks/bucket_view.py --world-size 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch.distributed.device_mesh import init_device_mesh

from dtensor_ema import ModelEMA

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rank(rank: int, world_size: int, store_dir: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
    )
    try:
        torch.manual_seed(0)
        model = torchvision.models.resnet50()
        mesh = init_device_mesh("cpu", (world_size,))
        emas = {
            "packed": ModelEMA(model, mesh=mesh),
            "bucket_view": ModelEMA(model, mesh=mesh, parameters_as_bucket_view=True),
        }
        numel = sum(p.numel() for p in model.state_dict().values() if p.is_floating_point())
        chunk = -(-numel // world_size)
        send = torch.randn(chunk)
        times: dict[str, list[float]] = {name: [] for name in [*emas, "flat_all_gather"]}
        for _ in range(args.repeats):
            for name, ema in emas.items():
                dist.barrier()
                start = time.perf_counter()
                ema.get_ema_state_dict()
                times[name].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            recv = torch.empty(chunk * world_size)
            _all_gather_flat(recv, send)
            times["flat_all_gather"].append(time.perf_counter() - start)
            del recv
        queue.put({"rank": rank, **{k: statistics.median(v) for k, v in times.items()}})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
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
        rows = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    print(
        f"ResNet-50 fp32, W={args.world_size}, median of {args.repeats}, torch {torch.__version__}"
    )
    print("rank  packed s  bucket_view s  flat all-gather s  packed/flat  bucket_view/flat")
    for r in rows:
        flat = r["flat_all_gather"]
        print(
            f"{r['rank']:>4}  {r['packed']:>8.3f}  {r['bucket_view']:>13.3f}  {flat:>17.3f}  "
            f"{r['packed'] / flat:>11.2f}  {r['bucket_view'] / flat:>16.2f}"
        )


if __name__ == "__main__":
    main()
