"""Command line for post-hoc EMA snapshots (one process, no process group)::

    python -m dtensor_ema.posthoc list run/phema
    python -m dtensor_ema.posthoc synthesize run/phema --sigma-rel 0.05 0.08 0.12 --out phema/
    python -m dtensor_ema.posthoc merge run/phema --last 4 --out merged.safetensors
    python -m dtensor_ema.posthoc merge run/phema --weights 4096=0.25 8192=0.75 --out m.pt

``synthesize`` prints each ``sigma_rel``'s weights and profile fit error, writes the outputs,
shows a progress bar when tqdm is installed, and, when matplotlib is installed, saves a plot
of the reconstructed profiles and the weights (``--plot PATH``; default next to ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dtensor_ema.checkpoint.reader import CheckpointError
from dtensor_ema.posthoc.phema_math import profile_density, sigma_rel_to_gamma
from dtensor_ema.posthoc.snapshots import list_snapshots
from dtensor_ema.posthoc.synthesis import (
    Term,
    merge_snapshots,
    merge_terms,
    plan_synthesis,
    synthesize,
)

__all__ = ["main"]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dtensor_ema.posthoc",
        description="Post-hoc EMA (EDM2): list snapshots, synthesize any sigma_rel, merge.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list the snapshots and their profiles")
    ls.add_argument("snapshot_dir")

    syn = sub.add_parser("synthesize", help="reconstruct the EMA of given sigma_rel values")
    syn.add_argument("snapshot_dir")
    syn.add_argument("--sigma-rel", type=float, nargs="+", required=True)
    syn.add_argument("--out", help="a .safetensors/.pt file (one sigma_rel) or a directory")
    syn.add_argument("--format", choices=("safetensors", "pt", "dcp"))
    syn.add_argument("--step", type=int, help="reconstruct at this snapshot's step")
    syn.add_argument("--dtype", choices=sorted(_DTYPES))
    syn.add_argument("--plot", help="where to save the profile plot (needs matplotlib)")
    syn.add_argument("--no-progress", action="store_true")

    merge = sub.add_parser("merge", help="average snapshots with explicit weights")
    merge.add_argument("snapshot_dir")
    how = merge.add_mutually_exclusive_group(required=True)
    how.add_argument("--last", type=int, help="uniform average of the last K snapshots")
    how.add_argument("--weights", nargs="+", metavar="STEP=W", help="explicit weights per step")
    merge.add_argument("--sigma-rel", type=float, help="tracked profile to average")
    merge.add_argument("--out", required=True)
    merge.add_argument("--format", choices=("safetensors", "pt", "dcp"))
    merge.add_argument("--dtype", choices=sorted(_DTYPES))
    merge.add_argument("--plot", help="where to save the weights plot (needs matplotlib)")
    merge.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status. Every error prints exactly one line,
    ``error: <file>: <what is wrong>``, and exits with status 2: bad arguments, missing or
    mismatched snapshots, a malformed or altered manifest, a snapshot refused as unsafe,
    oversized or corrupted (the readers' documented exceptions: ``SnapshotError``,
    ``CheckpointError``, ``ChecksumError``, ``ValueError``, ``OSError``)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            _list(args)
        elif args.command == "synthesize":
            _synthesize(args)
        else:
            _merge(args)
    except (OSError, ValueError, ImportError, CheckpointError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(error: BaseException) -> str:
    """The message on one line (an ``OSError`` names its file: ``<file>: <reason>``)."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    else:
        text = str(error)
    return " ".join(text.split())


def _list(args: argparse.Namespace) -> None:
    for s in list_snapshots(args.snapshot_dir):
        profiles = ", ".join(f"{p['sigma_rel']:g}" for p in s.profiles)
        dtypes = sorted({v["dtype"] for v in s.tensors.values()})
        untracked = f" ({len(s.untracked)} untracked)" if s.untracked else ""
        print(
            f"{s.path.name}  t={s.t:g} ({s.manifest['time']})  sigma_rel=[{profiles}]  "
            f"{len(s.tensors)} tensors{untracked}  {', '.join(dtypes)}"
        )


def _synthesize(args: argparse.Namespace) -> None:
    plans = []
    for sigma in args.sigma_rel:
        terms, error = plan_synthesis(args.snapshot_dir, sigma, step=args.step)
        plans.append((sigma, terms, error))
        top = sorted(terms, key=lambda t: -abs(t.weight))[:4]
        shown = ", ".join(f"{t.step}/{t.sigma_rel:g}: {t.weight:+.4f}" for t in top)
        print(
            f"sigma_rel={sigma:g}: {len(terms)} terms, profile fit error {error:.2e}; "
            f"largest weights (step/profile) {shown}"
        )
    result = synthesize(
        args.snapshot_dir,
        args.sigma_rel,
        out=args.out,
        format=args.format,
        step=args.step,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        progress=not args.no_progress,
    )
    if args.out is not None:
        for path in result:
            print(f"wrote {path}")
    else:
        print("no --out given: nothing written")
    _note_untracked(plans[0][1][-1].snapshot.untracked)
    plot = args.plot or _default_plot(args.out, "profiles")
    if plot is not None:
        _plot_profiles(plans, Path(plot))


def _merge(args: argparse.Namespace) -> None:
    weights = None
    if args.weights is not None:
        weights = {}
        for item in args.weights:
            step, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--weights items look like STEP=WEIGHT, got {item!r}")
            weights[int(step)] = float(value)
    path = merge_snapshots(
        args.snapshot_dir,
        last=args.last,
        weights=weights,
        sigma_rel=args.sigma_rel,
        out=args.out,
        format=args.format,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        progress=not args.no_progress,
    )
    print(f"wrote {path}")
    _note_untracked(list_snapshots(args.snapshot_dir)[-1].untracked)
    plot = args.plot or _default_plot(args.out, "weights")
    if plot is not None:
        terms = merge_terms(
            args.snapshot_dir, last=args.last, weights=weights, sigma_rel=args.sigma_rel
        )
        _plot_weights(terms, Path(plot))


def _note_untracked(untracked: list[str]) -> None:
    if untracked:
        print(
            f"the snapshots track part of the model: {len(untracked)} untracked tensors (e.g. "
            f"{untracked[:3]}) are not in the output; load it with strict=False"
        )


def _default_plot(out: str | None, what: str) -> str | None:
    if out is None or importlib.util.find_spec("matplotlib") is None:
        return None
    path = Path(out)
    stem = path.stem if path.suffix else path.name
    return str(path.with_name(f"{stem}_{what}.png"))


def _pyplot():  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_profiles(plans: list[tuple[float, list[Term], float]], path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for sigma, terms, error in plans:
        t_end = terms[-1].t
        tau = torch.linspace(0, t_end, 512, dtype=torch.float64)
        target = profile_density(t_end, sigma_rel_to_gamma(sigma), tau)
        recon = sum(
            (t.weight * profile_density(t.t, t.gamma, tau) for t in terms),
            start=torch.zeros_like(tau),
        )
        (line,) = left.plot(tau.numpy(), target.numpy(), "--", lw=1)
        left.plot(
            tau.numpy(),
            recon.numpy(),
            color=line.get_color(),
            label=f"sigma_rel={sigma:g} (fit error {error:.1e})",
        )
        for key in sorted({t.sigma_rel for t in terms}):
            chosen = [t for t in terms if t.sigma_rel == key]
            right.plot(
                [t.t for t in chosen],
                [t.weight for t in chosen],
                ".-",
                color=line.get_color(),
                alpha=0.4 + 0.6 * (key == max(t.sigma_rel for t in terms)),
            )
    left.set(
        xlabel="training time",
        ylabel="weight density",
        title="target (dashed) and reconstructed EMA profiles",
    )
    left.legend(fontsize=8)
    right.set(xlabel="snapshot time", ylabel="weight", title="least-squares weights")
    right.axhline(0, color="k", lw=0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved plot {path}")


def _plot_weights(terms: list[Term], path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([str(t.step) for t in terms], [t.weight for t in terms])
    ax.set(
        xlabel="snapshot step",
        ylabel="weight",
        title=f"merge of profile sigma_rel={terms[0].sigma_rel:g}",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved plot {path}")
