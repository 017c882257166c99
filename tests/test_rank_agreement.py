"""Ranks that disagree are refused on every rank, never stitched together (issue 35, items
6 and 9), in one spawn per world size.

* Construction compares the options as well as the model: ``decay=0.9`` on rank 0 and
  ``0.99`` on rank 1 used to build two EMAs whose gathered rows mixed (and the checkpoint
  recorded one of them); ``tau`` and ``update_every`` alike.
* Every collective call (post-hoc snapshots too) first agrees on which call, which EMA and
  which update count: one
  extra ``update()`` on one rank, or two EMAs gathered crosswise, used to return mixed rows
  without a word (also with ``DTENSOR_EMA_CHECK_COLLECTIVES`` set).
* On a 2 x 2 mesh a rank that differs is refused on every rank, including the one that
  shares no mesh dim group with it (which would otherwise hang in the next collective).
* FSDP1 models used to fail with "the ranks track different models" or "replicated
  parameters differ: ['_flat_param']" (or, on one rank, build an EMA of the flat shard);
  now they are refused by name, with the way out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from dtensor_ema import ModelEMA, PostHocEMA, export_ema, load_checkpoint, save_checkpoint
from dtensor_ema._collectives import CHECK_ENV, agree_on_call, entering
from dtensor_ema.checkpoint.reader import open_checkpoint

pytestmark = pytest.mark.distributed


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical replicas on every rank
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _error(fn: Any) -> str | None:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _fsdp1(use_orig_params: bool) -> str | None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(
        _model(), device_id=torch.device("cpu"), use_orig_params=use_orig_params
    )
    return _error(lambda: ModelEMA(wrapped))


def _agreement_calls(ema: ModelEMA) -> list[str]:
    """The backend calls of one agreement: one all-gather per mesh dim of size > 1."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        agree_on_call("probe", ema.engine.call_identity, mesh=ema.mesh)
    return [e.name for e in prof.events() if e.name.startswith("gloo:")]


def agreement_body(rank: int, world_size: int, tmp_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["fsdp1"] = _fsdp1(False)
    out["fsdp1_orig_params"] = _fsdp1(True)
    if world_size == 1:
        ema = ModelEMA(_model())
        ema.update()
        out["alone"] = _error(ema.get_model_state_dict)  # nothing to agree with
        return out
    # Options that differ between ranks.
    for name, mine in (
        ("decay", {"decay": 0.9 if rank == 0 else 0.99}),
        ("tau", {"tau": 10.0 if rank == 0 else 20.0}),
        ("update_every", {"update_every": 1 + rank}),
    ):
        out[f"options_{name}"] = _error(lambda mine=mine: ModelEMA(_model(), **mine))
    # One extra update on rank 0, then every collective call.
    model = _model()
    ema = ModelEMA(model, decay=0.5, tau=None)
    ema.update()
    if rank == 0:
        ema.update()
    out["extra_gather"] = _error(ema.get_model_state_dict)
    out["extra_export"] = _error(lambda: export_ema(ema, Path(tmp_dir) / "ema.pt"))

    def swap() -> None:
        with ema.average_parameters():
            pass

    out["extra_swap"] = _error(swap)
    out["extra_add"] = _error(lambda: ema.add_tensors([]))
    out["extra_save"] = _error(lambda: save_checkpoint({"ema": ema}, Path(tmp_dir) / "ckpt"))
    out["save_written"] = (Path(tmp_dir) / "ckpt").exists()
    posthoc = PostHocEMA(model, snapshot_dir=Path(tmp_dir) / "phema")
    posthoc.update()
    if rank == 0:
        posthoc.update()
    out["extra_snapshot"] = _error(posthoc.snapshot)
    out["snapshot_written"] = (Path(tmp_dir) / "phema").exists() and any(
        p.name.startswith("step-") for p in (Path(tmp_dir) / "phema").iterdir()
    )
    # Caught up: the calls work again, and the files are written.
    if rank == 1:
        ema.update()
    out["caught_up"] = _error(ema.get_model_state_dict)
    out["agreement_calls"] = _agreement_calls(ema)
    # Two EMAs of one model, gathered crosswise; with the hang detector on too.
    fast = ModelEMA(model, decay=0.5, tau=None)
    slow = ModelEMA(model, decay=0.9, tau=None)
    out["crosswise"] = _error((fast if rank == 0 else slow).get_ema_state_dict)
    save_checkpoint({"ema": fast}, Path(tmp_dir) / "fast")
    loaded = ModelEMA(model, decay=0.5, tau=None)
    out["crosswise_load"] = _error(
        lambda: load_checkpoint({"ema": loaded if rank == 0 else slow}, Path(tmp_dir) / "fast")
    )
    os.environ[CHECK_ENV] = "30"
    try:
        out["crosswise_checked"] = _error((fast if rank == 0 else slow).get_ema_state_dict)

        def timeout_inside() -> None:  # a backend timeout after every rank entered
            with entering("probe", mesh=fast.mesh):
                raise RuntimeError("[gloo] Timed out waiting 1000ms for recv operation")

        out["timeout_hint_checked"] = _error(timeout_inside)
    finally:
        del os.environ[CHECK_ENV]
    out["timeout_hint"] = _error(timeout_inside)
    # Pipeline stages: one EMA per stage over the stage's own mesh; they differ by design,
    # so saving, loading and snapshotting them together over the world must work.
    world = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    stage = _model()
    stage[2 * (1 - rank)] = nn.Identity()  # rank 0 keeps the first layer, rank 1 the last
    staged = ModelEMA(stage, world["dp"], decay=0.5, tau=None)
    staged.update()
    pp_dir = Path(tmp_dir) / "pp"
    out["stages_save"] = _error(lambda: save_checkpoint({"ema": staged}, pp_dir))
    dist.barrier()
    saved = open_checkpoint(pp_dir).entries_under(("ema",)) if pp_dir.exists() else []
    out["stages_saved"] = sorted({str(k).split(".", 2)[-1] for k in saved if "weight" in str(k)})
    stage_ph = PostHocEMA(stage, mesh=world["dp"], snapshot_dir=Path(tmp_dir) / "pp_phema")
    stage_ph.update()
    out["stages_snapshot"] = _error(stage_ph.snapshot)
    os.environ["DTENSOR_EMA_AGREE_CALLS"] = "0"  # the check can be turned off
    try:
        ema.update()
        out["off_same_calls"] = _error(ema.get_model_state_dict)
    finally:
        del os.environ["DTENSOR_EMA_AGREE_CALLS"]
    dist.barrier()
    return out


def grid_body(rank: int, world_size: int, tmp_dir: str) -> dict[str, Any]:
    """2 x 2 mesh: rank 3 differs; rank 0 shares no mesh dim group with it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    out: dict[str, Any] = {}
    out["options"] = _error(lambda: ModelEMA(_model(), mesh, decay=0.9 if rank == 3 else 0.99))
    ema = ModelEMA(_model(), mesh, decay=0.5, tau=None)
    out["agreement_calls"] = _agreement_calls(ema)
    if rank == 3:
        ema.update()
    out["extra"] = _error(ema.get_model_state_dict)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agreement")


@pytest.fixture(scope="module", params=[1, 2])
def results(request: pytest.FixtureRequest, workdir: Path) -> tuple[int, list[dict[str, Any]]]:
    tmp = workdir / f"w{request.param}"
    tmp.mkdir()
    return request.param, run_ranks(agreement_body, request.param, tmp, str(tmp))


def test_fsdp1_is_refused_by_name_with_the_way_out(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    _, outs = results
    for out in outs:
        for key in ("fsdp1", "fsdp1_orig_params"):
            error = out[key]
            assert error is not None and error.startswith("ValueError"), (key, error)
            assert "FSDP1" in error and "fully_shard" in error
            assert "fsdp_version: 2" in error and "ModelParallelStrategy" in error


def test_one_rank_has_nothing_to_agree_with(results: tuple[int, list[dict[str, Any]]]) -> None:
    world, outs = results
    if world == 1:
        assert outs[0]["alone"] is None


@pytest.mark.parametrize(
    ("option", "shown"),
    [
        ("decay", "0.9 on rank 0, 0.99 on rank 1"),
        ("tau", "10.0 on rank 0, 20.0 on rank 1"),
        ("update_every", "1 on rank 0, 2 on rank 1"),
    ],
)
def test_options_that_differ_are_refused_on_every_rank(
    results: tuple[int, list[dict[str, Any]]], option: str, shown: str
) -> None:
    world, outs = results
    if world == 1:
        pytest.skip("one rank agrees with itself")
    for out in outs:
        error = out[f"options_{option}"]
        assert error is not None and "construct the EMA with different options" in error
        assert f"{option}: {shown}" in error


@pytest.mark.parametrize("call", ["gather", "export", "swap", "add", "snapshot", "save"])
def test_an_extra_update_on_one_rank_is_refused_by_every_collective(
    results: tuple[int, list[dict[str, Any]]], call: str
) -> None:
    world, outs = results
    if world == 1:
        pytest.skip("one rank agrees with itself")
    errors = {out[f"extra_{call}"] for out in outs}
    assert len(errors) == 1, errors  # the same error on every rank
    (error,) = errors
    assert error is not None and "the ranks disagree on this collective call" in error
    assert "at updates=2" in error and "at updates=1" in error
    for out in outs:
        assert out["caught_up"] is None
        assert not out["snapshot_written"] and not out["save_written"]
        assert out["agreement_calls"] == ["gloo:all_gather"]  # its whole cost on one dim


def test_two_emas_gathered_crosswise_are_refused(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    world, outs = results
    if world == 1:
        pytest.skip("one rank agrees with itself")
    for key, call in (
        ("crosswise", "get_ema_state_dict"),
        ("crosswise_checked", "get_ema_state_dict"),
        ("crosswise_load", "load_checkpoint"),
    ):
        errors = {out[key] for out in outs}
        assert len(errors) == 1, errors
        (error,) = errors
        assert error is not None and f"{call}() on EMA" in error
        ids = [part.split(" on EMA ")[1].split()[0] for part in error.split("; ")]
        assert len(set(ids)) == 2, error  # two different EMAs named


def test_pipeline_stages_save_and_snapshot_their_own_emas(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    world, outs = results
    if world == 1:
        pytest.skip("stages need two ranks")
    for out in outs:
        assert out["stages_save"] is None and out["stages_snapshot"] is None
        assert out["stages_saved"] == ["0.weight", "2.weight"]  # both stages, one checkpoint


def test_timeout_message_does_not_ask_for_a_variable_already_set(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    world, outs = results
    if world == 1:
        pytest.skip("one rank agrees with itself")
    for out in outs:
        assert f"set {CHECK_ENV}" in out["timeout_hint"]
        checked = out["timeout_hint_checked"]
        assert checked is not None and f"set {CHECK_ENV}" not in checked
        assert "entered different collective calls" in checked
        assert out["off_same_calls"] is None


@pytest.fixture(scope="module")
def grid(workdir: Path) -> list[dict[str, Any]]:
    tmp = workdir / "grid"
    tmp.mkdir()
    return run_ranks(grid_body, 4, tmp, str(tmp))


def test_on_a_2d_mesh_every_rank_raises(grid: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(grid):
        assert out["options"] is not None, f"rank {rank} built an EMA a peer refused"
        assert out["extra"] is not None, f"rank {rank} gathered while a peer refused"
    assert "decay: 0.99 on rank" in grid[1]["options"]  # a peer of rank 3 names it
    assert "ranks [3]" in grid[0]["options"]  # rank 0 names who differs
    assert "at updates=1" in grid[0]["extra"] and "at updates=0" in grid[0]["extra"]
    for out in grid:
        assert out["agreement_calls"] == ["gloo:all_gather"] * 2  # one per mesh dim
