"""Symbolic certificates: each exact claim holds, its witness is what it says, and the
closed forms it certifies are the ones the library's manifolds compute."""

import numpy as np
import pytest
import sympy as sp
import torch

from geomuon.manifolds import LPRO, POLAR_EXPRESS, POLAR_EXPRESS_5, KELLER_QUINTIC, CenteredRouterSpace, DGram, Oblique, Stiefel
from geomuon.theory.symbolic import (
    cayley,
    certify_dgram_retraction,
    certify_newton_schulz_equivariance,
    certify_residual_lipschitz,
    certify_soft_cap_coupling,
    certify_soft_cap_monotone,
    certify_sorted_sigma_map_fails,
    certify_tangent_projection,
    exact,
    ns_fixed_points,
    ns_output_range,
    skew,
    soft_cap_coupling_roots,
    soft_cap_polynomial,
    symbolic_manifolds,
)

SYMBOLIC = symbolic_manifolds()


def test_cayley_gives_exact_rational_orthogonal_matrices():
    S = skew(3)
    Q = cayley(S)
    assert (Q.T * Q - sp.eye(3)).applyfunc(sp.simplify).is_zero_matrix
    numeric = cayley(sp.Matrix([[0, sp.Rational(1, 2), 2], [-sp.Rational(1, 2), 0, 3], [-2, -3, 0]]))
    assert all(entry.is_rational for entry in numeric)
    assert numeric.T * numeric == sp.eye(3)


@pytest.mark.parametrize("name", sorted(SYMBOLIC))
def test_tangent_projection_certificate(name):
    certificate = certify_tangent_projection(SYMBOLIC[name])
    assert certificate.holds, certificate.witness
    assert all(residual.is_zero_matrix for residual in certificate.witness.values())


def test_tangent_projection_certificate_catches_a_wrong_projection():
    stiefel = SYMBOLIC["Stiefel"]
    wrong = type(stiefel)(
        "Stiefel with a skew instead of symmetric part",
        stiefel.point,
        stiefel.on_manifold,
        stiefel.constraint,
        lambda W, X: X - W * (W.T * X - X.T * W) / 2,
    )
    assert not certify_tangent_projection(wrong).holds


# The library's manifolds at a rational point, compared with the certified closed forms.
_LIBRARY = {
    "Stiefel": Stiefel(),
    "DGram": DGram(),
    "Oblique": Oblique(),
    "LPRO": LPRO(radius=1.5),
    "CenteredRouterSpace": CenteredRouterSpace(),
}


@pytest.mark.parametrize("name", sorted(_LIBRARY))
def test_library_projection_matches_the_certified_formula(name):
    manifold = SYMBOLIC[name]
    values = {s: sp.Rational(k + 2, 7) for k, s in enumerate(sorted(manifold.point.free_symbols, key=str))}
    values.update({s: sp.Rational(3, 2) for s in manifold.point.free_symbols if s.name == "r"})
    point = manifold.point.subs(values)
    X = sp.Matrix(point.rows, point.cols, lambda i, j: sp.Rational((3 * i + 5 * j) % 7 - 3, 4))
    # The formulas may mention the point's parameters (LPRO's radius r) directly.
    expected = np.array(manifold.project(point, X).subs(values).evalf(30).tolist(), dtype=np.float64)
    W = torch.tensor(np.array(point.evalf(30).tolist(), dtype=np.float64))
    assert manifold.on_manifold(point).subs(values).applyfunc(sp.simplify).is_zero_matrix
    U = torch.tensor(np.array(X.evalf(30).tolist(), dtype=np.float64))
    got = _LIBRARY[name].proju(W, U).numpy()
    # Both are float64 evaluations of the same rational function of O(1) entries.
    assert np.abs(got - expected).max() < 1e-12


def test_dgram_retraction_fixes_points_and_sorted_sigma_map_does_not():
    certificate = certify_dgram_retraction()
    assert certificate.holds and certificate.witness.is_zero_matrix
    moved = certify_sorted_sigma_map_fails((1, 2))
    assert moved.holds and not moved.witness.is_zero_matrix
    # With column norms already descending the sorted map happens to agree.
    assert not certify_sorted_sigma_map_fails((2, 1)).holds


def test_newton_schulz_step_is_bi_orthogonally_equivariant():
    certificate = certify_newton_schulz_equivariance()
    assert certificate.holds and certificate.witness == {}
    # The same identity on an exact rational instance, and its failure when L is not
    # orthogonal (so the identity really uses L^T L = I).
    L = cayley(sp.Matrix([[0, sp.Rational(1, 3)], [-sp.Rational(1, 3), 0]]))
    R = cayley(sp.Matrix([[0, 1, 2], [-1, 0, sp.Rational(1, 2)], [-2, -sp.Rational(1, 2), 0]]))
    X = sp.Matrix([[1, 2, -1], [0, 3, 1]]) / 5
    a, b, c = (exact(v) for v in KELLER_QUINTIC.coefficients[0])

    def step(Y):
        S = Y * Y.T
        return a * Y + (b * S + c * S * S) * Y

    assert step(L * X * R.T) == L * step(X) * R.T
    not_orthogonal = sp.Matrix([[1, 1], [0, 1]])
    assert step(not_orthogonal * X * R.T) != not_orthogonal * step(X) * R.T


def test_newton_schulz_fixed_points():
    keller = [float(v) for v in ns_fixed_points(KELLER_QUINTIC.coefficients[0])]
    assert keller[0] == 0.0
    assert keller[1:] == pytest.approx([0.8680257976555313, 1.263729067298377], abs=1e-15)
    # Polar Express's last tuple (15/8, -5/4, 3/8) fixes 1 with zero slope (quadratic
    # convergence to 1), and also sqrt(21)/3 (repelling, outside the normalized range).
    last = POLAR_EXPRESS.coefficients[-1]
    assert ns_fixed_points(last) == [0, 1, sp.sqrt(21) / 3]
    sigma = sp.Symbol("sigma")
    a, b, c = (exact(v) for v in last)
    assert sp.diff(a * sigma + b * sigma**3 + c * sigma**5, sigma).subs(sigma, 1) == 0


@pytest.mark.parametrize(
    "schedule, steps, scale, lo, expected",
    [
        # REFERENCES.md, "Scalar maps of normalized singular values".
        (KELLER_QUINTIC, 5, 1, "0.001", (0.4705, 1.2024)),
        (KELLER_QUINTIC, 5, 1, "0.01", (0.6818, 1.1344)),
        (POLAR_EXPRESS_5, 5, "1.02", "0.001", (0.8467, 1.1411)),
        (POLAR_EXPRESS_5, 5, "1.02", "0.01", (0.8589, 1.1411)),
        (POLAR_EXPRESS, 6, "1.01", "0.001", (0.9935, 1.0012)),
        (POLAR_EXPRESS, 6, "1.01", "0.01", (0.9974, 1.0012)),
        (POLAR_EXPRESS, 8, "1.01", "0.001", (1.0000, 1.0000)),
    ],
)
def test_newton_schulz_output_range_matches_the_reference_table(schedule, steps, scale, lo, expected):
    low, high = ns_output_range(schedule.coefficients, steps, lo=lo, input_scale=scale)
    # The table is rounded to 4 decimals from sampled values: its PE-5 minimum 0.8467 is
    # the rigorous 0.846647 rounded from a sample; allow one unit in the last place.
    assert (float(low), float(high)) == pytest.approx(expected, abs=1e-4)


def test_newton_schulz_output_range_on_the_issue_interval_encloses_samples():
    for schedule, steps, scale in [(KELLER_QUINTIC, 5, 1), (POLAR_EXPRESS_5, 5, 1.02), (POLAR_EXPRESS, 8, 1.01)]:
        low, high = ns_output_range(schedule.coefficients, steps, lo="0.003", input_scale=scale)
        x = np.geomspace(0.003, 1.0, 20001) / scale
        for a, b, c in schedule.step_coefficients(steps):
            x = a * x + b * x**3 + c * x**5
        # A rigorous enclosure contains every sample, and is tight: the sampled extremes
        # come within 1e-6 of it.
        assert float(low) <= x.min() + 1e-15 and x.max() <= float(high) + 1e-15
        assert x.min() - float(low) < 1e-6 and float(high) - x.max() < 1e-6
    keller = ns_output_range(KELLER_QUINTIC.coefficients, 5, lo="0.003")
    assert (float(keller[0]), float(keller[1])) == pytest.approx((0.68183, 1.20237), abs=1e-5)


def test_soft_cap_coupling_quartic():
    certificate = certify_soft_cap_coupling()
    assert certificate.holds and certificate.witness == 0


@pytest.mark.parametrize("w_max, wd, eta", [(1.0, 0.0, 1.0), (2.0, 0.01, 0.0240454), (6.0, 0.0, 0.5), (1.0, 0.0, 0.02)])
def test_soft_cap_coupling_roots_solve_the_coupling(w_max, wd, eta):
    roots = soft_cap_coupling_roots(w_max, wd, eta)
    assert roots and roots == tuple(sorted(roots)) and roots[0] >= 0
    k = w_max * (1 - wd) + eta
    numeric = np.roots([-(k**9), 3 * k**7, -3 * k**5, 0.0, k - w_max])
    real = sorted(r.real for r in numeric if abs(r.imag) < 1e-9 and r.real >= 0)
    assert roots == pytest.approx(real, rel=1e-8)
    value = soft_cap_polynomial(sp.Float(roots[0], 30), sp.Float(k, 30))
    assert abs(float(value) - w_max) < 1e-12 * w_max


def test_soft_cap_coupling_roots_empty_when_no_cap_is_needed_and_bad_input():
    assert soft_cap_coupling_roots(1.0, 0.5, 0.1) == ()
    with pytest.raises(ValueError, match="w_max"):
        soft_cap_coupling_roots(-1.0, 0.0, 0.1)


def test_soft_cap_monotonicity():
    # DESIGN 3.5: w_max = 1, eta = 1 is not monotone on [0, k] and peaks at 1.19.
    large = certify_soft_cap_monotone(1.0, 0.0, 1.0)
    assert not large.holds and large.witness["derivative_residual"] == 0
    assert float(large.witness["peak"]) == pytest.approx(1.19, abs=5e-3)
    small = certify_soft_cap_monotone(2.0, 0.01, 0.0240454)
    assert small.holds and float(small.witness["peak"]) == pytest.approx(2.0, abs=1e-12)


def test_residual_lipschitz_rule():
    certificate = certify_residual_lipschitz()
    assert certificate.holds
    a, L, t = sp.symbols("a L t", real=True)
    gap = ((1 - a) + a * L) ** 2 - ((1 - a) + a * t) ** 2
    assert sp.expand(certificate.witness["gap"] - gap) == 0
    # The rule needs a <= 1: at a = 2 the factor 2(1 - a) + a(L + t) is negative for small L + t.
    assert certificate.witness["gap"].subs({a: 2, L: 0, t: 0}) == 0
    assert certificate.witness["gap"].subs({a: 2, L: sp.Rational(1, 2), t: 0}) < 0
