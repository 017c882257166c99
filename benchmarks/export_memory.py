"""Peak host memory of ``export_ema`` on each rank, for torchvision ResNet-50 on CPU/gloo.

Each rank resets its peak resident set size (``/proc/self/clear_refs``), runs one export,
and reports the peak minus the resident size just before: the transient memory the export
cost. For comparison, side by side in the same processes: the same export built on the
all-gather path (``gather_full_tensors(rank0_only=True)``: every rank receives each bucket,
only rank 0 keeps it; what ``export_ema`` did before it gathered to rank 0), and the naive
thing, ``get_model_state_dict()`` (full EMA and model weights on every rank) followed by
``torch.save`` on rank 0. ``--no-bucket-view`` builds the EMA with
``parameters_as_bucket_view=False`` (ranks then pack their shards into a send buffer).

    python benchmarks/export_memory.py --world-size 2 --bucket-mib 64

Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from rss import reset_peak, status_kib
from torch.distributed.device_mesh import init_device_mesh

from dtensor_ema import ModelEMA, export_ema
from dtensor_ema.materialize.gather import LocalPiece, gather_full_tensors

MIB = 1024 * 1024


def _measure(fn: Any) -> tuple[float, float]:
    """``(peak MiB above the resident size before, seconds)`` of ``fn()``."""
    gc.collect()
    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    gc.collect()
    peak = status_kib("VmHWM")
    dist.barrier()
    return (peak - before) / 1024, seconds


def _rank(rank: int, world_size: int, store_dir: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
    )
    try:
        torch.manual_seed(0)
        model = torchvision.models.resnet50()
        ema = ModelEMA(
            model,
            mesh=init_device_mesh("cpu", (world_size,)),
            parameters_as_bucket_view=args.bucket_view,
        )
        ema.update()
        out = Path(store_dir) / f"ema.{args.format}"
        results: dict[str, Any] = {
            "rank": rank,
            "ema_local_mib": ema.local_nbytes() / MIB,
            "rss_mib": status_kib("VmRSS") / 1024,
        }
        results["export"] = _measure(
            lambda: export_ema(ema, out, bucket_bytes=args.bucket_mib * MIB)
        )
        if rank == 0:
            results["file_mib"] = out.stat().st_size / MIB

        def naive() -> None:
            ema_sd, _ = ema.get_model_state_dict()
            if rank == 0:
                torch.save(ema_sd, Path(store_dir) / "naive.pt")

        results["naive"] = _measure(naive)

        def all_gather_export() -> None:
            pieces = [
                LocalPiece(k, v.to_local(), v.shape, v.device_mesh, tuple(v.placements), v.dtype)
                for k, v in ema.ema_tensors().items()
            ]
            state = gather_full_tensors(
                pieces, rank0_only=True, cpu_offload=True, bucket_bytes=args.bucket_mib * MIB
            )
            if rank == 0:
                torch.save(state, Path(store_dir) / "allgather.pt")

        results["allgather"] = _measure(all_gather_export)
        queue.put(results)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--format", choices=["pt", "safetensors"], default="pt")
    parser.add_argument("--no-bucket-view", dest="bucket_view", action="store_false")
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
        rows = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    total = sum(
        p.numel() * p.element_size() for p in torchvision.models.resnet50().state_dict().values()
    )
    print(
        f"ResNet-50, {total / MIB:.1f} MiB of fp32 state, W={args.world_size}, "
        f"bucket {args.bucket_mib} MiB, format {args.format}, "
        f"parameters_as_bucket_view={args.bucket_view}, torch {torch.__version__}"
    )
    print(
        "rank  EMA shard  RSS before  export peak+  export s  all-gather peak+  all-gather s"
        "  naive peak+  naive s"
    )
    for r in rows:
        print(
            f"{r['rank']:>4}  {r['ema_local_mib']:>7.1f}M  {r['rss_mib']:>9.1f}M  "
            f"{r['export'][0]:>11.1f}M  {r['export'][1]:>8.2f}  "
            f"{r['allgather'][0]:>15.1f}M  {r['allgather'][1]:>12.2f}  "
            f"{r['naive'][0]:>10.1f}M  {r['naive'][1]:>7.2f}"
        )
    print(f"file: {rows[0]['file_mib']:.1f} MiB")


if __name__ == "__main__":
    main()
