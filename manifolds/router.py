r"""The centered subspace of MoE router weights."""

from __future__ import annotations

import torch

from .base import MatrixManifold, broadcast_pair, matrix_method
from .linalg import fp32_or_fp64

__all__ = ["CenteredRouterSpace"]


def _centered(x):
    return x - x.mean(-2, keepdim=True)


class CenteredRouterSpace(MatrixManifold):
    r"""Router weights with experts on rows, centered over experts: $\{W : \mathbf{1}^\top W = 0\}$.

    A router's logits are invariant under a shared shift $W \mapsto W + \mathbf{1}v^\top$
    (softmax over experts), so the centered subspace is its quotient. Rows are experts
    for every shape ($e = m \ge 2$ experts), columns are features.

    | map | formula |
    |---|---|
    | constraint | $L_W(A) = \mathbf{1}^\top A$ (multiplier ``[..., n]``) |
    | adjoint | $L_W^*(\lambda) = \mathbf{1}\lambda^\top$ |
    | diagonal of $L_WL_W^*$ | $e$ |
    | defining map | $F(W) = \mathbf{1}^\top W$ |
    | tangent projection / ``projx`` | $\Pi^\perp X = X - \tfrac1e\mathbf{1}\mathbf{1}^\top X$ |
    | retraction | $\Pi^\perp(W + V)$ ($= W + V$ for tangent $V$; re-centering removes drift) |

    ``proju`` computes in the input's dtype, the retraction in float32 (float64 for
    float64 points), ``projx`` in float64 (rounded once).

    The set is a linear subspace, so it is flat: ``expmap`` (the retraction) is the
    exponential map, ``logmap(x, y)`` $= \Pi^\perp(y - x)$ and ``dist`` $= \|\Pi^\perp(y - x)\|_F$.
    The point check is relative to the scale of each column, as the subspace is a cone (see
    :meth:`points_on_manifold`).
    """

    name = "CenteredRouterSpace"
    aliases = ("centered_router",)
    reversible = True  # a linear subspace: Pi(Pi(x + u) - u) = x for tangent u

    def dualizer_keeps_tangent(self, x, norm):
        # Column scaling and msign keep 1^T A = 0 when 1^T X = 0.
        return norm in ("spectral", "column")

    def shape_problem(self, m, n):
        if m < 2:
            return f"a router needs at least 2 experts (rows), got {m}"
        return super().shape_problem(m, n)

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return broadcast_pair(x, u)[1].sum(-2)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        batch = torch.broadcast_shapes(x.shape[:-2], lam.shape[:-1])
        return lam.unsqueeze(-2).expand(*batch, *x.shape[-2:])

    @matrix_method(result="multiplier")
    def constraint_gram_diag(self, x):
        # the integer e itself (same value and dtype as float(e)): symbolic sizes pass
        return x.new_full((*x.shape[:-2], x.size(-1)), x.size(-2))

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return x.sum(-2)

    @matrix_method("u")
    def proju(self, x, u):
        return _centered(broadcast_pair(x, u)[1])

    @matrix_method(finite=True)
    def projx(self, x):
        return _centered(x.double()).to(x.dtype)

    @matrix_method("u")
    def retr(self, x, u):
        compute = fp32_or_fp64(x.dtype)
        return _centered(x.to(compute) + u.to(compute)).to(x.dtype)

    @matrix_method("y")
    def logmap(self, x, y):
        return _centered(broadcast_pair(x, y)[1] - x)

    @matrix_method(result="multiplier")
    def points_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        r"""Per matrix ``[..., e, n]`` → ``[...]`` (bool, on ``x``'s device, no host read): every
        column sum vanishes relative to the column's absolute sum, finite,

        $$|\mathbf 1^\top w_j| \le \text{atol}\,\mathbf 1^\top|w_j| \quad\text{for every column } j.$$

        The generic test $|\mathbf 1^\top w_j| \le \text{atol}$ was not scale-free on this cone:
        it refused float32 routers fresh from ``projx`` at scale 10 with 64 experts and accepted any
        router of scale $10^{-7}$, centered or not. Rounding the exactly centered entries to the
        dtype moves $\mathbf 1^\top w_j$ by up to $\tfrac{\varepsilon}{2}\mathbf 1^\top|w_j|$ and the
        sum adds up to $(e - 1)\tfrac{\varepsilon}{2}\mathbf 1^\top|w_j|$, both proportional to the
        scale. ``rtol`` is unused (the reference value of the residual is 0).
        """
        column_sums = x.sum(-2).abs()
        column_scales = x.abs().sum(-2)
        close = (column_sums <= atol * column_scales) & torch.isfinite(column_scales)
        return close.all(-1)

    def _off_manifold_reason(self, x, *, atol, rtol):
        return f"column sums over the experts 1^T x are not 0 within atol={atol} times the columns' absolute sums"
