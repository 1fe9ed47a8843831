r"""Optional capabilities a manifold declares so the steepest-descent engine can go fast.

The engine asks, the manifold declares (geoopt's pattern); a manifold that declares
nothing gets the general path of :func:`geomuon.optimizers.steepest.steepest_direction`.

**Gram-space form** (:class:`GramForm`, the attribute ``MatrixManifold.gram_form``). For
constraints of the form $L_W(A) = \mathcal C(W^\top A)$ with adjoint
$L_W^*(\Lambda) = W\,S(\Lambda)$ (Stiefel, DGram, Oblique), every quantity of the dual
iterations is an $n\times n$ matrix ($n$ the short side): with $Z = G + WS$,

$$Z^\top Z = G^\top G + B^\top S + S^\top B + S^\top D S,\qquad B = W^\top G,\ D = W^\top W,$$

$\operatorname{msign}(Z) = Z\,(Z^\top Z)^{-1/2}$, $W^\top\operatorname{msign}(Z) = (B + DS)(Z^\top Z)^{-1/2}$,
so the $m\times n$ work of a step is $G^\top G$, $W^\top G$, $W^\top W$ and one assembly
$W T_1 + G T_2$ (Polar Express, arXiv 2505.16932, appendix F; Dao-AILab's Gram
Newton–Schulz). A form also carries the manifold's retraction as a right factor of its
Gram matrix: $R_W(V) = Y\,\rho(Y^\top Y)$ with $Y = W + V$, so the retraction folds into the
same assembly. Every map takes and returns tensors of the tall orientation ($m \ge n$;
a manifold with ``transposes_wide`` hands wide points to the engine transposed).

**Dualizer closed form** (``MatrixManifold.dualizer_keeps_tangent(x, norm)``): whether
the norm's dualizer maps a tangent vector at ``x`` to a tangent vector, so that
$\Phi(P_xG)$ is the steepest direction without dual steps.
"""

from __future__ import annotations

import torch

from .linalg import check_count, check_real, eigh, off_diagonal

#: The polish methods a form may declare as ManifoldMuon's default (the engine's
#: :func:`geomuon.optimizers.gram.polish` implements them).
POLISH_METHODS = ("admm", "alternating")

#: The largest relaxation of the Gram path's dual step (``newton_alpha``, ManifoldMuon's
#: ``dual_alpha``, ``GramSettings.alpha``): a relaxed fixed-point step $\Delta \leftarrow \Delta +
#: \alpha\,\delta$ contracts for $\alpha \in (0, 2)$ and reflects past the fixed point beyond; warm
#: started, the multipliers then grow without bound (measured, 12 x 6, 40 steps, 4 seeds: at 2.0 they
#: stay below 0.5 on Stiefel, DGram and Oblique, at 2.2 Stiefel's reached 2e7; at 4.0 a 6 x 3 Oblique
#: run wrote NaN weights).
MAX_DUAL_ALPHA = 2.0
#: What a dual step size must be, as its refusals say it (``newton_alpha``, ``dual_alpha``, ``alpha``).
DUAL_ALPHA_RANGE = f"a number in (0, {MAX_DUAL_ALPHA:g}] (beyond, the warm-started dual step diverges)"


def admissible_dual_alpha(alpha: float) -> bool:
    """Whether ``alpha`` is a dual step size in (0, :data:`MAX_DUAL_ALPHA`]."""
    return 0 < alpha <= MAX_DUAL_ALPHA


__all__ = ["GramForm", "inv_sqrt_near_identity", "inv_sqrt_unit_diagonal", "exact_inverse_sqrt", "spectral_function",
           "series_radius", "gram_retraction", "SERIES_MAX_TERMS", "POLISH_METHODS", "MAX_DUAL_ALPHA",
           "DUAL_ALPHA_RANGE", "admissible_dual_alpha"]

#: $\binom{-1/2}{k}$, the coefficients of $(I + E)^{-1/2} = \sum_k c_k E^k$.
_INV_SQRT_SERIES = (1.0, -0.5, 0.375, -0.3125, 0.2734375, -0.24609375, 0.2255859375)
#: The most terms :func:`inv_sqrt_near_identity` takes (the coefficients above).
SERIES_MAX_TERMS = len(_INV_SQRT_SERIES) - 1


def inv_sqrt_near_identity(E: torch.Tensor, terms: int = 6, *, low_dtype: torch.dtype | None = None) -> torch.Tensor:
    r"""$(I + E)^{-1/2} \approx \sum_{k=0}^{\text{terms}} \binom{-1/2}{k} E^k$ for symmetric ``E`` ``[..., n, n]``.

    Truncation error $\le |c_{K+1}|\,\|E\|_2^{K+1}/(1 - \|E\|_2)$ ($K$ = ``terms``;
    $c_7 \approx 0.21$): $2\cdot10^{-8}$ at $\|E\|_2 = 0.1$ with the default 6 terms (3 terms
    left $1.4\cdot10^{-5}$ on a DGram step whose smallest column norm was $1/126$ of the
    largest). A polynomial in $E$, so it commutes with every orthogonal change of basis.

    Three $n\times n$ products for 4–6 terms (Paterson–Stockmeyer: $E^2$, $E^3$, then
    $E^3(c_4E + c_5E^2 + c_6E^3)$). Dtypes: $E^2$, $E^3$ in ``E.dtype``; the tail product of
    the terms $k\ge4$ in ``low_dtype`` (default: bf16 for float32 ``E``, whose relative
    error $2^{-8}$ on terms of size $\|E\|^4$ stays below $4\cdot10^{-7}$ while
    $\|E\| \le 0.1$; ``E.dtype`` otherwise). Returns ``E.dtype``.
    """
    if low_dtype is None:
        low_dtype = torch.bfloat16 if E.dtype == torch.float32 else E.dtype
    if not 0 <= terms <= SERIES_MAX_TERMS:
        raise ValueError(f"inv_sqrt_near_identity: terms must be in [0, {SERIES_MAX_TERMS}], got {terms}")
    eye = torch.eye(E.size(-1), dtype=E.dtype, device=E.device)
    if terms == 0:
        return eye.expand_as(E).clone()
    powers = [eye, E]
    for _ in range(2, min(terms, 3) + 1):
        powers.append(powers[-1] @ E)
    out = eye + _INV_SQRT_SERIES[1] * E
    for k in range(2, min(terms, 3) + 1):
        out = out + _INV_SQRT_SERIES[k] * powers[k]
    if terms >= 4:  # Paterson-Stockmeyer: E^3 (c_4 E + c_5 E^2 + c_6 E^3), one product for the tail
        tail = _INV_SQRT_SERIES[4] * E
        for k in range(5, terms + 1):
            tail = tail + _INV_SQRT_SERIES[k] * powers[k - 3]
        out = out + (powers[3].to(low_dtype) @ tail.to(low_dtype)).to(E.dtype)
    return out


def series_radius(terms: int, dtype: torch.dtype) -> float:
    r"""The largest $r$ with truncation bound $|c_{K+1}|\,r^{K+1}/(1 - r) \le \varepsilon$ (the
    dtype's unit round-off) for :func:`inv_sqrt_near_identity` with $K$ = ``terms``: within
    $\|E\|_2 \le r$ the series is exact to working precision. $0.126$ for 6 terms in fp32,
    $0.0072$ in fp64. A float computed on the host from the settings (no tensor is read)."""
    c_next = abs(_INV_SQRT_SERIES[terms]) * (terms + 0.5) / (terms + 1)  # |c_{K+1}| = |c_K| (K + 1/2)/(K + 1)
    eps, r = torch.finfo(dtype).eps, 0.0
    for _ in range(50):  # the fixed point r = (eps (1 - r)/|c_{K+1}|)^{1/(K+1)}: a contraction on [0, 1)
        r = (eps * (1 - r) / c_next) ** (1 / (terms + 1))
    return r


def spectral_function(S: torch.Tensor, f) -> torch.Tensor:
    r"""$V\operatorname{diag}(f(\lambda))V^\top$ for symmetric ``S`` $= V\Lambda V^\top$
    (:func:`geomuon.manifolds.linalg.eigh` in ``S.dtype``; ``f`` maps the eigenvalues ``[..., n]``).
    On CUDA ``eigh`` reads its convergence flag back to the host."""
    lam, V = eigh(S)
    return (V * f(lam).unsqueeze(-2)) @ V.mT


def exact_inverse_sqrt(N: torch.Tensor) -> torch.Tensor:
    r"""$N^{-1/2}$ of symmetric positive definite ``N`` by :func:`spectral_function` (eigenvalues
    clamped at the dtype's ``tiny``)."""
    return spectral_function(N, lambda lam: lam.clamp_min(torch.finfo(N.dtype).tiny).rsqrt())


def inv_sqrt_unit_diagonal(N: torch.Tensor, terms: int = 6, far=exact_inverse_sqrt) -> torch.Tensor:
    r"""$N^{-1/2}$ for symmetric positive definite ``N`` ``[..., n, n]`` near the identity, in ``N.dtype``.

    Per matrix: the series :func:`inv_sqrt_near_identity` in $E = N - I$ where
    $\|E\|_F \le$ :func:`series_radius` (its truncation is below round-off there; the norm
    bounds $\|E\|_2$), else ``far`` $(N)$ (any $R$ with $R^\top NR = I$; default
    :func:`exact_inverse_sqrt`, an eigendecomposition; the engine passes a matrix-product one
    with its Polar Express dualizer, :func:`geomuon.optimizers.gram.polynomial_inverse_sqrt`);
    selected with ``torch.where`` (no host read on CPU). The series and the exact map are
    spectral functions of $N$, so the map commutes with every orthogonal change of basis. The series alone diverges for
    $\|E\|_2 \ge 1$: a DGram retraction meets that when a column norm falls to the order of
    the step ($N$'s off-diagonal entries are $O(\eta^2/(d_id_j))$), a Stiefel retraction
    when the step's length nears one. ``far=None``: the caller has bounded $\|E\|_2$
    within the radius a priori (:meth:`GramForm.series_covers`); the series alone, with no
    eigendecomposition.

    An array of exact expressions (:class:`geomuon.theory.symbolic.ExactTensor`, the Taylor
    expansion at $E = 0$ that the symbolic certificates take) gets the series, which is
    the map's expansion there.
    """
    eye = torch.eye(N.size(-1), dtype=N.dtype, device=N.device)
    E = N - eye
    series = inv_sqrt_near_identity(E, terms)
    if far is None or not isinstance(N, torch.Tensor):
        return series
    near = torch.linalg.matrix_norm(E) <= series_radius(terms, N.dtype)
    return torch.where(near.unsqueeze(-1).unsqueeze(-1), series, far(N))


def _diag(M: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(M, dim1=-2, dim2=-1)


class GramForm:
    r"""The $n\times n$ form of a manifold's tangent constraint and retraction.

    Subclasses define, for a tall point $W$ with $D = W^\top W$ (all ``[..., n, n]``
    unless said otherwise; the multiplier has the manifold's multiplier shape):

    * :meth:`project`: $\Sigma$ with $P_W(X) = X - W\Sigma$, from $M = W^\top X$;
    * :meth:`constraint`: $L_W(A)$ from $M = W^\top A$;
    * :meth:`adjoint`: $S$ with $L_W^*(\Lambda) = WS$;
    * :meth:`gram_diag`: the diagonal of $L_WL_W^*$ (the Jacobi preconditioner);
    * :meth:`retraction_factor`: $\rho$ with $R_W(V) = (W + V)\,\rho\big((W+V)^\top(W+V)\big)$.

    Attributes:
        diagonal_gram: whether $W^\top W$ is diagonal at every point of the manifold (then
            the engine takes $D$ from the column norms, with no $m\times n$ product).
        has_newton: whether the form declares :meth:`newton_increment`, the closed-form
            Newton step (Su's Lyapunov equation solved in $Q$'s eigenbasis, exact for $D = I$;
            it needs the eigenvectors of the ``"eigh"`` dualizer).
        newton_cg_steps: $k > 0$: the form's Newton step can be taken as $k$ preconditioned
            conjugate-gradient iterations on :meth:`newton_operator` (with
            :meth:`newton_diagonal`): the step of a form whose $D$ is not the identity, and of
            every dualizer without eigenvectors; 0: none. A form with neither takes Jacobi steps.
        dual_steps: ManifoldMuon's default dual steps per optimizer step on this manifold
            (chosen on the certificate inside GPT training, ``bench/manifold_inrun.py``).
        cold_dual_steps: the fewest dual steps ManifoldMuon takes by default, with warm
            starts on, in a step that has no warm start yet (a run's first step): a warm
            start is worth about one dual step (``bench/manifold_frontier.py``'s cold rows
            certify like the warm rows with one step fewer), so a form whose default leaves
            the cold step short declares more. 0: ``dual_steps`` serves.
        polish_rounds: ManifoldMuon's default rounds of
            :func:`geomuon.optimizers.gram.polish` on this manifold (chosen likewise).
        polish_method: ManifoldMuon's default method of those rounds on this manifold,
            one of :data:`POLISH_METHODS` (``"admm"``: from the dual
            iterate, toward the optimum; ``"alternating"``: alternating projections, toward
            the feasible set; chosen likewise).
        newton_alpha: ManifoldMuon's default dual step size of the Newton update on this
            manifold, in units of the full step (1: Su's fixed point as solved). Su's step
            holds $P = (Z^\top Z)^{-1/2}$ fixed and ignores its change along the step (and
            conjugate gradients truncate it); where its full step is measured to fall short
            of the dual optimum, the form over-relaxes ($> 1$).
        retraction_order: the order of the retraction $Y\rho(Y^\top Y)$ (1: a retraction,
            $R_W(tV) = W + tV + O(t^2)$; 2: second order, the curve's acceleration at 0
            is normal).

    Every map must be equivariant under the manifold's symmetry group acting on $n\times n$
    quantities by conjugation, and computes in its inputs' dtype.
    """

    diagonal_gram = False
    retraction_order = 1
    has_newton = False
    newton_cg_steps = 0
    dual_steps = 1
    cold_dual_steps = 0
    polish_rounds = 0
    polish_method = "admm"
    newton_alpha = 1.0

    def invalid_defaults(self) -> list[str]:
        """What is wrong with the optimizer defaults this form declares, one message each (empty:
        nothing): whole step and round counts >= 0, ``retraction_order`` >= 1, ``newton_alpha``
        in (0, :data:`MAX_DUAL_ALPHA`], ``polish_method`` one of :data:`POLISH_METHODS`. ManifoldMuon refuses a
        form with any (``dual_steps = 2.5`` had run as 2 steps) and the manifold contract reports
        them."""
        where = f"the Gram form {type(self).__name__}"
        invalid = []
        for name in ("dual_steps", "cold_dual_steps", "polish_rounds", "newton_cg_steps", "retraction_order"):
            try:
                check_count(where, name, getattr(self, name), 1 if name == "retraction_order" else 0)
            except ValueError as err:
                invalid.append(str(err))
        try:
            check_real(where, "newton_alpha", self.newton_alpha, admissible_dual_alpha, DUAL_ALPHA_RANGE)
        except ValueError as err:
            invalid.append(str(err))
        if self.polish_method not in POLISH_METHODS:
            invalid.append(f"{where}: polish_method must be one of {POLISH_METHODS}, got {self.polish_method!r}")
        return invalid

    @property
    def declares_newton(self) -> bool:
        """Whether the engine's ``"newton"`` update has a Newton step on this form (closed form or CG)."""
        return self.has_newton or self.newton_cg_steps > 0

    def project(self, D: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """$\\Sigma$ with $P_W(X) = X - W\\Sigma$, from $D = W^\\top W$ and $M = W^\\top X$."""
        raise NotImplementedError

    def constraint(self, M: torch.Tensor) -> torch.Tensor:
        """$L_W(A)$ from $M = W^\\top A$ (multiplier-shaped)."""
        raise NotImplementedError

    def adjoint(self, lam: torch.Tensor) -> torch.Tensor:
        r"""$S$ with $L_W^*(\Lambda) = WS$, ``[..., n, n]``."""
        raise NotImplementedError

    def gram_diag(self, D: torch.Tensor) -> torch.Tensor:
        """Diagonal of $L_WL_W^*$ from $D$ (multiplier-shaped, positive): the Jacobi step's
        preconditioner, exact on the manifold (the contract checks it there)."""
        raise NotImplementedError

    def retraction_factor(self, YtY: torch.Tensor, terms: int = 6, far=exact_inverse_sqrt) -> torch.Tensor:
        r"""$\rho(Y^\top Y)$, so that $R_W(V) = Y\rho(Y^\top Y)$; ``terms`` of the series of
        :func:`inv_sqrt_near_identity` where the form uses one, and ``far`` the inverse square
        root beyond its radius where the form needs one (:func:`inv_sqrt_unit_diagonal`;
        ``None`` where :meth:`series_covers` holds for the step)."""
        raise NotImplementedError

    def series_covers(self, step: float, normal: float, shrink: float, terms: int, dtype: torch.dtype) -> bool:
        r"""Whether every retraction of a step $V$ with $\|V\|_2 \le$ ``step`` and
        $\|\mathcal C(W^\top V)\|_2 \le$ ``normal`` (its normal part) from a point $cW$
        (``shrink`` $c$, $W$ on the manifold) keeps its Gram within the radius where the
        series of :meth:`retraction_factor` is exact to round-off, a priori: the caller may
        then pass ``far=None`` and no step pays for the branch beyond the radius (an
        eigendecomposition). Floats from the settings, no tensor read. ``False`` (the
        default) where the form has no such bound (DGram: its Gram is normalized by column
        norms that may fall to the step's order)."""
        return False

    def newton_operator(self, D: torch.Tensor, lam: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
        r"""The linearized tangency of the dual iterate at a frozen $P = (Z^\top Z)^{-1/2}$, on a
        multiplier $\Lambda$: $\mathcal A(\Lambda) = \mathcal C(D\,S(\Lambda)\,P)$ (multiplier-shaped).

        The residual $\mathcal C((B_0 + DS)P)$ changes by $\mathcal A(\delta)$ when $\Lambda$ moves by
        $\delta$ and $P$ is held, so $\mathcal A(\delta) = -\mathcal C(M)$ is Su's fixed-point step
        (:func:`geomuon.optimizers.gram.newton_update`). Symmetric positive semi-definite in the
        Frobenius inner product: $\langle\Lambda', \mathcal A(\Lambda)\rangle =
        \operatorname{tr}(S(\Lambda')\,D\,S(\Lambda)\,P)$. Declared by a form with ``newton_cg_steps``."""
        raise NotImplementedError

    def newton_diagonal(self, D: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
        r"""The diagonal of :meth:`newton_operator` on the basis of the multipliers the iteration
        visits (symmetric ones for an $n\times n$ multiplier), multiplier-shaped and nonnegative:
        the conjugate-gradient preconditioner of a form with ``newton_cg_steps``."""
        raise NotImplementedError

    def newton_increment(self, D: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
        r"""The multiplier increment of the Newton (Lyapunov) dual step whose $S$-space
        increment is the symmetric $E$ (:func:`geomuon.optimizers.gram.newton_update`), for a
        form with ``has_newton`` (its constraint is an $n\times n$ matrix)."""
        raise NotImplementedError


def gram_retraction(form: GramForm, x: torch.Tensor, u: torch.Tensor, terms: int = 6,
                    far=exact_inverse_sqrt) -> torch.Tensor:
    r"""The form's retraction materialized: $Y\rho(Y^\top Y)$, $Y = x + u$ (tall ``[..., m, n]``).

    What the engine folds into its assembly, for tests and for callers that hold a
    direction; computed in ``x.dtype`` (the Gram product in that dtype); ``far`` as in
    :meth:`GramForm.retraction_factor`.
    """
    Y = x + u
    return Y @ form.retraction_factor(Y.mT @ Y, terms, far)


def _lyapunov(D: torch.Tensor, S: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    r"""$DSP + PSD$ for a diagonal $D$ and symmetric $S$, $P$ (one $n\times n$ product)."""
    X = (_diag(D).unsqueeze(-1) * S) @ P
    return X + X.mT


def _lyapunov_diagonal(D: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    r"""$2(d_i^2P_{jj} + P_{ii}d_j^2)$: the diagonal of $\Lambda \mapsto DSP + PSD$, $S = \Lambda + \Lambda^\top$,
    on the basis of symmetric $\Lambda$."""
    d2, p = _diag(D), _diag(P)
    return 2 * (d2.unsqueeze(-1) * p.unsqueeze(-2) + p.unsqueeze(-1) * d2.unsqueeze(-2))


class OrthonormalGram(GramForm):
    r"""Stiefel: $\mathcal C(M) = M + M^\top$, $S(\Lambda) = 2\operatorname{sym}\Lambda$,
    $\Sigma_{ij} = (M + M^\top)_{ij}/(d_i^2 + d_j^2)$ ($\operatorname{sym}(M)$ on the manifold, where
    $d_i^2 = D_{ii} = 1$; exact also at a point $cW$ scaled by weight decay), $\operatorname{diag}(LL^*) = 4$ (its value on the manifold, kept at $cW$, where it is $4c^2$: a Jacobi preconditioner need not be exact, and a constant keeps the every-size certificate's algebra scalar), and the polar retraction
    $\rho(Y^\top Y) = (Y^\top Y)^{-1/2}$ (second order; by the series of
    :func:`inv_sqrt_near_identity` in $E = Y^\top Y - I$, which is $O(\eta^2)$ for a tangent
    step of length $\eta$ from a point on the manifold, and beyond the series' radius by
    ``far``, :func:`inv_sqrt_unit_diagonal`, unless :meth:`series_covers` bounds the step
    within it). The Newton increment is exact Su's fixed
    point: with $S = \Lambda + \Lambda^\top$, an increment $E$ of $S$ is $E/2$ of $\Lambda$."""

    diagonal_gram = True
    retraction_order = 2
    has_newton = True
    newton_cg_steps = 5  # the Newton step of the Polar Express dualizer (no eigenvectors)
    # in-run certificate (bench/manifold_inrun.py, 200 steps; dual steps, polish rounds: mean / min):
    # 0, 0: 0.868 / 0.777; 1, 0: 0.921 / 0.879; 1, 1: 0.954 / 0.926; 2, 1: 0.967 / 0.946;
    # 2, 2: 0.975 / 0.957 (400 steps: 0.978 / 0.954), the first to reach 0.97 / 0.92 (alternating
    # projections; ADMM rounds, 400 steps against a 32-step reference: 0.982 / 0.952, alternating
    # 0.982 / 0.966: its dual steps converge, so the polish only has to reach the ball)
    dual_steps = 2
    polish_rounds = 2
    polish_method = "alternating"

    def project(self, D, M):
        # sym(M) at D = I; dividing by d_i^2 + d_j^2 keeps the projection exact at a point
        # scaled by weight decay (D = c^2 I), where sym(M) left (1 - c^2) of the normal part
        d2 = _diag(D)
        return (M + M.mT) / (d2.unsqueeze(-1) + d2.unsqueeze(-2))

    def constraint(self, M):
        return M + M.mT

    def adjoint(self, lam):
        return lam + lam.mT

    def gram_diag(self, D):
        return torch.full_like(D, 4.0)

    def retraction_factor(self, YtY, terms=6, far=exact_inverse_sqrt):
        return inv_sqrt_unit_diagonal(YtY, terms, far)

    def series_covers(self, step, normal, shrink, terms, dtype):
        # Y^T Y - I = (c^2 - 1) I + c^2 (W^T W - I) + c C(W^T V) + V^T V: the step's terms get half
        # the radius, the other half is left to the point's own feasibility error (a point the
        # engine retracted is off by round-off; one ManifoldMuon admits, by at most 1e-5 an entry)
        deviation = abs(shrink * shrink - 1) + shrink * normal + step * step
        return deviation <= 0.5 * series_radius(terms, dtype)

    def newton_increment(self, D, E):
        return 0.5 * E

    def newton_operator(self, D, lam, P):
        return _lyapunov(D, self.adjoint(lam), P)

    def newton_diagonal(self, D, P):
        return _lyapunov_diagonal(D, P)


class OrthogonalColumnsGram(GramForm):
    r"""DGram: $\mathcal C(M) = \operatorname{Off}(M + M^\top)$,
    $S(\Lambda) = 2\operatorname{Off}(\operatorname{sym}\Lambda)$,
    $\Sigma_{ij} = (M + M^\top)_{ij}/(d_i^2 + d_j^2)$ off the diagonal, $\operatorname{diag}(LL^*)
    = 2(d_i^2 + d_j^2)$ with $d_i^2 = D_{ii}$; and the column-norm-keeping polar retraction
    of the normalized columns, $R_W(V) = \operatorname{msign}(Y\Delta^{-1/2})\,\Delta^{1/2}$,
    $\Delta = \operatorname{diag}(Y^\top Y)$:

    $$\rho(Y^\top Y) = \Delta^{-1/2}\,N^{-1/2}\,\Delta^{1/2},\qquad N = \Delta^{-1/2}\,Y^\top Y\,\Delta^{-1/2}$$

    ($N$ has a unit diagonal; its off-diagonal part is $O(\eta^2/(d_id_j))$ for a tangent
    step of length $\eta$: small at comparable column norms, of order one once a column
    norm falls to the order of the step, so :func:`inv_sqrt_unit_diagonal` takes the series
    only within its radius and the exact inverse square root beyond). A retraction of order 1; it
    keeps every column norm of $Y$ and is equivariant under signed column permutations.
    ``DGram.retr`` is the same map, with the polar factor of $Y\Delta^{-1/2}$ by Polar Express
    on the $m\times n$ matrix instead of $N^{-1/2}$.

    Newton step: Su's fixed point for DGram's constraint, the off-diagonal symmetric $\delta$ with

    $$\mathcal A(\delta) = \operatorname{Off}(DS(\delta)P + PS(\delta)D) = -\operatorname{Off}(M + M^\top),\qquad
    S(\delta) = 2\delta,$$

    by ``newton_cg_steps`` conjugate-gradient iterations preconditioned by the operator's
    diagonal $2(d_i^2P_{jj} + P_{ii}d_j^2)$ (:meth:`newton_diagonal`). The closed form in
    $Q$'s eigenbasis needs $D = I$: its off-diagonal part, which the form declared until
    it certified 0.16 in a GPT run whose column norms spread to $2\cdot10^{-4}$, is not this
    step once column norms differ.
    """

    diagonal_gram = True
    retraction_order = 1
    newton_cg_steps = 5
    # the frontier's GPT set (24 steps, 1 warm step): the cold first step certified 0.918 of the
    # optimum with 1 dual step, 0.940 with 2 (then the run's least is its second step, 0.928)
    cold_dual_steps = 2
    # in-run (bench/manifold_inrun.py, 400 steps, against a 32-step reference; mean / min over all
    # matrices): 1.0: 0.926 / 0.755; 1.3: 0.937 / 0.789; 1.5: 0.935 / 0.800; 2.0: 0.903 / 0.800.
    # The frontier's GPT set (24 steps): 1.0: 0.975 / 0.928; 1.3: 0.980 / 0.937; 1.5: 0.982 / 0.942
    newton_alpha = 1.5
    # in-run (400 steps, against a 32-step reference; 1 Newton step; mean / min): alternating
    # projections, 1 round 0.935 / 0.799, 2: 0.952 / 0.830, 3: 0.958 / 0.845; ADMM 1: 0.924 / 0.778,
    # 2: 0.954 / 0.8235, 3: 0.967 / 0.860. At two rounds the two methods are level in GPT training;
    # ADMM is the method because it keeps improving with rounds (it converges to the optimum,
    # alternating projections to a feasible point) and on tests/test_direction_taken.py's MLP two
    # rounds reach 0.981 / 0.940 against alternating's 0.970 / 0.884. Each round costs one eigh and about nine n x n products: the second took the AMX
    # Xeon's step from 12.0x to 13.8x our Muon (bench/optimizer_step.py, 6 x 384, one thread).
    polish_rounds = 2

    def project(self, D, M):
        d2 = _diag(D)
        return off_diagonal(M + M.mT) / (d2.unsqueeze(-1) + d2.unsqueeze(-2))

    def newton_operator(self, D, lam, P):
        return off_diagonal(_lyapunov(D, self.adjoint(lam), P))

    def newton_diagonal(self, D, P):
        return off_diagonal(_lyapunov_diagonal(D, P))

    def constraint(self, M):
        return off_diagonal(M + M.mT)

    def adjoint(self, lam):
        return off_diagonal(lam + lam.mT)

    def gram_diag(self, D):
        d2 = _diag(D)
        return 2 * (d2.unsqueeze(-1) + d2.unsqueeze(-2))

    def retraction_factor(self, YtY, terms=6, far=exact_inverse_sqrt):
        root = _diag(YtY).sqrt()
        N = YtY / (root.unsqueeze(-1) * root.unsqueeze(-2))
        return inv_sqrt_unit_diagonal(N, terms, far) * (root.unsqueeze(-2) / root.unsqueeze(-1))


class UnitColumnsGram(GramForm):
    r"""Oblique: $\mathcal C(M) = \operatorname{diag}(M)$ (multiplier ``[..., n]``),
    $S(\lambda) = \operatorname{diag}(\lambda)$, $\Sigma = \operatorname{diag}(M_{jj}/D_{jj})$,
    $\operatorname{diag}(LL^*) = D_{jj}$, and the normalization retraction
    $\rho = \operatorname{diag}(Y^\top Y)^{-1/2}$ (exact; second order: the metric projection)."""

    retraction_order = 2

    def project(self, D, M):
        return torch.diag_embed(_diag(M) / _diag(D))

    def constraint(self, M):
        return _diag(M)

    def adjoint(self, lam):
        return torch.diag_embed(lam)

    def gram_diag(self, D):
        return _diag(D)

    def retraction_factor(self, YtY, terms=6, far=exact_inverse_sqrt):
        return torch.diag_embed(_diag(YtY).rsqrt())
