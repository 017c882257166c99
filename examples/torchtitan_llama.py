"""Train with torchtitan's own trainer and a sharded EMA: its entry point, our ``--module``.

    torchrun --nproc_per_node=8 examples/torchtitan_llama.py --config llama3_8b \\
        --ema.decays 0.999

runs exactly what this runs::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module dtensor_ema.integrations.torchtitan --config llama3_8b --ema.decays 0.999

(``--config`` defaults to ``llama3_debugmodel`` here.) Every torchtitan flag works as
usual, ``--help`` lists them with the ``--ema.*`` section. torchtitan's own ``Trainer``
(:class:`dtensor_ema.integrations.torchtitan.trainer.EMATrainer`) then keeps one EMA per
decay, every element on exactly one rank of whatever layout the flags build (FSDP2, HSDP,
TP, EP, CP; per stage with PP); updates it after each optimizer step; saves it in
torchtitan's checkpoints under ``ema`` (``--checkpoint.enable``; a resume at another world
size reshards it); and with ``--validator.enable`` logs ``validation_metrics/ema_loss/
<name>`` beside ``validation_metrics/loss``. See ``docs/trainers.md#torchtitan``.

torchtitan targets GPUs: it needs its tokenizer and dataset assets (``--hf_assets_path``,
``--dataloader.dataset_path``) and NCCL. ``tests/test_examples_smoke.py`` runs this script on
CPU ranks (TP at W=2, resumed in one process) with the CPU switches of the test
suite (``tests/titan_models.py``), none of which are in this script or the library.
"""

from __future__ import annotations

import sys

MODULE = "dtensor_ema.integrations.torchtitan"
DEFAULT_CONFIG = "llama3_debugmodel"


def torchtitan_args(argv: list[str]) -> list[str]:
    """The arguments for ``torchtitan.train``: ``--module`` ours, ``--config`` the given
    one or :data:`DEFAULT_CONFIG`, then ``argv`` unchanged."""
    if any(a == "--module" or a.startswith("--module=") for a in argv):
        raise SystemExit(f"this script sets --module {MODULE} itself; drop --module")
    given = any(a == "--config" or a.startswith("--config=") for a in argv)
    config = [] if given else ["--config", DEFAULT_CONFIG]
    return ["--module", MODULE, *config, *argv]


def main(argv: list[str] | None = None) -> None:
    from torchtitan.train import main as torchtitan_main

    sys.argv = [sys.argv[0], *torchtitan_args(sys.argv[1:] if argv is None else argv)]
    torchtitan_main()


if __name__ == "__main__":
    main()
