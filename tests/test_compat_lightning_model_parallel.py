"""``dtensor_ema.compat.lightning.EMAWeightAveraging`` under Lightning's
``ModelParallelStrategy`` (gloo, CPU), against a reference written here, in four cells:
FSDP2 via ``fully_shard`` in ``configure_model`` on a 1-D dp mesh (``data_parallel_size=W``,
``tensor_parallel_size=1``) at W=1 (a one-rank group in this process), W=2 and the uneven
W=3; and TP + FSDP2 at W=4 (``data_parallel_size=2``, ``tensor_parallel_size=2``:
``ColwiseParallel``/``RowwiseParallel`` on the MLP over ``device_mesh["tensor_parallel"]``,
then ``fully_shard`` over ``device_mesh["data_parallel"]``, Lightning's TP + FSDP2 recipe;
the two ranks of a TP group see the same batches). Each spawned cell is one body.

Lightning's own ``EMAWeightAveraging`` cannot run under this strategy at any W, W=1
included (its ``setup`` calls ``configure_model`` and deep-copies the sharded module:
``AssertionError: FSDP does not support deepcopy``, Lightning 2.6.6), so the reference is
torch's ``get_ema_avg_fn`` formula on full tensors: the first update copies, then
``d * ema + (1 - d) * model``, following the module's actual weights after every optimizer
step. Our drop-in deep-copied it too at W=1 until the replica learned that FSDP2 models
take the engine's module on a one-rank mesh as well (the W=1 cell guards it).

Checked in one body per cell (16 samples per dp rank, batch 4: 4 steps per epoch, so the
step-4 checkpoint ends epoch 0): the full tensors are the module as built; the average
equals the reference bit for bit; validation sees it; each rank holds about ``1/W`` of it
and the ranks' shares add up to it (TP-replicated tensors split over tp too); the 2x2
module really is TP + FSDP2; the sharded checkpoint has Lightning's layout
(``state_dict`` = the average, the raw weights beside it); a resume from it ends exactly
where the uninterrupted run ends.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from dist_harness import require_extra

require_extra("lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning_net import Net, full_state  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from dtensor_ema.compat.lightning import EMAWeightAveraging  # noqa: E402

DECAY = 0.9
HIDDEN = {1: 7, 2: 6}  # the MLP's width per TP degree
PER_RANK, BATCH = 16, 4  # 4 steps per epoch at every W (the checkpoint at step 4 ends one)


class Reference(Callback):
    """torch's ``get_ema_avg_fn`` on full tensors after every optimizer step (put after the
    callback under test); records the raw weights and the average per step."""

    def __init__(self, start: dict[str, torch.Tensor] | None = None) -> None:
        self.ema = start
        self.raw: dict[int, dict[str, torch.Tensor]] = {}
        self.at: dict[int, dict[str, torch.Tensor]] = {}
        self.at_validation: list[dict[str, torch.Tensor]] = []
        self.last = -1

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.last:
            return
        self.last = trainer.global_step
        model = full_state(pl_module)
        if self.ema is None:
            self.ema = {k: v.clone() for k, v in model.items()}
        else:
            self.ema = {k: DECAY * self.ema[k] + (1 - DECAY) * model[k] for k in model}
        self.raw[trainer.global_step] = model
        self.at[trainer.global_step] = {k: v.clone() for k, v in self.ema.items()}

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Before the first update (sanity check) the average is the module as built.
        ema = full_state(pl_module) if self.ema is None else self.ema
        self.at_validation.append({k: v.clone() for k, v in ema.items()})


class RawAtEnd(Callback):
    """The training weights at ``on_train_end`` (put before the callback under test, which
    copies the average into the module there)."""

    def __init__(self) -> None:
        self.raw: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.raw = full_state(pl_module)


def _loader(dp: int) -> torch.utils.data.DataLoader[Any]:
    """``PER_RANK`` samples per data-parallel rank (the ranks of one TP group share them)."""
    g = torch.Generator().manual_seed(1)
    n = PER_RANK * dp
    x, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(dp: int, tp: int, root: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = Net(HIDDEN[tp], shard=True)
    ours = EMAWeightAveraging(decay=DECAY)
    ref, end = Reference(), RawAtEnd()
    callbacks: list[Any] = [end, ours, ref]
    if ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=str(root), every_n_train_steps=4, save_top_k=-1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=dp * tp,
            strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
            callbacks=callbacks,
            default_root_dir=str(root),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=8,
            limit_val_batches=1,
            num_sanity_val_steps=1 if ckpt_path is None else 0,
            check_val_every_n_epoch=1,
        )
        trainer.fit(model, _loader(dp), _loader(dp), ckpt_path=ckpt_path)
    assert ours._average_model is not None
    engine = ours._average_model.engine
    return {
        "ema": engine.get_ema_state_dict(),
        "raw_end": end.raw,
        "module_end": full_state(model),
        "ref": ref,
        "val_seen": model.val_seen,
        "ema_bytes": engine.local_nbytes(),
        "model_layout": _layout(dict(model.state_dict())),
        "full_bytes": sum(v.numel() * v.element_size() for v in full_state(model).values()),
        "step": trainer.global_step,
    }


def _layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """``fqn -> (mesh dim names..., placements...)`` of the float DTensors."""
    return {
        k: (*(v.device_mesh.mesh_dim_names or ()), *map(str, v.placements))
        for k, v in state.items()
        if isinstance(v, DTensor) and v.is_floating_point()
    }


def _body(rank: int, world: int, root: str, tp: int = 1) -> dict[str, Any]:
    os.environ.update(
        {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29999")  # unused: the group already exists
    base = Path(root)
    full = _fit(world // tp, tp, base / "full")
    ref: Reference = full["ref"]
    ckpt = base / "full" / "epoch=0-step=4.ckpt"
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    like = ref.at[4]
    saved = {k: torch.empty_like(v) for k, v in like.items()}
    saved_raw = {k: torch.empty_like(v) for k, v in like.items()}
    dest = saved | {f"current_model_state.{k}": v for k, v in saved_raw.items()}
    dcp.load({"state_dict": dest}, checkpoint_id=str(ckpt))
    resumed = _fit(world // tp, tp, base / "resumed", ckpt_path=str(ckpt))

    def eq(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert ref.ema is not None
    init = {k: v for k, v in Net(HIDDEN[tp]).state_dict().items() if v.is_floating_point()}
    return {
        "finite": all(torch.isfinite(v).all() for v in ref.ema.values()),
        "ema_equals_ref": eq(full["ema"], ref.ema),
        "max_diff": max((full["ema"][k] - ref.ema[k]).abs().max().item() for k in ref.ema),
        "moved": not eq(ref.ema, ref.raw[8]),
        "module_end_is_average": eq(full["module_end"], ref.ema),
        "val_sees_average": [
            eq(s, e) for s, e in zip(full["val_seen"], ref.at_validation, strict=True)
        ],
        "validations": len(full["val_seen"]),
        "sanity_sees_init": eq(full["val_seen"][0], init),
        "ema_bytes": full["ema_bytes"],
        "model_layout": full["model_layout"],
        "full_bytes": full["full_bytes"],
        "ckpt_is_dir": ckpt.is_dir(),
        "meta_current": meta.get("current_model_state"),
        "meta_n_averaged": int(meta["averaging_state"]["n_averaged"]),
        "meta_has_state_dict": "state_dict" in meta,
        "ckpt_average_is_ref": eq(saved, ref.at[4]),
        "ckpt_raw_is_raw": eq(saved_raw, ref.raw[4]),
        "resumed_step": resumed["step"],
        "resumed_ema_exact": eq(resumed["ema"], full["ema"]),
        "resumed_raw_exact": eq(resumed["raw_end"], full["raw_end"]),
    }


CELLS = {"w1": (1, 1), "w2": (2, 1), "w3": (3, 1), "w4-dp2-tp2": (2, 2)}
"""``name -> (data_parallel_size, tensor_parallel_size)``; the world is their product."""

COLWISE = ("data_parallel", "tensor_parallel", "_S(0, 2)", "S(0)")
"""A ``ColwiseParallel`` tensor under FSDP2: dp splits each TP rank's rows (strided)."""
TP_LAYOUT = {  # what the 2x2 cell's module holds after ``configure_model``
    "body.0.weight": COLWISE,
    "body.0.bias": COLWISE,
    "body.2.weight": ("data_parallel", "tensor_parallel", "S(0)", "S(1)"),  # rowwise
    "body.2.bias": ("data_parallel", "tensor_parallel", "S(0)", "R"),  # TP-replicated
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``{cell: rank 0's results, plus every rank's "ema_bytes_all"}``: W=2, 3 and the 2x2
    cell spawned (one body each), W=1 in this process."""
    root = tmp_path_factory.mktemp("lightning_mp")
    out: dict[str, dict[str, Any]] = {}
    for name, (dp, tp) in CELLS.items():
        if dp * tp == 1:
            continue
        d = root / name
        d.mkdir()
        ranks = run_ranks(_body, dp * tp, d, str(d), tp)
        out[name] = ranks[0] | {"ema_bytes_all": [r["ema_bytes"] for r in ranks]}
    # W=1: a one-rank gloo group needs no spawn (the body's environment is restored after).
    d = root / "w1"
    d.mkdir()
    environ = dict(os.environ)
    dist.init_process_group("gloo", store=dist.FileStore(str(d / "store"), 1), rank=0, world_size=1)
    try:
        out["w1"] = _body(0, 1, str(d))
        out["w1"]["ema_bytes_all"] = [out["w1"]["ema_bytes"]]
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return out


@pytest.mark.parametrize("cell", CELLS)
def test_average_matches_reference(runs: dict[str, dict[str, Any]], cell: str) -> None:
    run = runs[cell]
    assert run["finite"] and run["moved"]
    assert run["ema_equals_ref"], f"max |average - reference| = {run['max_diff']}"
    assert run["module_end_is_average"]  # on_train_end hands the average over
    assert run["validations"] == 3  # sanity check + 2 epochs
    assert run["val_sees_average"] == [True, True, True]
    assert run["sanity_sees_init"]  # the full tensors are the module as built, unsharded


def test_tensor_parallel_is_applied(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["w4-dp2-tp2"]["model_layout"] == TP_LAYOUT
    assert all(v == ("data_parallel", "S(0)") for v in runs["w2"]["model_layout"].values())


@pytest.mark.parametrize("cell", CELLS)
def test_each_rank_holds_its_share(runs: dict[str, dict[str, Any]], cell: str) -> None:
    run = runs[cell]
    world = math.prod(CELLS[cell])
    rows = 4 * 7 * 4  # at most one extra row per tensor from uneven chunks
    assert len(run["ema_bytes_all"]) == world
    assert max(run["ema_bytes_all"]) <= run["full_bytes"] // world + rows
    # Every element on exactly one rank: TP-replicated tensors are split over tp as well.
    assert sum(run["ema_bytes_all"]) == run["full_bytes"]


@pytest.mark.parametrize("cell", CELLS)
def test_checkpoint_layout_is_lightnings(runs: dict[str, dict[str, Any]], cell: str) -> None:
    run = runs[cell]
    assert run["ckpt_is_dir"]
    assert run["meta_current"] == {"format": "dcp", "prefix": "current_model_state."}
    assert run["meta_n_averaged"] == 4 and not run["meta_has_state_dict"]
    assert run["ckpt_average_is_ref"]  # state_dict = the average
    assert run["ckpt_raw_is_raw"]  # current_model_state = the raw weights


@pytest.mark.parametrize("cell", CELLS)
def test_resume_is_exact(runs: dict[str, dict[str, Any]], cell: str) -> None:
    run = runs[cell]
    assert run["resumed_step"] == 8
    assert run["resumed_ema_exact"] and run["resumed_raw_exact"]
