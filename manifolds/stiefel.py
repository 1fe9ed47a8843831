r"""The Stiefel manifold of orthonormal frames."""

from __future__ import annotations

import torch

from .base import MatrixManifold, matrix_method
from .capabilities import OrthonormalGram
from .linalg import fp32_or_fp64, msign, sym

__all__ = ["Stiefel"]


class Stiefel(MatrixManifold):
    r"""Orthonormal frames $\mathrm{St}(m, n) = \{W \in \mathbb{R}^{m\times n} : W^\top W = I_n\}$.

    Tall and square points ($m \ge n$) have orthonormal **columns**; a wide point
    ($m < n$) has orthonormal **rows**, $WW^\top = I_m$ (the transposed geometry; every
    formula below is then applied to $W^\top$). For a tall $W$:

    | map | formula |
    |---|---|
    | constraint | $L_W(A) = W^\top A + A^\top W$ (multiplier ``[..., n, n]``) |
    | adjoint | $L_W^*(\Lambda) = 2W\operatorname{sym}(\Lambda)$ |
    | $L_WL_W^*$ on symmetric $\Lambda$ | $4\Lambda$ (the diagonal is 4) |
    | defining map | $F(W) = W^\top W - I$ |
    | tangent projection | $P_W(X) = X - W\operatorname{sym}(W^\top X)$ |
    | retraction | $R_W(V) = \operatorname{msign}(W + V)$ |
    | ``projx`` | $UV^\top$ from the SVD $X = U\Sigma V^\top$ (the nearest frame) |

    The retraction runs Polar Express (:func:`geomuon.manifolds.linalg.msign`) in float32 (float64
    for float64 points): $W + V$ has singular values $\sqrt{1 + \sigma_i(V)^2} \ge 1$, so
    the iteration is well conditioned. ``projx`` takes the thin SVD in float64 (a float32
    SVD returns frames orthonormal only to about $n\varepsilon$) and rounds once; its $U$
    is a full orthonormal frame even for a rank-deficient $X$, so it always lands on the
    manifold. The constraint maps compute in the input's dtype, ``proju`` in ``u``'s.

    Against geoopt's ``Stiefel`` (whose default is the canonical metric with the Cayley
    retraction): this is geoopt's Euclidean-metric geometry, but wide points are valid, the
    polar retraction is not reversible (``reversible = False``: geoopt's samplers refuse
    it), and ``projx`` of a float32 point already on the manifold returns it within float32
    rounding. See the Manifolds concept page of the docs.
    """

    name = "Stiefel"
    transposes_wide = True
    gram_form = OrthonormalGram()

    def dualizer_keeps_tangent(self, x, norm):
        # Square W: P_W G = W skew(W^T G), and msign(W S) = W msign(S) stays skew-tangent.
        return norm == "spectral" and x.size(-1) == x.size(-2)

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return x.mT @ u + u.mT @ x

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return 2 * x @ sym(lam)

    @matrix_method(result="multiplier")
    def constraint_gram_diag(self, x):
        n = x.size(-1)
        return torch.full((*x.shape[:-2], n, n), 4.0, dtype=x.dtype, device=x.device)

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        eye = torch.eye(x.size(-1), dtype=x.dtype, device=x.device)
        return x.mT @ x - eye

    @matrix_method("u")
    def proju(self, x, u):
        x = x.to(u.dtype)  # computed in u's dtype, as MatrixManifold.proju documents
        return u - x @ sym(x.mT @ u)

    @matrix_method(finite=True)
    def projx(self, x):
        U, _, Vh = torch.linalg.svd(x.double(), full_matrices=False)
        return (U @ Vh).to(x.dtype)

    @matrix_method("u")
    def retr(self, x, u):
        compute = fp32_or_fp64(x.dtype)
        # (msign's norm floor is sqrt(tiny): only an exact zero is floored, so a point of tiny
        # scale stays in the Polar Express range)
        return msign(x.to(compute) + u.to(compute), "polar_express").to(x.dtype)
