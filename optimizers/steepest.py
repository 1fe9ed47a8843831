r"""Steepest descent on a matrix manifold under a norm: one engine for every manifold.

Given a point $W$, a direction $G$ (gradient or momentum) and a norm $\|\cdot\|$ with
dualizer $\Phi(X) = \arg\max_{\|A\|\le1}\langle X, A\rangle$, solve

$$A^\star = \arg\max_{A}\ \langle G, A\rangle\quad\text{s.t.}\quad \|A\|\le 1,\ L_W(A) = 0,$$

where $L_W$ is the manifold's tangent constraint (``manifold.constraint``). Lagrangian
duality gives $\max_A \min_\Lambda \langle G + L_W^*(\Lambda), A\rangle$, so for any
multiplier $\Lambda$ the **dual value** $\|G + L_W^*(\Lambda)\|_\dagger$ (the dual norm:
the nuclear norm for the spectral norm) bounds the optimum from above, and any feasible
$\hat A$ gives the **primal value** $\langle G, \hat A\rangle$ from below. Their ratio is a
certified lower bound on the fraction of the optimal descent reached.

The solver is dual (sub)gradient descent on $\Lambda$: $X_k = G + L_W^*(\Lambda_k)$,
$A_k = \Phi(X_k)$, $H_k = L_W(A_k)$ (the gradient of the dual function), and

$$\Lambda_{k+1} = \Lambda_k - \alpha_k\,H_k \oslash \operatorname{diag}(L_WL_W^*),\qquad
\alpha_k = \alpha\,(1 - k/K)\ \text{(or constant)},$$

Jacobi-preconditioned by ``manifold.constraint_gram_diag`` (for DGram this is
$2(d_i^2 + d_j^2)$: without it the step is wrong by the spread of column norms squared).
The default start is the **projection** $\Lambda_0 = -(L_WL_W^*)^{-1}L_W G$, so
$X_0 = P_W G$ and the first iterate is $\Phi(P_W G)$; a warm start adds the previous
correction $\Lambda - \Lambda_0$. The result is made exactly tangent and feasible,
$\hat A = P_W(A)/\|P_W(A)\|$ (the maximizer of a linear function lies on the sphere, so
scaling to norm one never lowers the primal value).

Closed forms need no dual steps: unconstrained manifolds ($\Phi(G)$), the centered
router subspace ($\Phi(\Pi^\perp G)$ for norms whose dualizer keeps columns centered) and
square Stiefel ($\Phi(P_W G)$ is already tangent). The manifold declares them
(``MatrixManifold.dualizer_keeps_tangent``); the engine asks, and returns the projection
iterate with a certificate of 1 up to round-off. Manifolds with a Gram-space form run the
same iteration on $n\times n$ matrices in :mod:`geomuon.optimizers.gram`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from geomuon.manifolds.linalg import msign

from .maps import col_norm, hybrid, row_norm

__all__ = ["Norm", "NORMS", "SOLVER_PRESETS", "SteepestResult", "steepest_direction", "certified_ratio"]


@dataclass(frozen=True)
class Norm:
    r"""A norm for steepest descent: its dualizer, its value and its dual norm.

    * ``dualize(X, settings) -> A``: $\Phi(X)$, ``[..., m, n]``.
    * ``value(A, exact) -> [...]``: $\|A\|$ (``exact=False`` may use a cheap estimate).
    * ``dual(X) -> [...]``: $\|X\|_\dagger = \max_{\|A\|\le1}\langle X,A\rangle$, exact.
    * ``exact_dualizer``: whether $\Phi$ is the true maximizer of that ball (``False`` for
      ``hybrid``, whose certificate is then measured against the spectral ball).
    """

    name: str
    dualize: Callable[[torch.Tensor, "_Settings"], torch.Tensor]
    value: Callable[[torch.Tensor, bool], torch.Tensor]
    dual: Callable[[torch.Tensor], torch.Tensor]
    exact_dualizer: bool = True


@dataclass(frozen=True)
class _Settings:
    msign_method: str
    msign_steps: int | None
    compute_dtype: torch.dtype | None


def _spectral_value(A: torch.Tensor, exact: bool) -> torch.Tensor:
    if exact:
        return torch.linalg.matrix_norm(A, ord=2)
    # sigma_max from the eigenvalues of the small Gram matrix (k x k, k = min(m, n)):
    # as cheap as one Newton-Schulz product, and invariant under O_m x O_n, so the
    # rescaled direction stays equivariant (a power iteration from a fixed start vector
    # is not: the start does not rotate with the problem). Computed in at least float32.
    compute = torch.float64 if A.dtype == torch.float64 else torch.float32
    Ac = A.to(compute)
    gram = Ac.mT @ Ac if A.size(-2) >= A.size(-1) else Ac @ Ac.mT
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt().to(A.dtype)


def _normal_only(tangent: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    r"""Per matrix: $\|P_WG\|_F \le 8\sqrt{\max(m, n)}\,\varepsilon\,\|G\|_F$, i.e. the tangent
    part of ``G`` is at the round-off level of the projection in ``G``'s dtype."""
    eps = torch.finfo(G.dtype).eps
    level = 8.0 * max(G.shape[-2:]) ** 0.5 * eps
    return tangent.norm(dim=(-2, -1)) <= level * G.norm(dim=(-2, -1))


def _nuclear(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(X).sum(dim=-1)


def _msign(X: torch.Tensor, s: _Settings) -> torch.Tensor:
    return msign(X, method=s.msign_method, steps=s.msign_steps, compute_dtype=s.compute_dtype)


def _exact_floor(X: torch.Tensor) -> float:
    # The smallest positive normal number: a zero row/column maps to zero, every other
    # one is normalized exactly (the floor is below any representable norm's round-off).
    return torch.finfo(X.dtype).tiny


NORMS: dict[str, Norm] = {
    "spectral": Norm("spectral", _msign, _spectral_value, _nuclear),
    "row": Norm(
        "row",
        lambda X, s: row_norm(X, eps=_exact_floor(X)),
        lambda A, exact: A.norm(dim=-1).amax(dim=-1),
        lambda X: X.norm(dim=-1).sum(dim=-1),
    ),
    "column": Norm(
        "column",
        lambda X, s: col_norm(X, eps=_exact_floor(X)),
        lambda A, exact: A.norm(dim=-2).amax(dim=-1),
        lambda X: X.norm(dim=-2).sum(dim=-1),
    ),
    "hybrid": Norm(
        "hybrid",
        lambda X, s: hybrid(
            X, alpha=0.0, method=s.msign_method, steps=s.msign_steps, compute_dtype=s.compute_dtype
        ),
        _spectral_value,
        _nuclear,
        exact_dualizer=False,
    ),
}

#: Named solver settings. ``accurate``: the certified-quality setting of the checks
#: (exact certificate, best iterate kept). ``fast``: the shape of what
#: :class:`~geomuon.optimizers.ManifoldMuon` runs per step (one constant-size dual step, to be
#: warm-started, no certificate). ``reference``: the unpreconditioned
#: setting of the reference code ($\Lambda_0 = -\tfrac14 L_W G$, $\alpha = 0.1$, 20 steps),
#: kept to show what the preconditioning buys.
SOLVER_PRESETS: dict[str, dict] = {
    "accurate": dict(steps=100, alpha=0.8, decay=True, tol=1e-10, certify="exact", track_best=True),
    "fast": dict(steps=1, alpha=1.0, decay=False, tol=0.0, certify=None, track_best=False, safeguard=True),
    "reference": dict(
        steps=20, alpha=0.1, decay=True, tol=1e-6, init="reference", precondition=False,
        certify="exact", track_best=False,
    ),
}


@dataclass
class SteepestResult:
    r"""Output of :func:`steepest_direction`.

    Attributes:
        direction: tangent $\hat A$ with $\|\hat A\| = 1$ (0 for a zero $G$), ``[..., m, n]``.
        primal: $\langle G, \hat A\rangle$, ``[...]`` (``None`` when ``certify=None``).
        dual: $\min_k \|G + L^*(\Lambda_k)\|_\dagger$, an upper bound on the optimum.
        ratio: primal / dual, a certified lower bound on the optimality fraction.
        steps: dual steps taken.
        residual: RMS of $L_W(A)$ at the last dual iterate (before the final
            projection), ``[...]``; ``None`` on the fast path (no certificate, ``tol = 0``),
            which skips that product after the last step.
        multiplier: the last $\Lambda$ (``lam_like``); ``None`` on the fast path.
        correction: $\Lambda - \Lambda_0(G)$, what to pass as ``warm_start`` next time
            (``None`` when no dual step was taken and no warm start was given).
    """

    direction: torch.Tensor
    primal: torch.Tensor | None
    dual: torch.Tensor | None
    ratio: torch.Tensor | None
    steps: int
    residual: torch.Tensor | None
    multiplier: torch.Tensor | None
    correction: torch.Tensor | None


def _inner(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    return (X * Y).sum(dim=(-2, -1))


#: ``track_best`` scores every this many iterates (and the last): two SVDs per score.
_TRACK_EVERY = 10


def _per_matrix(values: torch.Tensor, like: torch.Tensor, batch: int) -> torch.Tensor:
    """Reshape per-matrix ``values [...]`` to broadcast against ``like [..., *item]``."""
    return values.reshape(tuple(values.shape) + (1,) * (like.dim() - batch))


def _rms(H: torch.Tensor, batch: int) -> torch.Tensor:
    """RMS over the multiplier dimensions (those after the ``batch`` leading ones)."""
    if H.numel() == 0:
        return H.new_zeros(H.shape[:batch])
    return H.pow(2).mean(dim=tuple(range(batch, H.dim()))).sqrt()


def certified_ratio(G: torch.Tensor, direction: torch.Tensor, iterate: torch.Tensor) -> torch.Tensor:
    r"""The exact spectral-norm certificate of a tangent ``direction``: primal over dual,

    $$\frac{\langle G, \hat A\rangle / \max(1, \|\hat A\|_2)}{\|Z\|_*},$$

    where ``iterate`` $Z = G + L_W^*(\Lambda)$ is any dual iterate (so $\|Z\|_*$ bounds the
    optimum from above). A zero optimum (zero $G$) reports 1. SVD-based, in the inputs'
    dtype; ``[...]``.
    """
    primal = _inner(G, direction) / _spectral_value(direction, True).clamp_min(1.0)
    dual = _nuclear(iterate)
    tiny = torch.finfo(dual.dtype).tiny
    return torch.where(dual > tiny, primal / dual.clamp_min(tiny), torch.ones_like(dual))


def _gram_solve(manifold, W, rhs, gram_diag):
    r"""Solve $L L^* \lambda = r$ for $r$ = ``rhs``: one division when $LL^*$ is diagonal, else the
    manifold's own (conjugate-gradient) solver."""
    if gram_diag is not None:
        return torch.where(gram_diag > 0, rhs / gram_diag, torch.zeros_like(rhs))
    return manifold.gram_solve(W, rhs)


def steepest_direction(
    manifold,
    W: torch.Tensor,
    G: torch.Tensor,
    norm: str | Norm = "spectral",
    *,
    preset: str | None = "accurate",
    steps: int | None = None,
    alpha: float | None = None,
    decay: bool | None = None,
    tol: float | None = None,
    init: str | None = None,
    precondition: bool | None = None,
    warm_start: torch.Tensor | None = None,
    msign_method: str = "polar_express",
    msign_steps: int | None = None,
    compute_dtype: torch.dtype | None = None,
    certify: str | None = "default",
    track_best: bool | None = None,
    exact_norm: bool | None = None,
    safeguard: bool | None = None,
) -> SteepestResult:
    r"""Steepest-descent direction of ``G`` on ``manifold`` at ``W`` under ``norm``.

    Maximizes $\langle G, A\rangle$ over tangent $A$ with $\|A\|\le1$ (see the module
    docstring for the algorithm and the certificate). Descend with $W \leftarrow
    R_W(-\eta\,\hat A)$.

    Args:
        manifold: a matrix manifold with ``constraint``, ``constraint_adjoint``,
            ``constraint_gram_diag`` and ``proju`` (CONTRIBUTING.md).
        W: point ``[..., m, n]`` on the manifold.
        G: direction to align with ``[..., m, n]`` (the *negative* step direction).
        norm: ``"spectral"``, ``"row"``, ``"column"``, ``"hybrid"`` or a :class:`Norm`.
        preset: base settings from :data:`SOLVER_PRESETS` (``accurate``, ``fast``,
            ``reference``, or ``None`` for the explicit arguments only); explicit
            arguments override it.
        steps: maximum dual steps $K$ (0: the projection iterate $\Phi(P_WG)$ alone).
        alpha: dual step size $\alpha$ (in units of the Jacobi-preconditioned step).
        decay: step $\alpha(1 - k/K)$ if true, constant $\alpha$ otherwise.
        tol: stop when RMS$(L_W(A_k))$ < ``tol``.
        init: ``"projection"`` ($\Lambda_0 = -(LL^*)^{-1}L_WG$), ``"reference"``
            ($-\tfrac14 L_WG$) or ``"zero"``.
        precondition: divide the dual gradient by $\operatorname{diag}(L_WL_W^*)$.
        warm_start: correction added to $\Lambda_0$ (a previous result's ``correction``).
        msign_method: the spectral dualizer's ``method`` in :func:`geomuon.manifolds.linalg.msign`.
        msign_steps: its ``steps``.
        compute_dtype: dtype of the dual iterations (e.g. ``torch.bfloat16``); the final
            projection and rescaling run in ``W.dtype``.
        certify: ``"exact"`` (SVD-based dual norm and spectral norm), ``"fast"``
            ($\langle X, \Phi(X)\rangle$ and power iteration: an estimate, exact only
            when $\Phi$ is), or ``None`` (no certificate).
        track_best: score every tenth iterate and the last (primal of its feasible
            direction, dual value) and keep the best direction and the smallest dual
            value (``accurate``); otherwise only the last iterate is scored.
        exact_norm: rescale by the exact norm (SVD for the spectral norm) rather than an
            estimate (default: ``certify == "exact"``). The certified primal always
            divides by $\max(1, \|\hat A\|)$ with the exact norm, so it stays honest.
        safeguard: after each dual step, a matrix whose residual RMS$(L_W(A))$ grew
            returns to its previous iterate and stops (``fast``: constant steps can
            overshoot where the dual is nonsmooth, e.g. for a rank-deficient $G$); costs
            one constraint product for the last iterate.

    Returns:
        :class:`SteepestResult` with tensors of ``W.dtype``.

    Raises:
        ValueError: for mismatched shapes, an unknown norm, preset or init.
    """
    if preset is not None and preset not in SOLVER_PRESETS:
        raise ValueError(f"steepest_direction: unknown preset {preset!r}; choose {list(SOLVER_PRESETS)}")
    settings = dict(SOLVER_PRESETS[preset]) if preset is not None else {}
    explicit = dict(steps=steps, alpha=alpha, decay=decay, tol=tol, init=init,
                    precondition=precondition, track_best=track_best, safeguard=safeguard)
    settings.update({k: v for k, v in explicit.items() if v is not None})
    if certify != "default":
        settings["certify"] = certify
    K = int(settings.get("steps", 20))
    alpha_ = float(settings.get("alpha", 1.0))
    decay_ = bool(settings.get("decay", True))
    tol_ = float(settings.get("tol", 0.0))
    init_ = settings.get("init", "projection")
    precond = bool(settings.get("precondition", True))
    certify_ = settings.get("certify", None)
    best = bool(settings.get("track_best", False))
    exact_size = certify_ == "exact" if exact_norm is None else bool(exact_norm)
    guard = bool(settings.get("safeguard", False))

    nrm = NORMS.get(norm) if isinstance(norm, str) else norm
    if nrm is None:
        raise ValueError(f"steepest_direction: unknown norm {norm!r}; choose one of {list(NORMS)}")
    if W.shape != G.shape:
        raise ValueError(f"steepest_direction: W {tuple(W.shape)} and G {tuple(G.shape)} differ")
    if init_ not in ("projection", "reference", "zero"):
        raise ValueError(f"steepest_direction: unknown init {init_!r}")
    if certify_ not in (None, "fast", "exact"):
        raise ValueError(f"steepest_direction: certify must be None, 'fast' or 'exact', got {certify_!r}")
    if K < 0:
        raise ValueError(f"steepest_direction: steps must be >= 0, got {K}")

    batch = W.dim() - 2
    s = _Settings(msign_method, msign_steps, compute_dtype)
    out_dtype = W.dtype
    Wc = W if compute_dtype is None else W.to(compute_dtype)

    # Iterates X_k = B + L^*(Delta_k) around a base B formed in W's dtype: near a
    # constrained optimum G is mostly normal, and forming G + L^*(Lambda) in bf16 would
    # cancel its small tangent part away. Only the correction Delta goes through the
    # compute dtype.
    if init_ == "projection":
        B, lam0 = manifold.proju(W, G), None
    else:
        LG = manifold.constraint(W, G)
        lam0 = -0.25 * LG if init_ == "reference" else torch.zeros_like(LG)
        B = G + manifold.constraint_adjoint(W, lam0)
    gram = manifold.constraint_gram_diag(W) if precond else None
    keeps_tangent = getattr(manifold, "dualizer_keeps_tangent", None)
    if init_ == "projection" and warm_start is None and keeps_tangent is not None and keeps_tangent(W, nrm.name):
        K = 0
    diagnose = certify_ is not None or tol_ > 0

    def dual_value(X, A):
        if certify_ == "exact":
            return nrm.dual(X)
        return _inner(X, A.to(out_dtype))

    def feasible(A):
        At = manifold.proju(W, A.to(out_dtype))
        size = nrm.value(At, exact_size)
        size = size.reshape(*size.shape, 1, 1)
        return torch.where(size > 0, At / size.clamp_min(torch.finfo(out_dtype).tiny), torch.zeros_like(At))

    def primal_value(direction):
        value = _inner(G, direction)
        if certify_ == "exact" and not exact_size:
            value = value / nrm.value(direction, True).clamp_min(1.0)
        return value

    delta = None if warm_start is None else warm_start.to(out_dtype)
    best_dir = best_primal = best_dual = None
    taken = 0
    residual = previous = frozen = None
    for k in range(K + 1):
        X = B if delta is None else B + manifold.constraint_adjoint(Wc, delta.to(Wc.dtype)).to(out_dtype)
        A = nrm.dualize(X if compute_dtype is None else X.to(compute_dtype), s)
        if k == K and not diagnose and previous is None:
            break
        H = manifold.constraint(Wc, A.to(Wc.dtype)).to(out_dtype)
        if H.shape[-1] == 0:  # unconstrained: Phi(G) is the answer
            break
        residual = _rms(H, batch)
        if previous is not None:
            # safeguard: a matrix whose residual grew goes back to its previous iterate
            # and takes no further step (a rank-deficient G makes the dual nonsmooth,
            # where a constant step can overshoot).
            # (per matrix on the device: no read-back of a batch-wide flag)
            worse = residual > previous[3]
            frozen = worse if frozen is None else frozen | worse
            A, X, delta, residual = (
                torch.where(_per_matrix(worse, new, batch), old, new)
                for old, new in zip(previous, (A, X, delta, residual))
            )
        if best and certify_ is not None and (k % _TRACK_EVERY == 0 or k == K):
            cand = feasible(A)
            p, d = primal_value(cand), dual_value(X, A)
            if best_dir is None:
                best_dir, best_primal, best_dual = cand, p, d
            else:
                better = p > best_primal
                best_dir = torch.where(better.reshape(*better.shape, 1, 1), cand, best_dir)
                best_primal = torch.maximum(best_primal, p)
                best_dual = torch.minimum(best_dual, d)
        # the tolerance test reads back one flag, so only a solve that asks for it pays it
        if k == K or (tol_ > 0 and bool((residual < tol_).all())):
            break
        rate = alpha_ * (1.0 - k / K) if decay_ else alpha_
        if precond:
            # H = L(Phi(X)) is scale-free while the multiplier scales with G: a change
            # delta of Lambda moves Phi(X) by about L^*(delta)/sigma, so the Newton-like
            # step carries sigma = <X, Phi X>/<Phi X, Phi X>, X's typical singular value
            # (row/column norm for those norms).
            Ac = A.to(out_dtype)
            sigma = _inner(X, Ac) / _inner(Ac, Ac).clamp_min(torch.finfo(out_dtype).tiny)
            rate = rate * _per_matrix(sigma, H, batch)
        step = -rate * (_gram_solve(manifold, W, H, gram) if precond else H)
        if frozen is not None:
            step = torch.where(_per_matrix(frozen, step, batch), 0, step)
        if guard:
            previous = (A, X, torch.zeros_like(step) if delta is None else delta, residual)
        delta = step if delta is None else delta + step
        taken += 1

    if best_dir is not None:
        direction, primal, dual = best_dir, best_primal, best_dual
    else:
        direction = feasible(A)
        primal = primal_value(direction) if certify_ is not None else None
        dual = dual_value(X, A) if certify_ is not None else None
    if init_ == "projection":
        # A gradient normal to the manifold up to round-off has no meaningful tangent
        # part: dualizing the round-off would take a unit step in a noise direction (and
        # break equivariance). Such matrices get the zero direction instead.
        normal = _per_matrix(_normal_only(B, G), direction, batch)
        direction = torch.where(normal, torch.zeros_like(direction), direction)
    ratio = None
    if primal is not None:
        tiny = torch.finfo(out_dtype).tiny
        # A zero G has optimum 0, reached: report 1 rather than 0/0.
        ratio = torch.where(dual > tiny, primal / dual.clamp_min(tiny), torch.ones_like(dual))
    multiplier = None
    if diagnose:
        if lam0 is None:
            lam0 = -_gram_solve(manifold, W, manifold.constraint(W, G), manifold.constraint_gram_diag(W))
        multiplier = lam0 if delta is None else lam0 + delta
    return SteepestResult(
        direction=direction.to(out_dtype),
        primal=primal,
        dual=dual,
        ratio=ratio,
        steps=taken,
        residual=residual,
        multiplier=multiplier,
        correction=delta,
    )
