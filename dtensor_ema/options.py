"""Options that shape every update, validated once, and saved with each checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from dtensor_ema.decay import CallableDecay, DecaySchedule, HalfLifeDecay, RampDecay

__all__ = [
    "DEFAULT_DECAY",
    "DEFAULT_TAU",
    "FORMULA_NAMES",
    "TRACKING_CONFIG_KEYS",
    "UNSET",
    "AveragingFunction",
    "EmaOptions",
    "TrackSpec",
    "check_int",
    "resolve_schedule",
]

DEFAULT_DECAY = 0.9999
DEFAULT_TAU = 2000

ExcludeSpec = Iterable[str] | Callable[[str, torch.Tensor], bool] | None
TrackSpec = Literal["all", "trainable"] | Callable[[str, torch.Tensor], bool]
"""Which floating-point tensors the EMA holds: ``"all"`` parameters and buffers (default),
the ``"trainable"`` parameters (``requires_grad=True``), or a predicate ``(fqn, tensor) ->
bool`` on canonical fqns and the model's live tensors."""

TRACKING_CONFIG_KEYS = ("track", "untracked")
"""Keys of :meth:`EmaOptions.config` that describe the tracked set rather than the update:
metadata, compared tensor by tensor (:func:`dtensor_ema.state.validate_state`) instead of as
options. Present only when some floating-point tensor is untracked."""

Formula = Literal["lerp", "weighted_sum", "subtract", "subtract_alpha", "divide", "swa"]

FORMULA_NAMES = ("lerp", "weighted_sum", "subtract", "subtract_alpha", "divide", "swa")
"""The ``formula`` option's values (see :data:`dtensor_ema.update.fused_update.FORMULAS`)."""

_COUNTED_FORMULAS = ("divide", "swa")
"""Formulas that read the averaging step (``n``), not only the decay."""


def check_int(name: str, value: Any, low: int) -> int:
    """``value``, if it is an ``int`` (not a ``bool``) ``>= low``.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class _Unset:
    """Marks an argument the caller did not pass (``tau=None`` has a meaning of its own)."""

    def __repr__(self) -> str:
        return "<default>"


UNSET: Any = _Unset()


@dataclass(frozen=True, slots=True)
class AveragingFunction:
    """A torch/Lightning averaging function in the schedule's place.

    ``ModelEMA(model, schedule=AveragingFunction(avg_fn))`` calls ``avg_fn(averaged,
    current, num_averaged) -> Tensor`` on every averaging update instead of lerping with a
    decay (``multi=True``: ``multi_avg_fn(averaged_list, current_list, num_averaged)``, which
    updates ``averaged_list`` in place), as torch's ``AveragedModel`` does. The calls that
    ``update_after_step`` covers copy the model; ``num_averaged`` is a 0-dim ``int64``
    tensor on the EMA's device holding the averaging step (1 at the first averaging update:
    the copy the EMA started from counts as one model).

    The contract, in one sentence: **the function must be elementwise** (each output element
    depends only on the same element of its inputs and on ``num_averaged``), because each
    rank applies it to its own rows of every tensor, one list per (device, dtype) group.
    Construction checks it by applying the function once to a small float32 CPU probe,
    whole and split by rows, and raises ``ValueError`` naming the function if the results
    differ. EMA, SWA and weighted sums of the two arguments all qualify; a norm, a mean
    over the tensor, or anything that reads a tensor's shape does not.

    An update is all or nothing: the results for every group are computed (and their
    shapes checked) before any is written (``multi_avg_fn`` on copies), so a function that
    raises leaves the EMA and ``updates`` as they were; peak extra memory: one copy of this
    rank's EMA shard. (An ``avg_fn`` that writes its first argument in place, instead of
    returning a new tensor, writes as it goes, as it would in torch.)

    The eager path runs it (one Python call per update and group, one per tensor for
    ``avg_fn``); torch's own factories (``get_ema_*``/``get_swa_*``) are mapped onto the
    fused formulas by the drop-ins instead. ``get_decay()``/``last_decay`` are ``nan``:
    the function, not a decay, sets each step. Picklable when the function is.
    """

    fn: Callable[..., Any]
    """``avg_fn`` or ``multi_avg_fn`` in torch's convention."""
    multi: bool = False
    """``True``: ``fn`` is a ``multi_avg_fn`` (lists, in place)."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"{self.kind} must be callable, got {self.fn!r}")
        if not isinstance(self.multi, bool):
            raise TypeError(f"multi must be a bool, got {self.multi!r}")
        self.check_elementwise()

    @property
    def kind(self) -> str:
        """``"multi_avg_fn"`` or ``"avg_fn"``."""
        return "multi_avg_fn" if self.multi else "avg_fn"

    @property
    def name(self) -> str:
        """``module.qualname`` of the function (or of its class, for a callable object)."""
        fn = self.fn
        qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        module = getattr(fn, "__module__", None) or type(fn).__module__
        return f"{module}.{qualname}"

    def apply_(
        self, averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor
    ) -> None:
        """One averaging step on lists of local tensors (same device and dtype), in place:
        :meth:`results`, then one ``_foreach_copy_``."""
        torch._foreach_copy_(averaged, self.results(averaged, current, num_averaged))

    def results(
        self, averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor
    ) -> list[torch.Tensor]:
        """The averages one step would write, computed without writing ``averaged``:
        ``avg_fn``'s return values (torch's ``AveragedModel`` passes ``p_avg.detach()``
        too, so a function that writes its first argument in place does write it), or
        ``multi_avg_fn`` applied to copies (it works in place by torch's contract). Peak
        extra memory: one tensor per input, the size of ``averaged``."""
        if self.multi:
            copies = [a.clone() for a in averaged]
            self.fn(copies, current, num_averaged)
            return copies
        return [self.fn(a, c, num_averaged) for a, c in zip(averaged, current, strict=True)]

    def check_elementwise(self) -> None:
        """Apply the function to a (7, 3) probe whole and split by rows (3, 1, 3 rows, as
        ranks hold them); raise ``ValueError`` naming it unless both give the same bits.
        Peak extra memory: a few probe-sized tensors."""
        g = torch.Generator().manual_seed(0)
        averaged = torch.randn(7, 3, generator=g)
        current = torch.randn(7, 3, generator=g)
        cuts = ((0, 3), (3, 4), (4, 7))
        try:
            whole = [averaged.clone()]
            self.apply_(whole, [current.clone()], torch.tensor(3))
            pieces = [averaged[a:b].clone() for a, b in cuts]
            self.apply_(pieces, [current[a:b].clone() for a, b in cuts], torch.tensor(3))
            split = torch.cat(pieces)
        except Exception as e:
            raise ValueError(
                f"{self.kind}={self.name} failed on a (7, 3) float32 probe split by rows "
                f"({type(e).__name__}: {e}); the sharded EMA applies it to each rank's rows "
                "of every tensor, so it must be elementwise"
            ) from e
        same = whole[0].shape == split.shape and bool(
            ((whole[0] == split) | (whole[0].isnan() & split.isnan())).all()
        )
        if not same:
            raise ValueError(
                f"{self.kind}={self.name} is not elementwise: applied to a (7, 3) float32 "
                "probe whole and split by rows it gives different results. The sharded EMA "
                "applies it to each rank's rows of every tensor, so each output element "
                "must depend only on the same element of its inputs (and num_averaged)"
            )

    def __call__(self, step: int) -> float:
        return math.nan  # no decay: the function sets each step

    def decay_for(self, step: int, update_every: int) -> float:
        return math.nan

    def decay_tensor_for(self, step: torch.Tensor, update_every: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.kind} has no device-side decay (capturable=True)")

    def config(self) -> dict[str, Any]:
        return {"schedule": self.kind, "name": self.name}


def _callable_name(fn: Callable[..., Any]) -> str:
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"<function {module}.{qualname}>"


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
        if isinstance(schedule, (DecaySchedule, AveragingFunction)):
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
    """Everything besides the model and mesh that decides what the EMA holds and what
    ``update()`` does: validated once here, then passed whole (to the plan, the counter,
    the update groups and the updater).

    Each field is the :class:`~dtensor_ema.ModelEMA` argument of the same name
    (``bucket_view``: ``parameters_as_bucket_view``), documented there. The checkpoint
    ``config`` (:meth:`config`) holds those that shape the averages: not ``capturable``,
    ``offload``, ``kernel``, ``cuda_graph``, ``bucket_view``, ``replicate_buffers``,
    ``verify_replicas``.
    """

    schedule: DecaySchedule
    """Per-step decay as a function of the averaging step (see :mod:`dtensor_ema.decay`), or
    an :class:`AveragingFunction` that replaces the decay."""
    update_every: int = 1
    update_after_step: int = 0
    buffers: Literal["average", "copy"] = "average"
    exclude: ExcludeSpec = None
    track: TrackSpec = "all"
    ema_dtype: torch.dtype | None = None
    capturable: bool = False
    offload: bool = False
    kernel: Literal["eager", "compiled", "auto"] = "auto"
    """Update kernel: ``"eager"`` (``torch._foreach_lerp_``), ``"compiled"`` (one
    ``torch.compile``'d pass per group: each source value read once, bf16 upcast fused;
    same bits; the first update compiles, and falls back to eager with a warning where
    compiling is unavailable), or ``"auto"``: compiled only on device types where it was
    measured faster (none yet: eager)."""
    cuda_graph: bool | None = None
    """Replay ``update()`` as a captured CUDA graph: ``True`` (on CUDA; ``ModelEMA`` raises
    naming the reason where it is not safe and exact, see
    :func:`dtensor_ema.update.cuda_graph.decide`), ``None`` (auto: eager for now, replay is opt-in
    until proven on hardware, :data:`dtensor_ema.update.cuda_graph.AUTO_REPLAY`) or ``False``
    (never)."""
    formula: Formula = "lerp"
    """How an averaging step rounds ``d * ema + (1 - d) * model`` (see
    :data:`dtensor_ema.update.fused_update.FORMULAS`): ``"lerp"`` (default), or another library's
    rounding (eager kernel only)."""
    bucket_view: bool = False
    replicate_buffers: bool = False
    verify_replicas: bool = True

    @classmethod
    def from_arguments(
        cls,
        *,
        decay: float | _Unset = UNSET,
        tau: float | _Unset | None = UNSET,
        half_life: float | None = None,
        schedule: DecaySchedule | Callable[[int], float] | None = None,
        parameters_as_bucket_view: bool = False,
        **fields: Any,
    ) -> EmaOptions:
        """The options of :class:`~dtensor_ema.ModelEMA`'s keyword arguments, by its names:
        the schedule from the one way the caller described it (:func:`resolve_schedule`),
        ``parameters_as_bucket_view`` as :attr:`bucket_view`, every other one by its name.

        Raises:
            TypeError, ValueError: as :func:`resolve_schedule` and the options' checks.
        """
        return cls(
            schedule=resolve_schedule(decay, tau, half_life, schedule),
            bucket_view=parameters_as_bucket_view,
            **fields,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any] | list[Any]) -> None:
        """Unpickle; a state pickled before ``bucket_view``, ``replicate_buffers`` and
        ``verify_replicas`` joined the options (a list of the older fields, in order)
        gets their defaults."""
        names = [f.name for f in fields(self)]
        values = dict(zip(names, state, strict=False)) if isinstance(state, list) else state
        for f in fields(self):
            object.__setattr__(self, f.name, values.get(f.name, f.default))

    def __post_init__(self) -> None:
        check_int("update_every", self.update_every, 1)
        check_int("update_after_step", self.update_after_step, 0)
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
        if self.formula not in FORMULA_NAMES:
            raise ValueError(f"formula must be one of {FORMULA_NAMES}, got {self.formula!r}")
        if self.function is not None:
            clash = [
                f"{name}={value!r}"
                for name, value, default in (
                    ("update_every", self.update_every, 1),
                    ("formula", self.formula, "lerp"),
                    ("capturable", self.capturable, False),
                )
                if value != default
            ] + (["kernel='compiled'"] if self.kernel == "compiled" else [])
            if clash:
                raise ValueError(
                    f"{self.function.kind}={self.function.name} cannot be combined with "
                    f"{', '.join(clash)}: the function sets each averaging step itself, on "
                    "the eager path"
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
        if self.exclude is not None and not callable(self.exclude):
            # A tuple, read more than once (a generator would be used up by the first read).
            object.__setattr__(self, "exclude", tuple(self.exclude))
        for name, user_name in (
            ("bucket_view", "parameters_as_bucket_view"),
            ("replicate_buffers", "replicate_buffers"),
            ("verify_replicas", "verify_replicas"),
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{user_name} must be a bool, got {getattr(self, name)!r}")
        if not (self.track in ("all", "trainable") or callable(self.track)):
            raise ValueError(
                f"track must be 'all', 'trainable' or a predicate (fqn, tensor) -> bool, got "
                f"{self.track!r}"
            )

    @property
    def function(self) -> AveragingFunction | None:
        """The averaging function in the schedule's place, if any."""
        return self.schedule if isinstance(self.schedule, AveragingFunction) else None

    @property
    def counted(self) -> bool:
        """Whether an averaging step needs the step count (``num_averaged``), not only the
        decay: averaging functions and the ``"divide"``/``"swa"`` formulas."""
        return self.function is not None or self.formula in _COUNTED_FORMULAS

    def tracks(self, fqn: str, tensor: torch.Tensor, is_parameter: bool) -> bool:
        """Whether the EMA holds the floating-point tensor ``fqn`` (see :data:`TrackSpec`).

        Raises:
            TypeError: a ``track`` predicate returned something other than a bool.
        """
        if self.track == "all":
            return True
        if self.track == "trainable":
            return is_parameter and tensor.requires_grad
        assert callable(self.track)
        chosen = self.track(fqn, tensor)
        if not isinstance(chosen, bool):
            raise TypeError(
                f"the track predicate must return a bool, got {type(chosen).__name__} for {fqn!r}"
            )
        return chosen

    def track_label(self) -> str:
        """``"all"``, ``"trainable"`` or ``"predicate"``: how the tracked set was chosen."""
        return self.track if isinstance(self.track, str) else "predicate"

    def check_exclude(self, tracked: Iterable[str], untracked: Iterable[str] = ()) -> None:
        """Refuse ``exclude`` names that are not tracked floating-point tensors (``exclude``
        applies within the tracked set). A predicate is not checked.

        Raises:
            ValueError: naming the unknown names (untracked ones named as such).
        """
        if self.exclude is None or callable(self.exclude):
            return
        tracked = list(tracked)
        known = set(tracked)
        unknown = [n for n in self.exclude if n not in known]
        if not unknown:
            return
        skipped = set(untracked)
        not_tracked = [n for n in unknown if n in skipped]
        detail = (
            f" ({not_tracked[:5]} are not tracked with track={self.track_label()!r}: "
            "exclude applies within the tracked set)"
            if not_tracked
            else ""
        )
        raise ValueError(
            f"exclude names not found among the EMA's tracked floating-point tensors: "
            f"{unknown[:5]}{detail}; valid names look like {tracked[:3]}"
        )

    def is_copied(self, fqn: str, tensor: torch.Tensor, is_parameter: bool) -> bool:
        """Whether the tracked tensor ``fqn`` is copied from the model instead of averaged
        (``buffers="copy"`` for buffers, ``exclude``)."""
        if self.buffers == "copy" and not is_parameter:
            return True
        if self.exclude is None:
            return False
        if callable(self.exclude):
            return bool(self.exclude(fqn, tensor))
        return fqn in self.exclude

    def agreement(self) -> dict[str, str]:
        """Every option that shapes the EMA, as text, for the ranks to compare at
        construction: each rank of the world must build the EMA with the same values (a
        decay that differs between ranks would stitch rows of two EMAs together).
        Predicates and functions are named by their qualified name (``module.qualname``),
        ``exclude`` names sorted; ``verify_replicas`` (a check, not a property of the EMA)
        is left out."""
        # Names in a fixed order: a set iterates in an order each process's hash seed decides.
        exclude = self.exclude
        exclude = _callable_name(exclude) if callable(exclude) else sorted(exclude or ())
        track = self.track if isinstance(self.track, str) else _callable_name(self.track)
        schedule = dict(self.schedule.config())
        values: dict[str, Any] = {"schedule": schedule.pop("schedule", type(self.schedule))}
        values |= {("schedule function" if k == "name" else k): v for k, v in schedule.items()}
        values |= {
            "update_every": self.update_every,
            "update_after_step": self.update_after_step,
            "buffers": self.buffers,
            "exclude": exclude,
            "track": track,
            "ema_dtype": self.ema_dtype,
            "capturable": self.capturable,
            "offload": self.offload,
            "kernel": self.kernel,
            "cuda_graph": self.cuda_graph,
            "formula": self.formula,
            "parameters_as_bucket_view": self.bucket_view,
            "replicate_buffers": self.replicate_buffers,
        }
        return {k: str(v) for k, v in values.items()}

    def config(self, copied: set[str], untracked: Iterable[str] = ()) -> dict[str, Any]:
        """Plain values that must match for a checkpoint to resume on the same trajectory,
        plus (only when some float tensor is untracked) the tracked set's description
        under :data:`TRACKING_CONFIG_KEYS`: metadata, checked tensor by tensor."""
        untracked = sorted(untracked)
        tracking = {"track": self.track_label(), "untracked": untracked} if untracked else {}
        return (
            {
                "schedule": self.schedule.config(),
                "update_every": self.update_every,
                "update_after_step": self.update_after_step,
                "copied": sorted(copied),
                "ema_dtype": None if self.ema_dtype is None else str(self.ema_dtype),
            }
            | ({} if self.formula == "lerp" else {"formula": self.formula})
            | tracking
        )
