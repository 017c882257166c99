"""Peak extra memory of a staged ``load_checkpoint``, in EMA-shard bytes, against plain DCP.

``load_checkpoint`` reads each EMA into buffers of its own layout and swaps them in only
when every rank has read and checked everything, so a failed load changes no EMA: it costs
one more copy of each loaded EMA's local shards (``1/W`` of the model per EMA). Plain
``dcp.load`` writes the live EMA in place (no staging, and no such promise). Both also hold
what DCP reads at a time (one saved item, deserialized). GPT-2 small from ``transformers``
(randomly initialized), its EMA sharded over W gloo CPU ranks; each rank resets its peak
resident size (``/proc/self/clear_refs``), loads, and reports the peak minus the resident
size before, divided by its EMA shard's bytes. One EMA (verified, and with
``verify=False``: the checksum pass maps the byte ranges it digests, whose page-cache pages
count as resident while mapped), then two in one state.

    python benchmarks/load_memory.py --world-size 2

Linux only (reads ``/proc``); ``MALLOC_MMAP_THRESHOLD_=65536`` is set here so that freed
memory is returned and peaks are not hidden by reuse.
"""

from __future__ import annotations

import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the ranks start (glibc)

import argparse
import gc
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtensor_ema

from dtensor_ema import ModelEMA, load_checkpoint, save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import run_gloo_ranks


def gpt2() -> torch.nn.Module:
    """GPT-2 small from ``transformers``, randomly initialized (seed 0)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config())


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match is not None, field
    return int(match.group(1))


def peak_extra(fn: Callable[[], object]) -> int:
    """Bytes of resident memory above the level before ``fn()`` at its peak (every rank
    calls it: barriers before and after)."""
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _kib("VmRSS")
    fn()
    peak = _kib("VmHWM")
    dist.barrier()
    return (peak - before) * 1024


def _body(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    model = gpt2()
    emas = {"ema": ModelEMA(model, decay=0.9999, tau=None), "ema2": ModelEMA(model, decay=0.999)}
    for ema in emas.values():
        ema.update()
    root = Path(args.dir or folder)
    save_checkpoint(dict(emas), root / "ckpt")
    one = {"ema": emas["ema"]}
    out: dict[str, Any] = {"ema_bytes": emas["ema"].local_nbytes()}
    for _ in range(args.repeat):  # the smallest peak of each: the least disturbed
        samples = {
            "staged_one": peak_extra(lambda: load_checkpoint(dict(one), root / "ckpt")),
            "unverified_one": peak_extra(
                lambda: load_checkpoint(dict(one), root / "ckpt", verify=False)
            ),
            "dcp_one": peak_extra(lambda: dcp.load(dict(one), checkpoint_id=root / "ckpt")),
            "staged_two": peak_extra(lambda: load_checkpoint(dict(emas), root / "ckpt")),
            "dcp_two": peak_extra(lambda: dcp.load(dict(emas), checkpoint_id=root / "ckpt")),
        }
        for key, value in samples.items():
            out[key] = min(out.get(key, value), value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoint goes")
    args = parser.parse_args()
    rows = run_gloo_ranks(_body, args.world_size, args)
    print(
        f"GPT-2 small (transformers, random init), fp32 EMA, W={args.world_size} gloo, "
        f"torch {torch.__version__}; peak extra resident memory of a load, in EMA-shard bytes "
        f"(smallest of {args.repeat})"
    )
    print(
        "rank  EMA shard MiB  | one EMA: load_checkpoint  (verify=False)  dcp.load  "
        "| two EMAs: load_checkpoint  dcp.load"
    )
    for r in rows:
        shard = r["ema_bytes"]
        print(
            f"{r['rank']:>4}  {shard / 2**20:13.1f}  | {r['staged_one'] / shard:24.2f}  "
            f"{r['unverified_one'] / shard:15.2f}  {r['dcp_one'] / shard:8.2f}  "
            f"| {r['staged_two'] / shard:25.2f}  {r['dcp_two'] / shard:8.2f}"
        )


if __name__ == "__main__":
    main()
