"""Validation time per batch through every drop-in with a module, against its original
library: timm ``ModelEmaV3``, torch ``swa_utils.AveragedModel``, ema-pytorch ``EMA``,
ultralytics ``ModelEMA``, on a torchvision ResNet at W gloo ranks (CPU).

Each rank builds the model (same seed) and, per library, three EMAs that watch it: the
original, our drop-in (``evaluation="replica"``, the default) and our drop-in with
``evaluation="sharded"`` (the engine's FSDP2 module, one unit gathered per forward; not for
ultralytics, whose drop-in has only the replica). Each does one update, then one validation
pass the way the library's users run it: ``ema.eval()`` (ours: the replica's one coalesced
all-gather, kept until the next update; ultralytics: ours ``ema.materialize()``, then for
both ``ema.ema.float().eval()`` as its validator does, forwards through ``ema.ema``) and
``--batches`` forwards under ``no_grad``, the variants alternating batch by batch (so load
from neighbours hits all alike). Reported per batch: the median forward (robust to bursts
of load on a shared machine) plus the gather amortized over the pass.
Before that, one warm-up pass per EMA (one batch) measures the peak resident memory of
``eval()`` plus one batch (``VmHWM`` above the resident memory before), as a multiple of
the model's parameter bytes.

    python benchmarks/compat_eval.py [--model resnet50] [--world 2] [--batches 10]
        [--batch-size 8] [--image 128] [--libraries timm,swa,ema_pytorch,ultralytics]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("original", "replica", "sharded")


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


def _factories(library: str) -> dict[str, Callable[[nn.Module], Any]]:
    """variant -> (model -> EMA after one update)."""
    if library == "timm":
        from timm.utils import ModelEmaV3

        from dtensor_ema.compat.timm import ModelEmaV3 as Ours

        def timm_build(cls: Any, **kw: Any) -> Callable[[nn.Module], Any]:
            def build(model: nn.Module) -> Any:
                ema = cls(model, **kw)
                ema.update(model, step=1)
                return ema

            return build

        return {
            "original": timm_build(ModelEmaV3),
            "replica": timm_build(Ours),
            "sharded": timm_build(Ours, evaluation="sharded"),
        }
    if library == "swa":
        from torch.optim import swa_utils

        from dtensor_ema.compat import swa_utils as ours_swa

        def swa_build(cls: Any, **kw: Any) -> Callable[[nn.Module], Any]:
            def build(model: nn.Module) -> Any:
                ema = cls(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.999), **kw)
                ema.update_parameters(model)
                return ema

            return build

        return {
            "original": swa_build(swa_utils.AveragedModel),
            "replica": swa_build(ours_swa.AveragedModel),
            "sharded": swa_build(ours_swa.AveragedModel, evaluation="sharded"),
        }
    if library == "ema_pytorch":
        import ema_pytorch

        from dtensor_ema.compat import ema_pytorch as ours_ep

        def ep_build(cls: Any, **kw: Any) -> Callable[[nn.Module], Any]:
            def build(model: nn.Module) -> Any:
                ema = cls(model, beta=0.999, update_after_step=0, update_every=1, **kw)
                ema.update()
                return ema

            return build

        return {
            "original": ep_build(ema_pytorch.EMA),
            "replica": ep_build(ours_ep.EMA),
            "sharded": ep_build(ours_ep.EMA, evaluation="sharded"),
        }
    if library == "ultralytics":
        from ultralytics.utils.torch_utils import ModelEMA

        from dtensor_ema.compat.ultralytics import ModelEMA as OursUltra

        def ultra_build(cls: Any) -> Callable[[nn.Module], Any]:
            def build(model: nn.Module) -> Any:
                ema = cls(model)
                ema.update(model)
                return _UltralyticsValidation(ema)

            return build

        return {"original": ultra_build(ModelEMA), "replica": ultra_build(OursUltra)}
    raise ValueError(f"unknown library {library!r}: expected timm, swa, ema_pytorch or ultralytics")


class _UltralyticsValidation:
    """ultralytics' validation habit on a ``ModelEMA``: ``eval()`` is the trainer's step
    before ``validate()`` (ours: ``ema.materialize()``, the one collective gather, on every
    rank; the original: nothing) then the validator's ``ema.ema.float().eval()``; a call is a
    forward of ``ema.ema``."""

    def __init__(self, ema: Any) -> None:
        self.ema = ema
        self.module: nn.Module | None = None

    def eval(self) -> _UltralyticsValidation:
        if hasattr(self.ema, "materialize"):
            self.ema.materialize()
        self.module = self.ema.ema.float().eval()
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.module is not None, "eval() first"
        return self.module(x)


def _eval(ema: Any) -> float:
    """``ema.eval()`` (ours: the gather), seconds. Collective for ours."""
    dist.barrier()
    start = time.perf_counter()
    ema.eval()
    return time.perf_counter() - start


def rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=1800)
    )
    try:
        model = _model(args.model)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        g = torch.Generator().manual_seed(rank)
        shape = (args.batch_size, 3, args.image, args.image)
        batches = [torch.randn(shape, generator=g) for _ in range(args.batches)]
        results: dict[str, Any] = {"param_bytes": param_bytes}
        for library in args.libraries.split(","):
            build = _factories(library)
            variants = [v for v in VARIANTS if v in build]
            peaks = {}
            for variant in variants:  # warm-up pass: memory of eval() + one batch
                ema = build[variant](model)
                before = _peak_reset()
                _eval(ema)
                with torch.no_grad():
                    ema(batches[0])
                peaks[variant] = (_status("VmHWM") - before) / param_bytes
                del ema
            emas = {v: build[v](model) for v in variants}
            gathers = {v: _eval(emas[v]) for v in variants}
            spent: dict[str, list[float]] = {v: [] for v in variants}
            with torch.no_grad():
                for x in batches:
                    for variant in variants:
                        dist.barrier()
                        start = time.perf_counter()
                        emas[variant](x)
                        spent[variant].append(time.perf_counter() - start)
            results[library] = {
                v: (
                    statistics.median(spent[v]) + gathers[v] / args.batches,
                    gathers[v],
                    peaks[v],
                )
                for v in variants
            }
            del emas
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--libraries", default="timm,swa,ema_pytorch,ultralytics")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # see shared notes: peaks
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
    print(
        f"{args.model}, W={args.world} gloo, batch {args.batch_size}x3x{args.image}^2, "
        f"{args.batches} batches per pass, {args.threads} thread(s) per rank; ms per batch "
        "(median forward + the drop-ins' eval() gather amortized over the pass), ratio to the "
        "original; "
        "peak extra memory of eval() + one batch in parameter bytes"
    )
    print(
        "| library | rank | original | drop-in (replica) | its forward alone, gather once "
        "| sharded per-unit |"
    )
    print("|---|---|---|---|---|---|")
    for library in args.libraries.split(","):
        for rank, res in sorted(results.items()):
            row = res[library]
            t0, _, m0 = row["original"]
            t1, g1, m1 = row["replica"]
            sharded = "n/a"
            if "sharded" in row:
                t2, _, m2 = row["sharded"]
                sharded = f"{t2 * 1e3:.0f} ms, {t2 / t0:.2f}x (mem {m2:.2f}x)"
            print(
                f"| {library} | {rank} | {t0 * 1e3:.0f} ms (mem {m0:.2f}x) | "
                f"{t1 * 1e3:.0f} ms, {t1 / t0:.2f}x (mem {m1:.2f}x) | "
                f"{(t1 - g1 / args.batches) * 1e3:.0f} ms, {g1 * 1e3:.0f} ms | {sharded} |"
            )


if __name__ == "__main__":
    main()
