"""Model shapes at scale, a one-process fake world, and each rank's real local tensors.

Shared by ``gpu_suite.py`` and ``scale.py``. A model is built on the ``meta`` device (no
memory), laid out the way a W-rank job lays it out (DDP: a full replica per rank; FSDP2:
``fully_shard`` on a 1-D mesh; HSDP: ``fully_shard`` on a (W/8, 8) mesh; ZeRO-3: DeepSpeed's
partition attributes on every parameter, ``dtensor_ema.simulate.zero3_partitioned``), with
this process
acting as rank 0 of W through torch's fake process group (collectives return at once, an
all-gather hands back this rank's own input). :func:`materialize` then allocates only this
rank's local tensors on a real device, so per-rank update time is measured on per-rank
tensors of the true sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtensor_ema.simulate import zero3_partitioned

LAYOUTS = ("ddp", "fsdp2", "hsdp", "zero3")
HSDP_SHARD = 8
"""HSDP shards within groups of 8 ranks (one node) and replicates across them."""


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256


LLAMA3 = {
    "llama3-8b": LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "llama3-70b": LlamaConfig(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    "llama3-405b": LlamaConfig(dim=16384, layers=126, heads=128, kv_heads=8, ffn=53248),
}
"""Llama 3 shapes (untied embeddings): 8.03B, 70.6B and 405.9B parameters."""


class RMSNormWeight(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class LlamaBlock(nn.Module):
    """The parameters of one Llama block (GQA attention, SwiGLU FFN, two RMSNorms); the
    EMA only reads parameters, so no forward is needed."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        kv = c.dim // c.heads * c.kv_heads
        self.attention = nn.ModuleDict(
            {
                "wq": nn.Linear(c.dim, c.dim, bias=False),
                "wk": nn.Linear(c.dim, kv, bias=False),
                "wv": nn.Linear(c.dim, kv, bias=False),
                "wo": nn.Linear(c.dim, c.dim, bias=False),
            }
        )
        self.feed_forward = nn.ModuleDict(
            {
                "w1": nn.Linear(c.dim, c.ffn, bias=False),
                "w2": nn.Linear(c.ffn, c.dim, bias=False),
                "w3": nn.Linear(c.dim, c.ffn, bias=False),
            }
        )
        self.attention_norm = RMSNormWeight(c.dim)
        self.ffn_norm = RMSNormWeight(c.dim)


class Llama(nn.Module):
    """Llama 3 parameter shapes; ``layers`` overrides the depth (``embeddings=False``
    keeps only the blocks: "Llama-3-8B-shaped layers")."""

    def __init__(self, c: LlamaConfig, layers: int | None = None, embeddings: bool = True) -> None:
        super().__init__()
        if embeddings:
            self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(layers or c.layers))
        self.norm = RMSNormWeight(c.dim)
        if embeddings:
            self.output = nn.Linear(c.dim, c.vocab, bias=False)


def meta_model(name: str, layers: int | None = None) -> nn.Module:
    """A model by name on the meta device: ``llama3-8b|70b|405b`` (full), ``llama3-8b-L<n>``
    (n blocks, no embeddings), ``gpt2``, ``resnet50``, ``llama-tiny`` (smoke tests)."""
    with torch.device("meta"):
        if name in LLAMA3:
            return Llama(LLAMA3[name], layers)
        if name == "llama-tiny":
            return Llama(LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn=160, vocab=256))
        if name.startswith("llama3-8b-L"):
            return Llama(LLAMA3["llama3-8b"], int(name.removeprefix("llama3-8b-L")), False)
        if name == "gpt2":
            from workloads import GPT

            return GPT(vocab=50257, ctx=1024, dim=768, heads=12, layers=12)
        if name == "resnet50":
            import torchvision

            return torchvision.models.resnet50()
    raise ValueError(f"unknown model {name!r}")


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process is rank ``rank`` of ``world_size`` (fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def lay_out(
    model: nn.Module, layout: str, device_type: str, tag: str = ""
) -> tuple[nn.Module, DeviceMesh]:
    """Wrap ``model`` (on meta) as a ``dist.get_world_size()``-rank job would.

    Returns the model and the mesh to pass to ``ModelEMA`` (DDP: the 1-D world mesh; FSDP2
    and HSDP: the mesh the parameters live on). ``tag`` suffixes the mesh dim names: torch
    reuses a mesh object equal by value (same ranks, dims and names) made in an earlier
    fake world of this process, with that world's rank, so a process that plays several
    ranks of one W in turn tags each (``benchmarks/gpu_ranks.py``).
    """
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    names = (f"dp{tag}",) if tag else None
    if layout == "ddp":
        return model, init_device_mesh(device_type, (world,), mesh_dim_names=names)
    if layout == "zero3":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=names)
        return zero3_partitioned(model), mesh
    if layout == "fsdp2":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=names)
    elif layout == "hsdp":
        shard = min(HSDP_SHARD, world)
        mesh = init_device_mesh(
            device_type, (world // shard, shard), mesh_dim_names=(f"replicate{tag}", f"shard{tag}")
        )
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    blocks = getattr(model, "layers", None) or getattr(model, "blocks", None) or []
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def to_empty_tied(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to_empty(device=...)`` keeping tied parameters tied (``to_empty`` gives each
    module its own new tensor, e.g. untying GPT-2's ``lm_head`` from ``wte``)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for tied in owners.values():
        first = getattr(tied[0][0], tied[0][1])
        for module, name in tied[1:]:
            setattr(module, name, first)
    return model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate this rank's local tensors on ``device`` and fill them with random values:
    FSDP2 parameters get only their shard. (Set the dtype on meta, before :func:`lay_out`.)"""
    to_empty_tied(model, device)
    for t in model.state_dict(keep_vars=True).values():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_floating_point():
            local.normal_()
    return model
