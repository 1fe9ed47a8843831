"""Weight regulation (seed 003): every regulator against an SVD oracle, the soft-cap
coupling against an independent root finder, and the promised RMS→RMS bounds after every
step of 500-step Muon runs, measured independently by SVD."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from geomuon.manifolds.linalg import MSIGN_METHODS, fixed_start, msign
from geomuon.optimizers import Muon
from geomuon.optimizers.regulate import (
    _hard_cap_sign_profile,
    _top_ritz_vector,
    HARD_CAP_METHODS,
    REGULATORS,
    ColumnCap,
    HardCap,
    Chain,
    Regulator,
    SoftCap,
    SpectralHammer,
    SpectralNormalize,
    SpectralWeightDecay,
    WeightDecay,
    make_regulator,
    muon_update_norm,
    ns_output_max,
    rms_scale,
    rms_spectral_norm,
    soft_cap_alpha,
    soft_cap_alpha_tensor,
    soft_cap_polynomial,
)
from geomuon.theory.groups import haar_orthogonal
from geomuon.theory.symbolic import soft_cap_coupling_roots

F64_EPS = torch.finfo(torch.float64).eps
F32_EPS = torch.finfo(torch.float32).eps
SHAPES = [(24, 16), (16, 24), (20, 20)]


def with_rms_spectrum(shape, spectrum, generator, dtype=torch.float64):
    """A [fan_out, fan_in] matrix whose RMS-scaled singular values are `spectrum`."""
    m, n = shape
    k = min(m, n)
    U, V = haar_orthogonal(m, generator)[:, :k], haar_orthogonal(n, generator)[:, :k]
    s = torch.as_tensor(spectrum, dtype=torch.float64)
    return ((U * s) @ V.T / rms_scale(shape)).to(dtype)


def svd_apply(W, scalar_map):
    """Oracle: apply a scalar map to the RMS-scaled singular values of W (float64 SVD)."""
    scale = rms_scale(W.shape)
    U, S, Vh = torch.linalg.svd(W.double() * scale, full_matrices=False)
    return (U * scalar_map(S).unsqueeze(-2)) @ Vh / scale


def rms_singular_values(W):
    return torch.linalg.svdvals(W.double()) * rms_scale(W.shape)


# ----------------------------------------------------------------------------- soft cap coupling

# 20 feasible (w_max, wd, eta) points, from loose (eta << w_max) to near the monotone limit
# k = (81/62) w_max, and the 1.05-margin Muon eta for lr in {0.01, 0.1}.
COUPLING_POINTS = [
    (w, wd, frac * w * (81 / 62 - (1 - wd)))
    for w in (0.5, 1.0, 2.0, 6.0, 10.0)
    for wd, frac in ((0.0, 0.05), (0.0, 0.6), (0.01, 0.3), (0.1, 0.999))
]


def numpy_smallest_nonnegative_root(w_max, wd, eta):
    k = w_max * (1 - wd) + eta
    roots = np.roots([-(k**9), 3 * k**7, -3 * k**5, 0.0, k - w_max])
    real = [r.real for r in roots if abs(r.imag) <= 1e-9 * max(1.0, abs(r)) and r.real >= 0]
    return min(real)


@pytest.mark.parametrize("w_max, wd, eta", COUPLING_POINTS)
def test_soft_cap_alpha_solves_the_coupling(w_max, wd, eta):
    alpha = soft_cap_alpha(w_max, wd, eta)
    k = w_max * (1 - wd) + eta
    # f(k) = w_max: f is evaluated in float64 with terms of size ~k, so a few ulps of k.
    assert soft_cap_polynomial(k, alpha) == pytest.approx(w_max, rel=0, abs=16 * F64_EPS * k)
    # monotone on [0, k] (f' >= 0 iff sigma <= 1/sqrt(3 alpha)), so f([0, k]) = [0, w_max]
    assert 3 * alpha * k**2 <= 1 + 1e-12
    sigma = np.linspace(0, k, 10_001)
    assert np.all(np.diff(soft_cap_polynomial(sigma, alpha)) >= -16 * F64_EPS * k)
    # independent root finder (companion-matrix eigenvalues); the root is simple
    # (h'(beta) < 0), so both agree to the conditioning of the quartic, ~1e-13 relative.
    assert alpha == pytest.approx(numpy_smallest_nonnegative_root(w_max, wd, eta), rel=1e-10)


@pytest.mark.parametrize("w_max, wd, eta", COUPLING_POINTS)
def test_soft_cap_alpha_on_the_device_solves_the_same_coupling(w_max, wd, eta, no_host_reads):
    # The device bisection (a fixed step count, no host read) and the host one both stop
    # where rounding decides h(beta) > w_max / k: h is evaluated to about 4 eps64 (four
    # terms of size <= 1), so each beta is within 4 eps64 / |h'(beta)| of the root, and the
    # two within twice that: relative to beta, 8 eps64 / (|h'(beta)| beta).
    with no_host_reads():
        on_device = soft_cap_alpha_tensor(w_max, torch.tensor(wd, dtype=torch.float64),
                                          torch.tensor(eta, dtype=torch.float64))
    alpha = soft_cap_alpha(w_max, wd, eta)
    k = w_max * (1 - wd) + eta
    beta = alpha * k**2
    slope = beta * (6 - 9 * beta + 4 * beta**2)  # |h'(beta)|
    assert abs(on_device.item() - alpha) <= 8 * F64_EPS / (slope * beta) * alpha
    # no cap needed: 0, as on the host; beyond the monotone limit (where the host raises):
    # the strongest monotone cap, beta = 1/3
    assert soft_cap_alpha_tensor(w_max, torch.tensor(0.5), torch.tensor(0.1 * w_max)).item() == 0.0
    too_large = soft_cap_alpha_tensor(w_max, torch.tensor(0.0), torch.tensor(w_max))
    assert too_large.item() * (2 * w_max) ** 2 == pytest.approx(1 / 3, rel=4 * F64_EPS)


@pytest.mark.parametrize("w_max, wd, eta", COUPLING_POINTS)
def test_soft_cap_alpha_agrees_with_the_symbolic_certificate(w_max, wd, eta):
    # geomuon.theory.symbolic isolates the real roots exactly (sympy) and rounds at the end
    assert soft_cap_alpha(w_max, wd, eta) == pytest.approx(soft_cap_coupling_roots(w_max, wd, eta)[0], rel=1e-10)


def test_soft_cap_alpha_is_zero_when_no_cap_is_needed():
    assert soft_cap_alpha(1.0, 0.0, 0.0) == 0.0
    assert soft_cap_alpha(2.0, 0.1, 0.1) == 0.0  # k = 1.9 <= w_max


def test_soft_cap_alpha_refuses_non_monotone_couplings():
    # w_max = 1, eta = 1: the quartic's root gives an f that peaks above w_max on [0, k].
    alpha = numpy_smallest_nonnegative_root(1.0, 0.0, 1.0)
    peak = soft_cap_polynomial(1 / math.sqrt(3 * alpha), alpha)
    assert peak > 1.15  # DESIGN §3.5: peaks at 1.19, so the cap would be violated
    with pytest.raises(ValueError, match="eta=1 is too large for w_max=1"):
        soft_cap_alpha(1.0, 0.0, 1.0)
    # the feasibility limit is k = (81/62) w_max exactly
    limit = 81 / 62 - 1
    assert 3 * soft_cap_alpha(1.0, 0.0, limit * (1 - 1e-12)) * (1 + limit) ** 2 == pytest.approx(1, abs=1e-6)
    with pytest.raises(ValueError, match="too large"):
        soft_cap_alpha(1.0, 0.0, limit * (1 + 1e-9))


@pytest.mark.parametrize(
    "args, match",
    [((0.0, 0.0, 0.1), "w_max"), ((1.0, 1.0, 0.1), "wd"), ((1.0, -0.1, 0.1), "wd"),
     ((1.0, 0.0, -0.1), "eta"), ((1.0, 0.0, math.nan), "eta"), ((math.inf, 0.0, 0.1), "w_max")],
)
def test_soft_cap_alpha_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        soft_cap_alpha(*args)


# ----------------------------------------------------------------------------- soft cap kernel


class CountOps(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(3, 24, 16), (3, 16, 24), (20, 20)])
def test_soft_cap_applies_the_polynomial_to_singular_values(shape):
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(*shape, generator=gen, dtype=torch.float64)
    W = W / rms_spectral_norm(W).max() * 1.1  # every RMS singular value <= k = 1.1
    cap = SoftCap(w_max=1.0, eta=0.1, guard_steps=0)
    alpha = soft_cap_alpha(1.0, 0.0, 0.1)
    out = cap(W, lr=0.1)
    expected = svd_apply(W, lambda s: soft_cap_polynomial(s, alpha))
    # fp64, 4 matmuls of O(1) entries: round-off ~ n * eps
    torch.testing.assert_close(out, expected, rtol=0, atol=100 * F64_EPS)
    assert rms_spectral_norm(out).max() <= 1.0 + 100 * F64_EPS


def test_soft_cap_costs_four_matmuls_and_no_factorization():
    W = torch.randn(2, 24, 16)
    with CountOps() as ops:
        SoftCap(w_max=1.0, eta=0.1, guard_steps=0)(W, lr=0.1)
    products = [n for n in ops.names if n in ("matmul", "__matmul__", "bmm", "mm")]
    assert len(products) == 4
    assert not [n for n in ops.names if "svd" in n or "eig" in n or "qr" in n]


def test_soft_cap_guard_keeps_weights_outside_the_ball_finite():
    gen = torch.Generator().manual_seed(2)
    W = with_rms_spectrum((24, 16), torch.linspace(30.0, 1.0, 16), gen)
    eta = 0.2
    alpha = soft_cap_alpha(1.0, 0.0, eta)
    peak = soft_cap_polynomial(1 / math.sqrt(3 * alpha), alpha)
    unguarded = SoftCap(w_max=1.0, eta=eta, guard_steps=0)(W, lr=0.1)
    assert rms_spectral_norm(unguarded) > 1e6  # negative control: the cubic explodes
    guarded = SoftCap(w_max=1.0, eta=eta)(W, lr=0.1)
    # the guard's power estimate is a lower bound, so sigma may end slightly above k,
    # where f is still below its peak value
    assert rms_spectral_norm(guarded) <= peak


def test_soft_cap_reads_eta_from_lr_and_shape():
    cap = SoftCap(w_max=1.0)
    assert cap.eta_for(0.1, (16, 64)) == pytest.approx(0.1 * ns_output_max() * 1.05 * 2)
    assert SoftCap(w_max=1.0, eta=lambda lr, shape: 3 * lr).eta_for(0.1, (4, 4)) == pytest.approx(0.3)
    assert SoftCap(w_max=1.0, eta=0.2).eta_for(0.5, (4, 4)) == 0.2
    with pytest.raises(ValueError, match="too large"):
        SoftCap(w_max=1.0)(torch.randn(8, 8), lr=1.0)


# ----------------------------------------------------------------------------- Muon coupling


def test_ns_output_max_matches_the_reference_table():
    # REFERENCES.md: Keller quintic x 5 maps [1e-3, 1] into [0.4705, 1.2024]
    assert ns_output_max() == pytest.approx(1.2024, abs=5e-5)


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (32, 32)])
def test_muon_update_norm_bounds_a_real_muon_update(shape):
    gen = torch.Generator().manual_seed(3)
    lr = 0.05
    eta = muon_update_norm(lr, shape)
    largest = 0.0
    for rank in (1, 2, 4, 8, min(shape)):  # low stable rank puts sigma where NS overshoots
        W = torch.nn.Parameter(torch.zeros(shape))
        W.grad = torch.randn(shape[0], rank, generator=gen) @ torch.randn(rank, shape[1], generator=gen)
        Muon([W], lr=lr, weight_decay=0.0).step()
        largest = max(largest, rms_spectral_norm(W.detach()).item())
    assert largest <= eta
    assert largest >= eta / 1.05 * 0.8  # not vacuous: within the NS spread of the bound


# ----------------------------------------------------------------------------- hard cap


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (2, 3, 20, 20)])
def test_hard_cap_equals_svd_clipping_float64(shape):
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(*shape, generator=gen, dtype=torch.float64)  # RMS sigma spread ~[0.1, 8]
    out = HardCap(w_max=1.5)(W, lr=0.0)
    expected = svd_apply(W, lambda s: s.clamp(max=1.5))
    # Polar Express converges to ~1e-14 in fp64; the sign resolution around sigma = c
    # (20 steps) is far below the gaps of a random spectrum.
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-11)


def test_hard_cap_handles_rank_deficiency_and_huge_singular_values():
    gen = torch.Generator().manual_seed(5)
    spectrum = torch.tensor([1e4, 50.0, 3.0, 1.0001, 0.9999, 0.5, 0, 0, 0, 0])
    W = with_rms_spectrum((16, 10), spectrum, gen)
    out = HardCap(w_max=1.0)(W, lr=0.0)
    expected = svd_apply(W, lambda s: s.clamp(max=1.0))
    # 1.0001 vs 0.9999 straddle the cap: the sign must resolve 2e-4 relative
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-9)


def test_hard_cap_float32_kernel():
    gen = torch.Generator().manual_seed(6)
    W = torch.randn(3, 32, 48, generator=gen)
    out = HardCap(w_max=1.0)(W, lr=0.0)
    assert out.dtype == torch.float32
    expected = svd_apply(W, lambda s: s.clamp(max=1.0))
    # fp32: two msign iterations of ~20 steps, each adding ~eps32 relative: 20 * 8 * eps32
    assert ((out.double() - expected).norm() / expected.norm()).item() < 160 * F32_EPS
    assert rms_spectral_norm(out).max().item() <= 1.0 + hard_cap_beta((32, 48), torch.float32)


HARD_CAP_SIGN_STEPS = HardCap().sign_steps  # the default, which the caps below use


def hard_cap_beta(shape, dtype, method="polar_express"):
    r"""HardCap's stated bound $\beta$ on $\sigma_{\max}/w_{\max} - 1$ within its levels' range
    ($x = 1$): $1.01\,K/2$ (the last pass's sign in exact arithmetic; none for the SVD) plus
    $2(\sqrt m + \sqrt n)\,u$, the round-off of its Gram matrix and of the result."""
    m, n = shape[-2:]
    sign = 1.01 * _hard_cap_sign_profile(HARD_CAP_SIGN_STEPS)[0] / 2 if method == "polar_express" else 0.0
    return sign + 2 * (math.sqrt(m) + math.sqrt(n)) * torch.finfo(dtype).eps / 2


def hard_cap_violations(W, out, dtype, method):
    r"""What a cap of the square ``W`` (singular values: half far above $c = 1$, the rest at or
    below $1 + 10^{-2}$) breaks of HardCap's guarantees (float64 SVD of input and output, sorted,
    so the map is read value by value: every guarantee is monotone):

    * above: no singular value above $1 + \beta$ (:func:`hard_cap_beta`), and every one that was
      above 1 ends at least at $1 - \tau$ (less the final pass's deficit, below);
    * below: every value $\sigma \le 1 - w$ kept within $\tau$; one in the band $(1 - w, 1]$
      ends in $[\sigma - \tau, 1 + \beta]$. $w = 1.01\,r_{\text{eff}}/2$, $r_{\text{eff}} = r +
      2(\sqrt m + \sqrt n)u$ the last pass's resolution (none for the SVD). $\tau$: the round-off
      of the last level (Weyl: no singular value moves by more than the error's norm): its Gram
      matrix, rounded by about $\sqrt m\,u\,\sigma_{\max}^2$, which moves the values near $c$ by
      about that over $2c$, plus $2(\sqrt m + \sqrt n)\,u\,\sigma_{\max}$ of the products."""
    m, n = W.shape
    u = torch.finfo(dtype).eps / 2
    products = 2 * (math.sqrt(m) + math.sqrt(n)) * u  # the round-off of the products, per unit of sigma
    before = torch.linalg.svdvals(W.double())
    after = torch.linalg.svdvals(out.double())
    top = before[0].item()
    beta = hard_cap_beta(W.shape, dtype, method)
    tau = math.sqrt(m) * u * top**2 / 2 + products * top
    resolution = _hard_cap_sign_profile(HARD_CAP_SIGN_STEPS)[1][dtype] if method == "polar_express" else 0.0
    band = 1.01 * (resolution + products) / 2
    kept, in_band = before <= 1 - band, (before > 1 - band) & (before <= 1)
    found = []
    if after.max().item() > 1 + beta:
        found.append(f"sigma_max - 1 = {after.max().item() - 1:.3g} > beta = {beta:.3g}")
    # a value c(1 + e) with e < 1e-2 may be left in (c, sigma] by the level (its threshold sits t above
    # c^2, t <= 2e-3 c^2 here), and the final pass maps c(1 + e) to at least c(1 - 3 e^2 / 2)
    above = before > 1
    if (after[above] < 1 - tau - 1.5 * torch.where(before < 1.01, before - 1, 0)[above] ** 2).any():
        found.append("a value above the cap ended below it")
    if (moved := ((after - before).abs() * kept).max().item()) > tau:
        found.append(f"a value below the band moved by {moved:.3g} > tau = {tau:.3g}")
    if (after[in_band] < before[in_band] - tau).any() or (after[in_band] > 1 + beta).any():
        found.append("a value in the band left [sigma - tau, 1 + beta]")
    return found


@pytest.mark.parametrize("method", HARD_CAP_METHODS)
@pytest.mark.parametrize("dtype, n", [(torch.float64, 128), (torch.float32, 128), (torch.float32, 512)])
def test_hard_cap_is_min_sigma_c_up_to_its_stated_bound_and_band(method, dtype, n):
    # Half the singular values at 15 c (the worst level ratio: one pass at rho = 16), the rest just
    # above c (unresolved by a sign thresholded at c^2 and normalized by its Frobenius norm, which
    # had left them up to 2.4e-5 above the cap in float32 at n = 256, 1.5e-5 in float64) or spread
    # from c(1 - 1e-9) down to 0.3 c (which a threshold moved below c^2 had raised towards c, in a
    # band 3e-3 wide in float32 at n = 256).
    gen = torch.Generator().manual_seed(11)
    spectra = [torch.full((n - n // 2,), 1 + delta, dtype=torch.float64) for delta in (1e-6, 1e-5, 1e-4, 1e-2)]
    spectra.append(1 - torch.logspace(-9, math.log10(0.7), n - n // 2, dtype=torch.float64))
    cap = HardCap(w_max=1.0, method=method)
    for rest in spectra[-2:] if n > 128 else spectra:  # (the 512 ones cost a second each)
        W = with_rms_spectrum((n, n), torch.cat([torch.full((n // 2,), 15.0, dtype=torch.float64), rest]), gen, dtype)
        assert hard_cap_violations(W, cap(W, lr=0.0), dtype, method) == []
    # negative controls: each breaks one side, by less than the patterns it was built against
    W = with_rms_spectrum((n, n), torch.cat([torch.full((n // 2,), 15.0, dtype=torch.float64), spectra[-1]]), gen, dtype)
    beta = hard_cap_beta((n, n), dtype, method)
    fakes = {"above by 2 beta": lambda s: s.clamp(max=1 + 2 * beta),
             "every value to c": lambda s: torch.ones_like(s),
             "a band of 1e-3 raised to c": lambda s: torch.where(s > 1 - 1e-3, 1.0, s).clamp(max=1)}
    for name, fake in fakes.items():
        assert hard_cap_violations(W, svd_apply(W, fake).to(dtype), dtype, method) != [], name


def test_hard_cap_leaves_weights_inside_the_ball_unchanged():
    gen = torch.Generator().manual_seed(7)
    W = with_rms_spectrum((20, 12), torch.linspace(0.95, 0.01, 12), gen)
    torch.testing.assert_close(HardCap(w_max=1.0)(W, lr=0.0), W, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- power-iteration regulators


def gapped(shape, top, gen, rest=0.6):
    """Spectrum [top, rest·top, ...]: a clear gap, so power iteration converges."""
    k = min(shape)
    spectrum = torch.cat([torch.tensor([top]), torch.linspace(rest * top, 0.01, k - 1)])
    return with_rms_spectrum(shape, spectrum, gen)


@pytest.mark.parametrize("shape", SHAPES)
def test_spectral_normalize_matches_exact_scaling(shape):
    gen = torch.Generator().manual_seed(8)
    W = gapped(shape, 3.0, gen)
    out = SpectralNormalize(w_max=1.5)(W, lr=0.0)
    # block power iteration with gap 0.6^(2*16): the Ritz value is exact to round-off
    torch.testing.assert_close(out, W / 2.0, rtol=0, atol=1e-12)
    inside = gapped(shape, 1.2, gen)
    assert torch.equal(SpectralNormalize(w_max=1.5)(inside, lr=0.0), inside)


@pytest.mark.parametrize("shape", SHAPES)
def test_spectral_hammer_sets_only_the_top_singular_value(shape):
    gen = torch.Generator().manual_seed(9)
    W = gapped(shape, 4.0, gen, rest=0.2)
    out = SpectralHammer(w_max=2.0)(W, lr=0.0)
    expected = svd_apply(W, lambda s: torch.where(s == s.max(), torch.full_like(s, 2.0), s))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    below = gapped(shape, 1.0, gen)
    torch.testing.assert_close(SpectralHammer(w_max=2.0)(below, lr=0.0), below, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_spectral_weight_decay_shrinks_only_the_top_singular_value(shape):
    gen = torch.Generator().manual_seed(10)
    W = gapped(shape, 4.0, gen)
    out = SpectralWeightDecay(weight_decay=0.5)(W, lr=0.2)  # shrink by 1 - 0.1
    expected = svd_apply(W, lambda s: torch.where(s == s.max(), 0.9 * s, s))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_weight_decay_is_lr_coupled():
    W = torch.randn(6, 4, dtype=torch.float64)
    # three roundings: the RMS scaling in and out, and the decay factor
    torch.testing.assert_close(WeightDecay(0.1)(W, lr=0.5), W * 0.95, rtol=3 * F64_EPS, atol=0)
    with pytest.raises(ValueError, match="flip"):
        WeightDecay(10.0)(W, lr=0.5)


def test_power_iteration_state_is_a_warm_start():
    gen = torch.Generator().manual_seed(11)
    W = gapped((24, 16), 3.0, gen, rest=0.99)  # nearly degenerate top: cold start is inexact
    cold = SpectralNormalize(w_max=1.0, steps=1)(W, lr=0.0)
    state = {}
    for _ in range(20):
        warm = SpectralNormalize(w_max=1.0, steps=1)(W, lr=0.0, state=state)
    assert isinstance(state["regulate_v"], torch.Tensor)
    error = lambda out: abs(rms_spectral_norm(out).item() - 1.0)  # noqa: E731
    assert error(warm) < error(cold) / 10


def chain_of_two_estimates(steps):
    """Spectral normalization (4 vectors) then the hammer (8): two power-iteration blocks of two
    widths in one chain, each regulator's estimate seen in the result (the scale, the top)."""
    return make_regulator([{"name": "spectral_normalize", "w_max": 1.0, "steps": steps, "block": 4},
                           {"name": "spectral_hammer", "w_max": 0.9, "steps": steps}])


def test_each_power_iteration_regulator_of_a_chain_warm_starts_from_its_own_block():
    # The chain's regulators had shared one warm-start entry: the 4-vector block never fitted the
    # 8-vector one, so both started cold at every call (warm was the one-step result, 1.6e-2 off).
    # With a block each, 20 calls of one step are 20 steps from the same fixed start: the hammer's
    # input is the normalized weight, W times a scalar, whose power iteration spans the same
    # subspaces. They differ by round-off only: each call re-orthonormalizes its stored block (QR,
    # about k eps relative, k = 16), which the later steps contract: 20 k eps on entries below 1
    # (measured 4e-16).
    gen = torch.Generator().manual_seed(11)
    W = gapped((24, 16), 3.0, gen, rest=0.99)  # nearly degenerate top: one step is far off
    state = {}
    for _ in range(20):
        warm = chain_of_two_estimates(steps=1)(W, lr=0.0, state=state)
    cold = chain_of_two_estimates(steps=20)(W, lr=0.0)
    tolerance = 20 * 16 * F64_EPS
    torch.testing.assert_close(warm, cold, rtol=0, atol=tolerance)
    assert (chain_of_two_estimates(steps=1)(W, lr=0.0) - cold).abs().max() > 1e6 * tolerance  # the control
    # the checkpoint format: the first block where a single regulator keeps its own, the next after it
    assert state["regulate_v"].shape == (16, 4) and state["regulate_v.1"].shape == (16, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chains_warm_starts_survive_a_resume_bit_for_bit(dtype):
    # the slots follow from the spec alone: a loaded optimizer finds each block where it left it,
    # and the resumed run is the uninterrupted one bit for bit (on the CPU); every slot's block
    # stays in the regulators' fp32 for bf16 weights (torch's load had cast the second to bf16)
    gen = torch.Generator().manual_seed(12)
    start = (torch.randn(32, 24, generator=gen) * 0.5).to(dtype)
    grads = [torch.randn(32, 24, generator=gen).to(dtype) for _ in range(4)]
    chain = [{"name": "spectral_hammer", "block": 4}, "spectral_normalize"]

    def run(W, optimizer, steps):
        for grad in steps:
            W.grad = grad.clone()
            optimizer.step()

    W = torch.nn.Parameter(start.clone())
    optimizer = Muon([W], lr=0.05, regulate=chain)
    run(W, optimizer, grads[:2])
    saved, halfway = copy.deepcopy(optimizer.state_dict()), W.detach().clone()
    run(W, optimizer, grads[2:])
    assert saved["state"][0]["regulate_v"].shape == (24, 4) and saved["state"][0]["regulate_v.1"].shape == (24, 8)
    resumed = torch.nn.Parameter(halfway.clone())
    optimizer_resumed = Muon([resumed], lr=0.05, regulate=chain)
    optimizer_resumed.load_state_dict(saved)
    run(resumed, optimizer_resumed, grads[2:])
    assert torch.equal(resumed.detach(), W.detach())
    for key in ("regulate_v", "regulate_v.1"):
        assert optimizer_resumed.state[resumed][key].dtype == torch.float32
        assert torch.equal(optimizer_resumed.state[resumed][key], optimizer.state[W][key])
    # negative control: a resume without the second regulator's block (it starts cold) is not
    # the uninterrupted run, so the equality above needs that block restored
    del saved["state"][0]["regulate_v.1"]
    cold = torch.nn.Parameter(halfway.clone())
    optimizer_cold = Muon([cold], lr=0.05, regulate=chain)
    optimizer_cold.load_state_dict(saved)
    run(cold, optimizer_cold, grads[2:])
    assert not torch.equal(cold.detach(), W.detach())


# ----------------------------------------------------------------------------- DGram column cap


@pytest.mark.parametrize("shape", [(24, 10), (10, 24)])
def test_column_cap_is_the_exact_cap_on_dgram_points(shape):
    gen = torch.Generator().manual_seed(12)
    m, n = shape
    k = min(m, n)
    Q = haar_orthogonal(max(m, n), gen)[:, :k]  # orthonormal columns
    norms = torch.logspace(-1, 1, k, dtype=torch.float64)  # [0.1, 10]
    point = Q * norms if m >= n else (Q * norms).T  # DGram: orthogonal columns (rows when wide)
    out = ColumnCap(w_max=2.0)(point, lr=0.0)
    expected = svd_apply(point, lambda s: s.clamp(max=2.0))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_column_cap_side_is_explicit():
    W = torch.ones(4, 8, dtype=torch.float64)
    rows = ColumnCap(w_max=1.0, side="rows")(W, lr=0.0) * rms_scale(W.shape)
    assert torch.allclose(rows.norm(dim=-1), torch.ones(4, dtype=torch.float64))
    columns = ColumnCap(w_max=1.0, side="columns")(W, lr=0.0) * rms_scale(W.shape)
    assert torch.allclose(columns.norm(dim=-2), torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="side"):
        ColumnCap(side="diagonal")


# ----------------------------------------------------------------------------- contract of every regulator


@pytest.mark.parametrize("name", sorted(REGULATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_regulator_is_functional_batched_and_keeps_dtype(name, dtype):
    gen = torch.Generator().manual_seed(13)
    regulator = make_regulator({"name": name, **({"eta": 0.1} if name == "soft_cap" else {})})
    W = (torch.randn(3, 12, 20, generator=gen) * 0.2).to(dtype)
    before = W.clone()
    out = regulator(W, lr=0.1)
    assert torch.equal(W, before), "regulators must not write into their input"
    assert out.shape == W.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    one_by_one = torch.stack([regulator(w, lr=0.1) for w in W])
    # batched and single calls run the same fp32/fp64 arithmetic; bf16 only rounds the result
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), one_by_one.double(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", sorted(REGULATORS))
def test_every_regulator_rejects_bad_weights(name):
    regulator = make_regulator(name)
    with pytest.raises(ValueError, match="1-D"):
        regulator(torch.ones(5), lr=0.1)
    with pytest.raises(TypeError, match="floating"):
        regulator(torch.ones(3, 3, dtype=torch.int64), lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        regulator(torch.ones(3, 3), lr=-1.0)
    with pytest.raises(ValueError, match="non-finite"):
        regulator(torch.tensor([[1.0, math.nan], [0.0, 1.0]]), lr=0.1)


@pytest.mark.parametrize("name", sorted(REGULATORS))
@pytest.mark.parametrize("lr, error", [(math.nan, ValueError), (math.inf, ValueError), (-1.0, ValueError),
                                       ("0.1", TypeError), (None, TypeError)])
def test_a_bad_learning_rate_is_refused_by_the_regulators_name(name, lr, error):
    # the rate is checked before the regulator's refusal computes with it: a NaN or infinite rate
    # had been refused as soft_cap_alpha's `wd` or muon_update_norm's `lr` (options the caller never
    # gave), a string or None by a bare TypeError of the decays' product lr * weight_decay
    for regulator in (make_regulator(name), make_regulator({"name": name, **({"eta": 0.1} if name == "soft_cap" else {})})):
        with pytest.raises(error, match=rf"^{type(regulator).__name__}: lr must be a (finite|real) number"):
            regulator(torch.ones(3, 3), lr=lr)


# ----------------------------------------------------------------------------- make_regulator


def test_make_regulator_specs():
    assert make_regulator(None) is None
    assert isinstance(make_regulator("hard_cap"), HardCap)
    soft = make_regulator({"kind": "soft_cap", "w_max": 2.0})
    assert isinstance(soft, SoftCap) and soft.w_max == 2.0
    existing = HardCap(w_max=3.0)
    assert make_regulator(existing) is existing
    assert isinstance(make_regulator(SpectralHammer), SpectralHammer)
    stateful = lambda W, *, lr, state=None: W * 2  # noqa: E731
    assert make_regulator(stateful) is stateful


def test_make_regulator_list_is_a_chain():
    gen = torch.Generator().manual_seed(14)
    W = torch.randn(16, 12, generator=gen, dtype=torch.float64)
    chain = make_regulator(["weight_decay", {"name": "hard_cap", "w_max": 0.5}, None])
    assert isinstance(chain, Chain) and len(chain.regulators) == 2
    by_hand = HardCap(w_max=0.5)(WeightDecay()(W, lr=0.1), lr=0.1)
    torch.testing.assert_close(chain(W, lr=0.1, state={}), by_hand, rtol=0, atol=0)


def test_make_regulator_adapts_callables_without_state():
    calls = []

    def halve(W, *, lr):
        calls.append(lr)
        return W / 2

    regulator = make_regulator(halve)
    out = regulator(torch.ones(2, 2), lr=0.3, state={})
    assert torch.equal(out, torch.full((2, 2), 0.5)) and calls == [0.3]


@pytest.mark.parametrize(
    "spec, error, match",
    [("spectral_magic", ValueError, "unknown regulator 'spectral_magic'.*hard_cap"),
     ({"w_max": 1.0}, ValueError, "'name' key"),
     ({"name": "hard_cap", "wmax": 1.0}, TypeError, "bad options for 'hard_cap'"),
     ({"name": "hard_cap", "w_max": -1.0}, ValueError, "w_max"),
     (3, TypeError, "regulate= must be")],
)
def test_make_regulator_rejects_bad_specs(spec, error, match):
    with pytest.raises(error, match=match):
        make_regulator(spec)


def test_regulator_base_class_is_the_extension_point():
    class Halve(Regulator):
        name = "halve"

        def regulate(self, M, *, lr, state):
            return M / 2

    W = torch.randn(4, 6, dtype=torch.bfloat16)
    out = make_regulator(Halve())(W, lr=0.1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, W / 2, rtol=0, atol=0)


# ----------------------------------------------------------------------------- 500 Muon steps


def muon_run(w_max, regulate, *, steps=500, lr=0.05, seed=0):
    """Muon (geomuon.optimizers.Muon, bf16 Newton–Schulz as torch.optim.Muon) on a random linear
    regression whose solution has RMS norm 2 w_max, so the cap binds for most of the run.
    Yields the optimizer after every step."""
    gen = torch.Generator().manual_seed(seed)
    params, targets = [], []
    for shape in [(16, 32), (32, 16), (24, 24)]:
        start = torch.randn(shape, generator=gen)
        params.append(torch.nn.Parameter(start * (0.5 * w_max / rms_spectral_norm(start).float())))
        truth = torch.randn(shape, generator=gen)
        targets.append(truth * (2 * w_max / rms_spectral_norm(truth).float()))
    inputs = [torch.randn(128, p.shape[1], generator=gen) for p in params]
    optimizer = Muon([{"params": params, "regulate": regulate}], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(((x @ (p - t).T) ** 2).mean() for p, x, t in zip(params, inputs, targets))
        loss.backward()
        optimizer.step()
        yield optimizer


def largest_norm(optimizer, w_max):
    """The largest RMS→RMS norm of the optimizer's weights over w_max (SVD, float64)."""
    return max(rms_spectral_norm(p.detach()).item() for group in optimizer.param_groups for p in group["params"]) / w_max


@pytest.mark.parametrize("w_max", [1.0, 2.0, 6.0])
def test_muon_with_soft_cap_stays_below_w_max_after_every_step(w_max):
    ratios = [largest_norm(optimizer, w_max) for optimizer in muon_run(w_max, {"name": "soft_cap", "w_max": w_max})]
    assert max(ratios) <= 1 + 1e-3
    assert ratios[-1] > 0.9  # the cap binds: the regression pulls towards 2 w_max


@pytest.mark.parametrize("w_max", [1.0, 2.0, 6.0])
def test_muon_with_hard_cap_stays_below_w_max_after_every_step(w_max, one_thread):
    # its float32 bound beta (hard_cap_beta) at the largest shape of the run
    ratios = [largest_norm(optimizer, w_max) for optimizer in muon_run(w_max, {"name": "hard_cap", "w_max": w_max})]
    assert max(ratios) <= 1 + hard_cap_beta((32, 16), torch.float32)
    assert ratios[-1] > 0.99  # the cap binds


def ritz_estimate(W, block):
    r"""The Rayleigh–Ritz estimate $\sqrt{\lambda_{\max}(V^\top G V)}$ of $W$'s RMS→RMS norm on the
    orthonormalized ``block`` $V$ ($G$ the short-side Gram matrix of the RMS-scaled $W$), float64:
    the estimate $\hat\sigma$ a spectral regulator took from the block it kept in its state (it
    keeps the block it read $\hat v$ from), up to its float32 round-off. A lower bound on the norm."""
    X = W.double() * rms_scale(W.shape)
    X = X.mT if X.size(-2) < X.size(-1) else X
    V = torch.linalg.qr(block.double()).Q
    return torch.linalg.eigvalsh(V.mT @ (X.mT @ X) @ V)[..., -1].sqrt().item()


# What spectral_normalize guarantees: W' = W / max(1, sigma-hat / w_max), so its own estimate of W'
# is at most w_max, and ||W'|| <= w_max * rho with rho = sigma_max / sigma-hat >= 1, the estimate's
# error (scale-free: the same for W and W'), which no bound in w_max alone limits (see
# test_spectral_normalize_is_off_by_its_estimates_error_which_a_warm_start_removes). The estimate of
# W' recomputed in float64 exceeds w_max by the regulator's float32 round-off only: sigma-hat =
# ||X v-hat|| (a matvec and a norm, gamma_n + gamma_m), v-hat's unit norm (V from a float32 QR,
# orthonormal to about n u), and 3 roundings of the scaling, n, m <= 64, u = eps32 / 2
# (measured: 2.7 eps32).
ESTIMATE_ROUNDING = (64 + 64 + 64 + 3) * F32_EPS / 2


def assert_normalized_by_its_estimate(optimizer, w_max):
    """Every weight W' of the optimizer after a spectral_normalize step: its estimate at most
    w_max (the guarantee above). Returns the largest ||W'|| / w_max."""
    worst = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            norm = rms_spectral_norm(p.detach()).item()
            estimate = ritz_estimate(p.detach(), optimizer.state[p]["regulate_v"])
            assert estimate <= w_max * (1 + ESTIMATE_ROUNDING)  # so ||W'|| <= w_max * norm / estimate
            worst = max(worst, norm / w_max)
    return worst


@pytest.mark.parametrize("w_max", [1.0, 2.0, 6.0])
def test_muon_with_spectral_normalize_stays_below_w_max_up_to_its_estimates_error(w_max, one_thread):
    ratios = [assert_normalized_by_its_estimate(optimizer, w_max)
              for optimizer in muon_run(w_max, {"name": "spectral_normalize", "w_max": w_max})]
    assert ratios[-1] > 0.99  # the cap binds


def test_spectral_normalize_under_muon_steps_on_random_gradients(one_thread):
    # random gradients, 11 times larger every 7th step: the momentum turns at once, and every
    # singular value moves by the learning rate (a flat top for the block to resolve). The norm
    # stays within the estimate's error of w_max at every step (measured here: 1 + 4e-7).
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(64, 32), (32, 64), (48, 48)]]
    optimizer = Muon(params, lr=0.05, regulate={"name": "spectral_normalize", "w_max": 1.0})
    ratios = []
    for step in range(150):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (11 if step % 7 == 0 else 1)
        optimizer.step()
        ratios.append(assert_normalized_by_its_estimate(optimizer, 1.0))
    assert min(ratios) > 0.99  # the cap binds at every step (the weights start at RMS norm ~10)


def test_spectral_normalize_is_off_by_its_estimates_error_which_a_warm_start_removes():
    # The block power iteration's estimate is a lower bound, off by up to sigma_1 - sigma_9 only
    # where its start block is not orthogonal to the top singular vectors. Here the 9 top right
    # singular vectors (sigma = 1.3) are orthogonal to the fixed start, whose span is an invariant
    # subspace of singular value 1: in exact arithmetic the iteration never leaves it, in float32
    # round-off (~1e-7) grows by (1.3 / 1)^2 per step, 16 steps: 4e-4 of the block, which moves the
    # estimate by its square, so sigma-hat = 1 and the weight stays at 1.3 w_max. The guarantee is its estimate's: 1.3 is the error ratio. Warm-started, the
    # leaked component keeps growing, and the next calls find the top.
    m, n = 64, 32
    start = torch.linalg.qr(fixed_start((n, 8), torch.float64, torch.device("cpu"))).Q
    gen = torch.Generator().manual_seed(13)
    basis = torch.linalg.qr(torch.cat([start, torch.randn(n, n - 8, generator=gen, dtype=torch.float64)], 1)).Q
    right = torch.cat([basis[:, 8:], basis[:, :8]], 1)  # the 24 orthogonal to the start first
    spectrum = torch.cat([torch.full((9,), 1.3), torch.linspace(0.5, 0.1, 15), torch.ones(8)])
    left = haar_orthogonal(m, gen)[:, :n]
    W = ((left * spectrum) @ right.T / rms_scale((m, n))).float()
    state = {}
    cold = SpectralNormalize(w_max=1.0)(W, lr=0.0, state=state)
    norm, estimate = rms_spectral_norm(cold).item(), ritz_estimate(cold, state["regulate_v"])
    assert estimate <= 1 + ESTIMATE_ROUNDING  # the guarantee: ||W'|| <= w_max * norm / estimate
    assert norm / estimate > 1.29  # and it is 1.3 w_max: the estimate missed the 9 top singular values
    for _ in range(3):
        warm = SpectralNormalize(w_max=1.0)(W, lr=0.0, state=state)
    # found: W / 1.3 up to the estimate's float32 round-off and the 2 roundings of the weight's scaling
    assert abs(rms_spectral_norm(warm).item() - 1) <= ESTIMATE_ROUNDING + F32_EPS


def test_unregulated_muon_exceeds_w_max():
    # negative control: without regulation the same runs leave the ball, so the checks
    # above measure the regulators, not the data.
    assert max(largest_norm(optimizer, 1.0) for optimizer in muon_run(1.0, None, steps=200)) > 1.5


def test_hard_cap_at_large_norms_and_on_an_empty_batch():
    # Its Schatten-8 bound squared the Gram: in fp32 (gram @ gram) overflowed once sigma_max
    # passed 6e4 and the level count raised OverflowError; an empty batch failed in amax.
    # Exact cap: the fp32 tolerance of the cap tests above (1e-3 of w_max).
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(64, 64, generator=gen) / 8
    for scale in (3e4, 1e8):
        assert rms_spectral_norm(HardCap()(W * scale, lr=0.1)).item() == pytest.approx(1.0, abs=1e-3)
    assert HardCap()(torch.randn(0, 8, 16), lr=0.1).shape == (0, 8, 16)


@pytest.mark.parametrize("method", MSIGN_METHODS)
def test_hard_cap_takes_exactly_the_msign_methods_that_converge(method):
    # The construction needs sign -> the exact sign as the steps grow. 40 steps in float64 on a
    # well-conditioned 6x4 matrix bring Polar Express to round-off (~1e-15) and leave the 5-step
    # tables at their repeated last step's fixed point (1.035) or cycle ([0.68, 1.13]): 1e-6
    # separates the two by orders of magnitude either way.
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    steps = None if method == "svd" else 40
    converges = (torch.linalg.svdvals(msign(X, method, steps=steps)) - 1).abs().max().item() < 1e-6
    assert converges == (method in HARD_CAP_METHODS)
    W = torch.randn(16, 8, generator=gen) * 3  # RMS->RMS norm ~13, w_max = 1
    if converges:
        assert rms_spectral_norm(HardCap(w_max=1.0, method=method)(W, lr=0.0)).item() <= 1 + hard_cap_beta(W.shape, torch.float32, method)
    else:
        # it had been accepted, and left the norm at 2.63 (newton_schulz) or 1.012 (polar_express_5)
        with pytest.raises(ValueError, match=r"HardCap: method must be one of \('polar_express', 'svd'\)"):
            HardCap(w_max=1.0, method=method)


# every finite scale that keeps a randn weight's entries normal in its dtype (|entry| >= 1e-5
# times 2^-100 is above float32's 1.2e-38); 2^66 ~ 7e19 and 2^100 ~ 1e30 are where the Gram
# matrix (fp32: 1e19) and msign's norm of gram - c^2 I (fp32: sigma ~ 3e12) had overflowed
POWER_OF_TWO_SCALES = [(torch.float32, k) for k in (-100, 40, 66, 100)] + [(torch.float64, k) for k in (-900, 500, 900)]


@pytest.mark.parametrize("dtype, k", POWER_OF_TWO_SCALES)
@pytest.mark.parametrize("shape", [(3, 12, 20), (3, 20, 12)])
def test_regulators_commute_with_power_of_two_scaling_bitwise(dtype, k, shape):
    # Every regulator is homogeneous: R_{t w}(t W) = t R_w(W). Each computes on W divided by a
    # power of two near its largest entry, and scaling by a power of two is exact, so the two
    # sides run the very same arithmetic: equal bit for bit, NaN, zeros and raw errors included
    # (they had come back at t ~ 1e20 in float32).
    t = 2.0**k
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(*shape, generator=gen, dtype=dtype)  # RMS->RMS norms ~3: every cap binds
    for make in (lambda w: SpectralNormalize(w_max=w), lambda w: SpectralHammer(w_max=w),
                 lambda w: SpectralWeightDecay(weight_decay=0.5), lambda w: ColumnCap(w_max=w),
                 lambda w: HardCap(w_max=w), lambda w: HardCap(w_max=w, levels=2)):
        reference = make(1.0)(W, lr=0.1)
        scaled = make(t)(W * t, lr=0.1)
        assert torch.isfinite(scaled).all() and torch.equal(scaled, reference * t), make(1.0)


def test_hard_cap_caps_weights_of_any_finite_scale():
    # the report's cases: fp32 norm 3e12 (capped at 2.2e9 before) and 1e20 (raw error), fp64 1e150
    # (8e112) and 1e160 (raw error): the descent from 1e160 to 1 shrinks the matrix by 1e160 and
    # each pass rescales it. Tolerance: the cap's stated bound beta above (hard_cap_beta), and
    # below the fp32 one for both (the capped values land on w_max from above)
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(8, 4, generator=gen)
    for weight in (W * 1e12, W * 1e20, W.double() * 1e150, W.double() * 1e160):
        beta = hard_cap_beta(W.shape, weight.dtype)
        assert 1 - hard_cap_beta(W.shape, torch.float32) <= rms_spectral_norm(HardCap(w_max=1.0)(weight, lr=0.0)).item() <= 1 + beta


def test_a_finite_weight_never_comes_back_non_finite():
    # the module's promise, for regulators beyond their range too: __call__ checks its result
    class Overflowing(Regulator, register=False):
        def regulate(self, M, *, lr, state):
            return M * 1e30 * 1e30  # inf in float32

    with pytest.raises(ValueError, match="Overflowing: a finite weight .* gave a non-finite result"):
        Overflowing()(torch.ones(2, 3), lr=0.0)


@pytest.mark.parametrize("name", sorted(REGULATORS))
def test_every_regulator_returns_an_empty_weight_as_it_is(name):
    # a 0 x n weight has no singular value, so every bound holds as it is (rms_scale had raised
    # ZeroDivisionError)
    regulator = make_regulator({"name": name, **({"eta": 0.1} if name == "soft_cap" else {})})
    for shape in [(0, 4), (4, 0), (2, 0, 3)]:
        assert regulator(torch.zeros(shape), lr=0.1).shape == shape
    assert torch.equal(rms_spectral_norm(torch.zeros(2, 0, 3)), torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("make, error, match", [
    (lambda: SpectralNormalize(w_max=True), TypeError, "SpectralNormalize: w_max must be a real number, got True"),
    (lambda: SpectralNormalize(w_max="2"), TypeError, "w_max must be a real number, got '2'"),
    (lambda: SpectralNormalize(w_max=None), TypeError, "w_max must be a real number, got None"),
    (lambda: WeightDecay(weight_decay=True), TypeError, "WeightDecay: weight_decay must be a real number"),
    (lambda: SoftCap(guard_steps=2.7), ValueError, "SoftCap: guard_steps must be a whole number >= 0"),
    (lambda: SoftCap(guard_steps=-3), ValueError, "SoftCap: guard_steps must be a whole number >= 0"),
    (lambda: SoftCap(eta=math.nan), ValueError, "SoftCap: eta must be a finite number >= 0"),
    (lambda: SoftCap(eta="0.1"), TypeError, "SoftCap: eta must be a real number"),
    (lambda: HardCap(levels=1.5), ValueError, "HardCap: levels .* must be a whole number >= 0"),
    (lambda: HardCap(levels=True), ValueError, "HardCap: levels .* must be a whole number >= 0"),
    (lambda: HardCap(levels=300), ValueError, r"top level w_max \* ratio\^\(levels - 1\)"),
    (lambda: HardCap(ratio=math.inf), ValueError, r"HardCap: ratio must be a finite number >= sqrt\(2\)"),
    # it had run ceil(log(16) / log(1.0001)) = 27,726 passes on a weight at 16 w_max
    (lambda: HardCap(ratio=1.0001), ValueError, r"HardCap: ratio must be .*>= sqrt\(2\), got 1.0001 .*choose one"),
    # 8 steps resolve float64 eigenvalues only down to 0.95 of the bound: the threshold's shift
    # would exceed the level (7 and fewer: the sign overshoots 1 or never reaches eps64)
    (lambda: HardCap(sign_steps=8), ValueError, "HardCap: sign_steps=8 resolves .* use more sign_steps"),
    (lambda: HardCap(ratio="16"), TypeError, "HardCap: ratio must be a real number"),
    (lambda: WeightDecay()(torch.ones(2, 2), lr=True), TypeError, "WeightDecay: lr must be a real number"),
    (lambda: make_regulator({"name": ["soft_cap"]}), TypeError, "a regulator name must be a string"),
    (lambda: make_regulator({"name": "hard_cap", "kind": "soft_cap"}), ValueError, "'name'.*or its alias 'kind'.*not both"),
])
def test_regulator_options_are_refused_by_name(make, error, match):
    # each had been taken as a number (True as 1, "2" as 2.0, 2.7 guard steps as 2, -3 as
    # "disabled", ratio inf as zero levels: no cap at all), failed only at the first call (eta
    # NaN), or raised an error that named no option (None, a list name, name and kind)
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("make, match", [(lambda: HardCap(sign_steps=0), "sign_steps must be a whole number >= 1"),
                                         (lambda: HardCap(method="foo"), "method must be one of"),
                                         (lambda: SpectralNormalize(block=0), "block must be a whole number >= 1"),
                                         (lambda: SpectralNormalize(steps=-1), "steps must be a whole number >= 1"),
                                         (lambda: SpectralHammer(steps=0), "SpectralHammer: steps must be"),
                                         (lambda: SpectralWeightDecay(block=0), "SpectralWeightDecay: block must be")])
def test_regulator_arguments_are_checked_at_construction(make, match):
    # each had been accepted: a silent no-op cap, or an error at the first call
    with pytest.raises(ValueError, match=match):
        make()


def test_a_flattened_kernel_is_regulated_as_the_matrix_it_is_stepped_as():
    # matrix_view="flatten" steps a conv kernel [8, 4, 3, 3] as its [8, 36] matrix; the
    # regulator must bound that matrix (it had capped the 32 [3, 3] slices instead, leaving
    # the stepped matrix at 6.7 with w_max = 1). spectral_normalize's guarantee is on that
    # matrix: its estimate from the block it kept at most w_max (ESTIMATE_ROUNDING), and the cap
    # binds (the kernel starts at 6.7).
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 4, 3, 3, generator=gen) * 3)
    opt = Muon([p], lr=0.02, matrix_view="flatten", regulate={"name": "spectral_normalize", "w_max": 1.0})
    for _ in range(3):
        p.grad = torch.randn(8, 4, 3, 3, generator=gen)
        opt.step()
    stepped = p.detach().reshape(8, -1)
    assert ritz_estimate(stepped, opt.state[p]["regulate_v"]) <= 1 + ESTIMATE_ROUNDING
    assert rms_spectral_norm(stepped).item() > 0.9


def test_a_regulator_on_a_group_of_vectors_is_refused_at_construction():
    # an optimizer-wide regulate= reaches an AdamW group of biases; it raised from the
    # regulator in the step, after the other groups had moved
    W, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match=r"parameter #0 of param group 1 has shape \(8,\).*set regulate=None"):
        Muon([{"params": [W]}, {"params": [b], "update": "adamw"}], regulate="spectral_normalize")
    Muon([{"params": [W]}, {"params": [b], "update": "adamw", "regulate": None}], regulate="spectral_normalize")


# ----------------------------------------------------------------------------- no host reads


@pytest.mark.parametrize("name", sorted(REGULATORS))
def test_regulation_at_a_device_learning_rate_reads_nothing_back(name, no_host_reads):
    # lr as a 0-dim tensor (a schedule on the device): Muon's step with every regulator
    # (hard_cap with fixed levels) reads nothing back, and lands where the float lr does.
    # They differ only where lr * wd and eta are rounded (float32 products of the tensor
    # instead of float64 ones): a few eps32 of the soft cap's k, which moves alpha by at
    # most ~20x as much (d ln alpha / d ln k = (w/k) / (2 (1 - w/k)) ~ 20 at k = 1.025 w)
    # and the weights by alpha sigma^3 <= 0.05 of that: 8 eps32 of the largest entry.
    spec = {"name": name, "levels": 2} if name == "hard_cap" else {"name": name}
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen) / 4 for s in [(32, 16), (16, 32), (24, 24)]]
    grads = [torch.randn(w.shape, generator=gen) for w in start]
    results = []
    for lr in (0.02, torch.tensor(0.02)):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = Muon([{"params": params, "regulate": spec}], lr=lr)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with no_host_reads():
            optimizer.step()
        results.append([p.detach() for p in params])
    for p, q, w in zip(*results, start):
        assert (p - q).abs().max() <= 8 * F32_EPS * p.abs().max()
        assert not torch.equal(p, w)


def test_the_adaptive_hard_cap_reads_its_bound_back(no_host_reads):
    # control for the test above: the default (adaptive levels) reads one bound per call
    W = torch.randn(24, 16, dtype=torch.float64)
    with no_host_reads(), pytest.raises(RuntimeError, match="host read"):
        HardCap(w_max=1.0)(W, lr=0.0)


def test_hard_cap_fixed_levels_are_the_adaptive_cap_within_their_range():
    # Schatten-8 bound ~1.3e4 (sigma_max 1e4): the adaptive cap descends 4 levels of 16, so
    # 4 or more fixed levels are the same computation (bitwise); one level cannot resolve
    # the sign around c next to 1e4 c, and leaves the weight above the cap (the documented
    # range matters).
    gen = torch.Generator().manual_seed(5)
    W = with_rms_spectrum((16, 10), [1e4, 50.0, 3.0, 1.01, 0.99, 0.5, 0, 0, 0, 0], gen)
    adaptive = HardCap(w_max=1.0)(W, lr=0.0)
    for levels in (4, 5):
        assert torch.equal(HardCap(w_max=1.0, levels=levels)(W, lr=0.0), adaptive)
    assert rms_spectral_norm(HardCap(w_max=1.0, levels=1)(W, lr=0.0)).item() > 1.1
    with pytest.raises(ValueError, match="levels"):
        HardCap(levels=-1)


@pytest.mark.parametrize("gap", [0.5, 1e-2, 1e-4])
def test_top_ritz_vector_is_the_top_eigenvector_without_an_eigensolver(gap, monkeypatch):
    # float64 Ritz matrices with eigenvalue ratio lambda_2 / lambda_1 = 1 - gap (8 x 8, batched):
    # the squarings raise it to the power 2^32 (e^(-4e5) at gap 1e-4), so the vector matches
    # eigh's to round-off, and T v = lambda_1 v
    gen = torch.Generator().manual_seed(3)
    Q = torch.linalg.qr(torch.randn(4, 8, 8, generator=gen, dtype=torch.float64)).Q
    lam = torch.tensor([1.0, 1 - gap, 0.7, 0.5, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)
    T = (Q * lam) @ Q.mT
    reference = Q[..., 0]  # eigh's top eigenvector, up to sign
    monkeypatch.setattr(torch.linalg, "eigh", None)  # products only: any eigensolver call fails
    v = _top_ritz_vector(T)
    assert torch.allclose((v * reference).sum(-1).abs(), torch.ones(4, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(T @ v.unsqueeze(-1), v.unsqueeze(-1), atol=1e-12)
    # a tie at the top (a capped weight's flat spectrum): a unit vector of the top eigenspace
    tied = (Q * torch.tensor([1.0, 1.0, 1.0, 0.5, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)) @ Q.mT
    w = _top_ritz_vector(tied)
    assert torch.allclose(w.norm(dim=-1), torch.ones(4, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(tied @ w.unsqueeze(-1), w.unsqueeze(-1), atol=1e-12)
    assert torch.equal(_top_ritz_vector(torch.zeros(2, 8, 8)), torch.zeros(2, 8))  # zero: zero, not NaN
    # float32 at any scale: the Ritz matrix of a weight of RMS norm 1e-13 or 1e10 has entries near
    # 1e-26 or 1e20, whose Frobenius norm under- or overflows unless T is scaled first
    for scale in (1e-26, 1.0, 1e20):
        single = _top_ritz_vector((scale * T).float())
        assert torch.allclose((single.double() * reference).sum(-1).abs(), torch.ones(4, dtype=torch.float64), atol=1e-5)
    # the spectral regulators run without an eigensolver too (on CUDA eigh reads back to the host),
    # and normalize a huge weight to w_max (a lost top vector would leave it as it is)
    W = torch.randn(3, 48, 32, generator=gen)
    for regulator in (SpectralNormalize(w_max=0.5), SpectralHammer(w_max=0.5), SpectralWeightDecay()):
        assert torch.isfinite(regulator(W, lr=0.1)).all()
    for scale in (1e-12, 1.0, 1e12):
        normalized = SpectralNormalize(w_max=0.5)(scale * W, lr=0.0)
        # min(sigma, w_max): the block iteration's sigma-hat is exact to float32 round-off on a
        # Gaussian matrix (its top singular values are apart)
        expected = rms_spectral_norm(scale * W).clamp_max(0.5)
        assert torch.allclose(rms_spectral_norm(normalized), expected, rtol=1e-4)
        assert scale < 1 or torch.allclose(expected, torch.full((3,), 0.5, dtype=torch.float64))


# ----------------------------------------------------------------------------- entries left as they are


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("make", [
    lambda: SoftCap(w_max=1.0, eta=0.0),  # k = w_max: alpha = 0
    lambda: HardCap(w_max=1.0), lambda: HardCap(w_max=1.0, levels=2), lambda: SpectralNormalize(w_max=1.0),
    lambda: SpectralHammer(w_max=1.0), lambda: ColumnCap(w_max=1.0),
    lambda: WeightDecay(weight_decay=0.0), lambda: SpectralWeightDecay(weight_decay=0.0),
], ids=["soft_cap", "hard_cap", "hard_cap_levels", "spectral_normalize", "spectral_hammer", "column_cap",
        "weight_decay", "spectral_weight_decay"])
def test_a_weight_the_regulator_leaves_alone_comes_back_bit_for_bit(make, dtype):
    # RMS->RMS norm about 0.45 < w_max (randn's sigma_max ~ sqrt(24) + sqrt(16), times
    # sqrt(16/24) / 16), and no decay: every regulator is the identity here, and the module promises
    # the weight back unchanged. It came back as (W * s) / s, s = sqrt(16/24) not a power of two:
    # about 1 in 9 entries one ulp off, at every step of a run. Exact comparison: the identity has
    # no rounding to allow for. (A weight built as X / s would hide it: (X / s) * s is often X.)
    gen = torch.Generator().manual_seed(21)
    W = torch.randn(24, 16, generator=gen, dtype=dtype) / 16
    assert rms_spectral_norm(W).item() < 0.6
    torch.testing.assert_close(make()(W, lr=0.1), W, rtol=0, atol=0)


def test_a_column_cap_returns_the_columns_it_keeps_bit_for_bit():
    # a partial cap: the columns below w_max are the weight's own, the capped ones have RMS norm
    # w_max up to the three roundings of (M / s) (w / ||M / s||) / scale (3 eps32 relative) and the
    # two fp32 column norms compared (a sum of 24 squares, at most 23 eps, halved by the square
    # root: 12 eps each) with their rms_scale products (1 eps each): 3 + 2 (12 + 1) < 32 eps32
    gen = torch.Generator().manual_seed(22)
    W = torch.randn(24, 16, generator=gen)
    column_norms = W.norm(dim=0) * rms_scale(W.shape)
    kept = column_norms <= column_norms.median()
    out = ColumnCap(w_max=column_norms.median().item())(W, lr=0.0)
    assert torch.equal(out[:, kept], W[:, kept]) and kept.any() and not kept.all()
    capped = out[:, ~kept].norm(dim=0) * rms_scale(W.shape)
    torch.testing.assert_close(capped, torch.full_like(capped, column_norms.median().item()), rtol=32 * F32_EPS, atol=0)


# ----------------------------------------------------------------------------- soft cap options refused up front


def test_soft_cap_refuses_a_fixed_eta_that_no_learning_rate_makes_feasible():
    # Without weight decay every step has k = w_max + eta, so eta > (81/62 - 1) w_max fails at every
    # lr: it had been accepted and raised in the first step, after the update had moved the weights.
    limit = 81 / 62 - 1  # for w_max = 1
    with pytest.raises(ValueError, match=r"SoftCap: eta=0\.31 is too large for w_max=1 at every learning rate"):
        SoftCap(w_max=1.0, eta=0.31)
    p = torch.nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="SoftCap: eta=5 is too large"):
        Muon([p], lr=0.02, regulate={"name": "soft_cap", "eta": 5.0})
    # the construction test is the step's: just inside the limit both accept (and cap to w_max)
    inside = SoftCap(w_max=1.0, eta=limit * (1 - 1e-9))
    W = with_rms_spectrum((12, 8), torch.linspace(1 + limit * (1 - 1e-9), 0.1, 8), torch.Generator().manual_seed(23))
    # f(k) = w_max to the float64 round-off of 4 matmuls of O(1) entries (100 eps64, as above)
    assert rms_spectral_norm(inside(W, lr=0.1)).item() <= 1 + 100 * F64_EPS
    # with weight decay, k = w_max (1 - lr wd) + eta > eta: feasible for a large enough lr as long
    # as eta < (81/62) w_max, and never at or beyond it
    SoftCap(w_max=1.0, eta=0.31, weight_decay=0.1)
    SoftCap(w_max=1.0, eta=1.3, weight_decay=0.1)  # feasible from lr * weight_decay = 0.9935
    with pytest.raises(ValueError, match=r"SoftCap: eta=1\.31 is too large .* at every learning rate"):
        SoftCap(w_max=1.0, eta=1.31, weight_decay=0.1)


def test_soft_cap_names_its_weight_decay_when_lr_times_it_reaches_one():
    # it had raised "soft_cap_alpha: wd must lie in [0, 1)", naming an argument SoftCap does not have
    with pytest.raises(ValueError, match=r"SoftCap: lr \* weight_decay = 2 must be below 1.*lower lr or weight_decay"):
        SoftCap(w_max=1.0, eta=0.1, weight_decay=20.0)(torch.eye(4), lr=0.1)
    # and so does an optimizer's step, which asks the regulator's refusal before any group moves
    W = torch.nn.Parameter(torch.eye(4))
    W.grad = torch.ones(4, 4)
    # (the group applies the decay the cap assumes: one that applies less is refused at construction)
    opt = Muon([W], lr=0.1, weight_decay=20.0, regulate=SoftCap(w_max=1.0, eta=0.1, weight_decay=20.0))
    with pytest.raises(ValueError, match=r"SoftCap: lr \* weight_decay = 2 must be below 1"):
        opt.step()
    assert torch.equal(W.detach(), torch.eye(4))  # nothing moved


@pytest.mark.parametrize("lr, margin, error, match", [
    (-0.1, 1.05, ValueError, "muon_update_norm: lr must be a finite number >= 0"),
    (math.nan, 1.05, ValueError, "muon_update_norm: lr must be a finite number >= 0"),
    (0.1, 0.5, ValueError, "muon_update_norm: margin must be a finite number >= 1"),
    (0.1, math.inf, ValueError, "muon_update_norm: margin must be a finite number >= 1"),
    (0.1, "1.05", TypeError, "muon_update_norm: margin must be a real number"),
])
def test_muon_update_norm_refuses_what_would_not_bound_the_update(lr, margin, error, match):
    # each had returned a number: a negative or NaN eta, or one below the iteration's own maximum
    with pytest.raises(error, match=match):
        muon_update_norm(lr, (16, 16), margin=margin)


def test_a_bf16_weight_carries_the_cap_up_to_its_rounding():
    # The documented rule: the cap holds for the float32 result W'; rounding it to bf16 moves each
    # entry by at most u = 2^-8 of itself, so sigma_max by at most u ||W'||_F (RMS units here, as
    # the cap). The float32 cap itself is within beta (hard_cap_beta).
    gen = torch.Generator().manual_seed(24)
    W = torch.randn(32, 48, generator=gen).to(torch.bfloat16)  # RMS->RMS norm ~10: the cap binds
    out = HardCap(w_max=1.0)(W, lr=0.0)
    frobenius = out.double().norm().item() * rms_scale(W.shape)
    assert out.dtype == torch.bfloat16
    beta = hard_cap_beta(W.shape, torch.float32)
    assert rms_spectral_norm(out).item() <= 1 + beta + 2.0**-8 * frobenius
    # and the caveat is real: the bf16 weight is above w_max by more than the float32 error
    assert rms_spectral_norm(out).item() > 1 + beta


@pytest.mark.parametrize("cap, lr", [
    (SoftCap(w_max=1.0), 0.0),  # warm-up from lr = 0: eta = 0, k = w_max
    (SoftCap(w_max=1.0, eta=0.1, weight_decay=0.5), 0.5),  # k = 0.75 + 0.1 <= w_max
    (SoftCap(w_max=1.0), torch.tensor(0.0, dtype=torch.float64)),  # the same on the device path
], ids=["lr_zero", "decay_dominates", "device_lr_zero"])
def test_soft_cap_guard_brings_back_a_weight_outside_the_ball_where_alpha_is_zero(cap, lr):
    # k <= w_max gives alpha = 0, and the guard had been skipped there: a weight of RMS norm 30 came
    # back at 30 with w_max = 1. Now the guard scales it to its estimate sigma-hat = w_max. With
    # sigma_2 / sigma_1 = 0.1 the 4-step power estimate has relative error at most
    # (sigma_2 / sigma_1)^(4 * 4) tan^2(theta_0) = 1e-16 tan^2(theta_0), below 1e-9 unless the fixed
    # start is within 1e-3.5 of orthogonal to the top vector; the rest is float64 round-off.
    gen = torch.Generator().manual_seed(25)
    W = with_rms_spectrum((24, 16), torch.cat([torch.tensor([30.0]), torch.linspace(3.0, 0.1, 15)]), gen)
    out = cap.unchecked(W, lr=lr) if isinstance(lr, torch.Tensor) else cap(W, lr=lr)
    assert rms_spectral_norm(out).item() == pytest.approx(1.0, rel=1e-9)
    torch.testing.assert_close(out, W / 30.0, rtol=1e-9, atol=0)  # only scaled: the cap's map is the identity


# ----------------------------------------------------------------------------- the optimizer's update bound


def test_the_soft_cap_takes_its_eta_from_the_optimizers_own_update():
    # The default eta bounds Keller's Muon with adjust_lr_fn="original"; Muon with
    # "match_rms_adamw" (a larger update for a 64 x 256 weight) had pushed the RMS->RMS norm to
    # 1.04 at w_max = 1 in 30 steps. Tolerance: the cap holds in exact arithmetic; its fp32
    # polynomial (four products over an inner dimension of 64) rounds sigma by about
    # 4 * 64 * 2^-24 = 1.5e-5 relative, so 1e-4 is five times that and far below the 0.04 excess.
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(64, 256))
    opt = Muon([p], lr=0.02, weight_decay=0, adjust_lr_fn="match_rms_adamw", regulate={"name": "soft_cap", "w_max": 1})
    largest = 0.0
    for _ in range(30):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        largest = max(largest, float(rms_spectral_norm(p.detach())))
    assert largest <= 1 + 1e-4
    # Muon's own bound is the default's for Keller's quintic and "original", bitwise, and larger
    # for "match_rms_adamw" at this shape
    group = Muon([torch.nn.Parameter(torch.zeros(64, 256))], lr=0.02).param_groups[0]
    assert opt.update_bound(group)(0.02, (64, 256)) == muon_update_norm(0.02, (64, 256))
    assert opt.update_bound(opt.param_groups[0])(0.02, (64, 256)) > muon_update_norm(0.02, (64, 256))


def test_an_optimizer_that_states_no_update_bound_needs_the_soft_caps_eta():
    from geomuon.optimizers import HybridPolarGradM, ManifoldMuon

    W = torch.nn.Parameter(torch.randn(8, 4))
    for make in (lambda regulate: HybridPolarGradM([W], lr=0.02, regulate=regulate),
                 lambda regulate: ManifoldMuon([W], manifold="dgram", lr=0.02, regulate=regulate),
                 lambda regulate: Muon([{"params": [W], "update": "adamw", "regulate": regulate}], lr=0.02)):
        with pytest.raises(ValueError, match="group 0, regulate='soft_cap': soft_cap: its default eta .* give eta"):
            make("soft_cap")
        make({"name": "soft_cap", "eta": 0.05})  # control: the same regulator with its eta is accepted
    with pytest.raises(ValueError, match="give eta"):  # inside a chain too
        HybridPolarGradM([W], lr=0.02, regulate=["hard_cap", "soft_cap"])


@pytest.mark.parametrize("spec, shape, lr, why, lr_it_follows", [
    # the soft cap's infeasible eta had raised inside the step (nothing had been regulated)
    ("soft_cap", (32, 32), 0.5, r"eta=.* too large", 0.05),
    # lr * weight_decay = 1.25: a retried step had counted the gradient twice
    ({"name": "weight_decay", "weight_decay": 25.0}, (8, 4), 0.05,
     "weight_decay = 1.25 > 1 would flip the weights' sign", 0.02),
    ({"name": "spectral_weight_decay", "weight_decay": 25.0}, (8, 4), 0.05,
     "weight_decay = 1.25 > 1 would flip the top singular", 0.02),
], ids=["soft_cap", "weight_decay", "spectral_weight_decay"])
def test_a_rate_the_regulator_cannot_follow_is_refused_before_any_group_steps(spec, shape, lr, why, lr_it_follows):
    # it had raised inside the step, after the unregulated group and the regulated one had moved
    # (momentum and weights)
    gen = torch.Generator().manual_seed(1)
    free, regulated = (torch.nn.Parameter(torch.randn(shape, generator=gen)) for _ in range(2))
    opt = Muon([{"params": [free]}, {"params": [regulated], "regulate": spec}], lr=lr)
    before = [free.detach().clone(), regulated.detach().clone()]
    for p in (free, regulated):
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match=rf"group 1, regulate=.* at lr={lr} and shape \({shape[0]}, {shape[1]}\): "
                                         rf".*{why}.*nothing was stepped"):
        opt.step()
    assert torch.equal(free.detach(), before[0]) and torch.equal(regulated.detach(), before[1]) and not opt.state
    opt.param_groups[1]["lr"] = lr_it_follows  # control: a rate it can follow steps both groups
    opt.step()
    assert not torch.equal(free.detach(), before[0]) and not torch.equal(regulated.detach(), before[1])


def test_the_update_bound_follows_the_groups_options():
    # Muon's bound had been taken from the group's options when its regulator was built: a group
    # switched to adjust_lr_fn="match_rms_adamw" (a 3.9x larger update at 384 x 384) kept the old
    # eta, while a deepcopy or a reload of the same optimizer took the new one. At lr = 0.1 the
    # soft cap at w_max = 1 holds the original update (eta = 0.126 <= 0.306) but not the new (0.50).
    import copy

    opt = Muon([torch.nn.Parameter(torch.zeros(384, 384))], lr=0.1, regulate={"name": "soft_cap", "w_max": 1})
    assert opt.regulation_refusal(0, 0.1) is None
    opt.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"
    assert "too large" in opt.regulation_refusal(0, 0.1)
    assert copy.deepcopy(opt).regulation_refusal(0, 0.1) == opt.regulation_refusal(0, 0.1)


def test_a_soft_cap_subclass_that_computes_its_eta_needs_no_update_bound():
    # SoftCap.eta documents overriding eta_for for an eta an optimizer cannot store; such a
    # subclass had been refused wherever the optimizer states no bound (an AdamW group here)
    @dataclasses.dataclass(repr=False)
    class ScaledCap(SoftCap):
        name = "scaled_cap_of_the_eta_for_test"  # (an optimizer stores its regulator by registered name)

        def eta_for(self, lr, shape):
            return 0.1 * lr

    W = torch.nn.Parameter(torch.randn(8, 4))
    Muon([{"params": [W], "update": "adamw", "regulate": ScaledCap(w_max=1.0)}], lr=0.02)
    with pytest.raises(ValueError, match="give eta"):  # control: the plain cap needs its eta there
        Muon([{"params": [W], "update": "adamw", "regulate": SoftCap(w_max=1.0)}], lr=0.02)


def test_a_state_missing_a_group_key_loads_with_a_regulator():
    # torch's load ends in __setstate__, which rebuilt the regulators before the missing keys were
    # filled: Muon's bound read the absent adjust_lr_fn, KeyError half-way through the load
    W = torch.nn.Parameter(torch.randn(16, 8))
    opt = Muon([W], lr=0.02, regulate={"name": "soft_cap", "w_max": 1})
    W.grad = torch.randn_like(W)
    opt.step()
    saved = opt.state_dict()
    del saved["param_groups"][0]["adjust_lr_fn"]
    fresh = Muon([W], lr=0.02, regulate={"name": "soft_cap", "w_max": 1})
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["adjust_lr_fn"] is None and torch.equal(
        fresh.state[W]["momentum_buffer"], opt.state[W]["momentum_buffer"])


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw", None])
@pytest.mark.parametrize("shape", [(4, 0), (0, 4), (3, 0, 5)])
def test_muon_update_norm_of_an_empty_weight_is_zero(shape, adjust_lr):
    # an empty weight has no singular value, so its update is the zero map: eta = 0, as a float
    # or on the device (its fan ratio had raised ZeroDivisionError, in a soft-capped optimizer's
    # pre-step check of an empty layer). Control: a non-empty weight's eta is positive.
    assert muon_update_norm(0.1, shape, adjust_lr=adjust_lr) == 0.0
    on_device = muon_update_norm(torch.tensor(0.1), shape, adjust_lr=adjust_lr)
    assert isinstance(on_device, torch.Tensor) and on_device.item() == 0.0
    assert muon_update_norm(0.1, (4, 5), adjust_lr=adjust_lr) > 0
    cap = SoftCap(w_max=1.0)
    assert cap.refusal(0.1, shape) is None and cap(torch.zeros(shape), lr=0.1).shape == shape


@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
@pytest.mark.parametrize("eta", [0.13, 0.151, 0.2013])
def test_the_soft_cap_at_a_device_rate_is_the_float64_cap_of_the_host_rate(eta, weight_decay):
    # At a tensor lr the coupling was formed in float32 (torch.as_tensor of the float eta, and k in
    # the rate's dtype before the float64 bisection): a float64 weight with every RMS singular value
    # at k came out 3.5e-9 past w_max at a float64 rate. Now wd, eta and k are float64 as on the host.
    lr = 0.1
    k = 1.0 * (1 - lr * weight_decay) + eta
    W = with_rms_spectrum((12, 8), torch.full((8,), k, dtype=torch.float64), torch.Generator().manual_seed(9))
    cap = SoftCap(w_max=1.0, eta=eta, weight_decay=weight_decay)
    on_host, on_device = cap(W, lr=lr), cap(W, lr=torch.tensor(lr, dtype=torch.float64))
    # float64, four products of O(1) entries summed over 8-12 terms: round-off within 100 eps
    # (as test_soft_cap_applies_the_polynomial_to_singular_values); the two alphas agree to the
    # bisection's 2^-64 / 3 in beta, below float64's resolution
    assert rms_spectral_norm(on_device).item() <= 1.0 + 100 * F64_EPS
    torch.testing.assert_close(on_device, on_host, rtol=0, atol=100 * F64_EPS)
    # the device bisection of float32 inputs solves the coupling of the values they hold (k had
    # been rounded to float32 first: 1e-7 off), to the 1e-12 the certificates check it to
    wd32, eta32 = torch.tensor(lr * weight_decay), torch.tensor(eta)
    exact = soft_cap_alpha(1.0, wd32.item(), eta32.item())
    assert soft_cap_alpha_tensor(1.0, wd32, eta32).item() == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("regulate", [{"name": "soft_cap", "w_max": 2.0, "weight_decay": 0.5},
                                      [{"name": "spectral_normalize", "w_max": 4.0},
                                       {"name": "soft_cap", "w_max": 2.0, "weight_decay": 0.5}]],
                         ids=["soft_cap", "chain"])
def test_a_soft_cap_that_assumes_more_weight_decay_than_its_group_applies_is_refused(regulate):
    # The soft cap's k = w_max (1 - lr wd) + eta takes its weight_decay as applied before the update:
    # with none applied, a weight at the cap plus an update of norm eta came back 1.9 % above w_max
    # (lr 0.1, eta 0.2), accepted without a word. Controls: the group applying that decay, or more.
    W = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64) * 0.1)
    with pytest.raises(ValueError, match=r"assumes weight_decay=0.5 applied before each update, but the group "
                                         r"applies weight_decay=0\b"):
        Muon([W], weight_decay=0.0, regulate=regulate)
    for applied in (0.5, 0.7):
        Muon([W], lr=0.02, weight_decay=applied, regulate=regulate)


def test_a_group_edited_or_loaded_below_its_soft_caps_weight_decay_is_refused_before_it_steps():
    # the check had run only when the regulator was built: a group whose weight_decay was set to 0
    # afterwards stepped unrefused, and a state dict with such a group was refused halfway through
    # its load, leaving the optimizer unable to step. Control: the group as built steps.
    regulate = {"name": "soft_cap", "w_max": 2.0, "weight_decay": 0.5}
    W = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64) * 0.1)
    W.grad = torch.randn(8, 8, dtype=torch.float64)
    opt = Muon([W], lr=0.02, weight_decay=0.5, regulate=regulate)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["weight_decay"] = 0.0
    before = W.detach().clone()
    with pytest.raises(ValueError, match="assumes weight_decay=0.5 applied before each update"):
        opt.step()
    assert torch.equal(W.detach(), before)
    opt.param_groups[0]["weight_decay"] = 0.5
    edited = copy.deepcopy(saved)
    edited["param_groups"][0]["weight_decay"] = 0.0
    with pytest.raises(ValueError, match="assumes weight_decay=0.5 applied before each update"):
        opt.load_state_dict(edited)
    opt.step()  # the refused load changed nothing
    assert not torch.equal(W.detach(), before)
