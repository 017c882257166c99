"""torch's ``AveragedModel`` for EMAs and SWA, sharded:
``from dtensor_ema.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn``.

Same constructor, ``update_parameters(model)``, ``n_averaged``, ``use_buffers``,
``.module`` and forward, with every number from :class:`~dtensor_ema.ModelEMA`; the names
torch's tests import (``get_ema_multi_avg_fn``, ``get_ema_avg_fn``, ``get_swa_multi_avg_fn``,
``get_swa_avg_fn``, ``update_bn``) are here too. The first ``update_parameters`` copies the
model (``n_averaged == 0``), the next ones average with any averaging function
(:func:`averaging_of`: torch's factories on the fused path, any other elementwise callable
on each rank's pieces); ``use_buffers=False`` copies the buffers on every call. Bit for bit
equal to torch's ``AveragedModel`` (``tests/test_compat_upstream.py``), except integer
buffers, which follow the model. ``device`` must be the model's device or ``None``. Float
buffers are kept whole on every rank, each averaging its own model's, as torch's replica on
that rank does.

Evaluation (``.module``, forward) and the rank-0 save ``torch.save(swa_model.state_dict())``
follow the drop-ins' shared rules (:class:`~dtensor_ema.compat._replica.ReplicaFacade`):
``eval()`` or ``gather_for_save()`` all-gathers the full parameters (**collective**: every
rank; peak one full copy per rank, what torch's replica keeps always) until the next
``update_parameters`` or load (``train()`` keeps them: ``update_bn(loader, swa_model)``
recomputes the average's own BatchNorm statistics, each rank its own, as torch).
``evaluation="sharded"`` evaluates through the engine's FSDP2 module instead (FSDP2/TP
models always do). The guide: ``docs/migration-swa-utils.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import swa_utils as _torch_swa

from dtensor_ema.compat._replica import ReplicaFacade, fix_message, keeps_buffers_whole
from dtensor_ema.decay import ConstantDecay, DecaySchedule, RunningMeanDecay
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.options import AveragingFunction

__all__ = [
    "AveragedModel",
    "averaging_of",
    "get_ema_avg_fn",
    "get_ema_multi_avg_fn",
    "get_swa_avg_fn",
    "get_swa_multi_avg_fn",
    "update_bn",
]

get_swa_multi_avg_fn = _torch_swa.get_swa_multi_avg_fn
"""torch's function, re-exported (mapped onto the fused running mean, ``"lerp"``)."""
get_swa_avg_fn = _torch_swa.get_swa_avg_fn
"""torch's function, re-exported (mapped onto the fused running mean, ``"divide"``)."""
update_bn = _torch_swa.update_bn
"""torch's ``update_bn``: recomputes the BatchNorm statistics of the average's module."""


def get_ema_multi_avg_fn(decay: float = 0.999) -> Callable[..., None]:
    """torch's function (usable with torch's ``AveragedModel`` too), tagged with its decay."""
    fn = _torch_swa.get_ema_multi_avg_fn(decay)
    fn.ema_decay = (decay, "lerp")
    return fn


def get_ema_avg_fn(decay: float = 0.999) -> Callable[..., Tensor]:
    """torch's function, tagged with its decay."""
    fn = _torch_swa.get_ema_avg_fn(decay)
    fn.ema_decay = (decay, "weighted_sum")
    return fn


def _torch_factory(fn: Callable[..., Any]) -> str | None:
    """The name of the ``torch.optim.swa_utils`` factory that made ``fn``, if one did."""
    inner = inspect.unwrap(fn)  # torch.no_grad() wraps it
    if getattr(inner, "__module__", None) != "torch.optim.swa_utils":
        return None
    factory = getattr(inner, "__qualname__", "").partition(".<locals>")[0]
    return factory if factory.startswith(("get_ema_", "get_swa_")) else None


def averaging_of(
    avg_fn: Callable[..., Any] | None, multi_avg_fn: Callable[..., Any] | None
) -> tuple[DecaySchedule | AveragingFunction, str, int]:
    """``(schedule, formula, update_after_step)`` of the engine for torch's arguments.

    torch's factories (and this module's re-exports) take the fused formulas, bit for bit:
    ``get_ema_multi_avg_fn(d)``: ``ConstantDecay(d)``, ``"lerp"``; ``get_ema_avg_fn(d)``:
    ``"weighted_sum"``; ``get_swa_multi_avg_fn()``: ``RunningMeanDecay``, ``"lerp"``;
    ``get_swa_avg_fn()``: ``"divide"``; no function: ``"swa"`` (torch's device rule: lerp
    on CUDA, divide on CPU). Any other callable runs on the eager path as an
    :class:`~dtensor_ema.options.AveragingFunction` (checked to be elementwise: raises
    ``ValueError`` naming it otherwise). The decay of torch's EMA factories is read from
    their closure, torch's only handle on it.
    """
    if avg_fn is not None and multi_avg_fn is not None:
        raise AssertionError("Only one of avg_fn and multi_avg_fn should be provided")
    multi = multi_avg_fn is not None
    fn = multi_avg_fn if multi else avg_fn
    if fn is None:
        return RunningMeanDecay(), "swa", 0
    tagged = getattr(fn, "ema_decay", None)
    if tagged is not None:
        return ConstantDecay(decay=tagged[0]), tagged[1], 1
    factory = _torch_factory(fn)
    if factory == ("get_swa_multi_avg_fn" if multi else "get_swa_avg_fn"):
        return RunningMeanDecay(), "lerp" if multi else "divide", 0
    if factory == ("get_ema_multi_avg_fn" if multi else "get_ema_avg_fn"):
        inner = inspect.unwrap(fn)
        code = inner.__code__
        if "decay" in code.co_freevars and inner.__closure__ is not None:
            cell = inner.__closure__[code.co_freevars.index("decay")]
            return (
                ConstantDecay(decay=float(cell.cell_contents)),
                ("lerp" if multi else "weighted_sum"),
                1,
            )
    return AveragingFunction(fn, multi=multi), "lerp", 1


class AveragedModel(ReplicaFacade):
    """torch's ``AveragedModel`` with each rank holding ``1/W`` of the average.

    Construction is collective where :class:`~dtensor_ema.ModelEMA`'s is (every rank);
    ``update_parameters``, ``train()`` and the replica's forward are local; ``eval()`` and
    ``gather_for_save()`` are collective over the EMA's mesh (see the module docstring).
    ``evaluation`` and ``mesh`` (keyword only) are ours; other keywords go to ``ModelEMA``.
    """

    def __init__(
        self,
        model: nn.Module,
        device: int | torch.device | None = None,
        avg_fn: Callable[[Tensor, Tensor, Tensor | int], Tensor] | None = None,
        multi_avg_fn: Callable[..., None] | None = None,
        use_buffers: bool = False,
        *,
        evaluation: Literal["replica", "sharded"] = "replica",
        **engine: Any,
    ) -> None:
        super().__init__()
        schedule, formula, after = self.check_kwargs(avg_fn=avg_fn, multi_avg_fn=multi_avg_fn)
        self.check_evaluation(evaluation)
        first = next(iter(model.parameters()))
        if device is not None and torch.device(device) != first.device:
            raise ValueError(
                f"device={device!r}: the sharded EMA lives on the model's device "
                f"({first.device}); it already holds 1/W of the model per rank"
            )
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers
        engine.setdefault("replicate_buffers", keeps_buffers_whole(model, evaluation))
        average = ModelEMA(
            model,
            schedule=schedule,
            update_after_step=after,  # the first call (n_averaged == 0) copies
            buffers="average" if use_buffers else "copy",
            formula=formula,
            **engine,
        )
        # The replica registered as torch registers its copy.
        self.attach(average, fix_message("swa_model", also="`swa_model.eval()`"), evaluation)

    @staticmethod
    def check_kwargs(
        avg_fn: Callable[..., Any] | None = None,
        multi_avg_fn: Callable[..., Any] | None = None,
        **engine: Any,
    ) -> tuple[DecaySchedule | AveragingFunction, Any, int]:
        """:func:`averaging_of` the averaging function; raises for one that is not
        elementwise (before any model exists: Lightning's callback checks early)."""
        return averaging_of(avg_fn, multi_avg_fn)

    @property
    def module(self) -> nn.Module:
        """The average as a module: the replica (parameters gathered by ``eval()``, the
        forward or ``gather_for_save()``; calling it while they are freed raises), or with
        ``evaluation="sharded"`` the engine's sharded module (collective forward)."""
        return self._replica.module

    @property
    def n_averaged(self) -> Tensor:
        return torch.tensor(self._engine.updates, dtype=torch.long)

    def update_parameters(self, model: nn.Module) -> None:
        """One averaging step. Local: no communication. ``model`` must be the tracked one."""
        self._change(lambda: self._engine.update(model))

    def reset_to(self, model: nn.Module) -> None:
        """Copy ``model`` (the tracked one) into the average, keeping ``n_averaged``.
        Local."""
        self._change(lambda: self._engine.set(model))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """torch's keys (``module.*``, ``n_averaged``) with full tensors. Local; when
        sharded, after ``gather_for_save()`` (or ``eval()``) on every rank, else raises."""
        full = self._replica.full_state("AveragedModel.state_dict()")
        return {f"module.{k}": v for k, v in full.items()} | {"n_averaged": self.n_averaged}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, **_: Any) -> Any:  # type: ignore[override]
        """Load full tensors (every rank the same; each keeps its piece). Local."""
        ema = {k[7:]: v for k, v in state_dict.items() if k.startswith("module.")}
        self._engine.load_full_state_dict(ema, updates=int(state_dict["n_averaged"]))
        self._replica.changed()
