"""Options that shape every update, validated once, and saved with each checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dtensor_ema.decay import CallableDecay, DecaySchedule, HalfLifeDecay, RampDecay

__all__ = ["DEFAULT_DECAY", "DEFAULT_TAU", "UNSET", "EmaOptions", "resolve_schedule"]

DEFAULT_DECAY = 0.9999
DEFAULT_TAU = 2000

ExcludeSpec = Iterable[str] | Callable[[str, torch.Tensor], bool] | None


class _Unset:
    """Marks an argument the caller did not pass (``tau=None`` has a meaning of its own)."""

    def __repr__(self) -> str:
        return "<default>"


UNSET: Any = _Unset()


def resolve_schedule(
    decay: float | _Unset,
    tau: float | _Unset | None,
    half_life: float | None,
    schedule: DecaySchedule | Callable[[int], float] | None,
) -> DecaySchedule:
    """Pick the schedule from the one way the caller described it.

    ``decay``/``tau`` (yolov5 ramp, the default), ``half_life``, or an explicit
    ``schedule`` object or ``step -> decay`` callable: mixing them is an error, since the
    other values would be silently ignored.
    """
    given = [n for n, v in (("decay", decay), ("tau", tau)) if not isinstance(v, _Unset)]
    if schedule is not None:
        if given or half_life is not None:
            clash = given + (["half_life"] if half_life is not None else [])
            raise ValueError(
                f"schedule={schedule!r} conflicts with {', '.join(clash)}: put every decay "
                "setting into the schedule object"
            )
        if isinstance(schedule, type):
            raise TypeError(
                f"schedule must be a schedule instance or a function, got the class "
                f"{schedule.__name__}; instantiate it, e.g. {schedule.__name__}(decay=0.9999)"
            )
        if isinstance(schedule, DecaySchedule):
            return schedule
        return CallableDecay(schedule)
    if half_life is not None:
        if given:
            raise ValueError(
                f"half_life={half_life} conflicts with {', '.join(given)}: a half-life fixes "
                "the decay; pass one or the other"
            )
        return HalfLifeDecay(half_life=half_life)
    return RampDecay(
        decay=DEFAULT_DECAY if isinstance(decay, _Unset) else decay,
        tau=DEFAULT_TAU if isinstance(tau, _Unset) else tau,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class EmaOptions:
    """Everything besides the model and mesh that decides what ``update()`` does."""

    schedule: DecaySchedule
    """Per-step decay as a function of the averaging step (see :mod:`dtensor_ema.decay`)."""
    update_every: int = 1
    """Average on every ``update_every``-th ``update()`` call only (``>= 1``)."""
    update_after_step: int = 0
    """The first ``update_after_step`` calls copy the model instead of averaging (``>= 0``)."""
    buffers: Literal["average", "copy"] = "average"
    """Float buffers are averaged (yolov5) or copied from the model (timm ``exclude_buffers``)."""
    exclude: ExcludeSpec = None
    """Tensors copied from the model instead of averaged: fqns, or ``(fqn, tensor) -> bool``."""
    ema_dtype: torch.dtype | None = None
    """EMA dtype; ``None``: float32 for fp16/bf16 tensors, the model's dtype otherwise."""
    capturable: bool = False
    """Keep the counter and decay on the device so ``update()`` never synchronizes the host
    (for ``torch.compile``/CUDA graphs). Not part of the checkpoint config."""
    offload: bool = False
    """Keep the EMA shards in host memory, updated by a worker thread behind the training
    step. Not part of the checkpoint config."""
    kernel: Literal["eager", "compiled", "auto"] = "auto"
    """Update kernel: ``"eager"`` (``torch._foreach_lerp_``), ``"compiled"`` (one
    ``torch.compile``'d pass per group: each source value read once, bf16 upcast fused;
    same bits; the first update compiles, and falls back to eager with a warning where
    compiling is unavailable), or ``"auto"``: compiled only on device types where it was
    measured faster (none yet: eager). Not part of the checkpoint config."""
    cuda_graph: bool | None = None
    """Replay ``update()`` as a captured CUDA graph: ``True`` (on CUDA; ``ModelEMA`` raises
    naming the reason where it is not safe and exact, see
    :func:`dtensor_ema.cuda_graph.decide`), ``None`` (auto: eager for now, replay is opt-in
    until proven on hardware, :data:`dtensor_ema.cuda_graph.AUTO_REPLAY`) or ``False``
    (never). Not part of the checkpoint config."""
    formula: Literal["lerp", "weighted_sum", "subtract", "subtract_alpha"] = "lerp"
    """How an averaging step rounds ``d * ema + (1 - d) * model`` (see
    :data:`dtensor_ema.fused_update.FORMULAS`): ``"lerp"`` (default), or another library's
    rounding (eager kernel only)."""

    def __post_init__(self) -> None:
        for name in ("update_every", "update_after_step"):
            value = getattr(self, name)
            low = 1 if name == "update_every" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.buffers not in ("average", "copy"):
            raise ValueError(f"buffers must be 'average' or 'copy', got {self.buffers!r}")
        if self.ema_dtype is not None and not (
            isinstance(self.ema_dtype, torch.dtype) and self.ema_dtype.is_floating_point
        ):
            raise ValueError(
                f"ema_dtype must be a floating-point torch.dtype, got {self.ema_dtype!r}"
            )
        if self.kernel not in ("eager", "compiled", "auto"):
            raise ValueError(f"kernel must be 'eager', 'compiled' or 'auto', got {self.kernel!r}")
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            raise ValueError(
                f"cuda_graph must be None (auto), True or False, got {self.cuda_graph!r}"
            )
        if self.formula not in ("lerp", "weighted_sum", "subtract", "subtract_alpha"):
            raise ValueError(
                "formula must be 'lerp', 'weighted_sum', 'subtract' or 'subtract_alpha', got "
                f"{self.formula!r}"
            )
        if self.formula != "lerp" and (self.capturable or self.kernel == "compiled"):
            raise ValueError(
                f"formula={self.formula!r} has an eager kernel only: it cannot be combined "
                "with capturable=True or kernel='compiled'"
            )
        if self.capturable and self.offload:
            raise ValueError(
                "capturable=True and offload=True cannot be combined: a captured update "
                "cannot hand work to a host thread"
            )
        if isinstance(self.exclude, str):
            raise TypeError(
                f"exclude must be a collection of names or a predicate, got the string "
                f"{self.exclude!r}; wrap it in a list"
            )

    def copied_fqns(self, tensors: dict[str, torch.Tensor], parameters: set[str]) -> set[str]:
        """Float entries copied instead of averaged. Raises on unknown excluded names."""
        copied: set[str] = set()
        if self.buffers == "copy":
            copied |= {k for k, v in tensors.items() if k not in parameters}
        if self.exclude is None:
            return copied
        if callable(self.exclude):
            predicate = self.exclude
            return copied | {k for k, v in tensors.items() if predicate(k, v)}
        names = list(self.exclude)
        unknown = [n for n in names if n not in tensors]
        if unknown:
            raise ValueError(
                f"exclude names not found among the model's floating-point tensors: "
                f"{unknown[:5]}; valid names look like {list(tensors)[:3]}"
            )
        return copied | set(names)

    def config(self, copied: set[str]) -> dict[str, Any]:
        """Plain values that must match for a checkpoint to resume on the same trajectory."""
        return {
            "schedule": self.schedule.config(),
            "update_every": self.update_every,
            "update_after_step": self.update_after_step,
            "copied": sorted(copied),
            "ema_dtype": None if self.ema_dtype is None else str(self.ema_dtype),
        } | ({} if self.formula == "lerp" else {"formula": self.formula})
