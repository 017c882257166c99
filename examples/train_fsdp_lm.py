"""Train a small transformer language model with FSDP2 (``fully_shard``) and an fp32 EMA.

FSDP2 already shards every parameter (a ``DTensor``, ``Shard(0)`` on its mesh). The EMA
mirrors each parameter's mesh and placements, so each rank averages exactly the shard it
owns: ``update()`` is local, and evaluating the EMA weights needs **no gather** of the EMA:
``ema.average_parameters()`` copies the EMA shards into the parameter shards, FSDP's own
all-gather in the next forward does the rest, and the raw shards come back on exit.

    torchrun --standalone --nproc_per_node=2 examples/train_fsdp_lm.py
    torchrun --standalone --nproc_per_node=2 examples/train_fsdp_lm.py --param-dtype float32

Parameters are stored in bfloat16 by default (``model.to(torch.bfloat16)`` before
``fully_shard``); the EMA is float32 regardless (dtensor_ema's default for bf16/fp16
tensors: a bf16 EMA with decay 0.999 would round most updates away). With
``--param-dtype float32`` the parameters stay fp32 and FSDP2 computes in bf16 through
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.

The data is generated offline: token sequences from a random second-order Markov chain
(each pair of previous tokens allows a few likely next tokens, plus uniform noise). The
script prints the chain's true conditional entropy, the lowest loss any model can reach,
next to the raw and EMA validation losses.

Runs on CPU with gloo (torch >= 2.7) or on CUDA with NCCL; needs torchrun (FSDP2 needs a
process group, even with one rank). ``tqdm`` (optional) draws a progress bar on rank 0,
``matplotlib`` (optional) saves a PNG of both loss curves.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dtensor_ema import ModelEMA


# ---------------------------------------------------------------------------- data
class MarkovSource:
    """A random second-order Markov chain over ``vocab`` tokens.

    For every context ``(a, b)`` the next token is one of ``branching`` tokens drawn at
    random (probabilities from a Dirichlet), mixed with ``noise`` of uniform probability.
    """

    def __init__(
        self, vocab: int, branching: int, noise: float, generator: torch.Generator
    ) -> None:
        self.vocab = vocab
        logits = torch.full((vocab * vocab, vocab), -float("inf"))
        order = torch.rand(vocab * vocab, vocab, generator=generator).argsort(dim=1)
        choices = order[:, :branching]
        # Exponential draws, normalized by the softmax below: Dirichlet(1) probabilities.
        exponential = -torch.log(torch.rand(vocab * vocab, branching, generator=generator))
        logits.scatter_(1, choices, torch.log(exponential))
        self.probs = (1 - noise) * logits.softmax(dim=1) + noise / vocab

    def sample(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens (int64)."""
        tokens = torch.empty(n, length, dtype=torch.long)
        tokens[:, :2] = torch.randint(0, self.vocab, (n, 2), generator=generator)
        for t in range(2, length):
            context = tokens[:, t - 2] * self.vocab + tokens[:, t - 1]
            tokens[:, t] = torch.multinomial(self.probs[context], 1, generator=generator)[:, 0]
        return tokens

    def entropy(self, tokens: torch.Tensor) -> float:
        """Mean true negative log-likelihood (nats) of the predictable tokens in ``tokens``."""
        context = tokens[:, :-2] * self.vocab + tokens[:, 1:-1]
        p = self.probs[context.reshape(-1), tokens[:, 2:].reshape(-1)]
        return float(-p.log().mean())


# ---------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"--dim ({dim}) must be divisible by --heads ({heads})")
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------- helpers
def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (fp32) on the tokens a 2nd-order chain makes predictable."""
    return F.cross_entropy(
        logits[:, 1:-1].float().reshape(-1, logits.shape[-1]), tokens[:, 2:].reshape(-1)
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, tokens: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """(mean loss, next-token accuracy %) over every rank's validation shard. Collective:
    FSDP2 all-gathers in each forward, so every rank runs the same number of batches."""
    model.eval()
    loss_sum = correct = count = 0.0
    for i in range(0, tokens.shape[0], batch_size):
        batch = tokens[i : i + batch_size].to(device)
        logits = model(batch)[:, 1:-1].float()
        target = batch[:, 2:]
        loss_sum += F.cross_entropy(logits.transpose(1, 2), target, reduction="sum").item()
        correct += (logits.argmax(-1) == target).sum().item()
        count += target.numel()
    model.train()
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return float(totals[0] / totals[2]), float(100 * totals[1] / totals[2])


def save_plot(path: str, history: list[dict[str, float]], floor: float, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [row["step"] for row in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [row["raw_loss"] for row in history], "o-", label="raw weights")
    ax.plot(steps, [row["ema_loss"] for row in history], "s-", label="EMA weights")
    ax.axhline(floor, color="gray", ls="--", label="true entropy (best possible)")
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Launch with torchrun --standalone --nproc_per_node=N. Defaults finish in a "
        "couple of minutes on 2 CPU cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    data = p.add_argument_group("data (synthetic, generated offline)")
    data.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    data.add_argument("--context", type=int, default=64, help="tokens per training sequence")
    data.add_argument(
        "--branching", type=int, default=4, help="likely next tokens per two-token context"
    )
    data.add_argument(
        "--token-noise",
        type=float,
        default=0.1,
        help="probability mass spread uniformly over the vocabulary at every step",
    )
    data.add_argument(
        "--val-sequences",
        type=int,
        default=256,
        help="validation sequences (rounded down to a multiple of the world size)",
    )

    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=128, help="model width")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="bfloat16: parameters stored in bf16; float32: fp32 parameters, bf16 compute "
        "via MixedPrecisionPolicy. The EMA is float32 either way.",
    )

    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=400, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    train.add_argument(
        "--lr",
        type=float,
        default=1e-2,
        help="constant AdamW learning rate (high on purpose: noisy raw weights)",
    )
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    train.add_argument("--seed", type=int, default=0, help="seed for data and initialization")

    ema = p.add_argument_group("EMA")
    ema.add_argument("--ema-decay", type=float, default=0.98, help="asymptotic EMA decay")
    ema.add_argument(
        "--ema-tau",
        type=float,
        default=30.0,
        help="warm-up time constant in steps: decay * (1 - exp(-updates / tau)); 0 = constant",
    )
    ema.add_argument(
        "--eval-every", type=int, default=50, help="evaluate raw and EMA weights every N steps"
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (NCCL) when available, else CPU (gloo)",
    )
    out.add_argument(
        "--plot",
        default="ema_vs_raw_lm.png",
        help="PNG of both loss curves, written by rank 0 when matplotlib is installed ('' to skip)",
    )
    out.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in (
        "vocab",
        "context",
        "branching",
        "dim",
        "layers",
        "heads",
        "steps",
        "batch_size",
        "eval_every",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context < 3:
        p.error(f"--context must be >= 3 (two tokens of context plus a target), got {args.context}")
    if not 1 <= args.branching <= args.vocab:
        p.error(f"--branching must be in [1, --vocab={args.vocab}], got {args.branching}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit(
            "FSDP2 needs a process group: launch with\n"
            f"  torchrun --standalone --nproc_per_node=2 {sys.argv[0]}"
        )
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        run(args, device)
    finally:
        # DDP/FSDP modules sit in reference cycles (hooks) that still hold the process
        # group; free them now, not during interpreter shutdown, where gloo's threads
        # can abort the process ('terminate called without an active exception').
        gc.collect()
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    main_rank = rank == 0
    # Every rank builds the same chain, validation set and initial weights from the seed.
    generator = torch.Generator().manual_seed(args.seed)
    source = MarkovSource(args.vocab, args.branching, args.token_noise, generator)
    n_val = args.val_sequences - args.val_sequences % world
    if n_val == 0:
        raise SystemExit(f"--val-sequences ({args.val_sequences}) must be >= world size {world}")
    val = source.sample(n_val, args.context, generator)
    floor = source.entropy(val)
    val_shard = val[rank::world]  # equal shards: FSDP2 forwards must match across ranks

    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.context).to(device)
    mesh = init_device_mesh(device.type, (world,))
    if args.param_dtype == "bfloat16":
        model.to(torch.bfloat16)
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    # Each EMA tensor mirrors its parameter's mesh and placements (float32 for bf16 ones).
    ema = ModelEMA(model, decay=args.ema_decay, tau=args.ema_tau or None)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )

    if main_rank:
        n_params = sum(p.numel() for p in model.parameters())
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in ema.ema_tensors().values()})
        param_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())
        print(
            f"Markov chain: vocab {args.vocab}, {args.branching} likely successors per "
            f"context, noise {args.token_noise}; true entropy {floor:.4f} nats/token\n"
            f"TinyLM: {args.layers} blocks, dim {args.dim}, {n_params / 1e6:.2f}M parameters "
            f"({args.param_dtype}), fully_shard over {world} x {device.type} "
            f"({dist.get_backend()})\n"
            f"EMA ({'/'.join(dtypes)}): rank 0 holds {ema.local_nbytes() / 1024:.0f} KiB, "
            f"next to {param_bytes / 1024:.0f} KiB of parameter shards",
            flush=True,
        )
        header = (
            f"{'step':>5} | {'train loss':>10} | {'raw val loss':>12} | {'EMA val loss':>12} | "
            f"{'raw acc':>7} | {'EMA acc':>7} | {'time s':>6}"
        )
        _say(header)
        _say("-" * len(header))

    bar = _progress(args.steps, enabled=main_rank and not args.no_progress)
    history: list[dict[str, float]] = []
    train_losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        # The same global batch on every rank from a per-step seed; each rank takes its rows.
        step_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        batch = source.sample(args.batch_size * world, args.context, step_gen)
        tokens = batch[rank * args.batch_size : (rank + 1) * args.batch_size].to(device)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update()  # local: the EMA of this rank's parameter shards only
        train_losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")

        if step % args.eval_every == 0 or step == args.steps:
            raw_loss, raw_acc = evaluate(model, val_shard, args.batch_size, device)
            with ema.average_parameters() as ema_model:  # FSDP2: swaps shards, no gather
                ema_loss, ema_acc = evaluate(ema_model, val_shard, args.batch_size, device)
            mean_train = sum(train_losses) / len(train_losses)
            train_losses.clear()
            row = {
                "step": step,
                "train_loss": mean_train,
                "raw_loss": raw_loss,
                "ema_loss": ema_loss,
                "raw_acc": raw_acc,
                "ema_acc": ema_acc,
                "time": time.perf_counter() - start,
            }
            history.append(row)
            if main_rank:
                _say(
                    f"{step:>5} | {mean_train:>10.4f} | {raw_loss:>12.4f} | {ema_loss:>12.4f} | "
                    f"{raw_acc:>6.2f}% | {ema_acc:>6.2f}% | {row['time']:>6.1f}"
                )
    if bar is not None:
        bar.close()

    if main_rank:
        last = history[-1]
        print(
            f"final: raw val loss {last['raw_loss']:.4f}  EMA val loss {last['ema_loss']:.4f}  "
            f"(true entropy {floor:.4f}); raw acc {last['raw_acc']:.2f}%  EMA acc "
            f"{last['ema_acc']:.2f}%; EMA updates: {ema.updates}",
            flush=True,
        )
        if args.plot and save_plot(args.plot, history, floor, f"TinyLM + FSDP2, W={world}"):
            print(f"plot: {args.plot}", flush=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _progress(total: int, *, enabled: bool):  # type: ignore[no-untyped-def]
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="train", leave=False, dynamic_ncols=True)


def _say(msg: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(msg)
    except ImportError:
        print(msg, flush=True)


if __name__ == "__main__":
    main()
