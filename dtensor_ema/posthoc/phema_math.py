"""The math of post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training
Dynamics of Diffusion Models", EDM2, appendix C): power-function EMA profiles, their relative
width ``sigma_rel``, and the least-squares weights that combine snapshots of a few tracked
profiles into any other profile.

A power-function EMA with exponent ``gamma`` at time ``t`` averages the training trajectory
with the weight density ``p(tau) = (gamma + 1) tau**gamma / t**(gamma + 1)`` on ``[0, t]``.
Its width relative to ``t`` is ``sigma_rel = sqrt((gamma + 1) / ((gamma + 2)**2 (gamma + 3)))``
(eq. 125); ``sigma_rel -> gamma`` is the largest real root of the cubic of eq. 126. Tracked
online, update ``t`` (``1, 2, ...``) averages with ``beta_t = (1 - 1/t) ** (gamma + 1)``
(eq. 127): ``t = 1`` copies the model. Counted in samples (EDM2 counts images), an update
that brings the count to ``t`` after ``delta`` new samples uses ``(1 - delta/t) ** (gamma + 1)``.

Everything here is plain Python / float64 and needs no process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "SIGMA_REL_MAX",
    "gamma_to_sigma_rel",
    "power_beta",
    "profile_density",
    "profile_fit_error",
    "profile_inner",
    "sigma_rel_to_gamma",
    "solve_coefficients",
]

SIGMA_REL_MAX = 12**-0.5
"""``sigma_rel`` of ``gamma = 0`` (a uniform average of the whole run), about ``0.2887``."""

DEFAULT_MAX_CONDITION = 1e12
"""Largest condition number of the snapshots' Gram matrix accepted by :func:`solve_coefficients`:
beyond it, float64 leaves the coefficients fewer than ~4 correct digits."""


def check_sigma_rel(sigma_rel: object, name: str = "sigma_rel") -> float:
    """``sigma_rel`` as a float, or a ``ValueError`` naming it and the valid interval."""
    if isinstance(sigma_rel, bool) or not isinstance(sigma_rel, (int, float)):
        raise TypeError(f"{name} must be a number, got {sigma_rel!r}")
    value = float(sigma_rel)
    if not 0.0 < value < SIGMA_REL_MAX:
        raise ValueError(
            f"{name} must lie in (0, 1/sqrt(12) ~ 0.2887), got {sigma_rel}; EDM2 tracks 0.05 "
            "and 0.10 and sweeps about 0.01 to 0.25"
        )
    return value


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """Exponent ``gamma`` of the power-function EMA of relative width ``sigma_rel``.

    The largest real root of ``g**3 + 7 g**2 + (16 - s**-2) g + (12 - s**-2)`` (eq. 126),
    found by Newton's method from ``g = s**-2``, right of the root, where the cubic is
    increasing and convex, so the iteration decreases monotonically onto the largest root.

    Raises:
        ValueError: ``sigma_rel`` outside ``(0, 1/sqrt(12))``.
    """
    s = check_sigma_rel(sigma_rel)
    k = s**-2
    g = k
    for _ in range(200):
        value = ((g + 7.0) * g + (16.0 - k)) * g + (12.0 - k)
        slope = (3.0 * g + 14.0) * g + (16.0 - k)
        step = value / slope
        g -= step
        if abs(step) <= 1e-15 * max(1.0, abs(g)):
            break
    return g


def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative width of the power-function profile with exponent ``gamma`` (eq. 125)."""
    if not gamma > -1.0:
        raise ValueError(f"gamma must be > -1, got {gamma}")
    return math.sqrt((gamma + 1.0) / ((gamma + 2.0) ** 2 * (gamma + 3.0)))


def power_beta(gamma: float, t: float, delta: float = 1.0) -> float:
    """Decay of the update that brings the time to ``t``: ``(1 - delta/t) ** (gamma + 1)``.

    ``t`` counts updates (``delta = 1``) or samples (``delta`` = samples in this update);
    the first update (``t == delta``) returns 0: it copies the model.
    """
    if not 0 < delta <= t:
        raise ValueError(f"need 0 < delta <= t, got delta={delta}, t={t}")
    return (1.0 - delta / t) ** (gamma + 1.0)


def profile_inner(
    t_a: torch.Tensor, gamma_a: torch.Tensor, t_b: torch.Tensor, gamma_b: torch.Tensor
) -> torch.Tensor:
    """Inner products ``<p_a, p_b>`` of power-function profiles (Algorithm 3, ``p_dot``).

    Broadcasts its float64 arguments. Closed form of
    ``int_0^min(t_a, t_b) p_a(tau) p_b(tau) dtau``.
    """
    ratio = t_a / t_b
    exponent = torch.where(t_a < t_b, gamma_b, -gamma_a)
    numerator = (gamma_a + 1) * (gamma_b + 1) * ratio**exponent
    return numerator / ((gamma_a + gamma_b + 1) * torch.maximum(t_a, t_b))


def _as64(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1)


def solve_coefficients(
    snapshot_t: Sequence[float] | torch.Tensor,
    snapshot_gamma: Sequence[float] | torch.Tensor,
    target_t: float,
    target_gamma: float,
    *,
    max_condition: float = DEFAULT_MAX_CONDITION,
) -> torch.Tensor:
    """Least-squares weights of snapshots whose sum best matches a target profile.

    Solves ``A x = b`` with ``A[i, j] = <p_i, p_j>`` and ``b[i] = <p_i, p_target>``
    (eq. 151, Algorithm 3) in float64, then normalizes ``x`` to sum to 1 (as EDM2 does).
    A snapshot identical to the target gets weight exactly 1 (the exact solution).

    Returns:
        float64 tensor of shape ``(n,)``, one weight per snapshot.

    Raises:
        ValueError: no snapshots, different lengths, times ``<= 0``, or a Gram matrix that is
            singular or has a condition number above ``max_condition`` (duplicate snapshots,
            or too many too close together).
    """
    t = _as64(snapshot_t)
    g = _as64(snapshot_gamma)
    if t.numel() == 0:
        raise ValueError("too few snapshots: none selected")
    if t.shape != g.shape:
        raise ValueError(f"{t.numel()} snapshot times but {g.numel()} exponents")
    if not bool((t > 0).all()) or not target_t > 0:
        raise ValueError(f"snapshot times must be > 0, got {t.tolist()} and target {target_t}")
    exact = ((t == target_t) & (g == target_gamma)).nonzero().flatten()
    a = profile_inner(t[:, None], g[:, None], t[None, :], g[None, :])
    condition = float(torch.linalg.cond(a))
    if not math.isfinite(condition) or condition > max_condition:
        raise ValueError(
            f"the snapshots' least-squares system is singular or ill-conditioned (condition "
            f"number {condition:.3g} > {max_condition:.3g}) for {t.numel()} snapshots at "
            f"t={_short_list(t.tolist())}: drop duplicate or very close snapshots (too few "
            "distinct snapshots), or pass a larger max_condition"
        )
    if exact.numel():
        x = torch.zeros_like(t)
        x[exact[-1]] = 1.0
        return x
    tt = torch.tensor(float(target_t), dtype=torch.float64)
    tg = torch.tensor(float(target_gamma), dtype=torch.float64)
    b = profile_inner(t, g, tt, tg)
    x = torch.linalg.solve(a, b)
    total = float(x.sum())
    if not math.isfinite(total) or abs(total) < 1e-12:
        raise ValueError(
            f"least-squares weights sum to {total}: cannot normalize (too few snapshots?)"
        )
    return x / total


def profile_fit_error(
    snapshot_t: Sequence[float] | torch.Tensor,
    snapshot_gamma: Sequence[float] | torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
    target_t: float,
    target_gamma: float,
) -> float:
    """Relative L2 distance between ``sum_i w_i p_i`` and the target profile.

    ``||sum w_i p_i - p||^2 = w^T A w - 2 w^T b + <p, p>``, divided by ``<p, p>``, square
    root. 0 means the snapshots reproduce the target exactly.
    """
    t, g, w = _as64(snapshot_t), _as64(snapshot_gamma), _as64(weights)
    tt = torch.tensor(float(target_t), dtype=torch.float64)
    tg = torch.tensor(float(target_gamma), dtype=torch.float64)
    a = profile_inner(t[:, None], g[:, None], t[None, :], g[None, :])
    b = profile_inner(t, g, tt, tg)
    pp = float(profile_inner(tt, tg, tt, tg))
    squared = float(w @ a @ w - 2 * (w @ b)) + pp
    return math.sqrt(max(squared, 0.0) / pp)


def profile_density(t: float, gamma: float, tau: torch.Tensor) -> torch.Tensor:
    """``p(tau) = (gamma + 1) tau**gamma / t**(gamma + 1)`` on ``[0, t]``, 0 beyond (plots)."""
    tau = tau.to(torch.float64)
    inside = (tau >= 0) & (tau <= t)
    values = (gamma + 1) * tau.clamp(min=0) ** gamma / t ** (gamma + 1)
    return torch.where(inside, values, torch.zeros_like(values))


def _short_list(values: list[float], limit: int = 6) -> str:
    shown = ", ".join(f"{v:g}" for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"
