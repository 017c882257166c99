"""Run one function on W gloo CPU ranks (one thread each) and collect one row per rank.

The benchmarks that time collectives (``agreement.py``, ``checksums.py``) share this: each
rank is a fresh spawned interpreter in a gloo group over a ``FileStore`` in a temporary
folder, calls ``body(rank, world_size, folder, args)`` and hands back its dict.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Body = Callable[[int, int, str, Any], dict[str, Any]]


def _entry(body: Body, rank: int, world_size: int, folder: str, args: Any, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(folder, "store"), world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=1800),
    )
    try:
        queue.put({"rank": rank, **body(rank, world_size, folder, args)})
    finally:
        dist.destroy_process_group()


def run_gloo_ranks(
    body: Body, world_size: int, args: Any, *, timeout_s: float = 3600
) -> list[dict[str, Any]]:
    """``body`` (a module-level function) on ``world_size`` spawned gloo ranks; their rows,
    each with its ``"rank"``, in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_entry, args=(body, r, world_size, folder, args, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        rows = sorted((queue.get(timeout=timeout_s) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    return rows
