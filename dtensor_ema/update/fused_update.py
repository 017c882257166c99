"""The update kernels: one fused pass per group of local tensors.

The EMA update is memory-bound (it costs about a ``copy_`` of the same bytes), so the only
things worth optimizing are the bytes touched and the per-call dispatch: tensors are grouped
once at construction by (averaged or copied, device, EMA dtype, source dtype) and each group
is updated by one kernel on cached local views:

* ``"eager"``: ``torch._foreach_lerp_`` (``_foreach_copy_`` for copies); mixed dtypes (bf16
  model, fp32 EMA) upcast through a reused scratch buffer first.
* ``"compiled"``: :class:`~dtensor_ema.update.compiled_lerp.CompiledLerp`, one pass that reads
  each source value once (upcast in registers) and reads and writes each EMA value once,
  for K EMAs of the same sources at a time. Same bits as eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dtensor_ema.options import AveragingFunction
from dtensor_ema.plan import EmaPlan
from dtensor_ema.update.compiled_lerp import (
    COMPILED_EMA_DTYPES,
    CompiledLerp,
    compile_unavailable_reason,
    warn_unavailable,
)

__all__ = [
    "FOREACH_DEVICE_TYPES",
    "CountedStep",
    "UpdateGroup",
    "apply_groups_",
    "lerp_groups_",
    "lerp_step_",
    "resolve_kernel",
    "update_groups",
]


COMPILED_BY_DEFAULT: frozenset[str] = frozenset()
"""Device types on which ``kernel="auto"`` picks the compiled kernel: those where it was
measured faster than eager (``benchmarks/kernels.py``; CPU: not faster, see its README)."""


def _foreach_device_types() -> tuple[str, ...]:
    """The device types on which torch's ``AveragedModel`` takes its foreach (lerp) path
    when no averaging function is given. torch keeps the list in a private helper; wrapped
    here, with the list it returned in torch 2.6-2.14 as the fallback."""
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        return tuple(_get_foreach_kernels_supported_devices())
    except Exception:  # moved or renamed in a later torch
        return ("cuda", "xpu", "mtia", torch._C._get_privateuse1_backend_name())


FOREACH_DEVICE_TYPES: tuple[str, ...] = _foreach_device_types()
"""Device types where the ``"swa"`` formula lerps (torch's foreach rule); it divides on
the others (CPU)."""


class CountedStep(float):
    """A step's decay (a float: every updater reads it as one) that also carries ``count``,
    the averaging step ``updates - update_after_step``, for the formulas that need it
    (``"divide"``, ``"swa"``) and averaging functions (their ``num_averaged``)."""

    count: int

    def __new__(cls, decay: float, count: int) -> CountedStep:
        step = super().__new__(cls, decay)
        step.count = count
        return step


def resolve_kernel(kernel: str, device: torch.device, ema_dtype: torch.dtype) -> str:
    """``"eager"`` or ``"compiled"`` for a group on ``device`` with EMA dtype ``ema_dtype``.

    ``"compiled"`` falls back to eager (silently) for EMA dtypes the compiled kernel does
    not cover, and (with a one-line warning, once) where ``torch.compile`` is unavailable.
    """
    if kernel == "auto":
        kernel = "compiled" if device.type in COMPILED_BY_DEFAULT else "eager"
    if kernel == "compiled" and ema_dtype not in COMPILED_EMA_DTYPES:
        return "eager"
    if kernel == "compiled":
        reason = compile_unavailable_reason(device)
        if reason is not None:
            warn_unavailable(device.type, reason)
            return "eager"
    return kernel


@dataclass(slots=True)
class UpdateGroup:
    """Local tensors that one fused call updates: same device, EMA dtype, source dtype."""

    ema_locals: list[torch.Tensor]
    source_locals: list[torch.Tensor]
    averaged: bool
    """``False``: the EMA copies the sources (excluded tensors, copied buffers)."""
    kernel: str = "eager"
    """``"eager"`` or ``"compiled"`` (resolved: see :func:`resolve_kernel`)."""
    formula: str = "lerp"
    """How an averaging step combines EMA and source: see :data:`FORMULAS` (``"swa"`` is
    resolved per device by :func:`update_groups`; ``"function"``: :attr:`function`)."""
    function: AveragingFunction | None = None
    """The averaging function that replaces the formula (``formula == "function"``)."""
    _cache: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = field(default_factory=dict)
    """Per (kind, partner groups, sources list): staged upcast plans, compiled kernels and
    weight tensors, built on first use so later updates only launch kernels."""
    plain_lerp: bool = False
    """An eager lerp of sources already in the EMA dtype: one ``_foreach_lerp_`` a step."""

    def sources_in_ema_dtype(self, sources: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The sources (default: the source locals), upcast (a temporary copy) when their
        dtype is not the EMA's."""
        sources = self.source_locals if sources is None else sources
        dtype = self.ema_locals[0].dtype
        if sources[0].dtype == dtype:
            return sources
        return [s.to(dtype) for s in sources]

    def apply_(self, decay: float, sources: list[torch.Tensor] | None = None) -> None:
        """``ema.lerp_(source, 1 - decay)`` (or the group's :data:`FORMULAS` entry); a copy
        for copied tensors or ``decay == 0`` (except with the ``"subtract"`` formulas, which
        compute ``ema - (ema - source)`` then, as diffusers does).

        ``sources``: what to read instead of the source locals (a staged host copy); same
        shapes, any float dtype. ``"divide"`` and averaging functions read the step count
        from a :class:`CountedStep`.
        """
        if not self.averaged or (decay == 0.0 and not self.formula.startswith("subtract")):
            lerp_step_(self.ema_locals, self.source_locals if sources is None else sources, 0.0)
        elif self.function is not None or self.formula == "divide":
            count = getattr(decay, "count", None)
            assert count is not None, f"formula {self.formula!r} needs a CountedStep"
            num = torch.tensor(count, dtype=torch.int64, device=self.ema_locals[0].device)
            sources = self.sources_in_ema_dtype(sources)
            if self.function is not None:
                self.function.apply_(self.ema_locals, sources, num)
            else:
                divide_(self.ema_locals, sources, num)
        elif self.formula != "lerp":
            combine_(self.ema_locals, self.sources_in_ema_dtype(sources), decay, self.formula)
        elif self.plain_lerp and sources is None:  # the common step: no Python in between
            torch._foreach_lerp_(self.ema_locals, self.source_locals, 1.0 - decay)
        else:
            lerp_groups_([self], [1.0 - decay], sources)

    def computes_results(self, decay: float) -> bool:
        """Whether :meth:`apply_` with ``decay`` runs the averaging function (whose
        results :func:`apply_groups_` computes for every group before writing any)."""
        return self.function is not None and self.averaged and decay != 0.0

    def function_results(
        self, decay: float, sources: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """What the averaging function would write for ``decay`` (a :class:`CountedStep`),
        without writing the EMA (:meth:`AveragingFunction.results`)."""
        assert self.function is not None
        count = getattr(decay, "count", None)
        assert count is not None, "an averaging function needs a CountedStep"
        num = torch.tensor(count, dtype=torch.int64, device=self.ema_locals[0].device)
        return self.function.results(self.ema_locals, self.sources_in_ema_dtype(sources), num)

    def copy_(self) -> None:
        """Copy the sources into the EMA (``set()``), whatever the formula."""
        torch._foreach_copy_(self.ema_locals, self.source_locals)

    def apply_weight_(self, weight: torch.Tensor) -> None:
        """``ema.lerp_(source, weight)`` with a 0-dim device tensor: no host sync.

        ``weight`` 0 leaves the EMA unchanged and 1 copies the source, exactly (the lerp
        kernel computes ``end - (end - start) * (1 - w)`` for ``w >= 0.5``).
        """
        weight = weight.to(self.ema_locals[0].dtype)
        if self.kernel == "compiled":
            kernel = self.cached(("compiled",), (), lambda: CompiledLerp([self.ema_locals]))
            if kernel(self.source_locals, [weight]):
                return
            self.kernel = "eager"
        # Eager: lerp_groups_'s path, mixed dtypes upcast through its reused scratch, so a
        # step's temporaries stay bounded (and a CUDA graph's pool small).
        lerp_groups_([self], [weight])

    def cached(self, key: tuple[Any, ...], pins: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key``; ``pins`` are the objects whose ``id`` is in the key,
        kept alive and compared so a recycled ``id`` can never hit a stale entry."""
        hit = self._cache.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], pins, strict=True)):
            return hit[1]
        value = build()
        self._cache[key] = (pins, value)
        return value


FORMULAS = ("lerp", "weighted_sum", "subtract", "subtract_alpha", "divide", "swa")
"""Averaging formulas, all ``d * ema + (1 - d) * source`` in exact arithmetic, rounded as
the library each one reproduces rounds them (they differ in the last float bit):

* ``"lerp"``: ``ema.lerp_(source, 1 - d)`` (timm, ultralytics, ema-pytorch, torch
  ``get_ema_multi_avg_fn``); the default, and the only one the compiled, capturable and
  multi-EMA paths implement;
* ``"weighted_sum"``: ``d * ema + (1 - d) * source``, each product rounded (torch
  ``get_ema_avg_fn``, Lightning ``EMAWeightAveraging``);
* ``"subtract"``: ``ema - (1 - d) * (ema - source)`` (diffusers ``EMAModel``);
* ``"subtract_alpha"``: the same through ``_foreach_sub_(ema, ema - source, alpha=1 - d)``,
  which rounds the product and difference together (diffusers ``foreach=True``).

* ``"divide"``: ``ema + (source - ema) / n`` with ``n`` the averaging step as an int64
  tensor, so ``1 - d = 1 / n`` (torch ``get_swa_avg_fn``, and ``AveragedModel`` without a
  function on CPU; use it with :class:`~dtensor_ema.decay.RunningMeanDecay`);
* ``"swa"``: torch ``AveragedModel``'s rule without a function, per device: ``"lerp"`` on
  device types with foreach kernels (:data:`FOREACH_DEVICE_TYPES`: CUDA), ``"divide"``
  elsewhere (CPU).

The ``subtract`` formulas are applied at ``d = 0`` too (``ema - (ema - source)``), as
diffusers does, instead of a copy.
"""


def divide_(emas: list[torch.Tensor], sources: list[torch.Tensor], n: torch.Tensor) -> None:
    """``ema + (source - ema) / n`` in place, ``n`` a 0-dim int64 tensor on the EMAs'
    device: the bits of torch's ``get_swa_avg_fn`` (a true division, also on CUDA, where a
    Python scalar divisor would become a reciprocal multiply). Peak extra memory: one
    temporary of the size of ``sources``."""
    diff = torch._foreach_sub(sources, emas)
    torch._foreach_div_(diff, n)
    torch._foreach_add_(emas, diff)


def combine_(
    emas: list[torch.Tensor], sources: list[torch.Tensor], decay: float, formula: str
) -> None:
    """One averaging step with a non-lerp ``formula`` (see :data:`FORMULAS`), in place on
    ``emas``. Peak extra memory: one temporary of the size of ``sources``."""
    weight = 1.0 - decay
    if formula == "weighted_sum":
        scaled = torch._foreach_mul(sources, weight)
        torch._foreach_mul_(emas, decay)
        torch._foreach_add_(emas, scaled)
    elif formula == "subtract":
        diff = torch._foreach_sub(emas, sources)
        torch._foreach_mul_(diff, weight)
        torch._foreach_sub_(emas, diff)
    elif formula == "subtract_alpha":
        torch._foreach_sub_(emas, torch._foreach_sub(emas, sources), alpha=weight)
    else:
        raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")


def lerp_step_(emas: list[torch.Tensor], sources: list[torch.Tensor], decay: float) -> None:
    """The eager ``"lerp"`` step on explicit lists (one device): a copy for ``decay == 0``
    (``_foreach_copy_``, any source dtype), else ``ema.lerp_(source, 1 - decay)``
    (``_foreach_lerp_``; sources already in the EMA dtype). What :meth:`UpdateGroup.apply_`
    and :func:`lerp_groups_` run on a group's cached views, and the chunked offload
    pipeline on its device scratch. Peak extra memory: none."""
    if decay == 0.0:
        torch._foreach_copy_(emas, sources)
    else:
        torch._foreach_lerp_(emas, sources, 1.0 - decay)


def lerp_groups_(
    groups: Sequence[UpdateGroup],
    weights: Sequence[float | torch.Tensor],
    sources: list[torch.Tensor] | None = None,
) -> None:
    """``group.ema_locals[i].lerp_(sources[i], w)`` for every (group, w): K EMAs of the
    same sources (default: the first group's source locals) with aligned tensors; ``w`` a
    float or a 0-dim tensor of the EMA dtype on the EMA device (no host sync).

    Compiled kernel: one pass over each source for all K EMAs. Eager: one
    ``_foreach_lerp_`` per EMA; mixed dtypes upcast each slice of sources once into a
    reused scratch buffer (at most ``UPCAST_CHUNK`` elements), then lerp every EMA from it.
    """
    lead = groups[0]
    sources = lead.source_locals if sources is None else sources
    pins = (*groups, sources)
    if lead.kernel == "compiled":
        kernel = lead.cached(
            ("compiled", *map(id, pins)),
            pins,
            lambda: CompiledLerp([g.ema_locals for g in groups]),
        )
        tensors = lead.cached(
            ("weights", len(groups)),
            (),
            lambda: [
                torch.zeros((), dtype=lead.ema_locals[0].dtype, device=lead.ema_locals[0].device)
                for _ in groups
            ],
        )
        for tensor, weight in zip(tensors, weights, strict=True):
            tensor.fill_(weight)  # rounds like eager's scalar weight: to the EMA dtype
        if kernel(sources, tensors):
            return
        for g in groups:
            g.kernel = "eager"
    if sources[0].dtype == lead.ema_locals[0].dtype:
        for group, weight in zip(groups, weights, strict=True):
            _lerp_(group.ema_locals, sources, weight)
        return
    staged = lead.cached(
        ("staged", *map(id, pins)),
        pins,
        lambda: _staged_batches([g.ema_locals for g in groups], sources),
    )
    for batch in staged:
        if batch.scratch:
            torch._foreach_copy_(batch.scratch, batch.sources)
            upcast = batch.scratch
        else:  # non-contiguous tensors: the plain upcast
            upcast = [s.to(batch.emas[0][0].dtype) for s in batch.sources]
        for emas, weight in zip(batch.emas, weights, strict=True):
            _lerp_(emas, upcast, weight)


def _lerp_(
    emas: list[torch.Tensor], sources: list[torch.Tensor], weight: float | torch.Tensor
) -> None:
    """``_foreach_lerp_`` with a float or a 0-dim device tensor ``weight``; the tensor goes
    in as a list of it, the overload that reads it on the device (no host sync)."""
    if isinstance(weight, torch.Tensor):
        torch._foreach_lerp_(emas, sources, [weight] * len(emas))
    else:
        torch._foreach_lerp_(emas, sources, weight)


UPCAST_CHUNK = 1 << 24
"""Elements of the reused upcast scratch buffer (64 MiB in float32)."""


@dataclass(slots=True)
class _StagedBatch:
    emas: list[list[torch.Tensor]]
    """K lists of EMA slices, aligned with ``sources``."""
    sources: list[torch.Tensor]
    scratch: list[torch.Tensor]
    """Views of the shared scratch buffer, one per source; empty: upcast on the fly."""


def _staged_batches(
    emas: list[list[torch.Tensor]], sources: list[torch.Tensor]
) -> list[_StagedBatch]:
    """Cut contiguous (EMAs, source) tuples of more than ``UPCAST_CHUNK`` elements into
    flat slices of at most that (smaller ones stay whole) and pack them into batches that
    fit one scratch buffer, sliced to their shapes. Built once: the
    slices are views, so later updates only launch kernels. Fresh fp32 temporaries per
    step instead cost 4-5x more on CPU, where fresh pages cost more than the arithmetic
    (benchmarks/bf16_paths.py)."""
    k = len(emas)
    slices: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    loose = _StagedBatch([[] for _ in range(k)], [], [])
    for i, source in enumerate(sources):
        column = [e[i] for e in emas]
        if not (source.is_contiguous() and all(e.is_contiguous() for e in column)):
            for out, ema in zip(loose.emas, column, strict=True):
                out.append(ema)
            loose.sources.append(source)
            continue
        if source.numel() <= UPCAST_CHUNK:  # whole: an in-place op on a view costs more
            slices.append((column, source))
            continue
        flat_source = source.view(-1)
        flat = [e.view(-1) for e in column]
        for start in range(0, flat_source.numel(), UPCAST_CHUNK):
            end = start + UPCAST_CHUNK
            slices.append(([f[start:end] for f in flat], flat_source[start:end]))
    batches = [loose] if loose.sources else []
    if not slices:
        return batches
    first = slices[0][0][0]
    total = sum(s.numel() for _, s in slices)
    scratch = torch.empty(min(total, UPCAST_CHUNK), dtype=first.dtype, device=first.device)
    batch, used = _StagedBatch([[] for _ in range(k)], [], []), 0
    for column, source in slices:
        if used + source.numel() > scratch.numel():
            batches.append(batch)
            batch, used = _StagedBatch([[] for _ in range(k)], [], []), 0
        for out, ema in zip(batch.emas, column, strict=True):
            out.append(ema)
        batch.sources.append(source)
        batch.scratch.append(scratch[used : used + source.numel()].view(source.shape))
        used += source.numel()
    batches.append(batch)
    return batches


def apply_groups_(
    groups: list[UpdateGroup],
    decay: float,
    sources: list[list[torch.Tensor]] | None = None,
) -> None:
    """:meth:`UpdateGroup.apply_` on every group; ``sources``: per group, what to read
    instead of its source locals (staged host copies).

    With an averaging function, all-or-nothing: its results for every group are computed
    and their shapes checked first, and written only if none raised or came back with
    another shape, so such a function leaves the EMA as it was (peak extra memory then:
    one copy of this rank's EMA shard; an ``avg_fn`` that writes its first argument in
    place writes as it goes, as in torch). The built-in formulas cannot fail part way and
    write in place."""
    if sources is None and (not groups or groups[0].function is None):  # one for all groups
        for group in groups:
            group.apply_(decay)
        return
    staged: list[list[torch.Tensor] | None] = list(sources) if sources else [None] * len(groups)
    results = {
        i: group.function_results(decay, staged[i])
        for i, group in enumerate(groups)
        if group.computes_results(decay)
    }
    for i, values in results.items():
        for ema, value in zip(groups[i].ema_locals, values, strict=True):
            if not isinstance(value, torch.Tensor) or value.shape != ema.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"the averaging function returned {got} for an EMA piece of shape "
                    f"{tuple(ema.shape)}; it must return a tensor of its first argument's shape"
                )
    for i, group in enumerate(groups):
        if i in results:
            torch._foreach_copy_(group.ema_locals, results[i])
        else:
            group.apply_(decay, staged[i])


def update_groups(
    plan: EmaPlan,
    kernel: str = "eager",
    formula: str = "lerp",
    function: AveragingFunction | None = None,
) -> list[UpdateGroup]:
    """One group per (averaged, device, EMA dtype, source dtype); empty shards dropped.

    ``kernel``: ``"eager"``, ``"compiled"`` or ``"auto"``, resolved per group by
    :func:`resolve_kernel` (always eager for a non-lerp ``formula``). ``formula="swa"`` is
    resolved per group's device (see :data:`FORMULAS`); ``function`` replaces the formula
    (the groups' ``formula`` is then ``"function"``).
    """
    groups: dict[tuple[Any, ...], UpdateGroup] = {}
    for e in plan:
        if e.ema_local.numel() == 0:
            continue
        key = (e.averaged, e.ema_local.device, e.ema_local.dtype, e.source_local.dtype)
        if key not in groups:
            chosen_formula = formula
            if function is not None:
                chosen_formula = "function"
            elif formula == "swa":
                device_type = e.ema_local.device.type
                chosen_formula = "lerp" if device_type in FOREACH_DEVICE_TYPES else "divide"
            chosen = resolve_kernel(
                kernel if chosen_formula == "lerp" else "eager",
                e.ema_local.device,
                e.ema_local.dtype,
            )
            plain = chosen == "eager" and chosen_formula == "lerp" and key[2] == key[3]
            groups[key] = UpdateGroup(
                [], [], e.averaged, chosen, chosen_formula, function, plain_lerp=plain
            )
        # Views made together: the entries' own (scattered) cost a third more at 10,000.
        groups[key].ema_locals.append(e.ema_local.detach())
        groups[key].source_locals.append(e.source_local.detach())
    return list(groups.values())
