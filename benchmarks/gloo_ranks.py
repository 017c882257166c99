"""Run one function on W gloo CPU ranks (one thread each) and collect one row per rank.

The benchmarks that time collectives (``agreement.py``, ``checksums.py``) share this: each
rank is a fresh spawned interpreter in a gloo group over a ``FileStore`` in a temporary
folder, calls ``body(rank, world_size, folder, args)`` and hands back its dict. A rank that
raises or dies ends the run at once; one that stops answering (still running at
``timeout_s``) ends it with its Python stack, dumped by :mod:`faulthandler` on ``SIGUSR1``.
"""

from __future__ import annotations

import faulthandler
import os
import queue as queues
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Body = Callable[[int, int, str, Any], dict[str, Any]]


STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal on which a rank writes every thread's stack to ``stack<rank>`` in its folder
(POSIX only; elsewhere a stuck rank is named without its stack)."""


def _entry(body: Body, rank: int, world_size: int, folder: str, args: Any, queue: Any) -> None:
    torch.set_num_threads(1)
    if STACK_SIGNAL is not None:  # faulthandler keeps the file open for the process's life
        stacks = open(os.path.join(folder, f"stack{rank}"), "w")  # noqa: SIM115
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(folder, "store"), world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=1800),
    )
    try:
        row = {"rank": rank, **body(rank, world_size, folder, args)}
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
        raise
    else:
        queue.put(row)
    finally:
        dist.destroy_process_group()


def run_gloo_ranks(
    body: Body, world_size: int, args: Any, *, timeout_s: float = 3600
) -> list[dict[str, Any]]:
    """``body`` (a module-level function) on ``world_size`` spawned gloo ranks; their rows,
    each with its ``"rank"``, in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback in the message) or died before it
            reported (its exit code); the other ranks are terminated at once instead of
            waiting in a collective for the missing one.
        TimeoutError: some rank did not report within ``timeout_s`` (each such rank's
            stack in the message).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_entry, args=(body, r, world_size, folder, args, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            rows = _collect(queue, procs, timeout_s, folder)
        except BaseException:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            raise
        finally:
            for p in procs:
                p.join()
    return sorted(rows, key=lambda r: r["rank"])


def _collect(queue: Any, procs: list[Any], timeout_s: float, folder: str) -> list[dict[str, Any]]:
    """Every rank's row, checking every second for a rank that raised, died or is late."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while len(rows) < len(procs):
        try:
            row = queue.get(timeout=1.0)
        except queues.Empty:
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead:
                raise RuntimeError(f"rank(s) died before reporting (exit codes): {dead}") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - {row["rank"] for row in rows})
                raise TimeoutError(
                    f"rank(s) {missing} did not report within {timeout_s} s"
                    + "".join(_stacks(procs, missing, folder))
                ) from None
            continue
        if "error" in row:
            raise RuntimeError(f"rank {row['rank']} raised:\n{row['error']}")
        rows.append(row)
    return rows


def _stacks(procs: list[Any], ranks: list[int], folder: str, wait_s: float = 5.0) -> list[str]:
    """The stacks of ``ranks`` (still running): each is sent :data:`STACK_SIGNAL` and its
    ``faulthandler`` dump read back once it has been written (``wait_s`` at most)."""
    if STACK_SIGNAL is None:
        return []
    paths = [os.path.join(folder, f"stack{r}") for r in ranks]
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, STACK_SIGNAL)
    last = None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = [os.path.getsize(p) if os.path.exists(p) else 0 for p in paths]
        if now == last and all(now):
            break
        last = now
    return [
        f"\nrank {r}'s stack:\n{_read(p) or '(no dump)'}" for r, p in zip(ranks, paths, strict=True)
    ]


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()
