"""Run the dtensor_ema benchmark suite: one spawn of W ranks per world size.

    python benchmarks/run_all.py                 # full CPU suite (W = 1, 2, 4), ~10 min
    python benchmarks/run_all.py --quick         # smoke test, tiny models, < 1 min
    python benchmarks/run_all.py --device cuda   # NCCL, one GPU per rank

Prints a table and writes ``results.json``, ``results.csv`` and ``update_time.png`` to
``--out`` (default ``benchmarks/results/``). See ``benchmarks/README.md`` for what each
number means.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Benchmark the checkout this file lives in, not whatever dtensor_ema is installed.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from measure import Config, rank_main  # noqa: E402
from report import write_outputs  # noqa: E402

FULL_MODELS = ("resnet50", "gpt2", "gpt1b-L{big}")
QUICK_MODELS = ("mobilenet_v3_small", "gpt-tiny")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, W=1,2, few repeats")
    p.add_argument("--world-sizes", default=None, help="comma list (default 1,2,4; quick 1,2)")
    p.add_argument(
        "--models", default=None, help="comma list (default resnet50,gpt2,gpt1b-L<big>; none)"
    )
    p.add_argument(
        "--fsdp-models", default=None, help="FSDP2 swap models (default gpt2,resnet50; none)"
    )
    p.add_argument("--big-layers", type=int, default=2, help="layers of the 1B-wide shape")
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None, help="update repeats per implementation")
    p.add_argument("--mat-reps", type=int, default=None, help="materialization/FSDP2 repeats")
    p.add_argument(
        "--mem-budget-gib",
        type=float,
        default=None,
        help="host memory all ranks together may use; larger cases are skipped and reported\n"
        "(default: the smaller of 12 and 70%% of MemAvailable, read before each world size)",
    )
    p.add_argument("--deadline-s", type=float, default=1800.0, help="per world size")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-render tables, CSV and plot from an earlier results.json (no measuring)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    args.world_sizes = _ints(args.world_sizes or ("1,2" if quick else "1,2,4"))
    default_models = (
        QUICK_MODELS if quick else tuple(m.format(big=args.big_layers) for m in FULL_MODELS)
    )
    models = _names(args.models)
    args.models = default_models if models is None else models
    fsdp_models = _names(args.fsdp_models)
    default_fsdp = ("gpt-tiny",) if quick else ("gpt2", "resnet50")
    args.fsdp_models = default_fsdp if fsdp_models is None else fsdp_models
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    args.reps = args.reps or (3 if quick else 10)
    args.mat_reps = args.mat_reps or (2 if quick else 5)
    return args


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise SystemExit(f"--world-sizes must be positive integers, got {text!r}")
    return values


def _names(text: str | None) -> tuple[str, ...] | None:
    """Comma list; ``None`` when not given (use the default), ``()`` for ``none``."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    return tuple(v.strip() for v in text.split(",") if v.strip())


# --------------------------------------------------------------------------- spawning
def _rank_entry(rank: int, world_size: int, cfg: Config, run_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        if cfg.device == "cuda":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )
        result: tuple[bool, Any] = (True, rank_main(rank, world_size, cfg))
    except BaseException:
        result = (False, traceback.format_exc())
    with open(os.path.join(run_dir, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(world_size: int, cfg: Config, deadline_s: float) -> list[dict[str, Any]]:
    """Run :func:`measure.rank_main` on ``world_size`` ranks; their results, by rank."""
    with tempfile.TemporaryDirectory(prefix="dtensor-ema-bench-") as run_dir:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank_entry, args=(r, world_size, cfg, run_dir), name=f"rank{r}")
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        start = time.monotonic()
        while any(p.is_alive() for p in procs):
            if time.monotonic() - start > deadline_s:
                for proc in procs:
                    proc.terminate()
                raise SystemExit(f"W={world_size}: ranks still running after {deadline_s:.0f} s")
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(10)  # let the others report, then stop them
                for proc in procs:
                    proc.terminate()
                break
            time.sleep(0.1)
        results: list[dict[str, Any]] = []
        failures: list[str] = []
        for rank, proc in enumerate(procs):
            proc.join(5)
            path = Path(run_dir, f"result{rank}.pkl")
            if not path.exists():
                failures.append(f"rank {rank}: exit code {proc.exitcode}, no result")
                continue
            ok, value = pickle.loads(path.read_bytes())
            if ok:
                results.append(value)
            else:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise SystemExit(f"W={world_size} failed:\n" + "\n".join(failures))
        return results


def _available_gib() -> float:
    """MemAvailable from /proc/meminfo (the machine is shared), or 12 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return 12.0


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import dtensor_ema

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "dtensor_ema": dtensor_ema.__file__,
        "git_commit": commit,
        "threads_per_rank": 1,
    }


def rerender(path: Path, out: Path) -> None:
    """Tables, CSV, plot again from the raw samples an earlier run saved."""
    payload = json.loads(path.read_text())
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in payload["config"].items()
    }
    runs = {int(w): ranks for w, ranks in payload["raw"].items()}
    write_outputs(runs, Config(**fields), payload["environment"], out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        rerender(args.from_json, args.out)
        return 0
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        too_big = [w for w in args.world_sizes if w > torch.cuda.device_count()]
        if too_big:
            raise SystemExit(f"--world-sizes {too_big} exceed {torch.cuda.device_count()} GPUs")
    cfg = Config(
        models=args.models,
        fsdp_models=args.fsdp_models,
        param_dtype={"fp32": "float32", "bf16": "bfloat16"}[args.param_dtype],
        device=args.device,
        warmup=args.warmup,
        reps=args.reps,
        mat_reps=args.mat_reps,
        mem_budget_gib=args.mem_budget_gib or 0.0,
    )
    env = environment(args)
    if args.device == "cpu" and max(args.world_sizes) > (os.cpu_count() or 1):
        print(
            f"note: W={max(args.world_sizes)} ranks share {os.cpu_count()} CPU cores; "
            "compare implementations at the same W, not across W",
            flush=True,
        )
    runs: dict[int, list[dict[str, Any]]] = {}
    for world_size in args.world_sizes:
        t0 = time.monotonic()
        budget = args.mem_budget_gib or min(12.0, round(0.7 * _available_gib(), 1))
        run_cfg = dataclasses.replace(cfg, mem_budget_gib=budget)
        print(f"W={world_size}: host memory budget {budget} GiB", flush=True)
        runs[world_size] = spawn(world_size, run_cfg, args.deadline_s)
        print(f"W={world_size}: done in {time.monotonic() - t0:.0f} s", flush=True)
    write_outputs(runs, cfg, env, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
