r"""The Gram-space steepest-descent step: dual iterations in $n\times n$, one $m\times n$ assembly.

For a manifold that declares a :class:`~geomuon.manifolds.capabilities.GramForm` (Stiefel,
DGram, Oblique) and the spectral norm, one optimizer step on a tall stack $W$ with
momentum $G$ is an exact reformulation of the engine of
:mod:`geomuon.optimizers.steepest` (projection start, dual iterations, final tangent
projection) followed by the manifold's retraction:

1. $D = W^\top W$, $B = W^\top G$, $\Sigma_0 = \mathrm{project}(D, B)$, the tangent part
   $Z_0 = P_WG = G - W\Sigma_0$, $B_0 = W^\top Z_0 = B - D\Sigma_0$ and $K = Z_0^\top Z_0$.
2. Dual iterates $Z = Z_0 + WS$, $S = \mathrm{adjoint}(\Delta)$ for the multiplier
   correction $\Delta$ (the warm start): $Q = Z^\top Z = K + F^\top S + S^\top F$,
   $F = B_0 + \tfrac12 DS$, and the dualizer $P \approx Q^{-1/2}$, so that
   $\operatorname{msign}(Z) = ZP$ and $M = W^\top\operatorname{msign}(Z) = (B_0 + DS)P$
   (:func:`eigen_dualizer`: exact, from $Q = V\Lambda V^\top$; or :func:`gram_msign`:
   Polar Express on the Cholesky factor). The dual gradient is $H = \mathcal C(M)$, and
   $\Delta$ moves by the Newton step of Su's fixed point (:func:`newton_update`) or the
   Jacobi step (:func:`jacobi_update`).
3. The direction $\hat A = P_W(ZP) = WT_1 + Z_0T_2$, $T_1 = SP - \mathrm{project}(D, M)$,
   $T_2 = P$, and the retraction folded into its assembly:
   $R_W(-\eta\hat A) = Y\rho(Y^\top Y)$, $Y = W(I - \eta T_1) - \eta Z_0T_2$ (:func:`retract`),
   after ``polish_rounds`` rounds of :func:`polish` (ADMM between the tangent space and the
   unit spectral ball, started from $\hat A$ and $Z$) where the settings ask for them.

**Cost** per matrix ($m\times n$ products are the unit): $B$, $Z_0$, $K$, the two products
of $Y$, $Y^\top Y$ and $Y\rho$ — seven, however many dual steps run — plus per dual
iteration one $n\times n$ symmetric eigendecomposition and four $n\times n$ products, per
Newton update four more (Stiefel's closed form, bf16) or one per conjugate-gradient
iteration (DGram, ``newton_cg_steps`` = 5, fp32), and three for the retraction's series
(DGram's retraction adds one more eigendecomposition per step; Stiefel's only for a step
longer than :func:`far_inverse_sqrt`'s bound).

**Precision** (the dtype of every product; $u = 2^{-8}$ is bf16's unit round-off,
$\varepsilon$ the parameter dtype's):

* fp32 (the parameter's retraction dtype; fp64 for fp64): $B$, $Z_0$ (a gradient that is
  mostly normal keeps its small tangent part only if the projection is formed to fp32
  accuracy), $K$ and $Q$ (they decide the small singular values of $Z$: a Gram squares
  the condition number, so fp32 resolves $\sigma \gtrsim \sqrt\varepsilon\,\sigma_{\max}$
  and bf16 only $\sqrt u\,\sigma_{\max} = 0.06\,\sigma_{\max}$), the eigendecomposition,
  $P$, $SP$ and $M$, and the retraction: $Y$, $Y^\top Y$ and $Y\rho$.
* $D$: the squared column norms (elementwise, exact) where the form declares
  ``diagonal_gram``, else an fp32 product; feasibility never rests on $D$, because the
  retraction measures $Y^\top Y$.
* bf16 (``compute_dtype``): the basis changes of the Newton step, which only choose the
  next dual iterate (their error is $u$ relative to the step, never to the point).
* Every $m\times n$ product stays in the retraction dtype, not bf16 (measured with bf16
  products, fp32 accumulation, torch 2.13 on an x86 CPU with AMX): $B$ and $W\Sigma_0$ in
  bf16 leave a normal residual of $u\|G\|$ in $Z_0$ (a momentum with a 0.1 % tangent part then stepped along a direction of
  norm 44, and $\|W^\top W - I\|$ reached 0.14); $K$ in bf16 is rounded after its sum (a CPU
  bf16 product has no fp32 output) and resolves only $\sqrt u\,\sigma_{\max}$ (a momentum
  whose singular values spread over $[10^{-8}, 1]$ certified 0.39, against 0.95; inside GPT
  training Stiefel's mean certified ratio fell from 0.978 to 0.30); $Y^\top Y$, $Y\rho$ and
  $W(c(I - \eta T_1))$ set the point itself (its orthogonality is their round-off). The
  assembly's $Z_0T_2$ alone could be bf16 (its error is the direction's, bounded by
  $u(2\kappa + 1)\|\hat A\|_F$), but it saved about 3 % of a step, within the noise.

Why the retraction measures $Y^\top Y$ instead of summing it from $D$, $B_0$ and $K$: $Y$
holds $\eta Z_0P$ with $\|P\| \le \delta^{-1/2}$ large on $Z$'s small singular values, so
any sum reaches the rounding of $K$ times $\eta^2\|P\|^2$ (measured: $1.7\cdot10^{-5}$ off
Stiefel after one fp32 step), while a measured Gram is exact to $\varepsilon\|Y\|^2$ however
$Y$ was formed.

**The projected solver** (``GramSettings.solver = "projected"``, :func:`projected_step`) takes
no dual step: $\hat A$ is $P_W\operatorname{msign}(P_WG)$ with the polar factor by Polar
Express on the $m\times n$ matrix in bf16 (Muon's kernel, which resolves singular values
down to about $10^{-3}\sigma_{\max}$ where a bf16 Gram resolves only $0.06\,\sigma_{\max}$), then
the same polish rounds on the materialized $m\times n$ direction, and the retraction in the
parameters' dtype (fp32). Its $m\times n$ products are bf16 except $W\Sigma_0$, $Y^\top Y$ and
$Y\rho$; per matrix it costs about
two Muon steps plus one $n\times n$ eigendecomposition per polish round (see
:func:`projected_step` for the measured frontier).

Everything is a polynomial in, an eigendecomposition of, or a conjugation of these Gram
matrices, so the map is equivariant under the manifold's symmetry group (up to
round-off), and no step reads a value back to the host on CPU: the iteration counts are
fixed by the settings. (On CUDA, ``torch.linalg.eigh`` reads its convergence flag back;
``dualizer="polar_express"`` calls no ``eigh``: its dual steps take :func:`gram_msign`, its
polish :func:`polynomial_unit_ball`, and DGram's retraction beyond its series' radius
:func:`polynomial_inverse_sqrt`, :func:`geomuon.manifolds.capabilities.inv_sqrt_unit_diagonal`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geomuon.manifolds.capabilities import (DUAL_ALPHA_RANGE, POLISH_METHODS, SERIES_MAX_TERMS, GramForm,
                                            admissible_dual_alpha, exact_inverse_sqrt, gram_retraction,
                                            inv_sqrt_near_identity, spectral_function)
from geomuon.manifolds.linalg import (POLAR_EXPRESS, check_compute_dtype, check_count, check_real, check_shape_of, eigh, msign,
                                     per_matrix, polar_express_steps, unit_scale)

__all__ = ["GramSettings", "GramStep", "gram_step", "unchecked_gram_step", "projected_step", "dual_gram", "eigen_dualizer",
           "gram_msign", "newton_update", "jacobi_update", "newton_cg", "polish", "exact_unit_ball", "polynomial_unit_ball",
           "polynomial_inverse_sqrt", "retract", "far_inverse_sqrt", "DUALIZERS", "POLISH_METHODS", "UPDATES", "SOLVERS",
           "UNIT_BALLS", "FAR_INVERSE_SQRTS", "DIRECTION_NORM", "DIRECTION_NORMAL"]

#: ``GramSettings.dualizer``: exact from the eigendecomposition of $Q$, or Polar Express on
#: its Cholesky factor (bf16 products, no LAPACK eigensolver).
DUALIZERS = ("eigh", "polar_express")
#: ``GramSettings.update``: Su's Newton (Lyapunov) step where the form declares it, Jacobi.
UPDATES = ("newton", "jacobi")
#: ``GramSettings.solver``: dual iterations in Gram space (:func:`gram_step`), or the polar
#: factor of the projected momentum on the $m\times n$ matrix in bf16 (:func:`projected_step`).
SOLVERS = ("dual", "projected")


@dataclass(frozen=True)
class GramSettings:
    r"""Settings of :func:`gram_step`.

    Attributes:
        solver: ``"dual"`` (:func:`gram_step`'s dual iterations; every attribute below
            applies) or ``"projected"`` (:func:`projected_step`: ``msign_steps``,
            ``compute_dtype``, ``polish_rounds``, ``retraction_terms``, ``stored_dtype`` and
            the dualizer's unit ball and far inverse square root apply, the dual attributes
            and ``polish_method`` do not).
        dual_steps: dual iterations whose result is dualized again within the step (each
            costs one dualization; 0: the direction is $\operatorname{msign}$ of the
            warm-started iterate).
        carry: take one more dual step after the last iterate, into the returned
            correction only (the next step's warm start): the dual ascent then advances
            one step per optimizer step without another dualization.
        update: ``"newton"`` (:func:`newton_update`: the closed form in $Q$'s eigenbasis
            where the form declares it and the dualizer is ``"eigh"``, else conjugate
            gradients where the form declares ``newton_cg_steps``, else Jacobi) or
            ``"jacobi"`` (:func:`jacobi_update`).
        alpha: the dual step size (1: the full Newton or Jacobi step), at most
            :data:`~geomuon.manifolds.capabilities.MAX_DUAL_ALPHA`.
        dualizer: ``"eigh"`` (:func:`eigen_dualizer`) or ``"polar_express"``
            (:func:`gram_msign`).
        msign_steps: Polar Express steps of :func:`gram_msign` (6: singular values within
            $[0.9935, 1.0012]$ in exact arithmetic).
        compute_dtype: dtype of the products that only choose the next dual iterate
            (``None``: the parameter's).
        retraction_terms: terms of the retraction's inverse-square-root series
            (:func:`geomuon.manifolds.capabilities.inv_sqrt_near_identity`).
        polish_rounds: rounds of :func:`polish` of the direction after the dual steps (0:
            none; each costs about nine $n\times n$ products and the unit-ball factor of the
            dualizer's kind, :data:`UNIT_BALLS`: one eigendecomposition with ``"eigh"``, about
            50 more products with ``"polar_express"``; ManifoldMuon's default:
            :func:`~geomuon.optimizers.manifold_muon.default_polish_rounds`).
        polish_method: :data:`POLISH_METHODS`: ``"admm"`` (rounds of ADMM started from the
            last dual iterate) or ``"alternating"`` (alternating projections), see
            :func:`polish` (the dual solver's; the projected solver's rounds alternate).
        smoothing: $c$ of the smoothed dual $\operatorname{tr}(Z^\top Z + \mu I)^{1/2}$,
            $\sqrt\mu = c\,\|Z\|_*/n$ (:func:`eigen_dualizer`; ``"eigh"`` only; 0: the
            round-off shift alone). Its optimum certifies $\ge 1 - 0.301c$.
        shift_eps: a floor on the unit round-off $\varepsilon$ of the dualizer's shift
            (:func:`eigen_dualizer`, :func:`gram_msign`; ``None``: the dtype's own), so that a
            float64 step can keep float32's regularization (ManifoldMuon's choice,
            :data:`~geomuon.optimizers.manifold_muon.DUALIZER_SHIFT_EPS`).
        stored_dtype: the parameters' own dtype when it is narrower than the points' (bf16 or
            fp16 weights stepped in fp32): their points are off the manifold by that dtype's
            round-off ($\|W^\top W - I\| \approx 3\cdot10^{-3}$ for bf16), so the step measures
            $W^\top W$ instead of taking it from the column norms, and keeps the retraction's
            exact branch (:func:`far_inverse_sqrt`); ``None``: the points are stored as they
            are computed.
    """

    solver: str = "dual"
    dual_steps: int = 0
    carry: bool = True
    update: str = "newton"
    alpha: float = 1.0
    dualizer: str = "eigh"
    msign_steps: int = 6
    compute_dtype: torch.dtype | None = torch.bfloat16
    retraction_terms: int = 6
    polish_rounds: int = 0
    polish_method: str = "admm"
    smoothing: float = 0.0
    shift_eps: float | None = None
    stored_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # every field checked here, not at the step: alpha=NaN had returned a NaN warm start,
        # an int compute dtype lost it to integer products, 2.5 dual steps failed in range()
        check_count("GramSettings", "dual_steps", self.dual_steps)
        check_count("GramSettings", "polish_rounds", self.polish_rounds)
        check_count("GramSettings", "msign_steps", self.msign_steps, 1)
        check_count("GramSettings", "retraction_terms", self.retraction_terms)
        if self.retraction_terms > SERIES_MAX_TERMS:
            raise ValueError(f"GramSettings: retraction_terms must be at most {SERIES_MAX_TERMS} (the series' known "
                             f"coefficients), got {self.retraction_terms}")
        check_real("GramSettings", "alpha", self.alpha, admissible_dual_alpha, DUAL_ALPHA_RANGE)
        check_real("GramSettings", "smoothing", self.smoothing, lambda x: x >= 0, "a finite number >= 0")
        if self.shift_eps is not None:
            check_real("GramSettings", "shift_eps", self.shift_eps, lambda x: x > 0, "a finite number > 0 (or None)")
        if not isinstance(self.carry, bool):
            raise ValueError(f"GramSettings: carry must be True or False, got {self.carry!r}")
        check_compute_dtype("GramSettings", "compute_dtype", self.compute_dtype, float16=False)
        check_compute_dtype("GramSettings", "stored_dtype", self.stored_dtype)
        if self.smoothing and self.dualizer != "eigh":
            raise ValueError("GramSettings: smoothing needs dualizer='eigh' (mu is read off Q's eigenvalues)")
        if self.dualizer not in DUALIZERS:
            raise ValueError(f"GramSettings: dualizer must be one of {DUALIZERS}, got {self.dualizer!r}")
        if self.update not in UPDATES:
            raise ValueError(f"GramSettings: update must be one of {UPDATES}, got {self.update!r}")
        if self.polish_method not in POLISH_METHODS:
            raise ValueError(f"GramSettings: polish_method must be one of {POLISH_METHODS}, got {self.polish_method!r}")
        if self.solver not in SOLVERS:
            raise ValueError(f"GramSettings: solver must be one of {SOLVERS}, got {self.solver!r}")


@dataclass
class GramStep:
    """Output of :func:`gram_step`: the new points and the next warm start.

    Attributes:
        point: $R_W(-\\eta\\hat A)$, ``[..., m, n]`` in ``W.dtype``.
        correction: the multiplier correction $\\Delta$ (multiplier shape), to pass back;
            ``None`` from the projected solver (it has no dual to warm-start).
        direction_factors: ``(T1, T2, V, S)`` with $\\hat A = WT_1 + VT_2$ and the last dual
            iterate $Z = Z_0 + WS$ (for certificates); $V = Z_0$ from :func:`gram_step`.
        start: $Z_0 = P_WG$ where it is not $V$ (:func:`projected_step`: $V = \\hat A$ itself,
            $T_1 = S = 0$, $T_2 = I$).
    """

    point: torch.Tensor
    correction: torch.Tensor | None
    direction_factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    start: torch.Tensor | None = None

    def direction(self, W: torch.Tensor) -> torch.Tensor:
        """$\\hat A = WT_1 + VT_2$ for the (scaled) points ``W`` the step was taken from."""
        T1, T2, V, _ = self.direction_factors
        return W @ T1 + V @ T2

    def dual_iterate(self, W: torch.Tensor) -> torch.Tensor:
        """The last dual iterate $Z_0 + WS$ (its nuclear norm bounds the optimum from above)."""
        _, _, V, S = self.direction_factors
        return (V if self.start is None else self.start) + W @ S


def _low_mm(X: torch.Tensor, Y: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """$XY$ with the product in ``low``, returned in ``X.dtype``."""
    return (X.to(low) @ Y.to(low)).to(X.dtype)


def _trace(X: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(X, dim1=-2, dim2=-1).sum(-1)


@dataclass
class Dualized:
    r"""$P \approx Q^{-1/2}$ and what the dual updates read from it.

    Attributes:
        P: ``[..., n, n]``, $\operatorname{msign}(Z) = ZP$.
        value: $\operatorname{tr}(QP) = \langle Z, \operatorname{msign} Z\rangle$ ``[...]``
            ($\|Z\|_*$ for the exact dualizer).
        frobenius2: $\|ZP\|_F^2 = \operatorname{tr}(PQP)$ ``[...]``.
        eigenvectors, weights: $V$ and $f$ with $P = V\operatorname{diag}(f)V^\top$ (the
            exact dualizer only; ``None`` otherwise).
    """

    P: torch.Tensor
    value: torch.Tensor
    frobenius2: torch.Tensor
    eigenvectors: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def dual_gram(K: torch.Tensor, B0: torch.Tensor, S: torch.Tensor, DS: torch.Tensor) -> torch.Tensor:
    r"""$Q = Z^\top Z$ of the dual iterate $Z = Z_0 + WS$ from $K = Z_0^\top Z_0$, $B_0 = W^\top Z_0$
    and $DS$ ($D = W^\top W$, $S$ symmetric, all ``[..., n, n]``):

    $$Q = K + B_0^\top S + S^\top B_0 + S^\top DS = K + F^\top S + S^\top F,\qquad F = B_0 + \tfrac12 DS,$$

    one $n\times n$ product in the inputs' dtype.
    """
    SF = S.mT @ torch.add(B0, DS, alpha=0.5)
    return K + SF + SF.mT


def eigen_dualizer(Q: torch.Tensor, scale: torch.Tensor, smoothing: float = 0.0,
                   shift_eps: float | None = None) -> Dualized:
    r"""The exact dualizer from $Q = V\Lambda V^\top$ (:func:`geomuon.manifolds.linalg.eigh`, in ``Q.dtype``):

    $$P = V\operatorname{diag}(f)V^\top,\qquad f_i = (\max(\lambda_i, 0) + \delta)^{-1/2},\qquad
    \delta = \sqrt n\,\varepsilon\,t,$$

    with ``scale`` $t$ the sum of the traces of the terms $Q$ was summed from (a bound on
    their entries' size; $\sqrt n\,\varepsilon t$ bounds the spectral norm of the rounding of
    $Q$, the same shift as :func:`gram_msign`'s): eigenvalues below it are rounding
    (``shift_eps`` raises $\varepsilon$ to at least that value). The
    shift is a Tikhonov regularization: it maps a singular value $\sigma$ of $Z$ to
    $\sigma/\sqrt{\sigma^2 + \delta}$ (a factor $1 - \delta/(2\sigma^2)$ for $\sigma \gg
    \sqrt\delta$) and bounds the map's slope by $\delta^{-1/2}$, so a rank-deficient momentum
    does not amplify its round-off by $1/\sigma_{\min}$ (the exact $Q^{-1/2}$ moved a square
    GPT projection's first step by $3.4\cdot10^{-4}$ under a $1.9\cdot10^{-7}$ relative change
    of its momentum). A zero $Q$ gets $P = 0$. One $n\times n$ product
    ($V$ times $\operatorname{diag}(f)V^\top$).

    ``smoothing`` $c > 0$ raises the shift to $\max(\delta, \mu)$ with
    $\sqrt\mu = c\,\|Z\|_*/n = c\sum_i\sqrt{\lambda_i}/n$: then $ZP$ is the gradient of the
    smoothed dual $\phi_\mu = \operatorname{tr}(Z^\top Z + \mu I)^{1/2}$, and at its minimizer over the
    multiplier $ZP$ is tangent with $\|ZP\|_2 < 1$, so it is feasible and certifies

    $$\frac{\langle G, ZP\rangle}{\|Z\|_*} = \frac{\sum_i\sigma_i^2/\sqrt{\sigma_i^2 + \mu}}{\sum_i\sigma_i}
    \ \ge\ 1 - 0.301\,c$$

    (each $\sigma_i$ loses $\sigma_i(1 - \sigma_i/\sqrt{\sigma_i^2+\mu}) \le 0.301\sqrt\mu$, the maximum of $t(1 - t/\sqrt{t^2+1})$ being
    $0.30028$ at $t \approx 0.786$). Without it the
    dual is nonsmooth where $Z$ is rank-deficient (a transformer's momentum), and the tangent
    projection of $\operatorname{msign}$ of even a converged iterate leaves the unit ball. $\mu$ is a
    spectral function of $Q$, so the map stays equivariant.
    """
    lam, V = eigh(Q)
    lam = lam.clamp_min(0)
    eps = max(torch.finfo(Q.dtype).eps, shift_eps or 0.0)
    delta = (Q.size(-1) ** 0.5 * eps * scale).unsqueeze(-1)
    if smoothing:
        mu = (smoothing / Q.size(-1)) * lam.sqrt().sum(-1, keepdim=True)
        delta = torch.maximum(delta, mu * mu)
    f = torch.where(delta > 0, (lam + delta).rsqrt(), torch.zeros_like(lam))
    P = (V * f.unsqueeze(-2)) @ V.mT
    return Dualized(P=P, value=(lam * f).sum(-1), frobenius2=(lam * f * f).sum(-1), eigenvectors=V, weights=f)


def gram_msign(Q: torch.Tensor, steps: int, low: torch.dtype, scale: torch.Tensor | None = None,
               shift_eps: float | None = None) -> Dualized:
    r"""$P \approx Q^{-1/2}$ (to Polar Express's accuracy) by Polar Express on the Cholesky factor of $Q$.

    With the Cholesky factor $Q + \delta I = C^\top C$ ($C$ upper triangular, $n\times n$),
    $Z = UC$ with $U$ orthonormal, so $\operatorname{msign}(Z) = U\operatorname{msign}(C)$ and

    $$P = C^{-1}\operatorname{msign}(C),$$

    where $\operatorname{msign}(C)$ is Polar Express (arXiv 2505.16932) on the small factor, in the
    form Muon runs it (the iterate is the state, its Gram recomputed each step). Iterating on
    $Q$ itself (Gram Newton–Schulz) is not safe in bf16: rounding gives an ill-conditioned $Q$
    a slightly negative eigenvalue, which the polynomials amplify without bound (measured:
    overflow at $\operatorname{cond}(Q) = 4\cdot10^4$). Here a bf16 error $\epsilon$ of
    $\operatorname{msign}(C)$ is an error $U\epsilon$ of $\operatorname{msign}(Z)$, not amplified.

    $\delta = \sqrt n\,\varepsilon\,t$ (+ tiny) keeps the factorization defined for a
    semi-definite or zero $Q$ and for the rounding of a $Q$ formed as a sum of larger terms:
    ``scale`` $t$ is the sum of the traces of those terms (default $\operatorname{tr}Q$); it
    damps singular values below about $(n^{3/2}\varepsilon)^{1/2}\sigma_{\max}$ ($0.03$ at
    $n = 384$ in fp32, $\varepsilon = 2^{-23}$: a singular value of $0.03\,\sigma_{\max}$ comes
    out at about $1/\sqrt2$ of its value), the price of a factorization that must succeed
    (``shift_eps`` raises $\varepsilon$ to at least that value, as in :func:`eigen_dualizer`). A matrix whose
    factorization still fails gets $P = 0$ (a zero step) rather than NaN.
    Dtypes: Cholesky and the triangular solve in ``Q.dtype`` (fp32/fp64), the Polar Express
    products in ``low``. No host read: the failure flag selects on the device.
    """
    n = Q.size(-1)
    eye = torch.eye(n, dtype=Q.dtype, device=Q.device)
    trace = _trace(Q)
    finfo = torch.finfo(Q.dtype)
    scale = trace if scale is None else scale
    eps = max(finfo.eps, shift_eps or 0.0)
    shift = (n**0.5 * eps * scale + finfo.tiny ** 0.5).reshape(*trace.shape, 1, 1)
    C, info = torch.linalg.cholesky_ex(Q + shift * eye, upper=True)
    norm = (trace.reshape(*trace.shape, 1, 1) + n * shift).sqrt()  # ||C||_F
    X = polar_express_steps((C / (norm * POLAR_EXPRESS.input_scale)).to(low), steps, tall=True).to(Q.dtype)
    ok = info == 0
    P = torch.linalg.solve_triangular(C, X, upper=True)
    P = torch.where(ok.reshape(*info.shape, 1, 1), P, torch.zeros_like(P))
    zero = torch.zeros_like(trace)
    # tr(QP) = tr(C^T C C^{-1} X) - delta tr(P) = tr(C^T X) - delta tr(P), elementwise (no cancelling product)
    value = (C * X).sum((-2, -1)) - shift.reshape(trace.shape) * _trace(P)
    return Dualized(P=P, value=torch.where(ok, value, zero), frobenius2=torch.where(ok, X.square().sum((-2, -1)), zero))


#: Polar Express steps of :func:`polynomial_unit_ball` (measured at $n = 64$ and 384, spectra
#: uniform on $[0, 1.3]$ or half log-spaced down to $10^{-6}$: 8 steps leave the clipped
#: singular values within $3\cdot10^{-4}$ of the exact ones and at most $1 + 10^{-5}$; 6 steps
#: $2.6\cdot10^{-3}$ and $1.0014$).
UNIT_BALL_STEPS = 8


def exact_unit_ball(gram: torch.Tensor) -> torch.Tensor:
    r"""$\phi(\Gamma) = V\operatorname{diag}(\min(1, \lambda_i^{-1/2}))V^\top$ from
    $\Gamma = \hat A^\top\hat A = V\Lambda V^\top$ (``torch.linalg.eigh`` in ``gram.dtype``), so that
    $\hat A\phi(\Gamma)$ is the nearest point of the unit spectral ball to $\hat A$ (Frobenius
    metric: every singular value above 1 clipped to 1)."""
    return spectral_function(gram, lambda lam: lam.clamp_min(1.0).rsqrt())


def polynomial_unit_ball(gram: torch.Tensor, steps: int = UNIT_BALL_STEPS) -> torch.Tensor:
    r"""$\phi(\Gamma) \approx \min(1, \Gamma^{-1/2})$ with no eigendecomposition (matrix products,
    a Cholesky factorization and a triangular solve: no host read on CUDA), all in
    ``gram.dtype``:

    $$\phi = E_- + N^{-1/2}E_+,\qquad E_\pm = \tfrac12\bigl(I \pm \operatorname{sign}(\Gamma - I)\bigr),
    \qquad N = I + (\Gamma - I)E_+ = I + (\Gamma - I)_+,$$

    with the sign of the symmetric $\Gamma - I$ by Polar Express (its polar factor) and
    $N^{-1/2}$ by :func:`gram_msign`. All are functions of $\Gamma$, so they commute: on an
    eigenvector $\phi = 1$ below 1 and $\lambda^{-1/2}$ above. $N$ has eigenvalues
    $\max(1, \lambda)$, so its factorization is well conditioned however singular $\Gamma$ is
    (a rank-deficient direction's $\Gamma$ is indefinite by round-off: inverting $\Gamma$
    itself failed there and zeroed the direction). Where the sign is inaccurate
    ($\lambda \approx 1$) both branches are $\approx 1$, so the blend costs little; and
    $\phi$ stays between 1 and $\lambda^{-1/2}$, so a singular value below 1 never leaves the
    ball. Measured accuracy: :data:`UNIT_BALL_STEPS`. Cost: $6\cdot$``steps`` $+ 2$ $n\times n$ products.
    """
    eye = torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)
    M = gram - eye
    norm = torch.linalg.matrix_norm(M).clamp_min(torch.finfo(M.dtype).tiny).reshape(*M.shape[:-2], 1, 1)
    upper = 0.5 * (eye + polar_express_steps(M / (norm * POLAR_EXPRESS.input_scale), steps, tall=True))
    return (eye - upper) + gram_msign(eye + M @ upper, steps, gram.dtype).P @ upper


def polynomial_inverse_sqrt(N: torch.Tensor, steps: int = UNIT_BALL_STEPS, terms: int = 6) -> torch.Tensor:
    r"""$R$ with $R^\top NR = I$ for symmetric positive definite ``N`` ``[B, n, n]``, close to
    $N^{-1/2}$, with no eigendecomposition (the far branch of DGram's retraction under the Polar
    Express dualizer, :func:`geomuon.manifolds.capabilities.inv_sqrt_unit_diagonal`), in ``N.dtype``:

    $$R_0 = C^{-1}X,\quad X \approx \operatorname{msign}(C),\qquad R = R_0\,(X^\top X)^{-1/2}$$

    with :func:`gram_msign` ($N + \delta I = C^\top C$, $X$ by Polar Express, so $R_0 = N^{-1/2}$
    up to its accuracy) and the last factor by the series
    :func:`~geomuon.manifolds.capabilities.inv_sqrt_near_identity` in $X^\top X - I$ (of the order of
    Polar Express's error, inside the series' radius): $R^\top NR = I$ to the series' accuracy,
    since $R_0^\top NR_0 = X^\top X$ exactly up to the shift. Polar Express maps $C = U\Sigma V^\top$
    to $Up(\Sigma)V^\top$, so $R_0 = q(N)$ and $R$ are functions of $N$: $R$ is the symmetric
    $N^{-1/2}$ up to round-off, not a rotation of it. Cost: a Cholesky factorization, a
    triangular solve and $3\cdot$``steps`` $+ 5$ $n\times n$ products."""
    eye = torch.eye(N.size(-1), dtype=N.dtype, device=N.device)
    dual = gram_msign(N, steps, N.dtype)
    X_gram = dual.P.mT @ N @ dual.P  # = X^T X (the polar iterate's Gram) up to the shift
    return dual.P @ inv_sqrt_near_identity(0.5 * (X_gram + X_gram.mT) - eye, terms)


#: ``GramSettings.dualizer`` -> the unit-ball factor of :func:`polish`: exact with the exact
#: dualizer, matrix products only with Polar Express (no eigendecomposition on CUDA).
UNIT_BALLS = {"eigh": exact_unit_ball, "polar_express": polynomial_unit_ball}
#: ``GramSettings.dualizer`` -> the inverse square root of a retraction beyond its series' radius.
FAR_INVERSE_SQRTS = {"eigh": exact_inverse_sqrt, "polar_express": polynomial_inverse_sqrt}

#: A-priori bounds on the directions $\hat A$ both solvers retract along, per unit step length:
#: $\|\hat A\|_2$ (Stiefel's tangent projection $W\operatorname{skew}(W^\top X) + (I - WW^\top)X$ of
#: a matrix $X$ of the unit ball has norm at most $\sqrt2$, less after the polish's clip;
#: measured at most 1.16, with Polar Express's overshoot and bf16 rounding) and $\|\mathcal C(W^\top\hat A)\|_2$, its normal part
#: (round-off of the tangent projection: measured at most $8\cdot10^{-3}$ from the projected
#: solver's bf16 products and $2\cdot10^{-5}$ from the dual solver's fp32 ones, at $n \le 768$).
#: :func:`far_inverse_sqrt` passes them to :meth:`~geomuon.manifolds.capabilities.GramForm.series_covers`.
DIRECTION_NORM, DIRECTION_NORMAL = 1.5, 0.05


def far_inverse_sqrt(form: GramForm, settings: "GramSettings", lr: float | torch.Tensor,
                     shrink: float | torch.Tensor, dtype: torch.dtype):
    r"""The retraction's inverse square root beyond its series' radius (:data:`FAR_INVERSE_SQRTS`
    by the dualizer), or ``None`` where the form bounds every step of length ``lr`` within the
    radius a priori (:meth:`~geomuon.manifolds.capabilities.GramForm.series_covers` with
    :data:`DIRECTION_NORM` and :data:`DIRECTION_NORMAL`): then no step computes the branch
    (Stiefel: one $n\times n$ eigendecomposition per matrix saved, up to $\eta \approx 0.156$ in
    fp32 and $0.030$ in fp64 without weight decay). A 0-dim tensor ``lr`` or ``shrink`` has no
    value on the host, and points stored narrower than ``dtype`` (``settings.stored_dtype``)
    are off the manifold by more than the bound allows: the branch is kept."""
    far = FAR_INVERSE_SQRTS[settings.dualizer]
    if isinstance(lr, torch.Tensor) or isinstance(shrink, torch.Tensor):
        return far
    if settings.stored_dtype is not None:
        return far  # the bound assumes points on M to the points' round-off; narrower storage is farther off
    covered = form.series_covers(DIRECTION_NORM * lr, DIRECTION_NORMAL * lr, shrink, settings.retraction_terms, dtype)
    return None if covered else far


def jacobi_update(form: GramForm, D: torch.Tensor, dual: Dualized, M: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""The Jacobi-preconditioned dual step $-\alpha\,\sigma\,\mathcal C(M)\oslash\operatorname{diag}(LL^*)$.

    $\mathcal C(M) = L_W(\operatorname{msign} Z)$ is scale-free while the multiplier scales
    with $G$: a change $\delta$ of $\Lambda$ moves $\operatorname{msign}(Z)$ by about
    $L^*(\delta)/\sigma$, so the step carries $\sigma = \langle Z, A\rangle/\langle A, A\rangle
    = \operatorname{tr}(QP)/\|A\|_F^2$, $Z$'s typical singular value.
    """
    H = form.constraint(M)
    tiny = torch.finfo(M.dtype).tiny
    sigma = dual.value / dual.frobenius2.clamp_min(tiny)
    diag = form.gram_diag(D)
    sigma = sigma.reshape(sigma.shape + (1,) * (H.dim() - sigma.dim()))
    return torch.where(diag > 0, (-alpha * sigma) * H / diag.clamp_min(tiny), torch.zeros_like(H))


def newton_update(form: GramForm, D: torch.Tensor, dual: Dualized, M: torch.Tensor, alpha: float,
                  low: torch.dtype) -> torch.Tensor:
    r"""Su's fixed-point (Newton) step for the multiplier, by one Lyapunov solve in $Q$'s eigenbasis.

    On Stiefel ($D = I$) with $Z = G + WX$, $X$ symmetric: $W^\top\operatorname{msign}(Z) =
    (B + X)Q^{-1/2}$, and tangency $\operatorname{sym}(W^\top\operatorname{msign} Z) = 0$ with
    $R = Q^{1/2}$ held fixed is the Lyapunov equation $RX + XR = -2\operatorname{sym}(RB)$
    (J. Su, kexue.fm/archives/11221). Written as an increment $E = X_{\rm new} - X$ of the
    current iterate, whose residual is $\mathcal C(M) = M + M^\top$:

    $$RE + ER = -R\,\mathcal C(M)\,R,\qquad
    E = -V\Big[\frac{(V^\top\mathcal C(M)V)_{ij}}{f_i + f_j}\Big]V^\top$$

    ($R = V\operatorname{diag}(1/f)V^\top$, the same $f$ as $P$). The form maps $E$ to the
    multiplier's increment (:meth:`~geomuon.manifolds.capabilities.GramForm.newton_increment`).
    The basis changes (four $n\times n$ products) run in ``low``, but for the last one, whose
    product is in ``M.dtype``: they only choose the next iterate, and their error is relative
    to the step. (A ``low`` result read transposed, as the form's adjoint reads $E$, is what
    ``torch.compile``'s vectorized CPU kernels of torch 2.13 get wrong: the compiled Stiefel
    step returned NaN at $n \ge 64$, where a product's output in ``M.dtype`` is read as stored;
    cost: one $n\times n$ product in ``M.dtype`` per update.)

    A form whose $D$ is not the identity (DGram), and every form under a dualizer without
    eigenvectors (``"polar_express"``), takes the same fixed point, $EP + PE = -\mathcal C(M)$
    generalized to $\mathcal C(DS(\delta)P) = -\mathcal C(M)$, solved for the multiplier increment
    $\delta$ by :func:`newton_cg` (``newton_cg_steps`` iterations, in ``M.dtype``; it needs only
    $P$). A form that declares neither takes the Jacobi step.
    """
    if not (form.has_newton and dual.eigenvectors is not None):
        if form.newton_cg_steps:
            return (-alpha) * newton_cg(form, D, dual.P, form.constraint(M), form.newton_cg_steps)
        return jacobi_update(form, D, dual, M, alpha)
    V, f = dual.eigenvectors, dual.weights
    Vl = V.to(low)
    Ht = (Vl.mT @ form.constraint(M).to(low) @ Vl).to(M.dtype)
    # f_i + f_j = 0 only where P = 0 (a zero Q), and there H = 0: the clamp keeps 0/0 out
    scale = (-alpha) / (f.unsqueeze(-1) + f.unsqueeze(-2)).clamp_min(torch.finfo(M.dtype).tiny)
    E = (Vl @ (Ht * scale).to(low)).to(M.dtype) @ V.mT
    return form.newton_increment(D, E)


def newton_cg(form: GramForm, D: torch.Tensor, P: torch.Tensor, H: torch.Tensor, steps: int) -> torch.Tensor:
    r"""$\mathcal A^{-1}H$ for the form's :meth:`~geomuon.manifolds.capabilities.GramForm.newton_operator`
    $\mathcal A(\Lambda) = \mathcal C(DS(\Lambda)P)$ by ``steps`` iterations of conjugate gradients from 0,
    preconditioned by its diagonal (:meth:`~geomuon.manifolds.capabilities.GramForm.newton_diagonal`).

    $\mathcal A$ is symmetric positive semi-definite, and its range holds $H = \mathcal C(M)$, so
    each iteration lowers the $\mathcal A$-norm of the error. All in ``H.dtype`` (one $n\times n$
    product per iteration for a ``diagonal_gram`` form); per-matrix inner products and a
    fixed count, so no value is read back and no matrix depends on its batch-mates. A zero
    $H$ (or $P$) gives 0.
    """
    dims = tuple(range(D.dim() - 2, H.dim()))
    tiny = torch.finfo(H.dtype).tiny
    diag = form.newton_diagonal(D, P)
    # one division per iteration: an infinite divisor zeroes the entries outside the operator's range
    divisor = torch.where(diag > 0, diag.clamp_min(tiny), torch.full_like(diag, float("inf")))

    def precondition(R):
        return R / divisor

    X = torch.zeros_like(H)
    R = H
    Y = precondition(R)
    step = Y
    ry = (R * Y).sum(dims, keepdim=True)
    for iteration in range(steps):
        A_step = form.newton_operator(D, step, P)
        a = ry / (step * A_step).sum(dims, keepdim=True).clamp_min(tiny)
        X = X + a * step
        if iteration == steps - 1:  # the next search direction would go unused
            break
        R = R - a * A_step
        Y = precondition(R)
        ry, previous = (R * Y).sum(dims, keepdim=True), ry
        step = Y + (ry / previous.clamp_min(tiny)) * step
    return X


def polish(form: GramForm, mulD: "_PointGram", B0: torch.Tensor, K: torch.Tensor, T1: torch.Tensor,
           T2: torch.Tensor, rounds: int, unit_ball=exact_unit_ball,
           dual: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Rounds toward the steepest-descent problem's optimum from the direction, in Gram space;
    returns the new ``(T1, T2)`` of $\hat A = WT_1 + Z_0T_2$ (tangent).

    The problem $\max\{\langle G, A\rangle : A \in T_W,\ \|A\|_2 \le 1\}$ split between the
    tangent space and the unit spectral ball. With ``dual = (S, scale)`` (:data:`POLISH_METHODS`
    ``"admm"``) the rounds are ADMM's, in its scaled form (Boyd et al., *Distributed
    Optimization and Statistical Learning via the Alternating Direction Method of Multipliers*,
    2011, §3.1) with penalty $\rho$:

    $$x = P_W(z - u) + Z_0/\rho,\qquad z \leftarrow \Pi(x + u),\qquad u \leftarrow x + u - z,$$

    ($P_W(G/\rho) = Z_0/\rho$; $\Pi(Y) = Y\phi(Y^\top Y)$, $\phi(\lambda) = \min(1, \lambda^{-1/2})$,
    the nearest point of the unit ball in the Frobenius metric), started from the direction,
    $z = \hat A$, and the dual iterate $Z = Z_0 + WS$, $u = Z/\rho$, $\rho$ = ``scale``
    ($\|Z\|_F$ in :func:`gram_step`); the result is $P_W(z)$. At an optimal pair
    $(A^\star, Z^\star)$ ($A^\star$ tangent, $A^\star \in \partial\|Z^\star\|_*$) that start is a
    fixed point: $x = A^\star$, and $A^\star + Z^\star/\rho$ has $A^\star$'s singular vectors with
    the singular values on $Z^\star$'s range raised above 1, which $\Pi$ clips back. A zero
    ``scale`` (a matrix whose direction is zero) takes no $G$ term.

    With ``dual=None`` (``"alternating"``) $u = 0$ and there is no $G$ term: alternating
    projections $\hat A \leftarrow P_W(\Pi(\hat A))$, which tend to a feasible point near
    $\hat A$ (Bauschke–Borwein), not to the optimum. Why ADMM: where the dual optimum is
    rank-deficient the optimal direction has singular values below 1, which no
    $\operatorname{msign}$ of a dual iterate has, and only the $G$ term moves toward them. That
    happens on square DGram points (on ``tests/test_direction_taken.py``'s 16×16 layer $Z^\star$
    has rank 8–9, $A^\star$ singular values down to 0.09) and under a transformer's momentum
    (singular values over many orders of magnitude). Measured fraction of the optimal descent,
    DGram, 1 Newton dual step, mean / min: that MLP task, 2 rounds, ADMM 0.981 / 0.940,
    alternating 0.970 / 0.884; inside GPT training (``bench/manifold_inrun.py``, against a
    32-step reference), 3 rounds, 0.967 / 0.860 and 0.958 / 0.845. On Stiefel, whose dual steps
    converge, alternating keeps the better minimum (GPT training, 2 dual steps, 2 rounds:
    0.982 / 0.966 against ADMM's 0.982 / 0.952): each form declares its method
    (:attr:`~geomuon.manifolds.capabilities.GramForm.polish_method`). $\rho = \|Z\|_F$ was
    measured against $\sigma_{\max}(Z)$, $\|Z\|_F/\sqrt n$ and $4\|Z\|_F$: the best, by up to 0.04.

    Coordinates: every iterate is $WX_1 + Z_0X_2$, so a round is $n\times n$ work:
    $P_W(WX_1 + Z_0X_2) = W(X_1 - \mathrm{project}(D, DX_1 + B_0X_2)) + Z_0X_2$ and

    $$Y^\top Y = X_1^\top DX_1 + X_1^\top B_0X_2 + X_2^\top B_0^\top X_1 + X_2^\top KX_2 .$$

    Shapes ``[..., n, n]``, ``scale`` ``[...]``; all in the inputs' dtype (the retraction
    dtype); $\phi$ by ``unit_ball`` (:data:`UNIT_BALLS`: the exact :func:`exact_unit_ball`, or
    :func:`polynomial_unit_ball` with no eigendecomposition). Spectral functions and
    conjugations of Gram matrices, and $\rho$ a norm: the map keeps its equivariance.
    """
    if not rounds:
        return T1, T2
    x1, x2 = T1, T2  # ADMM's x from z = A, u = Z / rho: P_W(A - Z / rho) + Z_0 / rho = A (P_W(Z) = Z_0)
    if dual is not None:
        S, scale = dual
        inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)).reshape(*scale.shape, 1, 1)
        start = torch.eye(T2.size(-1), dtype=T2.dtype, device=T2.device) * inverse  # Z_0 / rho: (0, I / rho)
        u1, u2 = S * inverse, start
    for k in range(rounds):
        y1, y2 = (x1, x2) if dual is None else (x1 + u1, x2 + u2)
        cross = y1.mT @ (B0 @ y2)
        clip = unit_ball(y1.mT @ mulD(y1) + cross + cross.mT + y2.mT @ (K @ y2))
        z1, z2 = y1 @ clip, y2 @ clip
        if dual is None or k == rounds - 1:  # P_W(z): an alternating round, or ADMM's result
            x1, x2 = z1 - form.project(mulD.D, mulD(z1) + B0 @ z2), z2
        else:  # ADMM's multiplier and x-steps
            u1, u2 = y1 - z1, y2 - z2
            a, b = z1 - u1, z2 - u2
            x1, x2 = a - form.project(mulD.D, mulD(a) + B0 @ b), b + start
    return x1, x2


def _axpy(Y: torch.Tensor, X: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    r"""$Y + \alpha X$: ``torch.add``'s ``alpha`` for a float, a product by the 0-dim tensor
    otherwise (a learning rate scheduled on the device is never read back)."""
    return Y + alpha * X if isinstance(alpha, torch.Tensor) else torch.add(Y, X, alpha=alpha)


def _baddbmm(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    r"""$C + \alpha AB$ (``torch.baddbmm`` for a float $\alpha$; see :func:`_axpy`)."""
    return C + alpha * (A @ B) if isinstance(alpha, torch.Tensor) else torch.baddbmm(C, A, B, alpha=alpha)


def _scale(X: torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
    """$cX$, skipped for the float 1 (no decay: bitwise the unscaled product)."""
    return X if not isinstance(c, torch.Tensor) and c == 1.0 else c * X


def retract(form: GramForm, W: torch.Tensor, Z0: torch.Tensor, T1: torch.Tensor, T2: torch.Tensor,
            lr: float | torch.Tensor, shrink: float | torch.Tensor = 1.0, terms: int = 6,
            far=exact_inverse_sqrt) -> torch.Tensor:
    r"""$R_{W'}(-\eta\hat A) = Y\rho(Y^\top Y)$ with $Y = W' - \eta(W'T_1 + Z_0T_2) = W\,c(I - \eta T_1) - \eta Z_0T_2$,
    $W' = cW$: the $m\times n$ assembly, the measured Gram $Y^\top Y$ and the right factor, all
    in ``W.dtype`` (see the module docstring for why the Gram is measured). ``lr`` and
    ``shrink`` are floats or 0-dim tensors (see :func:`gram_step`); ``far``: the inverse square
    root beyond the series' radius (:func:`far_inverse_sqrt`; ``None``: the series alone).
    """
    eye = torch.eye(T1.size(-1), dtype=T1.dtype, device=T1.device)
    N1 = _axpy(eye, T1, -lr)
    Y = _baddbmm(W @ _scale(N1, shrink), Z0, T2, -lr)
    return Y @ form.retraction_factor(Y.mT @ Y, terms, far)


def _normal_only(tangent2: torch.Tensor, normal2: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    r"""Per matrix: $\|P_WG\|_F \le 8\sqrt{\max(m, n)}\,\varepsilon\,\|G\|_F$ (the tangent part
    is round-off of the projection; dualizing it would take a unit step in a noise direction),
    from the squared norms $\|Z_0\|_F^2 = \operatorname{tr}K$ and $\|W\Sigma_0\|_F^2 =
    \operatorname{tr}(\Sigma_0^\top D\Sigma_0)$ of the two orthogonal parts of $G$ (no pass over $G$)."""
    level = 64.0 * max(shape[-2:]) * torch.finfo(dtype).eps ** 2
    return tangent2 <= level * (tangent2 + normal2)


def _check_points(W: torch.Tensor, G: torch.Tensor, where: str) -> None:
    """The stacks a Gram step takes: tall ``[B, m, n]`` points and a momentum of their shape, in
    one dtype, float32 or float64 (a wide stack had come back with entries of 1e18, 2-D or
    bf16 input failed inside torch). A wide point's geometry is its transpose's: pass
    ``W.mT``, ``G.mT`` (ManifoldMuon does, for a manifold that ``transposes_wide``)."""
    if W.dim() != 3 or W.shape != G.shape:
        raise ValueError(f"{where}: W {tuple(W.shape)} and G {tuple(G.shape)} must be stacks [B, m, n] of one shape")
    if W.size(-2) < W.size(-1):
        raise ValueError(f"{where}: W {tuple(W.shape)} is wide; the Gram form is stated for tall points: pass the "
                         "transposes W.mT, G.mT (and transpose the result back)")
    if W.dtype != G.dtype or W.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{where}: W ({W.dtype}) and G ({G.dtype}) must share float32 or float64 (the retraction's "
                         "dtype; settings.compute_dtype sets the products that only choose the direction)")


def gram_step(form: GramForm, W: torch.Tensor, G: torch.Tensor, lr: float | torch.Tensor,
              correction: torch.Tensor | None = None, settings: GramSettings = GramSettings(),
              shrink: float | torch.Tensor = 1.0) -> GramStep:
    r"""One steepest-descent step with retraction, $W \leftarrow R_{cW}(-\eta\hat A)$, in Gram space.

    Args:
        form: the manifold's :class:`~geomuon.manifolds.capabilities.GramForm`.
        W: tall points ``[B, m, n]`` ($m \ge n$) in the retraction dtype (fp32 or fp64).
        G: momentum ``[B, m, n]`` (the negative step direction), same dtype.
        lr: the step length $\eta$: a float, or a 0-dim tensor (a schedule on the device:
            it enters as a product, never read back; floats take ``torch.add``'s ``alpha``).
        correction: warm start $\Delta$ (multiplier shape), or ``None`` (zero).
        settings: :class:`GramSettings`.
        shrink: $c = 1 - \eta\lambda$ of decoupled weight decay, applied before the step
            (a float, or a 0-dim tensor like ``lr``).

    Returns:
        :class:`GramStep`. See the module docstring for the algorithm and the dtype of
        every product. With ``settings.solver == "projected"`` the step is
        :func:`projected_step`'s (``correction`` is then unused).

    Raises:
        ValueError: stacks :func:`unchecked_gram_step` cannot take, a ``correction`` of another
            shape, a float ``lr`` that is not a finite number >= 0 or ``shrink`` not > 0 (``lr=nan``
            had returned NaN points; a tensor is a schedule on the device, not read back).
    """
    if not isinstance(lr, torch.Tensor):
        check_real("gram_step", "lr", lr, lambda x: x >= 0, "a finite number >= 0")
    if not isinstance(shrink, torch.Tensor):
        check_real("gram_step", "shrink", shrink, lambda x: x > 0, "a finite number > 0")
    if settings.solver == "dual" and correction is not None:
        _check_points(W, G, "gram_step")  # first: the correction's shape is read off W's
        # a correction of another shape had broadcast over the stack or failed inside a product: that of
        # the form's constraint of an n x n stack, a previous gram_step's correction for this stack
        check_shape_of("gram_step", "correction", correction, form.constraint, W[..., :W.size(-1), :])
        return _dual_step(form, W, G, lr, correction, settings, shrink)
    return unchecked_gram_step(form, W, G, lr, correction, settings, shrink)


def unchecked_gram_step(form: GramForm, W: torch.Tensor, G: torch.Tensor, lr: float | torch.Tensor,
                        correction: torch.Tensor | None = None, settings: GramSettings = GramSettings(),
                        shrink: float | torch.Tensor = 1.0) -> GramStep:
    r""":func:`gram_step` without the check of ``correction``'s shape, for a caller whose
    correction is the one a previous step returned for the same stack (ManifoldMuon's warm
    starts; a loaded one is checked at :meth:`~geomuon.optimizers.ManifoldMuon.load_state_dict`):
    the check builds the constraint on meta tensors, on Stiefel 0.9 ms per call against 68 ms
    for a 1536x384 step on one CPU thread (ManifoldMuon steps one matrix per call there)."""
    if settings.solver == "projected":
        return projected_step(form, W, G, lr, settings, shrink)
    _check_points(W, G, "gram_step")
    return _dual_step(form, W, G, lr, correction, settings, shrink)


def _dual_step(form: GramForm, W: torch.Tensor, G: torch.Tensor, lr: float | torch.Tensor,
               correction: torch.Tensor | None, settings: GramSettings, shrink: float | torch.Tensor) -> GramStep:
    """The dual solver's step (the module docstring's algorithm) on stacks :func:`_check_points`
    has passed: :func:`gram_step` checks them before the correction, :func:`unchecked_gram_step`
    alone, each once. It runs on $G/s$ (:func:`~geomuon.manifolds.linalg.unit_scale`, whose Gram
    $K$ neither overflows nor underflows): the direction is $G$'s, and the correction and the dual
    factors are scaled back by $s$ (the multiplier is homogeneous of degree one in $G$)."""
    low = settings.compute_dtype or W.dtype
    scale = unit_scale(G)
    G = G / scale
    mulD = _PointGram(form, W, shrink, settings.stored_dtype)
    D = mulD.D
    B = _scale(W.mT @ G, shrink)
    sigma0 = form.project(D, B)
    Z0 = _baddbmm(G, W, sigma0, -shrink)
    D_sigma0 = mulD(sigma0)
    B0 = B - D_sigma0
    K = Z0.mT @ Z0
    trace_K = _trace(K)
    normal = _normal_only(trace_K, (sigma0 * D_sigma0).sum((-2, -1)), G.shape, G.dtype)
    if correction is None:
        delta = torch.zeros_like(form.constraint(B0))
    else:
        delta = correction.to(W.dtype) / per_matrix(scale.flatten(), correction, 1)
    S = form.adjoint(delta)
    for k in range(settings.dual_steps + 1):
        DS = mulD(S)
        Q = dual_gram(K, B0, S, DS)
        magnitude = trace_K + (S * DS).sum((-2, -1))  # tr K + tr S^T D S >= |tr 2 sym(B0^T S)|
        if settings.dualizer == "eigh":
            dual = eigen_dualizer(Q, magnitude, settings.smoothing, settings.shift_eps)
        else:
            dual = gram_msign(Q, settings.msign_steps, low, magnitude, settings.shift_eps)
        P = dual.P
        SP = S @ P
        M = torch.baddbmm(mulD(SP), B0, P)
        last = k == settings.dual_steps
        if not last or settings.carry:
            if settings.update == "newton":
                step = newton_update(form, D, dual, M, settings.alpha, low)
            else:
                step = jacobi_update(form, D, dual, M, settings.alpha)
            delta = delta + step
            if not last:
                S = S + form.adjoint(step)
    keep = (~normal).to(W.dtype)
    T1 = (SP - form.project(D, M)) * keep.reshape(*keep.shape, 1, 1)
    T2 = P * keep.reshape(*keep.shape, 1, 1)
    # ADMM's penalty: the last dual iterate's ||Z||_F = sqrt(tr Q) (0 where the step is zero)
    admm = settings.polish_method == "admm" and settings.polish_rounds
    dual = (S, _trace(Q).clamp_min(0).sqrt() * keep) if admm else None
    T1, T2 = polish(form, mulD, B0, K, T1, T2, settings.polish_rounds, UNIT_BALLS[settings.dualizer], dual)
    point = retract(form, W, Z0, T1, T2, lr, shrink, settings.retraction_terms,
                    far_inverse_sqrt(form, settings, lr, shrink, W.dtype))
    return GramStep(point=point, correction=delta * per_matrix(scale.flatten(), delta, 1),
                    direction_factors=(T1, T2 / scale, Z0 * scale, S * scale))


def projected_step(form: GramForm, W: torch.Tensor, G: torch.Tensor, lr: float | torch.Tensor,
                   settings: GramSettings = GramSettings(solver="projected", polish_rounds=2),
                   shrink: float | torch.Tensor = 1.0) -> GramStep:
    r"""The projected solver: no dual step, Muon's kernel on the $m\times n$ matrix, then polish.

    With $W' = cW$ and $P_W(X) = X - W\,\mathrm{project}(D, W^\top X)$ (the form's tangent
    projection at $W$, $D = W^\top W$; $cW$ has the same normal space),

    $$Z_0 = P_WG,\qquad \hat A_0 = P_W\operatorname{msign}(Z_0),\qquad
    \hat A_{k+1} = P_W\big(\hat A_k\,\phi(\hat A_k^\top\hat A_k)\big),\qquad
    W \leftarrow Y\rho(Y^\top Y),\quad Y = W' - \eta\hat A_r,$$

    $\operatorname{msign}$ by ``settings.msign_steps`` Polar Express steps
    (:func:`geomuon.manifolds.linalg.msign`), $\phi$ the unit-ball factor of
    :func:`polish` (:data:`UNIT_BALLS` by ``settings.dualizer``: one $n\times n$
    eigendecomposition per round with ``"eigh"``), $r$ = ``settings.polish_rounds`` and $\rho$
    the form's retraction factor. $Z_0$ is the dual iterate of the zero multiplier correction,
    so $\|Z_0\|_*$ bounds the optimum (``start`` of the result) and the certificate of
    :func:`~geomuon.optimizers.steepest.certified_ratio` applies unchanged.

    Why no dual step: inside GPT training (``bench/manifold_inrun.py``, Stiefel, 400 steps,
    mean / min certified fraction of the optimal descent against a 32-step reference solve)
    this direction with 0, 1 and 2 polish rounds reaches 0.945 / 0.911, 0.964 / 0.948 and
    0.969 / 0.956, where :func:`gram_step`'s warm-started dual without polish reaches
    0.911 / 0.844 with 0 dual steps and 0.933 / 0.898 with 1 (a warm start lags the momentum
    it was computed for; the projection start does not), and its default, 2 dual steps and 2
    rounds, 0.982 / 0.966 at about twice the cost. On DGram the dual steps matter more (2
    rounds: 0.916 / 0.790, the dual default 0.935 / 0.799).

    **Precision** ($u$ = the unit round-off of ``settings.compute_dtype``, bf16 by default; a
    product in ``compute_dtype`` rounds its inputs and its output to it, so it resolves
    nothing below $u$ times its output's size):

    * $Z_0$: $\Sigma_0 = \mathrm{project}(D, W^\top G)$ with the product in ``compute_dtype``,
      then $G - W\Sigma_0$ in ``W.dtype``, so that the rounding of $\Sigma_0$ (about $u\|G\|_F$)
      becomes a normal vector, which one more projection in ``compute_dtype`` removes to
      $u\|Z_0\|_F + u^2\|G\|_F$ (its output is that small). Near a constrained optimum the
      momentum is mostly normal and its tangent part is all that matters: a projection in
      ``compute_dtype`` alone would leave a residual of $u\|G\|_F$ that swamps it. A matrix
      whose tangent part is below $4\varepsilon_{\rm low}^2\|G\|_F$ ($\varepsilon_{\rm low}$ the
      machine epsilon of ``compute_dtype``: $2.4\cdot10^{-4}\|G\|_F$ in bf16; with
      ``compute_dtype`` as precise as the points, :func:`gram_step`'s floor
      $8\sqrt{\max(m,n)}\,\varepsilon\,\|G\|_F$) cannot be told from the rounding; its direction
      is set to zero.
    * The polar factor, the projections of the direction and the polish's Gram
      $\hat A^\top\hat A$ (rounded to ``compute_dtype`` before its eigendecomposition in
      ``W.dtype``) only choose the direction: it is tangent to about $u$.
    * The retraction in ``W.dtype``: $Y^\top Y$ (an $O(1)$ output rounded to $u$ would be a
      feasibility error of $u$) and $Y\rho$ (on DGram $\rho - I$ is of order one once a column
      norm falls to the step's order). Measuring $Y^\top Y$ also removes the direction's
      normal part of order $u$ to second order.

    Cost per tall $m\times n$ matrix (products of $m\times n$ by $n\times n$ are the unit): the
    polar factor (two per Polar Express step, as Muon), five more in ``compute_dtype``
    ($W^\top G$, the refinement's two, the projection of the polar factor's two), three in
    ``W.dtype`` ($W\Sigma_0$, $Y^\top Y$, $Y\rho$), and per polish round four in
    ``compute_dtype`` and one eigendecomposition. All
    per matrix with fixed iteration counts: no host read, and no matrix depends on its
    batch-mates. Every map is a polynomial in, a spectral function of or a projection by
    Gram matrices of $W$, $G$ and the direction, so the step keeps the manifold's
    equivariance (up to round-off).
    """
    _check_points(W, G, "projected_step")
    low = settings.compute_dtype or W.dtype
    scale = unit_scale(G)  # as in gram_step: no norm below over- or underflows; `start` scaled back
    G = G / scale
    # projections at W itself (cW has the same normal space)
    D = _PointGram(form, W, 1.0, settings.stored_dtype).D
    W_low = W.to(low)

    def multiplier(X: torch.Tensor) -> torch.Tensor:  # project(D, W^T X), the product in compute_dtype
        return form.project(D, (W_low.mT @ X.to(low)).to(W.dtype))

    def tangent(X: torch.Tensor) -> torch.Tensor:  # P_W X of an X in compute_dtype, in compute_dtype
        return X - W_low @ multiplier(X).to(low)

    Z0 = G - W @ multiplier(G)  # exact W: the multiplier's rounding error is a normal vector
    Z0 = Z0 - (W_low @ multiplier(Z0).to(low)).to(W.dtype)  # which one refinement removes to u^2 |G|
    # the rounding left: u^2 |G| from the products, or the subtraction's own in W.dtype
    # (gram_step's floor, 8 sqrt(max(m, n)) eps |G|) when compute_dtype is as precise
    floor = max(4 * torch.finfo(low).eps ** 2, 8 * max(W.shape[-2:]) ** 0.5 * torch.finfo(W.dtype).eps)
    resolved = Z0.square().sum((-2, -1), keepdim=True) > floor**2 * G.square().sum((-2, -1), keepdim=True)
    A = tangent(msign(Z0.to(low), coefficients=POLAR_EXPRESS, steps=settings.msign_steps))
    unit_ball = UNIT_BALLS[settings.dualizer]
    for _ in range(settings.polish_rounds):
        A = tangent(A @ unit_ball((A.mT @ A).to(W.dtype)).to(low))
    A = A.to(W.dtype) * resolved
    new_point = gram_retraction(form, _scale(W, shrink), -lr * A, settings.retraction_terms,
                                far_inverse_sqrt(form, settings, lr, shrink, W.dtype))
    zero, eye = torch.zeros_like(D), torch.eye(W.size(-1), dtype=W.dtype, device=W.device).expand_as(D)
    return GramStep(point=new_point, correction=None, direction_factors=(zero, eye, A, zero), start=Z0 * scale)


class _PointGram:
    r"""$D = c^2W^\top W$ and $X \mapsto DX$ for the direction (projections, dual iterates).

    On a manifold whose form declares ``diagonal_gram`` (Stiefel, DGram: $W^\top W$ is
    diagonal on the manifold) $D$ is the diagonal of squared column norms, computed
    elementwise in ``W.dtype``; the off-diagonal part it leaves out is $W$'s own feasibility
    error (fp32 round-off), far below what a bf16 product of $W$ would add ($u/\sqrt m$).
    Points stored in a narrower dtype (``stored``: bf16 weights, off the manifold by
    $3\cdot10^{-3}$) and forms without the declaration (Oblique) take the full product in
    ``W.dtype``: a diagonal $D$ inconsistent with such a point had driven the dual to a
    direction of norm 579 and the weights to $10^{12}$ in one step. The retraction measures
    the new point's Gram itself, so $D$ never decides feasibility.
    """

    def __init__(self, form: GramForm, W: torch.Tensor, shrink: float, stored: torch.dtype | None = None) -> None:
        if form.diagonal_gram and stored is None:
            self.diagonal = ((shrink * shrink) * torch.linalg.vector_norm(W, dim=-2).square()).unsqueeze(-1)
            self.D = torch.diag_embed(self.diagonal.squeeze(-1))
        else:
            self.diagonal = None
            self.D = (shrink * shrink) * (W.mT @ W)

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        return self.diagonal * X if self.diagonal is not None else self.D @ X
