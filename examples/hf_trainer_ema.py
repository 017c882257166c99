"""Hugging Face Trainer + dtensor_ema: a sharded EMA in two lines, on a tiny GPT-2 built
from a config and offline data (nothing is downloaded).

    python examples/hf_trainer_ema.py                                   # one process
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer_ema.py  # DDP, 2 CPU ranks
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer_ema.py --fsdp  # GPUs only

The data is a noisy Markov chain over a small vocabulary: its entropy rate (printed) is the
best loss any model can reach. A large learning rate keeps the raw weights jittering around
it; their EMA settles closer. ``EMATrainer.evaluate()`` (also the evaluations during
training) runs with the EMA weights; at the end the script evaluates once more with the raw
weights, prints both losses, writes the EMA with ``save_ema_model`` as a
``save_pretrained`` folder and loads it back with ``from_pretrained``. Every checkpoint
folder holds the EMA's DCP shards in ``checkpoint-<step>/ema/``; ``--resume`` continues
from the last one. ``--fsdp`` shards the model with FSDP2 through accelerate, which
accelerate only does on GPUs (on CPU it refuses or falls back to DDP).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging as hf_logging

from dtensor_ema.integrations.transformers import EMACallback, EMATrainer


class MarkovTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences from a fixed random Markov chain (same chain for every split)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        chain = torch.Generator().manual_seed(0)
        logits = 2.5 * torch.randn(vocab, vocab, generator=chain)
        self.transition = logits.softmax(-1)
        g = torch.Generator().manual_seed(seed)
        ids = torch.empty(n, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, seq):
            ids[:, t] = torch.multinomial(self.transition[ids[:, t - 1]], 1, generator=g)[:, 0]
        self.ids = ids

    def entropy(self) -> float:
        """Expected loss of the true chain on these sequences: the best reachable loss."""
        p = self.transition
        row_entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)
        return float(row_entropy[self.ids[:, :-1]].mean())

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument(
        "--eval-every", type=int, default=50, help="evaluate (EMA) and checkpoint every N steps"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--train-size", type=int, default=2048, help="training sequences (offline)")
    p.add_argument("--val-size", type=int, default=128, help="validation sequences")
    p.add_argument("--context", type=int, default=24, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=48, help="vocabulary size of the Markov chain")
    p.add_argument("--dim", type=int, default=32, help="GPT-2 embedding width")
    p.add_argument("--layers", type=int, default=2, help="GPT-2 blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (large on purpose)")
    p.add_argument("--decay", type=float, default=0.99, help="EMA decay (ramped up, yolov5 style)")
    p.add_argument(
        "--output-dir", default="hf_ema_out", help="checkpoints and the exported EMA model"
    )
    p.add_argument(
        "--resume", action="store_true", help="resume from the last checkpoint in --output-dir"
    )
    p.add_argument("--fsdp", action="store_true", help="FSDP2 through accelerate (GPUs only)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    train = MarkovTokens(args.train_size, args.context, args.vocab, seed=1)
    val = MarkovTokens(args.val_size, args.context, args.vocab, seed=2)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.context,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    fsdp: dict[str, object] = {}
    if args.fsdp:
        fsdp = {
            "fsdp": True,
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        }
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        eval_strategy="steps",
        eval_steps=args.eval_every,
        save_strategy="steps",
        save_steps=args.eval_every,
        logging_steps=args.eval_every,
        report_to="none",
        disable_tqdm=True,
        **fsdp,
    )
    ema = EMACallback(decay=args.decay, tau=50)  # line 2 (line 1: the import) ...
    trainer = EMATrainer(  # ... and EMATrainer instead of Trainer
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=val,
        callbacks=[ema],
    )
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if main_rank:
        print(
            f"GPT-2 {sum(p.numel() for p in model.parameters())} parameters on {world} "
            f"rank(s); Markov chain entropy (best loss) {train.entropy():.4f}"
        )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    ema_loss = trainer.evaluate()["eval_loss"]
    ema.evaluate_with_ema = False
    raw_loss = trainer.evaluate()["eval_loss"]
    export = Path(args.output_dir) / "ema"
    trainer.save_ema_model(export)
    model.eval()
    with ema.average_parameters(), torch.no_grad():  # collective: every rank enters
        direct = model(input_ids=val.ids.to(model.device), labels=val.ids.to(model.device))
    if main_rank:
        reloaded = GPT2LMHeadModel.from_pretrained(export).to(model.device).eval()
        with torch.no_grad():
            check = reloaded(input_ids=val.ids.to(model.device), labels=val.ids.to(model.device))
        print(
            f"final: raw val loss {raw_loss:.4f}  EMA val loss {ema_loss:.4f}  "
            f"(best possible {train.entropy():.4f}; EMA updates: {ema.ema.updates})"
        )
        same = torch.equal(check.logits, direct.logits)
        print(
            f"EMA exported to {export}; from_pretrained reloads it: val loss "
            f"{check.loss.item():.4f}, logits identical to the EMA's: {same}"
        )
    if os.environ.get("LOCAL_RANK") is not None and dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
