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

$$\Lambda_{k+1} = \Lambda_k - \alpha_k\,\sigma_k\,H_k \oslash \operatorname{diag}(L_WL_W^*),\qquad
\alpha_k = \alpha\,(1 - k/K)\ \text{(or constant)},$$

$\sigma_k = \langle X_k, \Phi X_k\rangle/\langle \Phi X_k, \Phi X_k\rangle$ ($X_k$'s typical singular value:
$H_k$ is scale-free while $\Lambda$ scales with $G$, so $\alpha$ is dimensionless),

Jacobi-preconditioned by ``manifold.constraint_gram_diag`` (for DGram this is
$2(d_i^2 + d_j^2)$: without it the step is wrong by the spread of column norms squared).
The default start is the **projection** $\Lambda_0 = -(L_WL_W^*)^{-1}L_W G$, so
$X_0 = P_W G$ and the first iterate is $\Phi(P_W G)$; a warm start adds the previous
correction $\Lambda - \Lambda_0$. The result is made exactly tangent and feasible,
$\hat A = P_W(A)/\|P_W(A)\|$ (where $\|P_W(A)\| < 1$ the scaling raises a positive primal
value, the maximizer of a linear function lying on the sphere; where the projection leaves
the ball it lowers it: the price of feasibility).

Closed forms need no dual steps: unconstrained manifolds ($\Phi(G)$), the centered
router subspace ($\Phi(\Pi^\perp G)$ for norms whose dualizer keeps columns centered) and
square Stiefel ($\Phi(P_W G)$ is already tangent). The manifold declares them
(``MatrixManifold.dualizer_keeps_tangent``); the engine asks, and returns the projection
iterate with a certificate of 1 up to round-off. Manifolds with a Gram-space form run the
same iteration on $n\times n$ matrices in :mod:`geomuon.optimizers.gram`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from geomuon.manifolds.linalg import (MSIGN_METHODS, check_compute_dtype, check_count, check_real, check_shape_of,
                                     largest_entry, msign, per_matrix, unit_scale)

from .maps import col_norm, hybrid, row_norm

__all__ = [
    "Norm", "NORMS", "SolverSettings", "ACCURATE", "FAST", "REFERENCE", "SOLVER_PRESETS", "SteepestResult",
    "steepest_direction", "unchecked_steepest_direction", "certified_ratio",
]


@dataclass(frozen=True)
class Norm:
    r"""A norm for steepest descent: its dualizer, its value and its dual norm.

    * ``dualize(X, settings) -> A``: $\Phi(X)$, ``[..., m, n]``.
    * ``value(A, exact) -> [...]``: $\|A\|$ (``exact=False`` may use a cheap estimate).
    * ``dual(X) -> [...]``: $\|X\|_\dagger = \max_{\|A\|\le1}\langle X,A\rangle$, exact.
    * ``exact_dualizer``: whether $\Phi$ is the true maximizer of that ball (``False`` for
      ``hybrid``, whose certificate is then measured against the spectral ball).
    * ``polar_factor``: whether ``dualize`` runs the polar-factor kernel chosen by
      ``settings.msign_method`` / ``msign_steps`` (options that mean nothing to the others).
    """

    name: str
    dualize: Callable[[torch.Tensor, "SolverSettings"], torch.Tensor]
    value: Callable[[torch.Tensor, bool], torch.Tensor]
    dual: Callable[[torch.Tensor], torch.Tensor]
    exact_dualizer: bool = True
    polar_factor: bool = False


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
    part of ``G`` is at the round-off level of the projection in ``G``'s dtype. Both norms of the
    matrices over ``G``'s largest entry, whose squares neither underflow nor overflow (an fp32
    ``G`` of entries $10^{-25}$ or $10^{21}$ had compared $0 \le 0$ or $\infty \le \infty$ and lost its
    direction, certified optimal)."""
    eps = torch.finfo(G.dtype).eps
    level = 8.0 * max(G.shape[-2:]) ** 0.5 * eps
    scale = largest_entry(G)
    return (tangent / scale).norm(dim=(-2, -1)) <= level * (G / scale).norm(dim=(-2, -1))


def _nuclear(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(X).sum(dim=-1)


def _msign(X: torch.Tensor, s: "SolverSettings") -> torch.Tensor:
    return msign(X, method=s.msign_method, steps=s.msign_steps, compute_dtype=s.compute_dtype)


def _exact_floor(X: torch.Tensor) -> float:
    # The smallest positive normal number: a zero row/column maps to zero, every other
    # one is normalized exactly (the floor is below any representable norm's round-off).
    return torch.finfo(X.dtype).tiny


NORMS: dict[str, Norm] = {
    "spectral": Norm("spectral", _msign, _spectral_value, _nuclear, polar_factor=True),
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
        lambda X, s: hybrid(  # the exact floor: ROW_EPS = 1e-8 had moved the direction at G * 1e-5
            X, alpha=0.0, eps=_exact_floor(X), method=s.msign_method, steps=s.msign_steps,
            compute_dtype=s.compute_dtype,
        ),
        _spectral_value,
        _nuclear,
        exact_dualizer=False,
        polar_factor=True,
    ),
}

@dataclass(frozen=True)
class SolverSettings:
    r"""Settings of :func:`steepest_direction` (the defaults are :data:`ACCURATE`).

    Attributes:
        steps: maximum dual steps $K$ (0: the projection iterate $\Phi(P_WG)$ alone).
        alpha: dual step size $\alpha$ (in units of the Jacobi-preconditioned step
            $\sigma_k H_k \oslash \operatorname{diag}(L_WL_W^*)$; dimensionless). Not bounded here:
            with ``safeguard`` a step that lowers the dual is reverted, and with ``decay`` it
            shrinks; without either, a constant step above 2 diverges over warm-started calls
            as the Gram path's does (measured: Stiefel's correction at 5e13 after 50 calls at 3),
            which :data:`~geomuon.manifolds.capabilities.MAX_DUAL_ALPHA` bounds there.
        decay: step $\alpha(1 - k/K)$ if true, constant $\alpha$ otherwise.
        tol: a matrix whose RMS$(L_W(A_k))$ < ``tol`` takes no further step, and the solve
            stops when every matrix of the batch has (0: never; a positive ``tol`` reads one
            flag back per step). A matrix's result is thus the one it gets alone.
        init: ``"projection"`` ($\Lambda_0 = -(LL^*)^{-1}L_WG$), ``"reference"``
            ($-\tfrac14 L_WG$) or ``"zero"``.
        precondition: divide the dual gradient by $\operatorname{diag}(L_WL_W^*)$.
        certify: ``"exact"`` (SVD-based dual norm and spectral norm), ``"fast"``
            ($\langle X, \Phi(X)\rangle$: an estimate, exact only when $\Phi$ is), or
            ``None`` (no certificate).
        track_best: score every tenth iterate and the last and keep the best direction
            and the smallest dual value; otherwise only the last iterate is scored.
        exact_norm: rescale by the exact norm (SVD for the spectral norm) rather than
            $\sigma_{\max}$ from the small Gram matrix (``None``: ``certify == "exact"``). The
            certified primal always divides by $\max(1, \|\hat A\|)$ with the exact norm.
        safeguard: after each dual step, a matrix whose residual RMS$(L_W(A))$ grew returns
            to its previous iterate and stops (constant steps can overshoot where the dual
            is nonsmooth, e.g. for a rank-deficient $G$).
        msign_method, msign_steps: the spectral dualizer, a method of
            :func:`geomuon.manifolds.linalg.msign` and its iterations.
        compute_dtype: dtype of the dual iterations (e.g. ``torch.bfloat16``); the base
            iterate, the final projection and the rescaling run in ``W.dtype``.
    """

    steps: int = 100
    alpha: float = 0.8
    decay: bool = True
    tol: float = 1e-10
    init: str = "projection"
    precondition: bool = True
    certify: str | None = "exact"
    track_best: bool = True
    exact_norm: bool | None = None
    safeguard: bool = False
    msign_method: str = "polar_express"
    msign_steps: int | None = None
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # every field checked here, not at the step: 2.5 steps had failed inside range(), a
        # negative alpha ascended the dual, NaN reached an SVD
        if self.init not in ("projection", "reference", "zero"):
            raise ValueError(f"SolverSettings: unknown init {self.init!r}; choose 'projection', 'reference' or 'zero'")
        if self.certify not in (None, "fast", "exact"):
            raise ValueError(f"SolverSettings: certify must be None, 'fast' or 'exact', got {self.certify!r}")
        check_count("SolverSettings", "steps", self.steps)
        check_real("SolverSettings", "alpha", self.alpha, lambda x: x > 0, "a finite number > 0")
        check_real("SolverSettings", "tol", self.tol, lambda x: x >= 0, "a finite number >= 0")
        for flag in ("decay", "precondition", "track_best", "safeguard"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"SolverSettings: {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.exact_norm is not None and not isinstance(self.exact_norm, bool):
            raise ValueError(f"SolverSettings: exact_norm must be True, False or None, got {self.exact_norm!r}")
        if self.msign_method not in MSIGN_METHODS:
            raise ValueError(f"SolverSettings: msign_method must be one of {MSIGN_METHODS}, got {self.msign_method!r}")
        if self.msign_steps is not None:
            check_count("SolverSettings", "msign_steps", self.msign_steps, 1)
        check_compute_dtype("SolverSettings", "compute_dtype", self.compute_dtype, float16=False)

    @property
    def rescale_exactly(self) -> bool:
        """Whether the direction is rescaled by its exact norm (see ``exact_norm``)."""
        return self.certify == "exact" if self.exact_norm is None else bool(self.exact_norm)

    def replace(self, **changes) -> "SolverSettings":
        """A copy with ``changes`` (field: value), validated."""
        return dataclasses.replace(self, **changes)


#: The certified-quality setting of the checks: exact certificate, best iterate kept.
ACCURATE = SolverSettings()
#: What :class:`~geomuon.optimizers.ManifoldMuon`'s general path runs per step: one constant
#: dual step, to be warm-started, safeguarded, the cheap rescaling, no certificate.
FAST = SolverSettings(steps=1, alpha=1.0, decay=False, tol=0.0, certify=None, track_best=False,
                      exact_norm=False, safeguard=True)
#: The unpreconditioned setting of the reference code ($\Lambda_0 = -\tfrac14 L_W G$,
#: $\alpha = 0.1$, 20 steps), kept to show what the preconditioning buys.
REFERENCE = SolverSettings(steps=20, alpha=0.1, tol=1e-6, init="reference", precondition=False,
                           track_best=False)
SOLVER_PRESETS: dict[str, SolverSettings] = {"accurate": ACCURATE, "fast": FAST, "reference": REFERENCE}


@dataclass
class SteepestResult:
    r"""Output of :func:`steepest_direction`.

    Attributes:
        direction: tangent $\hat A$ with $\|\hat A\| = 1$ (0 for a zero $G$), ``[..., m, n]``.
        primal: $\langle G, \hat A\rangle$, ``[...]`` (``None`` when ``certify=None``).
        dual: $\min_k \|G + L^*(\Lambda_k)\|_\dagger$ over the scored iterates $k$ (every
            tenth and the last with ``track_best``; the last alone without),
            an upper bound on the optimum.
        ratio: primal / dual, a certified lower bound on the optimality fraction.
        steps: dual steps run on the batch (a matrix the ``safeguard`` or ``tol`` stopped took
            fewer: its later steps are zero, which the count cannot show without a read-back).
        residual: RMS of $L_W(A)$ at the last dual iterate (before the final
            projection), ``[...]``; ``None`` when nothing asked for it (no certificate,
            ``tol = 0``, no safeguard), which skips that product after the last step.
        multiplier: the last $\Lambda$ (``lam_like``); ``None`` likewise.
        correction: $\Lambda - \Lambda_0(G)$, what to pass as ``warm_start`` next time
            (``None`` when no dual step was taken and no warm start was used).
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


def _rms(H: torch.Tensor, batch: int) -> torch.Tensor:
    """RMS over the multiplier dimensions (those after the ``batch`` leading ones)."""
    if H.numel() == 0:
        return H.new_zeros(H.shape[:batch])
    return H.pow(2).mean(dim=tuple(range(batch, H.dim()))).sqrt()


def _ratio(primal: torch.Tensor, dual: torch.Tensor) -> torch.Tensor:
    """primal / dual; a zero optimum (zero $G$) is reached, so it reports 1, not 0/0; a NaN dual
    reports NaN (it had reported 1)."""
    tiny = torch.finfo(dual.dtype).tiny
    return torch.where(dual <= tiny, torch.ones_like(dual), primal / dual.clamp_min(tiny))


def certified_ratio(G: torch.Tensor, direction: torch.Tensor, *iterates: torch.Tensor) -> torch.Tensor:
    r"""The exact spectral-norm certificate of a tangent ``direction``: primal over dual,

    $$\frac{\langle G, \hat A\rangle / \max(1, \|\hat A\|_2)}{\min_k \|Z_k\|_*},$$

    where each of ``iterates`` $Z_k = G + L_W^*(\Lambda_k)$ is a dual iterate (so each
    $\|Z_k\|_*$ bounds the optimum from above, and the smallest is the tightest). A zero
    optimum (zero $G$) reports 1. SVD-based, in the inputs' dtype; ``[...]``.

    Raises:
        ValueError: no iterate, or a ``direction`` or iterate of another shape than ``G`` (one of
            another shape had broadcast into a "ratio" of 8.5).
    """
    if not iterates:
        raise ValueError("certified_ratio: give at least one dual iterate Z_k = G + L_W^*(Lambda_k) (the bound on "
                         "the optimum)")
    for what, X in (("direction", direction), *((f"iterate {k}", Z) for k, Z in enumerate(iterates))):
        if X.shape != G.shape:
            raise ValueError(f"certified_ratio: {what} has shape {tuple(X.shape)}, G {tuple(G.shape)}; pass the "
                             "direction and the dual iterates of this G")
    primal = _inner(G, direction) / _spectral_value(direction, True).clamp_min(1.0)
    return _ratio(primal, torch.stack([_nuclear(Z) for Z in iterates]).amin(0))


def certificate(G: torch.Tensor, direction: torch.Tensor, X: torch.Tensor, A: torch.Tensor, norm: Norm,
                settings: SolverSettings) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(primal, dual)`` of a feasible ``direction`` and the dual iterate ``X`` (its
    dualization ``A``), ``[...]`` each, in ``G.dtype``:

    * primal $\langle G, \hat A\rangle$, divided by $\max(1, \|\hat A\|)$ (exact norm) when
      the direction was rescaled by an estimate, so it never overstates;
    * dual $\|X\|_\dagger$ (``certify="exact"``), an upper bound on the optimum by weak
      duality, or the estimate $\langle X, \Phi(X)\rangle$ (``"fast"``), which is that norm
      only where $\Phi$ is the exact dualizer: a norm whose $\Phi$ is a heuristic (hybrid)
      takes $\|X\|_\dagger$ either way (its pairing had certified ratios above 1).
    """
    primal = _inner(G, direction)
    if settings.certify == "exact" and not settings.rescale_exactly:
        primal = primal / norm.value(direction, True).clamp_min(1.0)
    exact_dual = settings.certify == "exact" or not norm.exact_dualizer
    dual = norm.dual(X) if exact_dual else _inner(X, A.to(G.dtype))
    return primal, dual


def _gram_solve(manifold, W, rhs, gram_diag):
    r"""Solve $L L^* \lambda = r$ for $r$ = ``rhs``: one division when $LL^*$ is diagonal, else the
    manifold's own (conjugate-gradient) solver."""
    if gram_diag is not None:
        return torch.where(gram_diag > 0, rhs / gram_diag, torch.zeros_like(rhs))
    return manifold.gram_solve(W, rhs)


def _start(manifold, W: torch.Tensor, G: torch.Tensor, init: str):
    r"""The base iterate $B = G + L_W^*(\Lambda_0)$ in ``W``'s dtype and $\Lambda_0$ (``None``
    for the projection start, whose $B = P_WG$ comes from ``proju`` directly)."""
    if init == "projection":
        return manifold.proju(W, G), None
    LG = manifold.constraint(W, G)
    lam0 = -0.25 * LG if init == "reference" else torch.zeros_like(LG)
    return G + manifold.constraint_adjoint(W, lam0), lam0


def _feasible(manifold, W: torch.Tensor, A: torch.Tensor, norm: Norm, exact: bool) -> torch.Tensor:
    r"""$\hat A = P_W(A)/\|P_W(A)\|$ in ``W.dtype`` (0 where $P_W(A) = 0$): tangent, unit norm."""
    At = manifold.proju(W, A.to(W.dtype))
    size = norm.value(At, exact)
    size = size.reshape(*size.shape, 1, 1)
    return torch.where(size > 0, At / size.clamp_min(torch.finfo(W.dtype).tiny), torch.zeros_like(At))


def _jacobi_step(manifold, W, X, A, H, gram, rate: float, batch: int) -> torch.Tensor:
    r"""The Jacobi-preconditioned dual step $-\alpha_k\,\sigma\,H \oslash \operatorname{diag}(LL^*)$.

    $H = L(\Phi(X))$ is scale-free while the multiplier scales with $G$: a change $\delta$
    of $\Lambda$ moves $\Phi(X)$ by about $L^*(\delta)/\sigma$, so the Newton-like step carries
    $\sigma = \langle X, \Phi X\rangle/\langle \Phi X, \Phi X\rangle$, $X$'s typical singular
    value (row/column norm for those norms).
    """
    A = A.to(X.dtype)
    sigma = _inner(X, A) / _inner(A, A).clamp_min(torch.finfo(X.dtype).tiny)
    return -(rate * per_matrix(sigma, H, batch)) * _gram_solve(manifold, W, H, gram)


def _plain_step(H: torch.Tensor, rate: float | torch.Tensor) -> torch.Tensor:
    r"""The unpreconditioned dual (sub)gradient step $-\alpha_k H$ (the reference code's): not
    homogeneous in $G$ ($H$ is scale-free), so a solve on $G/s$ passes $\alpha_k/s$."""
    return -rate * H


class _BestIterate:
    """``track_best``: the best feasible direction and the smallest dual value scored so far."""

    def __init__(self) -> None:
        self.direction = self.primal = self.dual = None

    def score(self, direction: torch.Tensor, primal: torch.Tensor, dual: torch.Tensor) -> None:
        if self.direction is None:
            self.direction, self.primal, self.dual = direction, primal, dual
            return
        better = (primal > self.primal).reshape(*primal.shape, 1, 1)
        self.direction = torch.where(better, direction, self.direction)
        self.primal = torch.maximum(self.primal, primal)
        self.dual = torch.minimum(self.dual, dual)


def _settings(settings: SolverSettings | str, changes: dict) -> SolverSettings:
    if not isinstance(settings, (str, SolverSettings)):
        raise TypeError(f"steepest_direction: settings must be a SolverSettings or the name of one of "
                        f"{list(SOLVER_PRESETS)}, got {type(settings).__name__}")
    if isinstance(settings, str):
        if settings not in SOLVER_PRESETS:
            raise ValueError(f"steepest_direction: unknown preset {settings!r}; choose {list(SOLVER_PRESETS)}")
        settings = SOLVER_PRESETS[settings]
    unknown = set(changes) - {f.name for f in dataclasses.fields(SolverSettings)}
    if unknown:
        raise TypeError(f"steepest_direction: unknown solver setting(s) {sorted(unknown)}; the fields of "
                        f"SolverSettings are {[f.name for f in dataclasses.fields(SolverSettings)]}")
    return settings.replace(**changes) if changes else settings


def steepest_direction(
    manifold,
    W: torch.Tensor,
    G: torch.Tensor,
    norm: str | Norm = "spectral",
    settings: SolverSettings | str = ACCURATE,
    *,
    warm_start: torch.Tensor | None = None,
    **changes,
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
        settings: a :class:`SolverSettings` or the name of one in :data:`SOLVER_PRESETS`.
        warm_start: correction added to $\Lambda_0$ (a previous result's ``correction``);
            ignored at a closed form, whose dual gradient is round-off (accumulated in a
            warm start, it would move the next direction by about
            $\text{round-off}/\sigma_{\min}(P_WG)$).
        **changes: fields of :class:`SolverSettings` that replace those of ``settings``
            (``steepest_direction(m, W, G, steps=30)``).

    Returns:
        :class:`SteepestResult` with tensors of ``W.dtype``.

    Raises:
        ValueError: for mismatched shapes, non-finite ``W`` or ``G``, an unknown norm, preset, init or
            certify.
        TypeError: for a keyword that is not a field of :class:`SolverSettings`.
    """
    nrm, s = _inputs(W, G, norm, settings, changes)
    for name, X in (("W", W), ("G", G)):  # a host read: the optimizers call unchecked_steepest_direction
        if not bool(torch.isfinite(X).all()):
            # (a NaN in G had returned a zero direction certified optimal, ratio 1, or an SVD error)
            raise ValueError(f"steepest_direction: {name} has non-finite entries; pass finite values (an "
                             "optimizer skips a non-finite gradient before its step)")
    if warm_start is not None:
        # a warm start of another shape had broadcast an [8, 4] direction to [2, 2, 2, 2, 8, 4] or
        # failed inside a product: that of manifold.constraint(W, G), a previous result's correction
        check_shape_of("steepest_direction", "warm_start", warm_start, manifold.constraint, W, G)
    return _solve(manifold, W, G, nrm, s, warm_start)


def unchecked_steepest_direction(manifold, W: torch.Tensor, G: torch.Tensor, norm: str | Norm = "spectral",
                                 settings: SolverSettings | str = ACCURATE, *,
                                 warm_start: torch.Tensor | None = None, **changes) -> SteepestResult:
    r""":func:`steepest_direction` without the check of ``warm_start``'s shape, for a caller whose
    warm start is the ``correction`` a previous call returned for the same stack (ManifoldMuon's
    warm starts; a loaded one is checked at :meth:`~geomuon.optimizers.ManifoldMuon.load_state_dict`):
    the check builds the constraint on meta tensors, 0.3-0.4 ms per call on one CPU thread against
    77 ms for a 1536x384 row-norm call on Stiefel with one dual step (ManifoldMuon's per-step call)
    and 1.5 ms for a 256x64 one."""
    return _solve(manifold, W, G, *_inputs(W, G, norm, settings, changes), warm_start)


def _inputs(W: torch.Tensor, G: torch.Tensor, norm: str | Norm, settings: SolverSettings | str,
            changes: dict) -> tuple[Norm, SolverSettings]:
    """The :class:`Norm` and :class:`SolverSettings` of a :func:`steepest_direction` call, once its
    ``norm``, ``settings``, ``changes`` and points are checked (the errors it documents)."""
    s = _settings(settings, changes)
    nrm = NORMS.get(norm) if isinstance(norm, str) else norm
    if not isinstance(nrm, Norm):
        raise ValueError(f"steepest_direction: unknown norm {norm!r}; choose one of {list(NORMS)} or pass a Norm")
    if W.shape != G.shape:
        raise ValueError(f"steepest_direction: W {tuple(W.shape)} and G {tuple(G.shape)} differ")
    if W.dtype != G.dtype or W.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"steepest_direction: W ({W.dtype}) and G ({G.dtype}) must share float32 or float64 (the "
                         "base iterate, the projection and the certificate run in it; compute_dtype sets the "
                         "dual iterations')")
    return nrm, s


def _solve(manifold, W: torch.Tensor, G: torch.Tensor, nrm: Norm, s: SolverSettings,
           warm_start: torch.Tensor | None) -> SteepestResult:
    r"""The body of :func:`steepest_direction`, its inputs checked (``warm_start``'s shape by the caller),
    run on $G/s$ (:func:`~geomuon.manifolds.linalg.unit_scale`): the steepest direction of $G$ is
    that of $G/s$, and its primal and dual values, multiplier and correction are homogeneous of
    degree one in $G$, so they are scaled back by $s$; the one step that is not homogeneous, the
    unpreconditioned one (:func:`_plain_step`, a multiplier change of $\alpha$ in $G$'s units), is
    taken as $\alpha/s$. Without the scale an fp32 ``G`` of entries $10^{21}$ or $10^{-25}$ had lost
    its direction in ``msign``'s normalization (a zero direction, ratio 0, or ratio 0.8)."""
    batch = W.dim() - 2
    scale = unit_scale(G).reshape(G.shape[:-2])
    if warm_start is not None:
        warm_start = warm_start / per_matrix(scale, warm_start, batch)
    result = _solve_unit_scaled(manifold, W, G / per_matrix(scale, G, batch), scale, nrm, s, warm_start)

    def scaled(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else value * per_matrix(scale, value, batch)

    return dataclasses.replace(result, primal=scaled(result.primal), dual=scaled(result.dual),
                               multiplier=scaled(result.multiplier), correction=scaled(result.correction))


def _solve_unit_scaled(manifold, W: torch.Tensor, G: torch.Tensor, scale: torch.Tensor, nrm: Norm, s: SolverSettings,
                       warm_start: torch.Tensor | None) -> SteepestResult:
    """:func:`_solve` on ``G`` divided by the per-matrix ``scale [...]`` (largest entry in [1, 2), or zero)."""
    batch = W.dim() - 2
    Wc = W if s.compute_dtype is None else W.to(s.compute_dtype)
    # Iterates X_k = B + L^*(Delta_k) around a base B formed in W's dtype: near a
    # constrained optimum G is mostly normal, and forming G + L^*(Lambda) in bf16 would
    # cancel its small tangent part away. The correction L^*(Delta) is formed at W in W's dtype
    # too (X - G exactly normal, so ||X||_dual bounds the optimum); only the dualization and
    # the constraint of its output run in the compute dtype.
    B, lam0 = _start(manifold, W, G, s.init)
    gram = manifold.constraint_gram_diag(W) if s.precondition else None
    steps = s.steps
    keeps_tangent = getattr(manifold, "dualizer_keeps_tangent", None)
    if s.init == "projection" and keeps_tangent is not None and keeps_tangent(W, nrm.name):
        steps, warm_start = 0, None  # a closed form: Phi(P_W G) is the steepest direction
    measured = s.certify is not None or s.tol > 0

    def iterate(delta):
        # the normal offset at W itself, in W's dtype: X - G must be normal at W for ||X||_dual to
        # bound the optimum (at a bf16 copy of W the certificate had overstated by 1e-6)
        X = B if delta is None else B + manifold.constraint_adjoint(W, delta)
        return X, nrm.dualize(X if s.compute_dtype is None else X.to(s.compute_dtype), s)

    delta = None if warm_start is None else warm_start.to(W.dtype)
    best = _BestIterate() if s.track_best and s.certify is not None else None
    taken, residual, previous, frozen = 0, None, None, None
    for k in range(steps + 1):
        X, A = iterate(delta)
        if k == steps and not measured and previous is None:
            break
        H = manifold.constraint(Wc, A.to(Wc.dtype)).to(W.dtype)
        if H.shape[-1] == 0:  # unconstrained: Phi(G) is the answer
            break
        residual = _rms(H, batch)
        if previous is not None:
            # the safeguard, per matrix on the device (no read-back of a batch-wide flag)
            worse = residual > previous[3]
            frozen = worse if frozen is None else frozen | worse
            A, X, delta, residual = (torch.where(per_matrix(worse, new, batch), old, new)
                                     for old, new in zip(previous, (A, X, delta, residual)))
        met = residual < s.tol if s.tol > 0 else None
        # the tolerance test reads back one flag, so only a solve that asks for it pays it
        stop = k == steps or (met is not None and bool(met.all()))
        if best is not None and (k % _TRACK_EVERY == 0 or stop):  # (a tol stop's iterate had gone unscored)
            candidate = _feasible(manifold, W, A, nrm, s.rescale_exactly)
            best.score(candidate, *certificate(G, candidate, X, A, nrm, s))
        if stop:
            break
        rate = s.alpha * (1.0 - k / steps) if s.decay else s.alpha
        if s.precondition:
            step = _jacobi_step(manifold, W, X, A, H, gram, rate, batch)
        else:
            step = _plain_step(H, rate / per_matrix(scale, H, batch))
        if met is not None:  # a matrix within tol stops where it would alone (its batch-mates' steps had moved it on)
            frozen = met if frozen is None else frozen | met
        if frozen is not None:
            step = torch.where(per_matrix(frozen, step, batch), 0, step)
        if s.safeguard:
            previous = (A, X, torch.zeros_like(step) if delta is None else delta, residual)
        delta = step if delta is None else delta + step
        taken += 1

    if best is not None and best.direction is not None:
        direction, primal, dual = best.direction, best.primal, best.dual
    else:
        direction = _feasible(manifold, W, A, nrm, s.rescale_exactly)
        primal, dual = certificate(G, direction, X, A, nrm, s) if s.certify is not None else (None, None)
    ratio = None if primal is None else _ratio(primal, dual)
    if s.init == "projection":
        # A gradient normal to the manifold up to round-off has no meaningful tangent
        # part: dualizing the round-off would take a unit step in a noise direction (and
        # break equivariance). Such matrices get the zero direction instead, and the
        # certificate describes it (it had kept the discarded direction's, a ratio of 1.32):
        # primal 0, optimal up to round-off
        normal = _normal_only(B, G)
        direction = torch.where(per_matrix(normal, direction, batch), torch.zeros_like(direction), direction)
        if primal is not None:
            primal = torch.where(normal, torch.zeros_like(primal), primal)
            ratio = torch.where(normal, torch.ones_like(ratio), ratio)
    multiplier = None
    if measured:
        if lam0 is None:
            lam0 = -_gram_solve(manifold, W, manifold.constraint(W, G), manifold.constraint_gram_diag(W))
        multiplier = lam0 if delta is None else lam0 + delta
    return SteepestResult(
        direction=direction.to(W.dtype),
        primal=primal,
        dual=dual,
        ratio=ratio,
        steps=taken,
        residual=residual,
        multiplier=multiplier,
        correction=delta,
    )
