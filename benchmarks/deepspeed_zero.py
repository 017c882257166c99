"""The EMA of a DeepSpeed ZeRO model: ours against the common recipe, per rank, on CPU ranks.

    python benchmarks/deepspeed_zero.py --world-sizes 2 4 --mib 64 --stages 3 2

On each of W gloo CPU ranks (one torch thread each), a stack of ``1023 x 1023`` linear
layers with biases (``--mib`` MiB of fp32 weights; odd sizes, so partitions are padded) is
wrapped by ``deepspeed.initialize`` at ZeRO stage ``--stages`` and trained one step (the
biases, under ``stage3_param_persistence_threshold``, are then whole on every rank). Per
rank:

* **bytes**: ``ModelEMA(engine).local_nbytes()`` (and the resident-set growth of building it)
  against the model's bytes / W (``ds_numel``: the real sizes), and against the recipe's full
  replica (the model's bytes on every rank);
* **time**: median of ``--reps`` interleaved calls (a barrier before each; wall clock, and
  the calling thread's CPU time, which a shared machine's load leaves out but which misses
  the recipe's communication threads):
  ``ema.update()``; ``dst.copy_(src)`` of the EMA's local bytes; and the common recipe
  (DeepSpeed issue #2056, transformers #35994, diffusers' ``EMAModel`` under ZeRO-3): gather
  every parameter with ``deepspeed.zero.GatheredParameters`` and ``lerp_`` a full fp32
  replica on every rank, once with one gather of all parameters (``recipe_all``, the
  fastest, with the whole model gathered at once) and once per parameter (``recipe_each``,
  the leanest). The targets: EMA bytes <= 1.03 x model / W and update <= 1.1 / W of the
  recipe's time;
* at stage 3, whether ``dtensor_ema.simulate.plan_bytes`` of the same shapes on the meta
  device (``zero3_partitioned``: the scale simulation's way) counts this EMA's bytes.

Linux only (reads ``/proc``). Numbers depend on the machine and its load: compare rows of one
run. Prints a table and writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtensor_ema

from dtensor_ema import ModelEMA
from dtensor_ema.simulate import plan_bytes, zero3_partitioned

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import run_gloo_ranks

MIB = 1024 * 1024
WIDTH = 1023  # odd: every weight's partition is padded at W = 2 and 4
DECAY = 0.999


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 2], choices=(1, 2, 3))
    parser.add_argument("--mib", type=int, default=64, help="model size, MiB of fp32 weights")
    parser.add_argument("--reps", type=int, default=7, help="timed calls of each, interleaved")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="W=2, stage 3, 4 MiB, 2 reps")
    return parser


def make_model(mib: int) -> nn.Module:
    layers = max(1, mib * MIB // (WIDTH * WIDTH * 4))
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match is not None, field
    return int(match.group(1))


def rss_growth(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the growth of the resident set it leaves behind."""
    gc.collect()
    before = _status_kib("VmRSS")
    result = fn()
    gc.collect()
    return result, (_status_kib("VmRSS") - before) * 1024


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and this thread's CPU seconds of ``fn()``, after a barrier."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def interleaved(impls: dict[str, Callable[[], Any]], reps: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each, in turns (the same order on every rank: the
    recipe's gathers are collectives), after one warm-up call each."""
    for fn in impls.values():
        fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
    names = list(impls)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_timed(impls[name]))
    return {
        name: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
        for name, s in samples.items()
    }


class GatherRecipe:
    """The common recipe: a full fp32 replica of every parameter on every rank, updated
    inside ``GatheredParameters`` (all parameters at once, or one at a time)."""

    def __init__(self, module: nn.Module) -> None:
        import deepspeed

        self.gathered = deepspeed.zero.GatheredParameters
        self.params = dict(module.named_parameters())
        with self.gathered(list(self.params.values())):
            self.ema = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update_all(self) -> None:
        with self.gathered(list(self.params.values())):
            for name, p in self.params.items():
                self.ema[name].lerp_(p, 1 - DECAY)

    @torch.no_grad()
    def update_each(self) -> None:
        for name, p in self.params.items():
            with self.gathered(p):
                self.ema[name].lerp_(p, 1 - DECAY)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ema.values())


def _body(rank: int, world: int, folder: str, args: tuple[int, int, int]) -> dict[str, Any]:
    import deepspeed

    stage, mib, reps = args
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group of run_gloo_ranks
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    model = make_model(mib)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(1, WIDTH)
    engine.backward(engine(x).square().mean())
    engine.step()
    params = list(engine.module.parameters())
    model_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
    ema, ema_rss = rss_growth(lambda: ModelEMA(engine, decay=DECAY, tau=None))
    recipe, recipe_rss = rss_growth(lambda: GatherRecipe(engine.module))
    plan_matches = None
    if stage == 3:  # the scale simulation's count (simulate.py) against this real EMA
        with torch.device("meta"):
            meta = make_model(mib)
        plan_matches = plan_bytes(zero3_partitioned(meta)).local_bytes == ema.local_nbytes()
    numel = ema.local_numel()
    src, dst = torch.randn(numel), torch.empty(numel)
    seconds = interleaved(
        {
            "update": ema.update,
            "copy": lambda: dst.copy_(src),
            "recipe_all": recipe.update_all,
            "recipe_each": recipe.update_each,
        },
        reps,
    )
    return {
        "stage": stage,
        "world": world,
        "model_MiB": model_bytes / MIB,
        "ema_MiB": ema.local_nbytes() / MIB,
        "ema_rss_MiB": ema_rss / MIB,
        "ema_over_model_per_W": ema.local_nbytes() / (model_bytes / world),
        "recipe_MiB": recipe.nbytes() / MIB,
        "recipe_rss_MiB": recipe_rss / MIB,
        "plan_matches_real": plan_matches,
        **{f"{name}_ms": 1e3 * wall for name, (wall, _) in seconds.items()},
        **{f"{name}_cpu_ms": 1e3 * cpu for name, (_, cpu) in seconds.items()},
        "update_over_copy": seconds["update"][0] / seconds["copy"][0],
        "update_over_recipe_per_W": seconds["update"][0] / (seconds["recipe_all"][0] / world),
        "cpu_update_over_recipe_per_W": seconds["update"][1] / (seconds["recipe_all"][1] / world),
    }


COLUMNS = (
    ("stage", "{}"),
    ("world", "{}"),
    ("rank", "{}"),
    ("model_MiB", "{:.1f}"),
    ("ema_MiB", "{:.2f}"),
    ("ema_rss_MiB", "{:.1f}"),
    ("ema_over_model_per_W", "{:.4f}"),
    ("recipe_MiB", "{:.1f}"),
    ("recipe_rss_MiB", "{:.1f}"),
    ("plan_matches_real", "{}"),
    ("update_ms", "{:.2f}"),
    ("copy_ms", "{:.2f}"),
    ("recipe_all_ms", "{:.1f}"),
    ("recipe_each_ms", "{:.1f}"),
    ("update_over_copy", "{:.2f}"),
    ("update_over_recipe_per_W", "{:.3f}"),
    ("update_cpu_ms", "{:.2f}"),
    ("recipe_all_cpu_ms", "{:.1f}"),
    ("cpu_update_over_recipe_per_W", "{:.3f}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(k for k, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f.format(row[k]) for k, f in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.world_sizes, args.stages, args.mib, args.reps = [2], [3], 4, 2
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # RSS gives freed pages back
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for stage in args.stages:
        for world in args.world_sizes:
            rows += run_gloo_ranks(_body, world, (stage, args.mib, args.reps), timeout_s=1800)
    print(
        f"fp32 model and EMA, {args.mib} MiB, gloo CPU ranks, one thread each, median of "
        f"{args.reps}; torch {torch.__version__}; load average before: {load}"
    )
    print(table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
