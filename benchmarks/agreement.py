"""Cost of the agreement before each collective call (which call, which EMA, which count).

Every ``ModelEMA`` collective (``get_model_state_dict`` here), ``export_ema`` and
``export_peft_adapter`` first run ``_collectives.agree_on_call``: one all-gather of six
int64s per mesh dim. This measures, on ``--world-size`` gloo CPU ranks, one thread each:

* the agreement alone (median of ``20 * --repeat`` calls);
* ``get_model_state_dict()`` with the agreement off (``DTENSOR_EMA_AGREE_CALLS=0``) and on,
  off and on alternating within each repeat (which goes first alternating too), medians;
  the ratio on / off is the added cost (the target: at most 1.02 on GPT-2 at W=2).

    python benchmarks/agreement.py --world-size 2 --repeat 9 --model gpt2
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

from dtensor_ema import ModelEMA
from dtensor_ema._collectives import CALLS_ENV, agree_on_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import run_gloo_ranks
from workloads import get_spec


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _with_agreement(on: bool, fn: Callable[[], Any]) -> float:
    if on:
        os.environ.pop(CALLS_ENV, None)
    else:
        os.environ[CALLS_ENV] = "0"
    try:
        return _timed(fn)
    finally:
        os.environ.pop(CALLS_ENV, None)


def _body(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = get_spec(args.model).build()
    ema = ModelEMA(model, decay=0.9, tau=None)
    ema.update()
    alone = [
        _timed(lambda: agree_on_call("bench", ema.engine.call_identity, mesh=ema.mesh))
        for _ in range(20 * args.repeat)
    ]
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeat):
        for on in (False, True) if i % 2 == 0 else (True, False):
            times[on].append(_with_agreement(on, ema.get_model_state_dict))
    return {
        "alone_ms": 1e3 * statistics.median(alone),
        "off_s": statistics.median(times[False]),
        "on_s": statistics.median(times[True]),
        "bytes": ema.local_nbytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--model", default="gpt2")
    args = parser.parse_args()
    spec = get_spec(args.model)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = run_gloo_ranks(_body, args.world_size, args)
    print(
        f"{spec.note} fp32 EMA, W={args.world_size} gloo, median of {args.repeat}, "
        f"torch {torch.__version__}, one thread per rank; load average before: {load_before}"
    )
    print("rank  EMA MiB  agreement ms  get_model_state_dict s: off    on  ratio")
    for r in rows:
        print(
            f"{r['rank']:>4}  {r['bytes'] / 2**20:7.1f}  {r['alone_ms']:12.3f}  "
            f"{'':>22}{r['off_s']:6.3f}  {r['on_s']:6.3f}  {r['on_s'] / r['off_s']:5.3f}"
        )


if __name__ == "__main__":
    main()
