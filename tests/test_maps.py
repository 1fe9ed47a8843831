"""Update maps: formulas, zero handling, dtypes and each docstring's equivariance claim.

Equivariance is checked in float64 on random full-rank matrices, where every map is
smooth, so a residual of ~1e-12 means "holds" and O(1) means "fails"; each claimed group
is paired with a negative control the docstring says fails.
"""

import math

import pytest
import torch

from geomuon.optimizers import maps
from geomuon.optimizers.maps import centered, col_norm, hybrid, left_polar, right_polar, row_norm, sign, spectral
from geomuon.theory.groups import haar_orthogonal

M, N = 12, 7
# float64 maps are accurate to ~1e-13 relative (Polar Express reaches the fp64 fixed point);
# 1e-8 leaves room for the
# conditioning of a random 12x7 matrix (condition number < 1e2) without hiding an O(1) miss.
HOLDS = 1e-8
# A map that is not equivariant under a group moves by O(1) relative; 1e-2 is far above
# round-off and far below what a violation gives.
FAILS = 1e-2


def _signed_permutation(k, gen):
    perm = torch.eye(k, dtype=torch.float64)[torch.randperm(k, generator=gen)]
    signs = torch.where(torch.rand(k, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    return perm * signs


def _permutation(k, gen):
    return torch.eye(k, dtype=torch.float64)[torch.randperm(k, generator=gen)]


GROUPS = {"O": haar_orthogonal, "S+-": _signed_permutation, "S": _permutation}


def _residual(update, left, right, seed=0):
    gen = torch.Generator().manual_seed(seed)
    D = torch.randn(M, N, generator=gen, dtype=torch.float64)
    P, Q = GROUPS[left](M, gen), GROUPS[right](N, gen)
    out = update(P @ D @ Q.T)
    expected = P @ update(D) @ Q.T
    return ((out - expected).norm() / expected.norm()).item()


svd_spectral = lambda D: spectral(D, method="svd")  # noqa: E731
# (map, left group, right group, holds?) — the docstring claims and their negative controls.
CLAIMS = [
    (svd_spectral, "O", "O", True),
    (spectral, "O", "O", True),
    (row_norm, "S+-", "O", True),
    (row_norm, "O", "O", False),
    (col_norm, "O", "S+-", True),
    (col_norm, "O", "O", False),
    (right_polar, "O", "O", True),
    (left_polar, "O", "O", True),
    (hybrid, "S+-", "O", True),
    (hybrid, "O", "O", False),
    (centered(spectral), "S", "O", True),
    (centered(spectral), "S+-", "O", False),
    (centered(row_norm), "S", "O", True),
    (centered(row_norm), "O", "O", False),
    (centered(hybrid), "S", "O", True),
    (centered(left_polar), "S", "O", True),
    (sign, "S+-", "S+-", True),
    (sign, "O", "S+-", False),
    (sign, "S+-", "O", False),
]


@pytest.mark.parametrize("update,left,right,holds", CLAIMS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_equivariance_claims(update, left, right, holds):
    residual = max(_residual(update, left, right, seed) for seed in range(3))
    if holds:
        assert residual < HOLDS
    else:
        assert residual > FAILS


@pytest.mark.parametrize("update", [centered(spectral), centered(row_norm), centered(hybrid), centered(left_polar)])
def test_centered_maps_ignore_shifts_and_return_centered(update):
    gen = torch.Generator().manual_seed(1)
    D = torch.randn(M, N, generator=gen, dtype=torch.float64)
    shift = torch.ones(M, 1, dtype=torch.float64) @ torch.randn(1, N, generator=gen, dtype=torch.float64)
    out = update(D)
    assert ((update(D + shift) - out).norm() / out.norm()).item() < HOLDS
    assert out.sum(dim=0).abs().max().item() < HOLDS
    # negative control: the uncentered map does see the shift
    plain = getattr(maps, update.__name__.removeprefix("centered_"))
    assert ((plain(D + shift) - plain(D)).norm() / plain(D).norm()).item() > FAILS


def test_formulas_against_svd():
    gen = torch.Generator().manual_seed(2)
    D = torch.randn(M, N, generator=gen, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(D, full_matrices=False)
    polar = U @ Vh
    assert torch.allclose(spectral(D), polar, atol=1e-10)
    assert torch.allclose(right_polar(D, alpha=0.0), polar, atol=1e-10)
    assert torch.allclose(right_polar(D), S.sum() * polar, atol=1e-9)
    assert torch.allclose(left_polar(D), right_polar(D), atol=1e-9)
    R = D / D.norm(dim=1, keepdim=True)
    Ur, Sr, Vhr = torch.linalg.svd(R, full_matrices=False)
    assert torch.allclose(hybrid(D), Sr.sum() * Ur @ Vhr, atol=1e-9)
    assert torch.allclose(row_norm(D).norm(dim=1), torch.ones(M, dtype=torch.float64))
    assert torch.allclose(col_norm(D).norm(dim=0), torch.ones(N, dtype=torch.float64))


ALL_MAPS = [spectral, row_norm, col_norm, right_polar, left_polar, hybrid, sign,
            centered(spectral), centered(row_norm), centered(hybrid), centered(left_polar)]


@pytest.mark.parametrize("update", ALL_MAPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_zero_matrix_gives_zero_and_dtype_is_kept(update, dtype):
    D = torch.zeros(3, M, N, dtype=dtype)
    out = update(D)
    assert out.dtype == dtype and out.shape == D.shape
    assert torch.equal(out, torch.zeros_like(out))


def _row_normalized(D):
    return D / (D.norm(dim=-1, keepdim=True) + maps.ROW_EPS)  # a zero row: 0 / eps = 0


def _centered_rows(D):
    return D - D.mean(dim=-2, keepdim=True)


def _svd_hybrid(D):
    U, S, Vh = torch.linalg.svd(_row_normalized(D), full_matrices=False)
    return S.sum() * U @ Vh


# float64 references of the maps with a row-normalization, written out from their docstrings
_ZERO_ROW_REFERENCES = {
    "row_norm": _row_normalized,
    "hybrid": _svd_hybrid,
    "centered_row_norm": lambda D: _centered_rows(_row_normalized(_centered_rows(D))),
}


@pytest.mark.parametrize("update", [row_norm, hybrid, centered(row_norm)], ids=lambda f: f.__name__)
def test_zero_row_stays_finite(update):
    # finite in float32, and the documented formula in float64 (it had only been checked finite):
    # with one zero row of 12 the row-normalized 12 x 7 matrix keeps full rank 7, so the float64
    # maps are within HOLDS of their SVD references, as in test_formulas_against_svd
    gen = torch.Generator().manual_seed(5)
    D = torch.randn(M, N, generator=gen)
    D[3] = 0
    out = update(D)
    assert torch.isfinite(out).all()
    if update is row_norm:
        assert torch.equal(out[3], torch.zeros(N))
    reference = _ZERO_ROW_REFERENCES[update.__name__](D.double())
    assert ((update(D.double()) - reference).norm() / reference.norm()).item() < HOLDS


def test_zero_column_col_norm():
    D = torch.randn(M, N)
    D[:, 2] = 0
    out = col_norm(D)
    assert torch.isfinite(out).all() and torch.equal(out[:, 2], torch.zeros(M))


@pytest.mark.parametrize("update", [right_polar, left_polar])
def test_rank_deficient_polar_is_finite(update):
    D = torch.randn(M, 2) @ torch.randn(2, N)
    out = update(D)
    assert torch.isfinite(out).all()


def test_batched_equals_per_matrix():
    D = torch.randn(4, M, N, dtype=torch.float64)
    for update in ALL_MAPS:
        batched = update(D)
        single = torch.stack([update(d) for d in D])
        assert torch.allclose(batched, single, atol=1e-12), update.__name__


def test_bf16_compute_dtype_spectral_is_close_to_fp32():
    D = torch.randn(32, 16)
    exact = spectral(D, method="svd")
    # bf16 has an 8-bit mantissa (unit round-off 2^-8 ~ 4e-3); 12 Polar Express steps in
    # bf16 accumulate a few ulps per entry, so 5e-2 relative bounds it without admitting
    # a wrong answer (a different polar factor differs by O(1)).
    out = spectral(D, compute_dtype=torch.bfloat16)
    assert out.dtype == torch.float32
    assert ((out - exact).norm() / exact.norm()).item() < 5e-2


def test_bad_input():
    with pytest.raises(ValueError, match="AdamW"):
        row_norm(torch.randn(5))
    with pytest.raises(TypeError, match="floating"):
        spectral(torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(TypeError):
        hybrid([[1.0]])


def test_registry_names():
    assert set(maps.MAPS) >= {"spectral", "row_norm", "col_norm", "right_polar", "left_polar", "hybrid",
                              "sign", "centered_hybrid", "centered_left_polar"}


@pytest.mark.parametrize("scale", [1e-19, 1e-13, 1.0, 5e8, 1e10])
def test_polar_maps_in_fp32_at_any_scale(scale):
    # Their Gram D^T D underflowed (D of order 1e-13) or overflowed (5e8) in fp32 and the maps
    # returned NaN; D is scaled by its largest entry first. The polar factor is scale-free:
    # fp32 against float64 within 1e-4 (12 Polar Express steps on D, condition ~ 10:
    # measured 7e-7 at every scale; the entries are O(1/sqrt(48)), so 1e-4 is ~1e3 eps).
    gen = torch.Generator().manual_seed(0)
    D = torch.randn(32, 48, generator=gen)
    for polar in (right_polar, left_polar):
        reference = polar(D.double(), alpha=0.0)
        assert (polar(D * scale, alpha=0.0).double() - reference).abs().max() <= 1e-4, polar.__name__


@pytest.mark.parametrize("shape", [(384, 384), (384, 96), (96, 384)], ids=["square", "tall", "wide"])
def test_polar_maps_in_fp32_are_the_polar_factor_of_an_ill_conditioned_matrix(shape):
    # Through the Gram matrix the condition number squares: an fp32 inverse square root of
    # D^T D was 13 % off msign(D) at cond(D) = 100 (0.5 % at 10, 44 % at 1000). On D itself,
    # 12 Polar Express steps take every normalized singular value in [1e-3, 1] to 1 within
    # fp32's round-off (the spectrum below spans [1e-3, 1] times 1/sqrt(sum sigma^2) >= 1e-3
    # after msign's normalization); products of 384-long sums round at ~sqrt(384) eps = 2e-6:
    # 1e-4 relative (Frobenius) against the exact factor (measured 2e-6 to 1e-5).
    gen = torch.Generator().manual_seed(0)
    m, n = shape
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    for condition in (10.0, 100.0, 1000.0):
        sigma = torch.logspace(0, -math.log10(condition), k, dtype=torch.float64)
        D, exact = (U * sigma) @ V.mT, U @ V.mT
        for polar in (right_polar, left_polar):
            out = polar(D.float(), alpha=0.0).double()
            assert (out - exact).norm() <= 1e-4 * exact.norm(), (polar.__name__, condition)
            nuclear = (polar(D.float(), alpha=1.0).double() * exact).sum() / exact.square().sum()
            assert abs(nuclear - sigma.sum()) <= 1e-4 * sigma.sum()  # ||D||_* scales the factor


def test_fp16_row_and_column_norms_do_not_overflow():
    # a row of fp16 norm above 65504 had been divided by inf: the whole map was zero
    gen = torch.Generator().manual_seed(0)
    R = (torch.randn(4, 1024, generator=gen) * 3000).half()
    for out, dim in ((row_norm(R), -1), (col_norm(R.mT), -2)):
        assert out.dtype == torch.float16
        assert torch.allclose(out.float().norm(dim=dim), torch.ones(4), rtol=1e-3)  # fp16 (u = 4.9e-4)


@pytest.mark.parametrize("shape", [(64, 8), (256, 32), (32, 256)])
def test_polar_maps_match_the_svd_on_a_dominant_singular_value(shape):
    # D = randn + 1 has one singular value far above the rest (the all-ones direction), so
    # its Gram's top eigenvalue is many times its largest entry: the iteration must start from
    # the Frobenius norm (singular values <= 1), where an inverse square root started from the
    # largest entry diverged (error 2.0 at 64 x 8, NaN at 256 x 32) and every small-size test
    # still passed. float64, condition ~ 1e2, 12 Polar Express steps: 1e-10 (measured 2e-15).
    gen = torch.Generator().manual_seed(0)
    D = torch.randn(shape, generator=gen, dtype=torch.float64) + 1
    U, _, Vh = torch.linalg.svd(D, full_matrices=False)
    for polar in (right_polar, left_polar):
        assert (polar(D, alpha=0.0) - U @ Vh).abs().max() <= 1e-10, polar.__name__


@pytest.mark.parametrize("update", list(maps.MAPS.values()), ids=list(maps.MAPS))
def test_maps_of_an_empty_matrix_are_empty(update):
    # the polar maps had raised IndexError (amax over an empty dimension), as would the row and
    # column maps' largest entries
    for shape in ((0, 5), (3, 0), (2, 0, 4)):
        assert update(torch.zeros(shape)).shape == shape


# Scales at which a plain norm of the row leaves the dtype's range: its squares underflow
# (fp32/bf16 entries below 1e-19 give a norm of 0) or overflow (above 1e19 an infinite norm).
_ROW_SCALES = {
    torch.float64: (1e-200, 1.0, 1e200),
    torch.float32: (1e-30, 1e-20, 1.0, 1e20, 1e30),
    torch.bfloat16: (1e-30, 1.0, 1e30),
    torch.float16: (1e-3, 1.0, 2e4),
}


@pytest.mark.parametrize("dtype", list(_ROW_SCALES), ids=str)
@pytest.mark.parametrize("floor", ["zero", "tiny", "default"])
@pytest.mark.parametrize("update,dim", [(row_norm, -1), (col_norm, -2)], ids=["row_norm", "col_norm"])
def test_row_and_column_maps_are_the_dualizers_at_any_scale(update, dim, floor, dtype):
    # A plain d_i / (||d_i|| + eps) had given rows of NaN (a zero row at eps = 0) or of inf (a
    # row of fp32 entries 1e-30 at eps = 0: a norm of 0), and of 1e15 at eps = tiny (the floor
    # of steepest_direction's exact row and column dualizers).
    # Reference: the same (rounded) input in float64, d_i / (||d_i|| + eps), each row divided by
    # its largest entry c_i first (float64 squares leave their range too, at 1e+-200):
    # (d_i / c_i) / (||d_i / c_i|| + eps / c_i).
    eps = {"zero": 0.0, "tiny": torch.finfo(dtype).tiny, "default": maps.ROW_EPS}[floor]
    gen = torch.Generator().manual_seed(3)
    n = 24
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    # the documented limit of a floor so large that lost squares are below the rounding: rows
    # of norm above sqrt(max) of the accumulating dtype come out as 0 (as msign's matrices)
    plain = (n * torch.finfo(accumulate).tiny) ** 0.5 <= torch.finfo(dtype).eps / 2 * eps
    for scale in _ROW_SCALES[dtype]:
        # (entries within 3 scale: fp16's 2e4 stay below 65504, their row norms do not)
        D = (torch.randn(6, n, generator=gen, dtype=torch.float64).clamp(-3, 3) * scale).to(dtype)
        D = D if dim == -1 else D.mT.contiguous()
        D.select(dim - 1 if dim == -1 else -1, 2).zero_()  # row (column) 2 is zero
        exact = D.double()
        largest = exact.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        unit_scale = exact / largest
        norms = unit_scale.norm(dim=dim, keepdim=True) * largest
        reference = unit_scale / (unit_scale.norm(dim=dim, keepdim=True) + eps / largest)
        reference = torch.where(norms > 0, reference, 0.0)  # a zero row maps to zero (not 0/0)
        if plain:
            reference = torch.where(norms > torch.finfo(accumulate).max ** 0.5, 0.0, reference)
        out = update(D, eps=eps)
        assert out.dtype == dtype and torch.isfinite(out).all(), scale
        # Per entry: the power-of-two scaling is exact, the sum of n squares is accumulated in
        # fp32 for half types (relative error <= n u_acc, halved by the square root), then the
        # norm, the eps addition and the quotient each round once in the dtype (u each):
        # |out - ref| <= (3 u + n u_acc) |ref|, with a factor 2 for the first-order bound; the
        # float64 reference rounds the same way with u = u_acc = u_64.
        u = torch.finfo(dtype).eps / 2
        u_acc = torch.finfo(accumulate).eps / 2
        u_64 = torch.finfo(torch.float64).eps / 2
        bound = 2 * (3 * u + n * u_acc) + 2 * (3 + n) * u_64
        assert ((out.double() - reference).abs() <= bound * reference.abs()).all(), scale
        # the dual pairing without a floor: <d_i, u_i> = ||d_i|| (summed: the dual norm) and
        # ||u_i|| = 1 for every nonzero row (a zero row: 0)
        if floor == "zero":
            pairing = (unit_scale * out.double()).sum(dim=dim, keepdim=True) * largest  # per row, in range
            assert ((pairing - norms).abs() <= bound * norms).all(), scale
            unit = out.double().norm(dim=dim)
            assert ((unit - 1).abs() <= bound).sum() == unit.numel() - 1 and unit.min() == 0, scale


@pytest.mark.parametrize("update", [right_polar, left_polar, hybrid], ids=lambda f: f.__name__)
def test_negative_alpha_keeps_zero_at_zero_and_is_the_formula(update):
    # hybrid had returned NaN for the zero matrix at alpha < 0 (0 * 0^alpha = 0 * inf); a
    # skipped optimizer step arrives as exactly that zero
    assert torch.equal(update(torch.zeros(2, M, N), alpha=-0.5), torch.zeros(2, M, N))
    gen = torch.Generator().manual_seed(4)
    D = torch.randn(M, N, generator=gen, dtype=torch.float64)
    R = D / D.norm(dim=-1, keepdim=True) if update is hybrid else D
    U, S, Vh = torch.linalg.svd(R, full_matrices=False)
    expected = S.sum() ** -0.5 * (U @ Vh)
    # float64, condition of a random 12 x 7 below 10: 12 Polar Express steps reach the polar
    # factor to ~1e-15 (test_formulas_against_svd); hybrid's eps = 1e-8 moves each row of R by a
    # relative 1e-8 / ||d_i|| <= 1e-8 (rows of norm >= 1 here): 1e-7 covers both
    assert D.norm(dim=-1).min() >= 1
    assert ((update(D, alpha=-0.5) - expected).norm() / expected.norm()).item() <= 1e-7


@pytest.mark.parametrize("scale", [1.0, 1e-12, 1e-30, 1e30])
def test_spectral_is_scale_free(scale):
    # An absolute floor of 1e-7 on ||D||_F had made spectral(D * 1e-12) 20 % off msign(D) (the
    # iteration started from singular values far below its range): the map is the polar factor
    # at every scale, as msign is.
    gen = torch.Generator().manual_seed(5)
    D = torch.randn(M, N, generator=gen, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(D, full_matrices=False)
    polar = U @ Vh
    # float64: 12 Polar Express steps on normalized singular values in [1/(sqrt(7) kappa), 1]
    # (kappa < 10 here) converge to round-off; the fixed point attracts, so the error stays at
    # a few N u per step: 100 N u kappa bounds it (measured ~1e-15)
    kappa = (S[0] / S[-1]).item()
    assert kappa < 10
    bound = 100 * N * torch.finfo(torch.float64).eps * kappa
    assert ((spectral(D * scale) - polar).norm() / polar.norm()).item() <= bound


@pytest.mark.parametrize("update", [right_polar, left_polar, hybrid, centered(right_polar)], ids=lambda f: f.__name__)
def test_a_scale_beyond_the_range_gives_zero_and_the_rest_of_the_batch_its_update(update):
    # ||D||_*^alpha beyond float32's range had written inf (and NaN, 0 * inf) into the update: a
    # float32 D of entries 1e-43 has ||D||_* ~ 1e-42 (subnormal), whose inverse is 1e42; hybrid's
    # rows of entries 1e-30 normalize to about 1e-22 (the floor 1e-8), whose nuclear norm squared
    # inverts to about 1e42. The map gives 0 for that matrix, as msign beyond its range, on the device.
    gen = torch.Generator().manual_seed(6)
    D = torch.randn(2, 16, 8, generator=gen)
    D[0] *= 1e-30 if update is hybrid else 1e-43
    alpha = -2.0 if update is hybrid else -1.0
    out = update(D, alpha=alpha)
    assert torch.equal(out[0], torch.zeros(16, 8))
    # the other matrix of the batch keeps its update: the float64 map within 1e-4 relative, the
    # tolerance of test_polar_maps_in_fp32_at_any_scale (12 Polar Express steps in float32, ~1e3 eps)
    reference = update(D[1].double(), alpha=alpha)
    assert ((out[1].double() - reference).norm() / reference.norm()).item() <= 1e-4


def test_a_huge_polar_update_gives_zero_and_one_in_range_its_value():
    # float32 D of entries 1e36: ||D||_* ~ 5e38 leaves float32 (the update was inf and NaN); its
    # square root does not, and had been inf too (the product s nu overflowed before the power)
    gen = torch.Generator().manual_seed(7)
    D = torch.randn(64, 64, generator=gen) * 1e36
    assert torch.equal(right_polar(D), torch.zeros(64, 64))
    reference = right_polar(D.double(), alpha=0.5)
    # as above: the float64 map within 1e-4 relative
    assert ((right_polar(D, alpha=0.5).double() - reference).norm() / reference.norm()).item() <= 1e-4
