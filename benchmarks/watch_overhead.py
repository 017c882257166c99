"""Change-detection cost: ``update()`` with and without a module built elsewhere each step.

A loss module built inside the training step (``nn.CrossEntropyLoss()`` registers a buffer)
used to make the next ``update()`` walk the whole model's ``state_dict()``: a cost that does
not shrink with W. The plan now watches only the tracked modules, so both columns should
match. One thread, ResNet-50 (torchvision), medians of ``--reps`` interleaved calls:

* one process, no process group;
* rank 3 of W=8 simulated with the fake process group (this rank's real shards only).

    python benchmarks/watch_overhead.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dtensor_ema import ModelEMA


def _resnet50() -> nn.Module:
    from torchvision.models import resnet50

    return resnet50()


def _medians(ema: ModelEMA, reps: int) -> tuple[float, float, float]:
    """Median ms of plain updates and of updates after a loss module was built, and the
    number of model state-dict walks per such update (the cost this benchmark is about)."""
    import dtensor_ema.plan as plan_module

    walks = [0]
    real_walk = plan_module.model_tensors

    def counted(module: nn.Module) -> dict[str, torch.Tensor]:
        walks[0] += 1
        return real_walk(module)

    plain: list[float] = []
    with_loss: list[float] = []
    for _ in range(3):
        ema.update()
    for _ in range(reps):
        start = time.perf_counter()
        ema.update()
        plain.append(time.perf_counter() - start)
        nn.CrossEntropyLoss(weight=torch.ones(10))  # registers a buffer elsewhere
        plan_module.model_tensors = counted  # type: ignore[assignment]
        start = time.perf_counter()
        ema.update()
        with_loss.append(time.perf_counter() - start)
        plan_module.model_tensors = real_walk  # type: ignore[assignment]
    return statistics.median(plain) * 1e3, statistics.median(with_loss) * 1e3, walks[0] / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    ema = ModelEMA(_resnet50(), decay=0.999, tau=None)
    rows.append(("one process", *_medians(ema, args.reps)))
    del ema
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        ema = ModelEMA(_resnet50(), decay=0.999, tau=None)
        rows.append(("rank 3 of W=8 (fake process group)", *_medians(ema, args.reps)))
    finally:
        dist.destroy_process_group()
    print(
        "| setup | plain `update()` ms | after a loss module was built ms | overhead "
        "| state-dict walks per such update |"
    )
    print("|---|---|---|---|---|")
    for name, plain, loss, walks in rows:
        overhead = 100 * (loss / plain - 1)
        print(f"| {name} | {plain:.2f} | {loss:.2f} | {overhead:+.0f}% | {walks:.2f} |")


if __name__ == "__main__":
    main()
