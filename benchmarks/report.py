"""Turn the ranks' raw samples into tables, JSON, CSV and a plot.

Per-rank numbers are medians over repeats; a world size's number is the slowest rank's
median (a synchronous step waits for the slowest rank). Ratios compare implementations
measured at the same world size in the same processes.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from measure import Config
from workloads import get_spec, plan_bytes_per_rank

MiB = 1024**2
PLAN_WORLD_SIZES = (3, 8)


def _median_ms(samples: dict[str, list[float]], key: str = "wall") -> float:
    return statistics.median(samples[key]) * 1e3


def _slowest(ranks: list[dict[str, Any]], key: str = "wall") -> float:
    """Slowest rank's median, in ms."""
    return max(_median_ms(r, key) for r in ranks)


# --------------------------------------------------------------------------- summaries
def summarize(runs: dict[int, list[dict[str, Any]]], cfg: Config) -> dict[str, Any]:
    update, memory, materialize, fsdp2, skipped = [], [], [], [], []
    models = list(cfg.models)
    for model in models:
        shapes_done = False
        for w, ranks in sorted(runs.items()):
            per_rank = [r["models"][model] for r in ranks]
            head = per_rank[0]
            if "skipped" in head:
                skipped.append(
                    {"model": model, "world_size": w, "what": "all", "why": head["skipped"]}
                )
                continue
            impl_names = list(head["update"])
            times = {n: [p["update"][n] for p in per_rank] for n in impl_names}
            row: dict[str, Any] = {"model": model, "params": head["params"], "world_size": w}
            for n in impl_names:
                row[f"{n}_ms"] = _slowest(times[n])
                row[f"{n}_cpu_ms"] = _slowest(times[n], "cpu")
            row["ours_over_timm"] = row["dtensor_ema_ms"] / row["timm_v3_ms"]
            row["ours_over_timm_cpu"] = row["dtensor_ema_cpu_ms"] / row["timm_v3_cpu_ms"]
            if "swa_averaged_ms" in row:
                row["ours_over_swa"] = row["dtensor_ema_ms"] / row["swa_averaged_ms"]
                row["ours_over_swa_cpu"] = row["dtensor_ema_cpu_ms"] / row["swa_averaged_cpu_ms"]
            row["replan_over_update"] = row["dtensor_ema_replan_ms"] / row["dtensor_ema_ms"]
            row["target"] = 1.1 / w
            bw = [
                (p["touched_bytes"] / _median_ms(p["update"]["dtensor_ema"]))
                / (p["copy_ref_bytes"] / _median_ms(p["update"]["copy_ref"]))
                for p in per_rank
            ]
            row["bw_vs_copy_min"] = min(bw)
            row["bw_vs_copy_mean"] = statistics.mean(bw)
            row["ours_GBps_min"] = min(
                p["touched_bytes"] / _median_ms(p["update"]["dtensor_ema"]) / 1e6 for p in per_rank
            )
            row["copy_GBps_min"] = min(
                p["copy_ref_bytes"] / _median_ms(p["update"]["copy_ref"]) / 1e6 for p in per_rank
            )
            row["update_collectives"] = max(p["update_comms"] for p in per_rank)
            update.append(row)

            local = [p["local_nbytes"] for p in per_rank]
            total = head["ema_total_bytes"]
            plan, _ = _plan(model, cfg, w)
            memory.append(_memory_row(model, w, "measured", max(local), total, plan == local))
            if not shapes_done:
                for pw in PLAN_WORLD_SIZES:
                    plan_w, total_w = _plan(model, cfg, pw)
                    memory.append(_memory_row(model, pw, "plan", max(plan_w), total_w, None))
                shapes_done = True

            if "materialize_skipped" in head:
                skipped.append(
                    {
                        "model": model,
                        "world_size": w,
                        "what": "materialize",
                        "why": head["materialize_skipped"],
                    }
                )
                continue
            mat = {n: [p["materialize"][n] for p in per_rank] for n in head["materialize"]}
            mrow: dict[str, Any] = {"model": model, "world_size": w, "ema_mib": total / MiB}
            for n, samples in mat.items():
                mrow[f"{n}_ms"] = _slowest(samples)
            ref = mrow["all_gather_flat_ref_ms"]
            mrow["ref_prealloc_over_ref"] = mrow["all_gather_prealloc_ms"] / ref
            mrow["gmsd_over_ref"] = mrow["get_model_state_dict_ms"] / ref
            mrow["buckets_over_ref"] = mrow["ema_flat_buckets_ms"] / ref
            mrow["full_tensor_over_ref"] = mrow["full_tensor_each_ms"] / ref
            for n, count in head["materialize_comms"].items():
                mrow[f"{n}_collectives"] = count
            materialize.append(mrow)
    for model in cfg.fsdp_models:
        for w, ranks in sorted(runs.items()):
            per_rank = [r["fsdp2"][model] for r in ranks]
            head = per_rank[0]
            frow: dict[str, Any] = {
                "model": model,
                "world_size": w,
                "params": head["params"],
                "dtensor_params": head["dtensor_params"],
                "replicated_float_buffers": head["replicated_float_buffers"],
                "swap_collectives": max(p["swap_comms"] for p in per_rank),
                "update_collectives": max(p["update_comms"] for p in per_rank),
                "swap_correct": all(p["swap_ok"] for p in per_rank),
            }
            for n in head["times"]:
                frow[f"{n}_ms"] = _slowest([p["times"][n] for p in per_rank])
            fsdp2.append(frow)
    return {
        "update": update,
        "memory": memory,
        "materialize": materialize,
        "fsdp2": fsdp2,
        "skipped": skipped,
    }


def _plan(model: str, cfg: Config, world_size: int) -> tuple[list[int], int]:
    with torch.device("meta"):
        shapes = get_spec(model).build().to(getattr(torch, cfg.param_dtype))
    return plan_bytes_per_rank(shapes, world_size)


def _memory_row(
    model: str, w: int, source: str, max_local: int, total: int, matches_plan: bool | None
) -> dict[str, Any]:
    return {
        "model": model,
        "world_size": w,
        "source": source,
        "max_local_mib": max_local / MiB,
        "total_over_w_mib": total / w / MiB,
        "ratio": max_local / (total / w),
        "matches_plan": matches_plan,
    }


# --------------------------------------------------------------------------- tables
def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def format_tables(summary: dict[str, Any], env: dict[str, Any]) -> str:
    parts = [
        f"Machine: {env['cpu']}, {env['cpu_count']} cores, torch {env['torch']}, "
        f"1 thread per rank, {env['date']}, commit {env['git_commit']}",
        f"Command: {env['command']}",
        "",
        "1-2. update(): per-rank wall ms (median over repeats, slowest rank), interleaved",
    ]
    rows = []
    for r in summary["update"]:
        ok = "yes" if r["ours_over_timm"] <= r["target"] else "NO"
        rows.append(
            [
                r["model"],
                f"{r['params'] / 1e6:.1f}M",
                str(r["world_size"]),
                _ms(r["dtensor_ema_ms"]),
                _ms(r["dtensor_ema_replan_ms"]),
                _ms(r["timm_v3_ms"]),
                _ms(r.get("swa_averaged_ms")),
                _ms(r["yolov5_loop_ms"]),
                f"{r['ours_over_timm']:.3f}",
                f"{r['ours_over_timm_cpu']:.3f}",
                f"{r['ours_over_swa']:.3f}" if "ours_over_swa" in r else "-",
                f"{r['ours_over_swa_cpu']:.3f}" if "ours_over_swa_cpu" in r else "-",
                f"{r['target']:.3f} {ok}",
                f"{r['bw_vs_copy_min']:.2f}",
                f"{r['ours_GBps_min']:.1f} / {r['copy_GBps_min']:.1f}",
                str(r["update_collectives"]),
            ]
        )
    parts.append(
        _table(
            [
                "model",
                "params",
                "W",
                "dtensor_ema",
                "(re-plan)",
                "timm V3",
                "AveragedModel",
                "yolov5 loop",
                "ours/timm",
                "(cpu time)",
                "ours/AvgModel",
                "(cpu time)",
                "target 1.1/W",
                "bw/copy_",
                "GB/s ours / copy_",
                "comms",
            ],
            rows,
        )
    )
    parts += ["", "3. EMA bytes per rank: slowest (largest) rank vs total/W"]
    rows = [
        [
            r["model"],
            str(r["world_size"]),
            r["source"]
            + (
                ""
                if r["matches_plan"] is None
                else (" = plan" if r["matches_plan"] else " != plan")
            ),
            f"{r['max_local_mib']:.2f}",
            f"{r['total_over_w_mib']:.2f}",
            f"{r['ratio']:.4f}",
        ]
        for r in summary["memory"]
    ]
    parts.append(_table(["model", "W", "source", "max MiB", "total/W MiB", "ratio"], rows))
    parts += ["", "4. Full weights: ms (slowest rank) vs one flat all_gather of the same bytes"]
    rows = [
        [
            r["model"],
            str(r["world_size"]),
            f"{r['ema_mib']:.0f}",
            _ms(r["get_model_state_dict_ms"]),
            _ms(r["ema_flat_buckets_ms"]),
            _ms(r["full_tensor_each_ms"]),
            _ms(r["all_gather_flat_ref_ms"]),
            _ms(r["all_gather_prealloc_ms"]),
            _ms(r["alloc_touch_ref_ms"]),
            f"{r['gmsd_over_ref']:.2f}",
            f"{r['buckets_over_ref']:.2f}",
            f"{r['full_tensor_over_ref']:.2f}",
            f"{r['get_model_state_dict_collectives']}/{r['ema_flat_buckets_collectives']}",
        ]
        for r in summary["materialize"]
    ]
    parts.append(
        _table(
            [
                "model",
                "W",
                "EMA MiB",
                "get_model_state_dict",
                "EMA buckets",
                "full_tensor() each",
                "flat all_gather (ref)",
                "ref, out preallocated",
                "fresh P bytes: alloc+touch",
                "gmsd/ref",
                "buckets/ref",
                "full_tensor/ref",
                "colls gmsd/buckets",
            ],
            rows,
        )
    )
    parts += ["", "5. FSDP2 (fully_shard per block + root): evaluation swap and update"]
    rows = [
        [
            r["model"],
            str(r["world_size"]),
            f"{r['dtensor_params']}/{r['replicated_float_buffers']}",
            _ms(r["swap_enter_exit_ms"]),
            str(r["swap_collectives"]),
            _ms(r["update_ms"]),
            str(r["update_collectives"]),
            _ms(r["get_model_state_dict_ms"]),
            "yes" if r["swap_correct"] else "NO",
        ]
        for r in summary["fsdp2"]
    ]
    parts.append(
        _table(
            [
                "model",
                "W",
                "DTensor params/float buffers",
                "swap enter+exit",
                "swap comms",
                "update",
                "update comms",
                "get_model_state_dict",
                "swap correct",
            ],
            rows,
        )
    )
    if summary["skipped"]:
        parts += ["", "Skipped:"]
        parts += [
            f"- {s['model']} W={s['world_size']} ({s['what']}): {s['why']}"
            for s in summary["skipped"]
        ]
    return "\n".join(parts)


# --------------------------------------------------------------------------- files
def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _plot(summary: dict[str, Any], env: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    world_sizes = sorted({r["world_size"] for r in summary["update"]})
    colors = plt.get_cmap("tab10")
    for i, w in enumerate(world_sizes):
        rows = sorted(
            (r for r in summary["update"] if r["world_size"] == w), key=lambda r: r["params"]
        )
        x = [r["params"] for r in rows]
        ax.plot(
            x,
            [r["dtensor_ema_ms"] for r in rows],
            "o-",
            color=colors(i),
            label=f"dtensor_ema W={w}",
        )
        ax.plot(
            x,
            [r["timm_v3_ms"] for r in rows],
            "x--",
            color=colors(i),
            label=f"timm ModelEmaV3 W={w}",
        )
    for r in summary["update"]:
        if r["world_size"] == world_sizes[0]:
            ax.annotate(
                r["model"],
                (r["params"], r["timm_v3_ms"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 6),
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("update() per rank, ms (median, slowest rank)")
    where = (
        f"{env['gpu']}, NCCL"
        if env.get("gpu")
        else f"{env['cpu_count']} CPU cores, gloo, 1 thread/rank"
    )
    ax.set_title(f"EMA update time, {where}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    runs: dict[int, list[dict[str, Any]]], cfg: Config, env: dict[str, Any], out_dir: Path
) -> dict[str, Any]:
    """Print the tables; write results.json/.md, one CSV per section, update_time.png."""
    summary = summarize(runs, cfg)
    text = format_tables(summary, env)
    print(text, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "config": asdict(cfg), "summary": summary, "raw": runs}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / "results.md").write_text(text + "\n")
    for section in ("update", "memory", "materialize", "fsdp2"):
        _write_csv(out_dir / f"{section}.csv", summary[section])
    if summary["update"]:
        _plot(summary, env, out_dir / "update_time.png")
    return summary
