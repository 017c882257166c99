"""Cost of checkpoint checksums (save and load side by side) and of the collective-entry check.

1. ``save_checkpoint`` with and without ``checksums`` (the CRC-32 of every byte range each
   rank wrote, in the memory-mapped files after the write, and a per-rank checksum file),
   and ``load_checkpoint`` with and without ``verify`` (the CRC-32 of the byte ranges each
   rank loads, inside the load, before DCP deserializes them): median seconds over
   ``--repeat`` runs on every rank, off and on alternating within each repeat, and each as
   a ratio to the unchecked save or load. The EMA of ``--model`` (``resnet50``, ``gpt2``:
   GPT-2 small's shape from ``benchmarks/workloads.py``, or the quick
   ``mobilenet_v3_small``/``gpt-tiny``), fp32. Digests: CRC-32 and, with the optional
   ``xxhash`` package, XXH3-64 (checked instead when present); ``--crc32-only`` measures
   CRC-32 alone, as without ``xxhash``.
2. ``DTENSOR_EMA_CHECK_COLLECTIVES`` (``--collective-check``): the monitored barrier
   alone, and construction, ``save_checkpoint``, ``export_ema`` and ``average_parameters``
   with the check off and on.

    python benchmarks/checksums.py --world-size 2 --repeat 5 --collective-check
    python benchmarks/checksums.py --world-size 2 --repeat 5 --model gpt2
    python benchmarks/checksums.py --world-size 2 --repeat 5 --model gpt2 --crc32-only

The checkpoints go to ``--dir`` (default: a temporary directory, in the page cache right after
the save: the numbers then price the CPU work, not the disk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtensor_ema

from dtensor_ema import ModelEMA, export_ema
from dtensor_ema._collectives import CHECK_ENV, check_group_enters
from dtensor_ema.checkpoint import checksums
from dtensor_ema.checkpoint.reader import open_checkpoint
from dtensor_ema.checkpoint.save_load import load_checkpoint, save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import run_gloo_ranks
from workloads import get_spec


def _median(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times)


def _once(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) of one call, after a barrier."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _checksums(ema: ModelEMA, root: Path, repeat: int) -> dict[str, float]:
    plain, checked = root / "plain", root / "checked"
    save_checkpoint({"ema": ema}, checked)
    checkpoint = open_checkpoint(checked)
    items = checkpoint.verify_reads(checkpoint.metadata.storage_data)
    assert items > 0, "the checkpoint has no checksums"
    pairs: list[dict[str, Callable[[], Any]]] = [
        {
            "save": lambda: save_checkpoint({"ema": ema}, plain, checksums=False),
            "save_crc": lambda: save_checkpoint({"ema": ema}, checked),
        },
        {
            "load": lambda: load_checkpoint({"ema": ema}, checked, verify=False),
            "load_verify": lambda: load_checkpoint({"ema": ema}, checked),
        },
    ]
    times: dict[str, list[tuple[float, float]]] = {k: [] for pair in pairs for k in pair}
    for i in range(repeat):
        # Off and on alternate within each repeat, which goes first alternating too, so
        # load drifts and after-effects of the previous call hit both alike.
        for pair in pairs:
            for name, fn in sorted(pair.items(), reverse=i % 2 == 1):
                times[name].append(_once(fn))
    out: dict[str, float] = {"items": items}
    for name, samples in times.items():
        out[name] = statistics.median(w for w, _ in samples)
        out[name + "_cpu"] = statistics.median(c for _, c in samples)
    return out


def _collective_check(
    model: torch.nn.Module, ema: ModelEMA, root: Path, repeat: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    group = dist.group.WORLD
    os.environ[CHECK_ENV] = "600"
    out["barrier"] = _median(lambda: check_group_enters(group, "bench"), repeat * 20)
    del os.environ[CHECK_ENV]

    def swap() -> None:
        with ema.average_parameters():
            pass

    calls: dict[str, Callable[[], Any]] = {
        "construct": lambda: ModelEMA(model, decay=0.9, tau=None),
        "save": lambda: save_checkpoint({"ema": ema}, root / "checked"),
        "export": lambda: export_ema(ema, root / "ema.pt"),
        "swap": swap,
    }
    for name, fn in calls.items():
        out[f"{name}_off"] = _median(fn, repeat)
        os.environ[CHECK_ENV] = "600"
        out[f"{name}_on"] = _median(fn, repeat)
        del os.environ[CHECK_ENV]
    return out


def _body(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    if args.crc32_only:  # as without the optional xxhash package
        checksums.ALGORITHMS = {"crc32": checksums.ALGORITHMS["crc32"]}
    torch.manual_seed(0)
    model = get_spec(args.model).build()
    ema = ModelEMA(model, decay=0.9, tau=None)
    ema.update()
    root = Path(args.dir or folder) / "ckpt"
    out: dict[str, Any] = {"bytes": ema.local_nbytes()}
    out.update(_checksums(ema, root, args.repeat))
    if args.collective_check:
        out.update(_collective_check(model, ema, root, args.repeat))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--collective-check", action="store_true")
    parser.add_argument(
        "--crc32-only", action="store_true", help="record and check CRC-32 alone (no xxhash)"
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints go")
    args = parser.parse_args()
    spec = get_spec(args.model)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = run_gloo_ranks(_body, args.world_size, args)
    digests = "CRC-32" if args.crc32_only or len(checksums.ALGORITHMS) == 1 else "CRC-32 + XXH3-64"
    print(
        f"{spec.note} fp32 EMA, W={args.world_size} gloo, median of {args.repeat}, "
        f"torch {torch.__version__}, one thread per rank; digests: {digests}"
    )
    print(
        "rank  EMA MiB  |  wall s: save  +crc  ratio   load  verified  ratio  |  "
        "CPU s: save  +crc  ratio   load  verified  ratio"
    )
    for r in rows:
        line = f"{r['rank']:>4}  {r['bytes'] / 2**20:7.1f}  |"
        for suffix, label in (("", "wall s:"), ("_cpu", " CPU s:")):
            save, crc = r["save" + suffix], r["save_crc" + suffix]
            load, verified = r["load" + suffix], r["load_verify" + suffix]
            line += (
                f"  {label} {save:5.2f} {crc:5.2f}  {crc / save:5.2f}  {load:5.2f}  "
                f"{verified:8.2f}  {verified / load:5.2f}  |"
            )
        print(line.rstrip(" |"))
    print(
        f"(+crc: save_checkpoint with checksums, vs without; verified: load_checkpoint with "
        f"verify=True, vs verify=False; {rows[0]['items']} saved items; CPU: this process's "
        f"CPU time, all threads; load average before the run: {load_before})"
    )
    if not args.collective_check:
        return
    print(f"\n{CHECK_ENV}: monitored barrier alone, ms per call (rank: value)")
    print("  " + ", ".join(f"{r['rank']}: {1e3 * r['barrier']:.2f}" for r in rows))
    print("call        off s    on s   (rank 0)")
    r = rows[0]
    for name in ("construct", "save", "export", "swap"):
        print(f"{name:<10}  {r[name + '_off']:6.3f}  {r[name + '_on']:6.3f}")


if __name__ == "__main__":
    main()
