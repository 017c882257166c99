"""``dtensor_ema.simulate.plan_bytes`` on a meta model equals the bytes a real ``ModelEMA``
of the same shapes holds, on every rank, for plain (DDP) and FSDP2 layouts; real models are
refused. One process acts as any rank of W through torch's fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models import make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dtensor_ema import ModelEMA
from dtensor_ema.simulate import plan_bytes


def _fake_world(world_size: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
@pytest.mark.parametrize(("world_size", "rank"), [(8, 0), (8, 7), (3, 2)])
def test_plan_bytes_equals_a_real_ema(layout: str, world_size: int, rank: int) -> None:
    _fake_world(world_size, rank)
    try:
        counts = {}
        for device in ("meta", "cpu"):
            # Built on meta, not moved there: Module.to("meta") unties tied weights.
            with torch.device(device):
                model = make_model("transformer")
            mesh = init_device_mesh("cpu", (world_size,))
            if layout == "fsdp2":
                for block in model.blocks.layers:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            if device == "meta":
                pb = plan_bytes(model, mesh if layout == "ddp" else None)
                counts[device] = (pb.local_bytes, pb.local_numel)
                full = sum(4 * p.numel() for p in {id(p): p for p in model.parameters()}.values())
                assert pb.replicated_bytes == full
            else:
                ema = ModelEMA(model, mesh if layout == "ddp" else None)
                counts[device] = (ema.local_nbytes(), ema.local_numel())
        assert counts["meta"] == counts["cpu"]
        assert counts["cpu"][1] > 0 or rank == world_size - 1
    finally:
        dist.destroy_process_group()


def test_plan_bytes_refuses_a_real_model_and_modelema_refuses_a_meta_one() -> None:
    with pytest.raises(ValueError, match=r"plan_bytes needs a meta-device model"):
        plan_bytes(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"meta device"):
        ModelEMA(torch.nn.Linear(2, 2, device="meta"))
    assert plan_bytes(torch.nn.Linear(3, 5, device="meta")).local_bytes == 4 * (15 + 5)


@pytest.mark.parametrize(("world_size", "rank"), [(8, 0), (8, 7), (3, 2), (1024, 1023)])
def test_plan_bytes_of_zero3_partitions(world_size: int, rank: int) -> None:
    """``zero3_partitioned`` gives a meta model DeepSpeed ZeRO-3's partition attributes;
    ``plan_bytes`` then counts this rank's partition of every parameter without its padding:
    DeepSpeed's rule, ``[r * c, (r + 1) * c)`` with ``c = ceil(numel / W)``, cut at ``numel``
    (written here). ``benchmarks/deepspeed_zero.py`` checks the same count against a real
    ``ModelEMA`` of a DeepSpeed engine."""
    from dtensor_ema.simulate import zero3_partitioned

    _fake_world(world_size, rank)
    try:
        with torch.device("meta"):
            model = make_model("transformer")
        sizes = [p.numel() for p in {id(p): p for p in model.parameters()}.values()]
        pb = plan_bytes(zero3_partitioned(model))
        expected = 0
        for n in sizes:
            c = -(-n // world_size)
            expected += max(0, min(n, (rank + 1) * c) - min(n, rank * c))
        assert (pb.local_numel, pb.local_bytes) == (expected, 4 * expected)
        assert pb.replicated_bytes == 4 * sum(sizes)
        assert all(p.shape == (0,) for p in model.parameters())
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="needs a meta-device model"):
        _fake_world(2, 0)
        try:
            zero3_partitioned(torch.nn.Linear(2, 2))
        finally:
            dist.destroy_process_group()
