"""The Hugging Face callback and ``EMATrainer`` under real ``Trainer.train``: one process
(W=1, no process group) and DDP over 2 gloo ranks set up the way ``torchrun`` does (W=2),
on a tiny GPT-2 (tied embeddings) built from a config: nothing is downloaded.

Checked against a reference EMA written here (plain ``lerp_`` on full tensors, following
the model's actual weights after every optimizer step): the EMA after ``train()``; every
evaluation (inside ``train()`` and a standalone ``evaluate()``) sees exactly the
reference's weights, and the training weights come back bit for bit; every checkpoint
folder holds the EMA (sharded DCP), and ``resume_from_checkpoint`` ends with the same EMA
and weights as the uninterrupted run; a W=2 checkpoint resumes at W=1 (new data order, so
against a reference started from the checkpoint); ``save_ema_model`` writes a folder that
``from_pretrained`` loads with the EMA's values; mis-configurations raise clear errors.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
from dist_harness import require_extra

require_extra("transformers", "transformers")

import models  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from transformers import GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from dtensor_ema.integrations.transformers import EMACallback, EMATrainer  # noqa: E402

DECAY, TAU = 0.9, 3.0
STEPS, SAVE_EVERY = 6, 3
SAMPLES, SEQ, VOCAB = 24, 8, 32


def _ref_decay(k: int) -> float:
    return DECAY * (1 - math.exp(-k / TAU))


def tiny_gpt2() -> GPT2LMHeadModel:
    return models.tiny_gpt2(vocab=VOCAB, seq=SEQ, width=12, heads=2)  # type: ignore[return-value]


def Tokens(n: int = SAMPLES, seed: int = 1) -> models.TokenRows:
    return models.TokenRows(n, vocab=VOCAB, seq=SEQ, seed=seed)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class ReferenceEMA(TrainerCallback):
    """The test's EMA (after the EMACallback in the list) and the evaluation probes."""

    def __init__(self, start: dict[str, torch.Tensor] | None = None, updates: int = 0) -> None:
        self.ema = start
        self.updates = updates
        self.last_step = -1
        self.training: dict[str, torch.Tensor] | None = None
        self.evals: list[bool] = []
        self.restore_errors: list[int] = []
        self._in_eval = False

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        if self.ema is None:
            self.ema = full_state(model)
        self.last_step = state.global_step

    def on_step_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        if self.training is not None and not _equal(full_state(model), self.training):
            self.restore_errors.append(state.global_step)
        self._in_eval = False

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        if state.global_step == self.last_step:
            return
        self.last_step = state.global_step
        self.updates += 1
        assert self.ema is not None
        for k, v in full_state(model).items():
            self.ema[k].lerp_(v, 1 - _ref_decay(self.updates))
        self.training = full_state(model)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self._in_eval:  # the first batch of each evaluation
            self._in_eval = True
            model = kw.get("model")
            assert model is not None and self.ema is not None
            self.evals.append(_equal(full_state(model), self.ema))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._in_eval = False


def _args(out: Path, **kw: Any) -> TrainingArguments:
    kw = {"use_cpu": True, "max_steps": STEPS, **kw}
    return models.hf_training_args(out, every=SAVE_EVERY, **kw)  # type: ignore[return-value]


def train_and_check(
    out: Path,
    *,
    resume: str | bool | None = None,
    ref_start: tuple[dict[str, torch.Tensor], int] | None = None,
    export: Path | None = None,
) -> dict[str, Any]:
    model = tiny_gpt2()
    ema_cb = EMACallback(decay=DECAY, tau=TAU)
    ref = ReferenceEMA(*(ref_start or (None, 0)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = EMATrainer(
            model=model,
            args=_args(out),
            train_dataset=Tokens(),
            eval_dataset=Tokens(8, seed=2),
            callbacks=[ema_cb, ref],
        )
        trainer.train(resume_from_checkpoint=resume)
        trainer.evaluate()  # standalone, after training
        bad_export = None
        if export is not None:
            trainer.save_ema_model(export)
            try:  # rank 0 alone writes, and fails: every rank must raise, none wait
                ema_cb.save_pretrained(export.with_name("bad"), max_shard_size="not a size")
            except ValueError as e:
                bad_export = str(e)
    assert ref.ema is not None
    ema_full = ema_cb.ema.get_ema_state_dict()
    floats = {k: ema_full[k] for k in ref.ema}
    return {
        "ema_equals_ref": _equal(floats, ref.ema),
        "max_diff": max((floats[k] - ref.ema[k]).abs().max().item() for k in floats),
        "updates": ema_cb.ema.updates,
        "ref_updates": ref.updates,
        "evals": ref.evals,
        "restore_errors": ref.restore_errors,
        "restored_after_eval": _equal(full_state(model), ref.training or {}),
        "ema": floats,
        "weights": full_state(model),
        "step": trainer.state.global_step,
        "bad_export": bad_export,
    }


def saved_ema(folder: Path, like: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """The EMA in ``<checkpoint>/ema`` read back whole in this process (test side)."""
    from torch.distributed.checkpoint import load

    tied = "lm_head.weight"  # stored once, under transformer.wte.weight
    tensors = {k: torch.empty_like(v) for k, v in like.items() if k != tied}
    dest: dict[str, Any] = {"ema": {"ema": tensors, "updates": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(dest, checkpoint_id=str(folder / "ema"), no_dist=True)
    tensors[tied] = tensors["transformer.wte.weight"].clone()
    return tensors, int(dest["ema"]["updates"])


def _w2_body(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",  # unused: the gloo group already exists
        }
    )
    base = Path(root)
    out: dict[str, Any] = {}
    out["full"] = train_and_check(base / "full", export=base / "export")
    dist.barrier()
    ckpt = base / "full" / f"checkpoint-{SAVE_EVERY}"
    out["ckpt"] = str(ckpt)
    out["rank_files"] = sorted(p.name for p in (ckpt / "ema").iterdir())
    saved, updates = saved_ema(ckpt, out["full"]["ema"])
    out["resumed"] = train_and_check(base / "resumed", resume=str(ckpt), ref_start=(saved, updates))
    try:
        bad = EMATrainer(
            model=tiny_gpt2(),
            args=_args(base / "bad", eval_strategy="no"),
            train_dataset=Tokens(),
            callbacks=[EMACallback(decay=0.5, tau=TAU)],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad.train(resume_from_checkpoint=str(ckpt))
        out["bad_resume"] = "no error"
    except (ValueError, RuntimeError) as e:
        out["bad_resume"] = str(e)
    for run in (out["full"], out["resumed"]):
        run.pop("ema")
        run["weights"] = {k: v.sum().item() for k, v in run["weights"].items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    out: dict[str, Any] = {"root": root}
    out["w1"] = train_and_check(root / "w1", export=root / "w1_export")
    out["w2"] = run_ranks(_w2_body, 2, root, str(root / "w2"))
    ckpt = Path(out["w2"][0]["ckpt"])
    saved, updates = saved_ema(ckpt, out["w1"]["ema"])
    out["w1_from_w2"] = train_and_check(
        root / "w1_from_w2", resume=str(ckpt), ref_start=(saved, updates)
    )
    return out


def _check_run(run: dict[str, Any], evals: int, updates: int = STEPS) -> None:
    assert run["ema_equals_ref"], f"max |EMA - reference| = {run['max_diff']}"
    assert run["step"] == STEPS
    assert run["updates"] == run["ref_updates"] == updates
    assert run["evals"] == [True] * evals, run["evals"]
    assert run["restore_errors"] == [] and run["restored_after_eval"]


def test_w1_train_matches_reference(runs: dict[str, Any]) -> None:
    _check_run(runs["w1"], evals=3)  # steps 3 and 6, and the standalone evaluate()


def test_w2_ddp_train_matches_reference(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        _check_run(rank_out["full"], evals=3)


def test_every_checkpoint_folder_holds_the_sharded_ema(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for run_dir in (root / "w1", root / "w2" / "full"):
        for step in (SAVE_EVERY, STEPS):
            assert (run_dir / f"checkpoint-{step}" / "ema" / ".metadata").is_file()
    files = runs["w2"][0]["rank_files"]
    assert sum(f.endswith(".distcp") for f in files) == 2, files  # one file per rank


def test_w2_resume_is_bit_exact(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        resumed, full = rank_out["resumed"], rank_out["full"]
        _check_run(resumed, evals=2)  # step 6 and the standalone one
        assert resumed["weights"] == full["weights"]
        assert resumed["max_diff"] == 0.0


def test_w2_checkpoint_resumes_at_w1(runs: dict[str, Any]) -> None:
    _check_run(runs["w1_from_w2"], evals=2)


def test_w2_resume_with_other_options_fails_clearly(runs: dict[str, Any]) -> None:
    for rank_out in runs["w2"]:
        msg = rank_out["bad_resume"]
        assert "cannot resume the EMA" in msg and "0.5" in msg, msg


def test_export_loads_with_from_pretrained(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for folder, ema in ((root / "w1_export", runs["w1"]["ema"]), (root / "w2" / "export", None)):
        loaded = GPT2LMHeadModel.from_pretrained(folder)
        state = full_state(loaded)
        if ema is not None:
            assert _equal({k: state[k] for k in ema}, ema)
        assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)


def test_a_failed_export_raises_on_every_rank(runs: dict[str, Any]) -> None:
    """Rank 0 alone writes the folder; when it fails, every rank raises its error (the other
    rank used to wait in a barrier for a rank that had left)."""
    assert "not a size" in (runs["w1"]["bad_export"] or ""), runs["w1"]["bad_export"]
    errors = [r["full"]["bad_export"] for r in runs["w2"]]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "failed on rank 0: ValueError" in errors[0] and "not a size" in errors[0], errors


def test_misconfigured_callback_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\], got 2"):
        EMACallback(decay=2.0)
    with pytest.raises(ValueError, match="start_step must be an int >= 0, got -1"):
        EMACallback(start_step=-1)
    with pytest.raises(TypeError, match=r"unknown ModelEMA option\(s\) \['decau'\]"):
        EMACallback(decau=0.9)
    trainer = EMATrainer(
        model=tiny_gpt2(),
        args=_args(tmp_path, max_steps=1),
        train_dataset=Tokens(),
        eval_dataset=Tokens(4),
        callbacks=[EMACallback(), EMACallback(name="slow")],
    )
    with pytest.raises(ValueError, match="all have evaluate_with_ema=True"):
        trainer.evaluate()
    # A checkpoint saved without the callback cannot resume an EMA silently.
    plain = transformers.Trainer(
        model=tiny_gpt2(),
        args=_args(tmp_path / "plain", max_steps=2, save_steps=2, eval_strategy="no"),
        train_dataset=Tokens(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain.train()
        trainer = EMATrainer(
            model=tiny_gpt2(),
            args=_args(tmp_path / "plain", max_steps=3, eval_strategy="no"),
            train_dataset=Tokens(),
            callbacks=[EMACallback()],
        )
        with pytest.raises(ValueError, match="saved without this callback"):
            trainer.train(resume_from_checkpoint=True)


class GatedReference(TrainerCallback):
    """The test's EMA for ``update_every_n_steps=every, start_step=start`` (see the
    Lightning test): the first update starts from the model's weights."""

    def __init__(self, every: int, start: int) -> None:
        self.every, self.start = every, start
        self.ema: dict[str, torch.Tensor] | None = None
        self.updates = 0

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        step = state.global_step
        if step <= self.start or step % self.every:
            return
        if self.ema is None:
            self.ema = full_state(model)
        self.updates += 1
        for k, v in full_state(model).items():
            self.ema[k].lerp_(v, 1 - _ref_decay(self.updates))


def test_w1_delayed_sparse_updates(tmp_path: Path) -> None:
    ema_cb = EMACallback(decay=DECAY, tau=TAU, update_every_n_steps=2, start_step=1)
    ref = GatedReference(every=2, start=1)
    trainer = EMATrainer(
        model=tiny_gpt2(),
        args=_args(tmp_path, eval_strategy="no", save_strategy="no"),
        train_dataset=Tokens(),
        callbacks=[ema_cb, ref],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert ref.ema is not None and ref.updates == ema_cb.ema.updates == 3  # steps 2, 4, 6
    ema_full = ema_cb.ema.get_ema_state_dict()
    assert _equal({k: ema_full[k] for k in ref.ema}, ref.ema)


def test_w1_callback_with_plain_trainer_resumes_bit_exact(tmp_path: Path) -> None:
    """Without the mixin (no evaluation swap) the callback still finds the checkpoint:
    ``resume_from_checkpoint=True`` resumes ``<output_dir>/checkpoint-<step>``."""

    def run(max_steps: int, resume: bool) -> tuple[dict[str, torch.Tensor], int]:
        callback = EMACallback(decay=DECAY, tau=TAU)
        args = _args(tmp_path, max_steps=max_steps, eval_strategy="no", save_steps=SAVE_EVERY)
        trainer = transformers.Trainer(
            model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[callback]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=True if resume else None)
        return callback.ema.get_ema_state_dict(), callback.ema.updates

    full, updates = run(STEPS, resume=False)
    # Keep only the first checkpoint, so that resume_from_checkpoint=True picks it.
    shutil.rmtree(tmp_path / f"checkpoint-{STEPS}")
    resumed, resumed_updates = run(STEPS, resume=True)
    assert updates == resumed_updates == STEPS
    assert _equal(full, resumed)
