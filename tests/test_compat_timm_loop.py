"""The timm drop-in end to end at W=2 (gloo): ``tests/fixtures/timm_loop.py``, our own small
loop over timm's library pieces as timm's ``train.py`` uses them (``create_model``,
``ModelEmaV3`` built before DDP, ``update(model, step=)``, ``distribute_bn`` of the EMA,
validation through the EMA, ``CheckpointSaver(model_ema=)`` on rank 0,
``resume_checkpoint`` and ``load_checkpoint(use_ema=True)``), run once with timm's own
``ModelEmaV3`` and once with ours. The rank-0 checkpoints, loaded in this (fresh) process
with ``timm.models.load_checkpoint(model, path, use_ema=True)``, hold the same EMA bit for
bit, and so does a run resumed from ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_harness import aborted_at_exit, run_torchrun

timm = pytest.importorskip("timm")

SCRIPT = Path(__file__).parent / "fixtures" / "timm_loop.py"
ROOT = Path(__file__).parent.parent


def _run(tmp: Path, name: str, ema: str, epochs: int, resume: str = "") -> str:
    """The fixture at W=2 as ``torchrun --standalone --nproc_per_node 2`` launches it (its
    environment and rendezvous store per rank), forked from the preloaded rank server."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [str(SCRIPT), "--out", str(tmp / name), "--ema", ema, "--epochs", str(epochs)]
    if resume:
        argv += ["--resume", resume]
    for _ in range(2):  # once more only after torch 2.14 + gloo's abort at exit
        code, stdout, stderr = run_torchrun(argv, 2, tmp, env, timeout_s=600)
        if not aborted_at_exit(code, stdout + stderr):
            break
    assert code == 0, stderr[-4000:]
    assert "(EMA)" in stdout  # the EMA was validated
    return (tmp / name / "ema_class.txt").read_text()


def _ema(path: Path) -> dict[str, torch.Tensor]:
    model = timm.create_model("test_resnet", num_classes=2)
    timm.models.load_checkpoint(model, str(path), use_ema=True)
    return model.state_dict()


def _different(a: Path, b: Path) -> list[str]:
    ours, theirs = _ema(a), _ema(b)
    assert all(torch.isfinite(v).all() for v in theirs.values() if v.is_floating_point())
    return [k for k in theirs if not torch.equal(ours[k], theirs[k])]


@pytest.mark.slow
@pytest.mark.distributed
def test_timm_loop_end_to_end(tmp_path: Path) -> None:
    assert _run(tmp_path, "real", "timm", epochs=3) == "timm.utils.model_ema"
    assert _run(tmp_path, "ours", "ours", epochs=2) == "dtensor_ema.compat.timm"
    resume = str(tmp_path / "ours" / "last.pth.tar")
    assert _run(tmp_path, "resumed", "ours", epochs=3, resume=resume) == "dtensor_ema.compat.timm"
    for epoch in (0, 1):
        name = f"checkpoint-{epoch}.pth.tar"
        assert _different(tmp_path / "ours" / name, tmp_path / "real" / name) == [], epoch
    last = "last.pth.tar"
    assert _different(tmp_path / "resumed" / last, tmp_path / "real" / last) == []
