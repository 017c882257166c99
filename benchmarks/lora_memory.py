"""Per-rank EMA bytes of a LoRA fine-tune: ``ModelEMA(track="trainable")`` against the
full-model EMA and against diffusers' ``EMAModel`` on the same (adapter) parameters.

    python benchmarks/lora_memory.py                        # GPT-2 124M, LoRA r=8, W = 2, 4, 8
    python benchmarks/lora_memory.py --world-sizes 2 --quick  # tiny configs (smoke test)

Models: transformers' GPT-2 small (d=768, 12 layers, vocab 50257, tied embeddings: 124.4M)
with peft LoRA rank 8 on ``c_attn`` (peft's default for GPT-2), and a Llama of GPT-2's size
(d=768, 12 layers, 12 heads, ffn 3072) with LoRA rank 8 on ``q_proj``/``v_proj`` for tensor
parallelism (GPT-2's ``Conv1D`` layers have no TP plan). Layouts: DDP, FSDP2 (every block
and the root), HSDP (``fully_shard`` on a (2, W/2) mesh), FSDP2 + TP (TP 2 over the base
layers and ``lora_B``, FSDP2 over W/2).

One process acts as rank 0 of W ranks (torch's fake process group: collectives move no
data; rank 0 holds the most, shards follow ``torch.chunk``). Columns, per rank:

* ``adapter``: the adapter's bytes (the tracked set), in full;
* ``ours``: bytes of every storage the EMA's shards live in (views into a larger buffer
  count that buffer whole), and ``ours / (adapter / W)``: the target is within 1 %;
* ``kept`` / ``peak``: what torch's CPU allocator holds after the EMA is built, net of
  what it freed, and its peak while building it above the level before (torch's profiler
  with ``profile_memory=True``: every tensor allocation, temporaries included; Python
  objects are not counted);
* ``full EMA``: ``ModelEMA`` of the whole model (``track="all"``, the default);
* ``diffusers``: ``EMAModel(parameters=adapter parameters)``: one clone per parameter on
  every rank (for FSDP2 parameters, of this rank's DTensor shard).
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtensor_ema import ModelEMA

MiB = 2**20


def build(family: str, quick: bool) -> nn.Module:
    """The LoRA model: peft ``get_peft_model`` on a transformers model."""
    import peft
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    width, layers, heads = (64, 2, 4) if quick else (768, 12, 12)
    if family == "gpt2":
        base: nn.Module = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_embd=width,
                n_layer=layers,
                n_head=heads,
                vocab_size=512 if quick else 50257,
            )
        )
        targets = ["c_attn"]
    else:
        base = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=width,
                intermediate_size=4 * width,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                vocab_size=512 if quick else 50257,
                tie_word_embeddings=True,
            )
        )
        targets = ["q_proj", "v_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=targets))


def _blocks(model: nn.Module, family: str) -> list[nn.Module]:
    inner = model.base_model.model  # type: ignore[union-attr]
    return list(inner.transformer.h if family == "gpt2" else inner.model.layers)


def lay_out(model: nn.Module, family: str, layout: str, world: int) -> nn.Module:
    """Wrap or shard ``model`` as ``layout`` on the fake world of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        colwise = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
        for block in _blocks(model, family):
            plan: dict[str, Any] = {}
            for name, module in block.named_modules():
                parts = set(name.split("."))
                if not isinstance(module, nn.Linear) or "lora_A" in parts:
                    continue  # peft's wrappers; lora_A reads the full input: replicated
                if parts & colwise:  # the base layer, and lora_B: its output joins the base's
                    plan[name] = ColwiseParallel()
                elif parts & {"o_proj", "down_proj"}:
                    plan[name] = RowwiseParallel()
            parallelize_module(block, world_mesh["tp"], plan)
        mesh = world_mesh["dp"]
    for block in _blocks(model, family):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _storage_bytes(tensors: Any) -> int:
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _measured(make: Callable[[], Any]) -> tuple[Any, int, int]:
    """``make()``, and the bytes torch's CPU allocator kept (net) and peaked at (above the
    level before) while it ran."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        made = make()
    # An op's allocations are its self_cpu_memory_usage; frees outside any op are
    # "[memory]" events: in time order, their running sum is the allocator's level.
    level = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        level += event.self_cpu_memory_usage
        peak = max(peak, level)
    return made, level, peak


def measure(family: str, layout: str, world: int, quick: bool) -> dict[str, Any]:
    from diffusers.training_utils import EMAModel

    model = build(family, quick)
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model_bytes = sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
        if t.is_floating_point()
    )
    wrapped = lay_out(model, family, layout, world)
    ours, ours_kept, ours_peak = _measured(lambda: ModelEMA(wrapped, track="trainable"))
    full, _, _ = _measured(lambda: ModelEMA(wrapped))
    adapter = [p for p in model.parameters() if p.requires_grad]
    diffusers, diffusers_kept, _ = _measured(lambda: EMAModel(parameters=adapter))
    ours.update()  # the EMA works on this layout (local, no communication)
    ours_bytes = _storage_bytes(ours.ema_tensors().values())
    return {
        "model": family,
        "layout": layout,
        "W": world,
        "model_bytes": model_bytes,
        "adapter_bytes": adapter_bytes,
        "ours": ours_bytes,
        "ours_local_nbytes": ours.local_nbytes(),
        "ratio": ours_bytes / (adapter_bytes / world),
        "ours_kept": ours_kept,
        "ours_peak": ours_peak,
        "full": full.local_nbytes(),
        "diffusers": _storage_bytes(diffusers.shadow_params),
        "diffusers_kept": diffusers_kept,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--quick", action="store_true", help="tiny configs (smoke test)")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cases = [("gpt2", "ddp"), ("gpt2", "fsdp2"), ("gpt2", "hsdp"), ("llama", "tp")]
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            for family, layout in cases:
                if layout in ("hsdp", "tp") and (world < 4 or world % 2):
                    continue
                rows.append(measure(family, layout, world, args.quick))
        finally:
            dist.destroy_process_group()
    print(
        "| model | layout | W | adapter (MiB) | ours per rank (MiB) | ours / (adapter / W) | "
        "ours kept / peak (MiB) | full-model EMA per rank (MiB) | diffusers EMAModel per "
        "rank (MiB) | diffusers kept (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layout']} | {r['W']} | {r['adapter_bytes'] / MiB:.3f} | "
            f"{r['ours'] / MiB:.3f} | {r['ratio']:.4f} | {r['ours_kept'] / MiB:.3f} / "
            f"{r['ours_peak'] / MiB:.3f} | {r['full'] / MiB:.1f} | "
            f"{r['diffusers'] / MiB:.3f} | {r['diffusers_kept'] / MiB:.3f} |"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    kept = max(abs(r["ours_kept"] / (r["adapter_bytes"] / r["W"]) - 1) for r in rows)
    print(f"\nlargest deviation from adapter / W: storage {worst:.2%}, allocator {kept:.2%}")


if __name__ == "__main__":
    main()
