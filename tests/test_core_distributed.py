"""Sharded EMA on plain/DDP models at W = 1, 2, 3, 4 (gloo, CPU) against an unsharded one.

One spawn per world size runs every scenario (:func:`core_body`) and returns plain
values; the tests below assert on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from comm_mode import comm_debug_mode
from dist_harness import run_ranks
from models import (
    HAS_TORCHVISION,
    ReferenceEMA,
    make_batch,
    make_model,
    mismatches,
    train_step,
    with_torchvision,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from dtensor_ema import ModelEMA
from dtensor_ema.materialize.gather import DIRECT_BYTES

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2, 3, 4]
MODELS = with_torchvision(["edge", "edge_bf16", "resnet18", "transformer"])
STEPS = 3
DECAY, TAU = 0.9, 2.0


def count_collectives(fn: Any) -> tuple[Any, int]:
    """Run ``fn()``; return its result and the number of collectives it issued, counted
    two independent ways (DTensor's CommDebugMode sees c10d ops at the dispatcher; the
    profiler sees the backend's ``gloo:*`` calls). The larger count wins."""
    with comm_debug_mode() as comm, profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    gloo_calls = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    return result, max(comm.get_total_counts(), gloo_calls)


def _model_for(name: str) -> torch.nn.Module:
    model = make_model(name.removesuffix("_bf16"))
    return model.to(torch.bfloat16) if name.endswith("_bf16") else model


def _scenario(name: str, rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    base = name.removesuffix("_bf16")
    model = _model_for(name)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # "edge" exercises mesh=None (the default process group); the others pass a mesh.
    mesh = None if base == "edge" else init_device_mesh("cpu", (world_size,))
    ema = ModelEMA(ddp, mesh=mesh, decay=DECAY, tau=TAU)
    ref = ReferenceEMA(model.state_dict(), DECAY, TAU)
    out: dict[str, Any] = {"update_comms": 0}
    for step in range(STEPS):
        train_step(base, ddp, optimizer, step)
        _, n = count_collectives(ema.update)
        out["update_comms"] += n
        ref.update(model.state_dict())

    shards = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ema.ema_tensors().items()
    }
    out["shard_mismatch"] = [k for k in shards if not torch.equal(shards[k], ref.ema[k])]
    out["placements"] = {
        k: str(getattr(v, "placements", None)) for k, v in ema.ema_tensors().items()
    }
    (ema_sd, ori_sd), out["materialize_comms"] = count_collectives(ema.get_model_state_dict)
    # Large tensors whose rows split evenly are gathered one by one, straight into their
    # outputs (no packing); everything else travels in flat buckets.
    out["direct_gathers"] = sum(
        1
        for v in ema.ema_tensors().values()
        if v.dim() > 0
        and v.shape[0] % world_size == 0
        and v.numel() * v.element_size() >= DIRECT_BYTES
    )
    out["tensors"] = len(ema.ema_tensors())
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected_ema = {
        k: ref.ema[k].to(v.dtype) if v.is_floating_point() else v for k, v in model_sd.items()
    }
    out["ema_sd_mismatch"] = mismatches(ema_sd, expected_ema)
    out["ori_sd_mismatch"] = mismatches(ori_sd, model_sd)
    out["keys_in_order"] = list(ema_sd) == list(model_sd)
    out["no_prefix"] = not any(k.startswith("module.") for k in ema_sd)
    out["local_nbytes"] = ema.local_nbytes()
    out["local_numel"] = ema.local_numel()
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    out["total_numel"] = sum(t.numel() for t in unique.values() if t.is_floating_point())
    out["tied_alias"] = "head.weight" in ema_sd and "head.weight" not in ema.ema_tensors()

    def swapped() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        with ema.average_parameters() as m:
            inside = {k: v.detach().clone() for k, v in m.state_dict().items()}
            with torch.no_grad():
                m.eval()
                logits = m(make_batch(base, 99, next(m.parameters()).dtype)[0])
                m.train()
        return inside, logits

    (inside, _), out["swap_comms"] = count_collectives(swapped)
    out["swap_inside_mismatch"] = mismatches(
        {k: v for k, v in inside.items() if v.is_floating_point()},
        {k: v for k, v in expected_ema.items() if v.is_floating_point()},
    )
    after = {k: v.detach() for k, v in model.state_dict().items() if k != "int_buf"}
    out["swap_restore_mismatch"] = mismatches(after, {k: model_sd[k] for k in after})

    # DCP round trip at the same world size: save, move on, load, compare with the save.
    ckpt = tmp / f"ckpt-{name}"
    saved = {k: v.clone() for k, v in shards.items()}
    dcp.save({"ema": ema}, checkpoint_id=str(ckpt))
    train_step(base, ddp, optimizer, STEPS)
    ema.update()
    dcp.load({"ema": ema}, checkpoint_id=str(ckpt))
    reloaded = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ema.ema_tensors().items()
    }
    out["dcp_mismatch"] = mismatches(reloaded, saved)
    out["dcp_updates"] = ema.updates
    return out


def _errors(world_size: int) -> dict[str, str]:
    """Error messages for bad meshes (need a process group)."""
    errors: dict[str, str] = {}
    model = make_model("edge")
    if world_size % 2 == 0:
        mesh2d = init_device_mesh("cpu", (2, world_size // 2))
        ema2d = ModelEMA(model, mesh=mesh2d)  # N-D meshes are accepted (issue 10)
        errors["mesh_2d_ndims"] = str({e.ndim for e in ema2d.ema_tensors().values()})
        errors["mesh_2d_mesh_ndim"] = str(ema2d.mesh.ndim if ema2d.mesh else None)
    mesh = init_device_mesh("cpu", (world_size,))
    try:
        ModelEMA(make_model("edge").to("meta"), mesh=mesh)
    except ValueError as e:
        errors["mesh_device"] = str(e)
    return errors


def _resnet50_local_nbytes(world_size: int) -> int:
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    model = model.to_empty(device="cpu")
    with torch.no_grad():  # replicas must be identical (the EMA checks): no garbage
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    return ModelEMA(model, mesh=init_device_mesh("cpu", (world_size,))).local_nbytes()


def core_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {
        name: _scenario(name, rank, world_size, Path(tmp)) for name in MODELS
    }
    results["errors"] = _errors(world_size)
    if HAS_TORCHVISION:
        results["resnet50_nbytes"] = _resnet50_local_nbytes(world_size)
    dist.barrier()
    return results


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def core(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    tmp = tmp_path_factory.mktemp(f"core-w{world_size}")
    return world_size, run_ranks(core_body, world_size, tmp, str(tmp))


@pytest.mark.parametrize("name", MODELS)
def test_local_shards_equal_unsharded_reference(core: Any, name: str) -> None:
    _, results = core
    for rank, r in enumerate(results):
        assert r[name]["shard_mismatch"] == [], f"rank {rank}"


@pytest.mark.parametrize("name", MODELS)
def test_get_model_state_dict_is_full_exact_and_ordered(core: Any, name: str) -> None:
    _, results = core
    for rank, r in enumerate(results):
        assert r[name]["ema_sd_mismatch"] == [], f"rank {rank}"
        assert r[name]["ori_sd_mismatch"] == [], f"rank {rank}"
        assert r[name]["keys_in_order"] and r[name]["no_prefix"]


def test_tied_weights_are_averaged_once(core: Any) -> None:
    _, results = core
    assert all(r["transformer"]["tied_alias"] for r in results)


@pytest.mark.parametrize("name", MODELS)
def test_update_issues_no_collective(core: Any, name: str) -> None:
    world_size, results = core
    for r in results:
        assert r[name]["update_comms"] == 0
        # The counter is live: materializing does communicate (except alone in the group).
        if world_size > 1:
            assert r[name]["materialize_comms"] >= 1


def test_materialize_is_coalesced(core: Any) -> None:
    """One flat all-gather per dtype bucket, plus one per large evenly split tensor gathered
    straight into its output; never one per tensor (ResNet-18: 122 tensors)."""
    world_size, results = core
    if world_size == 1:
        pytest.skip("a group of one needs no gather")
    for r in results:
        for name in with_torchvision(["resnet18", "transformer"]):
            comms, direct = r[name]["materialize_comms"], r[name]["direct_gathers"]
            assert comms <= 2 + direct, (name, comms, direct)
            assert comms < r[name]["tensors"] / 4, (name, comms)


@pytest.mark.parametrize("name", MODELS)
def test_average_parameters_swaps_in_and_restores(core: Any, name: str) -> None:
    _, results = core
    for r in results:
        assert r[name]["swap_inside_mismatch"] == []
        assert r[name]["swap_restore_mismatch"] == []


def test_placements_are_shard0_except_scalars(core: Any) -> None:
    _, results = core
    placements = results[0]["edge"]["placements"]
    assert placements["scalar"] == "(Replicate(),)"
    assert all(v == "(Shard(dim=0),)" for k, v in placements.items() if k != "scalar")


def test_memory_is_total_over_world_size(core: Any) -> None:
    world_size, results = core
    for name in with_torchvision(["resnet18", "transformer"]):
        numels = [r[name]["local_numel"] for r in results]
        total = results[0][name]["total_numel"]
        assert sum(numels) >= total  # every element lives somewhere...
        assert max(numels) <= total / world_size * 1.1 + 64  # ...and once, up to chunk rounding
    if not HAS_TORCHVISION:
        pytest.skip("the ResNet-50 byte count needs torchvision")
    nbytes = [r["resnet50_nbytes"] for r in results]
    ratio = max(nbytes) / (sum(nbytes) / world_size)
    print(f"\nResNet-50 EMA bytes per rank at W={world_size}: {nbytes}, max/mean={ratio:.4f}")
    assert ratio <= 1.03


@pytest.mark.parametrize("name", MODELS)
def test_dcp_round_trip_same_world_size(core: Any, name: str) -> None:
    _, results = core
    for r in results:
        assert r[name]["dcp_mismatch"] == []
        assert r[name]["dcp_updates"] == STEPS


def test_bad_meshes_are_rejected_with_clear_errors(core: Any) -> None:
    world_size, results = core
    errors = results[0]["errors"]
    if world_size % 2 == 0:
        assert errors["mesh_2d_mesh_ndim"] == "2", errors
    assert "'cpu' does not match" in errors["mesh_device"] and "'meta'" in errors["mesh_device"]
