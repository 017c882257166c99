"""Cost of checkpoint checksums and of the collective-entry check, ResNet-50 fp32 on CPU/gloo.

1. ``save_checkpoint`` with and without ``checksums`` (CRC-32 of every written chunk and a
   per-rank sidecar file), and the CRC pass alone; ``load_checkpoint(verify=False)`` and
   the verification pass alone (every saved chunk the load reads is read again and its
   CRC-32 compared before DCP loads): median seconds over ``--repeat`` runs on every rank,
   and each as a ratio to the unchecked save or load.
2. ``DTENSOR_EMA_CHECK_COLLECTIVES``: the monitored barrier alone, and construction,
   ``save_checkpoint``, ``export_ema`` and ``average_parameters`` with the check off and on.

    python benchmarks/checksums.py --world-size 2 --repeat 5

The checkpoint goes to ``--dir`` (default: a temporary directory, usually tmpfs or page
cache: the numbers then price the CPU work, not the disk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision

from dtensor_ema import ModelEMA, export_ema
from dtensor_ema._collectives import CHECK_ENV, check_group_enters
from dtensor_ema.checkpoint import load_checkpoint, save_checkpoint
from dtensor_ema.reader import open_checkpoint


def _median(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times)


def _once(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _verify_only(ema: ModelEMA, ckpt: Path, rank: int) -> None:
    """What ``load_checkpoint(verify=True)`` adds: the checksum pass alone."""
    open_checkpoint(ckpt).verify({"ema": ema}, is_coordinator=rank == 0)


def _rank(rank: int, world_size: int, store: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(store, "store"), world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=600),
    )
    try:
        torch.manual_seed(0)
        model = torchvision.models.resnet50()
        ema = ModelEMA(model, decay=0.9, tau=None)
        ema.update()
        ckpt = Path(args.dir or store) / "ckpt"
        out: dict[str, float] = {"rank": rank}
        # Off and on alternate within each repeat, so load drifts hit both alike.
        times: dict[str, list[float]] = {k: [] for k in ("save", "save_crc", "load", "verify")}
        for _ in range(args.repeat):
            times["save"].append(
                _once(lambda: save_checkpoint({"ema": ema}, ckpt, checksums=False))
            )
            times["save_crc"].append(_once(lambda: save_checkpoint({"ema": ema}, ckpt)))
            times["load"].append(_once(lambda: load_checkpoint({"ema": ema}, ckpt, verify=False)))
            times["verify"].append(_once(lambda: _verify_only(ema, ckpt, rank)))
        out.update({k: statistics.median(v) for k, v in times.items()})
        local = [v.to_local() for v in ema.ema_tensors().values()]
        out["crc"] = _median(
            lambda: [
                zlib.crc32(t.reshape(-1).contiguous().view(torch.uint8).numpy()) for t in local
            ],
            args.repeat,
        )
        group = dist.group.WORLD
        os.environ[CHECK_ENV] = "600"
        out["barrier"] = _median(lambda: check_group_enters(group, "bench"), args.repeat * 20)
        del os.environ[CHECK_ENV]
        export = Path(store) / "ema.pt"

        def swap() -> None:
            with ema.average_parameters():
                pass

        calls: dict[str, Callable[[], Any]] = {
            "construct": lambda: ModelEMA(model, decay=0.9, tau=None),
            "save": lambda: save_checkpoint({"ema": ema}, ckpt),
            "export": lambda: export_ema(ema, export),
            "swap": swap,
        }
        for name, fn in calls.items():
            out[f"{name}_off"] = _median(fn, args.repeat)
            os.environ[CHECK_ENV] = "600"
            out[f"{name}_on"] = _median(fn, args.repeat)
            del os.environ[CHECK_ENV]
        queue.put(out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the checkpoint goes")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as store:
        procs = [
            ctx.Process(target=_rank, args=(r, args.world_size, store, args, queue))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        rows = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    print(
        f"ResNet-50 fp32 EMA, W={args.world_size} gloo, median of {args.repeat}, "
        f"torch {torch.__version__}, one thread per rank"
    )
    print("rank  save s  +crc s  ratio  crc pass s  ratio   load s  verify pass s  ratio")
    for r in rows:
        print(
            f"{r['rank']:>4}  {r['save']:6.3f}  {r['save_crc']:6.3f}  "
            f"{r['save_crc'] / r['save']:5.2f}  {r['crc']:10.3f}  {r['crc'] / r['save']:5.2f}"
            f"   {r['load']:6.3f}  {r['verify']:13.3f}  {r['verify'] / r['load']:5.2f}"
        )
    print(
        "(+crc: save_checkpoint with checksums, vs without; crc pass: CRC-32 of this rank's "
        "shards alone; verify pass: the check load_checkpoint(verify=True) adds)"
    )
    print(f"\n{CHECK_ENV}: monitored barrier alone, ms per call (rank: value)")
    print("  " + ", ".join(f"{r['rank']}: {1e3 * r['barrier']:.2f}" for r in rows))
    print("call        off s    on s   (rank 0)")
    r = rows[0]
    for name in ("construct", "save", "export", "swap"):
        print(f"{name:<10}  {r[name + '_off']:6.3f}  {r[name + '_on']:6.3f}")


if __name__ == "__main__":
    main()
