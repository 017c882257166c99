"""``ema.module``: the EMA as a forward-capable module, at W = 1, 2, 3 and with no process group.

Every forward is compared with an unsharded copy of the model loaded with
``get_model_state_dict()[0]``; the EMA itself with an unsharded reference written in
``models.py`` (plain ``lerp_`` on full tensors).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from models import ReferenceEMA, make_batch, make_model, mismatches, train_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dtensor_ema import ModelEMA

WORLD_SIZES = [1, 2, 3]
DECAY, TAU = 0.9, 2.0


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error; ``inf`` when the reference is not finite (a NaN reference would
    make any comparison vacuous)."""
    if not torch.isfinite(expected).all():
        return float("inf")
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _reference_forward(model: nn.Module, state: dict[str, torch.Tensor], x: Any) -> torch.Tensor:
    """An unsharded copy of ``model`` loaded with ``state``, in eval mode."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(state, strict=True)
    ref.eval()
    with torch.no_grad():
        return ref(x)


def _storage_shared(ema: ModelEMA) -> bool:
    """Every EMA tensor's local storage is the module's parameter storage (or a buffer's
    EMA shard that no module parameter holds)."""
    params = dict(ema.module.named_parameters())
    for fqn, tensor in ema.ema_tensors().items():
        if fqn not in params:
            continue
        p = params[fqn]
        mine = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        theirs = p.to_local() if isinstance(p, DTensor) else p
        if mine.numel() and mine.data_ptr() != theirs.data_ptr():
            return False
    return True


def _check_model(
    name: str, rank: int, world_size: int, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    model = make_model(name).to(dtype)
    reference_model = copy.deepcopy(model)
    ddp = DDP(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mesh = init_device_mesh("cpu", (world_size,))
    ema = ModelEMA(ddp, mesh=mesh, decay=DECAY, tau=TAU)
    ref = ReferenceEMA(model.state_dict(), DECAY, TAU)
    out: dict[str, Any] = {}
    x, _ = make_batch(name, 99, dtype=dtype)
    bytes_before = ema.local_nbytes()
    for phase in range(2):
        for step in range(2):
            train_step(name, ddp, optimizer, 10 * phase + step)
            ema.update()
            ref.update(model.state_dict())
        module = ema.module  # built on the first access, reused afterwards
        with torch.no_grad():
            y = module(x)
        expected = _reference_forward(reference_model, ema.get_model_state_dict()[0], x)
        out[f"rel_err_{phase}"] = _rel_err(y, expected)
        out[f"dtype_{phase}"] = y.dtype
        full = {k: v.full_tensor() for k, v in ema.ema_tensors().items()}
        tied = {"head.weight"} if name == "transformer" else set()
        expected_ema = {k: v for k, v in ref.ema.items() if k not in tied}
        out[f"ema_mismatches_{phase}"] = mismatches(full, expected_ema)
    out["same_module"] = ema.module is module and ema.ema_model is module
    out["model"] = ema.model is model
    out["no_grad"] = not any(p.requires_grad for p in module.parameters())
    out["eval"] = not module.training
    out["bytes"] = (bytes_before, ema.local_nbytes())
    out["storage_shared"] = _storage_shared(ema)
    out["fsdp_params"] = all(isinstance(p, DTensor) for p in module.parameters() if p.dim() > 0)
    out["model_untouched"] = all(not isinstance(p, DTensor) for p in model.parameters())
    return out


def _check_dtype_choice(rank: int, world_size: int) -> dict[str, Any]:
    """fp32 EMA of a bf16 model: bf16 forward by default, fp32 on request."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model("resnet18").to(torch.bfloat16)
    x, _ = make_batch("resnet18", 5, dtype=torch.bfloat16)
    default = ModelEMA(model, mesh=mesh)
    fp32 = ModelEMA(model, mesh=mesh)
    fp32.build_module(compute_dtype=torch.float32)
    with torch.no_grad():
        y16 = default.module(x)
        y32 = fp32.module(x.float())
    ref16 = _reference_forward(model, default.get_model_state_dict()[0], x)
    full32 = {k: v.full_tensor() for k, v in fp32.ema_tensors().items()}
    state32 = {**model.state_dict(), **full32}
    ref32 = _reference_forward(copy.deepcopy(model).float(), state32, x.float())
    return {
        "bf16": (y16.dtype, _rel_err(y16, ref16)),
        "fp32": (y32.dtype, _rel_err(y32, ref32)),
    }


def _check_units(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    model = make_model("transformer")
    for label, units in {
        "out_proj": ["blocks.layers.0.self_attn.out_proj"],
        "modulelist": ["blocks.layers"],
        "unknown": ["nope"],
        "string": "blocks",
    }.items():
        ema = ModelEMA(model, mesh=mesh)
        try:
            ema.build_module(units=units)  # type: ignore[arg-type]
            out[label] = "built"
        except (ValueError, TypeError) as e:
            out[label] = f"{type(e).__name__}: {e}"
    # A predicate that picks every Linear must still leave out_proj to its parent.
    ema = ModelEMA(model, mesh=mesh)
    try:
        ema.build_module(units=lambda fqn, m: isinstance(m, nn.Linear))
        out["predicate_linear"] = "built"
    except ValueError as e:
        out["predicate_linear"] = f"ValueError: {e}"
    ema = ModelEMA(model, mesh=mesh)
    ema.build_module(units=["blocks", "norm"])
    x, _ = make_batch("transformer", 3)
    with torch.no_grad():
        y = ema.module(x)
    out["explicit_units"] = _rel_err(y, _reference_forward(model, ema.get_model_state_dict()[0], x))
    try:
        ema.build_module()
        out["twice"] = "built"
    except RuntimeError as e:
        out["twice"] = str(e)
    return out


def _check_fsdp(rank: int, world_size: int, mixed: bool) -> dict[str, Any]:
    """FSDP2 student: the module mirrors its units and mixed precision."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model("transformer")
    reference_model = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = ModelEMA(model, decay=DECAY, tau=TAU)
    x, _ = make_batch("transformer", 99)
    out: dict[str, Any] = {}
    for phase in range(2):
        for step in range(2):
            train_step("transformer", model, optimizer, 10 * phase + step)
            ema.update()
        with torch.no_grad():
            y = ema.module(x)
        state = ema.get_model_state_dict()[0]
        ref_model = reference_model.to(torch.bfloat16) if mixed else reference_model
        expected = _reference_forward(ref_model, state, x)
        out[f"rel_err_{phase}"] = _rel_err(y.float(), expected.float())
        out[f"dtype_{phase}"] = y.dtype
    units = sorted(fqn for fqn, m in ema.module.named_modules() if isinstance(m, FSDPModule))
    out["units"] = units == sorted(
        fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)
    )
    out["storage_shared"] = _storage_shared(ema)
    out["student_is_fsdp"] = type(model).__name__.startswith("FSDP")
    out["twin_class"] = type(ema.module).__name__
    return out


def module_body(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "fsdp": _check_fsdp(rank, world_size, mixed=False),
        "fsdp_bf16": _check_fsdp(rank, world_size, mixed=True),
        "transformer": _check_model("transformer", rank, world_size),
        "resnet18": _check_model("resnet18", rank, world_size),
        "edge": _check_model("edge", rank, world_size),
        "dtype": _check_dtype_choice(rank, world_size),
        "units": _check_units(rank, world_size),
    }


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(module_body, request.param, tmp_path_factory.mktemp("ema_module"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["transformer", "resnet18", "edge"])
def test_forward_equals_unsharded_model_loaded_with_the_ema(ranks: Any, name: str) -> None:
    for r in ranks:
        res = r[name]
        for phase in range(2):
            assert res[f"rel_err_{phase}"] <= 1e-5, (phase, res[f"rel_err_{phase}"])
            assert res[f"ema_mismatches_{phase}"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["transformer", "resnet18", "edge"])
def test_module_holds_no_second_copy(ranks: Any, name: str) -> None:
    for r in ranks:
        res = r[name]
        assert res["storage_shared"]
        assert res["bytes"][0] == res["bytes"][1]
        assert res["fsdp_params"] and res["model_untouched"]
        assert res["same_module"] and res["model"]
        assert res["no_grad"] and res["eval"]


@pytest.mark.distributed
def test_fsdp_model_is_mirrored(ranks: Any) -> None:
    for r in ranks:
        res = r["fsdp"]
        for phase in range(2):
            assert res[f"rel_err_{phase}"] <= 1e-5 and res[f"dtype_{phase}"] == torch.float32
        assert res["units"] and res["storage_shared"] and res["student_is_fsdp"]
        assert res["twin_class"].startswith("FSDP")  # the mirror's own FSDP class
        mixed = r["fsdp_bf16"]
        for phase in range(2):
            # bf16 all-gathers of the fp32 EMA, as the student's MixedPrecisionPolicy does
            assert mixed[f"dtype_{phase}"] == torch.bfloat16
            assert mixed[f"rel_err_{phase}"] <= 1e-2, mixed[f"rel_err_{phase}"]


@pytest.mark.distributed
def test_bf16_model_computes_in_bf16_by_default(ranks: Any) -> None:
    for r in ranks:
        dtype16, err16 = r["dtype"]["bf16"]
        dtype32, err32 = r["dtype"]["fp32"]
        assert dtype16 == torch.bfloat16 and err16 <= 1e-5
        assert dtype32 == torch.float32 and err32 <= 1e-5


@pytest.mark.distributed
def test_units_are_validated(ranks: Any) -> None:
    for r in ranks:
        units = r["units"]
        assert "out_proj" in units["out_proj"] and "MultiheadAttention" in units["out_proj"]
        assert units["modulelist"].startswith("ValueError") and "ModuleList" in units["modulelist"]
        assert units["unknown"].startswith("ValueError") and "nope" in units["unknown"]
        assert units["string"].startswith("TypeError")
        assert units["predicate_linear"].startswith("ValueError")
        assert units["explicit_units"] <= 1e-5
        assert "already built" in units["twice"]


# ------------------------------------------------------------------ no process group
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_process_group_module_shares_the_ema_tensors(dtype: torch.dtype) -> None:
    model = make_model("resnet18").to(dtype)
    reference_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = ModelEMA(model, decay=DECAY, tau=TAU)
    ref = ReferenceEMA(model.state_dict(), DECAY, TAU)
    x, _ = make_batch("resnet18", 99, dtype=dtype)
    for phase in range(2):
        for step in range(2):
            train_step("resnet18", model, optimizer, 10 * phase + step)
            ema.update()
            ref.update(model.state_dict())
        with torch.no_grad():
            y = ema.module(x)
        expected = _reference_forward(reference_model, ema.get_model_state_dict()[0], x)
        assert y.dtype == dtype
        assert _rel_err(y, expected) <= 1e-5
        assert mismatches(dict(ema.ema_tensors()), ref.ema) == []
    tensors = ema.ema_tensors()
    for fqn, p in ema.module.named_parameters():
        assert p.data_ptr() == tensors[fqn].data_ptr(), fqn  # the EMA itself, fp32
        assert not p.requires_grad and p.dtype == torch.float32
    for fqn, b in ema.module.named_buffers():
        if fqn in tensors:
            assert b.data_ptr() == tensors[fqn].data_ptr(), fqn
    assert ema.ema_model is ema.module and ema.model is model


def test_no_process_group_forward_error_restores_the_ema_slots() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    ema = ModelEMA(model)
    with pytest.raises(RuntimeError):
        ema.module(torch.randn(5, 7, dtype=torch.bfloat16))  # wrong width
    tensors = ema.ema_tensors()
    for fqn, p in ema.module.named_parameters():
        assert p.dtype == torch.float32 and p.data_ptr() == tensors[fqn].data_ptr()


# ------------------------------------------------------------------ HSDP (W=4 as 2 x 2)
def hsdp_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model("resnet18")
    reference_model = copy.deepcopy(model)
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = ModelEMA(model, mesh=mesh["shard"], decay=DECAY, tau=TAU)
    # mesh=None: the EMA splits each HSDP shard over the replicate dim too (1/4 per rank);
    # the module keeps its own (Replicate(), Shard(0)) shards, refreshed before a forward.
    ema_world = ModelEMA(model, decay=DECAY, tau=TAU)
    x, _ = make_batch("resnet18", 99)
    errors, world_errors = [], []
    for phase in range(2):
        for step in range(2):
            train_step("resnet18", model, optimizer, 10 * phase + step)
            ema.update()
            ema_world.update()
        with torch.no_grad():
            y = ema.module(x)
            y_world = ema_world.module(x)
        expected = _reference_forward(reference_model, ema.get_model_state_dict()[0], x)
        errors.append(_rel_err(y, expected))
        expected = _reference_forward(reference_model, ema_world.get_model_state_dict()[0], x)
        world_errors.append(_rel_err(y_world, expected))
    placements = {tuple(str(p) for p in param.placements) for param in ema.module.parameters()}
    world_placements = {
        tuple(str(p) for p in param.placements) for param in ema_world.module.parameters()
    }
    refused = {}
    # A plain model on a 2-D mesh: its EMA is split over both dims, FSDP2 cannot hold it.
    try:
        ModelEMA(make_model("resnet18"), mesh=mesh).build_module()
        refused["plain_2d"] = "built"
    except NotImplementedError as e:
        refused["plain_2d"] = str(e)
    return {
        "errors": errors,
        "world_errors": world_errors,
        "placements": placements,
        "world_placements": world_placements,
        "world_levels": sum(bool(e.levels) for e in ema_world.engine.plan),
        "shared": _storage_shared(ema),
        "refused": refused,
    }


@pytest.mark.distributed
def test_hsdp_model_is_mirrored(tmp_path: Path) -> None:
    for r in run_ranks(hsdp_body, 4, tmp_path):
        assert all(e <= 1e-5 for e in r["errors"]), r["errors"]
        assert r["placements"] == {("R", "S(0)")}  # HSDP: (Replicate(), Shard(0))
        assert r["shared"]
        assert all(e <= 1e-5 for e in r["world_errors"]), r["world_errors"]
        assert r["world_placements"] == {("R", "S(0)")} and r["world_levels"] > 0
        assert "2-D mesh" in r["refused"]["plain_2d"], r["refused"]
