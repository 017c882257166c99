"""Post-hoc EMA math against the EDM2 formulas, written here (numpy float64, no library code).

- eq. 126: gamma is the largest real root of g^3 + 7 g^2 + (16 - s^-2) g + (12 - s^-2).
- eq. 127: beta_t = (1 - 1/t) ** (gamma + 1); with sample counts (1 - delta/t) ** (gamma + 1).
- eq. 151 / Algorithm 3: least-squares weights from the profiles' inner products, normalized.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dtensor_ema.posthoc.phema_math import (
    gamma_to_sigma_rel,
    power_beta,
    profile_fit_error,
    profile_inner,
    sigma_rel_to_gamma,
    solve_coefficients,
)


def ref_gamma(sigma_rel: float) -> float:
    k = sigma_rel**-2
    return float(np.roots([1.0, 7.0, 16.0 - k, 12.0 - k]).real.max())


def ref_inner(ta: float, ga: float, tb: float, gb: float) -> float:
    """Integral of p_a * p_b with p(tau) = (g + 1) tau^g / t^(g + 1) on [0, t]."""
    lo = min(ta, tb)
    return (
        (ga + 1)
        * (gb + 1)
        * lo ** (ga + gb + 1)
        / ((ga + gb + 1) * ta ** (ga + 1) * tb ** (gb + 1))
    )


def ref_coefficients(ts, gs, t_out, g_out) -> np.ndarray:
    a = np.array(
        [
            [ref_inner(ta, ga, tb, gb) for tb, gb in zip(ts, gs, strict=True)]
            for ta, ga in zip(ts, gs, strict=True)
        ]
    )
    b = np.array([ref_inner(ta, ga, t_out, g_out) for ta, ga in zip(ts, gs, strict=True)])
    x = np.linalg.solve(a, b)
    return x / x.sum()


@pytest.mark.parametrize("sigma_rel", [0.001, 0.01, 0.05, 0.08, 0.10, 0.2, 0.28, 0.2886])
def test_gamma_is_the_largest_root_of_the_cubic(sigma_rel: float) -> None:
    gamma = sigma_rel_to_gamma(sigma_rel)
    assert gamma == pytest.approx(ref_gamma(sigma_rel), rel=1e-12, abs=1e-12)
    # and back, by eq. 125 written out
    assert math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))) == pytest.approx(sigma_rel)
    assert gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-12)


def test_edm2_values() -> None:
    # EDM2 quotes gamma ~ 16.97 for sigma_rel 0.05 and ~ 6.94 for 0.10
    assert sigma_rel_to_gamma(0.05) == pytest.approx(16.97, abs=0.01)
    assert sigma_rel_to_gamma(0.10) == pytest.approx(6.94, abs=0.01)


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.289, 0.5, float("nan")])
def test_sigma_rel_out_of_range_names_the_value(bad: float) -> None:
    with pytest.raises(ValueError, match=f"got {bad}"):
        sigma_rel_to_gamma(bad)
    with pytest.raises(TypeError):
        sigma_rel_to_gamma("0.1")  # type: ignore[arg-type]


def test_beta() -> None:
    gamma = sigma_rel_to_gamma(0.05)
    for t in (1, 2, 3, 10, 1000):
        assert power_beta(gamma, t) == (1 - 1 / t) ** (gamma + 1)
    assert power_beta(gamma, 1) == 0.0  # the first update copies the model
    assert power_beta(gamma, 96, 32) == (1 - 32 / 96) ** (gamma + 1)
    with pytest.raises(ValueError, match="delta"):
        power_beta(gamma, 3, 4)


def test_inner_products_match_the_integral() -> None:
    for ta, ga, tb, gb in [(10, 3.0, 20, 7.0), (20, 7.0, 10, 3.0), (5, 16.9, 5, 6.9), (1, 0, 2, 0)]:
        got = float(
            profile_inner(*(torch.tensor(float(v), dtype=torch.float64) for v in (ta, ga, tb, gb)))
        )
        assert got == pytest.approx(ref_inner(ta, ga, tb, gb), rel=1e-13)


@pytest.mark.parametrize("n", [1, 3, 8, 32])
def test_coefficients_match_eq151(n: int) -> None:
    steps = [1000.0 * (i + 1) for i in range(n)]
    g05, g10 = sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)
    ts, gs = steps + steps, [g05] * n + [g10] * n
    for sigma in (0.03, 0.08, 0.15):
        g_out = sigma_rel_to_gamma(sigma)
        got = solve_coefficients(ts, gs, steps[-1], g_out)
        assert got.dtype == torch.float64
        want = ref_coefficients(ts, gs, steps[-1], g_out)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-9)
        assert float(got.sum()) == pytest.approx(1.0, abs=1e-12)
        # reconstructing at an earlier time than the last snapshot works too
        got_mid = solve_coefficients(ts, gs, steps[n // 2], g_out)
        np.testing.assert_allclose(
            got_mid.numpy(), ref_coefficients(ts, gs, steps[n // 2], g_out), rtol=1e-6, atol=1e-9
        )


def test_tracked_profile_gets_weight_one_exactly() -> None:
    steps = [100.0, 200.0, 300.0]
    g05, g10 = sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)
    ts, gs = steps + steps, [g05] * 3 + [g10] * 3
    got = solve_coefficients(ts, gs, 300.0, g10)
    assert got.tolist() == [0, 0, 0, 0, 0, 1.0]
    # the least-squares solution itself agrees (the shortcut is the exact answer)
    np.testing.assert_allclose(ref_coefficients(ts, gs, 300.0, g10), got.numpy(), atol=1e-8)


def test_singular_and_empty_systems_are_refused() -> None:
    g = sigma_rel_to_gamma(0.05)
    with pytest.raises(ValueError, match="singular or ill-conditioned"):
        solve_coefficients([100.0, 100.0], [g, g], 100.0, sigma_rel_to_gamma(0.1))
    with pytest.raises(ValueError, match="too few snapshots"):
        solve_coefficients([], [], 100.0, g)
    with pytest.raises(ValueError, match="condition number"):
        solve_coefficients([100.0, 200.0], [g, g], 200.0, sigma_rel_to_gamma(0.1), max_condition=1)


def test_fit_error_matches_a_numerical_integral() -> None:
    g05, g10, g08 = (sigma_rel_to_gamma(s) for s in (0.05, 0.10, 0.08))
    ts, gs = [50.0, 100.0, 50.0, 100.0], [g05, g05, g10, g10]
    w = solve_coefficients(ts, gs, 100.0, g08)
    tau = np.linspace(0, 100.0, 400001)

    def p(t: float, g: float) -> np.ndarray:
        return np.where(tau <= t, (g + 1) * tau**g / t ** (g + 1), 0.0)

    diff = sum(wi * p(t, g) for wi, t, g in zip(w.tolist(), ts, gs, strict=True)) - p(100.0, g08)
    want = math.sqrt(np.trapezoid(diff**2, tau) / np.trapezoid(p(100.0, g08) ** 2, tau))
    assert profile_fit_error(ts, gs, w, 100.0, g08) == pytest.approx(want, rel=1e-3)
    assert profile_fit_error(ts, gs, [0, 0, 0, 1.0], 100.0, g10) == pytest.approx(0, abs=1e-6)
