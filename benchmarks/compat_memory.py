"""Per-rank EMA bytes of each drop-in (:mod:`dtensor_ema.compat`) against the original.

    python benchmarks/compat_memory.py                   # ResNet-50, W = 2, 4
    python benchmarks/compat_memory.py --model unet --world-sizes 2,4,8

One process acts as rank 0 of W ranks (torch's fake process group: collectives move no
data). Rank 0 holds the most (shards follow ``torch.chunk``: the first chunks are full).
The original's bytes are those of the EMA copy it keeps on every rank, measured on the real
object: timm's ``ModelEmaV3.module``, ultralytics' ``ModelEMA.ema`` and ema-pytorch's
``ema_model`` (deepcopies: parameters and all buffers; ``PostHocEMA``: one per profile, two
here), torch's ``AveragedModel.module`` (likewise; Lightning's ``EMAWeightAveraging`` keeps
one), diffusers'
``shadow_params`` (parameters only). The drop-in's bytes are
``ModelEMA.local_nbytes()`` of the engine underneath (Lightning's drop-in holds the same
``AveragedModel`` drop-in). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50()
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=32, block_out_channels=(64, 128, 256, 256))


def original_bytes(lib: str, model: nn.Module) -> int:
    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    if lib == "timm":
        from timm.utils import ModelEmaV3

        return nbytes(ModelEmaV3(model).module.state_dict().values())
    if lib == "ultralytics":
        from ultralytics.utils.torch_utils import ModelEMA

        return nbytes(ModelEMA(model).ema.state_dict().values())
    if lib == "ema_pytorch":
        import ema_pytorch

        return nbytes(ema_pytorch.EMA(model).ema_model.state_dict().values())
    if lib == "ema_pytorch PostHocEMA":
        import tempfile

        import ema_pytorch

        with tempfile.TemporaryDirectory() as folder:
            ph = ema_pytorch.PostHocEMA(model, sigma_rels=(0.05, 0.28), checkpoint_folder=folder)
            return sum(nbytes(m.ema_model.state_dict().values()) for m in ph.ema_models)
    if lib == "swa_utils / lightning":
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
        return nbytes(avg.module.state_dict().values())
    from diffusers.training_utils import EMAModel

    return nbytes(EMAModel(model.parameters()).shadow_params)


def ours_bytes(lib: str, model: nn.Module) -> int:
    if lib == "timm":
        from dtensor_ema.compat.timm import ModelEmaV3

        return ModelEmaV3(model).engine.local_nbytes()
    if lib == "ultralytics":
        from dtensor_ema.compat.ultralytics import ModelEMA

        return ModelEMA(model).engine.local_nbytes()
    if lib == "ema_pytorch":
        from dtensor_ema.compat.ema_pytorch import EMA

        return EMA(model).engine.local_nbytes()
    if lib == "ema_pytorch PostHocEMA":
        import tempfile

        from dtensor_ema.compat.ema_pytorch import PostHocEMA

        with tempfile.TemporaryDirectory() as folder:
            ph = PostHocEMA(model, sigma_rels=(0.05, 0.28), checkpoint_folder=folder)
            return sum(m.engine.local_nbytes() for m in ph.ema_models)
    if lib == "swa_utils / lightning":
        from dtensor_ema.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn

        avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
        return avg.engine.local_nbytes()
    from dtensor_ema.compat.diffusers import EMAModel

    return EMAModel(model.parameters()).engine.local_nbytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "unet"])
    parser.add_argument("--world-sizes", default="2,4")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = build(args.model)
    libs = ["timm", "ultralytics", "ema_pytorch", "ema_pytorch PostHocEMA"]
    libs += ["swa_utils / lightning", "diffusers"]
    original = {lib: original_bytes(lib, model) for lib in libs}
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            for lib in libs:
                ours = ours_bytes(lib, model)
                rows.append((lib, world, original[lib], ours))
        finally:
            dist.destroy_process_group()
    mib = 2**20
    print(f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")
    print("| library | W | original per rank (MiB) | drop-in per rank (MiB) | ratio |")
    print("|---|---|---|---|---|")
    for lib, world, orig, ours in rows:
        print(f"| {lib} | {world} | {orig / mib:.1f} | {ours / mib:.1f} | {ours / orig:.3f} |")


if __name__ == "__main__":
    main()
