"""The Lightning callback under real ``Trainer.fit``: DDP (gloo, W=2), one device (W=1, no
process group) and ``ModelParallelStrategy`` with FSDP2 (W=2), against a reference EMA
written here (plain ``lerp_`` on full tensors) that follows the module's actual weights.

Checked per run: the EMA equals the reference bit for bit after every fit; every validation
batch (sanity check included) sees exactly the reference EMA's weights and training goes on
with the training weights restored bit for bit; a run resumed from a mid-run checkpoint ends
with the same EMA and weights as the uninterrupted run (same W); a checkpoint saved at W=2
resumes at W=1 and one saved at W=1 resumes at W=2, continuing the EMA trajectory exactly;
mis-configurations raise clear errors.

One spawn at W=2 runs every W=2 scenario; the W=1 runs are in this process.
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
from dist_harness import run_ranks  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning_net import Net, full_state  # noqa: E402

from dtensor_ema.integrations.lightning import EMACallback  # noqa: E402

DECAY, TAU = 0.9, 3.0  # steep ramp: a resume that lost the counter would use other decays
SAMPLES, BATCH = 32, 4  # W=2: 4 steps per epoch; W=1: 8


def _ref_decay(k: int) -> float:
    return DECAY * (1 - math.exp(-k / TAU))


class ReferenceEMA(Callback):
    """The test's own EMA: full tensors, ``lerp_``, every optimizer step. Put after the
    EMACallback, so it also sees the module right after the EMA swap was undone."""

    def __init__(self, start: dict[str, torch.Tensor] | None = None, updates: int = 0) -> None:
        self.ema = start
        self.updates = updates
        self.last_step = -1
        self.at_validation: list[dict[str, torch.Tensor]] = []
        self.restore_errors: list[str] = []
        self.training_weights: dict[str, torch.Tensor] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ema is None:
            self.ema = full_state(pl_module)
        self.last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.last_step:
            return
        self.last_step = trainer.global_step
        self.updates += 1
        d = _ref_decay(self.updates)
        assert self.ema is not None
        for k, v in full_state(pl_module).items():
            self.ema[k].lerp_(v.to(self.ema[k].dtype), 1 - d)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.ema is not None
        self.at_validation.append({k: v.clone() for k, v in self.ema.items()})

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # The EMACallback (earlier in the list) has restored the training weights by now.
        if self.training_weights is None or not _equal(
            full_state(pl_module), self.training_weights
        ):
            self.restore_errors.append(f"step {trainer.global_step}: weights not restored")


class TrainingWeights(Callback):
    """Records the module's weights before validation starts (put before the EMACallback)."""

    def __init__(self, ref: ReferenceEMA) -> None:
        self.ref = ref

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.ref.training_weights = full_state(pl_module)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 5, generator=g)
    y = torch.randn(SAMPLES, 3, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _trainer(world: int, callbacks: list[Any], root: Path, **kwargs: Any) -> pl.Trainer:
    strategy: Any = "auto"
    if kwargs.pop("fsdp", False):
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    elif world > 1:
        strategy = "ddp"
    kwargs.setdefault("limit_val_batches", 2)
    kwargs.setdefault("num_sanity_val_steps", 1)
    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        callbacks=callbacks,
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **kwargs,
    )


def _ema_cb(**kwargs: Any) -> EMACallback:
    return EMACallback(decay=DECAY, tau=TAU, **kwargs)


def fit_and_check(
    world: int,
    root: Path,
    *,
    fsdp: bool = False,
    max_steps: int,
    ckpt_every: int | None = None,
    ckpt_path: str | None = None,
    ref_start: tuple[dict[str, torch.Tensor], int] | None = None,
) -> dict[str, Any]:
    """One ``fit``; returns plain results (all ranks compute the same)."""
    model = Net(shard=fsdp)
    ema_cb = _ema_cb()
    ref = ReferenceEMA(*(ref_start or (None, 0)))
    callbacks: list[Any] = [TrainingWeights(ref), ema_cb, ref]
    if ckpt_every:
        callbacks.append(
            ModelCheckpoint(dirpath=str(root), every_n_train_steps=ckpt_every, save_top_k=-1)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(world, callbacks, root, max_steps=max_steps, fsdp=fsdp)
        trainer.fit(model, _loader(), _loader(), ckpt_path=ckpt_path)
    ema_full = ema_cb.ema.get_ema_state_dict()
    assert ref.ema is not None
    floats = {k: v for k, v in ema_full.items() if k in ref.ema}
    return {
        "ema_equals_ref": _equal(floats, ref.ema),
        "max_diff": max((floats[k] - ref.ema[k]).abs().max().item() for k in floats),
        "updates": ema_cb.ema.updates,
        "ref_updates": ref.updates,
        "validations": len(model.val_seen),
        "val_sees_ema": [
            _equal(seen, ema) for seen, ema in zip(model.val_seen, ref.at_validation, strict=True)
        ],
        "restore_errors": ref.restore_errors,
        "ema": floats,
        "weights": full_state(model),
        "step": trainer.global_step,
    }


def saved_full_ema(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The full EMA tensors and counter in a DDP / one-device Lightning checkpoint file."""
    ckpt = torch.load(path, weights_only=True)
    state = ckpt["callbacks"]["EMACallback[ema]"]
    assert state["format"] == "full"
    return state["ema"], state["updates"]


# ---------------------------------------------------------------------------- W=2 body
def _w2_body(rank: int, world: int, root: str, w1_ckpt: str) -> dict[str, Any]:
    os.environ.update(
        {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29999")  # unused: the group already exists
    base = Path(root)
    out: dict[str, Any] = {}
    # DDP: uninterrupted 8 steps (2 epochs), checkpoints every 4 steps.
    out["ddp_full"] = fit_and_check(world, base / "ddp", max_steps=8, ckpt_every=4)
    ckpt = base / "ddp" / "epoch=0-step=4.ckpt"
    dist.barrier()
    saved, updates = saved_full_ema(ckpt)
    out["ddp_saved_updates"] = updates
    out["ddp_ckpt"] = str(ckpt)
    # Same W resume from step 4.
    out["ddp_resumed"] = fit_and_check(
        world, base / "ddp_resume", max_steps=8, ckpt_path=str(ckpt), ref_start=(saved, updates)
    )
    # The W=1 checkpoint (saved in the pytest process) resumed at W=2.
    w1_saved, w1_updates = saved_full_ema(Path(w1_ckpt))
    out["from_w1"] = fit_and_check(
        world,
        base / "from_w1",
        max_steps=12,
        ckpt_path=w1_ckpt,
        ref_start=(w1_saved, w1_updates),
    )
    # A resume with other EMA options fails on every rank, naming the difference.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(world, [EMACallback(decay=0.5, tau=TAU)], base / "bad", max_steps=9)
            trainer.fit(Net(), _loader(), ckpt_path=str(ckpt))
        out["bad_resume"] = "no error"
    except ValueError as e:
        out["bad_resume"] = str(e)
    # FSDP2 through ModelParallelStrategy: sharded DCP checkpoints.
    out["fsdp_full"] = fit_and_check(world, base / "fsdp", fsdp=True, max_steps=8, ckpt_every=4)
    fckpt = base / "fsdp" / "epoch=0-step=4.ckpt"
    out["fsdp_ckpt_is_dir"] = fckpt.is_dir()
    fmeta = torch.load(fckpt / "meta.pt", weights_only=False)["callbacks"]["EMACallback[ema]"]
    out["fsdp_format"] = fmeta["format"]
    out["fsdp_meta_has_tensors"] = "ema" in fmeta
    fsaved = {k: v.clone() for k, v in _read_dcp_ema(fckpt, out["fsdp_full"]["ema"]).items()}
    out["fsdp_resumed"] = fit_and_check(
        world,
        base / "fsdp_resume",
        fsdp=True,
        max_steps=8,
        ckpt_path=str(fckpt),
        ref_start=(fsaved, fmeta["updates"]),
    )
    for run in out.values():
        if isinstance(run, dict):
            run.pop("ema", None)
            run["weights"] = {k: v.sum().item() for k, v in run["weights"].items()}
    return out


def _read_dcp_ema(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EMA tensors of a sharded Lightning checkpoint, read back whole (test side)."""
    import torch.distributed.checkpoint as dcp

    dest = {f"_dtensor_ema.{k}": torch.empty_like(v) for k, v in like.items()}
    dcp.load({"state_dict": dest}, checkpoint_id=str(path))
    return {k.removeprefix("_dtensor_ema."): v for k, v in dest.items()}


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lightning")
    out: dict[str, Any] = {}
    out["w1_full"] = fit_and_check(1, root / "w1", max_steps=8, ckpt_every=4)
    w1_ckpt = root / "w1" / "epoch=0-step=4.ckpt"
    out["w2"] = run_ranks(_w2_body, 2, root, str(root / "w2"), str(w1_ckpt))
    ddp_ckpt = Path(out["w2"][0]["ddp_ckpt"])
    saved, updates = saved_full_ema(ddp_ckpt)
    out["w1_from_w2"] = fit_and_check(
        1, root / "w1_from_w2", max_steps=12, ckpt_path=str(ddp_ckpt), ref_start=(saved, updates)
    )
    return out


def _check_run(run: dict[str, Any], steps: int, updates: int, validations: int) -> None:
    assert run["ema_equals_ref"], f"max |EMA - reference| = {run['max_diff']}"
    assert run["step"] == steps
    assert run["updates"] == run["ref_updates"] == updates
    assert run["validations"] == validations, {k: v for k, v in run.items() if k != "weights"}
    assert run["val_sees_ema"] == [True] * validations
    assert run["restore_errors"] == []


def test_w1_fit_matches_reference(runs: dict[str, Any]) -> None:
    _check_run(runs["w1_full"], steps=8, updates=8, validations=2)  # sanity check + epoch 0


def test_w2_ddp_fit_matches_reference(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        _check_run(rank_out["ddp_full"], steps=8, updates=8, validations=3)


def test_w2_ddp_resume_is_bit_exact(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        assert rank_out["ddp_saved_updates"] == 4
        resumed, full = rank_out["ddp_resumed"], rank_out["ddp_full"]
        _check_run(resumed, steps=8, updates=8, validations=1)  # no sanity check on resume
        assert resumed["weights"] == full["weights"]


def test_w2_resume_ema_equals_uninterrupted(runs: dict[str, Any]) -> None:
    """Not only the same as a reference started from the checkpoint: the same bits as the
    run that never stopped (the EMA of the final fit is compared on rank 0 and 1)."""
    for rank_out in runs["w2"]:
        assert rank_out["ddp_resumed"]["max_diff"] == 0.0
        assert rank_out["ddp_resumed"]["weights"] == rank_out["ddp_full"]["weights"]


def test_checkpoint_resumes_at_other_world_sizes(runs: dict[str, Any]) -> None:
    # W=1 checkpoint at step 4 (of 8 per epoch) -> W=2; W=2 checkpoint -> W=1.
    for rank_out in runs["w2"]:
        run = rank_out["from_w1"]
        assert run["ema_equals_ref"] and run["updates"] == run["ref_updates"] == 12
    run = runs["w1_from_w2"]
    assert run["ema_equals_ref"] and run["updates"] == run["ref_updates"] == 12


def test_w2_resume_with_other_options_fails_clearly(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        msg = rank_out["bad_resume"]
        assert "checkpoint EMA options differ" in msg and "0.5" in msg, msg


def test_w2_fsdp2_model_parallel(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        assert rank_out["fsdp_ckpt_is_dir"]
        assert rank_out["fsdp_format"] == "dcp" and not rank_out["fsdp_meta_has_tensors"]
        _check_run(rank_out["fsdp_full"], steps=8, updates=8, validations=3)
        resumed = rank_out["fsdp_resumed"]
        _check_run(resumed, steps=8, updates=8, validations=1)
        assert resumed["weights"] == rank_out["fsdp_full"]["weights"]


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_misconfigured_callback_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\], got 2"):
        EMACallback(decay=2.0)
    with pytest.raises(ValueError, match="update_every_n_steps must be an int >= 1, got 0"):
        EMACallback(update_every_n_steps=0)
    with pytest.raises(TypeError, match=r"unknown ModelEMA option\(s\) \['decau'\]"):
        EMACallback(decau=0.9)
    with pytest.raises(ValueError, match="half_life=10 conflicts with tau"):
        EMACallback(tau=5, half_life=10)
    # ModelEMA's construction-only flags are options too (a TypeError from EmaOptions before)
    EMACallback(parameters_as_bucket_view=True, replicate_buffers=True, verify_replicas=False)
    with pytest.raises(TypeError, match="replicate_buffers must be a bool, got 'yes'"):
        EMACallback(replicate_buffers="yes")
    with pytest.raises(RuntimeError, match="state_key` must be unique"):  # Lightning's check
        _trainer(1, [EMACallback(), EMACallback()], tmp_path, max_steps=1)
    trainer = _trainer(1, [EMACallback(), EMACallback(name="slow")], tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="all have evaluate_with_ema=True"):
        trainer.fit(Net(), _loader())
    trainer = _trainer(1, [EMACallback(exclude=["nope"])], tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="exclude names not found"):
        trainer.fit(Net(), _loader())


class GatedReference(Callback):
    """The test's EMA for ``update_every_n_steps=every, start_step=start``: after step ``s``
    with ``s > start`` and ``s % every == 0`` only; the first such update starts from the
    module's weights. Put before the EMACallback: it sees the raw weights at validation."""

    def __init__(self, every: int, start: int) -> None:
        self.every, self.start = every, start
        self.ema: dict[str, torch.Tensor] | None = None
        self.updates = 0
        self.last_step = 0
        self.expected_at_validation: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step
        if step == self.last_step:
            return
        self.last_step = step
        if step <= self.start or step % self.every:
            return
        if self.ema is None:
            self.ema = full_state(pl_module)
        self.updates += 1
        for k, v in full_state(pl_module).items():
            self.ema[k].lerp_(v, 1 - _ref_decay(self.updates))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Before the EMA starts, validation runs with the module's own weights.
        expected = self.ema if self.ema is not None else full_state(pl_module)
        self.expected_at_validation.append({k: v.clone() for k, v in expected.items()})


def test_w1_delayed_sparse_updates_and_hand_over(tmp_path: Path) -> None:
    model = Net()
    ema_cb = _ema_cb(update_every_n_steps=2, start_step=3, copy_to_model_on_train_end=True)
    ref = GatedReference(every=2, start=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(1, [ref, ema_cb], tmp_path, max_steps=16, enable_checkpointing=False)
        trainer.fit(model, _loader(), _loader())
    assert ref.ema is not None and ref.updates == 7  # after steps 4, 6, ..., 16
    assert ema_cb.ema.updates == 7
    ema_full = ema_cb.ema.get_ema_state_dict()
    assert _equal({k: ema_full[k] for k in ref.ema}, ref.ema)
    # Sanity check (EMA not started: raw weights), then the ends of epochs 0 and 1.
    assert len(model.val_seen) == len(ref.expected_at_validation) == 3
    for seen, expected in zip(model.val_seen, ref.expected_at_validation, strict=True):
        assert _equal(seen, expected)
    assert _equal(full_state(model), ref.ema)  # copy_to_model_on_train_end


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
@pytest.mark.filterwarnings("ignore:The dirpath has changed from")  # resumed in another folder
def test_checkpoint_without_ema_state_warns_and_starts_from_restored_weights(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = _trainer(1, [], tmp_path, max_steps=2, num_sanity_val_steps=0)
        plain.fit(Net(), _loader())
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"))
    model, ema_cb = Net(), _ema_cb()
    trainer = _trainer(1, [ema_cb], tmp_path / "resumed", max_steps=2, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="has no state for this callback"):
        trainer.fit(model, _loader(), ckpt_path=str(ckpt))  # already at max_steps: no step
    assert ema_cb.ema.updates == 0
    assert _equal(ema_cb.ema.get_ema_state_dict(), model.state_dict())
