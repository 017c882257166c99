"""The update counter of a :class:`~dtensor_ema.ModelEMA` and the decay it implies.

Every ``update()`` call counts; every ``update_every``-th call averages with the decay
``schedule(step) ** update_every`` at ``step = updates - update_after_step`` (``0.0``, a
copy, while ``step <= 0``). The count lives on the host (inline and offloaded updates) and
has a float64 device twin for the device paths (``capturable=True``, CUDA graph replay),
which count without reading anything back to the host (float64 counts exactly up to
``2**53``). :class:`UpdateCounter` is the one owner of both, and of the last decay applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from dtensor_ema.options import EmaOptions
from dtensor_ema.update.fused_update import CountedStep

__all__ = ["MAX_COUNT", "DeviceStep", "HostStep", "UpdateCounter", "check_count"]

MAX_COUNT = 2**63 - 1
"""The largest count: it must fit an int64 (saved counters beyond it are refused before a
load writes anything)."""


class DeviceStep(NamedTuple):
    """One capturable step: 0-dim device tensors, so nothing reads back to the host (a
    named tuple, which ``torch.compile(fullgraph=True)`` traces without a graph break)."""

    decay: torch.Tensor
    """The decay of an averaging step (``0`` copies)."""
    active: torch.Tensor
    """``False`` on calls that ``update_every`` skips: the EMA stays unchanged."""


class HostStep(NamedTuple):
    """One host-path call, decided but not yet counted (see :meth:`UpdateCounter.host_step`)."""

    updates: int
    """The count once this call is recorded."""
    decay: float | None
    """Its decay (``0.0``: copy; ``None``: a call ``update_every`` skips)."""
    step: float | None
    """What an updater applies: the decay, or a :class:`~dtensor_ema.update.fused_update.
    CountedStep` for formulas that read the averaging step; ``None`` when skipped."""


def check_count(value: object, name: str = "updates") -> int:
    """``value`` as a counter value; raises ``ValueError`` unless an ``int >= 0`` that fits
    an int64 (at most :data:`MAX_COUNT`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {_shown(value)}")
    if value > MAX_COUNT:
        raise ValueError(f"{name} must fit an int64 (at most 2**63 - 1), got {_shown(value)}")
    return value


def _shown(value: object) -> str:
    """``repr(value)``, but a huge int by its size (its digits could run to pages, or past
    Python's limit for converting an int to text)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 96:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


class UpdateCounter:
    """The count of ``update()`` calls, on the host and (for the device paths) the device.

    Args:
        options: the EMA's options (schedule, ``update_every``, ``update_after_step``,
            ``capturable``: with it the device count is the authoritative one).
        updates: the initial count (``>= 0``).
        device: where the device twin lives (the model's device). Two 0-dim float64
            tensors; local, no communication anywhere in this class.
    """

    def __init__(self, options: EmaOptions, updates: int, device: torch.device) -> None:
        self.options = options
        self.host = check_count(updates)
        self.device_count = torch.tensor(float(updates), dtype=torch.float64, device=device)
        self.device_last_decay = torch.tensor(math.nan, dtype=torch.float64, device=device)
        self._last_decay: float | None = None
        self._last_decay_from_count = False  # set by a restore: a state stores the count only
        self.device_stale = False  # a host-path step ran in graph mode: the device twin lags

    def decay_at(self, updates: int) -> float:
        """Decay of the averaging call that brings the count to ``updates`` (``0.0``: a
        copy within ``update_after_step``)."""
        step = updates - self.options.update_after_step
        if step <= 0:
            return 0.0
        return self.options.schedule.decay_for(step, self.options.update_every)

    def current(self) -> int:
        """The count (reads the device twin when ``capturable``: a host sync)."""
        if self.options.capturable:
            return int(self.device_count.item())
        return self.host

    def assign(self, value: int) -> None:
        """Set the count on the host and the device."""
        self.host = check_count(value)
        self.device_count.fill_(float(value))

    def restore(self, value: int) -> None:
        """Set the count from a loaded state; the last decay then follows from the count,
        computed when read (a stateful schedule, ``PostHocEMA``'s, may restore its own state
        after this one)."""
        self.assign(value)
        self._last_decay_from_count = True

    def next_step(self) -> tuple[int, float | None]:
        """The count after the next call, and its decay (``0.0``: copy; ``None``: skipped)."""
        updates = self.host + 1
        if updates % self.options.update_every:
            return updates, None
        return updates, self.decay_at(updates)

    def host_step(self) -> HostStep:
        """The next host-path call, to be applied by an updater and then :meth:`record`-ed.
        Marks the device twin stale (a CUDA graph refreshes it before its next replay)."""
        updates, decay = self.next_step()
        self.device_stale = True
        step: float | None = decay
        if decay and self.options.counted:  # not a copy: the formula reads the count
            step = CountedStep(decay, updates - self.options.update_after_step)
        return HostStep(updates, decay, step)

    def record(self, updates: int, decay: float | None) -> None:
        """Count a call once its step has been applied."""
        self.host = updates
        if decay is not None:
            self._last_decay = decay
            self._last_decay_from_count = False

    def advance(self) -> float | None:
        """Count one call now (for callers that apply the step themselves); return its
        decay, ``0.0`` to copy, ``None`` to skip."""
        updates, decay = self.next_step()
        self.record(updates, decay)
        return decay

    def last_decay(self) -> float | None:
        """Decay of the most recent averaging call, ``None`` before the first (reads the
        device twin when ``capturable``)."""
        if self._last_decay_from_count:
            updates = self.current()
            last = updates - updates % self.options.update_every
            return self.decay_at(last) if last > 0 else None
        if self.options.capturable:
            value = float(self.device_last_decay.item())
            return None if math.isnan(value) else value
        return self._last_decay

    def refresh_device(self) -> None:
        """Bring the device twin up to the host count after host-path steps."""
        if self.device_stale:
            self.device_count.fill_(float(self.host))
            self.device_stale = False

    def device_step(self, apply: Callable[[DeviceStep], None]) -> None:
        """Count and apply one step on the device: no ``.item()``, no branch on a tensor
        (what ``capturable=True`` runs and a CUDA graph captures).

        Skipped calls (``update_every``) lerp with weight 0 and copies with weight 1, both
        exact. The decay is computed in float64 and rounded to the EMA dtype, which matches
        the host path's Python float bit for bit for float32 EMAs (a float64 EMA may differ
        in the last bit, as torch's and libm's ``exp`` may).
        """
        # Counted up front, as in the host path's inline mode: a device step cannot fail
        # later in a worker. (Counting in a callback after the lerp compiled to wrong values
        # on torch 2.13.)
        self.device_count += 1
        step = self.device_count - self.options.update_after_step
        decay = self.options.schedule.decay_tensor_for(step, self.options.update_every)
        decay = torch.where(step <= 0, torch.zeros_like(decay), decay)
        active = torch.remainder(self.device_count, self.options.update_every) == 0
        self.device_last_decay.copy_(torch.where(active, decay, self.device_last_decay))
        apply(DeviceStep(decay=decay, active=active))
