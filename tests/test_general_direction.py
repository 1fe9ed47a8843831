r"""The general steepest-descent path, checked against an independent float64 optimum.

For a point $W$, a gradient $G$ and a norm, the steepest tangent direction solves

$$\mathrm{OPT} = \max_A \langle G, A\rangle \ \text{s.t.}\ \|A\| \le 1,\ L_W(A) = 0
= \min_\lambda \|P_WG + L_W^*\lambda\|_\dagger$$

(Lagrangian duality; $\|\cdot\|_\dagger$ the dual norm: the nuclear norm for the spectral
ball, $\sum_i\|x_i\|$ over rows for the row norm, over columns for the column norm). This
module computes OPT on its own: its constraint maps are written here from the manifolds'
definitions (not imported), the dual is smoothed, $\sum\sqrt{s^2 + \mu}$ over singular
values / row / column norms, and minimized by scipy's BFGS with $\mu \to 0$; every smoothed
dual point gives an upper bound and the tangent projection of its gradient, rescaled to the
unit ball, a lower bound. Only a certified gap below :data:`REFERENCE_GAP` is used.

Against it, for Oblique, LPRO (row radius), CenteredRouterSpace, Euclidean and a user's
manifold defined by its constraint alone (the generic projection and retraction), under
the spectral, row, column and hybrid norms, on tall, square and wide matrices:

* :func:`geomuon.optimizers.steepest_direction`'s direction is tangent, in the unit ball,
  at least as good as its own certificate claims (and its dual value at least OPT), exact
  where a closed form exists, and never below its projection start;
* the direction :class:`geomuon.optimizers.ManifoldMuon` takes on its general path, read
  off the weights through the documented retraction, is in the unit ball, at least as good
  as ``certify_every``'s certificate, and leaves the weights on their manifold.

Negative controls (a wrong-sign direction, an untangent one, one outside the ball) fail
the same checks. The hybrid norm's dualizer is a heuristic: its direction is measured
against the spectral ball (``Norm.exact_dualizer``), so OPT is the spectral one there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import scipy.optimize
import torch

from geomuon.manifolds import LPRO, CenteredRouterSpace, Euclidean, MatrixManifold, Oblique
from geomuon.manifolds.base import matrix_method
from geomuon.optimizers import ManifoldMuon, steepest_direction

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)
NORM_NAMES = ("spectral", "row", "column", "hybrid")
SHAPES = ((7, 4), (5, 5), (4, 7))
#: The reference is used only where its certified relative gap (upper - lower) / upper is
#: below this: BFGS on the smoothed dual closes it to 1e-8 or better on these sizes.
REFERENCE_GAP = 1e-6
LPRO_RADIUS = 2.0


class UnitFrobeniusSphere(MatrixManifold):
    r"""A user's manifold as CONTRIBUTING.md describes one: $\{W : \|W\|_F = 1\}$ from its
    constraint $L_W(A) = \langle W, A\rangle$ (multiplier ``[..., 1]``), adjoint and defining
    map alone, so the engine solves $L_WL_W^*$ by conjugate gradients and steps by the generic
    Gauss-Newton retraction."""

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return (x * u).sum((-2, -1)).unsqueeze(-1)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return x * lam[..., None]

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return 0.5 * (x.square().sum((-2, -1)) - 1).unsqueeze(-1)


@dataclass(frozen=True)
class Geometry:
    """A manifold and its tangent constraint written independently of the library.

    ``sphere_axis``: the axis each slice's sphere lives along (0: columns, 1: rows, ``None``:
    the whole matrix), with radius ``radius``; ``None`` for ``affine`` geometries (router,
    Euclidean), whose retraction is $W + V$ up to re-centering. ``closed_forms``: the exact
    norms whose dualizer maps tangent vectors to tangent vectors here, so that
    $\\Phi(P_WG)$ is the optimum (derived below per geometry).
    """

    name: str
    manifold: MatrixManifold
    constraint: Callable[[np.ndarray, np.ndarray], np.ndarray]
    adjoint: Callable[[np.ndarray, np.ndarray], np.ndarray]
    multipliers: Callable[[np.ndarray], int]
    sphere_axis: int | None
    radius: float
    affine: bool
    closed_forms: tuple[str, ...]


GEOMETRIES = {
    # diag(W^T A): column scaling keeps each column orthogonal to its w_j
    "oblique": Geometry("oblique", Oblique(), lambda W, A: (W * A).sum(0), lambda W, lam: W * lam[None, :],
                        lambda W: W.shape[1], 0, 1.0, False, ("column",)),
    # rowdot(W, A): row scaling keeps each row orthogonal to its w_i
    "lpro": Geometry("lpro", LPRO(radius=LPRO_RADIUS), lambda W, A: (W * A).sum(1), lambda W, lam: W * lam[:, None],
                     lambda W: W.shape[0], 1, LPRO_RADIUS, False, ("row",)),
    # 1^T A: column scaling and the polar factor keep 1^T A = 0
    "router": Geometry("router", CenteredRouterSpace(), lambda W, A: A.sum(0),
                       lambda W, lam: np.broadcast_to(lam[None, :], W.shape).copy(),
                       lambda W: W.shape[1], None, 1.0, True, ("spectral", "column")),
    "euclidean": Geometry("euclidean", Euclidean(), lambda W, A: np.zeros(0), lambda W, lam: np.zeros_like(W),
                          lambda W: 0, None, 1.0, True, ("spectral", "row", "column")),
    "custom": Geometry("custom", UnitFrobeniusSphere(), lambda W, A: np.array([(W * A).sum()]),
                       lambda W, lam: W * lam[0], lambda W: 1, None, 1.0, False, ()),
}


# ---------------------------------------------------------------------------- reference
def _slice_axis(norm: str) -> int | None:
    return {"row": 1, "column": 0}.get(norm)


def norm_value(norm: str, A: np.ndarray) -> float:
    r"""$\|A\|$: the spectral norm (also the hybrid direction's ball), the largest row or
    column norm."""
    axis = _slice_axis(norm)
    return float(np.linalg.norm(A, 2)) if axis is None else float(np.linalg.norm(A, axis=axis).max())


def dual_norm(norm: str, X: np.ndarray) -> float:
    axis = _slice_axis(norm)
    if axis is None:
        return float(np.linalg.svd(X, compute_uv=False).sum())
    return float(np.linalg.norm(X, axis=axis).sum())


def exact_dualizer(norm: str, X: np.ndarray) -> np.ndarray:
    r"""$\Phi(X)$ exactly: $UV^\top$ by SVD, or the rows / columns normalized."""
    axis = _slice_axis(norm)
    if axis is None:
        U, _, Vt = np.linalg.svd(X, full_matrices=False)
        return U @ Vt
    return X / np.linalg.norm(X, axis=axis, keepdims=True)


def _smoothed(norm: str, X: np.ndarray, mu: float) -> tuple[float, np.ndarray]:
    r"""$\sum_k\sqrt{s_k^2 + \mu}$ over singular values / row / column norms, and its gradient
    (the smoothed dualizer, inside the unit ball)."""
    axis = _slice_axis(norm)
    if axis is None:
        U, s, Vt = np.linalg.svd(X, full_matrices=False)
        root = np.sqrt(s**2 + mu)
        return float(root.sum()), (U * (s / root)) @ Vt
    root = np.sqrt(np.linalg.norm(X, axis=axis, keepdims=True) ** 2 + mu)
    return float(root.sum()), X / root


def _polar_completions(X: np.ndarray, L: Callable[[np.ndarray], np.ndarray]) -> list[np.ndarray]:
    r"""Candidate maximizers from a dual point $X = U\Sigma V^\top$ whose trailing singular
    values may be zero at the optimum (there the smoothed dualizer leaves the null-space part
    undetermined): for every split into $r$ leading and trailing directions,
    $A = U_1V_1^\top + U_0MV_0^\top$ with $M$ the least-squares solution of $L(A) = 0$. Each is
    then projected and rescaled by the caller, so any $M$ gives a valid lower bound."""
    U, s, Vt = np.linalg.svd(X)
    candidates = []
    for rank in range(1, len(s)):
        U0, V0 = U[:, rank:], Vt[rank:].T
        lead = U[:, :rank] @ Vt[:rank]
        basis = [np.outer(U0[:, i], V0[:, j]) for i in range(U0.shape[1]) for j in range(V0.shape[1])]
        coefficients = np.linalg.lstsq(np.stack([L(B) for B in basis], 1), -L(lead), rcond=None)[0]
        candidates.append(lead + sum(c * B for c, B in zip(coefficients, basis)))
    return candidates


@dataclass(frozen=True)
class Reference:
    lower: float  # <G, A> of a feasible A
    upper: float  # a dual value, >= OPT
    project: Callable[[np.ndarray], np.ndarray]  # P_W, float64
    constraint: Callable[[np.ndarray], np.ndarray]  # L_W

    @property
    def gap(self) -> float:
        return (self.upper - self.lower) / self.upper


def reference(geometry: Geometry, norm: str, W: np.ndarray, G: np.ndarray) -> Reference:
    """The certified optimum of the problem, from the smoothed dual (module docstring)."""
    k = geometry.multipliers(W)
    L = lambda A: geometry.constraint(W, A)  # noqa: E731
    Ls = lambda lam: geometry.adjoint(W, lam)  # noqa: E731
    if k:
        gram = np.stack([L(Ls(e)) for e in np.eye(k)], axis=1)  # L L^*, k x k
        project = lambda X: X - Ls(np.linalg.solve(gram, L(X)))  # noqa: E731
    else:
        project = lambda X: X  # noqa: E731
    base = project(G)
    scale = float(np.linalg.norm(G)) ** 2
    lam, lower, upper = np.zeros(k), -np.inf, np.inf
    for mu in scale * 10.0 ** -np.arange(2.0, 24.0, 2.0):
        if k:
            def objective(l):  # noqa: E741
                value, grad = _smoothed(norm, base + Ls(l), mu)
                return value, L(grad)
            # dense BFGS: k <= 7 multipliers; L-BFGS-B's relative-reduction stop had left gaps of 1e-5
            lam = scipy.optimize.minimize(objective, lam, jac=True, method="BFGS",
                                          options=dict(maxiter=500, gtol=1e-14 * scale**0.5)).x
        X = base + Ls(lam)
        candidates = [project(_smoothed(norm, X, mu)[1])]
        if _slice_axis(norm) is None:
            candidates += [project(A) for A in _polar_completions(X, L)]
        lower = max([lower] + [float((G * A).sum()) / norm_value(norm, A) for A in candidates])
        upper = min(upper, dual_norm(norm, X))
        if upper - lower <= 1e-10 * upper:  # far below every slack the gap enters
            break
    ref = Reference(lower, upper, project, L)
    assert ref.gap <= REFERENCE_GAP, f"reference not certified: gap {ref.gap:.2e} ({geometry.name}, {norm})"
    return ref


# ---------------------------------------------------------------------------- checks
def fraction_slack(W: np.ndarray, G: np.ndarray, A: np.ndarray, ref: Reference) -> float:
    r"""How far a computed fraction $\langle G, A\rangle/\mathrm{OPT}$ may be off.

    The reference's OPT is known to its certified gap. An inner product of $mn$ terms in
    float64 carries at most $mn\,\varepsilon\,\|G\|_F\|A\|_F$ (the standard $\gamma_{mn}$
    bound with Cauchy-Schwarz); four such quantities enter a comparison (our primal, the
    library's primal, its SVD-based dual and norm), hence the factor 4, relative to OPT.
    """
    m, n = W.shape
    return ref.gap + 4 * m * n * EPS64 * float(np.linalg.norm(G) * np.linalg.norm(A)) / ref.lower


def tangency_tolerance(geometry: Geometry, W: np.ndarray, A: np.ndarray) -> np.ndarray:
    r"""Per multiplier, the round-off of a float64 tangent projection and of evaluating $L_W$.

    Each entry of $L_W(A)$ is an inner product of $k$ terms (a column, a row, the whole
    matrix; the router's $\mathbf 1^\top a_j$ is $\langle \mathbf 1, a_j\rangle$), computed
    with error $\le k\varepsilon|\cdot|$ and so $\le k\varepsilon\|w\|\|a\|$ by
    Cauchy-Schwarz; the projection that made $A$ tangent leaves the same again, and the
    final rescaling by the norm multiplies the residual by one rounding. Factor 4.
    """
    if geometry.name == "router":
        slices_w, slices_a = np.full(W.shape[1], W.shape[0] ** 0.5), np.linalg.norm(A, axis=0)
        length = W.shape[0]
    elif geometry.sphere_axis is None:
        slices_w, slices_a = np.array([np.linalg.norm(W)]), np.array([np.linalg.norm(A)])
        length = W.size
    else:
        slices_w = np.linalg.norm(W, axis=geometry.sphere_axis)
        slices_a = np.linalg.norm(A, axis=geometry.sphere_axis)
        length = W.shape[geometry.sphere_axis]
    return 4 * length * EPS64 * slices_w * slices_a


def ball_tolerance(A: np.ndarray) -> float:
    r"""How far above 1 a direction rescaled to the unit ball may measure: the library's
    rescale divides by $\sigma_{\max}$ from the eigenvalues of the small Gram matrix (or by an
    SVD, or row/column norms), whose relative error is at most about $k\varepsilon$ for
    $k = \max(m, n)$ terms per entry, and our SVD adds the same (factor 8 for both and the
    division)."""
    return 8 * max(A.shape) * EPS64


def check_direction(geometry: Geometry, norm: str, W: np.ndarray, G: np.ndarray, A: np.ndarray,
                    ref: Reference, certificate: float | None, slack_ball: float = 0.0,
                    tangency: bool = True) -> float:
    """Assert ``A`` is tangent, in the unit ball and at least as good as ``certificate``
    claims; return its fraction of the optimum."""
    if tangency and geometry.multipliers(W):
        residual = np.abs(ref.constraint(A))
        assert (residual <= tangency_tolerance(geometry, W, A)).all(), f"not tangent: |L_W(A)| = {residual.max():.2e}"
    size = norm_value(norm, A)
    assert size <= 1 + ball_tolerance(A) + slack_ball, f"outside the unit ball: ||A|| = {size!r}"
    fraction = float((G * A).sum()) / ref.lower
    assert fraction > 0, f"not a descent direction: fraction {fraction:.4f}"
    if certificate is not None:
        # the certificate divides the primal by max(1, ||A||) and the dual bounds OPT from above
        assert certificate <= fraction / max(1.0, size) + fraction_slack(W, G, A, ref), (
            f"certificate {certificate:.6f} overstates the fraction {fraction:.6f}")
    return fraction


def _problem(geometry: Geometry, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(shape, generator=generator, dtype=torch.float64)
    W = torch.Tensor(geometry.manifold.projx(raw)).clone()
    if geometry.name == "lpro":
        assert np.allclose(np.linalg.norm(W.numpy(), axis=1), LPRO_RADIUS)
    return W, torch.randn(shape, generator=generator, dtype=torch.float64)


CASES = [(g, n, s) for g in GEOMETRIES for n in NORM_NAMES for s in SHAPES]


def _case_id(case) -> str:
    return f"{case[0]}-{case[1]}-{case[2][0]}x{case[2][1]}"


# ---------------------------------------------------------------------------- engine
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_steepest_direction_is_tangent_in_the_ball_and_certified_against_the_optimum(case):
    name, norm, shape = case
    geometry = GEOMETRIES[name]
    W, G = _problem(geometry, shape, seed=sum(shape) + NORM_NAMES.index(norm))
    ref = reference(geometry, norm, W.numpy(), G.numpy())
    result = steepest_direction(geometry.manifold, W, G, norm)  # ACCURATE: the checks' setting
    A = result.direction.numpy()
    check_direction(geometry, norm, W.numpy(), G.numpy(), A, ref, float(result.ratio))
    # the engine's dual value is an upper bound on OPT >= our feasible lower bound
    assert float(result.dual) >= ref.lower * (1 - fraction_slack(W.numpy(), G.numpy(), A, ref))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_exact_dualizer_reaches_the_closed_form_and_never_ends_below_its_start(case):
    r"""With the exact polar factor, the engine's direction is optimal where $\Phi(P_WG)$ is
    tangent (the geometry's closed forms), and elsewhere at least the projection start
    $P_W\Phi(P_WG)/\|P_W\Phi(P_WG)\|$, which ``track_best`` scores first."""
    name, norm, shape = case
    geometry = GEOMETRIES[name]
    W, G = _problem(geometry, shape, seed=100 + sum(shape) + NORM_NAMES.index(norm))
    Wn, Gn = W.numpy(), G.numpy()
    ref = reference(geometry, norm, Wn, Gn)
    result = steepest_direction(geometry.manifold, W, G, norm, msign_method="svd")
    A = result.direction.numpy()
    fraction = check_direction(geometry, norm, Wn, Gn, A, ref, float(result.ratio))
    slack = fraction_slack(Wn, Gn, A, ref)
    if norm in geometry.closed_forms:
        assert fraction >= 1 - slack
        return
    if norm == "hybrid":  # Phi(X) = msign(row_norm(X))
        base = exact_dualizer("spectral", exact_dualizer("row", ref.project(Gn)))
    else:
        base = exact_dualizer(norm, ref.project(Gn))
    start = ref.project(base)
    start_fraction = float((Gn * start).sum()) / norm_value(norm, start) / ref.lower
    assert fraction >= start_fraction - slack


def test_the_checks_refuse_a_wrong_sign_an_untangent_and_an_oversized_direction():
    geometry = GEOMETRIES["oblique"]
    W, G = _problem(geometry, (7, 4), seed=7)
    Wn, Gn = W.numpy(), G.numpy()
    ref = reference(geometry, "spectral", Wn, Gn)
    result = steepest_direction(geometry.manifold, W, G, "spectral")
    A, certificate = result.direction.numpy(), float(result.ratio)
    check_direction(geometry, "spectral", Wn, Gn, A, ref, certificate)  # the positive case passes
    with pytest.raises(AssertionError, match="descent"):
        check_direction(geometry, "spectral", Wn, Gn, -A, ref, certificate)
    untangent = exact_dualizer("spectral", Gn)  # Muon's direction, ignoring the manifold
    with pytest.raises(AssertionError, match="not tangent"):
        check_direction(geometry, "spectral", Wn, Gn, untangent, ref, None)
    with pytest.raises(AssertionError, match="unit ball"):
        check_direction(geometry, "spectral", Wn, Gn, 1.01 * A, ref, None)
    # a certificate above the achieved fraction is refused
    with pytest.raises(AssertionError, match="overstates"):
        check_direction(geometry, "spectral", Wn, Gn, 0.5 * A, ref, certificate)


# ---------------------------------------------------------------------------- optimizer
LR = 0.05


def direction_taken(geometry: Geometry, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    r"""The $A$ of $W_+ = R_W(-\eta A)$, by inverting the documented retraction.

    Affine geometries: $A = (W - W_+)/\eta$ (the router's re-centering leaves a centered
    step unchanged). Spheres of radius $r$ per slice ($W_+$ rescales each slice of
    $W - \eta A$ to norm $r$, and tangency gives $\|w - \eta a\| = \sqrt{r^2 + \eta^2\|a\|^2}$):
    $\langle w_+, w\rangle = r^3/\|w - \eta a\|$, so $w - \eta a = (r^2/\langle w_+, w\rangle)\,w_+$.
    This recovers the tangent part only: a normal component of the step is removed by the
    retraction and cannot be read off the weights.
    """
    if geometry.affine:
        return (before - after) / LR
    axis = (0, 1) if geometry.sphere_axis is None else geometry.sphere_axis
    scale = geometry.radius**2 / (after * before).sum(axis, keepdims=True)
    return (before - scale * after) / LR


def recovery_slack(before: np.ndarray) -> float:
    r"""Spectral-norm error of :func:`direction_taken`: each entry of $W - cW_+$ carries about
    $4\varepsilon\max|W|$ (the retraction's float64 rounding of $W_+$, the scale, the product,
    the difference), divided by $\eta$; the spectral norm of that error matrix is at most its
    Frobenius norm, $\sqrt{mn}$ times the entry bound."""
    return before.size**0.5 * 4 * EPS64 * float(np.abs(before).max()) / LR


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_manifold_muon_takes_a_certified_direction_and_stays_on_the_manifold(case):
    r"""ManifoldMuon's general path (``retraction="manifold"``: Oblique's spectral norm too),
    float64 weights and dual iterations, no momentum (the step's $G$ is the gradient),
    certificate at every step: the direction read off the weights is in the unit ball and
    at least what the certificate claims; the weights stay on their manifold."""
    name, norm, shape = case
    geometry = GEOMETRIES[name]
    W, _ = _problem(geometry, shape, seed=200 + sum(shape))
    weight = torch.nn.Parameter(W.clone())
    opt = ManifoldMuon([weight], lr=LR, momentum=0.0, manifold=geometry.manifold, norm=norm, retraction="manifold",
                       certify_every=1, compute_dtype=None)
    generator = torch.Generator().manual_seed(300 + sum(shape))
    for _ in range(2):  # the second step is warm-started
        before = weight.detach().numpy().copy()
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        weight.grad = grad.clone()
        opt.step()
        after = weight.detach().numpy().copy()
        ref = reference(geometry, norm, before, grad.numpy())
        A = direction_taken(geometry, before, after)
        (certificate,) = opt.certificates.values()
        # tangency is observable only on affine geometries (the spheres' retraction removes
        # a normal part); there the slack is the recovery's
        check_direction(geometry, norm, before, grad.numpy(), A, ref, certificate, slack_ball=recovery_slack(before),
                        tangency=False)
        if geometry.affine and geometry.multipliers(before):
            # 1^T A sums k = m recovered entries, each within recovery_slack's entry bound
            assert np.abs(ref.constraint(A)).max() <= W.shape[0] * recovery_slack(before)
        assert_on_manifold(geometry, after, EPS64)


def assert_on_manifold(geometry: Geometry, W: np.ndarray, eps: float) -> None:
    r"""Unit / radius-$r$ slices, or a centered router, to the retraction's round-off.

    A slice normalized in a dtype of unit round-off $\varepsilon$ has norm $r(1 + \delta)$ with
    $|\delta| \le (k/2 + 2)\varepsilon$ ($k$ squares summed, a square root, a division) and
    storing adds $\varepsilon/2$: tolerance $(k + 4)\varepsilon r$. A centered column's sum,
    $\sum_i(x_i - \bar x)$, is zero up to $2k\varepsilon\sum_i|x_i|$ for $k$ experts, and
    storing each entry adds $\varepsilon|x_i|/2$ more: tolerance $4k\varepsilon\sum_i|x_i|$.
    """
    if geometry.name == "router":
        sums = np.abs(W.sum(0))
        assert (sums <= 4 * W.shape[0] * eps * np.abs(W).sum(0)).all(), f"router off center: {sums.max():.2e}"
    elif not geometry.affine:
        axis = (0, 1) if geometry.sphere_axis is None else geometry.sphere_axis
        length = W.size if geometry.sphere_axis is None else W.shape[geometry.sphere_axis]
        norms = np.linalg.norm(W, axis=axis)
        error = np.abs(norms - geometry.radius).max()
        assert error <= (length + 4) * eps * geometry.radius, f"{geometry.name} slices off the sphere: {error:.2e}"


@pytest.mark.parametrize("name", ["oblique", "lpro", "router"])
@pytest.mark.parametrize("norm", NORM_NAMES)
def test_float32_weights_stay_on_their_manifold_under_the_default_bf16_dual(name, norm):
    """The default ManifoldMuon (bf16 dual iterations) on float32 weights, several
    momentum steps: Oblique's columns unit, LPRO's rows on their sphere, the router
    centered, to float32's retraction round-off (:func:`assert_on_manifold`)."""
    geometry = GEOMETRIES[name]
    W, _ = _problem(geometry, (7, 5), seed=11)
    weight = torch.nn.Parameter(W.float())
    opt = ManifoldMuon([weight], lr=0.1, manifold=geometry.manifold, norm=norm, retraction="manifold")
    generator = torch.Generator().manual_seed(12)
    for _ in range(4):
        weight.grad = torch.randn(weight.shape, generator=generator)
        opt.step()
    after = weight.detach().double().numpy()
    assert not np.allclose(after, W.numpy(), atol=1e-3)  # it moved
    assert_on_manifold(geometry, after, EPS32)


def test_the_manifold_checks_refuse_a_point_off_it():
    W, _ = _problem(GEOMETRIES["oblique"], (7, 5), seed=13)
    with pytest.raises(AssertionError, match="off the sphere"):
        assert_on_manifold(GEOMETRIES["oblique"], W.numpy() * (1 + 1e-5), EPS32)
    with pytest.raises(AssertionError, match="off the sphere"):
        assert_on_manifold(GEOMETRIES["lpro"], W.numpy(), EPS32)  # unit columns, not rows of radius 2
    with pytest.raises(AssertionError, match="off center"):
        assert_on_manifold(GEOMETRIES["router"], W.numpy() + 1e-4, EPS32)


def test_a_bf16_dual_certifies_a_dual_value_not_below_the_optimum():
    # the dual iterate's normal offset had been formed at a bf16 copy of W, so X - G was not
    # normal at W and ||X||_dual fell 1e-6 below the optimum (a ratio above the true fraction).
    # The optimum of Oblique under the column norm is the sum of the tangent part's column norms;
    # tolerance: float64 rounding of the two column-norm sums, 8 eps relative.
    from geomuon.optimizers.steepest import FAST

    g = torch.Generator().manual_seed(240)
    W = torch.randn(6, 4, generator=g, dtype=torch.float64)
    W = W / W.norm(dim=0)
    G = torch.randn(6, 4, generator=g, dtype=torch.float64)
    optimum = (G - W * (W * G).sum(0)).norm(dim=0).sum()
    result = steepest_direction(Oblique(), W, G, "column", FAST.replace(certify="exact", compute_dtype=torch.bfloat16))
    assert result.dual >= optimum * (1 - 8 * torch.finfo(torch.float64).eps)


def test_the_fast_certificate_of_the_hybrid_norm_never_claims_more_than_the_optimum():
    # "fast" paired X with the hybrid's heuristic map, which is not its dual norm: a ratio of 1.0115
    # against a true 0.941. Control: the true fraction from the reference solve bounds it.
    g = torch.Generator().manual_seed(0)
    W = CenteredRouterSpace().projx(torch.randn(7, 4, generator=g, dtype=torch.float64))
    G = torch.randn(7, 4, generator=g, dtype=torch.float64)
    result = steepest_direction(CenteredRouterSpace(), W, G, "hybrid", certify="fast")
    ref = reference(GEOMETRIES["router"], "hybrid", W.numpy(), G.numpy())
    at_most = float((G * result.direction).sum()) / ref.lower  # the true fraction is <G, A>/OPT, OPT >= lower
    assert float(result.ratio) <= at_most + 1e-9 and at_most < 1.0


def test_a_tolerance_stop_keeps_the_iterate_it_stopped_at():
    # with track_best, a tol stop between scored steps had returned an earlier scored iterate
    # (the start, ratio 0.947) instead of the converged one (1.000)
    g = torch.Generator().manual_seed(1004)
    W = torch.randn(5, 5, generator=g, dtype=torch.float64)
    W = W / W.norm()
    G = torch.randn(5, 5, generator=g, dtype=torch.float64)
    stopped = steepest_direction(UnitFrobeniusSphere(), W, G, "row")
    full = steepest_direction(UnitFrobeniusSphere(), W, G, "row", tol=0.0)
    assert float(stopped.ratio) >= float(full.ratio) - 1e-9
