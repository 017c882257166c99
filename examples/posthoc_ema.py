"""Post-hoc EMA (EDM2): train once, then pick the EMA length by sweeping sigma_rel.

    python examples/posthoc_ema.py --out-dir runs/phema

Trains a small MLP on an offline, seeded regression problem (no download) with noisy SGD, so
averaging the weights matters, while :class:`~dtensor_ema.PostHocEMA` tracks two
power-function EMAs (``sigma_rel`` 0.05 and 0.10) and snapshots them every
``--snapshot-every`` steps. Afterwards it reconstructs the EMA of every ``sigma_rel`` in the
sweep with :func:`~dtensor_ema.synthesize`, evaluates each on held-out data, prints the
validation loss per ``sigma_rel`` and, when matplotlib is installed, plots it: the curve
EDM2 uses to choose the EMA length. The two tracked lengths are evaluated directly too, as a
check that the synthesized ones line up with them.

The training half is the same under ``torchrun`` with DDP or FSDP2 (every rank writes its own
shards of each snapshot); this script stays in one process so it runs anywhere in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ema import PostHocEMA, synthesize

FEATURES = 32


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="runs/posthoc_ema", help="snapshots and the plot")
    parser.add_argument("--steps", type=int, default=2000, help="training steps")
    parser.add_argument("--snapshot-every", type=int, default=100, help="steps per snapshot")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per step")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--hidden", type=int, default=128, help="MLP width")
    parser.add_argument(
        "--sigma-rels",
        type=float,
        nargs="+",
        default=[0.01, 0.02, 0.03, 0.05, 0.07, 0.10, 0.13, 0.17, 0.21, 0.25],
        help="sigma_rel values to synthesize and evaluate",
    )
    parser.add_argument("--seed", type=int, default=0, help="data and initialization seed")
    return parser


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random teacher network plus label noise: offline and reproducible."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 64, generator=teacher) / FEATURES**0.5
    w2 = torch.randn(64, 1, generator=teacher) / 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.3 * torch.randn(n, 1, generator=g)
    return x, y


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.GELU(), nn.Linear(hidden, 1))


@torch.no_grad()
def evaluate(model: nn.Module, state: dict[str, torch.Tensor] | None, data) -> float:
    x, y = data
    if state is not None:
        model.load_state_dict(state)
    return float(F.mse_loss(model(x), y))


def main(argv: list[str] | None = None) -> dict[float, float]:
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    torch.manual_seed(args.seed)
    train_x, train_y = make_data(args.seed + 1, 20_000)
    val = make_data(args.seed + 2, 4_000)
    model = make_model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    ph = PostHocEMA(
        model,
        sigma_rels=(0.05, 0.10),
        snapshot_every=args.snapshot_every,
        snapshot_dir=out / "snapshots",
    )
    g = torch.Generator().manual_seed(args.seed + 3)
    for _step in range(args.steps):
        idx = torch.randint(0, train_x.shape[0], (args.batch_size,), generator=g)
        loss = F.mse_loss(model(train_x[idx]), train_y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ph.update(samples=args.batch_size)  # time in samples, as EDM2 counts images
    if args.steps % args.snapshot_every:
        ph.snapshot()

    raw = evaluate(model, None, val)
    print(f"trained {args.steps} steps; raw weights: validation loss {raw:.5f}")
    tracked = {}
    for sigma in ph.sigma_rels:
        with ph.profile(sigma).average_parameters():
            tracked[sigma] = evaluate(model, None, val)
    probe = make_model(args.hidden)
    losses: dict[float, float] = {}
    print(f"{'sigma_rel':>9}  {'val loss':>10}")
    for sigma, state in zip(
        args.sigma_rels, synthesize(out / "snapshots", args.sigma_rels), strict=True
    ):
        losses[sigma] = evaluate(probe, state, val)
        mark = "  (tracked)" if sigma in tracked else ""
        print(f"{sigma:>9.3f}  {losses[sigma]:>10.5f}{mark}")
    for sigma, loss in tracked.items():
        if sigma in losses:
            print(f"tracked sigma_rel={sigma}: online {loss:.6f}, synthesized {losses[sigma]:.6f}")
    best = min(losses, key=losses.__getitem__)
    print(f"best sigma_rel {best:g}: validation loss {losses[best]:.5f} (raw {raw:.5f})")
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(list(losses), list(losses.values()), "o-", label="synthesized post hoc")
        ax.plot(list(tracked), list(tracked.values()), "s", label="tracked online")
        ax.axhline(raw, color="gray", ls="--", lw=1, label="raw weights")
        ax.set(xlabel="sigma_rel (EMA length)", ylabel="validation MSE", title="post-hoc EMA sweep")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sigma_rel_sweep.png", dpi=120)
        print(f"saved plot {out / 'sigma_rel_sweep.png'}")
    return losses


if __name__ == "__main__":
    main()
