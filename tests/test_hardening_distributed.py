"""Multi-rank failure paths found by review (issue 15), in one W=3 spawn (uneven shards).

* ``torch.save({"ema": ema.state_dict()})`` on rank 0, then ``load_state_dict`` on every
  rank: the other ranks used to load rank 0's rows silently (even shards) or raise a raw
  size error (uneven); now they refuse with an error naming the fix, and the full-tensor
  pattern (``get_ema_state_dict`` / ``export_ema`` + ``load_full_state_dict``) works.
* ``export_ema`` on a mesh that excludes global rank 0 (a pipeline stage) used to agree on
  WORLD and write from global rank 0 only: the stage's file was never written.
* A collective entered by one rank of three: named in the error (a monitored barrier with
  ``DTENSOR_EMA_CHECK_COLLECTIVES``, and the backend's timeout otherwise) instead of a bare
  gloo timeout.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from models import make_model, mismatches
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema import ModelEMA, export_ema

pytestmark = pytest.mark.distributed

WORLD = 3
CHECK_ENV = "DTENSOR_EMA_CHECK_COLLECTIVES"


def _trained(model: nn.Module, mesh: DeviceMesh | None = None) -> ModelEMA:
    ema = ModelEMA(model, mesh=mesh, decay=0.5, tau=None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    return ema


def _locals(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in ema.ema_tensors().items()}


def _single_file(rank: int, tmp: Path, name: str, model_fn: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = model_fn()
    ema = _trained(model)
    want = ema.get_ema_state_dict()
    path = tmp / f"{name}-sharded.pt"
    if rank == 0:
        torch.save({"ema": ema.state_dict()}, path)
    dist.barrier()
    fresh = ModelEMA(model, decay=0.5, tau=None)
    before = _locals(fresh)
    try:
        fresh.load_state_dict(torch.load(path, weights_only=False)["ema"])
        out["sharded_error"] = None
    except ValueError as e:
        out["sharded_error"] = str(e)
    # This rank's own shards: rank 0's must now be the saved ones, the others' unchanged.
    got, saved = _locals(fresh), _locals(ema)
    out["sharded_equal_want"] = mismatches(got, saved) == []
    out["sharded_equal_before"] = mismatches(got, before) == []
    # The full-tensor ways: one file written on rank 0, loaded on every rank.
    full = ema.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
    full_path = tmp / f"{name}-full.pt"
    if rank == 0:
        torch.save(full, full_path)
    export_path = tmp / f"{name}-export.pt"
    export_ema(ema, export_path)
    dist.barrier()
    for label, file in (("full", full_path), ("export", export_path)):
        other = ModelEMA(model, decay=0.5, tau=None)
        other.load_full_state_dict(torch.load(file, weights_only=True), updates=1)
        out[f"{label}_mismatch"] = mismatches(other.get_ema_state_dict(), want)
        out[f"{label}_updates"] = other.updates
    return out


def hardening_body(rank: int, world_size: int, tmp_dir: str) -> dict[str, Any]:
    tmp = Path(tmp_dir)
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    out["even"] = _single_file(rank, tmp, "even", lambda: nn.Linear(4, 6))  # 2, 2, 2 rows
    torch.manual_seed(0)
    out["uneven"] = _single_file(rank, tmp, "uneven", lambda: make_model("edge"))

    # Two "pipeline stages": rank 0 alone, ranks 1-2 together; each exports its own EMA.
    stage_a = dist.new_group([0])
    stage_b = dist.new_group([1, 2])
    if rank == 0:
        ema = _trained(make_model("edge", seed=1), DeviceMesh.from_group(stage_a, "cpu"))
        path = tmp / "stage-a.pt"
    else:
        ema = _trained(make_model("edge", seed=2), DeviceMesh.from_group(stage_b, "cpu"))
        path = tmp / "stage-b.pt"
    want = ema.get_ema_state_dict()
    export_ema(ema, path)
    dist.barrier()
    out["stage_file_exists"] = path.is_file()
    out["stage_mismatch"] = (
        mismatches(torch.load(path, weights_only=True), want) if path.is_file() else None
    )

    # A collective that only rank 0 enters, on groups of their own (WORLD stays usable).
    checked = dist.new_group([0, 1, 2])
    short = dist.new_group([0, 1, 2], timeout=timedelta(seconds=3))
    torch.manual_seed(0)  # replicas must be identical (construction checks)
    checked_ema = ModelEMA(nn.Linear(4, 5), mesh=DeviceMesh.from_group(checked, "cpu"))
    short_ema = ModelEMA(nn.Linear(4, 5), mesh=DeviceMesh.from_group(short, "cpu"))
    dist.barrier()
    if rank == 0:
        os.environ[CHECK_ENV] = "2"
        start = time.monotonic()
        try:
            checked_ema.get_model_state_dict()
            out["checked_error"] = None
        except RuntimeError as e:
            out["checked_error"] = str(e)
        out["checked_seconds"] = time.monotonic() - start
        del os.environ[CHECK_ENV]
        try:
            short_ema.get_ema_state_dict()
            out["timeout_error"] = None
        except RuntimeError as e:
            out["timeout_error"] = str(e)
    else:
        time.sleep(8)  # long enough for rank 0's two failures
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hardening")
    return run_ranks(hardening_body, WORLD, tmp, str(tmp))


@pytest.mark.parametrize("shape", ["even", "uneven"])
def test_one_ranks_sharded_state_is_refused_on_the_others(
    results: list[dict[str, Any]], shape: str
) -> None:
    rank0 = results[0][shape]
    assert rank0["sharded_error"] is None and rank0["sharded_equal_want"]
    for rank in range(1, WORLD):
        out = results[rank][shape]
        error = out["sharded_error"]
        assert error is not None, f"rank {rank} silently loaded rank 0's shards"
        assert "save_checkpoint" in error and "load_full_state_dict" in error
        assert out["sharded_equal_before"]  # refused: nothing written


@pytest.mark.parametrize("shape", ["even", "uneven"])
def test_full_state_from_one_file_loads_on_every_rank(
    results: list[dict[str, Any]], shape: str
) -> None:
    for out in results:
        assert out[shape]["full_mismatch"] == [] and out[shape]["full_updates"] == 1
        assert out[shape]["export_mismatch"] == []


def test_export_writes_from_the_ema_meshs_first_rank(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        assert out["stage_file_exists"], f"rank {rank}'s stage file was never written"
        assert out["stage_mismatch"] == []


def test_collective_entered_by_one_rank_is_named(results: list[dict[str, Any]]) -> None:
    out = results[0]
    assert out["checked_error"] is not None
    assert "get_model_state_dict() is a collective" in out["checked_error"]
    assert out["checked_seconds"] < 6
    assert out["timeout_error"] is not None
    assert "get_ema_state_dict() timed out in a collective" in out["timeout_error"]
