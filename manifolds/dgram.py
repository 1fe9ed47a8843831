r"""DGram: matrices with pairwise orthogonal, nonzero columns."""

from __future__ import annotations

import torch

from .base import MatrixManifold, matrix_method
from .capabilities import OrthogonalColumnsGram
from .linalg import fp32_or_fp64, largest_entry, msign, off_diagonal, sym

__all__ = ["DGram"]


class DGram(MatrixManifold):
    r"""Diagonal-Gram matrices $\{W : \operatorname{Off}(W^\top W) = 0,\ w_j \ne 0\}$.

    Equivalently $W = Q\operatorname{diag}(d)$ with $Q^\top Q = I$ and $d_j = \|w_j\| > 0$:
    the singular values of $W$ are its column norms, and they are not bounded. Its
    symmetry group is $O_m \times$ signed column permutations, *not* $O_m \times O_n$.

    Tall and square points ($m \ge n$) have orthogonal **columns**; a wide point has
    orthogonal nonzero **rows** (the transposed geometry). For a tall $W$, with
    $d_i = \|w_i\|$:

    | map | formula |
    |---|---|
    | constraint | $L_W(A) = \operatorname{Off}(W^\top A + A^\top W)$ (``[..., n, n]``) |
    | adjoint | $L_W^*(\Lambda) = 2W\operatorname{Off}(\operatorname{sym}\Lambda)$ |
    | $L_WL_W^*$ on symmetric zero-diagonal $\Lambda$ | $\Lambda_{ij} \mapsto 2(d_i^2 + d_j^2)\Lambda_{ij}$ |
    | defining map | $F(W) = \operatorname{Off}(W^\top W)$ |
    | tangent projection | $P_W(X) = X - W\Sigma$, $\Sigma_{ij} = \dfrac{(W^\top X + X^\top W)_{ij}}{d_i^2 + d_j^2}$, $\Sigma_{ii} = 0$ |
    | retraction | $R_W(V) = \operatorname{msign}\big((W + V)\Delta^{-1/2}\big)\Delta^{1/2}$, $\Delta = \operatorname{Diag}\big((W + V)^\top(W + V)\big)$ |
    | ``projx`` | $UV^\top\operatorname{diag}(\|x_j\|)$, $X = U\Sigma V^\top$ |

    The retraction keeps each column's norm and orthogonalizes the directions. It is
    **not** the map $\operatorname{polar}(X)\operatorname{diag}(\text{sorted }\sigma(X))$,
    which moves a point whose column norms are unsorted and needs an SVD. It runs Polar
    Express in float32 (float64 for float64 points) on the normalized columns, whose singular
    values are near 1 for a target near the manifold, whatever its column norms (a point's are
    exactly 1): exact to round-off at any spread of the column norms
    (:func:`~geomuon.theory.symbolic.certify_dgram_retraction`; each norm is taken from its column
    over the column's largest entry, so float32 columns of norm $10^{\pm30}$, whose squares leave
    its range, retract too), and the same map as the Gram
    form's retraction (:class:`~geomuon.manifolds.capabilities.OrthogonalColumnsGram`, which
    ManifoldMuon's default ``retraction="fused"`` folds into its step). (``msign`` of $W + V$
    itself normalizes by $1.01\|W + V\|_F$ and put a column $10^3$ times shorter than the
    others below Polar Express's range: measured in float64 at $1024\times1024$, one zero step
    shortened it by 0.27 %, and 60 steps took it to zero.)
    ``projx`` (thin SVD in float64, rounded once) fixes every point of the manifold but is
    not the metric projection (which has no closed form). The constraint maps compute in
    the input's dtype, ``proju`` in ``u``'s.

    A ``projx`` input with a zero column raises ``ValueError`` (a host read: ``projx`` is
    not called inside an optimizer step). A retraction target $W + V$ with a zero column has
    no retraction (that column's direction is undefined, and the manifold requires it
    nonzero): ``retr`` returns the point $W$ itself, $R_W(0)$, for each matrix of a batch
    whose target has one, decided on the device, no host read (the retraction is called
    inside optimizer steps, e.g. :class:`~geomuon.optimizers.ManifoldMuon`'s general path).
    So the step of that matrix is a no-op that stays on the manifold; the alternative, the
    target's zero column kept, would leave the manifold with a column no later step can
    revive ($P_W$ keeps it out of the point, and the next point check comes only after a
    load). An exact zero target column is a measure-zero event (e.g. $V = -W$, tangent,
    in exact arithmetic). The maps an optimizer's step calls at its point, ``proju`` and
    ``constraint_gram_diag``, read nothing back either: a point with a zero column is
    refused by the point check (:meth:`points_on_manifold`, an optimizer's first step), and
    past it no retraction makes one. At such a point ``proju`` is still the orthogonal
    projection onto $\ker L_W$ (the denominators $d_i^2 + d_j^2$ are clamped at ``tiny``, where
    the numerator vanishes: on the diagonal, and between two zero columns), and the Gram
    diagonal is 0 on the multipliers $L_W$ cannot reach.
    """

    name = "DGram"
    transposes_wide = True
    gram_form = OrthogonalColumnsGram()

    @staticmethod
    def _squared_column_norms(x: torch.Tensor) -> torch.Tensor:
        r"""$d_j^2 = \|x_{:,j}\|^2$, ``[..., n]``."""
        return x.square().sum(-2)

    def _nonzero_squared_column_norms(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """:meth:`_squared_column_norms`, refused (a host read: ``projx`` only, which no optimizer
        step calls) where a column of ``what`` is zero."""
        d2 = self._squared_column_norms(x)
        if bool((d2 == 0).any()):
            raise ValueError(
                f"DGram: {what} has a zero column (a zero row if it is wide); DGram points "
                "need nonzero columns: start from DGram.random, or projx of a matrix whose "
                "columns are all nonzero"
            )
        return d2

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return off_diagonal(x.mT @ u + u.mT @ x)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return 2 * x @ off_diagonal(sym(lam))

    @matrix_method(result="multiplier")
    def constraint_gram_diag(self, x):
        # The diagonal entries of the multiplier are always zero; 4 d_i^2 there is a safe
        # positive placeholder given by the same formula. No zero-column check: a host read in
        # every optimizer step (the solvers treat a zero entry as a multiplier L_W cannot reach).
        d2 = self._squared_column_norms(x)
        return 2 * (d2.unsqueeze(-1) + d2.unsqueeze(-2))

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return off_diagonal(x.mT @ x)

    @matrix_method("u")
    def proju(self, x, u):
        x = x.to(u.dtype)  # computed in u's dtype, as MatrixManifold.proju documents
        d2 = self._squared_column_norms(x)
        # clamped, not checked (a host read in every optimizer step): where d_i^2 + d_j^2 = 0 the
        # numerator is 0 too (the diagonal, or two zero columns), so 0 / tiny = 0 is the projection
        denominator = d2.unsqueeze(-1) + d2.unsqueeze(-2)
        if isinstance(denominator, torch.Tensor):  # (the symbolic certificates' columns are nonzero letters)
            denominator = denominator.clamp_min(torch.finfo(denominator.dtype).tiny)
        sigma = off_diagonal(x.mT @ u + u.mT @ x) / denominator
        return u - x @ sigma

    @matrix_method(finite=True)
    def projx(self, x):
        # projx(cx) = c projx(x): computed on x over its largest entry, so the squared column
        # norms neither overflow (1e160 in float64 had given inf/NaN) nor underflow
        x64 = x.double()
        largest = largest_entry(x64)
        x64 = x64 / largest
        d2 = self._nonzero_squared_column_norms(x64, "x given to projx")
        U, _, Vh = torch.linalg.svd(x64, full_matrices=False)
        return ((U @ Vh) * (d2.sqrt().unsqueeze(-2) * largest)).to(x.dtype)

    @matrix_method("u")
    def retr(self, x, u):
        compute = fp32_or_fp64(x.dtype)
        y = x.to(compute) + u.to(compute)
        # each column's norm from the column over its largest entry, whose squares neither overflow
        # nor underflow (fp32 columns of norm 1e20 had given NaN, of norm 1e-25 a skipped step)
        largest = largest_entry(y, dim=-2)
        d2 = self._squared_column_norms(y / largest)  # a zero column is handled below, on the device
        norms = d2.sqrt().unsqueeze(-2) * largest
        # the polar factor of the unit columns (a zero column's 0/0 stays in its own matrix, which
        # keeps x below)
        polar = msign(y / norms, "polar_express")
        point = (polar * norms).to(x.dtype)
        if isinstance(d2, torch.Tensor):  # (the symbolic certificates' columns are nonzero letters)
            # a target with a zero column keeps the point x (R_x(0)), chosen on the device
            point = torch.where((d2 == 0).any(-1)[..., None, None], x, point)
        return point

    @matrix_method(result="multiplier")
    def points_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        # Scale-free: nonzero columns whose normalized columns are orthonormal (cosines vanish).
        d = x.norm(dim=-2)
        q = x / d.unsqueeze(-2)
        cosines = off_diagonal(q.mT @ q)
        close = torch.isclose(cosines, torch.zeros_like(cosines), atol=atol, rtol=rtol)
        return (d != 0).all(-1) & close.flatten(x.dim() - 2).all(-1)

    def _off_manifold_reason(self, x, *, atol, rtol):
        # x is tall here (the base's check runs on the transpose of a wide point)
        if bool((x.norm(dim=-2) == 0).any()):
            return "x has a zero column (row for wide matrices)"
        return f"columns are not orthogonal (cosines) with atol={atol}"
