"""DeepSpeed ZeRO-2 and ZeRO-3 through each trainer's own entry point, with our integrations:
the Hugging Face ``Trainer(args=TrainingArguments(deepspeed=...))`` with ``EMACallback`` and
``EMATrainer``; ``Accelerator(deepspeed_plugin=...)`` with ``ModelEMA(engine)`` in a
hand-written loop; Lightning's ``DeepSpeedStrategy`` with ``EMACallback`` (refused before
issue 39).

One launch per world size: ``tests/fixtures/deepspeed_trainers.py`` as ``torchrun
--nproc_per_node=W`` starts it (``dist_harness.run_torchrun``), every scenario at W=2 and
the ZeRO-3 ones (uneven, padded partitions) at W=3; on a machine with no GPU, with the
test-only shims of ``tests/fixtures/deepspeed_cpu.py``.
Checked per scenario, against a reference EMA written in the script (``lerp_`` on the
weights gathered after every optimizer step): the EMA bit for bit; every evaluation sees the
reference's weights, and the training weights come back; a resume from a mid-run checkpoint
through the trainer's own resume ends with the EMA and the weights of the run that never
stopped, bit for bit; the Hugging Face export loads with ``from_pretrained``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from dist_harness import aborted_at_exit, require_extra

require_extra("deepspeed", "deepspeed")
require_extra("transformers", "transformers")
require_extra("lightning", "lightning")

import torch  # noqa: E402
from dist_harness import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).parent / "fixtures" / "deepspeed_trainers.py"
ROOT = Path(__file__).parent.parent
LAUNCHES = {2: ("hf2", "hf3", "acc2", "acc3", "pl2", "pl3"), 3: ("hf3", "acc3", "pl3")}
"""Scenarios per world size: everything at W=2; ZeRO-3 (uneven partitions) at W=3 too."""
CASES = [(2, 2), (2, 3), (3, 3)]
"""(world size, ZeRO stage) of each trainer's test."""

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


class Launches:
    """One launch per world size, on first use: each rank's results per scenario."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[int, dict[str, Any]] = {}

    def __call__(self, world: int) -> dict[str, Any]:
        if world not in self.done:
            self.done[world] = self._launch(world)
        return self.done[world]

    def _launch(self, world: int) -> dict[str, Any]:
        out = self.root / f"w{world}"
        out.mkdir()
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        argv = [str(SCRIPT), str(out), *LAUNCHES[world]]
        for _ in range(2):  # once more only after torch 2.14 + gloo's abort at exit
            code, stdout, stderr = run_torchrun(argv, world, out, env, timeout_s=600)
            if not aborted_at_exit(code, stdout + stderr):
                break
        assert code == 0, (stdout + stderr)[-6000:]
        runs: dict[str, Any] = {"out": out}
        for name in LAUNCHES[world]:
            runs[name] = [
                torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(world)
            ]
        return runs


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("deepspeed"))


def _check_common(rank_out: dict[str, Any], updates: int) -> None:
    assert rank_out["ema_equals_ref"], f"max |EMA - reference| = {rank_out['max_diff']}"
    assert rank_out["updates"] == (updates, updates)
    assert rank_out["resumed_ema_equal"], f"max |resumed - full| = {rank_out['resumed_max_diff']}"
    assert rank_out["resumed_weights_equal"]
    assert rank_out["resumed_updates"] == updates


@pytest.mark.parametrize(("world", "stage"), CASES)
def test_hf_trainer(launches: Launches, world: int, stage: int) -> None:
    """``Trainer.train`` with ``deepspeed=`` config: the EMA, the evaluations inside and after
    ``train()`` (on the EMA), a resume from ``checkpoint-3`` (its ``ema/`` folder one DCP
    file per rank), bit for bit."""
    for rank_out in launches(world)[f"hf{stage}"]:
        _check_common(rank_out, updates=6)
        assert rank_out["steps"] == 6
        assert rank_out["evals_match_ref"] == [True] * 3  # steps 3, 6 and the standalone one
        assert rank_out["resumed_evals_equal"] == [True, True]
        assert rank_out["restore_errors"] == [] and rank_out["restored_at_end"]
        files = rank_out["ema_dir_files"]
        assert sum(f.endswith(".distcp") for f in files) == world, files


@pytest.mark.parametrize(("world", "stage"), CASES)
def test_hf_export_loads_with_from_pretrained(launches: Launches, world: int, stage: int) -> None:
    from transformers import GPT2LMHeadModel

    folder = launches(world)["out"] / f"hf{stage}"
    ema = torch.load(folder / "ema.pt", weights_only=True)
    loaded = GPT2LMHeadModel.from_pretrained(folder / "export").state_dict()
    assert sorted(ema) == sorted(k for k, v in loaded.items() if v.is_floating_point())
    assert all(torch.equal(loaded[k], v) for k, v in ema.items())


@pytest.mark.parametrize(("world", "stage"), CASES)
def test_accelerate_deepspeed_plugin(launches: Launches, world: int, stage: int) -> None:
    """``ModelEMA(engine)`` of the engine ``accelerator.prepare`` returns: the plain model's
    keys; the engine's own forward under ``average_parameters()`` gives the loss of a plain
    model holding the reference EMA; ``save_state`` + ``save_checkpoint`` resume exactly;
    the EMA registered with ``register_for_checkpointing`` (rank 0's file) is refused on
    rank 1. diffusers' ``EMAModel`` drop-in on the same parameters: diffusers' numbers, bit
    for bit, in real shapes after ``gather_for_save()``; under ZeRO-3 ``copy_to`` into the
    placeholders raises, naming ``engine.average_parameters()``."""
    for rank, rank_out in enumerate(launches(world)[f"acc{stage}"]):
        assert rank_out["keys_are_plain"]
        _check_common(rank_out, updates=6)
        assert rank_out["eval_sees_ema"] and rank_out["eval_loss_equal"]
        assert rank_out["restored"]
        # what register_for_checkpointing(ema) saves: rank 0's pieces alone
        custom = rank_out["custom_state"]
        assert custom == "loaded" if rank == 0 else "not this rank's" in custom, custom
        if rank == 0:  # diffusers' drop-in beside it: its numbers, and copy_to refused
            diffusers = rank_out["diffusers"]
            assert diffusers["equal"], diffusers
            if stage == 3:
                assert "ZeRO-3 partitions" in diffusers["copy_to"], diffusers


@pytest.mark.parametrize(("world", "stage"), CASES)
def test_lightning_deepspeed_strategy(launches: Launches, world: int, stage: int) -> None:
    """``EMACallback`` under ``DeepSpeedStrategy`` (refused before): fit, validation (the
    sanity check and two epoch ends) on the EMA, ``copy_to_model_on_train_end`` (into the
    partitions and the whole copies of persistent parameters), and ``fit(ckpt_path=...)``
    from DeepSpeed's checkpoint folder, bit for bit. The EMA travels in DeepSpeed's own
    files: ZeRO-2, the full EMA in rank 0's file (read by every rank); ZeRO-3, each rank's
    own pieces (1/W) in its own file, nothing gathered."""
    steps = 2 * math.ceil(math.ceil(32 / world) / 4)  # two epochs of the script's data
    for rank_out in launches(world)[f"pl{stage}"]:
        _check_common(rank_out, updates=steps)
        assert rank_out["steps"] == steps
        assert rank_out["val_sees_ema"] == [True] * 3
        assert rank_out["restore_errors"] == []
        assert rank_out["handed_over"] == (True, True)
        ckpt, total = rank_out["ckpt"], rank_out["total_numel"]
        if stage == 3:
            assert ckpt["ckpt_format"] == "rank", ckpt
            assert ckpt["ckpt_ema_numel"] == ckpt["local_numel"] < total, (ckpt, total)
        else:
            assert ckpt["ckpt_format"] == "full" and ckpt["ckpt_ema_numel"] == total, ckpt
