"""Scale simulation: per-rank EMA bytes and update time for Llama 3 8B/70B/405B at W = 8..1024.

    python benchmarks/scale.py --out scale_out             # CPU, ~5-10 minutes
    python benchmarks/scale.py --out scale_out --quick     # fewer sizes (smoke test)

One process acts as rank 0 of W ranks (torch's fake process group). Rank 0 holds the most:
shards follow ``torch.chunk``, whose first chunks are the full ones.

1. ``bytes``: the model is built on the ``meta`` device and laid out as DDP (a replica per
   rank, EMA sharded over the 1-D world), FSDP2 (``fully_shard`` on a 1-D mesh) or HSDP
   (``fully_shard`` on a (W/8, 8) mesh), or DeepSpeed ZeRO-3 (every parameter given the
   partition attributes DeepSpeed sets: ``ds_numel``, ``ds_shape``, this rank's
   ``ceil(ds_numel / W)``-element ``ds_tensor``; ``dtensor_ema.simulate.zero3_partitioned``);
   :func:`dtensor_ema.simulate.plan_bytes` runs the library's own layout rule on it.
   Compared with a replicated EMA (timm, AveragedModel: the whole model on every rank).
2. ``time``: rank 0's real local tensors (FSDP2 layout, bf16 parameters, fp32 EMA) are
   allocated on ``--device`` and updated; eager and compiled kernels against a ``copy_``
   of the same bytes (10 per value: the ideal single pass for bf16 -> fp32). A replicated
   EMA's time is extrapolated from timm ``ModelEmaV3`` measured on one full Llama-3-8B
   block per value (the update is memory-bound, so its time is linear in the values).

Writes ``scale.json``, ``scale.md`` and ``scale_bytes.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from gpu_suite import interleave  # noqa: E402
from shapes import (  # noqa: E402
    LAYOUTS,
    count_params,
    fake_world,
    lay_out,
    materialize,
    meta_model,
    to_empty_tied,
)

from dtensor_ema import ModelEMA  # noqa: E402
from dtensor_ema.simulate import plan_bytes  # noqa: E402

GB = 1e9
CLOCK = {"cpu": "cpu", "cuda": "wall"}
"""CPU: one torch thread, thread CPU time (a shared machine's load cancels in the ratios)."""
DECAY = 0.9999
MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
# (model, W) whose rank-0 tensors fit a laptop-class host: <= ~2 GB of EMA + source.
TIME_POINTS = (
    ("llama3-8b", 64),
    ("llama3-8b", 1024),
    ("llama3-70b", 1024),
    ("llama3-405b", 1024),
)


def bytes_rows(models: tuple[str, ...], worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for name in models:
        params = count_params(meta_model(name))
        for layout in LAYOUTS:
            for world in worlds:
                with fake_world(world):
                    model, mesh = lay_out(meta_model(name), layout, "cpu")
                    pb = plan_bytes(model, mesh if layout == "ddp" else None)
                rows.append(
                    {
                        "model": name,
                        "params_B": round(params / 1e9, 2),
                        "layout": layout,
                        "world": world,
                        "ema_GB_per_rank": round(pb.local_bytes / GB, 4),
                        "replicated_GB_per_rank": round(pb.replicated_bytes / GB, 2),
                        "ratio_vs_replicated_over_W": round(
                            pb.local_bytes / (pb.replicated_bytes / world), 4
                        ),
                    }
                )
                print(rows[-1], flush=True)
    return rows


def timm_ns_per_value(device: torch.device, reps: int) -> float:
    """timm ModelEmaV3 (fp32 EMA of a bf16 model) on one full Llama-3-8B block, per value."""
    from timm.utils.model_ema import ModelEmaV3

    model = to_empty_tied(meta_model("llama3-8b-L1").to(torch.bfloat16), device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    ema = ModelEmaV3(model, decay=DECAY, dtype=torch.float32)
    seconds = interleave(
        {"timm": lambda: ema.update(model)}, device, warmup=1, reps=reps, clock=CLOCK[device.type]
    )
    return seconds["timm"] / count_params(model) * 1e9


def time_rows(points: tuple[tuple[str, int], ...], device: torch.device, reps: int) -> list:
    timm_ns = timm_ns_per_value(device, reps)
    rows = []
    for name, world in points:
        with fake_world(world):
            model, _ = lay_out(meta_model(name).to(torch.bfloat16), "fsdp2", device.type)
            model = materialize(model, device)
            eager = ModelEMA(model, decay=DECAY, tau=None, kernel="eager", cuda_graph=False)
            compiled = ModelEMA(model, decay=DECAY, tau=None, kernel="compiled", cuda_graph=False)
            start = time.perf_counter()
            compiled.update()
            first = time.perf_counter() - start
            numel = eager.local_numel()
            nbytes = 10 * numel
            src = torch.empty(nbytes // 8, dtype=torch.float32, device=device).normal_()
            dst = torch.empty_like(src)
            t = interleave(
                {
                    "eager": eager.update,
                    "compiled": compiled.update,
                    "copy": lambda dst=dst, src=src: dst.copy_(src),
                },
                device,
                warmup=1,
                reps=reps,
                clock=CLOCK[device.type],
            )
            copy_bw = nbytes / t["copy"]
            params = count_params(meta_model(name))
            replicated_s = timm_ns * params / 1e9
            best = min(t["eager"], t["compiled"])
            rows.append(
                {
                    "model": name,
                    "world": world,
                    "clock": CLOCK[device.type],
                    "local_values_M": round(numel / 1e6, 1),
                    "eager_ms": round(t["eager"] * 1e3, 2),
                    "compiled_ms": round(t["compiled"] * 1e3, 2),
                    "first_compiled_update_s": round(first, 1),
                    "copy_ms": round(t["copy"] * 1e3, 2),
                    "copy_GBps": round(copy_bw / GB, 2),
                    "eager_bw_vs_copy": round(t["copy"] / t["eager"], 3),
                    "compiled_bw_vs_copy": round(t["copy"] / t["compiled"], 3),
                    "replicated_timm_s_extrapolated": round(replicated_s, 2),
                    "best_over_replicated_per_W": round(best / (replicated_s / world), 3),
                }
            )
            print(rows[-1], flush=True)
            del model, eager, compiled, src, dst, t
            gc.collect()
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"ddp": "o", "fsdp2": "s", "hsdp": "^", "zero3": "x"}
    for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        color = f"C{i}"
        mine = [r for r in rows if r["model"] == name]
        worlds = sorted({r["world"] for r in mine})
        replicated = [
            next(r for r in mine if r["world"] == w)["replicated_GB_per_rank"] for w in worlds
        ]
        ax.plot(worlds, replicated, "--", color=color, label=f"{name} replicated EMA")
        for layout, marker in markers.items():
            pts = [r for r in mine if r["layout"] == layout]
            ax.plot(
                [r["world"] for r in pts],
                [r["ema_GB_per_rank"] for r in pts],
                marker=marker,
                linestyle="-" if layout == "fsdp2" else "none",
                color=color,
                markerfacecolor=color if layout == "fsdp2" else "none",
                markersize={"ddp": 10, "hsdp": 7, "fsdp2": 4, "zero3": 8}[layout],
                label=f"{name} dtensor_ema"
                if layout == "fsdp2"
                else (f"{layout} (all models)" if i == 0 else None),
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size W")
    ax.set_ylabel("fp32 EMA GB per rank (rank 0)")
    ax.set_title("Per-rank EMA memory, Llama 3 shapes (plan on meta, fake process group)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def bytes_summary(rows: list[dict[str, Any]]) -> str:
    """Models x W, EMA GB per rank (identical for every layout where they agree)."""
    worlds = sorted({r["world"] for r in rows})
    lines = ["| model | replicated EMA GB/rank | " + " | ".join(f"W={w}" for w in worlds) + " |"]
    lines.append("|---|---|" + "---|" * len(worlds))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        cells = []
        for w in worlds:
            values = {r["ema_GB_per_rank"] for r in mine if r["world"] == w}
            cells.append(" / ".join(f"{v:.3g}" for v in sorted(values)))
        lines.append(
            f"| {name} | {mine[0]['replicated_GB_per_rank']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def write_markdown(results: dict[str, Any], out: Path) -> None:
    md = ["# Scale simulation\n", f"`{json.dumps(results['env'])}`\n", "## EMA GB per rank\n"]
    md += [bytes_summary(results["bytes"]), "\n### All rows\n", table(results["bytes"])]
    if "time" in results:
        md += ["\n## Per-rank update time (rank 0's real tensors)\n", table(results["time"])]
    (out / "scale.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("scale_out"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="8B only, W = 8, 1024; one time point")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--from-json", type=Path, help="re-render scale.md and the plot only")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    models = MODELS[:1] if args.quick else MODELS
    worlds = (8, 1024) if args.quick else WORLDS
    points = (("llama3-8b", 1024),) if args.quick else TIME_POINTS
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        plot(results["bytes"], args.out / "scale_bytes.png")
        write_markdown(results, args.out)
        return 0
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    results: dict[str, Any] = {
        "env": {
            "torch": torch.__version__,
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
        "bytes": bytes_rows(models, worlds),
    }
    plot(results["bytes"], args.out / "scale_bytes.png")
    if not args.skip_time:
        results["time"] = time_rows(points, device, 3 if args.quick else args.reps)
    (args.out / "scale.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, args.out)
    print(f"wrote {args.out}/scale.md, scale.json, scale_bytes.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
