"""Small models for the tests, and the unsharded reference EMA the library must match.

The reference is written here, simply, and never imported from the library: plain
``lerp_`` on full tensors, with the decay formula spelled out.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn


def _torchvision_works() -> bool:
    # A torchvision wheel built for another torch fails at import ("operator
    # torchvision::nms does not exist"), e.g. beside a local CPU build of an older torch.
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


HAS_TORCHVISION = _torchvision_works()
"""Tests that need torchvision models skip (or leave them out) without it."""


def with_torchvision(names: list[str]) -> list[str]:
    """``names`` without the torchvision models (``resnet*``) when torchvision is unusable."""
    return names if HAS_TORCHVISION else [n for n in names if "resnet" not in n]


class EdgeModel(nn.Module):
    """Every shape that stresses Shard(0): a 0-dim parameter, dim 0 smaller than W (empty
    shards), odd sizes, a zero-size tensor, a frozen parameter, float and integer buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.scalar = nn.Parameter(torch.tensor(0.5))
        self.tiny = nn.Parameter(torch.randn(1, 4))
        self.pair = nn.Parameter(torch.randn(2, 3))
        self.odd = nn.Parameter(torch.randn(13, 7))
        self.vec = nn.Parameter(torch.randn(5))
        self.empty = nn.Parameter(torch.randn(0, 3))
        self.frozen = nn.Parameter(torch.randn(6, 2), requires_grad=False)
        self.conv = nn.Conv2d(3, 5, 3)
        self.register_buffer("float_buf", torch.randn(7))
        self.register_buffer("int_buf", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (B, 3, 8, 8) -> scalar loss touching every trainable parameter."""
        with torch.no_grad():
            self.float_buf.mul_(0.9).add_(x.mean().to(self.float_buf.dtype))
            self.int_buf.add_(1)
        y = self.conv(x).mean() * self.scalar
        y = y + (self.odd**2).mean() + self.tiny.sum() + self.pair.pow(2).sum()
        return y + self.vec.sum() + self.empty.sum() + (self.frozen * 0).sum()


class TinyTransformer(nn.Module):
    """A 2-layer pre-norm transformer LM with tied input/output embeddings."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: (B, seq) int64 -> logits (B, seq, vocab)."""
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(h)))


def make_model(name: str, seed: int = 0) -> nn.Module:
    """The same weights on every rank for a given seed."""
    torch.manual_seed(seed)
    if name == "edge":
        return EdgeModel()
    if name == "transformer":
        return TinyTransformer()
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    raise ValueError(f"unknown test model {name!r}")


def make_batch(
    name: str, step: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Identical data on every rank (seeded by step) so replicated tensors stay identical."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "edge":
        return torch.randn(2, 3, 8, 8, generator=g).to(dtype), None
    if name == "transformer":
        tokens = torch.randint(0, 50, (2, 8), generator=g)
        return tokens, torch.randint(0, 50, (2, 8), generator=g)
    x = torch.randn(2, 3, 32, 32, generator=g).to(dtype)
    return x, torch.randint(0, 10, (2,), generator=g)


GRAD_CLAMP = 0.1
"""Bound on every gradient element in the tests' training steps (see :func:`clamp_grads_`)."""


def clamp_grads_(model: nn.Module, bound: float = GRAD_CLAMP) -> None:
    """Clamp every gradient element to ``[-bound, bound]``, on the local tensors.

    ResNet-18 on a batch of 2 normalizes layer4 over 2 values per channel (1 x 1 maps), and
    plain SGD with momentum then diverges: BatchNorm ``running_var`` passed 1e7 within 4
    bf16 steps and the forward turned NaN at some torch thread counts. Clamped steps keep
    every model finite. Elementwise on ``to_local()``, so a sharded model (FSDP2, DDP)
    clamps exactly as its unsharded twin does, with no communication.
    """
    for p in model.parameters():
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.clamp_(-bound, bound)


def assert_finite(what: str, tensors: dict[str, torch.Tensor]) -> None:
    """Raise naming the first non-finite tensor: a NaN reference makes comparisons vacuous."""
    for k, v in tensors.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        if local.is_floating_point() and not torch.isfinite(local).all():
            raise AssertionError(f"{what}: {k} is not finite (training diverged?)")


def train_step(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One clamped SGD step on :func:`make_batch`'s data; raises if the loss is not finite."""
    x, y = make_batch(name, step, dtype=next(model.parameters()).dtype)
    out = model(x)
    if name == "edge":
        loss = out
    elif name == "transformer":
        assert y is not None
        loss = nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    else:
        assert y is not None
        loss = nn.functional.cross_entropy(out.float(), y)
    if not torch.isfinite(loss.detach()).all():
        raise AssertionError(f"{name} step {step}: loss {loss.item()} is not finite")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    clamp_grads_(model)
    optimizer.step()


class ReferenceEMA:
    """Unsharded EMA: ``ema.lerp_(p.to(ema.dtype), 1 - d)`` on full tensors.

    ``d = decay * (1 - exp(-updates / tau))`` (``tau`` falsy: ``d = decay``). Float32 for
    fp16/bf16 model tensors. Tied tensors are averaged once per key, like the library.
    """

    def __init__(self, state: dict[str, torch.Tensor], decay: float, tau: float | None) -> None:
        self.decay, self.tau, self.updates = decay, tau, 0
        self.ema = {
            k: v.detach().to(_ema_dtype(v.dtype)).clone()
            for k, v in state.items()
            if v.is_floating_point()
        }

    def update(self, state: dict[str, torch.Tensor]) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau)) if self.tau else self.decay
        for k, v in state.items():
            if k in self.ema:
                self.ema[k].lerp_(v.detach().to(self.ema[k].dtype), 1 - d)
        assert_finite(f"reference EMA after update {self.updates}", self.ema)


def _ema_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def error_text(fn: Callable[[], object]) -> str | None:
    """``"<type>: <message>"`` of what ``fn()`` raised, ``None`` if it returned."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def mismatches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit, dtype or shape (missing keys included)."""
    bad = [k for k in expected if k not in actual]
    bad += [k for k in actual if k not in expected]
    for k in expected:
        if k in actual:
            a, e = actual[k], expected[k]
            if a.dtype != e.dtype or a.shape != e.shape or not torch.equal(a.cpu(), e.cpu()):
                bad.append(k)
    return bad


LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
"""peft LoRA target modules of the tiny transformers models below."""


def transformers_base(family: str) -> nn.Module:
    """A tiny transformers ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (vocabulary 96), the
    same weights for a given family; dropout off."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config: object = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=96, n_positions=16,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(*, vocab: int, seq: int, width: int, heads: int) -> nn.Module:
    """A one-block transformers ``GPT2LMHeadModel`` built from a config (nothing downloaded):
    tied embeddings, dropout off, the same weights for the same sizes (seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=1, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def hf_training_args(out: object, *, max_steps: int, every: int, **kw: object) -> object:
    """``TrainingArguments`` of the Hugging Face ``Trainer`` tests: batches of 4, a constant
    learning rate of 0.05, evaluation, checkpoint and log every ``every`` steps, seed 3, no
    reporting or progress bars; ``kw`` overrides or adds (``use_cpu=True``,
    ``deepspeed=...``)."""
    import transformers

    args: dict[str, object] = dict(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, learning_rate=0.05, lr_scheduler_type="constant",
        eval_strategy="steps", eval_steps=every, save_strategy="steps", save_steps=every,
        logging_steps=every, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        seed=3,
    )  # fmt: skip
    args.update(kw)
    return transformers.TrainingArguments(**args)  # type: ignore[arg-type]


class TokenRows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` random rows of ``seq`` tokens below ``vocab`` (from ``seed``), each row its own
    label: a causal-LM dataset for the Hugging Face ``Trainer`` tests."""

    def __init__(self, n: int, *, vocab: int, seq: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def peft_lora(family: str) -> nn.Module:
    """``peft.get_peft_model`` LoRA (r=4, random init so the adapters matter) on
    :func:`transformers_base`: the base frozen, the adapters trainable."""
    import warnings

    import peft

    config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS[family], init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: fan_in_fan_out set by peft
        return peft.get_peft_model(transformers_base(family), config)


def qlora_model(adapters: bool = True) -> nn.Module:
    """QLoRA: a block whose two linear weights are torchao ``NF4Tensor`` parameters (frozen;
    256 x 128 elements: ``to_nf4``'s 64 x 256 blocks, twice, so FSDP2 can shard them over
    two ranks), with peft LoRA adapters (r=4, random init) on both unless ``adapters`` is
    false. Seeded."""
    import peft
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    torch.manual_seed(0)
    base = nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256, bias=False), nn.GELU())
    base.append(nn.Linear(256, 128, bias=False))
    for linear in (base[1], base[3]):
        linear.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
    if not adapters:
        return base
    config = peft.LoraConfig(r=4, target_modules=["1", "3"], init_lora_weights=False)
    return peft.get_peft_model(base, config)


def tiny_unet() -> nn.Module:
    """A diffusers ``UNet2DModel`` of 8x8 one-channel images, two down and two up blocks
    (GroupNorm of 4 groups), seeded: the same weights on every call and rank."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )


@torch.no_grad()
def perturb_trainable_(model: nn.Module, step: int) -> None:
    """Step ``step`` of a trajectory: each trainable parameter gets a delta seeded by the
    step and its name (the same at any W and in any process)."""
    for fqn, p in model.named_parameters():
        if p.requires_grad:
            g = torch.Generator().manual_seed(step * 1_000_003 + zlib.crc32(fqn.encode()))
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def reader_model() -> nn.Module:
    """The small model whose checkpoints and snapshots the reader tests craft (issues 35 and
    42): two linear layers around a BatchNorm (an integer buffer), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
