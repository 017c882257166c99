"""``dtensor_ema.compat.lightning.EMAWeightAveraging`` under Lightning's
``ModelParallelStrategy`` (FSDP2 via ``fully_shard`` in ``configure_model`` on a 1-D dp
mesh: ``data_parallel_size=W``, ``tensor_parallel_size=1``, gloo) at W=1 (a one-rank group
in this process), W=2 and the uneven W=3 (one spawned body each), against a reference
written here.

Lightning's own ``EMAWeightAveraging`` cannot run under this strategy at any W, W=1
included (its ``setup`` calls ``configure_model`` and deep-copies the sharded module:
``AssertionError: FSDP does not support deepcopy``, Lightning 2.6.6), so the reference is
torch's ``get_ema_avg_fn`` formula on full tensors: the first update copies, then
``d * ema + (1 - d) * model``, following the module's actual weights after every optimizer
step. Our drop-in deep-copied it too at W=1 until the replica learned that FSDP2 models
take the engine's module on a one-rank mesh as well (the W=1 cell guards it).

Checked in one body per W (16 samples per rank, batch 4: 4 steps per epoch, so the
step-4 checkpoint ends epoch 0): the average equals the reference bit for bit; validation
sees it; each rank holds about ``1/W`` of it; the sharded checkpoint has Lightning's layout
(``state_dict`` = the average, the raw weights beside it); a resume from it ends exactly
where the uninterrupted run ends.
"""

from __future__ import annotations

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
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from dtensor_ema.compat.lightning import EMAWeightAveraging  # noqa: E402

DECAY = 0.9
PER_RANK, BATCH = 16, 4  # 4 steps per epoch at every W (the checkpoint at step 4 ends one)


class Net(pl.LightningModule):
    """Odd sizes (uneven shards at W=2) and a float buffer that changes every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.register_buffer("seen", torch.zeros(3))
        self.val_seen: list[dict[str, torch.Tensor]] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.body[0], mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.add_(0.25)
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_seen.append(full_state(self))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full float tensors (``full_tensor()`` for DTensors: collective)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
        if v.is_floating_point()
    }


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


def _loader(world: int) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    n = PER_RANK * world
    x, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(world: int, root: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = Net()
    ours = EMAWeightAveraging(decay=DECAY)
    ref, end = Reference(), RawAtEnd()
    callbacks: list[Any] = [end, ours, ref]
    if ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=str(root), every_n_train_steps=4, save_top_k=-1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
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
        trainer.fit(model, _loader(world), _loader(world), ckpt_path=ckpt_path)
    assert ours._average_model is not None
    engine = ours._average_model.engine
    return {
        "ema": engine.get_ema_state_dict(),
        "raw_end": end.raw,
        "module_end": full_state(model),
        "ref": ref,
        "val_seen": model.val_seen,
        "ema_bytes": engine.local_nbytes(),
        "full_bytes": sum(v.numel() * v.element_size() for v in full_state(model).values()),
        "step": trainer.global_step,
    }


def _body(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(
        {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29999")  # unused: the group already exists
    base = Path(root)
    full = _fit(world, base / "full")
    ref: Reference = full["ref"]
    ckpt = base / "full" / "epoch=0-step=4.ckpt"
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    like = ref.at[4]
    saved = {k: torch.empty_like(v) for k, v in like.items()}
    saved_raw = {k: torch.empty_like(v) for k, v in like.items()}
    dest = saved | {f"current_model_state.{k}": v for k, v in saved_raw.items()}
    dcp.load({"state_dict": dest}, checkpoint_id=str(ckpt))
    resumed = _fit(world, base / "resumed", ckpt_path=str(ckpt))

    def eq(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert ref.ema is not None
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
        "ema_bytes": full["ema_bytes"],
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """``{W: rank 0's results}``: W=2 and 3 spawned, W=1 in this process."""
    root = tmp_path_factory.mktemp("lightning_mp")
    out: dict[int, dict[str, Any]] = {}
    for world in (2, 3):
        d = root / f"w{world}"
        d.mkdir()
        out[world] = run_ranks(_body, world, d, str(d))[0]
    # W=1: a one-rank gloo group needs no spawn (the body's environment is restored after).
    d = root / "w1"
    d.mkdir()
    environ = dict(os.environ)
    dist.init_process_group("gloo", store=dist.FileStore(str(d / "store"), 1), rank=0, world_size=1)
    try:
        out[1] = _body(0, 1, str(d))
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return out


WORLDS = [1, 2, 3]


@pytest.mark.parametrize("world", WORLDS)
def test_average_matches_reference(runs: dict[int, dict[str, Any]], world: int) -> None:
    run = runs[world]
    assert run["finite"] and run["moved"]
    assert run["ema_equals_ref"], f"max |average - reference| = {run['max_diff']}"
    assert run["module_end_is_average"]  # on_train_end hands the average over
    assert run["validations"] == 3  # sanity check + 2 epochs
    assert run["val_sees_average"] == [True, True, True]


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_its_share(runs: dict[int, dict[str, Any]], world: int) -> None:
    run = runs[world]
    rows = 4 * 7 * 4  # at most one extra row per tensor from uneven chunks
    assert run["ema_bytes"] <= run["full_bytes"] // world + rows
    if world == 1:
        assert run["ema_bytes"] == run["full_bytes"]


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoint_layout_is_lightnings(runs: dict[int, dict[str, Any]], world: int) -> None:
    run = runs[world]
    assert run["ckpt_is_dir"]
    assert run["meta_current"] == {"format": "dcp", "prefix": "current_model_state."}
    assert run["meta_n_averaged"] == 4 and not run["meta_has_state_dict"]
    assert run["ckpt_average_is_ref"]  # state_dict = the average
    assert run["ckpt_raw_is_raw"]  # current_model_state = the raw weights


@pytest.mark.parametrize("world", WORLDS)
def test_resume_is_exact(runs: dict[int, dict[str, Any]], world: int) -> None:
    run = runs[world]
    assert run["resumed_step"] == 8
    assert run["resumed_ema_exact"] and run["resumed_raw_exact"]
