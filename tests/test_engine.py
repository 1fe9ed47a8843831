"""The Gram-space engine: an exact reformulation, per-matrix, host-sync free, compilable.

Math checks in float64 (the reformulation is exact there); kernel checks in the
optimizer's real dtypes (fp32 weights, bf16 dual iterations).
"""

import contextlib

import pytest
import torch

from geomuon.manifolds import DGram, Oblique, Stiefel
from geomuon.optimizers import ManifoldMuon, steepest_direction
from geomuon.manifolds.capabilities import gram_retraction
from geomuon.optimizers.gram import (UNIT_BALL_STEPS, GramSettings, eigen_dualizer, exact_unit_ball, gram_msign,
                                     gram_step, newton_cg, newton_update, polynomial_unit_ball, projected_step)
from geomuon.optimizers.steepest import certified_ratio

MANIFOLDS = [(Stiefel(), False), (DGram(), True), (Oblique(), False)]
IDS = ["stiefel", "dgram", "oblique"]


def _problem(manifold, m, n, seed, spread=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    W = manifold.projx(torch.randn(m, n, generator=gen, dtype=torch.float64))
    if spread:  # DGram column norms over [0.1, 10]
        W = W * torch.logspace(-1, 1, n, dtype=torch.float64)
    return W.to(dtype), torch.randn(m, n, generator=gen, dtype=torch.float64).to(dtype)


def _gram_direction(manifold, W, G, settings, correction=None):
    out = gram_step(manifold.gram_form, W[None], G[None], 1e-3, correction, settings)
    T1, T2, Z0, S = out.direction_factors
    return W @ T1[0] + Z0[0] @ T2[0], Z0[0] + W @ S[0], out


#: the general engine's dualizer for each Gram-space dualizer (the same map of Z)
_GENERAL_MSIGN = {"polar_express": dict(msign_method="polar_express", msign_steps=6),
                  "eigh": dict(msign_method="svd")}


@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("dual_steps", [0, 3])
@pytest.mark.parametrize("dualizer", list(_GENERAL_MSIGN))
def test_gram_space_direction_is_the_general_engines_direction(manifold, spread, dual_steps, dualizer):
    # Same algorithm (projection start, constant Jacobi steps, final tangent projection) and
    # the same dualizer of Z, so in float64 the two directions agree to round-off (measured
    # ~1e-15; the eigh dualizer's shift eps*tr(Q) moves sigma by eps*tr(Q)/sigma^2, below
    # 1e-13 here); the general engine also rescales to unit spectral norm, hence the
    # comparison up to a positive scale.
    W, G = _problem(manifold, 48, 16, seed=dual_steps, spread=spread)
    settings = GramSettings(dual_steps=dual_steps, carry=False, compute_dtype=None, update="jacobi",
                            dualizer=dualizer)
    gram, _, _ = _gram_direction(manifold, W, G, settings)
    general = steepest_direction(manifold, W, G, steps=dual_steps, alpha=1.0, decay=False, tol=0.0,
                                 certify=None, track_best=False, safeguard=False, exact_norm=True,
                                 **_GENERAL_MSIGN[dualizer]).direction
    scale = gram.norm() / general.norm()
    assert torch.allclose(gram, scale * general, atol=1e-12)
    # negative control: one dual step more is a different direction
    other = steepest_direction(manifold, W, G, steps=dual_steps + 1, alpha=1.0, decay=False, tol=0.0,
                               certify=None, track_best=False, safeguard=False,
                               **_GENERAL_MSIGN[dualizer]).direction
    assert not torch.allclose(gram / gram.norm(), other / other.norm(), atol=1e-6)


def test_newton_step_solves_su_lyapunov_equation_on_stiefel():
    # One Newton step from the projection start must give the X of Su's fixed point for the
    # frozen R = (Z^T Z)^{1/2}: R X + X R = -2 sym(R B), Z = G + W X, B = W^T G (kexue.fm/archives/11221).
    # Checked against a dense Kronecker solve in float64 (n = 6: a 36 x 36 system).
    W, G = _problem(Stiefel(), 20, 6, seed=21)
    form = Stiefel.gram_form
    zero_step = GramSettings(dual_steps=0, carry=True, compute_dtype=None)
    out = gram_step(form, W[None], G[None], 1e-3, None, zero_step)
    _, _, _, S0 = out.direction_factors          # S = 0: Z = Z0 = G - W sym(B)
    B = W.T @ G
    X_old = S0[0] - form.project(torch.eye(6, dtype=W.dtype), B)
    Z = G + W @ X_old
    lam, V = torch.linalg.eigh(Z.T @ Z)
    R = (V * lam.sqrt()) @ V.T
    eye = torch.eye(6, dtype=W.dtype)
    lyapunov = torch.kron(eye, R) + torch.kron(R, eye)  # vec(RX + XR), column-major vec (R symmetric)
    rhs = -(R @ B + B.T @ R)
    X_su = torch.linalg.solve(lyapunov, rhs.T.reshape(-1)).reshape(6, 6).T
    X_new = form.adjoint(out.correction[0]) - form.project(eye, B)
    assert torch.allclose(X_new, X_su, atol=1e-10)
    # negative control: the Jacobi step from the same start is not Su's solution
    jacobi = gram_step(form, W[None], G[None], 1e-3, None, GramSettings(dual_steps=0, update="jacobi",
                                                                         compute_dtype=None))
    X_jacobi = form.adjoint(jacobi.correction[0]) - form.project(eye, B)
    assert not torch.allclose(X_jacobi, X_su, atol=1e-3)


@pytest.mark.parametrize("manifold,spread", MANIFOLDS[:2], ids=IDS[:2])
@pytest.mark.parametrize("dualizer", ["eigh", "polar_express"])
def test_newton_dual_steps_converge_to_the_optimum_cold(manifold, spread, dualizer):
    # Su's fixed point converges (linearly) from the projection start on random problems;
    # constant Jacobi steps stall or overshoot. Stiefel declares the closed form (eigh), both
    # forms the conjugate-gradient step (DGram always, Stiefel under Polar Express, which has
    # no eigenvectors). 16 Newton steps in float64: eigh certifies >= 0.999 (measured 1.0000),
    # Polar Express >= 0.9935 / 1.0012 (its 6-step band of singular values; measured 0.9985);
    # Jacobi 0.98 on Stiefel, 0.9775 on DGram (column norms over [0.1, 10]).
    assert manifold.gram_form.declares_newton
    assert manifold.gram_form.has_newton == isinstance(manifold, Stiefel)
    W, G = _problem(manifold, 96, 32, seed=5, spread=spread)
    ratios = {}
    for update in ("newton", "jacobi"):
        settings = GramSettings(dual_steps=16, carry=False, compute_dtype=None, update=update, dualizer=dualizer)
        A, Z, _ = _gram_direction(manifold, W, G, settings)
        ratios[update] = certified_ratio(G, A, Z).item()
    assert ratios["newton"] >= (0.999 if dualizer == "eigh" else 0.9935 / 1.0012)
    assert ratios["jacobi"] < 0.99  # the comparison is not vacuous


def test_stiefel_newton_by_conjugate_gradients_is_the_closed_form():
    # Under Polar Express (no eigenvectors) Stiefel's Newton step is conjugate gradients on
    # S P + P S = -(M + M^T); with n(n+1)/2 = 21 iterations (n = 6) it is the closed-form
    # Lyapunov solution in Q's eigenbasis up to float64 round-off times the operator's
    # condition number (bound 21 cond(P) eps). Negative control: 3 iterations are not.
    form = Stiefel.gram_form
    W, G = _problem(Stiefel(), 20, 6, seed=21)
    D = torch.eye(6, dtype=torch.float64)
    B = W.T @ G
    Z0 = G - W @ form.project(D, B)
    B0 = W.T @ Z0
    Q = Z0.T @ Z0
    dual = eigen_dualizer(Q, torch.trace(Q))
    M = B0 @ dual.P
    closed = newton_update(form, D, dual, M, 1.0, torch.float64)
    bound = 21 * torch.linalg.cond(dual.P).item() * torch.finfo(torch.float64).eps
    by_cg = -newton_cg(form, D[None], dual.P[None], form.constraint(M)[None], 21)[0]
    assert (form.adjoint(by_cg) - form.adjoint(closed)).norm() <= bound * form.adjoint(closed).norm()
    short = -newton_cg(form, D[None], dual.P[None], form.constraint(M)[None], 3)[0]
    assert (form.adjoint(short) - form.adjoint(closed)).norm() > 1e-4 * form.adjoint(closed).norm()


def test_dgram_newton_step_solves_the_frozen_tangency_equation():
    # DGram's Newton step is Su's fixed point for its constraint: the off-diagonal symmetric
    # delta with Off(D S P + P S D) = -Off(M + M^T), S = S(delta), P frozen, by conjugate
    # gradients. On n = 6 (15 unknowns) 15 iterations are exact in exact arithmetic; against a
    # dense solve in float64 the error is round-off times the operator's condition number
    # (bound: 15 cond eps; measured 1.6e-16 at cond 707).
    manifold = DGram()
    form = manifold.gram_form
    W, G = _problem(manifold, 20, 6, seed=21, spread=True)
    D = torch.diag((W * W).sum(0))
    B = W.T @ G
    B0 = B - D @ form.project(D, B)
    K = (G - W @ form.project(D, B)).T @ (G - W @ form.project(D, B))
    P = eigen_dualizer(K, torch.trace(K)).P
    H = form.constraint(B0 @ P)
    pairs = [(i, j) for i in range(6) for j in range(i + 1, 6)]

    def unit(i, j):
        E = torch.zeros(6, 6, dtype=torch.float64)
        E[i, j] = E[j, i] = 1.0
        return E

    dense = torch.stack([torch.stack([form.newton_operator(D, unit(i, j), P)[k, l] for k, l in pairs])
                         for i, j in pairs], dim=1)
    coef = torch.linalg.solve(dense, torch.stack([-H[k, l] for k, l in pairs]))
    expected = sum(c * unit(i, j) for c, (i, j) in zip(coef, pairs))
    delta = -newton_cg(form, D[None], P[None], H[None], len(pairs))[0]
    bound = len(pairs) * torch.linalg.cond(dense).item() * torch.finfo(torch.float64).eps
    assert (delta - expected).norm() <= bound * expected.norm()
    assert form.constraint((B0 + D @ form.adjoint(delta)) @ P).norm() <= bound * H.norm()
    # negative controls: 3 iterations are not the solve, and neither is the off-diagonal part
    # of Stiefel's closed form (D = I) once column norms differ (its residual: 575 ||H||)
    short = -newton_cg(form, D[None], P[None], H[None], 3)[0]
    assert (short - expected).norm() > 1e-4 * expected.norm()
    lam, V = torch.linalg.eigh(K)
    f = lam.clamp_min(0).add(1e-30).rsqrt()
    closed = -V @ ((V.T @ H @ V) / (f[:, None] + f[None, :])) @ V.T
    closed = 0.5 * (closed - torch.diag(torch.diag(closed)))
    assert form.constraint((B0 + D @ form.adjoint(closed)) @ P).norm() > H.norm()


def test_smoothed_newton_steps_certify_the_smoothing_bound_on_a_rank_spread_momentum():
    # A momentum whose singular values spread from 1 to 1e-8 (a transformer's): the dual is
    # nonsmooth there, and msign of a converged dual iterate is ambiguous on Z's near-null
    # space, so its tangent projection leaves the unit ball. Newton steps on the smoothed dual
    # tr((Z^T Z + mu I)^{1/2}), sqrt(mu) = c ||Z||_* / n, converge to a Z whose Z(Z^T Z + mu I)^{-1/2}
    # is tangent with norm < 1, certifying >= 1 - 0.301 c (each singular value loses at most
    # max_t t(1 - t/sqrt(1 + t^2)) sqrt(mu) = 0.30028 sqrt(mu), at t = 0.786); float64 round-off is far below.
    # Measured after 32 steps: c = 0.03 -> 0.996, c = 0 -> 0.935 (96 x 32).
    manifold = Stiefel()
    W, G = _problem(manifold, 96, 32, seed=3)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    G = U @ torch.diag(torch.logspace(0, -8, 32, dtype=torch.float64)) @ Vh
    ratios = {}
    for c in (0.03, 0.0):
        settings = GramSettings(dual_steps=32, carry=False, compute_dtype=None, smoothing=c)
        A, Z, _ = _gram_direction(manifold, W, G, settings)
        ratios[c] = certified_ratio(G, A, Z).item()
    assert ratios[0.03] >= 1 - 0.301 * 0.03
    assert ratios[0.0] < 0.95  # negative control: without smoothing the same steps certify less


@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
def test_gram_space_step_is_the_manifolds_retraction_of_that_direction(manifold, spread):
    W, G = _problem(manifold, 48, 16, seed=7, spread=spread)
    settings = GramSettings(dual_steps=1, compute_dtype=None)
    out = gram_step(manifold.gram_form, W[None], G[None], 0.05, None, settings)
    T1, T2, Z0, _ = out.direction_factors
    direction = W @ T1[0] + Z0[0] @ T2[0]
    assert manifold.check_point_on_manifold(out.point[0], atol=1e-12)
    expected = manifold.retr(W, -0.05 * direction)
    # Stiefel and Oblique retract with the manifold's own map; DGram's Gram form keeps
    # column norms by msign(Y D^-1/2) D^1/2, which agrees with DGram.retr to second order.
    tol = 1e-12 if not isinstance(manifold, DGram) else 1e-4
    assert torch.allclose(out.point[0], expected, atol=tol)


@pytest.mark.parametrize("dualizer", ["eigh", "polar_express"])
@pytest.mark.parametrize("manifold,spread", MANIFOLDS[:2], ids=IDS[:2])
def test_alternating_polish_brings_the_direction_into_the_unit_ball_and_keeps_it_tangent(manifold, spread, dualizer):
    # A momentum whose singular values spread from 1 to 1e-8 (as a transformer's do): one
    # Jacobi dual step leaves the tangent projection of msign(Z) at spectral norm 1.15
    # (Stiefel) / 1.31 (DGram), and the certificate divides by it. Alternating projections
    # bring the norm to 1 while the direction stays tangent, and the certificate does not
    # fall (measured 0.690 -> 0.698 on Stiefel, 0.585 -> 0.639 on DGram after 4 rounds).
    # (ADMM rounds need not shorten the direction monotonically: tests/test_direction_taken.py
    # checks that they reach the optimum.)
    W, G = _problem(manifold, 96, 32, seed=3, spread=spread)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    G = U @ torch.diag(torch.logspace(0, -8, 32, dtype=torch.float64)) @ Vh
    ratios, norms = [], []
    for rounds in (0, 1, 4):
        settings = GramSettings(dual_steps=1, carry=False, compute_dtype=None, update="jacobi", polish_rounds=rounds,
                                dualizer=dualizer, polish_method="alternating")
        A, Z, _ = _gram_direction(manifold, W, G, settings)
        # float64 tangent projection: residual <= 8 n eps ||W||_2^2 ||A||_2 (column norms up to 10)
        bound = 8 * 32 * torch.finfo(torch.float64).eps * torch.linalg.matrix_norm(W, 2).item() ** 2 * 2
        assert manifold.constraint(W, A).abs().max().item() <= bound
        ratios.append(certified_ratio(G, A, Z).item())
        norms.append(torch.linalg.matrix_norm(A, 2).item())
    assert norms[0] > 1.1  # the regime it is about
    assert norms[0] > norms[1] > norms[2] and norms[2] - 1 < (norms[0] - 1) / 20
    assert ratios[0] <= ratios[1] <= ratios[2]
    if spread:  # DGram: the certificate rises visibly
        assert ratios[2] - ratios[0] > 0.03


def _tangent(manifold, W, X):
    return X - W @ manifold.gram_form.project(W.mT @ W, W.mT @ X)


def _projected_reference(manifold, W, G, rounds):
    """The projected solver's map written out plainly in float64: the exact polar factor
    (SVD) of the projected momentum, projected, then ``rounds`` clips to the unit ball (every
    singular value above 1 set to 1) each followed by the tangent projection."""
    U, _, Vh = torch.linalg.svd(_tangent(manifold, W, G), full_matrices=False)
    A = _tangent(manifold, W, U @ Vh)
    for _ in range(rounds):
        U, sigma, Vh = torch.linalg.svd(A, full_matrices=False)
        A = _tangent(manifold, W, U @ torch.diag(sigma.clamp_max(1.0)) @ Vh)
    return A


@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_the_projected_step_is_the_polished_projection_of_the_projected_polar_factor(manifold, spread, rounds):
    # float64 throughout (compute_dtype None), 40 Polar Express steps (the table's last
    # quintic repeats: converged to round-off on a Gaussian 48 x 16 momentum, condition
    # about 3). Control: the reference with one round fewer or more is far (the rounds are
    # really taken, and each one moves the direction).
    W, G = _problem(manifold, 48, 16, seed=7, spread=spread)
    settings = GramSettings(solver="projected", polish_rounds=rounds, msign_steps=40, compute_dtype=None)
    out = projected_step(manifold.gram_form, W[None], G[None], 0.05, settings)
    direction = out.direction(W)[0]
    expected = _projected_reference(manifold, W, G, rounds)
    # the polar factor to ~1e-12, then O(1)-conditioned projections and clips: 1e-9 of O(1) entries
    assert torch.allclose(direction, expected, atol=1e-9)
    for other in {max(rounds - 1, 0), rounds + 1} - {rounds}:
        assert (direction - _projected_reference(manifold, W, G, other)).abs().max() > 1e-4
    # the dual iterate it certifies against is the projection start, and the point is the
    # form's retraction of the step (the retraction measures Y^T Y: exact to round-off)
    assert torch.allclose(out.dual_iterate(W)[0], _tangent(manifold, W, G), atol=1e-12)
    assert torch.allclose(out.point[0], gram_retraction(manifold.gram_form, W, -0.05 * direction), atol=1e-12)
    assert out.correction is None


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
def test_the_projected_step_does_not_step_on_its_own_rounding(manifold, spread, compute_dtype):
    # In the default dtypes (fp32 points, bf16 products) and in fp32 alone, a momentum that is
    # normal to the manifold has a tangent part of round-off only: its step is zero, not a unit
    # step in a rounding direction. Control: a tangent part of 0.1 % of the momentum (above the
    # 4 eps_bf16^2 = 0.024 % floor; one bf16 projection alone leaves ~0.4 % of normal
    # residual, which would swamp it) is stepped, and close to the exact direction.
    # With products as precise as the points (fp32) the floor is gram_step's,
    # 8 sqrt(max(m, n)) eps_fp32 = 9e-6 of the momentum, below the control's 0.1 %.
    W, G = _problem(manifold, 96, 32, seed=5, spread=spread, dtype=torch.float32)
    normal = G - _tangent(manifold, W, G)
    settings = GramSettings(solver="projected", polish_rounds=1, compute_dtype=compute_dtype)
    out = projected_step(manifold.gram_form, W[None], normal[None], 0.05, settings)
    assert torch.equal(out.direction(W)[0], torch.zeros_like(W))
    tangent = _tangent(manifold, W, G)
    mixed = normal + 1e-3 * tangent * normal.norm() / tangent.norm()
    out = projected_step(manifold.gram_form, W[None], mixed[None], 0.05, settings)
    step = out.direction(W)[0].double()
    exact = _projected_reference(manifold, W.double(), mixed.double(), 1)
    assert torch.linalg.matrix_norm(step, 2) > 0.5
    cosine = (step * exact).sum() / (step.norm() * exact.norm())
    # refined residual u |Z0| + u^2 |G| = (0.4 % + 1.5 % ) of the tangent part, plus the bf16 polar factor's
    assert cosine > 0.95


def _clip_problem(n, seed, dtype=torch.float32):
    r"""$\hat A = U\operatorname{diag}(s)V^\top$ ($3n\times n$) with $s$ log-spaced over $[10^{-6}, 0.95]$ on
    half the columns and uniform over $[1.05, 1.3]$ on the rest, and its Gram in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(3 * n, n, generator=gen, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    s = torch.cat([torch.logspace(-6, 0, n // 2, dtype=torch.float64) * 0.95,
                   1.05 + 0.25 * torch.rand(n - n // 2, generator=gen, dtype=torch.float64)])
    A = ((U * s) @ V.mT).to(dtype)[None]  # a batch of one: the engine's kernels take [B, n, n]
    return A, A.mT @ A, s.clamp_max(1.0)


@pytest.mark.parametrize("n", [16, 96])
def test_the_polynomial_unit_ball_is_the_clip_and_takes_no_eigendecomposition(n, monkeypatch, no_host_reads):
    # The kernel in its real dtype (fp32). Tolerance: away from sigma = 1 (here |sigma - 1| >=
    # 0.05, so the sign's normalized inputs are >= 0.05 / ||Gamma - I||_F >= 1e-3, the range the
    # Polar Express table is built for) the 8-step sign and Gamma^{-1/2} are within the table's
    # 6-step interval [0.9935, 1.0012] squared by the two repeated cubic steps (~1e-4), plus fp32
    # rounding of n x n products and of Gamma itself, ~ n eps_32 ||A||^2 = 2e-5 at n = 96; a
    # clipped singular value moves by at most the sum of the two errors: 1e-3 holds them with a
    # margin of 3-5 (measured 3e-4 at n = 384).
    A, gram, clipped = _clip_problem(n, seed=n)
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: pytest.fail("polynomial_unit_ball called eigh"))
    with no_host_reads():
        phi = polynomial_unit_ball(gram)
    monkeypatch.undo()
    tolerance = 1e-3
    singular = torch.linalg.svdvals((A @ phi).double())[0]
    assert singular.max().item() <= 1 + tolerance
    assert torch.allclose(singular.sort().values, clipped.sort().values, atol=tolerance, rtol=0)
    exact = torch.linalg.svdvals((A @ exact_unit_ball(gram)).double())[0]
    assert torch.allclose(exact.sort().values, clipped.sort().values, atol=tolerance, rtol=0)
    # negative controls: no clip at all (phi = I), and too few steps for the sign to converge
    unclipped = torch.linalg.svdvals(A.double())[0]
    assert not torch.allclose(unclipped.sort().values, clipped.sort().values, atol=tolerance, rtol=0)
    coarse = torch.linalg.svdvals((A @ polynomial_unit_ball(gram, steps=2)).double())[0]
    assert not torch.allclose(coarse.sort().values, clipped.sort().values, atol=tolerance, rtol=0)


def test_the_polynomial_unit_ball_survives_a_gram_made_indefinite_by_round_off():
    # A rank-deficient direction (square DGram in training) has Gamma = A'A with eigenvalues
    # a few 1e-4 below zero after fp32 rounding. Gamma's own Cholesky fails there (control:
    # gram_msign gives P = 0, which zeroed the clipped direction: certificates of 0.33 in
    # training); N = I + (Gamma - I)_+ has eigenvalues >= 1. Tolerance as in the test above.
    A, gram, clipped = _clip_problem(32, seed=5)
    V = torch.linalg.eigh(gram.double())[1]
    lam = torch.linalg.eigvalsh(gram.double())
    lam[..., :3] = torch.tensor([-5e-4, -1e-4, 0.0], dtype=torch.float64)  # the null space, rounded
    gram = ((V * lam.unsqueeze(-2)) @ V.mT).float()
    expected = lam.clamp_min(0).sqrt() * lam.clamp_min(1).rsqrt()  # sqrt(lambda) min(1, lambda^-1/2)
    assert not gram_msign(gram, UNIT_BALL_STEPS, torch.float32).P.any()
    phi = polynomial_unit_ball(gram).double()
    singular = torch.linalg.eigvalsh(phi.mT @ gram.double() @ phi).clamp_min(0).sqrt()
    assert torch.allclose(singular.sort().values, expected.sort().values, atol=1e-3, rtol=0)


def _stepped(manifold, shapes, seed, steps=3, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(manifold.random(*s, generator=gen).data) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return params, grads


def _run(optimizer, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


class WholeBatchManifoldMuon(ManifoldMuon):
    """ManifoldMuon stacking whole same-shape batches on the CPU too, in one thread, as an
    accelerator does (the CPU default steps one matrix per stack)."""

    cpu_stack_size = None
    parallel_batches = False


@pytest.mark.parametrize("solver", ["dual", "projected"])
@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
def test_a_matrix_step_does_not_depend_on_its_batch_mates(manifold, spread, solver, monkeypatch, one_thread):
    # Three same-shape matrices of very different gradient scales in one stack, against
    # each alone, both on one thread (no workers). Every map of the step is per matrix (no
    # batch-wide maximum, no shared stopping rule), so the results are bitwise equal.
    shapes = [(24, 8)] * 3
    params, grads = _stepped(manifold, shapes, seed=11)
    grads = [[g * scale for g, scale in zip(gs, (1e-3, 1.0, 1e3))] for gs in grads]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    together = WholeBatchManifoldMuon([{"params": params, "manifold": manifold}], lr=0.05, solver=solver)
    assert [len(b) for b in together._batches(together.param_groups[0], params)] == [3]
    stacks = []
    inner = together._matrix_step
    monkeypatch.setattr(together, "_matrix_step", lambda group, batch, *a: stacks.append(len(batch)) or inner(group, batch, *a))
    _run(together, params, grads)
    for i, p in enumerate(alone):
        _run(ManifoldMuon([{"params": [p], "manifold": manifold}], lr=0.05, solver=solver), [p], [[gs[i]] for gs in grads])
    assert stacks and set(stacks) == {3}  # the three really were stepped as one stack
    for p, q in zip(params, alone):
        assert torch.equal(p.detach(), q.detach())
    # the matrices did move, and differently (a batch-coupled step could not hide here)
    assert not torch.equal(params[0].detach(), params[1].detach())


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=["stiefel", "dgram"])
def test_a_late_first_gradient_does_not_cold_start_its_warm_batch_mates(manifold, one_thread):
    # A same-shape batch-mate whose first gradient comes at step 3: a whole-batch stack had
    # cold-started every matrix of the batch (a warm start needs all of them), so the warm
    # matrix's step depended on its mate. Each part now steps as it would alone, bitwise.
    gen = torch.Generator().manual_seed(12)
    W1, W2 = (manifold.random(16, 8, generator=gen).data for _ in range(2))
    first = [torch.randn(16, 8, generator=gen) for _ in range(3)]
    late = torch.randn(16, 8, generator=gen)

    def run(with_mate, optimizer_class=WholeBatchManifoldMuon):
        p1, p2 = torch.nn.Parameter(W1.clone()), torch.nn.Parameter(W2.clone())
        opt = optimizer_class([{"params": [p1, p2] if with_mate else [p1], "manifold": manifold}], lr=0.05)
        for k, g in enumerate(first):
            p1.grad = g.clone()
            p2.grad = late.clone() if with_mate and k == 2 else None
            opt.step()
        return p1.detach(), p2.detach()

    alone, _ = run(False)
    together, mate = run(True)
    assert torch.equal(alone, together)
    assert torch.equal(mate, run(True, ManifoldMuon)[1])  # the mate's own cold first step, as on the CPU default
    assert not torch.equal(mate, W2)


def test_the_sync_guard_catches_a_read_back(no_host_reads):
    # negative control of the guard itself: each of these is a host read
    x = torch.ones(2)
    for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x.all()), lambda: float(x.sum())):
        with no_host_reads(), pytest.raises(RuntimeError, match="host read"):
            read()


def test_the_sync_guard_holds_until_the_last_overlapping_user_leaves(no_host_reads):
    # ManifoldMuon's worker threads enter and leave the guard in any order: here the first
    # one in leaves first. A guard that saved and restored the methods it found would let
    # reads through while the second is inside, and leave them refused for good after.
    x = torch.ones(2)
    first, second = no_host_reads(), no_host_reads()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    try:
        with pytest.raises(RuntimeError, match="host read"):
            x.sum().item()
    finally:
        second.__exit__(None, None, None)
    assert x.sum().item() == 2.0


@pytest.mark.parametrize("solver", ["dual", "projected"])
@pytest.mark.parametrize("optimizer_class", [ManifoldMuon, WholeBatchManifoldMuon], ids=["cpu-stacks", "whole-batch"])
@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
def test_manifold_muon_batch_work_reads_nothing_back(manifold, spread, optimizer_class, solver, monkeypatch,
                                                     no_host_reads):
    # The per-batch work of every step (momentum, the engine, the retraction, the state
    # writes) runs under the guard, tall and wide, warm-started, with weight decay. The base
    # class's non-finite check before it reads one flag per param group (it names the
    # parameter it skips) and stays outside.
    # (a wide Oblique point takes the general path, whose manifold.retr checks for zero
    # columns, a read-back: the Gram path is what this test holds to no syncs)
    shapes = [(24, 8), (24, 8)] + ([(8, 24)] if manifold.transposes_wide else [])
    params, grads = _stepped(manifold, shapes, seed=12, steps=3)
    optimizer = optimizer_class([{"params": params, "manifold": manifold}], lr=0.05, weight_decay=0.1, solver=solver)
    _run(optimizer, params, grads[:1])  # the first step checks every weight is on its manifold
    inner = optimizer._matrix_step

    def guarded(*args, **kwargs):
        with no_host_reads():
            return inner(*args, **kwargs)

    monkeypatch.setattr(optimizer, "_matrix_step", guarded)
    _run(optimizer, params, grads[1:])
    # the dual solver keeps its warm start; the projected one has none (a wide Oblique point
    # takes the general path, which has one whatever the solver)
    gram_path = [p for p in params if p.shape[0] >= p.shape[1] or manifold.transposes_wide]
    assert all(("dual_correction" in optimizer.state[p]) == (solver == "dual") for p in gram_path)
    assert optimizer.check_on_manifold() == []


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, compute_dtype", [
    # compiling takes ~10 s per case on a 2-core CPU: ManifoldMuon's CPU settings run by default
    pytest.param((2, 24, 8), None, marks=pytest.mark.slow), ((1, 128, 64), torch.bfloat16)],
    ids=["fp32-24x8", "bf16-128x64"])
def test_the_gram_kernel_compiles_and_matches_eager(shape, compute_dtype, threads):
    # ManifoldMuon's settings on the CPU (bf16 basis changes of the closed-form Newton step): at
    # n >= 64 on one thread (the kernel inductor generates depends on the thread count) the
    # compiled step had returned NaN, torch 2.13's vectorized CPU kernel reading the Newton
    # update's bf16 product transposed (the form's adjoint); 24 x 8 in fp32 had passed
    torch.set_num_threads(threads)  # (restored by conftest's _keep_torch_threads)
    gen = torch.Generator().manual_seed(13)
    W = Stiefel().random(*shape, generator=gen).data  # a plain tensor (random gives a ManifoldTensor)
    G = torch.randn(*shape, generator=gen)
    settings = GramSettings(dual_steps=2, update="newton", dualizer="eigh", compute_dtype=compute_dtype,
                            polish_rounds=2, polish_method="alternating", carry=True)

    def step(W, G):
        return gram_step(Stiefel.gram_form, W, G, 0.02, None, settings).point

    # a fresh, static-shape compile: after another parametrization of this test dynamo had reused
    # `step`'s code object and recompiled with dynamic shapes, another kernel, that hid the NaN
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False)(W, G)
    eager = step(W, G)
    # the same float32/bf16 operations in the same order: measured bitwise equal; allow
    # the fp32 round-off of a fused reordering (16 eps of O(1) entries)
    assert torch.allclose(compiled, eager, atol=16 * torch.finfo(torch.float32).eps)
    assert not torch.allclose(compiled, W, atol=1e-4)  # the step moved the point


def test_same_shape_matrices_on_different_manifold_instances_are_batched_apart():
    # Batches are keyed by the manifold's identity (class and constructor arguments), not by
    # geoopt's extra_repr: two LPRO radii must not be stepped with the first one's manifold.
    import geoopt

    from geomuon.manifolds import LPRO

    gen = torch.Generator().manual_seed(17)
    small, large = LPRO(radius=1.0), LPRO(radius=2.0)
    params = [geoopt.ManifoldParameter(m.random(12, 4, generator=gen).data, manifold=m) for m in (small, large)]
    optimizer = ManifoldMuon(params, lr=0.05)
    assert sorted(len(b) for b in optimizer._batches(optimizer.param_groups[0], params)) == [1, 1]
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    assert optimizer.check_on_manifold() == []
    # negative control: equal radii are one manifold, and one batch
    twins = [geoopt.ManifoldParameter(LPRO(radius=1.0).random(12, 4, generator=gen).data, manifold=LPRO(radius=1.0))
             for _ in range(2)]
    optimizer = ManifoldMuon(twins, lr=0.05)
    assert [len(b) for b in optimizer._batches(optimizer.param_groups[0], twins)] == [2]


@pytest.mark.parametrize("manifold,spread", MANIFOLDS, ids=IDS)
def test_a_tensor_learning_rate_is_never_read_back(manifold, spread, no_host_reads):
    # A learning rate scheduled on the device (a 1-element tensor) enters the step as an
    # operand: the whole step() under the read guard, first and warm-started steps, weight
    # decay, tall, wide and square, with an AdamW group (control: the base class's old
    # lr.item() and ManifoldMuon's float(lr) are reads the guard refuses).
    shapes = [(24, 8), (24, 8), (8, 24), (8, 8)]
    eps = torch.finfo(torch.float32).eps
    after_one = {}
    for kind, lr in (("float", 0.05), ("tensor", torch.tensor([0.05])), ("perturbed", 0.05)):
        params, grads = _stepped(manifold, shapes, seed=19)
        if kind == "perturbed":  # every momentum entry moved by 2 eps (relative), random sign
            grads[0] = [g * (1 + 2 * eps * (2 * torch.randint(0, 2, g.shape, generator=torch.Generator().manual_seed(k))
                                           - 1)) for k, g in enumerate(grads[0])]
        vector = torch.nn.Parameter(torch.ones(5))
        optimizer = ManifoldMuon([{"params": params, "manifold": manifold},
                                  {"params": [vector], "update": "adamw", "lr": lr}], lr=lr, weight_decay=0.1)
        with no_host_reads() if kind == "tensor" else contextlib.nullcontext():
            for k, step_grads in enumerate(grads if kind == "tensor" else grads[:1]):
                for p, g in zip([*params, vector], [*step_grads, torch.full((5,), 0.5)]):
                    p.grad = g.clone()
                optimizer.step()
                if k == 0:
                    after_one[kind] = [p.detach().clone() for p in [*params, vector]]
    # One step: the same sums with lr as a product instead of torch.add's and baddbmm's alpha
    # (fused there), so the tangent momentum Z0 = G - cW Sigma0 and Y = W(I - eta T1) - eta Z0 T2
    # differ by about 2 eps of their entries, and the point, Y times a factor near I, by about
    # 3x that: 16 eps of the largest entry, where the direction is well conditioned. The
    # direction amplifies Z0's rounding by its dual solve's conditioning (a square DGram
    # matrix's tangent momentum here has sigma_max / sigma_min = 46: 32 eps measured on an AMD
    # EPYC), so that is measured on the same step: the change of the point when every momentum
    # entry moves by 2 eps, "perturbed"; the paths may differ by 4x that (a few such roundings).
    # (Over steps the warm start carries the difference on and the dualizer's slope bound
    # amplifies it, up to 8e-5 on a square DGram matrix after 3 steps: not compared.)
    for p, q, r in zip(after_one["float"], after_one["tensor"], after_one["perturbed"]):
        assert (p - q).abs().max() <= 16 * eps * p.abs().max() + 4 * (p - r).abs().max()
    assert not torch.allclose(after_one["float"][0], _stepped(manifold, shapes, seed=19)[0][0], atol=1e-3)


@pytest.mark.parametrize("changes, match", [
    (dict(alpha=float("nan")), r"alpha must be a number in \(0, 2\]"),
    (dict(alpha=2.5), r"alpha must be a number in \(0, 2\] \(beyond, the warm-started dual step diverges"),
    (dict(smoothing=float("nan")), "smoothing must be a finite number >= 0"),
    (dict(compute_dtype=torch.int32), "compute_dtype must be a real floating"),
    (dict(compute_dtype=torch.float16), "compute_dtype=torch.float16 cannot hold"),
    (dict(stored_dtype=torch.int8), "stored_dtype must be a real floating"),
    (dict(retraction_terms=10), "retraction_terms must be at most 6"),
    (dict(retraction_terms=-1), "retraction_terms must be a whole number >= 0"),
    (dict(dual_steps=2.5), "dual_steps must be a whole number"),
    (dict(polish_rounds=1.5), "polish_rounds must be a whole number"),
    (dict(carry="no"), "carry must be True or False"),
    (dict(shift_eps=0.0), "shift_eps must be a finite number > 0"),
])
def test_gram_settings_refuse_bad_values_by_name(changes, match):
    # each had been taken: alpha=NaN returned a NaN warm start, smoothing=NaN a zero direction,
    # an int compute dtype lost the warm start to integer products, 10 retraction terms an
    # IndexError at the step, 2.5 dual steps a TypeError inside range()
    with pytest.raises(ValueError, match=f"GramSettings: {match}"):
        GramSettings(**changes)


@pytest.mark.parametrize("step", [gram_step, projected_step], ids=["gram_step", "projected_step"])
def test_gram_steps_refuse_stacks_they_cannot_take_by_name(step):
    # a wide stack had come back with entries of 1e18 (gram_step) or off the manifold
    # (projected_step); 2-D, bf16 and mixed-dtype stacks failed inside torch
    form = Stiefel().gram_form
    W = Stiefel().random(2, 16, 4, dtype=torch.float64)
    G = torch.randn(2, 16, 4, dtype=torch.float64)
    settings = GramSettings(solver="projected") if step is projected_step else GramSettings()
    for bad_W, bad_G, match in ((W.mT, G.mT, "is wide"), (W[0], G[0], "must be stacks"),
                                (W, G[:, :8], "must be stacks"), (W.bfloat16(), G.bfloat16(), "must share"),
                                (W, G.float(), "must share")):
        with pytest.raises(ValueError, match=f"{step.__name__}: .*{match}"):
            step(form, bad_W, bad_G, 0.1, settings=settings) if step is gram_step else step(form, bad_W, bad_G, 0.1,
                                                                                            settings)
    moved = step(form, W, G, 0.1, settings=settings) if step is gram_step else step(form, W, G, 0.1, settings)
    assert (moved.point.mT @ moved.point - torch.eye(4, dtype=torch.float64)).abs().max() <= 1e-12  # control


def test_gram_step_refuses_a_step_length_that_is_no_finite_number():
    # lr=nan (or inf) had returned NaN points; a tensor lr is a schedule on the device, not read
    form = Stiefel().gram_form
    W = Stiefel().random(2, 16, 4, dtype=torch.float64)
    G = torch.randn(2, 16, 4, dtype=torch.float64)
    for lr, shrink, match in ((float("nan"), 1.0, "lr must be a finite number >= 0"),
                              (float("inf"), 1.0, "lr must be a finite number >= 0"),
                              (-0.1, 1.0, "lr must be a finite number >= 0"),
                              (0.1, 0.0, "shrink must be a finite number > 0")):
        with pytest.raises(ValueError, match=f"gram_step: {match}"):
            gram_step(form, W, G, lr, shrink=shrink)
    # controls: a float, an int and a tensor lr step (a tensor is a schedule on the device)
    for lr in (0.1, 0, torch.tensor(0.1, dtype=torch.float64)):
        moved = gram_step(form, W, G, lr)
        assert (moved.point.mT @ moved.point - torch.eye(4, dtype=torch.float64)).abs().max() <= 1e-12


@pytest.mark.parametrize("manifold", [Stiefel(), DGram(), Oblique()], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("solver", ["dual", "projected"])
def test_gram_steps_are_homogeneous_in_the_momentum_across_fp32s_range(manifold, solver, monkeypatch):
    # Both solvers run on G over a power of two of its largest entry, so a momentum scaled by 2^k
    # is the same step bit for bit (a product by a power of two is exact), with the correction and
    # the dual iterate scaled by 2^k. Unscaled, an fp32 momentum of entries 2^-70 (1e-21) had
    # squared to zero in K (Stiefel: no step; DGram: a step along another direction) and one of
    # 2^70 to infinity.
    import geomuon.optimizers.gram as gram

    form = manifold.gram_form
    W = manifold.random(3, 24, 8, generator=torch.Generator().manual_seed(0))
    G = torch.randn(3, 24, 8, generator=torch.Generator().manual_seed(1))
    settings = GramSettings(solver=solver)
    warm = gram_step(form, W, G, 0.1, None, settings).correction

    def step(k: int) -> gram.GramStep:
        return gram_step(form, W, G * 2.0**k, 0.1, None if warm is None else warm * 2.0**k, settings)

    reference = step(0)
    for k in (-70, 70):
        scaled = step(k)
        assert torch.equal(scaled.point, reference.point), k
        assert torch.equal(scaled.direction(W), reference.direction(W)), k
        assert torch.equal(scaled.dual_iterate(W), reference.dual_iterate(W) * 2.0**k), k
        assert warm is None or torch.equal(scaled.correction, reference.correction * 2.0**k), k
    # control: without the scale (unit_scale returning 1) the 2^70 momentum loses its step (the
    # projected solver's norms overflow; the dual's K does, and its eigendecomposition fails)
    monkeypatch.setattr(gram, "unit_scale", lambda X: torch.ones_like(X[..., :1, :1]))
    try:
        lost = not torch.allclose(step(70).point, reference.point, rtol=0, atol=1e-3)
    except torch.linalg.LinAlgError:
        lost = True
    assert lost


def _gram_step_of_a_stack():
    """A stack of two Stiefel points, gradients, and a step of them without a correction:
    ``(form, W, G, first)``."""
    form = Stiefel().gram_form
    W = Stiefel().random(2, 16, 4, dtype=torch.float64)
    G = torch.randn(2, 16, 4, dtype=torch.float64)
    return form, W, G, gram_step(form, W, G, 0.1, None, GramSettings(dual_steps=1))


def test_gram_step_refuses_a_correction_of_another_shape_by_name():
    # a correction for one matrix had broadcast over a stack of two, and one of the wrong size
    # failed inside a product
    form, W, G, first = _gram_step_of_a_stack()
    for shape in ((4, 4), (2, 3, 3)):
        with pytest.raises(ValueError, match=rf"gram_step: correction \({', '.join(map(str, shape))}\) must have "
                                             r"the multiplier's shape \(2, 4, 4\)"):
            gram_step(form, W, G, 0.1, torch.zeros(shape, dtype=torch.float64), GramSettings(dual_steps=1))
    # control: the correction a step returned is taken
    assert first.correction.shape == (2, 4, 4)
    assert gram_step(form, W, G, 0.1, first.correction, GramSettings(dual_steps=1)).point.shape == W.shape


def test_gram_step_checks_its_stacks_once(monkeypatch):
    # a given correction had run _check_points twice (gram_step's, then unchecked_gram_step's)
    import geomuon.optimizers.gram as gram
    calls = []
    original = gram._check_points
    monkeypatch.setattr(gram, "_check_points", lambda *args: calls.append(args[2]) or original(*args))
    form, W, G, first = _gram_step_of_a_stack()
    gram_step(form, W, G, 0.1, first.correction, GramSettings(dual_steps=1))
    assert calls == ["gram_step", "gram_step"]  # one per step, with and without a correction
