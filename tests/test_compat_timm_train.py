"""timm's own train.py (tests/fixtures/timm_train.py: the CPU DDP fix and the one-line swap
to dtensor_ema.compat.timm) at W=2 gloo with --model-ema, against the same script on the
real timm ModelEmaV3: validation (with distribute_bn of the EMA), rank-0 checkpoints loaded
with timm.models.load_checkpoint(use_ema=True) in one process, and a --resume.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

timm = pytest.importorskip("timm")
Image = pytest.importorskip("PIL.Image")

FIXTURE = Path(__file__).parent / "fixtures" / "timm_train.py"
ROOT = Path(__file__).parent.parent

# sitecustomize in the ranks: at exit, record which ModelEmaV3 timm's task module used.
SITECUSTOMIZE = """
import atexit, os, sys
def _report():
    task = sys.modules.get("timm.task.task")
    if task is not None and os.environ.get("EMA_CLASS_DIR"):
        path = os.path.join(os.environ["EMA_CLASS_DIR"], "rank" + os.environ.get("RANK", "x"))
        with open(path, "w") as f:
            f.write(task.ModelEmaV3.__module__)
atexit.register(_report)
"""


def _dataset(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    for split in ("train", "validation"):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(8):
                pixels = (torch.rand(16, 16, 3, generator=g) * 255).byte().numpy()
                Image.fromarray(pixels).save(folder / f"{i}.png")


def _train(tmp: Path, name: str, swap: bool, epochs: int, resume: str = "") -> list[str]:
    classes = tmp / f"classes-{name}"
    classes.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp / "site"), str(ROOT)]),
        OMP_NUM_THREADS="1",
        DTENSOR_EMA_SWAP="1" if swap else "0",
        EMA_CLASS_DIR=str(classes),
    )
    args = (
        f"--data-dir {tmp / 'data'} --model test_resnet --num-classes 2 --img-size 16 "
        "--batch-size 4 --validation-batch-size 4 --model-ema --model-ema-decay 0.9 "
        "--workers 0 --no-prefetcher --opt sgd --lr 0.05 --sched step --warmup-epochs 0 "
        f"--no-aug --device cpu --seed 0 --output {tmp / 'out'} --experiment {name} "
        f"--epochs {epochs}"
    ).split()
    if resume:
        args += ["--resume", resume]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(FIXTURE), *args]
    done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "(EMA)" in done.stderr + done.stdout  # the EMA was validated
    return sorted(p.read_text() for p in classes.iterdir())


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
def test_timm_train_py_end_to_end(tmp_path: Path) -> None:
    _dataset(tmp_path / "data")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "out"
    real = _train(tmp_path, "real", swap=False, epochs=3)
    ours = _train(tmp_path, "ours", swap=True, epochs=2)
    resumed = _train(tmp_path, "resumed", True, 3, resume=str(out / "ours" / "last.pth.tar"))
    assert real == ["timm.utils.model_ema"] * 2
    assert ours == resumed == ["dtensor_ema.compat.timm"] * 2
    for epoch in (0, 1):
        name = f"checkpoint-{epoch}.pth.tar"
        assert _different(out / "ours" / name, out / "real" / name) == [], epoch
    assert _different(out / "resumed" / "last.pth.tar", out / "real" / "last.pth.tar") == []
