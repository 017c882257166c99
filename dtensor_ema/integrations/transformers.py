"""A Hugging Face ``TrainerCallback`` that keeps a sharded EMA of the model's weights, and
the ``Trainer`` mixin that makes ``evaluate()`` run with them::

    trainer = EMATrainer(model=model, args=args, ..., callbacks=[EMACallback(decay=0.9999)])

``on_train_begin`` builds a :class:`~dtensor_ema.ModelEMA` once the ``Trainer`` has prepared
the model (DDP, FSDP2, DeepSpeed ZeRO; each rank holds ``1/W`` of the EMA) and restores the
one saved in the checkpoint it resumes from; ``on_step_end`` updates it (local);
``on_save`` writes it to ``checkpoint-<step>/ema/`` with DCP (every rank its own shards).
:class:`EMATrainerMixin` (``EMATrainer``) evaluates with the EMA swapped in (no callback
event precedes an evaluation, hence the mixin: first among your ``Trainer``'s bases);
:meth:`EMACallback.save_pretrained` writes a ``from_pretrained`` folder. Requires
``transformers``. The guide: ``docs/trainers.md#hugging-face-trainer``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from dtensor_ema._collectives import agree, group_of
from dtensor_ema.checkpoint.save_load import load_checkpoint, save_checkpoint
from dtensor_ema.integrations._common import (
    StepGate,
    check_ema_options,
    is_rank0,
)
from dtensor_ema.model_ema import ModelEMA

__all__ = ["EMACallback", "EMATrainer", "EMATrainerMixin"]


class EMACallback(TrainerCallback):
    """Sharded EMA of the model's weights for the Hugging Face ``Trainer``.

    Args:
        name: the subfolder of each checkpoint folder the EMA is saved in
            (``checkpoint-<step>/<name>/``); give each ``EMACallback`` its own.
        update_every_n_steps: call ``ema.update()`` after every ``N``-th optimizer step only
            (the decay applies per call). ModelEMA's ``update_every=N`` instead keeps the
            EMA's memory in steps independent of ``N``.
        start_step: no update during the first ``start_step`` optimizer steps; the EMA
            restarts from the model's weights at its first update.
        evaluate_with_ema: :class:`EMATrainerMixin` evaluates with the EMA weights.
        mesh: passed to ``ModelEMA`` (``None``: the whole default process group).
        **ema_options: any :class:`~dtensor_ema.ModelEMA` keyword (``decay``, ``tau``, ...),
            checked here.

    Raises:
        TypeError: an unknown ``ModelEMA`` keyword.
        ValueError: a value out of range (``update_every_n_steps=0``, ``decay=2``, ...).

    Communication: ``update()`` none; saving and resuming are DCP's collectives (every rank
    runs the ``Trainer``'s callbacks); the evaluation swap is collective for replicated
    (DDP) tensors and free for FSDP2 parameters.
    """

    def __init__(
        self,
        *,
        name: str = "ema",
        update_every_n_steps: int = 1,
        start_step: int = 0,
        evaluate_with_ema: bool = True,
        mesh: DeviceMesh | None = None,
        **ema_options: Any,
    ) -> None:
        if not isinstance(name, str) or not name or os.sep in name or name.startswith("."):
            raise ValueError(f"name must be a plain folder name, got {name!r}")
        if not isinstance(evaluate_with_ema, bool):
            raise TypeError(f"evaluate_with_ema must be a bool, got {evaluate_with_ema!r}")
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be None or a DeviceMesh, got {type(mesh).__name__}")
        check_ema_options(ema_options)
        self.name = name
        self.gate = StepGate(update_every_n_steps, start_step)
        self.evaluate_with_ema = evaluate_with_ema
        self.ema_options = ema_options
        self._mesh = mesh
        self._ema: ModelEMA | None = None
        self._model: nn.Module | None = None
        self._last_step = 0
        self._started = False
        self._resume_from: str | None = None

    # ------------------------------------------------------------------ public
    @property
    def ema(self) -> ModelEMA:
        """The :class:`~dtensor_ema.ModelEMA` (exists from ``on_train_begin`` on)."""
        if self._ema is None:
            raise RuntimeError(
                f"EMACallback({self.name!r}) has no EMA yet: it is created when "
                "Trainer.train() starts"
            )
        return self._ema

    def resume_from(self, checkpoint: str | os.PathLike[str] | None) -> None:
        """Name the checkpoint folder ``train()`` resumes from (``EMATrainerMixin.train``
        calls this). Without it a resumed run looks in ``args.resume_from_checkpoint``,
        then in ``<output_dir>/checkpoint-<global_step>``."""
        self._resume_from = None if checkpoint is None else str(checkpoint)

    @contextlib.contextmanager
    def average_parameters(self) -> Iterator[None]:
        """The EMA weights swapped into the model for the body of the ``with``; nothing
        happens before the EMA exists or has started. Collective (see
        :meth:`ModelEMA.average_parameters`): every rank must enter it."""
        if self._ema is None or not self._started:
            yield
            return
        with self._ema.average_parameters():
            yield

    def save_pretrained(
        self, output_dir: str | os.PathLike[str], model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        """Write the EMA weights as a ``save_pretrained`` folder (``config.json`` and
        safetensors) that ``from_pretrained`` loads. **Collective**: every rank must call
        it; the EMA is gathered to rank 0 on the CPU (``get_ema_state_dict(only_rank0_receives=True,
        cpu_offload=True, include_untracked=True)``, in the model's dtypes: a whole state dict,
        tensors the EMA does not track taken from the model), which alone writes; then one
        all-reduce over the world group tells every rank whether the write failed, and every
        rank raises rank 0's error if it did (no rank is left waiting). A peft model's
        ``save_pretrained`` writes its adapter from it.

        Args:
            output_dir: the folder.
            model: a ``PreTrainedModel`` whose config and class describe the weights
                (default: the model the EMA tracks).
            **kwargs: passed to ``model.save_pretrained`` (e.g. ``safe_serialization``).
        """
        ema = self.ema
        target: Any = self._model if model is None else model
        if not hasattr(target, "save_pretrained"):
            raise TypeError(
                f"{type(target).__name__} has no save_pretrained(); pass a transformers "
                "PreTrainedModel as model="
            )
        state = ema.get_ema_state_dict(
            only_rank0_receives=True, cpu_offload=True, include_untracked=True
        )
        error: Exception | None = None
        if is_rank0():
            try:
                target.save_pretrained(output_dir, state_dict=state, **kwargs)
            except Exception as e:  # every rank raises it, below
                error = e
        agree(group_of(None), error, f"writing the EMA as a save_pretrained folder to {output_dir}")

    # ------------------------------------------------------------------ events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError("EMACallback needs the Trainer's model in on_train_begin")
        if self._ema is None or self._model is not model:
            self._ema = ModelEMA(model, mesh=self._mesh, **self.ema_options)
            self._model = model
        self._last_step = state.global_step
        self._started = not self.gate.delayed
        if state.global_step > 0:
            self._load(self._checkpoint_dir(args, state))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step
        if step <= self._last_step:
            return
        self._last_step = step
        if not self.gate.should_update(step):
            return
        ema = self.ema
        if not self._started:
            ema.set()  # a delayed start averages from the weights at the start, not at init
            self._started = True
        ema.update()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save into ``<output_dir>/checkpoint-<global_step>/<name>`` (DCP, collective)."""
        if self._ema is None:
            return
        folder = _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        save_checkpoint(self._state(), folder / self.name)

    # ------------------------------------------------------------------ internals
    def _state(self) -> dict[str, Any]:
        return {
            "ema": self.ema,
            "callback": {"last_step": self._last_step, "started": int(self._started)},
        }

    def _checkpoint_dir(self, args: TrainingArguments, state: TrainerState) -> Path:
        if self._resume_from is not None:
            return Path(self._resume_from)
        if isinstance(args.resume_from_checkpoint, str):
            return Path(args.resume_from_checkpoint)
        return _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"

    def _load(self, checkpoint_dir: Path) -> None:
        path = checkpoint_dir / self.name
        if not path.is_dir():
            raise ValueError(
                f"EMACallback({self.name!r}): training resumes at step {self._last_step} but "
                f"{path} does not exist: the checkpoint was saved without this callback (or "
                "with another name=), or it lies outside output_dir and a plain Trainer did "
                "not say where (use EMATrainer, or call EMACallback.resume_from(path) first)"
            )
        state = self._state()
        load_checkpoint(state, path)  # checks names, shapes and options before writing
        self._last_step = int(state["callback"]["last_step"])
        self._started = bool(state["callback"]["started"])


def _output_dir(args: TrainingArguments) -> Path:
    if args.output_dir is None:
        raise ValueError("EMACallback needs TrainingArguments.output_dir to find checkpoints")
    return Path(args.output_dir)


class EMATrainerMixin:
    """Mixin for a ``transformers.Trainer`` subclass: ``evaluate()`` with the EMA weights.

    Put it first: ``class MyTrainer(EMATrainerMixin, Trainer)`` (or use
    :class:`EMATrainer`). It finds the :class:`EMACallback` among the trainer's callbacks.
    """

    callback_handler: Any
    model: Any
    args: TrainingArguments

    def _ema_callbacks(self) -> list[EMACallback]:
        return [cb for cb in self.callback_handler.callbacks if isinstance(cb, EMACallback)]

    def _evaluating_callback(self) -> EMACallback | None:
        evaluating = [cb for cb in self._ema_callbacks() if cb.evaluate_with_ema]
        if len(evaluating) > 1:
            raise ValueError(
                f"EMACallbacks {[cb.name for cb in evaluating]} all have evaluate_with_ema=True: "
                "only one EMA can be swapped into the model; set it to False on the others"
            )
        return evaluating[0] if evaluating else None

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` with the EMA weights swapped in (collective swap)."""
        callback = self._evaluating_callback()
        if callback is None or callback._ema is None:
            if callback is not None:
                warnings.warn(
                    f"EMACallback({callback.name!r}) has no EMA yet (it is created by "
                    "train()); evaluating the model's own weights",
                    stacklevel=2,
                )
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        with callback.average_parameters():
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``, telling the callbacks which checkpoint it resumes from."""
        path: str | None = None
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            path = get_last_checkpoint(self.args.output_dir)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = str(resume_from_checkpoint)
        for callback in self._ema_callbacks():
            callback.resume_from(path)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def save_ema_model(self, output_dir: str | os.PathLike[str] | None = None) -> None:
        """Write the EMA weights of the (single) :class:`EMACallback` as a
        ``save_pretrained`` folder, default ``<output_dir>/ema``. Collective."""
        callbacks = self._ema_callbacks()
        if len(callbacks) != 1:
            raise ValueError(
                f"save_ema_model needs exactly one EMACallback, found {len(callbacks)}; "
                "call EMACallback.save_pretrained on the one you want"
            )
        target = _output_dir(self.args) / "ema" if output_dir is None else Path(output_dir)
        callbacks[0].save_pretrained(target, self.model)


class EMATrainer(EMATrainerMixin, Trainer):
    """``transformers.Trainer`` whose ``evaluate()`` uses the EMA weights."""
