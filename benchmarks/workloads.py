"""What the benchmark runs: model shapes, the EMA implementations we compare against, and
the per-rank memory that the ``Shard(0)`` plan implies for any world size.

The baselines are used the way their projects document them, each on a full replica of the
model on every rank:

* timm ``ModelEmaV3(model)``: ``update(model)`` walks both state dicts and runs one
  ``torch._foreach_lerp_`` over all floating-point entries.
* ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(d),
  use_buffers=True)``: ``update_parameters(model)`` groups by device/dtype and runs
  ``torch._foreach_lerp_`` per group.
* yolov5/ultralytics ``ModelEMA``: a Python loop over the state dict doing
  ``v *= d; v += (1 - d) * msd[k]`` per tensor (written out below, it is not a package).

To fit the shared 24 GiB machine, the three baselines share ONE replica per rank (timm's
``module``): their update cost does not depend on which buffer they write, and every update
touches far more bytes than the 32 MiB L3 cache, so sharing changes no timing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DECAY = 0.9999


# --------------------------------------------------------------------------- models
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder (pre-norm, learned positions, tied ``lm_head``)."""

    def __init__(self, *, vocab: int, ctx: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    note: str


def _gpt(**shape: int) -> Callable[[], nn.Module]:
    return lambda: GPT(**shape)


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)()

    return build


def get_spec(name: str) -> ModelSpec:
    """A model by name: ``resnet50``, ``gpt2``, ``gpt1b-L<layers>``, and for
    ``--quick``: ``mobilenet_v3_small``, ``gpt-tiny``."""
    if name == "resnet50":
        return ModelSpec(name, _torchvision("resnet50"), "torchvision ResNet-50")
    if name == "mobilenet_v3_small":
        return ModelSpec(name, _torchvision(name), "torchvision MobileNetV3-small (quick mode)")
    if name == "gpt2":
        shape = {"vocab": 50257, "ctx": 1024, "dim": 768, "heads": 12, "layers": 12}
        return ModelSpec(name, _gpt(**shape), "GPT-2 small shape: d=768, 12 layers, tied")
    if name == "gpt-tiny":
        shape = {"vocab": 1000, "ctx": 64, "dim": 128, "heads": 4, "layers": 2}
        return ModelSpec(name, _gpt(**shape), "tiny GPT: d=128, 2 layers")
    match = re.fullmatch(r"gpt1b-L(\d+)", name)
    if match:
        layers = int(match.group(1))
        shape = {"vocab": 50257, "ctx": 2048, "dim": 2048, "heads": 16, "layers": layers}
        note = f"width of a 1B GPT (d=2048, ffn 8192; 18 layers = 1.01B params), {layers} layers"
        return ModelSpec(name, _gpt(**shape), note)
    raise ValueError(
        f"unknown model {name!r}; choose resnet50, gpt2, gpt1b-L<layers>, "
        "mobilenet_v3_small or gpt-tiny"
    )


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Identical weights on every rank (fixed seed), as DDP would have them."""
    torch.manual_seed(0)
    return spec.build().to(device=device, dtype=dtype)


# --------------------------------------------------------------------------- baselines
class YoloV5EMA:
    """ultralytics/yolov5 ``ModelEMA.update``, verbatim in effect (a per-tensor loop)."""

    def __init__(self, replica: nn.Module, decay: float = DECAY, tau: float = 2000) -> None:
        self.ema, self.decay, self.tau, self.updates = replica, decay, tau, 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def replicated_baselines(model: nn.Module, *, fp32_ema: bool) -> dict[str, Callable[[], object]]:
    """timm, AveragedModel and yolov5 EMAs of ``model``, sharing one full replica.

    ``fp32_ema``: the model is bf16 and the replica is kept in float32 (timm
    ``dtype=torch.float32``); AveragedModel cannot (it keeps the model's dtype), so it is left
    out in that case.
    """
    from timm.utils.model_ema import ModelEmaV3
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    timm_ema = ModelEmaV3(model, decay=DECAY, dtype=torch.float32 if fp32_ema else None)
    replica = timm_ema.module
    yolo = YoloV5EMA(replica)
    impls: dict[str, Callable[[], object]] = {
        "timm_v3": lambda: timm_ema.update(model),
        "yolov5_loop": lambda: yolo.update(model),
    }
    if not fp32_ema:
        # Built around an empty module so no second replica is ever allocated, then pointed
        # at the shared one; its first call copies, later calls lerp (warm-up runs the first).
        avg = AveragedModel(nn.Module(), multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
        avg.module = replica
        # Its step counter becomes a plain attribute (the same scalar add per call): assigning
        # a registered buffer (`self.n_averaged += 1`) goes through register_buffer and fires
        # torch's global registration hook, which dtensor_ema's update() watches; interleaved
        # with AveragedModel, every dtensor_ema update would take its re-check path (measured
        # separately as "dtensor_ema_replan").
        counter = avg._buffers.pop("n_averaged")
        object.__setattr__(avg, "n_averaged", counter)
        impls["swa_averaged"] = lambda: avg.update_parameters(model)
    return impls


# --------------------------------------------------------------------------- memory plan
def plan_bytes_per_rank(model: nn.Module, world_size: int) -> tuple[list[int], int]:
    """EMA bytes each rank would hold under ``Shard(0)`` (0-dim: replicated), and the total.

    Computed from state-dict shapes alone with :func:`dtensor_ema.chunk_range`, so it covers
    world sizes too large to spawn here. Tied tensors count once, integer buffers not at
    all, fp16/bf16 tensors as float32 (the default EMA dtype), like the library.
    """
    from dtensor_ema import chunk_range

    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    per_rank = [0] * world_size
    total = 0
    for t in unique.values():
        if not t.is_floating_point():
            continue
        size = 4 if t.dtype in (torch.float16, torch.bfloat16) else t.element_size()
        total += t.numel() * size
        if t.dim() == 0:
            for r in range(world_size):
                per_rank[r] += size
            continue
        row = math.prod(t.shape[1:])
        for r in range(world_size):
            per_rank[r] += chunk_range(t.shape[0], world_size, r)[1] * row * size
    return per_rank, total
