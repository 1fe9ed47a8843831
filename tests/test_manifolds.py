"""Every built-in manifold against the manifold contract, hypothesis properties, the DGram
facts of DESIGN §2 (with negative controls), dtype handling and bad input.

Math runs in float64 (tolerance 1e-10), the real retraction dtype in float32 (1e-5); both
come from geomuon.theory.contracts.default_tolerance, whose docstring says why.
"""

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from geomuon.manifolds import (
    LPRO,
    CenteredRouterSpace,
    DGram,
    Euclidean,
    MatrixManifold,
    Oblique,
    Stiefel,
    msign,
)
from geomuon.manifolds.capabilities import OrthonormalGram, UnitColumnsGram
from geomuon.theory.contracts import (
    check_manifold_contract,
    default_tolerance,
    manifold_residual,
    normal_component,
)
from geomuon.theory.strategies import matrix_shapes, points_and_tangents

@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    # Tests that draw without an explicit generator stay reproducible.
    torch.manual_seed(0)


# Every built-in manifold, from the registry (a new one is tested without editing a
# table), plus LPRO with a radius (a constructor argument that changes the geometry).
MANIFOLDS = {
    **{cls.name.lower(): cls for cls in MatrixManifold.registered().values()
       if cls.__module__.startswith("geomuon.manifolds.")},
    "lpro_radius": lambda: LPRO(radius=2.0),
}
SHAPES = {
    "tall": (9, 4),
    "square": (5, 5),
    "wide": (4, 9),
    "batched_tall": (2, 7, 3),
    "batched_wide": (3, 2, 6),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("name", MANIFOLDS)
def test_contract(name, shape, dtype):
    report = check_manifold_contract(MANIFOLDS[name](), shape, dtype=dtype, seed=7)
    assert report.passed
    assert len(report.checks) >= 14  # the adjoint/gram checks only exist with multipliers


# --------------------------------------------------------------------------- negative controls
class _ScaledAdjointOblique(Oblique):
    """The adjoint off by a factor 2: the adjoint and Gram-diagonal checks must fail (the
    derived projection itself is invariant under rescaling the adjoint)."""

    def constraint_adjoint(self, x, lam):
        return 2 * super().constraint_adjoint(x, lam)


class _FirstOrderWrongStiefel(Stiefel):
    """msign(x + 2u) is not a retraction (its derivative at 0 is 2u): the slope check fails."""

    def retr(self, x, u):
        return super().retr(x, 2 * u)


class _NonOrthogonalProjectionStiefel(Stiefel):
    """Idempotent and onto T_x but not orthogonal, P'u = Pu + <u - Pu, x> P(1): the
    self-adjointness check must fail."""

    def proju(self, x, u):
        tangent = super().proju(x, u)
        normal_weight = ((u - tangent) * x).sum(dim=(-2, -1), keepdim=True)
        return tangent + normal_weight * super().proju(x, torch.ones_like(x))


class _ZeroFarProjxOblique(Oblique):
    """projx returns the zero matrix far from the origin (as a sphere's did when its squared
    norm overflowed): the Gauss-Newton residual is 0 there, where the normal space vanishes."""

    def projx(self, x):
        return torch.where(x.norm(dim=(-2, -1), keepdim=True) > 5 * x.size(-1) ** 0.5, 0 * x, super().projx(x))


class _LaxChecksOblique(Oblique):
    """Point and tangent checks that accept everything (ManifoldMuon then steps weights off M)."""

    def points_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        return torch.ones(x.shape[:-2], dtype=torch.bool)

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        return True, None

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        return True, None


class _BatchCoupledRetractionOblique(Oblique):
    """Normalizes columns by their mean norm over the batch: right for one matrix, and for a
    batch whose steps all have the same length."""

    def retr(self, x, u):
        y = x + u
        return y / y.norm(dim=-2, keepdim=True).mean(dim=tuple(range(y.dim() - 2)) or None, keepdim=True)


class _WrongDiagonalForm(UnitColumnsGram):
    def gram_diag(self, D):
        return 1e-3 * super().gram_diag(D)


class _WrongGramDiagonalOblique(Oblique):
    """The form's Jacobi diagonal off by 1e3 while the manifold declares none: the engine's
    Jacobi step divides by the form's (the dual diverged)."""

    gram_form = _WrongDiagonalForm()

    def constraint_gram_diag(self, x):
        return None


class _WrongNewtonForm(OrthonormalGram):
    def newton_operator(self, D, lam, P):
        return -super().newton_operator(D, lam, P)


class _WrongNewtonStiefel(Stiefel):
    """A sign-flipped Newton operator (conjugate gradients on it crashed the first step)."""

    gram_form = _WrongNewtonForm()


class _WrongNewtonDiagonalForm(OrthonormalGram):
    def newton_diagonal(self, D, P):
        # one entry below the diagonal off by half: the basis element C(E_0,n-1) = E_0,n-1 + E_n-1,0
        # is the only one whose support holds it (the check runs on the upper half of a symmetric basis)
        diagonal = super().newton_diagonal(D, P).clone()
        diagonal[..., -1, 0] *= 1.5
        return diagonal


class _WrongNewtonDiagonalStiefel(Stiefel):
    """A Newton preconditioner wrong at one multiplier entry (conjugate gradients would lose symmetry)."""

    gram_form = _WrongNewtonDiagonalForm()


class _OverconfidentForm(OrthonormalGram):
    def series_covers(self, step, normal, shrink, terms, dtype):
        return True


class _OverconfidentSeriesStiefel(Stiefel):
    """series_covers vouches for every step (fp32 weights ended 1.6e-4 off Stiefel at lr 0.6)."""

    gram_form = _OverconfidentForm()


class _MismatchedFormOblique(Oblique):
    """Stiefel's Gram form on Oblique: [n, n] multipliers against the manifold's [n]."""

    gram_form = OrthonormalGram()


@pytest.mark.parametrize(
    "broken,failing,shape",
    [
        (_ScaledAdjointOblique(), {"constraint_adjoint", "constraint_gram_diag"}, (8, 5)),
        (_FirstOrderWrongStiefel(), {"retr_slope"}, (8, 5)),
        (_NonOrthogonalProjectionStiefel(), {"proju_self_adjoint"}, (8, 5)),
        (_ZeroFarProjxOblique(), {"points_pass_own_check"}, (8, 5)),
        (_LaxChecksOblique(), {"own_checks_refuse_normal_offsets"}, (8, 5)),
        (_BatchCoupledRetractionOblique(), {"retr_on_manifold"}, (3, 8, 5)),
        (_WrongGramDiagonalOblique(), {"gram_form_matches"}, (8, 5)),
        (_WrongNewtonStiefel(), {"gram_newton_matches"}, (8, 5)),
        (_WrongNewtonDiagonalStiefel(), {"gram_newton_matches"}, (2, 8, 5)),
        (_OverconfidentSeriesStiefel(), {"gram_series_covers"}, (8, 5)),
        (_MismatchedFormOblique(), {"gram_form_matches"}, (8, 5)),
    ],
    ids=["wrong_adjoint", "not_a_retraction", "non_orthogonal_projection", "zero_projx_far_out", "lax_checks",
         "batch_coupled_retraction", "wrong_form_gram_diag", "wrong_newton_operator", "wrong_newton_diagonal_entry",
         "overconfident_series",
         "form_of_another_multiplier_shape"],
)
def test_contract_detects_broken_manifolds(broken, failing, shape):
    report = check_manifold_contract(broken, shape, raise_on_failure=False)
    assert failing <= {check.name for check in report.failures}, str(report)
    with pytest.raises(AssertionError, match="manifold contract failed"):
        check_manifold_contract(broken, shape)


class _CountingNewtonForm(OrthonormalGram):
    operator_calls = 0

    def newton_operator(self, D, lam, P):
        self.operator_calls += 1
        return super().newton_operator(D, lam, P)


class _CountingNewtonStiefel(Stiefel):
    """Stiefel whose form counts the applications of its Newton operator."""

    gram_form = _CountingNewtonForm()


def test_the_newton_diagonal_check_probes_instead_of_applying_the_operator_per_basis_element():
    # one call per basis element C(E_ij), n^2 of them, had cost 97% of the contract at 256 x 128;
    # now one call checks the definition and one stack of round-robin probes the diagonal
    manifold = _CountingNewtonStiefel()
    manifold.gram_form.operator_calls = 0
    check_manifold_contract(manifold, (8, 5))
    assert manifold.gram_form.operator_calls == 2


class _FullGramNewtonForm(OrthonormalGram):
    r"""The Newton operator by its definition $\mathcal C(DS(\Lambda)P)$ with the whole $D$, and its
    exact diagonal: Stiefel's $2(D_{ii}P_{jj} + P_{ii}D_{jj})$ plus $4D_{ij}P_{ij}$ off the diagonal. At
    a point off Stiefel ($D$ not diagonal) it couples basis elements of disjoint index pairs."""

    def newton_operator(self, D, lam, P):
        return self.constraint(D @ self.adjoint(lam) @ P)

    def newton_diagonal(self, D, P):
        coupling = D * P
        return super().newton_diagonal(D, P) + 4 * (coupling - torch.diag_embed(torch.diagonal(coupling, dim1=-2,
                                                                                                  dim2=-1)))


class _DiagonalDNewtonForm(_FullGramNewtonForm):
    """The diagonal of the diagonal-D operator declared for the full one (the coupling term left out)."""

    def newton_diagonal(self, D, P):
        return OrthonormalGram.newton_diagonal(self, D, P)


def test_the_newton_diagonal_check_takes_every_basis_element_where_probes_interact():
    from geomuon.theory.contracts import _newton_mismatch, _probed_diagonal_mismatch

    generator = torch.Generator().manual_seed(0)
    W, X = (torch.randn(8, 5, dtype=torch.float64, generator=generator) for _ in range(2))
    D, P = W.mT @ W, torch.eye(5, dtype=torch.float64) + 0.1
    form = _FullGramNewtonForm()
    # the probes see the coupling and step aside (their quotients would be O(1) off)
    assert _probed_diagonal_mismatch(form, D, P, form.newton_diagonal(D, P), True, generator) is None
    tol = default_tolerance(torch.float64)  # exact formulas: the mismatch is round-off, ~1e-16
    assert _newton_mismatch(form, W, X, torch.Generator().manual_seed(1)) <= tol
    # the coupling term 4 D_ij P_ij is of the size of the diagonal: an O(1) error, caught
    assert _newton_mismatch(_DiagonalDNewtonForm(), W, X, torch.Generator().manual_seed(1)) > 0.1


# --------------------------------------------------------------------------- hypothesis
HYPOTHESIS_SHAPES = matrix_shapes(min_side=2, max_side=8)


@pytest.mark.parametrize("name", MANIFOLDS)
@given(data=st.data())
def test_properties_on_drawn_points(name, data):
    """projx/proju/retr on points of scale 1e-3..1e3, condition up to 1e3, rank-deficient inputs."""
    manifold = MANIFOLDS[name]()
    x, v = data.draw(points_and_tangents(manifold, HYPOTHESIS_SHAPES, max_relative_norm=0.5))
    tol = default_tolerance(torch.float64)
    # Relative residuals are scale-free; the constraint Gram of DGram has condition
    # (d_max/d_min)^2 <= 1e6 here, which multiplies round-off (1e-16) to at most 1e-10.
    assert manifold_residual(manifold, x) <= tol
    # The drawn v itself is tangent, relative to its own norm (re-projecting it first, as
    # below, had hidden that half the drawn "tangent vectors" were normal).
    v_norm = v.norm(dim=(-2, -1))
    assert (normal_component(manifold, x, v).norm(dim=(-2, -1)) <= tol * v_norm).all()
    assert ((manifold.proju(x, v) - v).norm(dim=(-2, -1)) <= tol * v_norm).all()
    u = data.draw(st.sampled_from([v, torch.randn_like(v)]))
    pu = manifold.proju(x, u)
    u_norm = u.norm(dim=(-2, -1)).max()
    assert normal_component(manifold, x, pu).norm(dim=(-2, -1)).max() <= tol * u_norm
    assert (manifold.proju(x, pu) - pu).norm(dim=(-2, -1)).max() <= tol * u_norm
    assert manifold_residual(manifold, manifold.retr(x, v)) <= tol


# --------------------------------------------------------------------------- DGram facts
def dgram_point(shape=(10, 6), norms=(3.0, 0.2, 7.0, 1.0, 0.05, 2.0), seed=0):
    """Q diag(d) with deliberately unsorted column norms d."""
    gen = torch.Generator().manual_seed(seed)
    Q = Stiefel().random(*shape, dtype=torch.float64, generator=gen)
    return Q * torch.tensor(norms, dtype=torch.float64)


def sorted_sigma_map(X):
    """The seed paper's map polar(X) diag(sorted sigma(X)): the negative control."""
    return msign(X, method="svd") * torch.linalg.svdvals(X).unsqueeze(-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_dgram_retraction_fixes_points_with_unsorted_norms(dtype):
    W = dgram_point().to(dtype)
    R = DGram().retr(W, torch.zeros_like(W))
    # Relative error: round-off of the fp32/fp64 Polar Express at condition 7/0.05 = 140.
    tol = default_tolerance(dtype)
    assert ((R.double() - W.double()).norm() / W.double().norm()).item() <= tol
    # The sorted-sigma map moves the same point by O(1): the fact the retraction respects.
    moved = sorted_sigma_map(W.double())
    assert ((moved - W.double()).norm() / W.double().norm()).item() > 0.1


def signed_permutation(n, gen):
    perm = torch.randperm(n, generator=gen)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return torch.eye(n, dtype=torch.float64)[:, perm] * signs


def haar(n, gen):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def dgram_maps(W, U, V):
    manifold = DGram()
    return {
        "projx": manifold.projx(W + 0.1 * U),
        "proju": manifold.proju(W, U),
        "retr": manifold.retr(W, manifold.proju(W, V)),
    }


def transform(maps_or_tensor, left, right):
    return left @ maps_or_tensor @ right


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("right, symmetric", [(signed_permutation, True), (haar, False)],
                         ids=["signed_column_permutation", "generic_right_rotation"])
def test_dgram_maps_commute_with_left_rotations_and_signed_column_permutations_only(seed, right, symmetric):
    gen = torch.Generator().manual_seed(100 + seed)
    W = dgram_point()
    U, V = (torch.randn(W.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    O, R = haar(W.size(-2), gen), right(W.size(-1), gen)
    base = dgram_maps(W, U, V)
    moved = dgram_maps(O @ W @ R, O @ U @ R, O @ V @ R)
    for name in base:
        residual = (moved[name] - O @ base[name] @ R).norm() / base[name].norm()
        if symmetric:
            # Exact symmetry: only round-off (fp64, condition 140) separates the two sides.
            assert residual.item() <= 1e-10, name
        else:
            # Negative control: O_m x O_n is NOT DGram's symmetry group; the residual is O(1).
            assert residual.item() > 1e-2, name


def test_wide_dgram_uses_orthogonal_rows():
    W = dgram_point().mT  # 6 x 10: rows orthogonal with unsorted norms
    manifold = DGram()
    assert manifold.check_point_on_manifold(W)
    gram = W @ W.mT
    assert torch.allclose(gram, torch.diag_embed(torch.diagonal(gram)), atol=1e-12)
    V = manifold.proju(W, torch.randn_like(W))
    R = manifold.retr(W, 0.1 * V)
    row_gram = R @ R.mT
    assert torch.allclose(row_gram, torch.diag_embed(torch.diagonal(row_gram)), atol=1e-12)


# --------------------------------------------------------------------------- orientation
def test_orientation_of_each_manifold():
    # Round-off bounds (float64): a sum or dot product of k terms of unit-size entries carries up
    # to k eps, and the factors are orthonormal (LAPACK's SVD, backward stable with a constant
    # of order k) or normalized (one division, one norm of k terms) to k eps: 8 k eps, k the
    # length of the sums, times the scale of the entries.
    eps = torch.finfo(torch.float64).eps
    gen = torch.Generator().manual_seed(3)
    wide = Stiefel().random(3, 7, dtype=torch.float64, generator=gen)
    assert (wide @ wide.mT - torch.eye(3, dtype=torch.float64)).abs().max() <= 8 * 7 * eps
    tall = Stiefel().random(7, 3, dtype=torch.float64, generator=gen)
    assert (tall.mT @ tall - torch.eye(3, dtype=torch.float64)).abs().max() <= 8 * 7 * eps
    oblique = Oblique().random(3, 7, dtype=torch.float64, generator=gen)  # columns, any shape
    assert (oblique.norm(dim=-2) - 1).abs().max() <= 8 * 3 * eps
    # Experts are rows: each column sums to zero relative to its absolute sum.
    router = CenteredRouterSpace().random(4, 9, dtype=torch.float64, generator=gen)
    assert (router.sum(-2).abs() <= 8 * 4 * eps * router.abs().sum(-2)).all()
    rows = LPRO(radius=0.5).random(3, 7, dtype=torch.float64, generator=gen)  # vocabulary = rows
    assert (rows.norm(dim=-1) - 0.5).abs().max() <= 8 * 7 * eps * 0.5
    # A wrong orientation misses by O(1): wide Oblique's rows, LPRO's columns are not normalized.
    assert (oblique.norm(dim=-1) - 1).abs().max() > 0.1 and (rows.norm(dim=-2) - 0.5).abs().max() > 0.1


# --------------------------------------------------------------------------- dtypes and API
@pytest.mark.parametrize("name", ["stiefel", "dgram", "oblique", "centeredrouterspace", "lpro_radius"])
def test_retraction_computes_in_fp32_for_bf16_points(name):
    manifold = MANIFOLDS[name]()
    x = manifold.random(16, 8, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    v = 0.05 * manifold.proju(x, torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
    xb, vb = x.bfloat16(), v.bfloat16()
    out = manifold.retr(xb, vb)
    assert out.dtype == torch.bfloat16
    # Bitwise equal to the fp32 computation rounded once: no bf16 arithmetic inside.
    assert torch.equal(out, manifold.retr(xb.float(), vb.float()).bfloat16())


def test_generic_surface_is_consistent():
    manifold = DGram()
    gen = torch.Generator().manual_seed(4)
    x = manifold.random(2, 6, 4, dtype=torch.float64, generator=gen)
    u, v = (torch.randn(2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    assert torch.equal(manifold.egrad2rgrad(x, u), manifold.proju(x, u))
    assert torch.equal(manifold.expmap(x, u), manifold.retr(x, u))
    assert manifold.inner(x, u, v).shape == (2,)
    assert manifold.inner(x, u, v, keepdim=True).shape == (2, 1, 1)
    assert torch.allclose(manifold.inner(x, u), (u * u).sum(dim=(-2, -1)))
    assert torch.equal(manifold.component_inner(x, u, v), manifold.inner(x, u, v, keepdim=True))
    y = manifold.retr(x, 0.1 * manifold.proju(x, u))
    assert torch.equal(manifold.transp(x, y, v), manifold.proju(y, v))
    # Batched x with one shared tangent direction broadcasts.
    assert manifold.proju(x, u[0]).shape == (2, 6, 4)


def test_origin_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = Stiefel().origin(5, 3, dtype=torch.float64), Stiefel().origin(5, 3, dtype=torch.float64)
    assert torch.equal(a, b)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert Stiefel().check_point_on_manifold(a)


def test_point_checks_report_reasons():
    manifold = Stiefel()
    x = manifold.random(6, 3, dtype=torch.float64)
    assert manifold.check_point_on_manifold(x)
    ok, reason = manifold.check_point_on_manifold(2 * x, explain=True)
    assert not ok and "F(x)" in reason
    u = manifold.proju(x, torch.randn_like(x))
    assert manifold.check_vector_on_tangent(x, u)
    assert not manifold.check_vector_on_tangent(x, u + x)
    zero = torch.zeros(6, 3, dtype=torch.float64)
    ok, reason = DGram().check_point_on_manifold(zero, explain=True)
    assert not ok and "zero column" in reason


def test_dgram_names_its_constraint_for_a_wide_point_in_the_transposed_geometry():
    # The base check asks _off_manifold_reason for a finite point that points_on_manifold
    # refuses, with a wide point transposed first: its zero row is the zero column seen there.
    manifold = DGram()
    wide = manifold.random(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert manifold.check_point_on_manifold(wide)  # control
    zero_row = wide.clone()
    zero_row[2] = 0
    assert manifold.check_point_on_manifold(zero_row, explain=True) == (
        False, "x has a zero column (row for wide matrices)")
    skewed = wide.clone()
    skewed[0] += wide[1]  # rows 0 and 1 at cosine 1/sqrt(2) or so, far past atol
    assert manifold.check_point_on_manifold(skewed, explain=True) == (
        False, "columns are not orthogonal (cosines) with atol=1e-05")


def test_generic_projection_solves_a_non_diagonal_gram():
    # A Stiefel point far from the manifold makes L L* non-diagonal: the Jacobi guess is
    # wrong and CG must iterate. The generic projection must still be exactly orthogonal.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    u = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    manifold = Stiefel()
    pu = MatrixManifold.proju(manifold, x, u)
    # Tolerances from CG's stopping rule and x's condition kappa (about 2.2 here): it stops at
    # |r| <= 16 eps (|b| + |G||lambda|) with b = L_x u, |b| <= 2|x|_2|u|, |G||lambda| <= kappa^2 |b|;
    # forming u - L^* lambda and L_x of it add a few eps |x|_2 |u| kappa^2 more: 64 eps (1 + kappa^2)
    # |x|_2 |u|. The normal part is x (2 Lambda), Lambda symmetric up to round-off; a least-squares
    # fit of it recovers S with backward error eps and forward error kappa eps: 16 kappa eps.
    eps = torch.finfo(torch.float64).eps
    singular_values = torch.linalg.svdvals(x)
    kappa = singular_values[0] / singular_values[-1]
    tangent_tol = 64 * eps * (1 + kappa**2) * singular_values[0] * u.norm()
    assert manifold.constraint(x, pu).norm() <= tangent_tol
    normal = u - pu  # must be x S with S symmetric: the normal space at x
    S = torch.linalg.lstsq(x, normal).solution
    assert (x @ S - normal).norm() <= 16 * kappa * eps * normal.norm()
    assert (S - S.mT).norm() <= 16 * kappa * eps * S.norm()
    one_jacobi_step = u - manifold.constraint_adjoint(x, manifold.constraint(x, u) / 4)
    assert manifold.constraint(x, one_jacobi_step).norm() > tangent_tol  # CG was needed


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", MANIFOLDS)
@pytest.mark.parametrize("method", ["projx", "proju", "retr", "constraint", "egrad2rgrad"])
def test_vectors_are_rejected_with_a_clear_error(name, method):
    manifold = MANIFOLDS[name]()
    vector = torch.randn(5, dtype=torch.float64)
    args = (vector,) if method == "projx" else (vector, vector)
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\], got shape \(5,\); vectors \(biases, gains\) belong to an unconstrained"):
        getattr(manifold, method)(*args)


@pytest.mark.parametrize("name", MANIFOLDS)
def test_mismatched_vector_shape_is_rejected(name):
    manifold = MANIFOLDS[name]()
    x = manifold.random(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="does not match the point's matrix shape"):
        manifold.proju(x, torch.randn(4, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not broadcast"):
        manifold.retr(x.expand(2, 6, 4), torch.zeros(3, 6, 4, dtype=torch.float64))
    # transp's vector is named v in its message (it had been proju's u)
    with pytest.raises(ValueError, match=r": v of shape \(6, 5\) does not match"):
        manifold.transp(x, x, torch.randn(6, 5, dtype=torch.float64))


def test_wrong_shapes_and_types_are_rejected():
    with pytest.raises(ValueError, match="at least 2 experts"):
        CenteredRouterSpace().projx(torch.randn(1, 5))
    with pytest.raises(ValueError, match="at least 2 experts"):
        CenteredRouterSpace().random(1, 5)
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
        Stiefel().random(5)
    with pytest.raises(ValueError, match="empty"):
        Oblique().projx(torch.randn(0, 3))
    with pytest.raises(TypeError, match="floating-point"):
        Stiefel().projx(torch.ones(4, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        Stiefel().projx([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="radius"):
        LPRO(radius=0.0)


def test_dgram_zero_column_is_rejected():
    W = dgram_point()
    W[:, 2] = 0
    manifold = DGram()
    with pytest.raises(ValueError, match="zero column"):
        manifold.projx(W)
    assert not manifold.check_point_on_manifold(W)  # what refuses such weights before a step
    # A retraction target with a zero column keeps the point, R_W(0) (a deliberate change: it
    # had raised after a host read inside every optimizer step; see DGram's docstring), here
    # for a step that annihilates every column (V = -W is tangent: Off(-2 W^T W) = 0).
    assert torch.equal(manifold.retr(W, torch.zeros_like(W)), W)
    assert torch.equal(manifold.retr(dgram_point(), -dgram_point()), dgram_point())


def test_zero_columns_and_rows_cannot_be_normalized():
    with pytest.raises(ValueError, match="column of the input is zero"):
        Oblique().projx(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="row of the input is zero"):
        LPRO(radius=1.0).projx(torch.zeros(4, 3))


def test_no_nan_from_the_documented_safe_inputs():
    # Zero tangent vectors and zero steps are safe everywhere (no division by |u|).
    for name, factory in MANIFOLDS.items():
        manifold = factory()
        x = manifold.random(5, 3, dtype=torch.float64)
        zero = torch.zeros_like(x)
        for out in (manifold.proju(x, zero), manifold.retr(x, zero)):
            assert torch.isfinite(out).all(), name
    assert math.isfinite(manifold_residual(Euclidean(), torch.zeros(3, 2)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("wide", [False, True])
def test_dgram_retraction_keeps_a_column_far_shorter_than_the_others(wide, dtype):
    # msign of the target itself had normalized by 1.01 ||W||_F, which put a column 1e-3 times
    # the others at x = 3e-5 at n = 1024, below Polar Express's range: one zero step shortened
    # it by 0.27 % and 60 took it to 0. Here a 192 x 96 point whose column 0 is 1e-6 of the
    # others (x = 1e-7 without the columns' normalization), retracted 60 times with zero steps.
    # Tolerance: each retraction of an exact point adds its round-off, about eps sqrt(mn) relative
    # (the Frobenius sums of Polar Express), so 60 of them stay within 60 eps sqrt(mn): 1.8e-12
    # in float64, 9.8e-4 in float32 (measured: 4e-15 and 9e-7); the old map lost the column (1.0).
    gen = torch.Generator().manual_seed(0)
    W = Stiefel().random(192, 96, dtype=torch.float64, generator=gen)
    W[:, 0] *= 1e-6
    W = (W.mT if wide else W).to(dtype)
    x = W
    for _ in range(60):
        x = DGram().retr(x, torch.zeros_like(x))
    columns = -1 if wide else -2
    drift = ((x.double() - W.double()).norm(dim=columns) / W.double().norm(dim=columns)).max()
    assert drift <= 60 * torch.finfo(dtype).eps * math.sqrt(192 * 96), drift
    # control: one step of the unnormalized map loses that column's norm
    target = (W.mT if wide else W).double()
    unnormalized = msign(target, "polar_express") * target.norm(dim=-2, keepdim=True)
    assert (unnormalized[:, 0].norm() / target[:, 0].norm() - 1).abs() > 1e-2


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_dgram_retraction_of_fp32_columns_beyond_the_squares_range(scale):
    # fp32 columns of norm 1e30 had squared to inf (a NaN point) and of norm 1e-30 to 0 (the
    # step skipped as if a column were zero): each column's norm comes from the column over its
    # largest entry. Tolerance: the fp32 retraction's round-off, default_tolerance's eps sqrt(mn)
    gen = torch.Generator().manual_seed(1)
    W = (Stiefel().random(12, 6, dtype=torch.float64, generator=gen) * scale).float()
    V = 1e-2 * scale * torch.randn(12, 6, generator=gen, dtype=torch.float64)
    V = (V - W.double() @ (W.double().mT @ V) / scale**2).float()  # normal to W's columns: tangent
    R = DGram().retr(W, V)
    expected = (W.double() + V.double()) / (W.double() + V.double()).norm(dim=-2, keepdim=True)
    expected = msign(expected, "svd") * (W.double() + V.double()).norm(dim=-2, keepdim=True)
    assert ((R.double() - expected).norm() / expected.norm()).item() <= default_tolerance(torch.float32)


@pytest.mark.parametrize("scale", [1e-12, 1.0, 1e12])
def test_dgram_retraction_is_scale_free(scale):
    # DGram is a cone (W in M => sW in M), so its retraction must fix points at any scale
    # (msign's default norm floor of 1e-7 would break this at 1e-12).
    W = dgram_point() * scale
    R = DGram().retr(W, torch.zeros_like(W))
    assert ((R - W).norm() / W.norm()).item() <= default_tolerance(torch.float64)


class _WrongNormalConstraintOblique(Oblique):
    """Constraint 2 diag(W^T A) against F = (|w_j|^2 - 1)/2: same kernel (so projection,
    adjointness and retraction all pass) but not dF; only the derivative check sees it
    (it declares no Gram form: Oblique's would disagree with the doubled constraint)."""

    gram_form = None

    def constraint(self, x, u):
        return 2 * super().constraint(x, u)

    def constraint_adjoint(self, x, lam):
        return 2 * super().constraint_adjoint(x, lam)

    def constraint_gram_diag(self, x):
        return 4 * super().constraint_gram_diag(x)


def test_contract_checks_the_defining_map_against_the_constraint():
    report = check_manifold_contract(_WrongNormalConstraintOblique(), (7, 3), raise_on_failure=False)
    assert {check.name for check in report.failures} == {"defining_map_derivative"}, str(report)


class _Broken(Oblique):
    """Oblique with one method broken at a time (``bug``), each a bug the contract had passed."""

    def __init__(self, bug):
        super().__init__()
        self.bug = bug

    def egrad2rgrad(self, x, u):
        out = super().egrad2rgrad(x, u)
        return -out if self.bug == "egrad2rgrad" else out

    def proju(self, x, u):
        out = super().proju(x, u)
        return u.copy_(out) if self.bug == "proju_in_place" else out

    def transp(self, x, y, v):
        out = super().transp(x, y, v)
        return 0 * out if self.bug == "transp" else out

    def retr(self, x, u):
        out = super().retr(x, u)
        return out.double() if self.bug == "retr_dtype" else out

    def projx(self, x):
        out = super().projx(x)
        if self.bug == "projx_small":  # leaves points inside the unit ball where they are
            return torch.where(x.norm(dim=-2, keepdim=True) < 1, x, out)
        return out

    def dualizer_keeps_tangent(self, x, norm):
        return self.bug == "keeps_tangent" or super().dualizer_keeps_tangent(x, norm)


class _BorrowedGramForm(Oblique):
    """Oblique declaring Stiefel's Gram form (its projection is not Oblique's)."""

    gram_form = Stiefel.gram_form


@pytest.mark.parametrize("manifold, dtype, failed", [
    (_Broken("egrad2rgrad"), torch.float64, "egrad2rgrad_is_gradient"),
    (_Broken("proju_in_place"), torch.float64, "methods_leave_their_inputs"),
    (_Broken("transp"), torch.float64, "transp_identity"),
    (_Broken("retr_dtype"), torch.float32, "methods_keep_the_dtype"),
    (_Broken("projx_small"), torch.float64, "projx_on_manifold_far_and_near"),
    (_Broken("keeps_tangent"), torch.float64, "dualizer_keeps_tangent"),
    (_BorrowedGramForm(), torch.float64, "gram_form_matches"),
], ids=["egrad2rgrad", "proju_in_place", "transp", "retr_dtype", "projx_small", "keeps_tangent", "gram_form"])
def test_contract_catches_what_it_had_passed(manifold, dtype, failed):
    # each of these had passed every check; the right check now fails, and the error says
    # what to fix. Control: the same class without a bug passes.
    report = check_manifold_contract(manifold, (7, 3), dtype=dtype, raise_on_failure=False)
    assert failed in {check.name for check in report.failures}, str(report)
    with pytest.raises(AssertionError, match=f"what to fix:\n.*{failed}: "):
        check_manifold_contract(manifold, (7, 3), dtype=dtype)
    assert check_manifold_contract(_Broken(None), (7, 3), dtype=dtype).passed


@pytest.mark.parametrize("dtype,scales", [(torch.float64, (1e160, 1e-300)), (torch.float32, (1e20, 1e-30))],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("manifold", [Oblique(), LPRO(radius=2.0), DGram()], ids=["oblique", "lpro", "dgram"])
def test_projx_of_a_matrix_at_an_extreme_scale_is_the_scaled_projection(manifold, dtype, scales):
    # Squared norms of such inputs overflow or underflow the dtype: Oblique and LPRO had
    # returned the zero matrix for the large one and called a nonzero column of the small one
    # "zero"; DGram had returned inf/NaN. The sphere maps are scale-free, DGram's projx is
    # homogeneous (projx(cx) = c projx(x)). The scales keep the input normal (a subnormal input
    # is itself rounded). Tolerance: the scaling by a power of ten and the division by the
    # largest entry round a few times in the dtype: 16 eps relative.
    g = torch.randn(6, 3, dtype=dtype, generator=torch.Generator().manual_seed(0))
    reference = manifold.projx(g)
    for scale in scales:
        y = manifold.projx(scale * g)
        unscaled = y / scale if isinstance(manifold, DGram) else y
        assert torch.isfinite(y).all()
        assert (unscaled - reference).abs().max() <= 16 * torch.finfo(dtype).eps * reference.abs().max(), scale


@pytest.mark.parametrize("dtype,scales", [(torch.float64, (1e160, 1e-300)), (torch.float32, (1e20, 1e-25))],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("manifold,dim", [(Oblique(), -2), (LPRO(radius=2.0), -1)], ids=["oblique", "lpro"])
def test_sphere_projx_normalizes_each_slice_whatever_its_neighbours_scale(manifold, dim, dtype, scales):
    # each column (Oblique) or row (LPRO) is normalized on its own, so its result cannot depend
    # on another slice's scale: a column of 1e-25 beside one of 1e20 (fp32) had been divided by
    # the matrix's largest entry into subnormals and called "zero". Tolerance as above.
    g = torch.randn(6, 4, dtype=dtype, generator=torch.Generator().manual_seed(1))
    reference = manifold.projx(g)
    slices = g.size(-1 if dim == -2 else -2)  # the normalized slices: columns for dim -2, rows for -1
    factors = torch.tensor([scales[j % 2] for j in range(slices)], dtype=dtype)
    mixed = g * (factors if dim == -2 else factors[:, None])
    y = manifold.projx(mixed)
    assert (y - reference).abs().max() <= 16 * torch.finfo(dtype).eps * reference.abs().max()


# --------------------------------------------------------------------------- geoopt surface
FLAT = ("euclidean", "lpro", "centeredrouterspace")
CURVED = [name for name in MANIFOLDS if name not in FLAT]


@pytest.mark.parametrize("name", CURVED)
def test_dist_and_logmap_of_a_curved_manifold_name_it_and_say_what_to_use(name):
    # geoopt's base raised a bare NotImplementedError: no manifold, no alternative
    manifold = MANIFOLDS[name]()
    x = manifold.random(6, 4, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=rf"^{manifold.name} has no geodesic distance.*\(x - y\)\.norm"):
        manifold.dist(x, x)
    with pytest.raises(NotImplementedError, match=rf"^{manifold.name} has no logmap.*proju\(x, y - x\)"):
        manifold.logmap(x, x)


@pytest.mark.parametrize("name", FLAT)
def test_flat_manifolds_have_exact_logmap_and_dist(name):
    manifold = MANIFOLDS[name]()
    gen = torch.Generator().manual_seed(11)
    x = manifold.random(2, 6, 4, dtype=torch.float64, generator=gen)
    y = manifold.random(6, 4, dtype=torch.float64, generator=gen)  # broadcast over x's batch
    u = manifold.logmap(x, y)
    # Exact inverse of expmap on a flat space; fp64 round-off of one subtraction, one
    # addition and (router) one centering over 6 rows: 16 eps relative is ample.
    tol = 16 * torch.finfo(torch.float64).eps
    assert u.shape == (2, 6, 4)
    assert ((manifold.expmap(x, u) - y).norm(dim=(-2, -1)) <= tol * y.norm()).all()
    assert ((manifold.proju(x, u) - u).norm(dim=(-2, -1)) <= tol * u.norm()).all()  # tangent
    assert torch.equal(manifold.logmap(x, x), torch.zeros_like(x))
    assert torch.allclose(manifold.dist(x, y), (x - y).norm(dim=(-2, -1)), rtol=tol, atol=0)
    assert manifold.dist(x, y, keepdim=True).shape == (2, 1, 1)


@pytest.mark.parametrize("name", MANIFOLDS)
def test_reversible_flag_says_whether_the_retraction_undoes_itself(name):
    # geoopt's samplers read `reversible`; Euclidean and the router's subspace had said False
    # although R_{R_x(u)}(-transp(u)) = x exactly there (geoopt.Euclidean says True).
    manifold = MANIFOLDS[name]()
    gen = torch.Generator().manual_seed(12)
    x = manifold.random(6, 4, dtype=torch.float64, generator=gen)
    u = 0.3 * manifold.proju(x, torch.randn(6, 4, dtype=torch.float64, generator=gen))
    y, v = manifold.retr_transp(x, u, u)
    back, _ = manifold.retr_transp(y, -v, v)
    # A reversible round trip is exact to fp64 round-off (64 eps relative); a curved
    # retraction misses by O(|u|^2) = O(0.1), far outside it.
    returns = ((back - x).norm() <= 64 * torch.finfo(torch.float64).eps * x.norm()).item()
    assert manifold.reversible is returns


@pytest.mark.parametrize("name", MANIFOLDS)
@pytest.mark.parametrize("x_dtype,u_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64),
                                             (torch.bfloat16, torch.float32)], ids=["x64_u32", "x32_u64", "xbf16_u32"])
def test_proju_computes_in_the_dtype_of_u(name, x_dtype, u_dtype):
    # MatrixManifold.proju documents u's dtype: Stiefel and DGram had crashed inside a matmul
    # ("expected m1 and m2 to have the same dtype"), Oblique and LPRO had promoted to float64.
    manifold = MANIFOLDS[name]()
    gen = torch.Generator().manual_seed(13)
    x = manifold.random(6, 4, dtype=torch.float64, generator=gen).to(x_dtype)
    u = torch.randn(6, 4, dtype=torch.float64, generator=gen).to(u_dtype)
    for out in (manifold.proju(x, u), manifold.egrad2rgrad(x, u), MatrixManifold.proju(manifold, x, u)):
        assert out.dtype == u_dtype
    assert torch.equal(manifold.proju(x, u), manifold.proju(x.to(u_dtype), u))


@pytest.mark.parametrize("name", MANIFOLDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_matrix_with_a_non_finite_entry_is_no_point(name, bad):
    # Euclidean and LPRO without a radius (an empty defining map) had accepted a NaN weight
    manifold = MANIFOLDS[name]()
    x = manifold.random(2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    x[1, 2, 3] = bad
    assert manifold.points_on_manifold(x).tolist() == [True, False]
    # the reason names the entry, not a constraint the NaN only seems to break
    assert manifold.check_point_on_manifold(x[1], explain=True) == (False, "x has a NaN or infinite entry")
    assert manifold.check_point_on_manifold(x[0])  # control


@pytest.mark.parametrize("name", MANIFOLDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_projx_refuses_a_matrix_with_a_non_finite_entry(name, bad):
    # NaN had come back silently from Oblique, LPRO and the router (Stiefel raised LAPACK's error)
    manifold = MANIFOLDS[name]()
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    assert manifold.points_on_manifold(manifold.projx(x)).item()  # control: a finite matrix projects
    x[2, 3] = bad
    with pytest.raises(ValueError, match="x given to projx has a NaN or infinite entry"):
        manifold.projx(x)
    with pytest.raises(ValueError, match="x given to projx has a NaN or infinite entry"):
        manifold.projx(x.mT.contiguous())  # wide, through the transposed geometry too


class ProjxJudgedStiefel(Stiefel):
    """Stiefel judged by projx alone (no defining map): the generic point test's other branch."""

    has_defining_map = False


def test_a_point_test_by_projx_says_false_for_a_non_finite_matrix():
    # projx refuses NaN (and Stiefel's SVD fails on it): the point test by projx had raised instead
    # of answering False, and check_point_on_manifold could not give its reason
    manifold = ProjxJudgedStiefel()
    x = Stiefel().random(2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    x[1, 2, 3] = float("nan")
    assert manifold.points_on_manifold(x).tolist() == [True, False]
    assert manifold.check_point_on_manifold(x[1], explain=True) == (False, "x has a NaN or infinite entry")
    assert not manifold.points_on_manifold(x[0] + 0.1).item()  # control: the projx test still judges


def test_router_point_check_is_relative_to_the_scale_of_the_weights():
    # The subspace 1^T W = 0 is a cone; the generic test |1^T w_j| <= atol was not scale-free.
    router = CenteredRouterSpace()
    gen = torch.Generator().manual_seed(15)
    for scale in (1e-3, 1.0, 10.0, 1e3):
        # float32 weights fresh from projx (float64, rounded once): 64 experts at scale 10 had
        # been refused. Rounding the centered entries moves a column sum by at most
        # eps/2 * 1^T|w_j|, the float32 sum adds at most 63 eps/2 of it: 32 eps = 3.8e-6 < atol.
        point = router.projx(scale * torch.randn(64, 512, generator=gen)).float()
        assert router.check_point_on_manifold(point), scale
        # a shift 1 v^T with |v_j| about 1e-3 of the entries moves column sums by 64e-3 |w|,
        # 1e-3 of their absolute sums: refused at every scale (a router of scale 1e-3 had passed)
        shifted = point + 1e-3 * point.abs().mean() * torch.ones(64, 1)
        assert not router.check_point_on_manifold(shifted), scale
    ok, reason = router.check_point_on_manifold(1e-7 * torch.randn(8, 16, generator=gen), explain=True)
    assert not ok and "column sums over the experts" in reason


@pytest.mark.parametrize("radius,error", [(float("inf"), ValueError), (True, TypeError), ("2", TypeError),
                                          (-1.0, ValueError)], ids=["inf", "bool", "string", "negative"])
def test_lpro_refuses_a_radius_that_is_not_a_finite_positive_number(radius, error):
    # inf had been accepted (projx returned infinite rows), True taken as 1 and "2" as 2
    with pytest.raises(error, match=r"LPRO: radius"):
        LPRO(radius=radius)


@pytest.mark.parametrize("size", [(6, -4), (-2, 6, 4)], ids=["matrix", "batch"])
def test_random_refuses_a_negative_size_by_name(size):
    # torch's "Trying to create tensor with negative dimension" had named no parameter
    with pytest.raises(ValueError, match=r"Stiefel: size .* has a negative dimension"):
        Stiefel().random(*size)


@pytest.mark.parametrize("manifold,scale", [
    (LPRO(radius=1e-6), 1.0), (LPRO(radius=1e3), 1.0), (DGram(), 1e-4), (DGram(), 1e2),
    (CenteredRouterSpace(), 1e-4), (CenteredRouterSpace(), 1e2), (Stiefel(), 1.0), (Oblique(), 1.0),
], ids=["lpro_1e-6", "lpro_1e3", "dgram_1e-4", "dgram_1e2", "router_1e-4", "router_1e2", "stiefel", "oblique"])
def test_tangent_check_is_scale_free(manifold, scale):
    # |L_x(u)| <= atol had refused float32 tangent vectors of size 1e2 (the round-off of L_x(u)
    # grows with |x||u|) and accepted a unit normal at a point of LPRO(radius=1e-6).
    # Tolerance: a float32 proju output keeps a normal component of its round-off, about
    # sqrt(n) eps |u| = 7e-7 |u| for n = 32 summed terms, and the check's own float32 solve adds
    # as much; the default atol 1e-5 (84 eps) is 7x above both. A normal vector's ratio is 1.
    gen = torch.Generator().manual_seed(16)
    x = manifold.random(64, 32, generator=gen).data * scale  # (each manifold here is a cone or a point set at that scale)
    assert manifold.check_point_on_manifold(x)
    for size in (1e-4, 1e2):
        tangent = manifold.proju(x, size * torch.randn(64, 32, generator=gen))
        assert manifold.check_vector_on_tangent(x, tangent), size
        normal = normal_component(manifold, x, torch.randn(64, 32, generator=gen, dtype=torch.float64))
        normal = (size * normal / normal.norm()).float()
        ok, reason = manifold.check_vector_on_tangent(x, normal, explain=True)
        assert not ok and "normal component of u" in reason, size


def test_dgram_maps_of_an_optimizer_step_read_nothing_back():
    # proju and constraint_gram_diag had checked for a zero column with bool(), a host read in
    # every step of ManifoldMuon's general path (three per step); the point check and the
    # retraction (which keeps the point where a target has one) keep zero columns out. Counted by
    # bool() on any tensor.
    manifold, reads = DGram(), []
    W, G = dgram_point(), torch.randn(10, 6, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    original = torch.Tensor.__bool__
    torch.Tensor.__bool__ = lambda tensor: reads.append(1) or original(tensor)
    try:
        P, diag = manifold.proju(W, G), manifold.constraint_gram_diag(W)
        W0 = W.clone()
        W0[:, 2] = 0
        P0 = manifold.proju(W0, G)
    finally:
        torch.Tensor.__bool__ = original
    assert reads == []
    # still the orthogonal projection onto ker L_W, at a zero column too (no NaN from 0/0):
    # idempotent, tangent and self-adjoint to float64 round-off (the contract's tolerance)
    tol = default_tolerance(torch.float64)
    for point, projected in ((W, P), (W0, P0)):
        assert torch.isfinite(projected).all()
        assert (manifold.proju(point, projected) - projected).norm() <= tol * G.norm()
        assert manifold.constraint(point, projected).norm() <= tol * point.norm() * G.norm()
        H = torch.randn(10, 6, generator=torch.Generator().manual_seed(18), dtype=torch.float64)
        assert abs((projected * H).sum() - (G * manifold.proju(point, H)).sum()) <= tol * G.norm() * H.norm()
    # the Jacobi diagonal is L_W L_W^* on the range of L_W
    lam = manifold.constraint(W, G)
    assert (manifold.constraint(W, manifold.constraint_adjoint(W, lam)) - diag * lam).norm() <= tol * (diag * lam).norm()


# --------------------------------------------------------------------------- sphere products
SPHERES = {"oblique": (Oblique(), -2), "lpro": (LPRO(radius=2.0), -1)}  # manifold, axis its slices run along


@pytest.mark.parametrize("name", SPHERES)
def test_sphere_proju_at_a_zero_slice_is_the_orthogonal_projection(name):
    # A zero column (Oblique) or row (LPRO) constrains nothing (<x_j, .> = 0), so the projection
    # onto ker L_x keeps u there; the closed form had divided 0 by 0 and returned NaN where the
    # generic projection (MatrixManifold.proju) and DGram's keep u_j. Each slice is one
    # Householder-like update u_j - c x_j with c from two sums of at most 6 terms: a few eps of |u|
    # per slice, so 16 eps |u| bounds the gap to the generic one-iteration CG solve.
    manifold, dim = SPHERES[name]
    gen = torch.Generator().manual_seed(21)
    x = manifold.random(2, 6, 5, dtype=torch.float64, generator=gen)
    across = -1 if dim == -2 else -2  # the axis that indexes the slices
    x[1].select(across, 2).zero_()  # matrix 1: its slice 2 is zero; matrix 0: the control
    u = torch.randn(2, 6, 5, dtype=torch.float64, generator=gen)
    projected = manifold.proju(x, u)
    tol = 16 * torch.finfo(torch.float64).eps * u.norm()
    assert torch.isfinite(projected).all()
    assert (projected - MatrixManifold.proju(manifold, x, u)).norm() <= tol
    assert torch.equal(projected[1].select(across, 2), u[1].select(across, 2))  # the unconstrained slice, untouched
    assert (manifold.constraint(x, projected).abs() <= tol * x.norm(dim=dim).amax()).all()  # tangent elsewhere


@pytest.mark.parametrize("name", SPHERES)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e20), (torch.float32, 1e-25), (torch.float16, 300.0)],
                         ids=["fp32_large", "fp32_small", "fp16_norm_300"])
def test_sphere_proju_is_scale_free(name, dtype, scale):
    # P_{cx} = P_x (the tangent constraint of a slice is its direction), but the squared norms
    # of cx had overflowed (fp32 at 1e20; fp16 already at a row norm of 300, LPRO(radius=300):
    # 9e4 > 65504) to inf, so u came back unprojected, or underflowed to 0 (fp32 at 1e-25): inf.
    # Reference: float64 of the same rounded inputs. Error in the dtype: the scaled x_j rounds
    # once, its two sums of k <= 6 terms carry k eps each, the quotient, product and difference
    # one eps each: (2k + 4) eps = 16 eps of |u_j|.
    manifold, dim = SPHERES[name]
    gen = torch.Generator().manual_seed(22)
    x = (scale * manifold.random(6, 5, dtype=torch.float64, generator=gen)).to(dtype)
    u = torch.randn(6, 5, dtype=torch.float64, generator=gen).to(dtype)
    projected = manifold.proju(x, u)
    reference = manifold.proju(x.double(), u.double())
    slice_norms = u.double().norm(dim=dim, keepdim=True)
    assert ((projected.double() - reference).abs() <= 16 * torch.finfo(dtype).eps * slice_norms).all()


def test_the_manifolds_page_names_exactly_the_manifolds_that_transpose_wide_points():
    # docs/concepts/manifolds.md had said a wide Oblique weight uses the transposed geometry;
    # Oblique constrains its columns for every shape (transposes_wide is False, see
    # test_orientation_of_each_manifold). The page's list is held to the classes' flag.
    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts" / "manifolds.md").read_text()
    listed = re.search(r"are the reference orientation of (.*?): the\s+columns are constrained", page, re.S)
    assert listed is not None, "the orientation paragraph of docs/concepts/manifolds.md moved"
    named = set(re.findall(r"`(\w+)`", listed.group(1)))
    transposing = {cls.name for cls in MatrixManifold.registered().values()
                   if cls.__module__.startswith("geomuon.manifolds.") and cls.transposes_wide}
    assert named == transposing


@pytest.mark.parametrize("name", SPHERES)
def test_sphere_normalization_of_long_slices_is_accurate_in_float32(name):
    # torch's float32 Tensor.norm along a strided dim accumulates sequentially on the CPU: an
    # Oblique column of 2e5 entries came back from retr and projx with a norm about 2e-5 off 1
    # (beyond the point check's 1e-5), 2e-4 at 1e6 rows. Bound: the entries round once (eps/2),
    # the pairwise sum of k squares carries log2(k) eps/2 relative, the root, quotient and
    # product eps/2 each: (log2(k) + 4) eps of the radius.
    manifold, dim = SPHERES[name]
    radius = 1.0 if name == "oblique" else manifold.radius
    length = 200_000
    shape = (length, 2) if dim == -2 else (2, length)
    gen = torch.Generator().manual_seed(23)
    point = manifold.random(*shape, dtype=torch.float64, generator=gen).float()
    step = manifold.proju(point, 0.01 * torch.randn(shape, generator=gen))
    tol = (math.log2(length) + 4) * torch.finfo(torch.float32).eps * radius
    for landed in (manifold.retr(point, step), manifold.projx(torch.randn(shape, generator=gen))):
        assert (landed.double().norm(dim=dim) - radius).abs().max() <= tol
        assert manifold.check_point_on_manifold(landed)


@pytest.mark.parametrize("wide", [False, True], ids=["tall", "wide"])
def test_dgram_retraction_of_a_zero_column_target_keeps_that_point_without_a_host_read(no_host_reads, wide):
    # retr had read bool((d2 == 0).any()) back in every call (a device sync in every step of
    # ManifoldMuon's general path) to raise for a zero target column. Now the matrix whose
    # target has one keeps its point (selected on the device, bitwise), the others of the batch
    # retract as they do alone. Column 2 of W0 annihilated: V0 = -w_2 e_2^T is tangent, since
    # W0^T V0 = -d_2^2 e_2 e_2^T is diagonal.
    manifold = DGram()
    W0, W1 = dgram_point(seed=3), dgram_point(seed=4)
    V0 = torch.zeros_like(W0)
    V0[:, 2] = -W0[:, 2]
    V1 = manifold.proju(W1, torch.randn(W1.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    W, V = torch.stack([W0, W1]), torch.stack([V0, V1])
    if wide:  # the transposed geometry: a zero row
        W, V, W1, V1 = W.mT, V.mT, W1.mT, V1.mT
    with no_host_reads():
        points = manifold.retr(W, V)
    alone = manifold.retr(W1, V1)
    assert torch.equal(points[0], W[0])
    # the other matrix: the same float64 Polar Express as alone (at most 12 steps of 3 products
    # with inner dimension <= m + n = 16, each off by <= (m + n) eps ||Y||_F), times its norms
    eps, size = torch.finfo(torch.float64).eps, sum(W1.shape)
    tolerance = 12 * 3 * size * eps * float((W1 + V1).norm())
    assert (points[1] - alone).abs().max() <= tolerance
    assert not torch.equal(points[1], W[1])  # it moved
    # on DGram: its cosines are the orthogonalization's error, within the same bound (a cosine
    # is scale-free, so the bound relative to ||Y||_F applies to it as it stands)
    assert manifold.check_point_on_manifold(points[1], atol=12 * 3 * size * eps, rtol=0.0)


def test_the_generic_maps_of_an_empty_batch_return_an_empty_batch():
    # gram_solve (and the generic proju, egrad2rgrad, retr and projx through it) had raised
    # "cannot reshape tensor of 0 elements into shape [0, -1]" on a [0, m, n] batch. Each map's
    # result is its output for one point, stacked zero times: shape [0, *one point's], x's dtype.
    from test_constraint_manifold import GeneralizedStiefel, UnitColumnsFromMaps, spd

    for manifold in (UnitColumnsFromMaps(), GeneralizedStiefel(spd(6))):
        one = manifold.projx(torch.randn(6, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
        empty = torch.zeros(0, 6, 4, dtype=torch.float64)
        multiplier = manifold.constraint(one, one)
        maps = {
            "gram_solve": (manifold.gram_solve(empty, manifold.constraint(empty, empty)), multiplier),
            "proju": (manifold.proju(empty, empty), one),
            "egrad2rgrad": (manifold.egrad2rgrad(empty, empty), one),
            "retr": (manifold.retr(empty, empty), one),
            "projx": (manifold.projx(empty), one),
        }
        for name, (out, of_one) in maps.items():
            assert out.shape == (0, *of_one.shape), (manifold.name, name, out.shape)
            assert out.dtype == torch.float64, (manifold.name, name, out.dtype)
