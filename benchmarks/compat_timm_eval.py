"""Validation through ``dtensor_ema.compat.timm.ModelEmaV3`` vs timm's replica, per batch,
and per-rank EMA bytes vs timm's, on a torchvision ResNet at W gloo ranks (CPU).

Each rank builds the model (same seed), timm's ``ModelEmaV3`` and ours, does one update,
then times a validation pass the way timm's ``validate`` does it: ``model_ema.eval()``
(ours: one coalesced all-gather of the parameters, kept until the next update) and
``--batches`` forwards under ``no_grad``, timm's and ours alternating batch by batch (so
load from neighbours hits both alike). Reported per batch, the gather amortized over the
pass, plus the gather alone, the sharded per-unit forward (``ModelEMA.module``, FSDP2 over
the EMA mesh) for comparison, and the peak resident memory of the pass (``VmHWM``) above
the resident memory before, as a multiple of the model's parameter bytes.
Per-rank bytes at other world sizes come from a fake process group (no data moves).

    python benchmarks/compat_timm_eval.py [--model resnet50] [--world 2] [--batches 10]
        [--batch-size 8] [--image 128] [--bytes-worlds 2,4]
"""

from __future__ import annotations

import argparse
import os
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model(name: str) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)()


def _peak_reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _pass(ema: Any, batches: list[torch.Tensor]) -> tuple[float, float, int]:
    """(seconds for eval() + all batches, seconds for eval() alone, peak extra bytes)."""
    before = _peak_reset()
    dist.barrier()
    start = time.perf_counter()
    ema.eval()
    gathered = time.perf_counter()
    with torch.no_grad():
        for x in batches:
            ema(x)
    end = time.perf_counter()
    return end - start, gathered - start, _status("VmHWM") - before


def rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue: Any) -> None:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    torch.set_num_threads(args.threads)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        from timm.utils import ModelEmaV3

        from dtensor_ema import ModelEMA
        from dtensor_ema.compat.timm import ModelEmaV3 as OurV3

        model = _model(args.model)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        g = torch.Generator().manual_seed(rank)
        shape = (args.batch_size, 3, args.image, args.image)
        batches = [torch.randn(shape, generator=g) for _ in range(args.batches)]
        results: dict[str, Any] = {"param_bytes": param_bytes}
        for label in ("timm", "ours", "timm", "ours"):  # interleaved, second round kept
            ema = ModelEmaV3(model) if label == "timm" else OurV3(model)
            ema.update(model, step=1)
            total, gather, peak = _pass(ema, batches)
            results[label] = (total / args.batches, gather, peak / param_bytes)
            if label == "ours":
                results["ours_local_bytes"] = ema.engine.local_nbytes()
            else:
                results["timm_bytes"] = sum(
                    t.numel() * t.element_size() for t in ema.module.state_dict().values()
                )
            del ema
        # Alternate batch by batch (drift and neighbours' load hit both alike).
        timm_ema, ours_ema = ModelEmaV3(model), OurV3(model)
        for ema in (timm_ema, ours_ema):
            ema.update(model, step=1)
        timm_ema.eval()
        dist.barrier()
        start = time.perf_counter()
        ours_ema.eval()
        gather = time.perf_counter() - start
        spent = {"timm": 0.0, "ours": 0.0}
        with torch.no_grad():
            for x in batches:
                for label, ema in (("timm", timm_ema), ("ours", ours_ema)):
                    dist.barrier()
                    start = time.perf_counter()
                    ema(x)
                    spent[label] += time.perf_counter() - start
        results["alternating"] = (
            spent["timm"] / args.batches,
            spent["ours"] / args.batches,
            gather,
        )
        del timm_ema, ours_ema
        sharded = ModelEMA(model)
        module = sharded.build_module()
        module.eval()
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            for x in batches:
                module(x)
        results["sharded_module"] = (time.perf_counter() - start) / args.batches
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def _bytes_at(world: int, name: str) -> tuple[int, int]:
    """(our largest per-rank EMA bytes, timm's replica bytes) at ``world`` (fake PG)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtensor_ema.compat.timm import ModelEmaV3 as OurV3

    model = _model(name)
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    worst = 0
    for rank in (0, world - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            worst = max(worst, OurV3(model).engine.local_nbytes())
        finally:
            dist.destroy_process_group()
    return worst, full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bytes-worlds", default="2,4")
    args = parser.parse_args()
    for world in (int(w) for w in args.bytes_worlds.split(",")):
        ours, full = _bytes_at(world, args.model)
        print(
            f"W={world}: per-rank EMA bytes ours {ours / 2**20:.1f} MiB, "
            f"timm {full / 2**20:.1f} MiB ({ours / full:.3f}x)"
        )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, args.world, tmp, args, queue))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    for rank, res in sorted(results.items()):
        _, _, peak_timm = res["timm"]
        _, _, peak_ours = res["ours"]
        t_timm, forward_ours, gather = res["alternating"]
        t_ours = forward_ours + gather / args.batches
        print(
            f"rank {rank} {args.model} W={args.world} batch {args.batch_size}x{args.image}^2, "
            f"{args.batches} batches: timm {t_timm * 1e3:.0f} ms/batch, ours {t_ours * 1e3:.0f} "
            f"ms/batch ({t_ours / t_timm:.2f}x; forward {forward_ours * 1e3:.0f} ms + gather "
            f"{gather * 1e3:.0f} ms once per pass), "
            f"sharded per-unit module {res['sharded_module'] * 1e3:.0f} ms/batch "
            f"({res['sharded_module'] / t_timm:.2f}x); peak extra memory of the pass: timm "
            f"{peak_timm:.2f}x, ours {peak_ours:.2f}x the parameter bytes"
        )


if __name__ == "__main__":
    main()
