"""``ModelEMA(model)`` with ``mesh=None`` on the meshes trainers build, W=4 (2 x 2) on gloo.

torchtitan's ``ParallelDims`` unflattens a 1-D ``("world",)`` mesh, so its parameters'
meshes are 2-D while their root is 1-D; accelerate flattens submeshes of an
``init_device_mesh`` mesh; Lightning slices one. For each: the EMA is built with
``mesh=None``, trained a few real optimizer steps, and compared bit for bit against a
reference written here (``lerp_`` on ``full_tensor()`` of every tensor after each step);
the per-rank EMA element counts add up to the model's (every element on exactly one rank)
and each rank holds about total / W.

One spawn at W=4 runs every case.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from titan_models import parallel_dims
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_ema import ModelEMA

pytestmark = pytest.mark.distributed

DECAY = 0.75
STEPS = 3
DIM, HIDDEN = 12, 18  # uneven: 18 rows over 4 ranks, 5 output rows (TP needs even HIDDEN)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(0.5)
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Experts(nn.Module):
    """A grouped-experts weight, sharded over ``ep`` like torchtitan's MoE."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, DIM, DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        return x + torch.einsum("bsd,edf->bsf", x, w) / 4


class Net(nn.Module):
    def __init__(self, experts: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.experts = Experts() if experts else None
        self.out = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if self.experts is not None:
            x = self.experts(x)
        return self.out(x)


def _tp(model: Net, tp_mesh: DeviceMesh) -> None:
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _fsdp(model: Net, mesh: DeviceMesh) -> Net:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _floats(model: nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return {k: _full(v) for k, v in named if v.is_floating_point()}


def _run(model: nn.Module) -> dict[str, Any]:
    """Construct with mesh=None, train, compare with the reference; plain values out."""
    ref = _floats(model)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        x = torch.randn(2, 4, DIM, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        for k, v in _floats(model).items():
            ref[k].lerp_(v, 1 - DECAY)
    got = ema.get_ema_state_dict()
    numel = torch.tensor([ema.local_numel()])
    dist.all_reduce(numel)
    total = sum(t.numel() for t in ref.values())
    return {
        "finite": all(bool(t.isfinite().all()) for t in ref.values()),
        "moved": sum(not torch.equal(got[k], v) for k, v in _floats(model).items()),
        "mismatch": [k for k in ref if not torch.equal(got[k], ref[k])],
        "numel_sum": int(numel),
        "total": total,
        "ratio": ema.local_numel() / (total / dist.get_world_size()),
        "world": ema.mesh.mesh.tolist(),
        "dtensor_meshes": sorted(
            {str(p.device_mesh.mesh.tolist()) for p in model.parameters() if isinstance(p, DTensor)}
        ),
    }


def _cases() -> dict[str, Any]:
    cases: dict[str, Any] = {}
    if importlib.util.find_spec("torchtitan") is not None:
        world = dist.get_world_size()

        def titan_hsdp() -> Net:
            dims = parallel_dims(world, dp_replicate=2, dp_shard=2)
            return _fsdp(Net(), dims.get_mesh(["dp_replicate", "dp_shard"]))

        def titan_fsdp_tp() -> Net:
            dims = parallel_dims(world, dp_shard=2, tp=2)
            model = Net()
            _tp(model, dims.get_mesh("tp"))
            return _fsdp(model, dims.get_mesh("dp_shard"))

        def titan_hsdp_cp_legacy() -> Net:
            # The legacy backend folds cp into an unflattened "fsdp" dim.
            dims = parallel_dims(world, dp_replicate=2, cp=2, spmd_backend="partial_dtensor")
            return _fsdp(Net(), dims.get_mesh(["dp_replicate", "fsdp"]))

        def titan_ep() -> Net:
            # Dense weights FSDP over all 4 ranks, experts split over ep (2): the world
            # is refined to (2, 2) and its outer dim has no group of its own yet.
            dims = parallel_dims(world, dp_shard=4, ep=2)
            model = Net(experts=True)
            assert model.experts is not None
            model.experts.weight = nn.Parameter(
                distribute_tensor(model.experts.weight.data, dims.get_mesh("ep"), [Shard(0)])
            )
            for layer in model.layers:
                fully_shard(layer, mesh=dims.get_mesh("dp_shard"))
            dp_shard = dims.get_mesh("dp_shard")
            fully_shard(model, mesh=dp_shard, ignored_params={model.experts.weight})
            return model

        cases.update(
            titan_hsdp=titan_hsdp,
            titan_fsdp_tp=titan_fsdp_tp,
            titan_hsdp_cp_legacy=titan_hsdp_cp_legacy,
            titan_ep=titan_ep,
        )

    def sliced() -> Net:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = Net()
        _tp(model, mesh["tp"])
        return _fsdp(model, mesh["dp"])

    def flattened() -> Net:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        return _fsdp(Net(), mesh["a", "b"]._flatten("ab"))

    cases.update(sliced=sliced, flattened=flattened)
    if importlib.util.find_spec("lightning") is not None:

        def lightning_model_parallel() -> Net:
            from lightning.fabric.strategies.model_parallel import _setup_device_mesh

            # The mesh ModelParallelStrategy hands configure_model (self.device_mesh).
            mesh = _setup_device_mesh(2, 2, 4, torch.device("cpu"))
            model = Net()
            _tp(model, mesh["tensor_parallel"])
            return _fsdp(model, mesh["data_parallel"])

        cases["lightning_model_parallel"] = lightning_model_parallel
    if importlib.util.find_spec("accelerate") is not None:

        def accelerate_hsdp() -> Net:
            from accelerate.parallelism_config import ParallelismConfig

            config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
            mesh = config.build_device_mesh("cpu")
            # accelerate's fsdp2_prepare_model: mesh[tuple(fsdp_dim_names)].
            return _fsdp(Net(), mesh[tuple(config.fsdp_dim_names)])

        def accelerate_fsdp_tp() -> Net:
            from accelerate.parallelism_config import ParallelismConfig

            config = ParallelismConfig(dp_shard_size=2, tp_size=2)
            mesh = config.build_device_mesh("cpu")
            model = Net()
            _tp(model, mesh["tp"])
            return _fsdp(model, mesh[tuple(config.fsdp_dim_names)])

        cases.update(accelerate_hsdp=accelerate_hsdp, accelerate_fsdp_tp=accelerate_fsdp_tp)
    return cases


def world_body(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, build in _cases().items():
        torch.manual_seed(0)
        try:
            results[name] = _run(build())
        except Exception as error:  # reported per case; pytest names it
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    return results


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("world_mesh")
    return run_ranks(world_body, 4, tmp, deadline_s=500)


CASES = [
    "titan_hsdp",
    "titan_fsdp_tp",
    "titan_hsdp_cp_legacy",
    "titan_ep",
    "sliced",
    "flattened",
    "lightning_model_parallel",
    "accelerate_hsdp",
    "accelerate_fsdp_tp",
]
_OPTIONAL = {"titan": "torchtitan", "lightning": "lightning", "accelerate": "accelerate"}


@pytest.mark.parametrize("name", CASES)
def test_mesh_none_equals_reference_with_every_element_once(
    world_results: list[dict[str, Any]], name: str
) -> None:
    prefix = name.split("_")[0]
    if prefix in _OPTIONAL and importlib.util.find_spec(_OPTIONAL[prefix]) is None:
        pytest.skip(f"{_OPTIONAL[prefix]} is not installed")
    for rank, results in enumerate(world_results):
        out = results[name]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["finite"]
        assert out["moved"] > 0  # the EMA lags the trained weights: the steps did something
        assert out["mismatch"] == [], f"rank {rank}"
        assert out["numel_sum"] == out["total"]
        assert 0.5 < out["ratio"] < 1.5, out["ratio"]  # uneven chunks of a tiny model
        assert out["world"] == world_results[0][name]["world"]
