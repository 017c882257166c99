"""torch's ``AveragedModel`` for EMAs and SWA, sharded:
``from dtensor_ema.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn``.

Same constructor, ``update_parameters(model)``, ``n_averaged``, ``use_buffers``,
``.module`` and forward, with every number from :class:`~dtensor_ema.ModelEMA`:

* the first ``update_parameters`` copies the model (``n_averaged == 0``), the next ones
  average: ``update_after_step=1`` (SWA: its schedule copies at step 1);
* ``multi_avg_fn=get_ema_multi_avg_fn(d)``: ``ConstantDecay(d)``, lerp (torch's kernel);
  ``avg_fn=get_ema_avg_fn(d)``: the same decay with ``formula="weighted_sum"``
  (``d * ema + (1 - d) * model``, as torch rounds it); no function: SWA's running mean,
  :class:`~dtensor_ema.decay.RunningMeanDecay`. Both torch's functions and this module's are
  recognized; any other averaging function cannot be mapped and raises ``ValueError``;
* ``use_buffers=False`` copies the buffers from the model on every call
  (``buffers="copy"``), ``True`` averages the float buffers.

Bit for bit equal to torch's ``AveragedModel`` (``tests/test_compat.py``), except integer
buffers (``num_batches_tracked``): they follow the model, where torch with
``use_buffers=True`` averages them too (and truncates). ``device`` must be the model's
device or ``None``. Float buffers are kept whole on every rank (``replicate_buffers=True``)
and each rank averages its own model's, as torch's replica on that rank does.

Evaluation (``.module``, forward) runs on a replica gathered once per validation pass:
``eval()``, or the first forward after an update, all-gathers the full parameters
(**collective**: every rank validates) and keeps them until the next
``update_parameters``, ``train()`` or load; each rank holds ``1/W`` of the parameters in
between (peak while gathered: one full copy per rank, what torch's replica keeps always).
``update_bn(loader, swa_model)`` recomputes the EMA's own BatchNorm statistics (each rank
its own, as torch). ``evaluation="sharded"`` (keyword) evaluates through the engine's
FSDP2 module instead (one unit gathered per forward: peak about the largest unit, 1.4-1.8x
the replica's time per batch on ResNet-50, ``benchmarks/compat_eval.py``); FSDP2/TP models
always do. The rank-0 save ``torch.save(swa_model.state_dict())`` works after
``gather_for_save()`` (or ``eval()``) on every rank and refuses naming that fix otherwise
(see :mod:`dtensor_ema.compat._replica`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import swa_utils as _torch_swa

from dtensor_ema.compat._replica import EmaReplica, fix_message, keeps_buffers_whole
from dtensor_ema.decay import ConstantDecay, DecaySchedule, RunningMeanDecay
from dtensor_ema.model_ema import ModelEMA

__all__ = ["AveragedModel", "get_ema_avg_fn", "get_ema_multi_avg_fn"]


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


def ema_of(fn: Callable[..., Any] | None, multi: bool) -> tuple[float, str] | None:
    """``(decay, formula)`` of an EMA averaging function from torch's factories, ``None``
    for none (SWA). Reads the factory's closure: torch exposes no other handle on the
    decay; a function it cannot read is refused rather than guessed."""
    if fn is None:
        return None
    tagged = getattr(fn, "ema_decay", None)
    if tagged is not None:
        return tuple(tagged)
    factory = "get_ema_multi_avg_fn" if multi else "get_ema_avg_fn"
    inner = inspect.unwrap(fn)  # torch.no_grad() wraps it
    code = getattr(inner, "__code__", None)
    if (
        getattr(inner, "__module__", None) == "torch.optim.swa_utils"
        and getattr(inner, "__qualname__", "").startswith(factory + ".")
        and code is not None
        and "decay" in code.co_freevars
    ):
        cell = inner.__closure__[code.co_freevars.index("decay")]
        return float(cell.cell_contents), "lerp" if multi else "weighted_sum"
    raise ValueError(
        f"{'multi_avg_fn' if multi else 'avg_fn'}={fn!r} cannot be mapped onto the sharded EMA: "
        "only torch.optim.swa_utils.get_ema_multi_avg_fn(decay) / get_ema_avg_fn(decay) (or "
        "none, for SWA's running mean) are supported"
    )


class AveragedModel(nn.Module):
    """torch's ``AveragedModel`` with each rank holding ``1/W`` of the average.

    Construction is collective where :class:`~dtensor_ema.ModelEMA`'s is (every rank);
    ``update_parameters`` is local; ``eval()``, ``gather_for_save()`` and the first forward
    after an update are collective over the EMA's mesh (see the module docstring).
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
        found = self.check_kwargs(avg_fn=avg_fn, multi_avg_fn=multi_avg_fn)
        if evaluation not in ("replica", "sharded"):
            raise ValueError(f"evaluation must be 'replica' or 'sharded', got {evaluation!r}")
        schedule: DecaySchedule = (
            RunningMeanDecay() if found is None else ConstantDecay(decay=found[0])
        )
        formula: Any = "lerp" if found is None else found[1]
        first = next(iter(model.parameters()))
        if device is not None and torch.device(device) != first.device:
            raise ValueError(
                f"device={device!r}: the sharded EMA lives on the model's device "
                f"({first.device}); it already holds 1/W of the model per rank"
            )
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers
        engine.setdefault("replicate_buffers", keeps_buffers_whole(model, evaluation))
        self._engine = ModelEMA(
            model,
            schedule=schedule,
            update_after_step=0 if found is None else 1,  # n_averaged == 0: copy
            buffers="average" if use_buffers else "copy",
            formula=formula,
            **engine,
        )
        self.evaluation = evaluation
        self._replica = EmaReplica(
            self._engine,
            fix_message("swa_model", also="`swa_model.eval()`"),
            sharded=evaluation == "sharded",
        )
        if not self._replica.sharded:  # registered as torch registers its copy
            self._modules["module"] = self._replica.module

    @staticmethod
    def check_kwargs(
        avg_fn: Callable[..., Any] | None = None,
        multi_avg_fn: Callable[..., Any] | None = None,
        **engine: Any,
    ) -> tuple[float, str] | None:
        """``(decay, formula)`` of the averaging function, ``None`` for SWA; raises for one
        that cannot be mapped (before any model exists: Lightning's callback checks early)."""
        if avg_fn is not None and multi_avg_fn is not None:
            raise AssertionError("Only one of avg_fn and multi_avg_fn should be provided")
        return ema_of(multi_avg_fn, True) or ema_of(avg_fn, False)

    @property
    def engine(self) -> ModelEMA:
        """The :class:`~dtensor_ema.ModelEMA` doing the work."""
        return self._engine

    @property
    def module(self) -> nn.Module:
        """The average as a module: the replica (parameters gathered by ``eval()``, the
        forward or ``gather_for_save()``; calling it while they are freed raises), or with
        ``evaluation="sharded"`` the engine's sharded module (collective forward)."""
        return self._replica.module

    @property
    def n_averaged(self) -> Tensor:
        return torch.tensor(self._engine.updates, dtype=torch.long)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The average's forward. **Collective** after an update (the gather; replica), or
        on every call (sharded)."""
        return self._replica.forward_module()(*args, **kwargs)

    def train(self, mode: bool = True) -> AveragedModel:
        """``eval()`` gathers the replica (**collective**); ``train()`` frees it (a forward
        in train mode, e.g. ``update_bn``, gathers it again)."""
        if mode:
            self._replica.release()
        else:
            self._replica.prepare_eval()
        if self._replica.sharded:
            self._replica.module.train(mode)
        return super().train(mode)

    def update_parameters(self, model: nn.Module) -> None:
        """One averaging step. Local: no communication. ``model`` must be the tracked one."""
        self._replica.release()
        self._engine.update(model)
        self._replica.changed()

    def materialize(self) -> None:
        """Gather the full average on every rank until the next update (replica), or to
        rank 0's CPU (sharded). **Collective**. Peak: one full copy of the parameters."""
        self._replica.materialize()

    def gather_for_save(self) -> None:
        """**Collective** (every rank) before a rank-0 ``torch.save(model.state_dict())``:
        the same as :meth:`materialize`."""
        self._replica.materialize()

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
