"""What serving the EMA to a recovering torchft peer costs a rank: memory and time.

``register_ema(manager, ema)`` (``dtensor_ema.integrations.torchft``) hands torchft a
``state_dict`` that copies this rank's EMA shards under the lock that ``update()`` holds.
On ``--world-size`` gloo CPU ranks (one thread each), for a model replicated on every rank
and its EMA sharded over them, this measures per rank:

* the peak resident memory the served state adds while the transport holds it (Linux
  ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, glibc's mmap threshold
  fixed at 64 KiB so fresh allocations show), as a multiple of this rank's EMA bytes and
  of the model's float bytes; and the same for the naive ``ema.state_dict()`` (live
  tensors, no copy: nothing);
* the time of one served state against one ``ema.update()``, in rotating order, medians
  (before the mmap threshold is fixed): the longest the training thread waits when it
  updates while a peer is being served. The copy writes fresh memory (its pages are
  faulted in), the update writes the EMA in place; a copy of the shards into buffers
  allocated once is timed beside them, to tell the two apart.

torchft itself is not needed: a stand-in for the manager's two calls.

    python benchmarks/torchft_serve.py --world-size 2 --repeat 9 --model gpt2
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtensor_ema

from dtensor_ema import ModelEMA
from dtensor_ema.integrations.torchft import register_ema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import run_gloo_ranks
from workloads import get_spec

MIB = 1024 * 1024


class _Manager:
    """The two calls of ``torchft.Manager`` that ``register_ema`` makes."""

    def __init__(self) -> None:
        self.served: Callable[[], Any] | None = None

    def register_state_dict_fn(self, key: str, load: Any, state: Callable[[], Any]) -> None:
        self.served = state

    def current_step(self) -> int:
        return 0


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match is not None, field
    return int(match.group(1))


def _peak_extra(fn: Callable[[], Any]) -> int:
    """Bytes of resident-set peak above the level before ``fn()``, its result held."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    held = fn()  # the transport holds the state until it sent it
    peak = _status_kib("VmHWM")
    del held
    gc.collect()
    return (peak - before) * 1024


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _body(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = get_spec(args.model).build()
    ema = ModelEMA(model, decay=0.999, tau=None)
    manager = _Manager()
    register_ema(manager, ema)
    assert manager.served is not None
    served = manager.served
    ema.update()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ema_bytes = ema.local_nbytes()
    shards = [e.ema_local for e in ema.engine.plan]
    kept = [torch.empty_like(t) for t in shards]

    def copy_into_kept() -> None:
        for out, t in zip(kept, shards, strict=True):
            out.copy_(t)

    times: dict[str, list[float]] = {"serve": [], "update": [], "copy": []}
    calls = [("serve", served), ("update", ema.update), ("copy", copy_into_kept)]
    for i in range(args.repeat):  # with glibc's own malloc settings, as in training
        for name, fn in calls[i % 3 :] + calls[: i % 3]:
            times[name].append(_seconds(fn))
    kept.clear()  # free them before the memory is measured
    with contextlib.suppress(OSError):  # not glibc: the peak may undercount
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    copy = _peak_extra(served)
    naive = _peak_extra(ema.state_dict)
    return {
        "ema_mib": ema_bytes / MIB,
        "model_mib": model_bytes / MIB,
        "served_x_ema": copy / ema_bytes,
        "served_x_model": copy / model_bytes,
        "naive_x_ema": naive / ema_bytes,
        **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--model", default="gpt2", help="gpt2, resnet50, gpt-tiny, ...")
    args = parser.parse_args()
    rows = run_gloo_ranks(_body, args.world_size, args)
    print(f"{args.model}, W={args.world_size}, medians of {args.repeat}")
    print(
        "| rank | EMA shards | model | served state: peak extra | x model | "
        "`ema.state_dict()`: peak extra | served state | `update()` | served / update | "
        "copy into kept buffers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rank']} | {r['ema_mib']:.0f} MiB | {r['model_mib']:.0f} MiB | "
            f"{r['served_x_ema']:.2f}x the EMA shards | {r['served_x_model']:.2f} | "
            f"{r['naive_x_ema']:.2f}x | {r['serve_ms']:.1f} ms | {r['update_ms']:.1f} ms | "
            f"{r['serve_ms'] / r['update_ms']:.2f} | {r['copy_ms']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
