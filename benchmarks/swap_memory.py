"""Peak memory of ``average_parameters()`` on a replicated (DDP) model, before and after the
memory-bounded swap, as a multiple of the model's float bytes.

Each gloo rank builds the issue's model (an embedding and ``--blocks`` MLP blocks
1024 -> 2048 -> 1024), an EMA, and measures the peak resident memory (Linux ``VmHWM`` after
resetting it through ``/proc/self/clear_refs``) above the resident memory before:

* ``bounded``: ``with ema.average_parameters(bucket_bytes=B): pass`` (this library): backs up
  this rank's EMA-sized slice, gathers the EMA bucket by bucket into the model, restores by
  gathering the backups;
* ``full (before)``: the previous algorithm, re-enacted with the same gather code: gather the
  whole EMA, back up the whole model, copy, free the gathered EMA.

    python benchmarks/swap_memory.py [--world-sizes 2,4] [--blocks 8] [--bucket-mib 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dtensor_ema import ModelEMA
from dtensor_ema.materialize.gather import LocalPiece, gather_full_tensors


def _model(blocks: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Embedding(8192, 1024)]
    for _ in range(blocks):
        layers += [nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)]
    return nn.Sequential(*layers)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _fixed_mmap_threshold() -> None:
    """Make glibc return large freed blocks to the OS (``M_MMAP_THRESHOLD`` = 64 KiB, which
    also stops its dynamic raise), so a region's fresh allocations show up in ``VmHWM``
    instead of reusing pages an earlier region freed."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError):  # not glibc: the peak may undercount
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _peak(fn: Any) -> int:
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS:")
    fn()
    peak = _status("VmHWM:") - before
    dist.barrier()
    return peak


def _full_swap_before(ema: ModelEMA) -> None:
    """The swap as it was: full gathered EMA + full backup of every replicated tensor."""
    plan = ema.engine.plan
    pieces = [
        LocalPiece(
            e.fqn,
            e.ema_local,
            e.source.shape,
            None,
            (),
            e.source.dtype,
            e.levels,
            e.source_piece.shape,
        )
        for e in plan
    ]
    with torch.no_grad():
        full = gather_full_tensors(pieces)
        backups = [e.source.detach().clone() for e in plan]
        for e in plan:
            e.source.detach().copy_(full.pop(e.fqn))
        del full
        for e, b in zip(plan, backups, strict=True):
            e.source.detach().copy_(b)


def rank_main(rank: int, world_size: int, store: str, args: argparse.Namespace, q: Any) -> None:
    torch.set_num_threads(1)
    _fixed_mmap_threshold()
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=600),
    )
    try:
        torch.manual_seed(0)
        model = _model(args.blocks)
        ema = ModelEMA(model, decay=0.999, tau=None)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bucket = args.bucket_mib * 1024 * 1024

        def bounded() -> None:
            with ema.average_parameters(bucket_bytes=bucket):
                pass

        bounded()  # warm both paths
        _full_swap_before(ema)
        row = {
            "W": world_size,
            "model_mib": model_bytes / 2**20,
            "bounded": _peak(bounded) / model_bytes,
            "before": _peak(lambda: _full_swap_before(ema)) / model_bytes,
            "ema_local": ema.local_nbytes() / model_bytes,
        }
        q.put((rank, row, None))
    except BaseException:
        import traceback

        q.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    lines = [
        f"Swap peak RSS / model float bytes (embedding + {args.blocks} MLP blocks "
        f"1024-2048-1024, fp32, bucket {args.bucket_mib} MiB, gloo CPU), worst rank.",
        "",
        "| W | model MiB | before: full gather + full backup | after: bounded swap | 1/W |",
        "|---|---|---|---|---|",
    ]
    ctx = mp.get_context("spawn")
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            procs = [
                ctx.Process(target=rank_main, args=(r, world_size, store, args, q))
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
            results = [q.get(timeout=1800) for _ in procs]
            for p in procs:
                p.join()
        errors = [e for _, _, e in results if e]
        if errors:
            raise RuntimeError(errors[0])
        rows = [r for _, r, _ in results]
        lines.append(
            f"| {world_size} | {rows[0]['model_mib']:.0f} | "
            f"{max(r['before'] for r in rows):.2f}x | {max(r['bounded'] for r in rows):.2f}x | "
            f"{1 / world_size:.2f} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
