"""An OLMo-core ``Callback`` that keeps sharded EMAs of the model's weights::

    trainer_config = TrainerConfig(...).with_callback("ema", EMACallback(decays=[0.999, 0.9999]))

One :class:`~dtensor_ema.MultiModelEMA` holds an EMA per decay (``1/W`` of each per rank),
updated in ``post_train_batch`` at priority 2 (before OLMo-core's ``CheckpointerCallback``,
so a checkpoint holds the EMA of the step it saves), evaluated by every ``EvaluatorCallback``
under ``eval/ema/<name>``, and saved to ``<checkpoint>/ema/`` with
:func:`~dtensor_ema.save_checkpoint` (staged until OLMo-core reports the checkpoint saved).
Requires ``ai2-olmo-core`` 2.x. The details (resume, staging, cloud save folders):
``docs/trainers.md#olmo-core``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from olmo_core.io import get_parent, join_path
from olmo_core.train.callbacks import Callback, CheckpointerCallback, EvaluatorCallback

from dtensor_ema.checkpoint.background import release_staging
from dtensor_ema.checkpoint.save_load import load_checkpoint, save_checkpoint
from dtensor_ema.checkpoint.storage import storage_for
from dtensor_ema.integrations._common import StepGate, decay_name, is_rank0
from dtensor_ema.multi import MultiModelEMA

__all__ = ["EMACallback"]

log = logging.getLogger(__name__)

EMA_FOLDER = "ema"
"""The EMA's folder inside each checkpoint folder: ``<save_folder>/step<N>/ema``."""

STAGING = ".ema-staging"
"""Where an EMA waits until OLMo-core has written its checkpoint folder:
``<save_folder>/.ema-staging/step<N>`` (OLMo-core's checkpoint search ignores it)."""

_SHARED_OPTIONS = ("buffers", "exclude", "track", "ema_dtype", "kernel")
_MOVES = threading.Lock()  # post_checkpoint_saved may run in an async save's thread


@dataclass
class EMACallback(Callback):
    """Sharded EMAs of the model for OLMo-core's ``Trainer`` (see the module docstring).

    Communication: the update none; building the EMAs is collective over the model's mesh
    (every rank builds them: OLMo-core runs every callback on every rank); the evaluation
    swap is collective over the replica dims (none on a 1-D FSDP2 mesh); saving and
    loading are DCP's collectives over the default process group.

    Memory per rank: ``1/W`` of the averaged bytes per EMA; an evaluation adds the swap's
    backup (``1/W`` of the weights).

    Raises:
        ValueError: a decay outside ``[0, 1)``, no decay, two equal decays, ``tau < 0``,
            ``update_every_n_steps < 1``, ``start_step < 0``, an ``ema_options`` key
            that is not a shared :class:`~dtensor_ema.MultiModelEMA` option.
    """

    priority: ClassVar[int] = 2
    """Above OLMo-core's ``CheckpointerCallback`` (1): the update runs before the save."""

    decays: list[float] = field(default_factory=lambda: [0.9999])
    """One EMA per decay, named ``decay_<d>`` with ``_`` for the point (``decay_0_9999``)."""
    tau: float | None = None
    """Warm-up ramp of every decay: ``decay * (1 - exp(-updates / tau))`` (early updates
    forget the initialization faster); ``None``: the constant decays."""
    update_every_n_steps: int = 1
    """Update after every ``n``-th optimizer step only (the decay applies per update)."""
    start_step: int = 0
    """No update during the first ``start_step`` steps; the EMAs restart from the model's
    weights at their first update."""
    evaluate: bool = True
    """Evaluate each EMA whenever an ``EvaluatorCallback`` evaluates the model."""
    eval_prefix: str = "eval/ema"
    """Metrics of EMA ``name``: ``<eval_prefix>/<name>/<evaluator>/<metric>``."""
    ema_options: dict[str, Any] = field(default_factory=dict)
    """Options every EMA shares: ``buffers``, ``exclude``, ``track``, ``ema_dtype``,
    ``kernel`` (see :class:`~dtensor_ema.MultiModelEMA`)."""
    enabled: bool = True

    _emas: MultiModelEMA | None = field(default=None, init=False, repr=False, compare=False)
    _started: bool = field(default=False, init=False, repr=False, compare=False)
    _resumed: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _staged: dict[str, tuple[str, concurrent.futures.Future[None] | None]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.decays:
            raise ValueError("decays is empty: give at least one, e.g. [0.9999]")
        for d in self.decays:
            if isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 <= d < 1.0:
                raise ValueError(f"decays must lie in [0, 1), got {d!r} in {self.decays}")
        if len(set(self.names)) != len(self.decays):
            raise ValueError(f"decays must differ, got {self.decays}")
        if self.tau is not None and not (isinstance(self.tau, int | float) and self.tau >= 0):
            raise ValueError(f"tau must be None or a number >= 0, got {self.tau!r}")
        unknown = sorted(set(self.ema_options) - set(_SHARED_OPTIONS))
        if unknown:
            raise ValueError(
                f"ema_options {unknown} are not shared EMA options; valid: {list(_SHARED_OPTIONS)}"
            )
        self._gate = StepGate(self.update_every_n_steps, self.start_step)

    # ------------------------------------------------------------------ public
    @property
    def names(self) -> list[str]:
        """The EMAs' names, one per decay, in order."""
        return [decay_name("decay", d) for d in self.decays]

    @property
    def emas(self) -> MultiModelEMA:
        """The EMAs (built when training starts or a checkpoint loads)."""
        if self._emas is None:
            raise RuntimeError("EMACallback has no EMA yet: it is built when Trainer.fit() starts")
        return self._emas

    # ------------------------------------------------------------------ events
    def pre_train(self) -> None:
        if not self.enabled:
            return
        self._build()
        self._evaluate_if(lambda cb: cb.eval_on_startup)

    def post_train_batch(self) -> None:
        if not self.enabled:
            return
        step = self.step
        skipped = any(r.start <= step < r.stop for r in self.trainer.steps_to_skip or ())
        if skipped or not self._gate.should_update(step):
            return
        emas = self._build()
        if not self._started:
            for ema in emas.values():  # a delayed start averages from the weights now
                ema.set()
            self._started = True
        emas.update()

    def post_step(self) -> None:
        if not self.enabled or self.step <= 1:
            return
        step = self.step
        self._evaluate_if(
            lambda cb: (
                (cb.eval_interval is not None and step % cb.eval_interval == 0)
                or (cb.fixed_steps is not None and step in cb.fixed_steps)
            )
        )

    def post_train(self) -> None:
        if self.enabled:
            self._evaluate_if(lambda cb: cb.eval_on_finish)

    def state_dict(self) -> dict[str, Any]:
        """Called by the trainer on every rank when it starts a checkpoint: writes the EMA
        (staged under ``STAGING`` until saved; collective) and returns what the per-rank
        pickle keeps: the step and the EMAs' names."""
        if not self.enabled:
            return {}
        step = self.trainer.global_step
        folder = self.trainer.checkpointer.checkpoint_dirname(step)
        checkpoint = str(join_path(self.trainer.save_folder, folder))
        staged = str(join_path(self.trainer.save_folder, STAGING, folder))
        checkpointers = self.trainer.callbacks.values()
        in_background = any(
            isinstance(cb, CheckpointerCallback) and cb.save_async for cb in checkpointers
        )
        future = save_checkpoint(self._state(step), staged, async_=in_background)
        self._staged[checkpoint] = (staged, future)
        return {"step": step, "names": self.names, "folder": EMA_FOLDER}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict) if state_dict else None

    def post_checkpoint_saved(self, path: Any) -> None:
        staged = self._staged.get(str(path))
        if staged is not None:  # forgotten once moved: close() moves it if this comes late
            _commit(*staged, str(path))
            self._staged.pop(str(path), None)

    def post_checkpoint_loaded(self, path: Any) -> None:
        if not self.enabled:
            return
        emas = self._build()
        resumed, self._resumed = self._resumed, None
        checkpoint = str(path)
        found = _find(checkpoint)
        if resumed is None:  # no trainer state of ours: a fine-tune, or a run without EMA
            for ema in emas.values():
                ema.set()
            log.info(
                "EMA %s restarted from the weights loaded from %s%s",
                self.names,
                checkpoint,
                "" if found is None else f" (its EMA in {found} is not resumed: no trainer state)",
            )
            return
        if found is None:
            raise FileNotFoundError(
                f"checkpoint {checkpoint}: its trainer state says the EMA of step "
                f"{resumed.get('step')} was saved in {join_path(checkpoint, EMA_FOLDER)}, which "
                "does not exist (nor a staged copy)"
            )
        state = self._state(-1)
        load_checkpoint(state, found)  # names, shapes, options checked before anything is written
        saved_step = int(state["callback"]["step"])
        if saved_step != self.trainer.global_step:
            raise ValueError(
                f"checkpoint {checkpoint}: the EMA in {found} is of step {saved_step}, the "
                f"trainer resumes at step {self.trainer.global_step}"
            )
        self._started = bool(state["callback"]["started"])
        log.info(
            "EMA restored from %s (step %d): %s",
            found,
            saved_step,
            ", ".join(f"{n} {emas[n].updates} updates" for n in self.names),
        )

    def close(self) -> None:
        for checkpoint, staged in list(self._staged.items()):
            # The trainer finished it (OLMo-core's check); the report may be late.
            if self.trainer.checkpointer.dir_is_checkpoint(checkpoint):
                self._staged.pop(checkpoint, None)
                _commit(*staged, checkpoint)
        release_staging()  # waits for a background write, frees its CPU copy

    # ------------------------------------------------------------------ internals
    def _build(self) -> MultiModelEMA:
        if self._emas is None:
            model = getattr(self.trainer.train_module, "model", None)
            if model is None:
                raise TypeError(
                    f"EMACallback needs a train module with one model (TransformerTrainModule), "
                    f"got {type(self.trainer.train_module).__name__}"
                )
            self._emas = MultiModelEMA(
                model,
                {
                    name: {"decay": d, "tau": self.tau}
                    for name, d in zip(self.names, self.decays, strict=True)
                },
                **self.ema_options,
            )
            self._started = not self._gate.delayed
        return self._emas

    def _state(self, step: int) -> dict[str, Any]:
        return {
            "emas": self._build(),
            "callback": {"step": step, "started": int(self._started)},
        }

    def _evaluate_if(self, due: Any) -> None:
        """Evaluate every EMA with each evaluator callback for which ``due(callback)``.
        Collective (the swap's and the evaluator's)."""
        if not self.evaluate or self.trainer.no_evals:
            return
        evaluators = [
            cb for cb in self.trainer.callbacks.values() if isinstance(cb, EvaluatorCallback)
        ]
        for callback in [cb for cb in evaluators if due(cb)]:
            emas = self._build()
            for name in self.names:
                with emas[name].average_parameters():
                    callback.perform_eval(prefix=f"{self.eval_prefix}/{name}")


def _find(checkpoint: str) -> str | None:
    """The EMA of ``checkpoint``: its ``ema`` folder, or a staged one that was never moved
    in (the run stopped between OLMo-core's commit and the move)."""
    name = checkpoint.rstrip("/").rsplit("/", 1)[-1]
    for candidate in (
        join_path(checkpoint, EMA_FOLDER),
        join_path(get_parent(checkpoint), STAGING, name),
    ):
        if storage_for(str(candidate)).exists():
            return str(candidate)
    return None


def _commit(staged: str, future: concurrent.futures.Future[None] | None, checkpoint: str) -> None:
    """Once the EMA's write finished (``future``: a background write), move it into its
    checkpoint folder (rank 0; the folder is shared)."""
    if future is not None:
        future.result()
    if not is_rank0():
        return
    with _MOVES:
        source = storage_for(staged)
        if not source.exists():
            return
        source.move_to(storage_for(str(join_path(checkpoint, EMA_FOLDER))))  # type: ignore[arg-type]
        if isinstance(source.root, Path):
            with contextlib.suppress(OSError):  # other EMAs still staged there
                source.root.parent.rmdir()
