"""How long a checkpoint save blocks training: background (``async_=True``) vs blocking.

GPT-2 small from ``transformers`` (``GPT2LMHeadModel(GPT2Config())``, randomly initialized,
124M parameters), its EMA sharded over W gloo CPU ranks (one thread each). Each repeat, on
every rank after a barrier, in alternating order:

* ``blocking``: ``save_checkpoint(state, path)``, the whole call;
* ``background``: ``save_checkpoint(state, path, async_=True)`` until it returns (the
  agreement and the copy of the state to the CPU), then ``--steps`` EMA updates while the
  write runs (training goes on), then ``future.result()``: the time blocked, the time until
  the write finished, and the updates' time against the same updates with nothing in
  flight.

``state`` is ``{"ema": ema}`` (default) or, with ``--with-model``, ``{"ema": ema, "model":
model.state_dict()}``. Also, once each: the peak extra resident memory of a blocking save and
of a first background save (a new staging buffer) until its write finished, in EMA-shard
bytes (``/proc``; ``MALLOC_MMAP_THRESHOLD_=65536``, set here), and the staging buffer kept
for the next one. Both peaks include the page-cache pages of the files the checksum pass
maps (about one shard); the difference is the background save's CPU copy.

    python benchmarks/async_save.py --world-size 2 --repeat 5

The first background save of a process creates its gloo group; one warm-up of each runs
before the timed repeats. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the ranks start (glibc)

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtensor_ema

from dtensor_ema import ModelEMA, save_checkpoint
from dtensor_ema.checkpoint import background as background_saves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import run_gloo_ranks
from load_memory import gpt2, peak_extra


def _updates(ema: ModelEMA, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        ema.update()
    return time.perf_counter() - start


def _body(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    model = gpt2()
    ema = ModelEMA(model, decay=0.9999, tau=None)
    ema.update()
    root = Path(args.dir or folder)

    def state() -> dict[str, Any]:
        return {"ema": ema, "model": model.state_dict()} if args.with_model else {"ema": ema}

    def blocking() -> dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        save_checkpoint(state(), root / "blocking")
        return {"blocked": time.perf_counter() - start}

    def background() -> dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        future = save_checkpoint(state(), root / "background", async_=True)
        blocked = time.perf_counter() - start
        during = _updates(ema, args.steps)
        future.result()
        done = time.perf_counter() - start
        dist.barrier()
        idle = _updates(ema, args.steps)
        return {"blocked": blocked, "done": done, "steps_during": during, "steps_idle": idle}

    blocking()  # warm-up: files, page cache
    background()  # warm-up: the background group
    runs: dict[str, list[dict[str, float]]] = {"blocking": [], "background": []}
    for i in range(args.repeat):
        for name in sorted(runs, reverse=i % 2 == 1):
            runs[name].append(blocking() if name == "blocking" else background())
    out: dict[str, Any] = {"ema_bytes": ema.local_nbytes()}
    for name, samples in runs.items():
        for key in samples[0]:
            out[f"{name}_{key}"] = statistics.median(s[key] for s in samples)
    # The digest pass maps the files it digests: their page-cache pages count as resident
    # in both; the difference is the background save's own (the CPU copy).
    out["blocking_peak"] = peak_extra(lambda: save_checkpoint(state(), root / "blocking"))
    background_saves.release_staging()  # as the first background save: the buffer is new
    out["background_peak"] = peak_extra(
        lambda: save_checkpoint(state(), root / "background", async_=True).result()
    )
    out["staging_bytes"] = background_saves.staging_nbytes()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="EMA updates during each write")
    parser.add_argument("--with-model", action="store_true", help="save the model's state too")
    parser.add_argument("--dir", default=None, help="where the checkpoints go")
    args = parser.parse_args()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = run_gloo_ranks(_body, args.world_size, args)
    what = "EMA + model" if args.with_model else "EMA"
    print(
        f"GPT-2 small (transformers, random init), state: {what}, W={args.world_size} gloo, "
        f"median of {args.repeat}, torch {torch.__version__}, one thread per rank"
    )
    print(
        "rank  EMA MiB  blocking s  background: blocked s  ratio  write done s  "
        f"{args.steps} updates during / idle s  peak+ blocking / background  staging"
    )
    for r in rows:
        ratio = r["background_blocked"] / r["blocking_blocked"]
        print(
            f"{r['rank']:>4}  {r['ema_bytes'] / 2**20:7.1f}  {r['blocking_blocked']:10.3f}  "
            f"{r['background_blocked']:21.3f}  {ratio:5.3f}  {r['background_done']:12.3f}  "
            f"{r['background_steps_during']:.3f} / {r['background_steps_idle']:.3f}"
            f"{r['blocking_peak'] / r['ema_bytes']:>17.2f} / "
            f"{r['background_peak'] / r['ema_bytes']:.2f}  "
            f"{r['staging_bytes'] / r['ema_bytes']:7.2f}"
        )
    print(f"(load average before the run: {load_before})")


if __name__ == "__main__":
    main()
