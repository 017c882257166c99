"""``ModelEMA(track="trainable")`` on every layout (DDP at W = 2, 3, 4; FSDP2 at W = 2, 3;
HSDP and FSDP2 + TP at W = 4), a peft LoRA model (transformers GPT-2 and Llama) under DDP
and FSDP2 at W = 2, a trainable-set change made collectively, and DCP reshards of a tracked
subset W = 2 -> 3 -> one process.

One spawn per world size (:func:`track_body`). The references are written here: plain
``lerp_`` over the tracked tensors' full values (``full_tensor()``, torch's own gather), and
for the checkpoint trajectory a seeded delta per step computed in full in this process.
"""

from __future__ import annotations

import importlib.util
import math
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from models import mismatches, peft_lora, transformers_base
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from dtensor_ema import ModelEMA, export_ema, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

DECAY = 0.8
STEPS = 3
K, N = 2, 2  # checkpoint trajectory: steps before the save, and after the load
DIM, HIDDEN = 24, 37  # uneven: 37 rows over 2, 3 or 4 ranks
EVEN_HIDDEN = 32  # the W = 4 layouts, where every rank must hold exactly 1/4
HAVE_PEFT = all(importlib.util.find_spec(m) is not None for m in ("peft", "transformers"))
FROZEN = ("layers.0.", "layers.1.w1.")  # a frozen base: all of block 0, block 1's w1


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, hidden)
        self.w2 = nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    """Two blocks (a ``ModuleList``: the twin's units) and a head, part of it frozen."""

    def __init__(self, hidden: int = HIDDEN, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([Block(hidden) for _ in range(2)])
        self.out = nn.Linear(DIM, 8)
        for fqn, p in self.named_parameters():
            p.requires_grad_(not fqn.startswith(FROZEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _tracked(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full values of the trainable parameters (the tracked set), by fqn."""
    return {k: _full(p) for k, p in model.named_parameters() if p.requires_grad}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 6, DIM, generator=torch.Generator().manual_seed(step))


def _wrap(name: str, hidden: int = HIDDEN, seed: int = 0) -> tuple[Net, nn.Module]:
    """``(module, what the EMA is given)`` for a layout name."""
    model = Net(hidden, seed)
    if name == "ddp":
        return model, DDP(model)
    if name in ("fsdp", "hsdp"):
        mesh = (
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
            if name == "hsdp"
            else init_device_mesh("cpu", (dist.get_world_size(),))
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    assert name == "fsdp_tp"
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    for layer in model.layers:
        parallelize_module(layer, world["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    return model, model


def _storage_bytes(ema: ModelEMA) -> int:
    """Bytes of every storage the EMA's local shards live in (each once): what this rank
    allocated for the EMA, views into larger buffers counted at the buffer's size."""
    storages = {}
    for tensor in ema.ema_tensors().values():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def layout_scenario(name: str, hidden: int = HIDDEN) -> dict[str, Any]:
    """Train with the trainable set tracked; compare everything with the reference."""
    model, wrapped = _wrap(name, hidden)
    ref = _tracked(model)
    ema = ModelEMA(wrapped, decay=DECAY, tau=None, track="trainable")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    out: dict[str, Any] = {"update_collectives": 0}
    for step in range(STEPS):
        wrapped(_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        with CommDebugMode() as comm:
            ema.update()
        out["update_collectives"] += comm.get_total_counts()
        for k, v in _tracked(model).items():
            ref[k].lerp_(v, 1 - DECAY)
    model_full = {k: _full(v) for k, v in model.state_dict(keep_vars=True).items()}
    got = ema.get_ema_state_dict()
    out["keys"] = list(got) == list(ref)
    out["ema_mismatch"] = mismatches(got, ref)
    tracked_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    everything = sum(t.numel() * t.element_size() for t in model_full.values())
    out["local_nbytes"] = ema.local_nbytes()
    out["storage_bytes"] = _storage_bytes(ema)
    out["ratio"] = ema.local_nbytes() / (tracked_bytes / dist.get_world_size())
    out["share_of_model"] = ema.local_nbytes() / everything
    numel = torch.tensor([ema.local_numel()])
    dist.all_reduce(numel)
    out["numel_sum_ok"] = int(numel) == sum(t.numel() for t in ref.values())
    whole, original = ema.get_model_state_dict()
    expected = {k: ref.get(k, v) for k, v in model_full.items()}
    out["whole_mismatch"] = mismatches(whole, expected)
    out["original_mismatch"] = mismatches(original, model_full)
    out["strict_load"] = not Net(hidden, seed=5).load_state_dict(whole, strict=True).missing_keys
    with ema.average_parameters():
        inside = {k: _full(v) for k, v in model.state_dict(keep_vars=True).items()}
        with torch.no_grad():
            swapped = model(_batch(99))
    after = {k: _full(v) for k, v in model.state_dict(keep_vars=True).items()}
    out["swap_mismatch"] = mismatches(inside, expected)
    out["restore_mismatch"] = mismatches(after, model_full)
    with torch.no_grad():
        twin = ema.module(_batch(99))
    out["module_equals_swap"] = torch.equal(twin, swapped)
    # The twin holds no copy of an untracked tensor: a plain one is the model's own storage.
    shared = []
    for fqn, p in ema.module.named_parameters():
        if fqn.startswith(FROZEN) and not isinstance(p, DTensor):
            shared.append(p.data_ptr() == model.get_parameter(fqn).data_ptr())
    out["twin_shares_untracked"] = shared
    return out


# --------------------------------------------------------------------------- peft LoRA
def _base(family: str) -> nn.Module:
    return transformers_base(family)


def _lora(family: str) -> nn.Module:
    return peft_lora(family)


def peft_scenario(family: str, wrapper: str, tmp: Path) -> dict[str, Any]:
    import peft

    model = _lora(family)
    adapter = {k: _full(p) for k, p in model.named_parameters() if p.requires_grad}
    wrapped: nn.Module = model
    if wrapper == "ddp":
        wrapped = DDP(model)
    else:
        blocks = (
            model.base_model.model.transformer.h
            if family == "gpt2"
            else model.base_model.model.model.layers
        )
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    ema = ModelEMA(wrapped, decay=DECAY, tau=None, track="trainable")
    from dtensor_ema.compat.diffusers import EMAModel

    # diffusers' drop-in keeps a LoRA user's parameter list with model= (for FSDP2).
    drop_in = EMAModel([p for p in model.parameters() if p.requires_grad], model=model)
    out: dict[str, Any] = {
        "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values()),
        "local_nbytes": ema.local_nbytes(),
        "storage_bytes": _storage_bytes(ema),
        "diffusers_nbytes": drop_in.engine.local_nbytes(),
    }
    ref = dict(adapter)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tokens = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(STEPS):
        wrapped(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for k, p in model.named_parameters():
            if k in ref:
                ref[k].lerp_(_full(p), 1 - DECAY)
    out["ema_mismatch"] = mismatches(ema.get_ema_state_dict(), ref)
    model.eval()
    with ema.average_parameters(), torch.no_grad():
        swapped = model(tokens).logits
    with torch.no_grad():
        out["module_equals_swap"] = torch.equal(ema.module(tokens).logits, swapped)
    path = tmp / f"adapter-{family}-{wrapper}"
    export_ema(ema, path, format="peft")
    dist.barrier()
    loaded = peft.PeftModel.from_pretrained(_base(family), str(path)).eval()
    with torch.no_grad():
        out["export_equals_swap"] = torch.equal(loaded(tokens).logits, swapped)
    return out


# ----------------------------------------------------------- checkpoints and set changes
@torch.no_grad()
def perturb_(module: nn.Module, step: int) -> None:
    """Step ``step`` of the checkpoint trajectory: every trainable parameter gets a seeded
    delta, computed in full (and sliced for DTensors), the same at any W and layout."""
    for fqn, p in module.named_parameters():
        if not p.requires_grad:
            continue
        g = torch.Generator().manual_seed(step * 1_000_003 + zlib.crc32(fqn.encode()))
        delta = torch.randn(p.shape, generator=g) * 0.1
        if isinstance(p, DTensor):
            piece = distribute_tensor(delta, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().add_(piece.to_local())
        else:
            p.add_(delta)


UNFROZEN = ["layers.1.w1.weight", "layers.1.w1.bias"]


def references() -> dict[str, dict[str, torch.Tensor]]:
    """The trajectory's EMAs, unsharded: the subset after K and K + N steps, and the run
    that unfreezes ``layers.1.w1`` after K steps (its EMA starts there) after K + N."""
    out = {}
    for change in (False, True):
        model = Net()
        ema = _tracked(model)
        for step in range(1, K + N + 1):
            if change and step == K + 1:
                for fqn in UNFROZEN:
                    model.get_parameter(fqn).requires_grad_(True)
                    ema[fqn] = _full(model.get_parameter(fqn))
            perturb_(model, step)
            for k, v in _tracked(model).items():
                ema[k].lerp_(v, 1 - DECAY)
            if step in (K, K + N):
                out[f"{'change' if change else 'subset'}@{step}"] = {
                    k: v.clone() for k, v in ema.items()
                }
    return out


def _fresh(name: str, unfrozen: bool = False) -> tuple[Net, ModelEMA]:
    model, wrapped = _wrap(name)
    if unfrozen:
        for fqn in UNFROZEN:
            model.get_parameter(fqn).requires_grad_(True)
    return model, ModelEMA(wrapped, decay=DECAY, tau=None, track="trainable")


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def save_at_w2(tmp: Path) -> dict[str, Any]:
    """K steps of FSDP2 with the subset tracked, saved; a DDP run that unfreezes
    ``layers.1.w1`` after K steps (collectively added), saved after K + N."""
    refs = torch.load(tmp / "refs.pt", weights_only=True)
    out: dict[str, Any] = {}
    model, ema = _fresh("fsdp")
    for step in range(1, K + 1):
        perturb_(model, step)
        ema.update()
    out["subset@K"] = mismatches(ema.get_ema_state_dict(), refs[f"subset@{K}"])
    save_checkpoint({"ema": ema}, tmp / "subset_w2")
    model, ema = _fresh("ddp")
    for step in range(1, K + N + 1):
        if step == K + 1:
            for fqn in UNFROZEN:
                model.get_parameter(fqn).requires_grad_(True)
            out["update_refused"] = _error(ema.update)
            ema.add_tensors(UNFROZEN)
        perturb_(model, step)
        ema.update()
    out["change@K+N"] = mismatches(ema.get_ema_state_dict(), refs[f"change@{K + N}"])
    save_checkpoint({"ema": ema}, tmp / "change_w2")
    return out


def load_at_w3(tmp: Path) -> dict[str, Any]:
    """The W=2 subset checkpoint into FSDP2 and DDP EMAs at W=3, resumed N steps and saved
    again; the checkpoint taken after the change into an EMA built with the new set."""
    refs = torch.load(tmp / "refs.pt", weights_only=True)
    out: dict[str, Any] = {}
    for name in ("fsdp", "ddp"):
        model, ema = _fresh(name)
        for step in range(1, K + 1):
            perturb_(model, step)
        load_checkpoint({"ema": ema}, tmp / "subset_w2")
        out[f"{name}@K"] = mismatches(ema.get_ema_state_dict(), refs[f"subset@{K}"])
        for step in range(K + 1, K + N + 1):
            perturb_(model, step)
            ema.update()
        out[f"{name}@K+N"] = mismatches(ema.get_ema_state_dict(), refs[f"subset@{K + N}"])
        if name == "fsdp":
            save_checkpoint({"ema": ema}, tmp / "subset_w3")
    _, ema = _fresh("fsdp", unfrozen=True)
    load_checkpoint({"ema": ema}, tmp / "change_w2")
    out["change"] = mismatches(ema.get_ema_state_dict(), refs[f"change@{K + N}"])
    # The checkpoint of the old set into an EMA of the new one: refused, naming the tensors
    # only this EMA tracks, unless the caller asks for the tensors both track.
    model, ema = _fresh("fsdp", unfrozen=True)
    initial = ema.get_ema_state_dict()
    out["other_set_refused"] = _error(lambda: load_checkpoint({"ema": ema}, tmp / "subset_w2"))
    out["other_set_untouched"] = mismatches(ema.get_ema_state_dict(), initial)
    load_checkpoint({"ema": ema}, tmp / "subset_w2", common_subset=True)
    got = ema.get_ema_state_dict()
    out["common_subset"] = mismatches({k: got[k] for k in refs[f"subset@{K}"]}, refs[f"subset@{K}"])
    out["common_subset_kept"] = mismatches(
        {k: got[k] for k in UNFROZEN}, {k: initial[k] for k in UNFROZEN}
    )
    return out


def add_scenario(name: str, hidden: int = HIDDEN) -> dict[str, Any]:
    """Unfreeze ``layers.1.w1`` (sharded by FSDP2, and by TP under ``fsdp_tp``) mid-run and
    add it collectively: it starts from its current value and then follows the reference;
    dropping ``out`` frees its rows."""
    model, wrapped = _wrap(name, hidden)
    ema = ModelEMA(wrapped, decay=DECAY, tau=None, track="trainable")
    ref = _tracked(model)
    out: dict[str, Any] = {}
    for step in range(1, 4):
        if step == 2:
            for fqn in UNFROZEN:
                model.get_parameter(fqn).requires_grad_(True)
            before = ema.local_numel()
            ema.add_tensors(UNFROZEN)
            out["added_numel"] = ema.local_numel() - before
            ref.update({k: v for k, v in _tracked(model).items() if k in UNFROZEN})
        perturb_(model, step)
        ema.update()
        for k, v in _tracked(model).items():
            ref[k].lerp_(v, 1 - DECAY)
    out["after_add"] = mismatches(ema.get_ema_state_dict(), ref)
    numel = torch.tensor([out["added_numel"]])
    dist.all_reduce(numel)
    out["added_numel_ok"] = int(numel) == sum(ref[k].numel() for k in UNFROZEN)
    model.out.requires_grad_(False)
    ema.drop_tensors(["out.weight", "out.bias"])
    ema.update()
    order = [k for k, _ in model.named_parameters() if k in ref and not k.startswith("out.")]
    out["after_drop"] = list(ema.get_ema_state_dict()) == order
    return out


def replica_scenario() -> dict[str, Any]:
    """A drop-in (``AveragedModel``, whose replica every drop-in shares) over a DDP model
    at W > 1 follows ``engine.add_tensors``/``drop_tensors``: after ``gather_for_save()``
    its module holds the reference EMA of the tracked set and the model's own values of
    the others. Before the fix the added tensor kept the model's raw value and the
    gather after a drop raised ``KeyError``."""
    from dtensor_ema.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, _ = _wrap("ddp")
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), track="trainable")
    out: dict[str, Any] = {}

    def gathered(ref: dict[str, torch.Tensor]) -> list[str] | str:
        try:
            average.gather_for_save()
        except Exception as e:  # the bug raised KeyError: report it, do not kill the rank
            return f"{type(e).__name__}: {e}"
        state = average.module.state_dict()
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()} | ref
        return mismatches(state, expected)

    perturb_(model, 1)
    average.update_parameters(model)  # the first call copies
    ref = _tracked(model)
    for fqn in UNFROZEN:
        model.get_parameter(fqn).requires_grad_(True)
    average.engine.add_tensors(UNFROZEN)
    ref.update({k: v for k, v in _tracked(model).items() if k in UNFROZEN})
    perturb_(model, 2)
    average.update_parameters(model)
    for k, v in _tracked(model).items():
        ref[k].lerp_(v, 1 - DECAY)
    out["after_add"] = gathered(ref)
    model.out.requires_grad_(False)
    average.engine.drop_tensors(["out.weight", "out.bias"])
    del ref["out.weight"], ref["out.bias"]
    perturb_(model, 3)
    average.update_parameters(model)
    for k, v in _tracked(model).items():
        ref[k].lerp_(v, 1 - DECAY)
    out["after_drop"] = gathered(ref)
    return out


def track_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    tmp_path = Path(tmp)
    results: dict[str, Any] = {"ddp": layout_scenario("ddp")}
    if world_size in (2, 3):
        results["fsdp"] = layout_scenario("fsdp")
        results["add_fsdp"] = add_scenario("fsdp")
    if world_size == 4:
        results["ddp_even"] = layout_scenario("ddp", EVEN_HIDDEN)
        results["hsdp"] = layout_scenario("hsdp", EVEN_HIDDEN)
        results["fsdp_tp"] = layout_scenario("fsdp_tp", EVEN_HIDDEN)
        results["add_fsdp_tp"] = add_scenario("fsdp_tp", EVEN_HIDDEN)
    if world_size == 2 and HAVE_PEFT:
        for family, wrapper in (("gpt2", "ddp"), ("gpt2", "fsdp"), ("llama", "fsdp")):
            results[f"peft_{family}_{wrapper}"] = peft_scenario(family, wrapper, tmp_path)
        results["save"] = save_at_w2(tmp_path)
    if world_size == 2:
        results["replica"] = replica_scenario()
    if world_size == 3:
        results["load"] = load_at_w3(tmp_path)
    return results


@pytest.fixture(scope="module")
def track_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    tmp = tmp_path_factory.mktemp("track")
    torch.save(references(), tmp / "refs.pt")
    out: dict[int, Any] = {}
    for world_size in (2, 3, 4):  # 3 loads what 2 saved
        out[world_size] = run_ranks(track_body, world_size, tmp, str(tmp), deadline_s=600)
    out[0] = tmp
    return out


LAYOUTS = [
    (2, "ddp"),
    (2, "fsdp"),
    (3, "ddp"),
    (3, "fsdp"),
    (4, "ddp"),
    (4, "ddp_even"),
    (4, "hsdp"),
    (4, "fsdp_tp"),
]


@pytest.mark.parametrize(("world_size", "name"), LAYOUTS)
def test_tracked_subset_on_every_layout(track_results: Any, world_size: int, name: str) -> None:
    for rank, result in enumerate(track_results[world_size]):
        out = result[name]
        assert out["keys"] and out["ema_mismatch"] == [], (rank, out)
        assert out["update_collectives"] == 0, (rank, out)
        assert out["whole_mismatch"] == [] and out["original_mismatch"] == [], (rank, out)
        assert out["strict_load"], (rank, out)
        assert out["swap_mismatch"] == [] and out["restore_mismatch"] == [], (rank, out)
        assert out["module_equals_swap"], (rank, out)
        assert all(out["twin_shares_untracked"]), (rank, out)
        # Untracked tensors are never stored: every EMA element of the tracked set lives on
        # exactly one rank, and the EMA allocated nothing beyond its shards.
        assert out["numel_sum_ok"], (rank, out)
        assert out["storage_bytes"] == out["local_nbytes"], (rank, out)
        assert out["share_of_model"] < 0.6 / world_size, (rank, out)


@pytest.mark.parametrize("name", ["ddp_even", "hsdp", "fsdp_tp"])
def test_extra_memory_is_the_tracked_bytes_over_w(track_results: Any, name: str) -> None:
    ratios = [r[name]["ratio"] for r in track_results[4]]
    assert all(abs(ratio - 1) <= 0.01 for ratio in ratios), ratios


@pytest.mark.skipif(
    not HAVE_PEFT and not os.environ.get("CI"),
    reason="needs the 'transformers' extra (transformers, peft)",
)
@pytest.mark.parametrize("case", ["gpt2_ddp", "gpt2_fsdp", "llama_fsdp"])
def test_peft_lora_holds_exactly_the_adapter_bytes_over_w(track_results: Any, case: str) -> None:
    for rank, result in enumerate(track_results[2]):
        out = result[f"peft_{case}"]
        assert out["local_nbytes"] == out["adapter_bytes"] / 2, (rank, out)
        assert out["diffusers_nbytes"] == out["adapter_bytes"] / 2, (rank, out)
        assert out["storage_bytes"] == out["local_nbytes"], (rank, out)
        assert out["ema_mismatch"] == [], (rank, out)
        assert out["module_equals_swap"], (rank, out)
        assert out["export_equals_swap"], (rank, out)


def test_trainable_set_change_is_collective_and_checkpointed(track_results: Any) -> None:
    for rank, result in enumerate(track_results[2]):
        out = result["save"]
        assert out["subset@K"] == [], (rank, out)
        assert out["update_refused"].startswith(
            "ValueError: ModelEMA(track='trainable'): the model's trainable parameters changed"
        ), out["update_refused"]
        assert "now trainable ['layers.1.w1.weight', 'layers.1.w1.bias']" in out["update_refused"]
        assert out["change@K+N"] == [], (rank, out)
    for rank, result in enumerate(track_results[3]):
        out = result["load"]
        assert out["change"] == [], (rank, out)
        assert out["other_set_refused"].startswith("ValueError: "), out
        assert (
            "tracks other tensors than this EMA (tracked only by this EMA "
            "['layers.1.w1.weight', 'layers.1.w1.bias'])" in out["other_set_refused"]
        ), out["other_set_refused"]
        assert out["other_set_untouched"] == [], (rank, out)
        assert out["common_subset"] == [] and out["common_subset_kept"] == [], (rank, out)


@pytest.mark.parametrize(("world_size", "name"), [(2, "fsdp"), (3, "fsdp"), (4, "fsdp_tp")])
def test_add_and_drop_sharded_tensors(track_results: Any, world_size: int, name: str) -> None:
    for rank, result in enumerate(track_results[world_size]):
        out = result[f"add_{name}"]
        assert out["after_add"] == [] and out["added_numel_ok"], (rank, out)
        assert out["after_drop"], (rank, out)


def test_drop_ins_follow_add_and_drop_tensors_w2(track_results: Any) -> None:
    for rank, result in enumerate(track_results[2]):
        out = result["replica"]
        assert out["after_add"] == [] and out["after_drop"] == [], (rank, out)


def test_dcp_reshard_of_a_tracked_subset_2_3_1(track_results: Any) -> None:
    for rank, result in enumerate(track_results[3]):
        out = result["load"]
        for key in ("fsdp@K", "fsdp@K+N", "ddp@K", "ddp@K+N"):
            assert out[key] == [], (rank, key, out)
    # W=3 -> one process, no process group.
    assert not dist.is_initialized()
    tmp = track_results[0]
    refs = torch.load(tmp / "refs.pt", weights_only=True)
    ema = ModelEMA(Net(seed=9), decay=DECAY, tau=None, track="trainable")
    load_checkpoint({"ema": ema}, tmp / "subset_w3")
    assert mismatches(ema.get_ema_state_dict(), refs[f"subset@{K + N}"]) == []
    assert ema.updates == K + N
    assert math.isclose(
        ema.local_nbytes(), sum(4 * t.numel() for t in refs[f"subset@{K}"].values())
    )
