"""Save a sharded EMA with DCP at one world size, resume it at another, export it, load it.

``torchrun`` launches one world size per invocation, so the script runs in three phases
that share ``--ckpt-dir``:

    torchrun --standalone --nproc_per_node=4 examples/resume_reshard.py --phase train
    torchrun --standalone --nproc_per_node=2 examples/resume_reshard.py --phase resume
    python examples/resume_reshard.py --phase load

``train`` (any W) trains ``--steps`` steps, saves ``{"ema": ema, "train": model+optimizer,
"meta": ...}`` with ``torch.distributed.checkpoint`` (each rank writes only its shards),
then trains on to ``--total-steps`` without stopping and keeps that uninterrupted EMA as a
reference. ``resume`` (another W) loads the checkpoint (DCP reshards the EMA, the model and
the optimizer to the new world size), checks that the EMA came back unchanged (update
counter, fingerprint of every value), trains to ``--total-steps`` and compares its EMA with
the uninterrupted run; then it saves a final checkpoint and exports the full EMA weights to
one ``torch.save`` file with ``export_ema``. ``load`` runs in a plain process (no torchrun,
no process group): it loads the exported file into a fresh model with
``load_state_dict(strict=True)``, checks it bit for bit against the final DCP checkpoint
read straight into a ``ModelEMA``, and evaluates it.

Every step draws the same global batch (``--batch-size`` rows, from a per-step seed) and
each rank trains on its slice, so runs at different world sizes see the same data.
``--fsdp`` shards the model with FSDP2 (``fully_shard``) instead of replicating it with DDP;
the EMA then mirrors FSDP2's shards, and DCP reshards those too. CPU/gloo only (the model
is tiny).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from dtensor_ema import ModelEMA, export_ema

FEATURES, CLASSES = 20, 10


def make_model(hidden: int) -> nn.Sequential:
    # Odd widths give uneven Shard(0) pieces (and empty ones at large W).
    return nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.GELU(),
        nn.Linear(hidden, 37),
        nn.GELU(),
        nn.Linear(37, CLASSES),
    )


class Task:
    """Gaussian class clusters in ``FEATURES`` dimensions; batches drawn per step."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.means = 1.5 * torch.randn(CLASSES, FEATURES, generator=g)
        self.seed = seed

    def batch(self, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same ``n`` rows on every rank and at every world size for a given ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        labels = torch.randint(0, CLASSES, (n,), generator=g)
        return self.means[labels] + 2.0 * torch.randn(n, FEATURES, generator=g), labels


class TrainState(Stateful):
    """Model and optimizer as one DCP ``Stateful``, keyed by fqn (any wrapper, any W)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def fingerprint(full: dict[str, torch.Tensor]) -> str:
    """Order-independent digest of full tensors: equal values give equal strings."""
    total = sum(float(t.double().abs().sum()) for t in full.values())
    return f"{len(full)} tensors, sum|x| = {total:.12e}"


def full_ema(ema: ModelEMA, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full EMA weights on CPU (on every rank, or rank 0 only). Collective.

    Every rank gets them by default so that every rank computes the same fingerprint and
    takes the same branch; a large model would export with ``only_rank0_receives=True``.
    """
    return ema.get_ema_state_dict(only_rank0_receives=rank0_only, cpu_offload=True)


# ---------------------------------------------------------------------------- phases
def setup(args: argparse.Namespace) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, ModelEMA]:
    """Model (raw and wrapped), optimizer and EMA on every rank, identical from the seed."""
    torch.manual_seed(args.seed)
    model = make_model(args.hidden)
    world = dist.get_world_size()
    if args.fsdp:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: nn.Module = model
    else:
        wrapped = DDP(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, weight_decay=0.01)
    ema = ModelEMA(wrapped, decay=args.ema_decay, tau=args.ema_tau or None)
    return model, wrapped, optimizer, ema


def train_steps(
    args: argparse.Namespace,
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: ModelEMA,
    task: Task,
    first: int,
    last: int,
) -> None:
    """Steps ``first..last`` inclusive; ``ema.update()`` after each optimizer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = args.batch_size // world
    for step in range(first, last + 1):
        x, y = task.batch(args.batch_size, step)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        loss = F.cross_entropy(wrapped(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ema.update()


def phase_train(args: argparse.Namespace, ckpt: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _, wrapped, optimizer, ema = setup(args)
    task = Task(args.seed)
    train_steps(args, wrapped, optimizer, ema, task, 1, args.steps)

    saved = full_ema(ema)
    meta = {"step": args.steps, "world_size": world, "fingerprint": fingerprint(saved)}
    path = ckpt / f"step_{args.steps}"
    dcp.save(
        {"ema": ema, "train": TrainState(wrapped, optimizer), "meta": meta}, checkpoint_id=path
    )
    _log(
        f"[train W={world}] saved step {args.steps} to {path}: EMA updates={ema.updates}, "
        f"{meta['fingerprint']}; rank 0 holds {ema.local_numel()} of "
        f"{sum(t.numel() for t in ema.ema_tensors().values())} EMA values"
    )

    # The uninterrupted run, for the resumed one to compare against.
    train_steps(args, wrapped, optimizer, ema, task, args.steps + 1, args.total_steps)
    reference = full_ema(ema, rank0_only=True)
    if rank == 0:
        torch.save(reference, ckpt / "reference_ema.pt")
        (ckpt / "reference.json").write_text(
            json.dumps({"updates": ema.updates, "world_size": world})
        )
    _log(f"[train W={world}] uninterrupted to step {args.total_steps}: EMA updates={ema.updates}")


def phase_resume(args: argparse.Namespace, ckpt: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _, wrapped, optimizer, ema = setup(args)
    path = ckpt / f"step_{args.steps}"
    if not path.exists():
        raise SystemExit(f"no checkpoint at {path}: run --phase train first (same --ckpt-dir)")
    meta: dict[str, Any] = {"step": 0, "world_size": 0, "fingerprint": ""}
    state: dict[str, Any] = {"ema": ema, "train": TrainState(wrapped, optimizer), "meta": meta}
    dcp.load(state, checkpoint_id=path)  # reshards W_saved -> W in place
    meta = state["meta"]
    loaded = fingerprint(full_ema(ema))  # every rank: all take the same branch below
    same = loaded == meta["fingerprint"]
    _log(
        f"[resume W={world}] loaded step {meta['step']} saved at W={meta['world_size']}: "
        f"EMA updates={ema.updates}, {loaded} "
        f"({'identical to' if same else 'DIFFERENT FROM'} the saved EMA)"
    )
    if not same or ema.updates != meta["step"]:
        raise SystemExit("the EMA did not survive the checkpoint round trip")
    _log(
        f"[resume W={world}] rank 0 now holds {ema.local_numel()} of "
        f"{sum(t.numel() for t in ema.ema_tensors().values())} EMA values"
    )

    train_steps(args, wrapped, optimizer, ema, Task(args.seed), meta["step"] + 1, args.total_steps)
    final = full_ema(ema, rank0_only=True)
    if rank == 0:
        ref_file = ckpt / "reference_ema.pt"
        if ref_file.exists():
            reference = torch.load(ref_file, weights_only=True)
            diff = max(float((final[k] - reference[k]).abs().max()) for k in reference)
            ref_world = json.loads((ckpt / "reference.json").read_text())["world_size"]
            _log(
                f"[resume W={world}] continued to step {args.total_steps}: EMA updates="
                f"{ema.updates}; max |EMA - uninterrupted W={ref_world} EMA| = {diff:.3e} "
                "(world sizes reduce gradients in different orders: close, not bit-equal)"
            )
    final_path = ckpt / f"step_{args.total_steps}"
    dcp.save({"ema": ema}, checkpoint_id=final_path)
    # One torch.save file, keyed like model.state_dict(): rank 0 writes, all ranks gather.
    export_ema(ema, ckpt / "ema_final.pt")
    _log(f"[resume W={world}] saved {final_path} and exported {ckpt / 'ema_final.pt'}")


def phase_load(args: argparse.Namespace, ckpt: Path) -> None:
    # A plain process: no torchrun, no process group, no DTensor.
    export = ckpt / "ema_final.pt"
    if not export.exists():
        raise SystemExit(f"no export at {export}: run --phase train and --phase resume first")
    model = make_model(args.hidden)
    model.load_state_dict(torch.load(export, weights_only=True), strict=True)

    # The final DCP checkpoint, read straight into an unsharded ModelEMA.
    ema = ModelEMA(make_model(args.hidden), decay=args.ema_decay, tau=args.ema_tau or None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assum.*single.*process", category=UserWarning)
        dcp.load({"ema": ema}, checkpoint_id=ckpt / f"step_{args.total_steps}")
    from_dcp, _ = ema.get_model_state_dict()
    exported = model.state_dict()
    equal = all(torch.equal(from_dcp[k], exported[k]) for k in exported)

    model.eval()
    with torch.no_grad():
        x, y = Task(args.seed).batch(4096, step=-1)  # a batch no training step drew
        accuracy = 100.0 * float((model(x).argmax(1) == y).float().mean())
    print(
        f"[load, no process group] {export}: {len(exported)} tensors loaded with strict=True; "
        f"{'bit-identical to' if equal else 'DIFFERENT FROM'} the DCP checkpoint's EMA "
        f"(updates={ema.updates}); EMA model accuracy {accuracy:.2f}% on 4096 fresh samples",
        flush=True,
    )
    if not equal:
        raise SystemExit("exported EMA differs from the DCP checkpoint")


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Run --phase train and --phase resume under torchrun (different "
        "--nproc_per_node), --phase load with plain python, all with the same --ckpt-dir "
        "and model/EMA flags.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--phase",
        choices=("train", "resume", "load"),
        required=True,
        help="train: train and save at step --steps (torchrun); resume: load at another "
        "world size, continue, export (torchrun); load: read the export in a plain process",
    )
    p.add_argument(
        "--ckpt-dir",
        default="resume_reshard_ckpt",
        help="directory for the DCP checkpoints and the exported file (shared by phases)",
    )
    p.add_argument("--steps", type=int, default=100, help="steps before the checkpoint")
    p.add_argument("--total-steps", type=int, default=200, help="steps at the end of the run")
    p.add_argument(
        "--batch-size",
        type=int,
        default=24,
        help="global rows per step; must divide by every world size used (24: 1, 2, 3, 4, 6, 8)",
    )
    p.add_argument("--hidden", type=int, default=50, help="first hidden layer width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2, not DDP")
    p.add_argument("--ema-decay", type=float, default=0.99, help="asymptotic EMA decay")
    p.add_argument(
        "--ema-tau",
        type=float,
        default=20.0,
        help="warm-up time constant in steps; 0 = constant decay (must match across phases: "
        "the checkpoint stores the schedule and refuses a different one)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for data and initialization")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not 1 <= args.steps < args.total_steps:
        p.error(f"need 1 <= --steps < --total-steps, got {args.steps} and {args.total_steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ckpt = Path(args.ckpt_dir)
    if args.phase == "load":
        if "RANK" in os.environ:
            sys.exit("--phase load runs in a plain process: python examples/resume_reshard.py ...")
        phase_load(args, ckpt)
        return
    if "RANK" not in os.environ:
        sys.exit(
            f"--phase {args.phase} needs torchrun, e.g.\n  torchrun --standalone "
            f"--nproc_per_node=4 {sys.argv[0]} --phase {args.phase}"
        )
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        if args.batch_size % world:
            raise SystemExit(
                f"--batch-size {args.batch_size} must divide by the world size {world}"
            )
        if dist.get_rank() == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        (phase_train if args.phase == "train" else phase_resume)(args, ckpt)
    finally:
        # DDP/FSDP modules sit in reference cycles (hooks) that still hold the process
        # group; free them now, not during interpreter shutdown, where gloo's threads
        # can abort the process ('terminate called without an active exception').
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
