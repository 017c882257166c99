"""Train torchtitan's llama3 debugmodel with a sharded EMA, evaluate through it, resume at
another world size.

torchtitan 0.3.0's own model (``debugmodel`` as shipped: fused ``wqkv``), its own
``ParallelDims`` meshes and its own ``parallelize_llama`` (TP, selective activation
checkpointing, FSDP2), on CPU ranks with gloo. The EMA is
:class:`dtensor_ema.integrations.torchtitan.TorchtitanEMA` (torchtitan's EMA interface:
``step(current_step)``, DCP key ``ema``), built with ``mesh=None``: it finds the world from
the parameters' meshes and keeps every EMA element on exactly one rank. Three phases share
``--out``:

    python examples/torchtitan_llama.py --out=/tt  # all three, spawning its own ranks
    torchrun --standalone --nproc_per_node=4 examples/torchtitan_llama.py --phase train --out=/tt
    torchrun --standalone --nproc_per_node=2 examples/torchtitan_llama.py --phase resume --out=/tt
    python examples/torchtitan_llama.py --phase load --out=/tt

``train`` (W ranks; FSDP2+TP with TP degree ``--tp`` when W is a multiple of it, else FSDP2)
trains ``--steps`` AdamW steps on random tokens (offline: no tokenizer, no dataset), steps the
EMA, evaluates a held-out batch with the raw weights and inside ``ema.average_parameters()``
(the raw weights come back exactly), and saves model, optimizer and EMA with DCP
(:func:`dtensor_ema.save_checkpoint`). ``resume`` (another W; FSDP2 over all ranks) loads
that checkpoint (DCP reshards all of it), checks that the EMA is bit-identical to the one
saved, trains ``--steps`` more steps, evaluates and saves again. ``load`` runs in one plain
process (no process group, no parallelism): it loads the ``resume`` checkpoint into the plain
model and its EMA, checks the EMA bit for bit, and evaluates through it.

The bit-for-bit checks compare full EMA tensors (``get_ema_state_dict``: gathered, in the
model's own ``state_dict`` keys, so the fused ``wqkv`` comes out as torchtitan's
``wq``/``wk``/``wv``) written by rank 0 of the saving phase with those of the loading one.

CPU switches (torchtitan 0.3.0 targets CUDA; each is marked ``CPU:`` below):

* ``device_type = "cpu"`` in ``torchtitan.tools.utils`` and the modules that imported it
  (``torchtitan.distributed.parallel_dims``, ``torchtitan.distributed.utils``): torchtitan
  picks CUDA at import and builds its meshes there.
* Start the gloo process group yourself: torchtitan's ``init_distributed`` picks NCCL.
* SDPA attention (``ScaledDotProductAttention.Config()`` as every layer's
  ``inner_attention``): the debugmodel's FlexAttention has no CPU backward.
* ``set_force_sum_reduction_for_comms(True)`` on every FSDP2 module: gloo has no
  ``PREMUL_SUM``/``AVG`` reduce-scatter.
* ``training.mixed_precision_param = "float32"``: CPU bf16 matmuls are slow, and fp32 keeps
  the layouts comparable.
* Forward and backward inside torchtitan's ``get_spmd_context(parallel_dims=...)``, and the
  loss through torchtitan's ``cross_entropy_loss(..., global_vocab_size=...)``: under TP the
  logits are each rank's vocab shard (loss parallel), not the full vocabulary.
* Build on the meta device, ``to_empty(device="cpu")``, ``init_weights(buffer_device=cpu)``.

Every rank trains on the same batch (a per-step seed), so runs at any world size see the
same data; a real run feeds each data-parallel rank its own slice. ``--layers`` trims the
debugmodel (6 layers as shipped) to run fast.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dtensor_ema import load_checkpoint, save_checkpoint
from dtensor_ema.integrations.torchtitan import TorchtitanEMA

EVAL_SEED = 10_000


def use_cpu() -> None:
    """CPU: torchtitan picked CUDA at import; point it (and the copies) at the CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    tools_utils.device_type = parallel_dims.device_type = dist_utils.device_type = "cpu"


def trainer_config(args: argparse.Namespace, dp_shard: int, tp: int) -> Any:
    """torchtitan's ``llama3_debugmodel`` trainer config, with the CPU switches."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    trainer = llama3_debugmodel()
    model = trainer.model_spec.model
    if args.layers is not None:
        model.layers = model.layers[: args.layers]
    for layer in model.layers:  # CPU: FlexAttention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    trainer.training.seq_len = args.seq_len
    trainer.training.mixed_precision_param = "float32"  # CPU: fp32 compute
    trainer.parallelism.data_parallel_shard_degree = dp_shard
    trainer.parallelism.tensor_parallel_degree = tp
    trainer.optimizer.param_groups[0].optimizer_kwargs["lr"] = args.lr
    model.update_from_config(config=trainer)
    return trainer


def build(args: argparse.Namespace, world_size: int | None) -> tuple[nn.Module, Any, Any]:
    """``(model, parallel_dims or None, trainer config)``: parallelized by torchtitan over
    ``world_size`` ranks, or the plain model for ``None`` (one process, no process group)."""
    from torch.distributed.fsdp import FSDPModule

    use_cpu()
    if world_size is None:
        trainer = trainer_config(args, 1, 1)
        torch.manual_seed(0)
        model = trainer.model_spec.model.build()
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        return model, None, trainer

    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    tp = args.tp if args.phase == "train" and world_size % args.tp == 0 else 1
    trainer = trainer_config(args, world_size // tp, tp)
    dims = ParallelDims.from_config(trainer.parallelism, world_size)
    dims.build_mesh()  # torchtitan caches its meshes: build one ParallelDims per process
    with torch.device("meta"):
        model = trainer.model_spec.model.build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=trainer.training,
        parallelism=trainer.parallelism,
        compile_config=trainer.compile,
        ac_config=trainer.activation_checkpoint,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # CPU: gloo has no PREMUL_SUM
    return model, dims, trainer


def tokens(args: argparse.Namespace, seed: int, vocab: int) -> torch.Tensor:
    """``seq_len + 1`` random tokens per row: ``seq_len`` inputs (sequence parallel splits
    them over TP ranks) and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g)


def mean_loss(model: nn.Module, dims: Any, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token cross-entropy, torchtitan's way (vocab-parallel under TP)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import get_spmd_context

    with get_spmd_context(parallel_dims=dims)():  # CPU and GPU: TP logits need it
        logits = model(batch[:, :-1])
        loss = cross_entropy_loss(logits, batch[:, 1:], global_vocab_size=vocab)
    return loss / batch[:, 1:].numel()


def train(
    args: argparse.Namespace,
    model: nn.Module,
    dims: Any,
    opt: Any,
    ema: TorchtitanEMA,
    steps: range,
    vocab: int,
) -> None:
    from torchtitan.distributed.utils import get_spmd_context

    for step in steps:
        batch = tokens(args, step, vocab)
        loss = mean_loss(model, dims, batch, vocab)
        with get_spmd_context(parallel_dims=dims)():
            loss.backward()
        opt.step()
        opt.zero_grad()
        ema.step(step)  # torchtitan's call: after optimizer.step(), with the trainer step
        say(f"step {step} | loss {float(loss):.4f}")


def evaluate(
    args: argparse.Namespace, model: nn.Module, dims: Any, ema: TorchtitanEMA, vocab: int
) -> tuple[float, float]:
    """Held-out loss with the raw weights and through the EMA; the raw weights must come
    back exactly (checked on this rank's local shards)."""
    batch = tokens(args, EVAL_SEED, vocab)
    model.eval()
    raw_before = [_local(p).clone() for p in model.parameters()]
    with torch.no_grad():
        raw = float(mean_loss(model, dims, batch, vocab))
        with ema.average_parameters():  # collective: every rank enters
            averaged = float(mean_loss(model, dims, batch, vocab))
    model.train()
    params = list(model.parameters())
    restored = all(torch.equal(_local(p), b) for p, b in zip(params, raw_before, strict=True))
    if not restored:
        raise RuntimeError("average_parameters() did not restore the raw weights")
    say(f"eval loss | raw {raw:.4f} | EMA {averaged:.4f} | raw weights restored: {restored}")
    return raw, averaged


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def full_ema(ema: TorchtitanEMA) -> dict[str, dict[str, torch.Tensor]]:
    """Every EMA as full tensors in the model's ``state_dict`` keys (collective)."""
    return {name: e.get_ema_state_dict(cpu_offload=True) for name, e in ema.items()}


def same(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Bit for bit: the same EMAs, keys, dtypes and values."""
    return got.keys() == want.keys() and all(
        got[n].keys() == want[n].keys()
        and all(
            got[n][k].dtype == v.dtype and torch.equal(got[n][k], v) for k, v in want[n].items()
        )
        for n in want
    )


def say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _layout(dims: Any) -> str:
    if dims is None:
        return "1 process, no process group, plain model"
    tp = dims.tp
    kind = f"FSDP2 {dims.dp_shard} x TP {tp}" if tp > 1 else f"FSDP2 over {dims.dp_shard}"
    return f"{dist.get_world_size()} x cpu (gloo), {kind} by torchtitan's parallelize_llama"


def run_phase(args: argparse.Namespace) -> None:
    out = Path(args.out)
    world = dist.get_world_size() if dist.is_initialized() else None
    model, dims, trainer = build(args, world)
    vocab = trainer.model_spec.model.vocab_size
    say(f"phase {args.phase}: torchtitan llama3 debugmodel, {_layout(dims)}")
    ema = TorchtitanEMA(
        TorchtitanEMA.Config(enable=True, decays=[args.decay]),
        model_parts=[model],  # mesh=None: the world is found from the parameters' meshes
    )
    name = next(iter(ema))
    total = sum(p.numel() for p in model.parameters())
    say(f"EMA {name}: {ema[name].local_numel()} of {total} elements on rank 0")
    opt = trainer.optimizer.build(model_parts=[model])  # torchtitan's AdamW container

    if args.phase == "train":
        train(args, model, dims, opt, ema, range(1, args.steps + 1), vocab)
        _, ema_loss = evaluate(args, model, dims, ema, vocab)
        _save(out / "train", model, opt, ema, args.steps, ema_loss)
        return

    source = out / ("train" if args.phase == "resume" else "resume")
    meta = torch.load(source / "ema_full.pt")
    _load(source, model, opt, ema)  # one process: DCP reads every shard into plain tensors
    identical = same(full_ema(ema), meta["ema"])
    say(f"EMA after loading {source.name} (step {meta['step']}): bit-identical: {identical}")
    if not identical:
        raise RuntimeError("the resumed EMA differs from the saved one")
    if args.phase == "resume":
        step = meta["step"]
        train(args, model, dims, opt, ema, range(step + 1, step + args.steps + 1), vocab)
        _, ema_loss = evaluate(args, model, dims, ema, vocab)
        _save(out / "resume", model, opt, ema, step + args.steps, ema_loss)
    else:
        _, ema_loss = evaluate(args, model, dims, ema, vocab)
        say(
            f"EMA eval loss here {ema_loss:.4f} | at W={meta['world']} {meta['ema_loss']:.4f} "
            "(same weights; the layouts reduce in different orders)"
        )


def _states(model: nn.Module, opt: Any, ema: TorchtitanEMA) -> dict[str, Any]:
    """What torchtitan's CheckpointManager saves, as DCP ``Stateful`` values: the model
    through torchtitan's ``ModelWrapper`` (its ``state_dict`` hooks split the fused ``wqkv``
    into ``wq``/``wk``/``wv`` and merge them back on load), its optimizer container, and the
    EMA under ``ema``."""
    from torchtitan.components.checkpointer.base import ModelWrapper

    return {"model": ModelWrapper(model), "optimizer": opt, "ema": ema}


def _save(
    path: Path, model: nn.Module, opt: Any, ema: TorchtitanEMA, step: int, ema_loss: float
) -> None:
    save_checkpoint(_states(model, opt, ema), path / "ckpt")
    full = full_ema(ema)
    if dist.get_rank() == 0:
        meta = {"ema": full, "step": step, "world": dist.get_world_size(), "ema_loss": ema_loss}
        torch.save(meta, path / "ema_full.pt")
    dist.barrier()
    say(f"saved step {step} to {path / 'ckpt'} (DCP: model, optimizer, EMA under 'ema')")


def _load(path: Path, model: nn.Module, opt: Any, ema: TorchtitanEMA) -> None:
    load_checkpoint(_states(model, opt, ema), path / "ckpt")


def _rank_main(rank: int, world_size: int, store: str, args: argparse.Namespace) -> None:
    """A spawned rank: gloo over a file store (the self-spawning launch)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    try:
        run_phase(args)
    finally:
        gc.collect()  # FSDP's cycles hold the group: free them before interpreter exit
        dist.destroy_process_group()


def spawn(args: argparse.Namespace, world_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world_size, os.path.join(tmp, "store"), args), nprocs=world_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Without --phase (or --phase all) the script spawns its own ranks for train "
        "and resume, then runs load in this process. Under torchrun give --phase.",
    )
    parser.add_argument(
        "--phase",
        choices=["all", "train", "resume", "load"],
        default="all",
        help="train: train and save (W ranks); resume: load at another W, train on, save; "
        "load: one process, no process group; all: the three in turn (self-spawning)",
    )
    parser.add_argument("--out", required=True, help="directory for checkpoints (shared)")
    parser.add_argument(
        "--world-size", type=int, default=4, help="ranks of the self-spawned train phase"
    )
    parser.add_argument(
        "--resume-world-size",
        type=int,
        default=2,
        help="ranks of the self-spawned resume phase (FSDP2 over all of them)",
    )
    parser.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel degree of the train phase"
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per phase")
    parser.add_argument(
        "--layers", type=int, default=None, help="keep the first N layers (default: all 6)"
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    parser.add_argument("--decay", type=float, default=0.9, help="the EMA's fixed decay")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ:  # under torchrun
        if args.phase in ("all", "load"):
            sys.exit("under torchrun give --phase train or --phase resume")
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))  # CPU: not NCCL
        try:
            run_phase(args)
        finally:
            gc.collect()  # FSDP's cycles hold the group: free them before interpreter exit
            dist.destroy_process_group()
        return
    if args.phase in ("train", "resume"):
        world = args.world_size if args.phase == "train" else args.resume_world_size
        spawn(args, world)
        return
    if args.phase == "all":
        spawn(argparse.Namespace(**{**vars(args), "phase": "train"}), args.world_size)
        spawn(argparse.Namespace(**{**vars(args), "phase": "resume"}), args.resume_world_size)
        args.phase = "load"
    run_phase(args)


if __name__ == "__main__":
    main()
