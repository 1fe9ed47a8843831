"""Symbolic certificates of the library's own code: every identity is evaluated on the
library's methods/maps (run on exact sympy-valued tensors or free-algebra letters), and
each certificate family has a negative control asserted to be rejected."""

import math
import re

import numpy as np
import pytest
import sympy as sp
import torch

from geomuon.manifolds import (
    KELLER_QUINTIC, LPRO, POLAR_EXPRESS, POLAR_EXPRESS_5, CenteredRouterSpace, DGram, Oblique, Stiefel, sym,
)
from geomuon.manifolds.base import matrix_method
from geomuon.optimizers import maps
from geomuon.optimizers.regulate import (
    SOFT_CAP_MIN_RATIO, muon_update_norm, ns_output_bound, soft_cap_alpha, soft_cap_alpha_tensor,
)
from geomuon.theory import declared
from geomuon.theory.groups import BiOrthogonal, LeftPermRightOrth, RouterShift
from geomuon.theory.lipschitz import GELU_LIPSCHITZ
from geomuon.theory.symbolic import (
    ExactTensor,
    cayley,
    certify_gelu_lipschitz,
    certify_gram_form,
    certify_gram_space_identity,
    certify_manifold,
    certify_map_row,
    certify_equivariance_every_size,
    certify_every_size,
    certify_newton_schulz_equivariance,
    certify_newton_schulz_retraction,
    certify_newton_schulz_step_expansion,
    certify_inverse_sqrt_iteration,
    certify_gram_retract,
    certify_inverse_sqrt_series,
    certify_stiefel_retraction,
    certify_stiefel_retraction_every_size,
    certify_dgram_retraction,
    certify_dgram_step_expansion,
    certify_polar_express_table,
    POLAR_EXPRESS_DESIGNS,
    inverse_sqrt_error_bound,
    polar_map_reference,
    certify_projection,
    certify_residual_lipschitz,
    certify_retraction,
    certify_dualizer,
    certify_projx,
    certify_projx_float64,
    certify_rms_scale,
    hybrid_map_reference,
    certify_soft_cap_coupling,
    certify_soft_cap_monotone,
    certify_soft_cap_root_unique,
    certify_sorted_sigma_map_fails,
    exact,
    manifold_points,
    newton_schulz_error,
    ns_fixed_points,
    ns_output_range,
    skew,
    soft_cap_beta,
    soft_cap_coupling_roots,
    soft_cap_polynomial,
)

# Exact points: fully symbolic (rotation parameters, unit-vector parameters, column norms)
# at 2x2; rational rotations with symbolic column norms / router entries at tall and wide
# sizes (a fully symbolic 3x3 Cayley frame costs ~7 s per manifold).
_POINTS = {
    (2, 2): manifold_points(2, 2, generic=True),
    (3, 2): manifold_points(3, 2, generic=False),
    (2, 3): manifold_points(2, 3, generic=False),
}
_CASES = [(shape, name) for shape, points in _POINTS.items() for name in points]


def test_cayley_gives_exact_rational_orthogonal_matrices():
    Q = cayley(skew(3))
    assert (Q.T * Q - sp.eye(3)).applyfunc(sp.simplify).is_zero_matrix
    numeric = cayley(sp.Matrix([[0, sp.Rational(1, 2), 2], [-sp.Rational(1, 2), 0, 3], [-2, -3, 0]]))
    assert all(entry.is_rational for entry in numeric)
    assert numeric.T * numeric == sp.eye(3)


# The sections run cheapest-to-fail first (a broken table or constant is found in seconds);
# the declared map rows, the slowest, run last.

# ----------------------------------------------------------------------- coefficient tables


@pytest.mark.parametrize("schedule", [POLAR_EXPRESS, POLAR_EXPRESS_5], ids=lambda s: s.name)
def test_polar_express_rows_are_the_minimax_polynomials_of_their_intervals(schedule, monkeypatch):
    import dataclasses

    certificate = certify_polar_express_table(schedule)
    assert certificate.holds, certificate.witness
    rows = certificate.witness[: len(schedule.coefficients)]
    # the early rows are cushioned, the later ones minimax on their whole interval
    assert rows[0]["cushioned"] and not rows[len(schedule.coefficients) - 2]["cushioned"]
    # Controls: a change in the 8th significant digit of any one coefficient is caught
    # (the first residual moves by at least the change, see the docstring), and so is a
    # wrong cushion.
    for k, j in [(0, 0), (2, 1), (len(schedule.coefficients) - 2, 2)]:
        table = [list(r) for r in schedule.coefficients]
        table[k][j] *= 1 + 1e-8
        perturbed = dataclasses.replace(schedule, coefficients=tuple(map(tuple, table)))
        assert not certify_polar_express_table(perturbed).holds, (k, j)
    design = POLAR_EXPRESS_DESIGNS[schedule.name]
    wrong = dataclasses.replace(design, cushion=str(float(design.cushion) * (1 + 1e-8)))
    monkeypatch.setitem(POLAR_EXPRESS_DESIGNS, schedule.name, wrong)
    assert not certify_polar_express_table(schedule).holds


def test_inverse_square_root_iteration_converges_to_the_inverse_root():
    import inspect

    from geomuon.manifolds.linalg import inv_sqrt_psd

    certificate = certify_inverse_sqrt_iteration()
    assert certificate.holds, certificate.witness
    steps = inspect.signature(inv_sqrt_psd).parameters["steps"].default
    # The docstring's claim: the default steps cover normalized eigenvalues down to about
    # 1e-8 (relative error 2e-3 there) and are exact to 50 digits from 1e-6 on; five steps
    # fewer do not cover 1e-8.
    assert inverse_sqrt_error_bound(steps, "1e-8") < sp.Rational(1, 100)
    assert inverse_sqrt_error_bound(steps, "1e-6") <= sp.Rational(1, 10**50)
    assert inverse_sqrt_error_bound(steps - 5, "1e-8") > sp.Rational(1, 2)


def test_the_library_inverse_square_root_matches_the_exact_one():
    # inv_sqrt_psd (public; the polar maps no longer use it, and their value tests had been its
    # only check here) on A = Q diag(9/4, 1) Q^T with a rational rotation Q, against the exact
    # Q diag(2/3, 1) Q^T. Its normalized eigenvalues are >= 1/||A||_F > 0.4, where the certified
    # iteration error of the default steps is at most 1e-50; left: the eps shift (relative bias
    # <= k eps ||A||_F / (2 lambda_min) = 6e-16) and float64 round-off of ~10 products per step
    # at condition 2.25 (the fixed point attracts): a few 1e-15; 1e-13 is 30x that.
    import inspect

    from geomuon.manifolds.linalg import inv_sqrt_psd

    steps = inspect.signature(inv_sqrt_psd).parameters["steps"].default
    assert inverse_sqrt_error_bound(steps, "0.4") <= sp.Rational(1, 10**50)
    Q = sp.Matrix([[sp.Rational(3, 5), sp.Rational(-4, 5)], [sp.Rational(4, 5), sp.Rational(3, 5)]])
    A = Q * sp.diag(sp.Rational(9, 4), 1) * Q.T
    exact = Q * sp.diag(sp.Rational(2, 3), 1) * Q.T
    as_float = lambda M: torch.tensor(np.array(M.evalf(30).tolist(), dtype=float))  # noqa: E731
    for scale in (1.0, 1e-6, 1e6):  # the scale's root: (cA)^(-1/2) = A^(-1/2) / sqrt(c)
        out = inv_sqrt_psd(as_float(A) * scale) * scale**0.5
        assert float((out - as_float(exact)).norm() / as_float(exact).norm()) <= 1e-13, scale


_POLAR_CASES = [(s, a, f) for s in [(3, 2), (2, 3), (2, 2)] for a in (0, 1, 0.5) for f in (maps.right_polar, maps.left_polar)]


@pytest.mark.parametrize("shape, alpha, update", _POLAR_CASES, ids=[f"{f.__name__}-{s[0]}x{s[1]}-a{a}" for s, a, f in _POLAR_CASES])
def test_polar_maps_match_the_exact_polar_factor(shape, alpha, update):
    D, reference = polar_map_reference(shape, alpha)
    expected = torch.tensor(np.array(reference.evalf(30).tolist(), dtype=float))
    # D's singular values 3/2 and 1 normalize (by ||D||_F) to 0.83 and 0.55, inside [1e-3,
    # 1/1.01], where Polar Express's certified scalar error is <= 3e-16 (test_polar_express_
    # value_and_slope_enclosures); float64 round-off of 12 steps at condition 1.5 (the fixed
    # point attracts, so it does not accumulate) adds a few 1e-15: 1e-13 is 30x that.
    error = float((update(D, alpha=alpha) - expected).norm() / expected.norm())
    assert error <= 1e-13


_VALUE_SHAPES = [(3, 2), (2, 3), (2, 2)]


@pytest.mark.parametrize("shape", _VALUE_SHAPES, ids=[f"{m}x{n}" for m, n in _VALUE_SHAPES])
def test_spectral_hybrid_and_nuclear_norm_match_exact_values(shape):
    from geomuon.manifolds.linalg import nuclear_norm

    def to_float(M):
        return torch.tensor(np.array(M.evalf(30).tolist(), dtype=float))

    # Budget as for the polar maps: Polar Express's certified scalar error is <= 3e-16 on
    # normalized singular values in [1e-3, 1/1.01] (test_polar_express_value_and_slope_
    # enclosures), these lie in [0.47, 0.82]; float64 round-off of 12 steps at condition
    # <= 3 adds a few 1e-15: 1e-13 is 30x that. Keller's quintic is 0.34 off.
    D, polar = polar_map_reference(shape, 0)
    assert float((maps.spectral(D) - to_float(polar)).norm() / to_float(polar).norm()) <= 1e-13
    for alpha in (0, 1, 0.5):
        case = hybrid_map_reference(shape, alpha)
        assert case["x_min"] >= sp.Rational(1, 1000)
        expected = to_float(case["update"])
        # eps = 0: the row normalization of D is exactly R (unit rows by construction)
        error = float((maps.hybrid(case["D"], alpha=alpha, eps=0) - expected).norm() / expected.norm())
        assert error <= 1e-13, alpha
    assert abs(float(nuclear_norm(case["R"])) - float(case["nuclear"])) <= 1e-13 * float(case["nuclear"])


# ----------------------------------------------------------------------- constants


def test_gelu_lipschitz_constant_is_proved_and_is_the_library_constant():
    certificate = certify_gelu_lipschitz()
    assert certificate.holds, certificate.witness
    value = float(sp.N(certificate.witness["value"], 40))
    # The library's float is the correctly rounded value up to one unit in the last place.
    assert abs(GELU_LIPSCHITZ - value) <= math.ulp(value)


def test_soft_cap_root_is_unique_and_the_threshold_is_62_81():
    certificate = certify_soft_cap_root_unique()
    assert certificate.holds, certificate.witness
    assert SOFT_CAP_MIN_RATIO == float(certificate.witness["h(1/3)"])


def test_the_constant_certificates_read_the_library_constants(monkeypatch):
    # the docs say they pin GELU_LIPSCHITZ and SOFT_CAP_MIN_RATIO; they had proved the math alone,
    # and held with the reference's understated 1.1289 or a threshold of 0.76
    import geomuon.optimizers.regulate as regulate
    import geomuon.theory.lipschitz as lipschitz

    up_two = math.nextafter(math.nextafter(GELU_LIPSCHITZ, 2), 2)
    for wrong in (1.1289, math.nextafter(GELU_LIPSCHITZ, 0), up_two):  # below it, one ulp down, two ulps up
        monkeypatch.setattr(lipschitz, "GELU_LIPSCHITZ", wrong)
        assert certify_gelu_lipschitz().holds is False, wrong
    for wrong in (0.76, math.nextafter(SOFT_CAP_MIN_RATIO, 0), math.nextafter(SOFT_CAP_MIN_RATIO, 1)):
        monkeypatch.setattr(regulate, "SOFT_CAP_MIN_RATIO", wrong)
        assert certify_soft_cap_root_unique().holds is False, wrong
    monkeypatch.undo()  # controls: the library's own
    assert certify_gelu_lipschitz().holds and certify_soft_cap_root_unique().holds


@pytest.mark.parametrize("call, message", [
    (lambda: certify_dualizer(maps.col_norm, "spectral", (3, 2)), r"certify_dualizer: norm must be one of"),
    (lambda: certify_stiefel_retraction("sideways", 2), r"orientation must be 'tall' or 'wide', got 'sideways'"),
    (lambda: certify_every_size(Oblique(), "diagonal"), r"orientation must be one of \['tall', 'square'"),
    (lambda: certify_rms_scale(((0, 3),)), r"certify_rms_scale: shape \(0, 3\)'s fan_out must be"),
    (lambda: inverse_sqrt_error_bound(-1, "1e-8"), r"inverse_sqrt_error_bound: steps must be"),
    (lambda: inverse_sqrt_error_bound(25, 2), r"inverse_sqrt_error_bound: lam_min must be a number in \(0, 1\]"),
    (lambda: certify_soft_cap_monotone(1.0, 0.0, -0.1), r"certify_soft_cap_monotone: eta must be"),
    (lambda: soft_cap_coupling_roots(1.0, -0.1, 0.1), r"soft_cap_coupling_roots: wd must be a number in \[0, 1\)"),
    (lambda: soft_cap_coupling_roots(math.nan, 0.1, 0.1), r"soft_cap_coupling_roots: w_max must be"),
], ids=["dualizer-norm", "retraction-orientation", "every-size-orientation", "rms-shape", "steps", "lam-min",
        "monotone-eta", "roots-wd", "roots-nan"])
def test_certificates_refuse_arguments_they_cannot_state_by_name(call, message):
    # each had been certified (col_norm "the dualizer of the spectral norm", a "sideways" retraction, a
    # negative eta, lam_min = 2) or raised a bare KeyError / IndexError / sympy TypeError
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("w_max, wd, eta", [(1.0, 0.0, 0.05), (2.0, 0.01, 0.0240454), (1.0, 0.0, 0.3), (6.0, 0.0, 0.5)])
def test_library_soft_cap_alpha_is_the_certified_root(w_max, wd, eta):
    k = w_max * (1 - wd) + eta
    beta = soft_cap_beta(exact(w_max) / (exact(w_max) * (1 - exact(wd)) + exact(eta)))
    exact_alpha = float(sp.N(beta / (exact(w_max) * (1 - exact(wd)) + exact(eta)) ** 2, 30))
    # Bisection to float64 round-off in beta (h evaluated to a few ulps of 1, divided by
    # |h'(beta)| >= 0.3 at these roots: ~1e-15 absolute in beta >= 0.01), one rounding of
    # k^2 and the division: ~1e-13 relative; 1e-12 leaves a margin.
    assert soft_cap_alpha(w_max, wd, eta) == pytest.approx(exact_alpha, rel=1e-12)
    # The device path (a tensor lr: SoftCap's alpha without a host read) bisects the same
    # quartic for 64 fixed steps (2^-64/3 in beta, below its rounding): the same budget.
    on_device = soft_cap_alpha_tensor(w_max, torch.tensor(wd, dtype=torch.float64), torch.tensor(eta, dtype=torch.float64))
    assert float(on_device) == pytest.approx(exact_alpha, rel=1e-12)
    assert k > w_max


@pytest.mark.parametrize("shape", [(3, 2), (2, 3)])
def test_soft_cap_regulator_applies_the_certified_polynomial(shape, monkeypatch):
    from geomuon.theory.symbolic import certify_soft_cap_regulator

    certificate = certify_soft_cap_regulator(shape)
    assert certificate.holds, certificate.witness
    # control: the two cubic steps in the other order, g = s + alpha s^3 then g - alpha g^3,
    # a different polynomial (the coupling proofs are about the scalar map, not this one)
    from geomuon.optimizers.regulate import SoftCap

    def steps_swapped(self, M, *, lr, state):
        alpha = soft_cap_alpha(self.w_max, lr * self.weight_decay, self.eta_for(lr, tuple(M.shape)))
        X = M.mT if M.size(-2) < M.size(-1) else M
        for coefficient in (alpha, -alpha):
            X = X + coefficient * (X @ (X.mT @ X))
        return X.mT if M.size(-2) < M.size(-1) else X

    monkeypatch.setattr(SoftCap, "regulate", steps_swapped)
    assert certify_soft_cap_regulator(shape).holds is False

    def second_step_off(self, M, *, lr, state):  # 1 % too much alpha in the second cubic step
        alpha = soft_cap_alpha(self.w_max, lr * self.weight_decay, self.eta_for(lr, tuple(M.shape)))
        X = M.mT if M.size(-2) < M.size(-1) else M
        for coefficient in (-alpha, 1.01 * alpha):
            X = X + coefficient * (X @ (X.mT @ X))
        return X.mT if M.size(-2) < M.size(-1) else X

    # False, not None: sympy leaves this residual's is_zero_matrix undecided (holds had been None)
    monkeypatch.setattr(SoftCap, "regulate", second_step_off)
    assert certify_soft_cap_regulator(shape).holds is False


def test_library_soft_cap_threshold_is_the_certified_one():
    w_max = 1.0
    largest_eta = w_max * 81 / 62 - w_max
    soft_cap_alpha(w_max, 0.0, largest_eta * (1 - 1e-9))
    with pytest.raises(ValueError, match="too large"):
        soft_cap_alpha(w_max, 0.0, largest_eta * (1 + 1e-9))


def test_rms_scale_is_the_rms_operator_norm_and_eta_uses_it(monkeypatch):
    from geomuon.optimizers.muon import muon_shape_factor

    certificate = certify_rms_scale()
    assert certificate.holds, certificate.witness
    bound = ns_output_bound(KELLER_QUINTIC)
    for (m, n), (norm, _) in certificate.witness.items():
        # adjust_lr=None: an update already of unit RMS->RMS norm, eta = lr * bound * margin
        # (the default margin 1.05 for bf16 rounding: a product of four floats, <= 4 roundings)
        assert muon_update_norm(1.0, (m, n), adjust_lr=None, margin=1.0) == pytest.approx(bound, rel=1e-15)
        assert muon_update_norm(1.0, (m, n), adjust_lr=None) == pytest.approx(1.05 * bound, rel=1e-15)
        # "original": the update lr * s(m, n) * O has RMS->RMS norm <= lr * s * rms-norm * bound
        # (torch.optim.Muon's factor sqrt(max(1, m/n)), written out: not read from muon_shape_factor)
        assert muon_shape_factor(m, n, "original") == math.sqrt(max(1.0, m / n))
        expected = float(sp.N(norm, 30)) * math.sqrt(max(1.0, m / n)) * bound
        assert muon_update_norm(1.0, (m, n), adjust_lr="original", margin=1.0) == pytest.approx(expected, rel=1e-15)
    # control: the inverse scale is not the RMS->RMS norm
    import geomuon.manifolds.linalg as linalg

    monkeypatch.setattr(linalg, "rms_scale", lambda shape: math.sqrt(shape[-2] / shape[-1]))
    assert not certify_rms_scale().holds


def test_muon_update_norm_uses_the_rigorous_enclosure():
    for schedule in (KELLER_QUINTIC, POLAR_EXPRESS_5):
        _, high = ns_output_range(schedule.coefficients, schedule.default_steps, lo=0, hi=1, input_scale=schedule.input_scale)
        bound = ns_output_bound(schedule)
        assert float(high) <= bound <= math.nextafter(float(high), math.inf) + 1e-15
        # adjust_lr=None, square weight: eta = lr * bound * margin exactly.
        assert muon_update_norm(1.0, (8, 8), schedule=schedule, adjust_lr=None, margin=1.0) == bound
    keller = ns_output_bound(KELLER_QUINTIC)
    assert keller == pytest.approx(1.2023686, abs=1e-7)


def test_gram_space_identity():
    certificate = certify_gram_space_identity()
    assert certificate.holds and certificate.witness == {}


def test_newton_schulz_fixed_points():
    keller = [float(v) for v in ns_fixed_points(KELLER_QUINTIC.coefficients[0])]
    assert keller[0] == 0.0
    assert keller[1:] == pytest.approx([0.8680257976555313, 1.263729067298377], abs=1e-15)
    last = POLAR_EXPRESS.coefficients[-1]
    assert ns_fixed_points(last) == [0, 1, sp.sqrt(21) / 3]


@pytest.mark.parametrize(
    "schedule, steps, scale, lo, expected",
    [
        # The 4-decimal reference table of scalar maps of normalized singular values.
        (KELLER_QUINTIC, 5, 1, "0.001", (0.4705, 1.2024)),
        (KELLER_QUINTIC, 5, 1, "0.01", (0.6818, 1.1344)),
        (POLAR_EXPRESS_5, 5, "1.02", "0.001", (0.8467, 1.1411)),
        (POLAR_EXPRESS, 6, "1.01", "0.01", (0.9974, 1.0012)),
    ],
)
def test_newton_schulz_output_range_matches_the_reference_table(schedule, steps, scale, lo, expected):
    low, high = ns_output_range(schedule.coefficients, steps, lo=lo, input_scale=scale)
    # The table is rounded to 4 decimals from sampled values: one unit in the last place.
    assert (float(low), float(high)) == pytest.approx(expected, abs=1e-4)


def test_newton_schulz_output_range_encloses_samples_of_the_library_iteration():
    from geomuon.manifolds.linalg import newton_schulz_step

    for schedule, steps, scale in [(KELLER_QUINTIC, 5, 1), (POLAR_EXPRESS_5, 5, 1.02)]:
        low, high = ns_output_range(schedule.coefficients, steps, lo="0.003", input_scale=scale)
        x = torch.tensor(np.geomspace(0.003, 1.0, 4001) / scale).reshape(-1, 1, 1)
        for a, b, c in schedule.step_coefficients(steps):
            x = newton_schulz_step(x, a, b, c)
        # Rigorous: contains every sample; tight: the sampled extremes come within 1e-4.
        assert float(low) <= x.min() + 1e-15 and x.max() <= float(high) + 1e-15
        assert x.min() - float(low) < 1e-4 and float(high) - x.max() < 1e-4


def test_soft_cap_coupling_quartic():
    certificate = certify_soft_cap_coupling()
    assert certificate.holds and certificate.witness == 0


@pytest.mark.parametrize("w_max, wd, eta", [(1.0, 0.0, 1.0), (2.0, 0.01, 0.0240454)])
def test_soft_cap_coupling_roots_solve_the_coupling(w_max, wd, eta):
    roots = soft_cap_coupling_roots(w_max, wd, eta)
    assert roots and roots == tuple(sorted(roots)) and roots[0] >= 0
    k = w_max * (1 - wd) + eta
    value = soft_cap_polynomial(sp.Float(roots[0], 30), sp.Float(k, 30))
    assert abs(float(value) - w_max) < 1e-12 * w_max
    assert soft_cap_coupling_roots(1.0, 0.5, 0.1) == ()
    with pytest.raises(ValueError, match="w_max"):
        soft_cap_coupling_roots(-1.0, 0.0, 0.1)


def test_soft_cap_monotonicity():
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
    assert certificate.witness["gap"].subs({a: 2, L: sp.Rational(1, 2), t: 0}) < 0


# ----------------------------------------------------------------------- manifolds


# every orientation; a single row for all but the router (which needs two experts)
_EVERY_SIZE = [(m, o) for m in (Stiefel(), DGram(), Oblique(), LPRO(radius=1.5), CenteredRouterSpace())
               for o in ("tall", "square", "wide", "row") if not (o == "row" and isinstance(m, CenteredRouterSpace))]


@pytest.mark.parametrize("manifold, orientation", _EVERY_SIZE, ids=[f"{m.name}-{o}" for m, o in _EVERY_SIZE])
def test_every_size(manifold, orientation):
    certificate = certify_every_size(manifold, orientation)
    assert certificate.holds, certificate.witness
    assert certificate.witness["gram_diag_positive"]
    if isinstance(manifold, CenteredRouterSpace):
        # the library's own constraint_gram_diag, evaluated at symbolic size: e = m rows
        from geomuon.theory.symbolic import ORIENTATIONS

        assert certificate.witness["gram_diag"] == ORIENTATIONS[orientation][0]


class _StiefelDroppedSym(Stiefel):
    @matrix_method("u")
    def proju(self, x, u):
        return u - x @ (x.mT @ u)


class _DGramAdjointKeepingTheDiagonal(DGram):
    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return 2 * x @ sym(lam)


class _DGramProjectionKeepingTheDiagonal(DGram):
    @matrix_method("u")
    def proju(self, x, u):
        d2 = x.square().sum(-2)
        return u - x @ ((x.mT @ u + u.mT @ x) / (d2.unsqueeze(-1) + d2.unsqueeze(-2)))


class _ObliqueProjectionIsZero(Oblique):
    @matrix_method("u")
    def proju(self, x, u):
        return u * 0


class _RouterHalfCentered(CenteredRouterSpace):
    @matrix_method("u")
    def proju(self, x, u):
        return u - 0.5 * u.mean(-2, keepdim=True)


@pytest.mark.parametrize("orientation", ["tall", "wide"])
def test_every_size_rejects_wrong_formulas(orientation):
    adjoint = certify_every_size(_DGramAdjointKeepingTheDiagonal(), orientation)
    assert not adjoint.holds and adjoint.witness["<L(A), lam> = <A, L*(lam)>"]
    projection = certify_every_size(_DGramProjectionKeepingTheDiagonal(), orientation)
    # Off(Sigma) is what the constraint sees, so the kept diagonal shows as P != I - L*(LL*)^-1 L
    # and as a tangent vector that P moves.
    assert not projection.holds and projection.witness["P(V) = V for tangent V"]
    zero = certify_every_size(_ObliqueProjectionIsZero(), orientation)
    assert not zero.holds and zero.witness["P(V) = V for tangent V"] and not zero.witness["L(P(X)) = 0"]
    half = certify_every_size(_RouterHalfCentered(), orientation)
    assert not half.holds and half.witness["L(P(X)) = 0"]
    # X - W W^T X is tangent (so tangency alone misses it) but does not fix tangent vectors.
    dropped = certify_every_size(_StiefelDroppedSym(), orientation)
    assert not dropped.holds and not dropped.witness["L(P(X)) = 0"]
    assert dropped.witness["P(X) = X - L*((L L*)^-1 L(X))"] and dropped.witness["P(V) = V for tangent V"]


@pytest.mark.parametrize("shape, name", _CASES, ids=[f"{n}-{s[0]}x{s[1]}" for s, n in _CASES])
def test_manifold_certificate(shape, name):
    manifold, W = _POINTS[shape][name]
    certificate = certify_manifold(manifold, W, name)
    assert certificate.holds, certificate.witness
    assert certificate.witness["gram_diag_positive"]


def test_projx_certificate_rejects_wrong_projections():
    class ObliqueByRows(Oblique):  # normalizes rows: off the manifold
        @matrix_method()
        def projx(self, x):
            return x / x.norm(dim=-1, keepdim=True)

    class RouterUncentered(CenteredRouterSpace):
        @matrix_method()
        def projx(self, x):
            return x

    class LPROScaled(LPRO):  # on the manifold, but not the nearest point
        @matrix_method()
        def projx(self, x):
            y = x + x[..., :1, :]
            return 1.5 * y / y.norm(dim=-1, keepdim=True)

    for wrong, name in ((ObliqueByRows(), "Oblique"), (RouterUncentered(), "CenteredRouterSpace"), (LPROScaled(radius=1.5), "LPRO")):
        _, W = _POINTS[(3, 2)][name]
        assert not certify_projx(wrong, W).holds, name


@pytest.mark.parametrize("shape", _VALUE_SHAPES, ids=[f"{m}x{n}" for m, n in _VALUE_SHAPES])
def test_svd_projx_is_the_documented_map(shape):
    for manifold, keeps_column_norms in ((Stiefel(), False), (DGram(), True)):
        certificate = certify_projx_float64(manifold, shape, keeps_column_norms)
        assert certificate.holds, (manifold, certificate.witness)
        # each manifold held to the other's documented map: D's column norms are not 1
        assert not certify_projx_float64(manifold, shape, not keeps_column_norms).holds, manifold

    class DGramSquaredNorms(DGram):
        @matrix_method()
        def projx(self, x):
            U, _, Vh = torch.linalg.svd(x.double(), full_matrices=False)
            return ((U @ Vh) * x.square().sum(-2).unsqueeze(-2)).to(x.dtype)

    class StiefelQR(Stiefel):  # a frame, but not the polar factor
        @matrix_method()
        def projx(self, x):
            return torch.linalg.qr(x)[0]

    assert not certify_projx_float64(DGramSquaredNorms(), shape, True).holds
    assert not certify_projx_float64(StiefelQR(), shape, False).holds


def _dgram_projection_keeping_the_diagonal(W, X):
    d2 = W.square().sum(-2)
    S = W.mT @ X + X.mT @ W
    return X - W @ (S / (d2.unsqueeze(-1) + d2.unsqueeze(-2)))


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
def test_projection_certificate_accepts_the_library_and_rejects_wrong_projections(shape):
    stiefel, W = _POINTS[shape]["Stiefel"]
    dgram, Wd = _POINTS[shape]["DGram"]
    assert certify_projection(stiefel.proju, stiefel, W).holds
    assert certify_projection(dgram.proju, dgram, Wd).holds
    # P = 0, the Stiefel formula with sym dropped, DGram keeping Sigma's diagonal.
    assert not certify_projection(lambda W, X: X * 0, stiefel, W).holds
    assert not certify_projection(lambda W, X: X - W @ (W.mT @ X), stiefel, W).holds
    assert not certify_projection(_dgram_projection_keeping_the_diagonal, dgram, Wd).holds


def test_manifold_certificate_rejects_a_wrong_adjoint_and_gram_diagonal():
    class HalfAdjoint(Stiefel):
        def constraint_adjoint(self, x, lam):
            return super().constraint_adjoint(x, lam) / 2

    class DiagonalKept(DGram):
        def constraint_adjoint(self, x, lam):
            return 2 * x @ sym(lam)

    _, W = _POINTS[(3, 2)]["Stiefel"]
    _, Wd = _POINTS[(3, 2)]["DGram"]
    half = certify_manifold(HalfAdjoint.__new__(HalfAdjoint), W)
    assert not half.holds and not _zero(half.witness["<L(A), lam> = <A, L*(lam)>"])
    kept = certify_manifold(DiagonalKept.__new__(DiagonalKept), Wd)
    assert not kept.holds and not _zero(kept.witness["<L(A), lam> = <A, L*(lam)>"])


def test_a_manifold_without_a_diagonal_gram_is_refused_by_name_not_reported_as_failing():
    # a manifold declaring no diagonal L L* (a user's generalized Stiefel): its generic projection had
    # raised a TypeError inside the certificate, and a closed-form one had read "holds=False" with
    # every residual zero
    class NoDiagonalGram(Stiefel):
        def constraint_gram_diag(self, x):
            return None

    stiefel, W = _POINTS[(3, 2)]["Stiefel"]
    refused = r"NoDiagonalGram declares no diagonal L L\* .*check_manifold_contract"
    with pytest.raises(ValueError, match=rf"certify_manifold: {refused}"):
        certify_manifold(NoDiagonalGram(), W)
    with pytest.raises(ValueError, match=rf"certify_projection: {refused}"):
        certify_projection(NoDiagonalGram().proju, NoDiagonalGram(), W)
    every = certify_every_size(NoDiagonalGram())  # (its convention: not certified, the error as its witness)
    assert not every.holds and re.search(rf"ValueError: certify_every_size: {refused}", every.witness["error"])
    # negative controls: the parent class certifies
    assert certify_manifold(stiefel, W).holds and certify_projection(stiefel.proju, stiefel, W).holds
    assert certify_every_size(stiefel).holds


def _zero(residual) -> bool:
    return sp.Matrix(residual).is_zero_matrix if not isinstance(residual, sp.Expr) else residual == 0


# ----------------------------------------------------------------------- retractions

_EXACT_RETRACTIONS = [(s, n) for s in [(3, 2), (2, 3)] for n in ("Oblique", "LPRO", "CenteredRouterSpace", "Euclidean", "LPRO()")]


@pytest.mark.parametrize("shape, name", _EXACT_RETRACTIONS, ids=[f"{n}-{s[0]}x{s[1]}" for s, n in _EXACT_RETRACTIONS])
def test_retraction_series(shape, name):
    # LPRO() without a radius is the unconstrained space, at the Euclidean point
    manifold, W = (LPRO(), _POINTS[shape]["Euclidean"][1]) if name == "LPRO()" else _POINTS[shape][name]
    certificate = certify_retraction(manifold, W, name)
    assert certificate.holds, certificate.witness


def test_retraction_series_rejects_a_step_along_minus_u():
    manifold, W = _POINTS[(3, 2)]["Oblique"]
    backwards = certify_retraction(manifold, W, retraction=lambda W, U: manifold.retr(W, -U))
    assert not backwards.holds and not any(backwards.witness["R(W, 0) = W"].flat)
    assert any(backwards.witness["dR_W(0)[V] = V"].flat)


@pytest.mark.parametrize("orientation, n", [("tall", 3), ("wide", 2)])
def test_stiefel_retraction_series_every_size(orientation, n):
    certificate = certify_stiefel_retraction(orientation, n)
    assert certificate.holds, certificate.witness
    # Polar Express at 1/(1.01 sqrt n) is 1 to the series' 60 digits: R_W(0) = W, dR_W(0) = id.
    assert abs(certificate.witness["e"] - 1) < sp.Rational(1, 10**40)


def test_stiefel_retraction_series_rejects_wrong_retractions():
    from geomuon.manifolds.linalg import msign

    class Backwards(Stiefel):
        @matrix_method("u")
        def retr(self, x, u):
            return msign(x - u, "polar_express")

    class KellerRetraction(Stiefel):
        @matrix_method("u")
        def retr(self, x, u):
            return msign(x + u, "newton_schulz")

    backwards = certify_stiefel_retraction("tall", 3, Backwards())
    assert not backwards.holds and backwards.witness["other terms"]
    # Keller's quintic is not a retraction: R_W(0) = 0.686 W, outside Polar Express's enclosure.
    keller = certify_stiefel_retraction("tall", 3, KellerRetraction())
    assert not keller.holds and abs(keller.witness["e"] - 1) > sp.Rational(1, 4)
    # the every-size certificate rejects both too: W - tV is not the family W + tV, and
    # Keller's rows are not Polar Express's
    backwards = certify_stiefel_retraction_every_size("tall", Backwards())
    assert not backwards.holds and "step 0: input not of the family's form" in backwards.witness["problems"]
    keller = certify_stiefel_retraction_every_size("tall", KellerRetraction())
    assert not keller.holds and keller.witness["problems"]


@pytest.mark.parametrize("orientation", ["tall", "square", "wide", "row"])
def test_stiefel_retraction_every_size(orientation):
    certificate = certify_stiefel_retraction_every_size(orientation)
    assert certificate.holds, certificate.witness
    # e_n = P_12(1/(1.01 sqrt n)) is 1 to 50 digits for every n <= 10^6
    low, high = certificate.witness["e_n for n <= n_max in"]
    assert 1 - low <= sp.Rational(2, 10**50) and high - 1 <= sp.Rational(2, 10**50)


def test_dgram_step_expansion_every_size():
    certificate = certify_dgram_step_expansion()
    assert certificate.holds, certificate.witness


@pytest.mark.parametrize("orientation", ["tall", "square", "wide", "row"])
def test_dgram_retraction_series_every_size(orientation):
    certificate = certify_dgram_retraction(orientation)
    assert certificate.holds, certificate.witness
    assert certificate.witness["steps"] == 12
    # e_n = P_12(1/(1.01 sqrt n)) is 1 to 50 digits for every n <= 10^6, whatever the column norms
    low, high = certificate.witness["e_n for n <= n_max in"]
    assert 1 - low <= sp.Rational(2, 10**50) and high - 1 <= sp.Rational(2, 10**50)


def test_dgram_retraction_series_rejects_wrong_retractions():
    from geomuon.manifolds.linalg import msign

    class DGramBackwards(DGram):
        def retr(self, x, u):
            return super().retr(x, -u)

    class DGramPolarOnly(DGram):  # forgets to restore the column norms
        @matrix_method("u")
        def retr(self, x, u):
            return msign(x + u, "polar_express")

    class DGramElevenSteps(DGram):
        @matrix_method("u")
        def retr(self, x, u):
            d2 = (x + u).square().sum(-2)
            return msign(x + u, "polar_express", steps=11) * d2.sqrt().unsqueeze(-2)

    class DGramUnnormalized(DGram):  # msign of the target itself: its columns' x_i spread with their norms
        @matrix_method("u")
        def retr(self, x, u):
            d2 = (x + u).square().sum(-2)
            return msign(x + u, "polar_express") * d2.sqrt().unsqueeze(-2)

    for wrong in (DGramBackwards(), DGramPolarOnly(), DGramElevenSteps(), DGramUnnormalized()):
        certificate = certify_dgram_retraction("tall", wrong)
        assert not certificate.holds, type(wrong).__name__


@pytest.mark.parametrize("orientation", ["tall", "square", "wide", "row"])
def test_dgram_projection_and_retraction_commute_with_its_group_every_size(orientation):
    from geomuon.manifolds.linalg import msign
    from geomuon.theory.symbolic import certify_dgram_symmetry

    certificate = certify_dgram_symmetry(orientation)
    assert certificate.holds, certificate.witness

    class DGramRowNorms(DGram):  # rescales by the target's row norms: breaks O_m
        @matrix_method("u")
        def retr(self, x, u):
            y = x + u
            return msign(y, "polar_express") * y.norm(dim=-1, keepdim=True)

    wrong = certify_dgram_symmetry(orientation, DGramRowNorms())
    assert not wrong.holds and wrong.witness["R_gW(gV) = g R_W(V)"] and not wrong.witness["P_gW(gX) = g P_W(X)"]


def test_gram_engine_retract_is_the_forms_retraction():
    certificate = certify_gram_retract()
    assert certificate.holds, certificate.witness


def test_gram_form_retraction_series_coefficients_are_binomial():
    certificate = certify_inverse_sqrt_series()
    assert certificate.holds, certificate.witness


def test_newton_schulz_step_expansion_every_size():
    certificate = certify_newton_schulz_step_expansion()
    assert certificate.holds, certificate.witness


def _frames(shape, manifold, seed):
    generator = torch.Generator().manual_seed(seed)
    W = manifold.random(*shape, dtype=torch.float64, generator=generator)
    if isinstance(manifold, DGram):  # column norms in [1, 2], unsorted
        norms = 1 + torch.rand(min(shape), generator=generator, dtype=torch.float64)
        W = W * (norms.unsqueeze(-2) if shape[0] >= shape[1] else norms.unsqueeze(-1)) / W.norm(dim=-2 if shape[0] >= shape[1] else -1, keepdim=True)
    V = manifold.proju(W, torch.randn(*shape, generator=generator, dtype=torch.float64))
    return W, V / V.norm()


def _pe_error(W, columns):
    """Exact scalar error e = P_12(1.01^{-1} ||W||_F^{-1} d_j) of Polar Express at each
    normalized singular value (40-digit arithmetic on the library's step polynomial)."""
    scale = 1 / (sp.Rational("1.01") * sp.sqrt(exact(float(W.square().sum()))))
    return torch.tensor([float(newton_schulz_error(POLAR_EXPRESS, None, sp.N(scale * exact(float(d)), 40))) for d in columns], dtype=torch.float64)


@pytest.mark.parametrize("shape", [(5, 3), (3, 3), (3, 5)])
def test_stiefel_retraction_matches_its_certified_expansion(shape):
    stiefel = Stiefel()
    W, V = _frames(shape, stiefel, 0)
    e = float(_pe_error(W, [1.0])[0])
    certificate = certify_newton_schulz_retraction(stiefel.retr, W, V, lambda W, V: (e * W, e * V))
    assert certificate.holds, certificate.witness
    backwards = certify_newton_schulz_retraction(lambda W, U: stiefel.retr(W, -U), W, V, lambda W, V: (e * W, e * V))
    assert not backwards.holds and backwards.witness["derivative_error"] > 1.9


@pytest.mark.parametrize("shape", [(5, 3), (3, 5)])
def test_dgram_retraction_at_zero_and_first_order(shape):
    # R(W, 0) = e_n W exactly (msign of the normalized columns Q is Q P(1/(1.01 sqrt n)),
    # certify_dgram_retraction), and dR_W(0) = e_n id: the derivative is e_n V to the 1e-6
    # difference-quotient budget.
    dgram = DGram()
    W, V = _frames(shape, dgram, 1)
    tall = shape[0] >= shape[1]
    unit = W / W.norm(dim=-2 if tall else -1, keepdim=True)
    e = float(_pe_error(unit, [1.0])[0])

    def expected(W, V):
        return (e * W, e * V)

    assert certify_newton_schulz_retraction(dgram.retr, W, V, expected).holds
    assert not certify_newton_schulz_retraction(lambda W, U: dgram.retr(W, -U), W, V, expected).holds


# certify_gram_form: the Gram-space form agrees with the manifold and retracts (3x2);
# certify_projx: projx lands on the manifold with X - projx(X) normal (every exact shape).
_POINT_CERTIFICATES = (
    [(certify_gram_form, s, n) for s in [(3, 2)] for n, (m, _) in _POINTS[s].items() if getattr(m, "gram_form", None) is not None]
    + [(certify_projx, s, n) for s in _POINTS for n in ("Oblique", "LPRO", "CenteredRouterSpace", "Euclidean")]
)


@pytest.mark.parametrize("certify, shape, name", _POINT_CERTIFICATES,
                         ids=[f"{c.__name__}-{n}-{s[0]}x{s[1]}" for c, s, n in _POINT_CERTIFICATES])
def test_point_certificate(certify, shape, name):
    manifold, W = _POINTS[shape][name]
    certificate = certify(manifold, W, name)
    assert certificate.holds, certificate.witness


def test_gram_form_certificate_rejects_a_wrong_newton_increment():
    from geomuon.manifolds.capabilities import OrthonormalGram

    class FullIncrement(OrthonormalGram):
        def newton_increment(self, D, E):
            return E

    class StiefelFullIncrement(Stiefel):
        gram_form = FullIncrement()

    _, W = _POINTS[(3, 2)]["Stiefel"]
    certificate = certify_gram_form(StiefelFullIncrement(), W)
    assert not certificate.holds
    assert not _zero(certificate.witness["S(newton_increment(D, E)) = E for symmetric E"])


@pytest.mark.parametrize("name", ["Stiefel", "Oblique"])
def test_gram_form_certificate_rejects_a_projection_exact_only_on_the_manifold(name):
    # sym(M) for Stiefel and diag(M) for Oblique agree with the forms' projections where
    # D = I (every point the manifold certificates take), but gram_step projects at the
    # point cW scaled by weight decay, D = c^2 I, where they leave a normal part.
    from geomuon.manifolds.capabilities import OrthonormalGram, UnitColumnsGram

    class SymOnly(OrthonormalGram):
        def project(self, D, M):
            return sym(M)

    class DiagOnly(UnitColumnsGram):
        def project(self, D, M):
            return torch.diag_embed(torch.diagonal(M, dim1=-2, dim2=-1))

    manifold, W = _POINTS[(3, 2)][name]
    broken = type(f"{name}OnTheManifoldOnly", (type(manifold),), {"gram_form": SymOnly() if name == "Stiefel" else DiagOnly()})
    certificate = certify_gram_form(broken(), W)
    assert not certificate.holds
    assert _zero(certificate.witness["X - W Sigma = P(X)"])
    assert not _zero(certificate.witness["X - cW Sigma(c^2 D, cW'X) = P(X) at the scaled point cW"])


def test_series_radius_certificate_rejects_a_wrong_radius(monkeypatch):
    import geomuon.manifolds.capabilities as capabilities

    radius = capabilities.series_radius
    monkeypatch.setattr(capabilities, "series_radius", lambda terms, dtype: radius(terms, dtype) * 1.01)
    assert not certify_inverse_sqrt_series().holds


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stiefel_series_covers_is_the_certified_bound(dtype, monkeypatch):
    from geomuon.theory.symbolic import certify_series_covers

    certificate = certify_series_covers(dtype)
    assert certificate.holds, certificate.witness
    # controls: the decision against the whole radius (no room left for the point's own
    # feasibility error), and a constraint without its transpose term, which the identity sees
    from geomuon.manifolds.capabilities import OrthonormalGram, series_radius

    monkeypatch.setattr(OrthonormalGram, "series_covers", lambda self, step, normal, shrink, terms, dtype:
                        abs(shrink * shrink - 1) + shrink * normal + step * step <= series_radius(terms, dtype))
    assert not certify_series_covers(dtype).holds
    monkeypatch.undo()
    monkeypatch.setattr(OrthonormalGram, "constraint", lambda self, M: M)
    broken = certify_series_covers(dtype)
    assert not broken.holds and broken.witness["identity"]


def test_dgram_sorted_sigma_map_does_not_fix_points():
    moved = certify_sorted_sigma_map_fails((1, 2))
    assert moved.holds and not moved.witness.is_zero_matrix
    # With column norms already descending the sorted map happens to agree.
    assert not certify_sorted_sigma_map_fails((2, 1)).holds


# ----------------------------------------------------------------------- update maps

_MAP_ROWS = [d for d in declared.declarations() if d.kind == "map"]


@pytest.mark.parametrize("declaration", _MAP_ROWS, ids=[d.id for d in _MAP_ROWS])
def test_declared_map_row_is_certified(declaration):
    certificate = certify_map_row(declaration)
    assert certificate.holds, (certificate.claim, certificate.witness)


# Rows declared "holds" for a group their proof does not cover: each is false (the table
# declares spectral | row-scaling and hybrid | bi-orthogonal "fails"; the polar factor is not
# column-scaling invariant; centering does not make a map O_m-equivariant on the left, and a
# sign flip of a row moves the mean; hybrid's row stage breaks left rotations).
_WRONG_HOLDS = [("spectral", declared.ROWS), ("hybrid", declared.BO), ("right_polar", declared.COLS),
                ("centered(spectral)", declared.BO), ("swiglu hybrid stack", declared.BO),
                ("spectral per matrix", declared.ROWS), ("centered(right_polar)", declared.SRP),
                ("hybrid", declared.SCP)]


@pytest.mark.parametrize("name, group", _WRONG_HOLDS, ids=[f"{n}-{g.name}" for n, g in _WRONG_HOLDS])
def test_map_row_certificate_rejects_a_group_its_proof_does_not_cover(name, group):
    row = declared.Declaration(name, "map", group, "holds", "declared wrongly on purpose", lambda: None)
    certificate = certify_map_row(row)
    assert not certificate.holds, certificate.claim


_MSIGN_ROWS = [d for d in _MAP_ROWS if d.expected == "holds" and d.update not in ("row_norm", "col_norm", "sign", "centered(row_norm)")]


@pytest.mark.parametrize("declaration", _MSIGN_ROWS, ids=[d.id for d in _MSIGN_ROWS])
def test_map_rows_that_call_msign_rest_on_the_step_proof(declaration, monkeypatch):
    # The polar and spectral rows replace msign by the action the Newton-Schulz step proof
    # gives; without that proof (here: refuted) the row must not be certified.
    import geomuon.theory.symbolic as symbolic

    monkeypatch.setattr(symbolic, "certify_newton_schulz_equivariance",
                        lambda: symbolic.Certificate("the step proof, refuted for the control", False, None))
    assert not certify_map_row(declaration).holds


_DUALIZERS = [(f, norm, s) for f, norm in ((maps.row_norm, "row"), (maps.col_norm, "column"), (maps.sign, "max"))
              for s in ((3, 2), (2, 3))]


@pytest.mark.parametrize("update, norm, shape", _DUALIZERS, ids=[f"{f.__name__}-{s[0]}x{s[1]}" for f, _, s in _DUALIZERS])
def test_elementwise_maps_are_the_dualizers_of_their_norms(update, norm, shape):
    certificate = certify_dualizer(update, norm, shape)
    assert certificate.holds, certificate.witness


def test_dualizer_certificate_rejects_wrong_scales_and_axes():
    # each of these is as equivariant as the library's map, and none is its dualizer
    def squared_rows(D, eps=0.0):
        return D / (D.norm(dim=-1, keepdim=True) + eps) ** 2

    def doubled_sign(D):
        return 2 * maps.sign(D)

    assert not certify_dualizer(squared_rows, "row", (3, 2)).holds
    assert not certify_dualizer(doubled_sign, "max", (3, 2)).holds
    assert not certify_dualizer(maps.col_norm, "row", (3, 2)).holds


@pytest.mark.parametrize("orientation", ["tall", "square", "wide"])
def test_equivariance_certificate_rejects_maps_declared_equivariant_wrongly(orientation):
    from geomuon.theory.symbolic import _centered_stages, _hybrid_stages

    def rejected(update, group):
        return not certify_equivariance_every_size(update, group, orientation).holds

    # row_norm and sign are not O_m x O_n-equivariant; row_norm is not shift-invariant.
    assert rejected(maps.row_norm, BiOrthogonal())
    assert rejected(maps.sign, BiOrthogonal())
    assert rejected(maps.row_norm, RouterShift())
    # col_norm under S_m x O_n: the right rotation mixes columns; hybrid's row stage
    # under O_m x O_n; a centering that removes half the mean.
    assert rejected(maps.col_norm, LeftPermRightOrth())
    assert rejected(_hybrid_stages, BiOrthogonal())
    assert rejected(lambda D: D - 0.5 * D.mean(dim=-2, keepdim=True), RouterShift())
    # positive control: the library's centered(spectral) stages are accepted
    assert not rejected(_centered_stages(maps.spectral), RouterShift())


@pytest.mark.parametrize("orientation", ["tall", "square", "wide", "row"])
def test_polar_maps_composition_is_equivariant_every_size(orientation):
    from geomuon.theory.symbolic import certify_polar_map_equivariance

    certificate = certify_polar_map_equivariance(orientation=orientation)
    assert certificate.holds, certificate.witness

    def row_scaled(D, alpha=1.0):  # right_polar, then rows scaled by D's row norms
        return maps.right_polar(D, alpha=alpha) / (D.norm(dim=-1, keepdim=True) + 1)

    if orientation == "row":
        return  # one row: a row scaling commutes with O_1 = {1, -1}, no control there
    wrong = certify_polar_map_equivariance(row_scaled, orientation)
    assert not wrong.holds and wrong.witness[("row_scaled", 1, "left")]
    assert not wrong.witness[("row_scaled", 1, "right")]  # rotating the rows' entries is fine


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 5, 3)], ids=lambda s: "x".join(map(str, s)))
def test_msign_with_scratch_buffers_is_the_certified_iteration(shape, dtype):
    # The certificates run newton_schulz_step without buffers (the symbolic stand-ins take
    # that branch); Muon on the CPU passes ScratchBuffers, a second branch of the same step
    # (mm/addmm with out=), documented as the same kernels, so the same bits: equal bitwise.
    from geomuon.manifolds.linalg import ScratchBuffers, msign

    X = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    for schedule in (POLAR_EXPRESS, KELLER_QUINTIC):
        assert torch.equal(msign(X, coefficients=schedule, buffers=ScratchBuffers()), msign(X, coefficients=schedule))


def test_newton_schulz_equivariance_is_of_the_library_step():
    certificate = certify_newton_schulz_equivariance()
    assert certificate.holds and certificate.witness == {"step": {}, "normalization": {}}
    # Exact rational instance of the same identity, and its failure for a non-orthogonal L.
    from geomuon.manifolds.linalg import newton_schulz_step

    L = cayley(sp.Matrix([[0, sp.Rational(1, 3)], [-sp.Rational(1, 3), 0]]))
    R = cayley(sp.Matrix([[0, 1, 2], [-1, 0, sp.Rational(1, 2)], [-2, -sp.Rational(1, 2), 0]]))
    X = sp.Matrix([[1, 2, -1], [0, 3, 1]]) / 5
    a, b, c = KELLER_QUINTIC.coefficients[0]

    def step(Y):
        return newton_schulz_step(ExactTensor(Y), a, b, c).matrix()

    assert step(L * X * R.T) == L * step(X) * R.T
    not_orthogonal = sp.Matrix([[1, 1], [0, 1]])
    assert step(not_orthogonal * X * R.T) != not_orthogonal * step(X) * R.T


# The Gram engine's polish, Newton and Jacobi dual steps (float64, on the library's
# functions; wide pairs run transposed, as ManifoldMuon runs them).
_ENGINE_SHAPES = [(7, 4), (4, 4), (4, 7)]


def _engine_pair(manifold, shape, seed=0):
    """A float64 point (DGram: column norms in [1, 2], unsorted) and a generic momentum."""
    generator = torch.Generator().manual_seed(seed)
    W = torch.as_tensor(manifold.random(*shape, dtype=torch.float64, generator=generator)).clone()
    if isinstance(manifold, DGram):
        tall = shape[0] >= shape[1]
        norms = 1 + torch.rand(min(shape), generator=generator, dtype=torch.float64)
        W = W * (norms.unsqueeze(-2) if tall else norms.unsqueeze(-1)) / W.norm(dim=-2 if tall else -1, keepdim=True)
    return W, torch.randn(*shape, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("shape", _ENGINE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=["Stiefel", "DGram"])
def test_gram_engine_polish_newton_and_jacobi_steps(manifold, shape):
    from geomuon.theory.symbolic import certify_gram_jacobi_step, certify_gram_newton_step, certify_gram_polish

    W, G = _engine_pair(manifold, shape)
    for certify in (certify_gram_newton_step, certify_gram_jacobi_step):
        certificate = certify(manifold, W, G)
        assert certificate.holds, (certify.__name__, certificate.witness)
    for method in ("admm", "alternating"):  # the form declares one; either must do what it says
        certificate = certify_gram_polish(manifold, W, G, method=method)
        assert certificate.holds, (method, certificate.witness)


def test_gram_polish_certificate_rejects_admm_without_its_dual(monkeypatch):
    # control: "admm" rounds that drop the dual iterate (u = 0, no G term: alternating projections)
    import geomuon.optimizers.gram as gram
    from geomuon.theory.symbolic import certify_gram_polish

    polish = gram.polish
    monkeypatch.setattr(gram, "polish", lambda *args, dual=None: polish(*args))
    for shape in _ENGINE_SHAPES:
        W, G = _engine_pair(DGram(), shape)
        certificate = certify_gram_polish(DGram(), W, G, method="admm")
        tangency, deviation, _, tol = certificate.witness["round 1: |L_W(A)|, |A - reference|, |A|_F - |A_prev|_F, tol"]
        assert not certificate.holds and deviation > 1e3 * tol


_WEIGHT_DECAY_CASES = [(m, s) for m in (Stiefel(), DGram()) for s in _ENGINE_SHAPES] + [(Oblique(), (7, 4)), (Oblique(), (4, 4))]


@pytest.mark.parametrize("manifold, shape", _WEIGHT_DECAY_CASES, ids=[f"{type(m).__name__}-{s[0]}x{s[1]}" for m, s in _WEIGHT_DECAY_CASES])
def test_gram_engine_step_under_weight_decay(manifold, shape):
    from geomuon.theory.symbolic import certify_gram_weight_decay

    W, G = _engine_pair(manifold, shape)
    certificate = certify_gram_weight_decay(manifold, W, G)
    assert certificate.holds, certificate.witness


def test_gram_weight_decay_certificate_rejects_a_step_that_drops_the_decay(monkeypatch):
    # control: the engine's retraction from W instead of cW (weight decay silently dropped)
    import geomuon.optimizers.gram as gram
    from geomuon.theory.symbolic import certify_gram_weight_decay

    retract = gram.retract
    monkeypatch.setattr(gram, "retract", lambda form, W, Z0, T1, T2, lr, shrink=1.0, *rest: retract(form, W, Z0, T1, T2, lr, 1.0, *rest))
    W, G = _engine_pair(Stiefel(), (7, 4))
    certificate = certify_gram_weight_decay(Stiefel(), W, G)
    residual, tol = certificate.witness["|point - R_cW(-lr A)|, tol"]
    assert not certificate.holds and residual > 1e3 * tol


def test_polynomial_dualizer_kernels(monkeypatch):
    import geomuon.optimizers.gram as gram
    from geomuon.theory.symbolic import certify_polynomial_dualizers

    certificate = certify_polynomial_dualizers()
    assert certificate.holds, certificate.witness
    # controls, one per kernel: a step short in gram_msign's Polar Express, no clip in the
    # unit ball, and an inverse root that is a rotation of N^(-1/2) (the Cholesky factor's
    # inverse: R'NR = I, not symmetric)
    polar_express_steps = gram.polar_express_steps
    monkeypatch.setattr(gram, "polar_express_steps", lambda X, steps, **kw: polar_express_steps(X, steps - 1, **kw))
    assert not certify_polynomial_dualizers().holds
    monkeypatch.undo()
    monkeypatch.setattr(gram, "polynomial_unit_ball", lambda G: torch.eye(G.size(-1), dtype=G.dtype).expand_as(G))
    assert not certify_polynomial_dualizers().holds
    monkeypatch.undo()
    monkeypatch.setattr(gram, "polynomial_inverse_sqrt", lambda N: torch.linalg.inv(torch.linalg.cholesky(N, upper=True)))
    rotated = certify_polynomial_dualizers()
    assert not rotated.holds and rotated.witness["polynomial_inverse_sqrt: |R'NR - I|, |R - R'|, tol"][0] < 1e-12


def test_gram_engine_certificates_reject_wrong_formulas():
    from geomuon.manifolds.capabilities import OrthogonalColumnsGram, OrthonormalGram
    from geomuon.theory.symbolic import certify_gram_jacobi_step, certify_gram_newton_step, certify_gram_polish

    class NoTangentProjection(OrthogonalColumnsGram):  # polish without its tangent step
        def project(self, D, M):
            return 0 * M

    class OperatorXPlusX(OrthogonalColumnsGram):  # Off(X + X) instead of Off(X + X^T), X = D S P
        def newton_operator(self, D, lam, P):
            X = (torch.diagonal(D, dim1=-2, dim2=-1).unsqueeze(-1) * self.adjoint(lam)) @ P
            return 2 * (X - torch.diag_embed(torch.diagonal(X, dim1=-2, dim2=-1)))

    class FullIncrement(OrthonormalGram):  # the closed form's E instead of E/2
        def newton_increment(self, D, E):
            return E

    class DoubledJacobi(OrthogonalColumnsGram):  # diag(L L*) doubled
        def gram_diag(self, D):
            return 2 * super().gram_diag(D)

    for shape in ((7, 4), (4, 7)):
        W, G = _engine_pair(DGram(), shape)
        for method in ("admm", "alternating"):
            polish = certify_gram_polish(DGram(), W, G, form=NoTangentProjection(), method=method)
            assert not polish.holds
            tangency, _, _, tol = polish.witness["round 1: |L_W(A)|, |A - reference|, |A|_F - |A_prev|_F, tol"]
            assert tangency > 1e3 * tol
        operator = certify_gram_newton_step(DGram(), W, G, form=OperatorXPlusX())
        assert not operator.holds
        residual, tol = operator.witness["CG, 6 steps: |L_W((Z + L*d) P)|, tol"]
        assert residual > 1e3 * tol
        jacobi = certify_gram_jacobi_step(DGram(), W, G, form=DoubledJacobi())
        assert not jacobi.holds and jacobi.witness["|d * g + alpha sigma L_W(A)|, tol"][0] > 1e-3
        W, G = _engine_pair(Stiefel(), shape)
        increment = certify_gram_newton_step(Stiefel(), W, G, form=FullIncrement())
        residual, tol = increment.witness["closed form: |L_W((Z + L*d) P)|, tol"]
        assert not increment.holds and residual > 1e3 * tol
