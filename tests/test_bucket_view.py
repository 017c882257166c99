"""``parameters_as_bucket_view``: EMA shards as views into flat buffers, gathered unpacked.

At W = 1, 2, 3 and with no process group: the EMA equals an unsharded reference bit for
bit, materializes to the same bits as the packed layout, and a gather bucket's send buffer
is a view of the EMA storage itself. ``rank0_only`` materialization (``export_ema``) gathers
to rank 0 alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from comm_mode import data_path_only
from dist_harness import run_ranks
from models import ReferenceEMA, make_model, mismatches, train_step
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from dtensor_ema import ModelEMA
from dtensor_ema.materialize import gather as materialize

WORLD_SIZES = [1, 2, 3]
DECAY, TAU = 0.9, 2.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(ema: ModelEMA) -> set[tuple[int, torch.dtype]]:
    return {
        (_local(t).untyped_storage().data_ptr(), t.dtype)
        for t in ema.ema_tensors().values()
        if _local(t).numel()
    }


def _send_is_a_view(ema: ModelEMA) -> list[bool]:
    """Materialize the EMA (all-gather, then gather to rank 0) and report, for every send
    buffer the gathers used: is it a view of the EMA's own storage (no packing)?"""
    storages = {ptr for ptr, _ in _storages(ema)}
    seen: list[bool] = []
    original = materialize._send_buffer

    def spy(locals_: Any, numels: Any, padded: int, dtype: torch.dtype) -> torch.Tensor:
        send = original(locals_, numels, padded, dtype)
        if sum(numels):  # nothing of this rank's in the bucket: nothing to pack either
            seen.append(send.untyped_storage().data_ptr() in storages)
        return send

    materialize._send_buffer = spy
    try:
        ema.get_ema_state_dict()
        ema.get_ema_state_dict(only_rank0_receives=True)  # the gather to rank 0 (export_ema)
    finally:
        materialize._send_buffer = original
    return seen


def bucket_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("edge", "resnet18"):
        model = make_model(name)
        ddp = DDP(model) if world_size > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        # The seed example's call: default mesh (the whole group), DDP model.
        flat = ModelEMA(ddp, parameters_as_bucket_view=True, decay=DECAY, tau=TAU)
        packed = ModelEMA(ddp, parameters_as_bucket_view=False, decay=DECAY, tau=TAU)
        ref = ReferenceEMA(model.state_dict(), DECAY, TAU)
        for step in range(2):
            train_step(name, ddp, optimizer, step)
            flat.update()
            packed.update()
            ref.update(model.state_dict())
        full = {k: v.full_tensor() for k, v in flat.ema_tensors().items()}
        out[f"{name}_ema"] = mismatches(full, ref.ema)
        out[f"{name}_storages"] = (len(_storages(flat)), len(_storages(packed)))
        out[f"{name}_state"] = mismatches(
            flat.get_model_state_dict()[0], packed.get_model_state_dict()[0]
        )
        out[f"{name}_views"] = _send_is_a_view(flat)
        for label, ema in (("flat", flat), ("packed", packed)):
            with data_path_only(), profile(activities=[ProfilerActivity.CPU]) as prof:
                on_rank0 = ema.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
            out[f"{name}_{label}_rank0_calls"] = sorted(
                {e.name for e in prof.events() if e.name.startswith("gloo:")}
            )
            everywhere = ema.get_ema_state_dict()
            out[f"{name}_{label}_rank0"] = (
                mismatches(on_rank0, everywhere) if rank == 0 else list(on_rank0)
            )
            both = ema.get_model_state_dict(only_rank0_receives=True)
            out[f"{name}_{label}_rank0_model"] = (
                mismatches(both[1], model.state_dict()) if rank == 0 else [*both[0], *both[1]]
            )
        out[f"{name}_packed_views"] = _send_is_a_view(packed)
    # A synchronous DCP save/load round trip fills the flat buffer in place.
    before = {k: v.full_tensor() for k, v in flat.ema_tensors().items()}
    dcp.save({"ema": flat}, checkpoint_id=f"{tmp}/ckpt")
    flat.update()
    dcp.load({"ema": flat}, checkpoint_id=f"{tmp}/ckpt")
    after = {k: v.full_tensor() for k, v in flat.ema_tensors().items()}
    out["dcp"] = (mismatches(after, before), len(_storages(flat)))
    # Building ema.module moves the shards out of the flat buffer; the EMA stays exact.
    flat.module(torch.randn(2, 3, 32, 32))
    full = {k: v.full_tensor() for k, v in flat.ema_tensors().items()}
    out["after_module"] = mismatches(full, ref.ema)
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("bucket_view")
    return run_ranks(bucket_body, request.param, tmp, str(tmp))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["edge", "resnet18"])
def test_bucket_view_is_exact_and_gathers_without_packing(ranks: Any, name: str) -> None:
    for r in ranks:
        assert r[f"{name}_ema"] == []
        assert r[f"{name}_state"] == []
        flat_storages, packed_storages = r[f"{name}_storages"]
        assert flat_storages == 1 and packed_storages > 1
        assert all(r[f"{name}_views"])
        if len(ranks) > 1:  # W=1 gathers nothing
            assert r[f"{name}_views"]
            assert not all(r[f"{name}_packed_views"])  # single-tensor buckets need no packing
    assert all(r["after_module"] == [] for r in ranks)
    assert all(r["dcp"] == ([], 1) for r in ranks)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["edge", "resnet18"])
@pytest.mark.parametrize("label", ["flat", "packed"])
def test_rank0_only_gathers_to_rank0_alone(ranks: Any, name: str, label: str) -> None:
    """Rank 0 gets exactly the all-gathered tensors; the others get nothing and issue
    gathers, never all-gathers (they receive nothing)."""
    for r in ranks:
        assert r[f"{name}_{label}_rank0"] == []
        assert r[f"{name}_{label}_rank0_model"] == []
        calls = r[f"{name}_{label}_rank0_calls"]
        assert not any("all" in c.lower() for c in calls), calls
        if len(ranks) > 1:
            assert any("gather" in c.lower() for c in calls), calls


def test_bucket_view_without_process_group() -> None:
    model = make_model("edge")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = ModelEMA(model, parameters_as_bucket_view=True, decay=DECAY, tau=TAU)
    ref = ReferenceEMA(model.state_dict(), DECAY, TAU)
    for step in range(2):
        train_step("edge", model, optimizer, step)
        ema.update()
        ref.update(model.state_dict())
    assert mismatches(dict(ema.ema_tensors()), ref.ema) == []
    assert len(_storages(ema)) == 1
    with pytest.raises(TypeError, match="parameters_as_bucket_view"):
        ModelEMA(model, parameters_as_bucket_view="yes")  # type: ignore[arg-type]
