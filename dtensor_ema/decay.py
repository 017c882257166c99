"""Decay schedules: how much of the old average survives the ``updates``-th update.

``update()`` computes the decay as a Python float from the update counter alone, so every
rank computes the same number without communicating, and a resumed run that restores the
counter continues on exactly the same ramp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["RampDecay"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RampDecay:
    """yolov5/ultralytics ramp: ``d(updates) = decay * (1 - exp(-updates / tau))``.

    Early updates use a small decay so the average forgets the random initialization
    quickly; after a few ``tau`` updates ``d`` approaches ``decay``. ``tau=None`` or ``0``
    means a constant ``d = decay``.
    """

    decay: float = 0.9999
    """Asymptotic decay, in ``[0, 1]``. ``1`` freezes the EMA, ``0`` copies the model."""
    tau: float | None = 2000
    """Ramp time constant in updates, ``>= 0``; ``None`` or ``0`` disables the ramp."""

    def __post_init__(self) -> None:
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)):
            raise TypeError(f"decay must be a float in [0, 1], got {self.decay!r}")
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay}")
        if self.tau is not None:
            if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)):
                raise TypeError(f"tau must be a number >= 0 or None, got {self.tau!r}")
            if not self.tau >= 0:
                raise ValueError(f"tau must be >= 0 (or None for a constant decay), got {self.tau}")

    def __call__(self, updates: int) -> float:
        """Decay of the ``updates``-th update (``updates >= 1`` once ``update()`` ran)."""
        if not self.tau:
            return float(self.decay)
        return self.decay * (1.0 - math.exp(-updates / self.tau))

    def config(self) -> dict[str, Any]:
        """Plain values that identify the schedule in a checkpoint."""
        return {"schedule": "ramp", "decay": float(self.decay), "tau": self.tau}
