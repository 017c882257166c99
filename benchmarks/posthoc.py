"""Post-hoc EMA costs: snapshot time and bytes per rank, synthesize's peak memory, and the
reconstruction error against snapshot spacing.

    python benchmarks/posthoc.py --world-size 2 --sizes 16 64 256 --snapshots 8

1. **Snapshot cost per rank** (``--world-size`` gloo ranks on CPU): a stack of
   ``1024 x 1024`` linear layers (``--sizes`` in MiB of fp32 weights) tracked by a
   ``PostHocEMA`` with two profiles; each rank times ``snapshot()`` (synchronous, EMA dtype
   and bf16 storage; asynchronous: the time ``snapshot()`` blocks) and counts the bytes of
   its own ``.distcp`` file.
2. **synthesize peak memory** (one process, no process group): resident-set peak above the
   level before the call (``/proc/self/clear_refs`` + ``VmHWM``), as a multiple of the
   model's fp32 bytes, for ``synthesize(sigma_rel=0.08)`` over ``--snapshots`` snapshots of
   both profiles, side by side with the naive way (load every snapshot whole, then sum).
3. **Reconstruction error vs spacing**: a 64x64 toy parameter on a noisy drifting path for
   512 steps; the 0.08 EMA synthesized from 0.05/0.10 snapshots taken every ``k`` steps,
   against an online 0.08 EMA, relative to the distance between the 0.05 and 0.08 EMAs.

Linux only (reads ``/proc``). Numbers depend on the machine; compare rows of one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from gloo_ranks import run_gloo_ranks
from torch import nn

from dtensor_ema import PostHocEMA, synthesize
from dtensor_ema.posthoc import plan_synthesis

MIB = 1024 * 1024
LAYER = 1024  # 1024 x 1024 fp32 = 4 MiB per layer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks for the snapshot cost")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[4, 16, 64],
        help="model sizes in MiB of fp32 weights",
    )
    parser.add_argument("--snapshots", type=int, default=8, help="snapshots to synthesize from")
    parser.add_argument("--repeats", type=int, default=3, help="timed snapshots per setting")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("snapshot", "synthesize", "spacing"),
        default=["snapshot", "synthesize", "spacing"],
        help="which measurements to run",
    )
    return parser


def make_model(mib: int) -> nn.Module:
    layers = max(1, mib * MIB // (LAYER * LAYER * 4))  # 4 MiB per layer
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)))


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match is not None, field
    return int(match.group(1))


def peak_extra_bytes(fn: Any) -> tuple[Any, int]:
    """Run ``fn()``; return its result and the resident-set peak above the level before."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    result = fn()
    return result, (_status_kib("VmHWM") - before) * 1024


# ---------------------------------------------------------------------------- 1. snapshots
def _snapshot_body(rank: int, world: int, store_dir: str, args: Any) -> dict[str, Any]:
    sizes, repeats = args
    rows = []
    for mib in sizes:
        model = make_model(mib)
        for label, kwargs in (
            ("fp32", {}),
            ("bf16", {"snapshot_dtype": torch.bfloat16}),
            ("async fp32", {"async_save": True}),
        ):
            root = Path(store_dir) / f"{mib}-{label.replace(' ', '_')}"
            ph = PostHocEMA(model, (0.05, 0.10), snapshot_dir=root, **kwargs)
            times = []
            for _ in range(repeats):
                ph.update()
                dist.barrier()
                start = time.perf_counter()
                ph.snapshot()
                times.append(time.perf_counter() - start)
                ph.wait()
                dist.barrier()
            last = max(root.glob("step-*"))
            own = sum(f.stat().st_size for f in last.glob(f"__{rank}_*.distcp"))
            rows.append(
                {
                    "mib": mib,
                    "mode": label,
                    "s": min(times),
                    "bytes": own,
                    "local_ema_bytes": sum(ph.profile(s).local_nbytes() for s in ph.sigma_rels),
                }
            )
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root)
    return {"rows": rows}


def snapshot_costs(world: int, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    ranks = run_gloo_ranks(_snapshot_body, world, (sizes, repeats), timeout_s=1200)
    return [{"rank": r["rank"], **row} for r in ranks for row in r["rows"]]


# ---------------------------------------------------------------------------- 2. synthesize
def _naive(snapshot_dir: Path, sigma_rel: float) -> dict[str, torch.Tensor]:
    """Load every snapshot whole, then sum: what a non-streaming tool does."""
    terms, _ = plan_synthesis(snapshot_dir, sigma_rel)
    loaded = []
    for term in terms:
        spec = term.snapshot.tensors
        sd = {term.key: {k: torch.empty(v["shape"]) for k, v in spec.items()}}
        dcp.load(sd, checkpoint_id=str(term.snapshot.path), no_dist=True)
        loaded.append((term.weight, sd[term.key]))
    return {k: sum(w * sd[k].double() for w, sd in loaded).float() for k in loaded[0][1]}


def _measure_child(method: str, snapshot_dir: str, queue: Any) -> None:
    """In a fresh process, so one measurement's freed pages cannot hide the next one's."""
    torch.set_num_threads(1)
    warm = Path(snapshot_dir)
    plan_synthesis(warm, 0.08)  # imports and first-call allocations, outside the window
    fn = (
        (lambda: synthesize(warm, 0.08, bucket_bytes=32 * MIB))
        if method == "streaming"
        else (lambda: _naive(warm, 0.08))
    )
    start = time.perf_counter()
    out, peak = peak_extra_bytes(fn)
    queue.put((peak, time.perf_counter() - start, sum(v.numel() for v in out.values())))


def synthesize_memory(sizes: list[int], snapshots: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    rows = []
    for mib in sizes:
        model = make_model(mib)
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            ph = PostHocEMA(model, (0.05, 0.10), snapshot_every=1, snapshot_dir=tmp)
            for _ in range(snapshots):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                ph.update()
            del ph
            row: dict[str, Any] = {"mib": mib, "terms": 2 * snapshots}
            for method in ("streaming", "naive"):
                queue = ctx.Queue()
                proc = ctx.Process(target=_measure_child, args=(method, tmp, queue))
                proc.start()
                peak, seconds, numel = queue.get(timeout=1200)
                proc.join()
                assert numel * 4 == model_bytes
                row[f"{method}_peak_x_model"] = peak / model_bytes
                row[f"{method}_s"] = seconds
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- 3. spacing
def spacing_errors(spacings: list[int], steps: int = 512) -> dict[int, float]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    drift = torch.randn(64, 64) * 0.02
    with tempfile.TemporaryDirectory() as tmp:
        ph = PostHocEMA(model, (0.05, 0.10), snapshot_every=min(spacings), snapshot_dir=tmp)
        online = PostHocEMA(model, (0.08, 0.05))
        for _ in range(steps):
            with torch.no_grad():
                model.weight.add_(drift + torch.randn(64, 64) * 0.05)
            ph.update()
            online.update()
        truth = online.profile(0.08).ema_tensors()["weight"]
        scale = (truth - online.profile(0.05).ema_tensors()["weight"]).norm()
        errors = {}
        for k in spacings:
            got = synthesize(tmp, 0.08, steps=list(range(k, steps + 1, k)))["weight"]
            errors[k] = float((got - truth).norm() / scale)
    return errors


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sizes = [4, 8] if args.quick else args.sizes
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    if "snapshot" in args.parts:
        _print_snapshot_costs(args, sizes)
    if "synthesize" in args.parts:
        _print_synthesize_memory(args, sizes)
    if "spacing" in args.parts:
        _print_spacing()


def _print_snapshot_costs(args: argparse.Namespace, sizes: list[int]) -> None:
    print(f"## Snapshot cost per rank (W={args.world_size}, gloo, CPU; 2 profiles)\n")
    print("| model MiB | mode | rank | snapshot s | bytes written | local EMA bytes |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in snapshot_costs(args.world_size, sizes, args.repeats):
        print(
            f"| {row['mib']} | {row['mode']} | {row['rank']} | {row['s']:.3f} | "
            f"{row['bytes'] / MIB:.1f} MiB | {row['local_ema_bytes'] / MIB:.1f} MiB |"
        )


def _print_synthesize_memory(args: argparse.Namespace, sizes: list[int]) -> None:
    print(f"\n## synthesize peak memory (one process, {args.snapshots} snapshots x 2 profiles)\n")
    print(
        "| model MiB | terms | streaming peak / model | naive peak / model | streaming s ", end=""
    )
    print("| naive s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in synthesize_memory(sizes, 4 if args.quick else args.snapshots):
        print(
            f"| {row['mib']} | {row['terms']} | {row['streaming_peak_x_model']:.2f} | "
            f"{row['naive_peak_x_model']:.2f} | {row['streaming_s']:.2f} | {row['naive_s']:.2f} |"
        )


def _print_spacing() -> None:
    print("\n## Reconstruction error vs snapshot spacing (toy, 512 steps, sigma_rel 0.08)\n")
    print("| spacing (steps) | snapshots per profile | relative error |")
    print("|---:|---:|---:|")
    for k, err in spacing_errors([2, 4, 8, 16, 32, 64, 128]).items():
        print(f"| {k} | {512 // k} | {err:.2e} |")


if __name__ == "__main__":
    main()
