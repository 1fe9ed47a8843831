r"""The Gram-space steepest-descent step: dual iterations in $n\times n$, one $m\times n$ assembly.

For a manifold that declares a :class:`~geomuon.manifolds.capabilities.GramForm` (Stiefel,
DGram, Oblique) and the spectral norm, one optimizer step on a tall stack $W$ with
momentum $G$ is an exact reformulation of the engine of
:mod:`geomuon.optimizers.steepest` (projection start, Jacobi-preconditioned dual ascent,
final tangent projection) followed by the manifold's retraction:

1. $D = W^\top W$, $B = W^\top G$, $\Sigma_0 = \mathrm{project}(D, B)$, the tangent part
   $Z_0 = P_WG = G - W\Sigma_0$, $B_0 = W^\top Z_0 = B - D\Sigma_0$ and $K = Z_0^\top Z_0$.
2. Dual iterates $Z = Z_0 + WS$, $S = \mathrm{adjoint}(\Delta)$ for the multiplier
   correction $\Delta$ (the warm start): $Q = Z^\top Z = K + B_0^\top S + S^\top B_0 + S^\top DS$,
   $P \approx Q^{-1/2}$ by Polar Express on the Cholesky factor of $Q$ (:func:`gram_msign`:
   $\operatorname{msign}(Z) = ZP$),
   $W^\top\operatorname{msign}(Z) = M = B_0P + DSP$, $H = \mathcal C(M)$ (the dual gradient),
   $\Delta \leftarrow \Delta - \alpha\,\sigma\,H\oslash\operatorname{diag}(LL^*)$ with
   $\sigma = \operatorname{tr}(QP)/\|ZP\|_F^2$ (:func:`jacobi_update`).
3. The direction $\hat A = P_W(ZP) = WT_1 + Z_0T_2$, $T_1 = SP - \mathrm{project}(D, M)$,
   $T_2 = P$, and the retraction folded into its assembly:
   $R_W(-\eta\hat A) = Y\rho(Y^\top Y)$, $Y = W(I - \eta T_1) - \eta Z_0T_2$ (:func:`retract`).

**Precision** (the dtype of every product; $u = 2^{-8}$ is bf16's unit round-off):

* fp32 (the parameter's retraction dtype; fp64 for fp64): $B = W^\top G$ and $Z_0$ (a
  gradient that is mostly normal keeps its small tangent part only if the projection is
  formed to fp32 accuracy), $K = Z_0^\top Z_0$ and $Q$ (the Cholesky factorization needs $Q$
  positive definite; a bf16 Gram is not, at the round-off of its largest entries), the
  Cholesky factor and the triangular solve, and the retraction: $Y$, $Y^\top Y$ and
  $Y\rho$ (feasibility: the new point is as close to the manifold as these are exact).
* $D$: the squared column norms (elementwise, exact) where the form declares
  ``diagonal_gram``, else an fp32 product.
* bf16 (``compute_dtype``): the Polar Express products on the Cholesky factor, and the
  $n\times n$ products that only choose the direction ($SP$, $B_0P$): their error lowers the direction's quality by $O(u)$,
  which the certificate measures, and never moves the point off the manifold.

CPU bf16 matrix products round their output to bf16 (torch has no fp32-output bf16
``mm`` on CPU), so split-precision products cannot recover fp32 accuracy from bf16 units:
the fp32 products above are the floor of this step's cost on such a machine.

Everything is a polynomial in, or a conjugation of, these Gram matrices, so the map is
equivariant under the manifold's symmetry group (up to round-off), and no step reads a
value back to the host: the iteration counts are fixed by the settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geomuon.manifolds.capabilities import GramForm
from geomuon.manifolds.linalg import POLAR_EXPRESS

__all__ = ["GramSettings", "GramStep", "gram_step", "gram_msign", "jacobi_update", "retract"]


@dataclass(frozen=True)
class GramSettings:
    r"""Settings of :func:`gram_step`.

    Attributes:
        dual_steps: dual iterations whose result is dualized again within the step (each
            costs one :func:`gram_msign`; 0: the direction is $\Phi$ of the warm-started
            iterate).
        carry: take one more dual step after the last iterate, into the returned
            correction only (the next step's warm start): the dual ascent then advances
            one step per optimizer step at the price of one $n\times n$ product.
        alpha: the Jacobi step size (in units of the preconditioned Newton-like step).
        msign_steps: Polar Express steps of :func:`gram_msign` (6: singular values within
            $[0.9935, 1.0012]$ in exact arithmetic).
        compute_dtype: dtype of the dual iterations' products (``None``: the parameter's).
        retraction_terms: terms of the retraction's inverse-square-root series
            (:func:`geomuon.manifolds.capabilities.inv_sqrt_near_identity`).
    """

    dual_steps: int = 0
    carry: bool = True
    alpha: float = 1.0
    msign_steps: int = 6
    compute_dtype: torch.dtype | None = torch.bfloat16
    retraction_terms: int = 6

    def __post_init__(self) -> None:
        if self.dual_steps < 0:
            raise ValueError(f"GramSettings: dual_steps must be >= 0, got {self.dual_steps}")
        if self.msign_steps < 1:
            raise ValueError(f"GramSettings: msign_steps must be >= 1, got {self.msign_steps}")


@dataclass
class GramStep:
    """Output of :func:`gram_step`: the new points and the next warm start.

    Attributes:
        point: $R_W(-\\eta\\hat A)$, ``[..., m, n]`` in ``W.dtype``.
        correction: the multiplier correction $\\Delta$ (multiplier shape), to pass back.
        direction_factors: ``(T1, T2, Z0, S)`` with $\\hat A = WT_1 + Z_0T_2$ and the last dual
            iterate $Z = Z_0 + WS$ (for certificates).
    """

    point: torch.Tensor
    correction: torch.Tensor
    direction_factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _low_mm(X: torch.Tensor, Y: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """$XY$ with the product in ``low``, returned in ``X.dtype``."""
    return (X.to(low) @ Y.to(low)).to(X.dtype)


def gram_msign(Q: torch.Tensor, steps: int, low: torch.dtype,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""$P = Q^{-1/2}$ (to the dualizer's accuracy) such that $\operatorname{msign}(Z) = ZP$ for $Q = Z^\top Z$.

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
    damps singular values below about $(n^{3/2}\varepsilon)^{1/2}\sigma_{\max}$ ($0.02$ at
    $n = 384$ in fp32). A matrix whose factorization still fails gets $P = 0$ (a zero step)
    rather than NaN.
    Dtypes: Cholesky and the triangular solve in ``Q.dtype`` (fp32/fp64), the Polar Express
    products in ``low``.

    Returns:
        ``(P, frobenius2)`` in ``Q.dtype``: $P$ ``[..., n, n]`` and
        $\|\operatorname{msign}(Z)\|_F^2 = \|\operatorname{msign}(C)\|_F^2$ ``[...]``.
    """
    n = Q.size(-1)
    eye = torch.eye(n, dtype=Q.dtype, device=Q.device)
    trace = torch.diagonal(Q, dim1=-2, dim2=-1).sum(-1)
    finfo = torch.finfo(Q.dtype)
    scale = trace if scale is None else scale
    shift = (n**0.5 * finfo.eps * scale + finfo.tiny ** 0.5).reshape(*trace.shape, 1, 1)
    C, info = torch.linalg.cholesky_ex(Q + shift * eye, upper=True)
    norm = (trace.reshape(*trace.shape, 1, 1) + n * shift).sqrt()  # ||C||_F
    X = (C / (norm * POLAR_EXPRESS.input_scale)).to(low)
    for a, b, c in POLAR_EXPRESS.step_coefficients(steps):
        S = X.mT @ X
        X = torch.baddbmm(X, X, torch.baddbmm(S, S, S, beta=b, alpha=c), beta=a)
    X = X.to(Q.dtype)
    ok = info == 0
    P = torch.linalg.solve_triangular(C, X, upper=True)
    P = torch.where(ok.reshape(*info.shape, 1, 1), P, torch.zeros_like(P))
    return P, torch.where(ok, X.square().sum((-2, -1)), torch.zeros_like(trace))


def jacobi_update(form: GramForm, D: torch.Tensor, Q: torch.Tensor, P: torch.Tensor, frobenius2: torch.Tensor,
                  M: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""The Jacobi-preconditioned dual step $-\alpha\,\sigma\,\mathcal C(M)\oslash\operatorname{diag}(LL^*)$.

    $\mathcal C(M) = L_W(\operatorname{msign} Z)$ is scale-free while the multiplier scales
    with $G$: a change $\delta$ of $\Lambda$ moves $\operatorname{msign}(Z)$ by about
    $L^*(\delta)/\sigma$, so the step carries $\sigma = \langle Z, A\rangle/\langle A, A\rangle
    = \operatorname{tr}(QP)/\|A\|_F^2$, $Z$'s typical singular value ($\operatorname{tr}(QP)$
    elementwise, in ``Q.dtype``; a product $QP$ would cancel: $\|Q\|\|P\| \gg \|QP\|$).
    """
    H = form.constraint(M)
    tiny = torch.finfo(Q.dtype).tiny
    sigma = (Q * P.mT).sum((-2, -1)) / frobenius2.clamp_min(tiny)
    diag = form.gram_diag(D)
    sigma = sigma.reshape(sigma.shape + (1,) * (H.dim() - sigma.dim()))
    return torch.where(diag > 0, (-alpha * sigma) * H / diag.clamp_min(tiny), torch.zeros_like(H))


def retract(form: GramForm, W: torch.Tensor, Z0: torch.Tensor, T1: torch.Tensor, T2: torch.Tensor,
            lr: float, shrink: float = 1.0, terms: int = 6) -> torch.Tensor:
    r"""$R_{W'}(-\eta\hat A) = Y\rho(Y^\top Y)$ with $Y = W' - \eta(W'T_1 + Z_0T_2) = W\,c(I - \eta T_1) - \eta Z_0T_2$,
    $W' = cW$: the $m\times n$ assembly, the measured Gram $Y^\top Y$ and the right factor, all
    in ``W.dtype``.

    $Y^\top Y$ is measured rather than formed from $D$, $W^\top\hat A$ and $\hat A^\top\hat A$:
    that sum reaches $T_2^\top KT_2$ with $T_2 \approx Q^{-1/2}$, which amplifies any error of
    $K$ by $\operatorname{cond}(Z_0)^2$ (measured: $\|W^\top W - I\|_{\max} = 1.7\cdot10^{-5}$
    after one fp32 step on a rank-deficient gradient). Measured, the new point is as
    feasible as the form's retraction is accurate, whatever the direction's rounding.
    """
    eye = torch.eye(T1.size(-1), dtype=T1.dtype, device=T1.device)
    Y = torch.baddbmm(W @ (shrink * (eye - lr * T1)), Z0, T2, alpha=-lr)
    return Y @ form.retraction_factor(Y.mT @ Y, terms)


def _trace(X: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(X, dim1=-2, dim2=-1).sum(-1)


def _normal_only(Z0: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    r"""Per matrix: $\|P_WG\|_F \le 8\sqrt{\max(m, n)}\,\varepsilon\,\|G\|_F$ (the tangent part
    is round-off of the projection; dualizing it would take a unit step in a noise direction)."""
    level = 8.0 * max(G.shape[-2:]) ** 0.5 * torch.finfo(G.dtype).eps
    return Z0.norm(dim=(-2, -1)) <= level * G.norm(dim=(-2, -1))


def gram_step(form: GramForm, W: torch.Tensor, G: torch.Tensor, lr: float,
              correction: torch.Tensor | None = None, settings: GramSettings = GramSettings(),
              shrink: float = 1.0) -> GramStep:
    r"""One steepest-descent step with retraction, $W \leftarrow R_{cW}(-\eta\hat A)$, in Gram space.

    Args:
        form: the manifold's :class:`~geomuon.manifolds.capabilities.GramForm`.
        W: tall points ``[B, m, n]`` ($m \ge n$) in the retraction dtype (fp32 or fp64).
        G: momentum ``[B, m, n]`` (the negative step direction), same dtype.
        lr: the step length $\eta$.
        correction: warm start $\Delta$ (multiplier shape), or ``None`` (zero).
        settings: :class:`GramSettings`.
        shrink: $c = 1 - \eta\lambda$ of decoupled weight decay, applied before the step.

    Returns:
        :class:`GramStep`. See the module docstring for the algorithm and the dtype of
        every product.
    """
    low = settings.compute_dtype or W.dtype
    mulD = _PointGram(form, W, shrink)
    D = mulD.D
    B = shrink * (W.mT @ G)
    sigma0 = form.project(D, B)
    Z0 = torch.baddbmm(G, W, sigma0, alpha=-shrink)
    normal = _normal_only(Z0, G)
    B0 = B - mulD(sigma0)
    K = Z0.mT @ Z0
    delta = torch.zeros_like(form.constraint(B0)) if correction is None else correction.to(W.dtype)
    S = form.adjoint(delta)
    for k in range(settings.dual_steps + 1):
        BtS = B0.mT @ S
        SDS = S.mT @ mulD(S)
        Q = K + BtS + BtS.mT + SDS
        magnitude = _trace(K) + _trace(SDS)  # >= |tr 2 sym(B0^T S)|, by Cauchy-Schwarz
        P, frobenius2 = gram_msign(Q, settings.msign_steps, low, magnitude)
        SP = _low_mm(S, P, low)
        M = _low_mm(B0, P, low) + mulD(SP)
        last = k == settings.dual_steps
        if not last or settings.carry:
            step = jacobi_update(form, D, Q, P, frobenius2, M, settings.alpha)
            delta = delta + step
            if not last:
                S = S + form.adjoint(step)
    keep = (~normal).to(W.dtype).reshape(*normal.shape, 1, 1)
    T1 = (SP - form.project(D, M)) * keep
    T2 = P * keep
    point = retract(form, W, Z0, T1, T2, lr, shrink, settings.retraction_terms)
    return GramStep(point=point, correction=delta, direction_factors=(T1, T2, Z0, S))


class _PointGram:
    r"""$D = c^2W^\top W$ and $X \mapsto DX$ for the direction (projections, dual iterates).

    On a manifold whose form declares ``diagonal_gram`` (Stiefel, DGram: $W^\top W$ is
    diagonal on the manifold) $D$ is the diagonal of squared column norms, computed
    elementwise in ``W.dtype``; the off-diagonal part it leaves out is $W$'s own feasibility
    error (fp32 round-off), far below what a bf16 product of $W$ would add ($u/\sqrt m$).
    Otherwise (Oblique) $D$ is the full product in ``W.dtype``. The retraction measures the
    new point's Gram itself, so $D$ never decides feasibility.
    """

    def __init__(self, form: GramForm, W: torch.Tensor, shrink: float) -> None:
        if form.diagonal_gram:
            self.diagonal = ((shrink * shrink) * W.square().sum(-2)).unsqueeze(-1)
            self.D = torch.diag_embed(self.diagonal.squeeze(-1))
        else:
            self.diagonal = None
            self.D = (shrink * shrink) * (W.mT @ W)

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        return self.diagonal * X if self.diagonal is not None else self.D @ X
