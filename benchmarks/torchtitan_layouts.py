"""Per-layout cost of the EMA on torchtitan's llama3 debugmodel (gloo CPU, W=4 ranks).

Layouts: DDP; FSDP2 (1-D, every layer a unit); HSDP 2x2 (``(Replicate(), Shard(0))``);
FSDP2+TP 2x2 (TP on every layer's feed-forward ``w1``/``w3`` colwise and ``w2`` rowwise,
then FSDP2 on the dp dim). For each, per rank:

* EMA bytes / (total/W): ours (``ModelEMA``) against a torchtitan-style EMA, a
  ``p.detach().clone()`` of every (DTensor) parameter as torchtitan's development EMA keeps;
* update time (median of ``--repeats``): ``ema.update()`` against torchtitan's
  ``torch._foreach_lerp_`` on the DTensor clones;
* collectives issued by the swap (``average_parameters()`` entry and exit) and by
  ``get_model_state_dict()``, counted with torch's ``CommDebugMode`` (c10d and functional
  collectives).

Run: ``python benchmarks/torchtitan_layouts.py [--layers 2] [--repeats 20]`` (needs the
``zoo`` extra: torchtitan 0.3.0). Rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

W = 4
LAYOUTS = ("ddp", "fsdp2", "hsdp_2x2", "fsdp2_tp_2x2")


def _model(layers: int) -> nn.Module:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    return config.build()


def _layout(name: str, model: nn.Module) -> tuple[nn.Module, Any]:
    """``(module to train, mesh passed to ModelEMA or None)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name == "ddp":
        return DDP(model), None
    if name == "fsdp2":
        mesh = init_device_mesh("cpu", (W,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, None
    if name == "hsdp_2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mesh  # mesh=None is refused on 2-D meshes today (issue 18 item 2)
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.layers.values():
        plan = {
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _count(fn: Any) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn()
    return int(mode.get_total_counts())


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _body(rank: int, store_path: str, layers: int, repeats: int, queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, W)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=W, timeout=timedelta(seconds=300)
    )
    from dtensor_ema import ModelEMA

    rows = []
    for name in LAYOUTS:
        model = _model(layers)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        trained, mesh = _layout(name, model)
        ema = ModelEMA(trained, mesh, decay=0.999, tau=None, buffers="copy")
        params = [p for p in model.parameters() if p.requires_grad]
        clones = [p.detach().clone() for p in params]  # torchtitan's development EMA
        clone_bytes = sum(
            (c.to_local() if hasattr(c, "to_local") else c).numel() * c.element_size()
            for c in clones
        )
        ours_ms = _median_ms(ema.update, repeats)

        def titan_update(
            clones: list[torch.Tensor] = clones, params: list[torch.Tensor] = params
        ) -> None:
            with torch.no_grad():
                torch._foreach_lerp_(clones, [p.detach() for p in params], 0.001)

        titan_ms = _median_ms(titan_update, repeats)

        def swap(ema: ModelEMA = ema) -> None:
            with ema.average_parameters():
                pass

        swap_n = _count(swap)
        gsd_n = _count(ema.get_model_state_dict)
        rows.append(
            {
                "layout": name,
                "ours_ratio": ema.local_nbytes() / (total / W),
                "titan_ratio": clone_bytes / (total / W),
                "ours_ms": ours_ms,
                "titan_ms": titan_ms,
                "swap": swap_n,
                "gsd": gsd_n,
            }
        )
        dist.barrier()
    queue.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="debugmodel layers kept")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_body,
                args=(r, os.path.join(tmp, "store"), args.layers, args.repeats, queue),
            )
            for r in range(W)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1200) for _ in procs)
        for p in procs:
            p.join()
    print(
        f"torchtitan llama3 debugmodel ({args.layers} layers), W={W}, gloo CPU, 1 thread/rank; "
        "bytes and times: max over ranks; counts: rank 0"
    )
    print(
        "| layout | EMA bytes/(total/W) ours | torchtitan-style | update ms ours | "
        "torchtitan-style | swap collectives | get_model_state_dict collectives |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, row in enumerate(results[0]):
        per_rank = [results[r][i] for r in range(W)]
        print(
            f"| {row['layout']} | {max(x['ours_ratio'] for x in per_rank):.2f} | "
            f"{max(x['titan_ratio'] for x in per_rank):.2f} | "
            f"{max(x['ours_ms'] for x in per_rank):.2f} | "
            f"{max(x['titan_ms'] for x in per_rank):.2f} | {row['swap']} | {row['gsd']} |"
        )


if __name__ == "__main__":
    main()
