"""ModelEMA on every mesh torchtitan users run: HSDP, FSDP2+TP, TP with a replicated dp dim,
3-D HSDP+TP, pipeline stages, FSDP2 ``Shard(1)`` and ``CPUOffloadPolicy``; all on gloo CPU.

One spawn per world size: W=3 runs the 1-D scenarios (DDP regression, ``Shard(1)``,
CPU offload) and loads the W=4 checkpoints into DDP; W=4 runs the 2 x 2 scenarios and the
pipeline; W=8 the 2 x 2 x 2 layout. Each scenario trains with a real optimizer and keeps a
reference EMA written here: ``lerp_`` on ``full_tensor()`` of the parameters after every
step. The rule under test: every EMA element lives on exactly one rank (per-rank EMA bytes
close to total / W), ``update()`` issues no collective, the swap puts exactly the reference
into the model and restores the raw weights exactly, and checkpoints reshard anywhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from comm_mode import comm_debug_mode, data_path_only
from dist_harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtensor_ema import ModelEMA, convert_checkpoint, export_ema, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

DECAY = 0.8
STEPS = 3
DIM, HIDDEN = 24, 37  # uneven on purpose: 37 rows over 2 or 4 ranks


class Block(nn.Module):
    """A torchtitan-style MLP block: norm (replicated on tp), colwise w1, rowwise w2."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.out = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.out(x)


TP_PLAN = {
    "norm": SequenceParallel(),
    "w1": ColwiseParallel(use_local_output=False),
    "w2": RowwiseParallel(output_layouts=Shard(1)),
}


def _tp(model: Net, tp_mesh: DeviceMesh) -> None:
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, TP_PLAN)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in model.state_dict(keep_vars=True).items()}


def _batch(seed: int, model: nn.Module, seq_parallel: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, DIM, generator=g)


def _train(model: nn.Module, ema: ModelEMA, ref: dict[str, torch.Tensor], seed: int) -> int:
    """STEPS optimizer steps, each followed by ``ema.update()`` and the reference lerp;
    returns the largest number of collectives one ``update()`` issued."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    worst = 0
    for step in range(STEPS):
        x = _batch(seed * 100 + step, model, False)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with comm_debug_mode() as comm:
            ema.update()
        worst = max(worst, comm.get_total_counts())
        for k, v in _params(model).items():
            ref[k].lerp_(v, 1 - DECAY)
    return worst


def _check(
    model: nn.Module,
    ema: ModelEMA,
    ref: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with data_path_only(), comm_debug_mode() as comm:
        got = ema.get_ema_state_dict()
    out["gather_collectives"] = comm.get_total_counts()
    out["tensors"] = len(ref)
    out["ema_mismatch"] = [k for k in ref if not torch.equal(got[k], ref[k])]
    raw = _params(model)
    with ema.average_parameters():
        inside = _params(model)
    after = _params(model)
    out["swap_mismatch"] = [k for k in ref if not torch.equal(inside[k], ref[k])]
    out["restore_mismatch"] = [k for k in raw if not torch.equal(after[k], raw[k])]
    total = sum(t.numel() * t.element_size() for t in ref.values())
    out["ratio"] = ema.local_nbytes() / (total / dist.get_world_size(group))
    out["local_nbytes"] = ema.local_nbytes()
    # Every EMA element on exactly one rank: the local numels add up to the total.
    numel = torch.tensor([ema.local_numel()])
    dist.all_reduce(numel, group=group)
    out["numel_sum_ok"] = int(numel) == sum(t.numel() for t in ref.values())
    return out


def _scenario(name: str, world: DeviceMesh | None, build: Any, mesh_arg: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    model = build()
    ref = _params(model)
    ema = ModelEMA(model, mesh=mesh_arg, decay=DECAY, tau=None)
    out = {"update_collectives": _train(model, ema, ref, seed)}
    out.update(_check(model, ema, ref))
    return model, ema, ref, out


def _hsdp(world: DeviceMesh) -> Net:
    model = Net()
    for layer in model.layers.values():
        fully_shard(layer, mesh=world)
    fully_shard(model, mesh=world)
    return model


def _fsdp_tp(world: DeviceMesh, dp: tuple[str, ...] = ("dp",)) -> Net:
    model = Net()
    _tp(model, world["tp"])
    dp_mesh = world[dp] if len(dp) > 1 else world[dp[0]]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _tp_only(world: DeviceMesh) -> Net:
    model = Net()
    _tp(model, world["tp"])
    return model


def _save(ema: ModelEMA, ref: dict[str, torch.Tensor], path: Path) -> None:
    """A plain DCP save, the library's atomic save and an export, all of one N-D EMA."""
    dcp.save({"ema": ema}, checkpoint_id=str(path))
    save_checkpoint({"ema": ema}, path.with_name(path.name + "_atomic"))
    export_ema(ema, path.with_suffix(".export.pt"))
    if dist.get_rank() == 0:
        torch.save(ref, path.with_suffix(".ref.pt"))


def nd_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    tmp_path = Path(tmp)
    results: dict[str, Any] = {}
    if world_size == 4:
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        hsdp_world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        for name, build, mesh_arg in [
            ("hsdp", lambda: _hsdp(hsdp_world), None),
            ("fsdp_tp", lambda: _fsdp_tp(world), None),
            ("fsdp_tp_nd_mesh", lambda: _fsdp_tp(world), world),
            ("tp_dp", lambda: _tp_only(world), None),
            ("tp_dp_nd_mesh", lambda: _tp_only(world), world),
        ]:
            _, ema, ref, out = _scenario(name, world, build, mesh_arg, seed=7)
            results[name] = out
            if name in ("hsdp", "fsdp_tp"):
                _save(ema, ref, tmp_path / f"ckpt_{name}")
        results["pp"] = _pipeline(world_size, tmp_path)
    elif world_size == 8:
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
        _, ema, ref, out = _scenario(
            "hsdp_tp_3d", world, lambda: _fsdp_tp(world, ("rep", "shard")), None, seed=3
        )
        results["hsdp_tp_3d"] = out
    elif world_size == 3:
        mesh = init_device_mesh("cpu", (3,))

        def shard1() -> Net:
            model = Net()
            # Shard(1) wherever FSDP2 allows it (it needs dim 1 divisible by W).
            fully_shard(
                model,
                mesh=mesh,
                shard_placement_fn=lambda p: Shard(int(p.dim() > 1 and p.shape[1] % 3 == 0)),
            )
            return model

        def offload() -> Net:
            model = Net()
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            return model

        def default_meshes() -> Net:
            model = Net()  # fully_shard() without mesh=: an equal new mesh object per call
            for layer in model.layers.values():
                fully_shard(layer)
            fully_shard(model)
            return model

        for name, build in [
            ("ddp", Net),
            ("fsdp_shard1", shard1),
            ("fsdp_cpu_offload", offload),
            ("fsdp_default_meshes", default_meshes),
        ]:
            results[name] = _scenario(name, mesh, build, None, seed=11)[3]
        results["reload_into_ddp"] = _reload_into_ddp(tmp_path)
    return results


def _reload_into_ddp(tmp_path: Path) -> dict[str, list[str]]:
    """The W=4 N-D checkpoints load exactly into a plain model's EMA at W=3."""
    out = {}
    for name in ("hsdp", "fsdp_tp"):
        ref = torch.load(tmp_path / f"ckpt_{name}.ref.pt")
        ema = ModelEMA(Net(), decay=DECAY, tau=None)
        dcp.load({"ema": ema}, checkpoint_id=str(tmp_path / f"ckpt_{name}"))
        got = ema.get_ema_state_dict()
        out[name] = [k for k in ref if not torch.equal(got[k], ref[k])]
        validated = ModelEMA(Net(), decay=DECAY, tau=None)
        load_checkpoint({"ema": validated}, tmp_path / f"ckpt_{name}_atomic")
        got = validated.get_ema_state_dict()
        out[f"{name}_load_checkpoint"] = [k for k in ref if not torch.equal(got[k], ref[k])]
    return out


def _pipeline(world_size: int, tmp_path: Path) -> dict[str, Any]:
    """2 stages x 2 dp: each stage's module (the full model with the other stage's layers
    deleted, as torchtitan splits it) has its own ModelEMA over its dp submesh."""
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = world.get_coordinate()[0]  # type: ignore[index]
    torch.manual_seed(5)
    model = Net()
    del model.layers[str(1 - stage)]
    if stage == 0:
        model.out = nn.Identity()  # type: ignore[assignment]
    for layer in model.layers.values():
        fully_shard(layer, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    out: dict[str, Any] = {}
    try:
        ModelEMA(model, decay=DECAY, tau=None)  # mesh=None: the root mesh spans both stages
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    ref = _params(model)
    ema = ModelEMA(model, mesh=world["dp"], decay=DECAY, tau=None)
    out["update_collectives"] = _train(model, ema, ref, seed=stage)
    out.update(_check(model, ema, ref, group=world["dp"].get_group()))
    dcp.save({"ema": ema}, checkpoint_id=str(tmp_path / "ckpt_pp"))
    refs = [None] * world_size
    dist.all_gather_object(refs, ref)
    if dist.get_rank() == 0:
        merged: dict[str, torch.Tensor] = {}
        for r in refs:
            merged.update(r)  # type: ignore[arg-type]
        torch.save(merged, tmp_path / "ckpt_pp.ref.pt")
    return out


@pytest.fixture(scope="module")
def nd_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("nd")
    out = {}
    for world_size in (4, 8, 3):  # 3 reloads the W=4 checkpoints
        out[world_size] = run_ranks(nd_body, world_size, tmp, str(tmp), deadline_s=400)
    out[0] = {"tmp": tmp}  # type: ignore[dict-item]
    return out


SCENARIOS = [
    (4, "hsdp"),
    (4, "fsdp_tp"),
    (4, "fsdp_tp_nd_mesh"),
    (4, "tp_dp"),
    (4, "tp_dp_nd_mesh"),
    (4, "pp"),
    (8, "hsdp_tp_3d"),
    (3, "ddp"),
    (3, "fsdp_shard1"),
    (3, "fsdp_cpu_offload"),
    (3, "fsdp_default_meshes"),
]


@pytest.mark.parametrize(("world_size", "name"), SCENARIOS)
def test_ema_equals_reference_on_every_layout(nd_results: Any, world_size: int, name: str) -> None:
    for rank, result in enumerate(nd_results[world_size]):
        out = result[name]
        assert out["ema_mismatch"] == [], (rank, out)
        assert out["swap_mismatch"] == [], (rank, out)
        assert out["restore_mismatch"] == [], (rank, out)
        assert out["update_collectives"] == 0, (rank, out)
        assert out["numel_sum_ok"], (rank, out)


@pytest.mark.parametrize(("world_size", "name"), SCENARIOS)
def test_every_rank_holds_about_one_wth(nd_results: Any, world_size: int, name: str) -> None:
    """Per-rank EMA bytes / (total / W): the rule in numbers (1.0 is perfect)."""
    ratios = [result[name]["ratio"] for result in nd_results[world_size]]
    assert max(ratios) <= 1.1, ratios


@pytest.mark.parametrize(("world_size", "name"), SCENARIOS)
def test_materializing_costs_a_few_collectives_not_one_per_tensor(
    nd_results: Any, world_size: int, name: str
) -> None:
    """``get_ema_state_dict`` gathers in flat buckets, one mesh dim at a time (FSDP2 + TP
    included), so its collectives do not grow with the number of tensors."""
    for rank, result in enumerate(nd_results[world_size]):
        out = result[name]
        assert out["gather_collectives"] <= min(8, out["tensors"]), (rank, name, out)


def test_pipeline_mesh_spanning_stages_is_refused(nd_results: Any) -> None:
    for result in nd_results[4]:
        assert "track different models" in result["pp"]["refused"], result["pp"]
        assert "pipeline" in result["pp"]["refused"]


def test_nd_checkpoints_reload_into_ddp_at_another_world_size(nd_results: Any) -> None:
    for result in nd_results[3]:
        assert all(v == [] for v in result["reload_into_ddp"].values()), result
        assert len(result["reload_into_ddp"]) == 4


@pytest.mark.parametrize("name", ["hsdp", "fsdp_tp"])
def test_nd_export_and_convert_give_the_full_ema(nd_results: Any, name: str) -> None:
    tmp = nd_results[0]["tmp"]
    ref = torch.load(tmp / f"ckpt_{name}.ref.pt")
    exported = torch.load(tmp / f"ckpt_{name}.export.pt")
    assert [k for k in ref if not torch.equal(exported[k], ref[k])] == []
    converted = convert_checkpoint(tmp / f"ckpt_{name}_atomic", tmp / f"{name}_converted.pt")
    assert [k for k in ref if not torch.equal(converted[k], ref[k])] == []


@pytest.mark.parametrize("name", ["hsdp", "fsdp_tp", "pp"])
def test_nd_checkpoints_load_in_one_process_without_a_process_group(
    nd_results: Any, name: str
) -> None:
    """Both pipeline stages' EMAs saved into one checkpoint load into one ModelEMA over
    the whole model; the N-D checkpoints load the same way."""
    tmp = nd_results[0]["tmp"]
    assert not dist.is_initialized()
    ema = ModelEMA(Net(), decay=DECAY, tau=None)
    dcp.load({"ema": ema}, checkpoint_id=str(tmp / f"ckpt_{name}"))
    ref = torch.load(tmp / f"ckpt_{name}.ref.pt")
    got = ema.get_ema_state_dict()
    assert sorted(got) == sorted(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
    assert math.isfinite(sum(float(v.sum()) for v in got.values()))
