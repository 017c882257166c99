"""What a checkpoint costs in an object store: save and load of GPT-2 small's EMA at W=2
to a local S3 endpoint against the same through a local folder, in the same run, and the
requests each save and load makes.

GPT-2 small from ``transformers`` (``GPT2LMHeadModel(GPT2Config())``, randomly initialized,
124M parameters), its EMA sharded over W gloo CPU ranks (one thread each). The store is
moto's S3 server on 127.0.0.1 (``tests/object_store.py``: started here, in this process),
reached through ``s3fs``/``botocore`` as AWS is (``AWS_ENDPOINT_URL``). Each repeat, on
every rank after a barrier, in alternating order: ``save_checkpoint({"ema": ema}, path)``,
then ``load_checkpoint`` into a second EMA (verified), ``path`` a folder or
``s3://bench/ema``. Rank 0 reads from the store which requests each save and load made
(all ranks together), by kind.

    python benchmarks/object_storage.py --world-size 2 --repeat 3

Loopback moto is not S3: it has no network latency and no bandwidth limit, keeps objects in
this process, and parses every request in Python. The requests counted are the client's
and hold anywhere; the times say what the library adds on top of the transfers.
``--quick``: a tiny GPT-2, one repeat (the smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtensor_ema
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the local endpoint
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gloo_ranks import run_gloo_ranks
from object_store import LocalS3, make_bucket, requests

from dtensor_ema import ModelEMA, load_checkpoint, save_checkpoint

BUCKET = "bench"


def _model(quick: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = (
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, bos_token_id=0, eos_token_id=0)
        if quick
        else GPT2Config()
    )
    return GPT2LMHeadModel(config)


def kinds(seen: list[str]) -> dict[str, int]:
    """Requests by kind: ``GET`` of an object (a byte range or whole), ``LIST``, ``PUT``
    (an object, a part, or a server-side copy), ``HEAD``, ``POST`` (a multipart upload's
    start or end, a bulk delete)."""
    out: Counter[str] = Counter()
    for r in seen:
        method, _, rest = r.partition(" ")
        out["LIST" if method == "GET" and "list-type=" in rest else method] += 1
    return dict(sorted(out.items()))


def _body(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    model = _model(args.quick)
    ema, other = (ModelEMA(model, decay=0.9999, tau=None) for _ in range(2))
    ema.update()
    places = {"folder": str(Path(folder) / "ema"), "store": f"s3://{BUCKET}/ema"}

    def timed(fn: Any) -> tuple[float, dict[str, int]]:
        dist.barrier()
        before = len(requests(endpoint)) if rank == 0 else 0
        dist.barrier()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        dist.barrier()
        made = requests(endpoint)[before:] if rank == 0 else []
        return took, kinds(made)

    samples: dict[str, list[float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for where in places.values():  # warm-up: files, clients, the first save's leftovers
        save_checkpoint({"ema": ema}, where)
    for i in range(args.repeat):
        for name in sorted(places, reverse=i % 2 == 1):
            where = places[name]
            took, made = timed(lambda w=where: save_checkpoint({"ema": ema}, w))
            samples.setdefault(f"{name}_save", []).append(took)
            counts[f"{name}_save"] = made
            took, made = timed(lambda w=where: load_checkpoint({"ema": other}, w))
            samples.setdefault(f"{name}_load", []).append(took)
            counts[f"{name}_load"] = made
    out: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    out["ema_bytes"] = ema.local_nbytes()
    out["counts"] = counts if rank == 0 else {}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, one repeat")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 1
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with LocalS3() as store:
        os.environ.update(store.env)  # the ranks inherit it, as from a user's shell
        make_bucket(BUCKET)
        rows = run_gloo_ranks(_body, args.world_size, args)
    what = "tiny GPT-2 (--quick)" if args.quick else "GPT-2 small (transformers, random init)"
    print(
        f"{what}, EMA of W={args.world_size} gloo ranks, median of {args.repeat}, "
        f"torch {torch.__version__}, one thread per rank; store: moto on loopback"
    )
    print("rank  EMA MiB  save: folder s  store s  ratio   load: folder s  store s  ratio")
    for r in rows:
        print(
            f"{r['rank']:>4}  {r['ema_bytes'] / 2**20:7.1f}  {r['folder_save']:14.3f}  "
            f"{r['store_save']:7.3f}  {r['store_save'] / r['folder_save']:5.2f}   "
            f"{r['folder_load']:14.3f}  {r['store_load']:7.3f}  "
            f"{r['store_load'] / r['folder_load']:5.2f}"
        )
    counts = rows[0]["counts"]
    for op in ("save", "load"):
        made = counts[f"store_{op}"]
        detail = ", ".join(f"{k} {v}" for k, v in made.items())
        print(f"requests per {op} (all ranks): {sum(made.values())} ({detail})")
    if any(re.search("folder", k) and v for k, v in counts.items()):
        print("(unexpected: the folder runs made requests to the store)")
    print(f"(load average before the run: {load_before})")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
