"""What FSDP2 registers on the modules after each training phase, per configuration.

Prints a markdown table: for each configuration, how many of the model's parameters the
modules register as sharded DTensors (``DTensor/all``) after construction, forward,
backward, ``optimizer.step()``, an evaluation forward under ``no_grad`` and
``state_dict()``; whether the sharded parameters' ``to_local()`` storage stayed where it
was at ``fully_shard`` (lazy init and training included); and whether ``optimizer.step()``
writes that storage even while modules register unsharded parameters.

Run from the repository root (gloo, CPU; W = 2, 3 and 4 ranks)::

    python benchmarks/fsdp_registration_table.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_harness import run_ranks
from models import make_batch, make_model

CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "transformer, root only (default)": ({"model": "transformer"}, 2),
    "transformer, root only, raf=True": ({"model": "transformer", "root_raf": True}, 2),
    "transformer, nested (default)": ({"model": "transformer", "nested": True}, 2),
    "transformer, nested, blocks raf=False": (
        {"model": "transformer", "nested": True, "block_raf": False},
        2,
    ),
    "transformer, nested, blocks raf=False, root raf=True": (
        {"model": "transformer", "nested": True, "block_raf": False, "root_raf": True},
        2,
    ),
    "transformer, nested, MixedPrecision bf16": (
        {"model": "transformer", "nested": True, "mp": True},
        2,
    ),
    "transformer, nested, set_reshard_after_backward(False)": (
        {"model": "transformer", "nested": True, "reshard_after_backward": False},
        2,
    ),
    "resnet18, nested (default), W=3": ({"model": "resnet18", "nested": True}, 3),
    "transformer, HSDP 2x2, nested (default)": (
        {"model": "transformer", "nested": True, "hsdp": True},
        4,
    ),
}
PHASES = ["construct", "forward", "backward", "step", "eval forward", "state_dict()"]


def _blocks(model: nn.Module, name: str) -> list[nn.Module]:
    if name == "transformer":
        return list(model.blocks.layers)
    return [block for stage in (1, 2, 3, 4) for block in getattr(model, f"layer{stage}")]


def _registered(model: nn.Module) -> str:
    params = list(model.parameters())
    return f"{sum(isinstance(p, DTensor) for p in params)}/{len(params)}"


def _body(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    name = cfg["model"]
    model = make_model(name)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if cfg.get("nested"):
        for block in _blocks(model, name):
            extra = {"reshard_after_forward": cfg["block_raf"]} if "block_raf" in cfg else {}
            fully_shard(block, **kwargs, **extra)
    extra = {"reshard_after_forward": cfg["root_raf"]} if "root_raf" in cfg else {}
    fully_shard(model, **kwargs, **extra)
    if cfg.get("reshard_after_backward") is False:
        model.set_reshard_after_backward(False)
    sharded = list(model.parameters())
    ptrs = [p.to_local().data_ptr() for p in sharded]
    opt = torch.optim.SGD(sharded, lr=0.01)
    x, y = make_batch(name, 0)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, -2).float(), y.flatten())

    def eval_forward() -> None:
        with torch.no_grad():
            model.eval()
            model(x)
            model.train()

    row = {"construct": _registered(model)}
    for _ in range(2):  # the second iteration runs after lazy init
        out = model(x)
        row["forward"] = _registered(model)
        loss_of(out).backward()
        row["backward"] = _registered(model)
        opt.step()
        opt.zero_grad()
        row["step"] = _registered(model)
    eval_forward()
    row["eval forward"] = _registered(model)
    model.state_dict()
    row["state_dict()"] = _registered(model)
    # optimizer.step() writes the sharded storage even when a forward left modules unsharded
    eval_forward()
    before = [p.to_local().clone() for p in sharded]
    loss_of(model(x)).backward()
    opt.step()
    trained = [p for p in sharded if p.requires_grad and p.to_local().numel()]
    row["step writes shards"] = all(
        not torch.equal(b, p.to_local())
        for b, p in zip(before, sharded, strict=True)
        if any(p is t for t in trained)
    )
    row["to_local() storage stable"] = all(
        p.to_local().data_ptr() == ptr for p, ptr in zip(sharded, ptrs, strict=True)
    )
    return row


def main() -> None:
    columns = [*PHASES, "to_local() storage stable", "step writes shards"]
    print("| configuration | W | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for label, (cfg, world_size) in CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            row = run_ranks(_body, world_size, Path(tmp), cfg)[0]
        print(f"| {label} | {world_size} | " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
