r"""The unconstrained space of matrices."""

from __future__ import annotations

import torch

from .base import MatrixManifold, broadcast_pair, matrix_method

__all__ = ["Euclidean"]


class Euclidean(MatrixManifold):
    r"""All of $\mathbb{R}^{m\times n}$: no constraint, $P_W(X) = X$, $R_W(V) = W + V$.

    The constraint is the empty map: its multiplier has shape ``[..., 0]``. ``random``
    draws a standard Gaussian matrix. The space is flat: ``expmap`` is the retraction,
    ``logmap(x, y)`` $= y - x$ and ``dist`` $= \|y - x\|_F$. Everything computes in the
    input's dtype.
    """

    name = "Euclidean"
    reversible = True  # R_{x + u}(-u) = x: geoopt's samplers accept it, as geoopt.Euclidean

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        x, u = broadcast_pair(x, u)
        return u.new_zeros((*u.shape[:-2], 0))

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return x.new_zeros((*torch.broadcast_shapes(x.shape[:-2], lam.shape[:-1]), *x.shape[-2:]))

    @matrix_method(result="multiplier")
    def constraint_gram_diag(self, x):
        return x.new_zeros((*x.shape[:-2], 0))

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return x.new_zeros((*x.shape[:-2], 0))

    @matrix_method("u")
    def proju(self, x, u):
        return broadcast_pair(x, u)[1]

    @matrix_method(finite=True)
    def projx(self, x):
        return x

    @matrix_method("u")
    def retr(self, x, u):
        return x + u

    @matrix_method("y")
    def logmap(self, x, y):
        r"""$\log_x(y) = y - x$: the space is flat, the retraction $x + u$ is its exponential map."""
        x, y = broadcast_pair(x, y)
        return y - x

    def component_inner(self, x, u, v=None):
        r"""Entrywise $u \odot v$ ($u \odot u$ without ``v``), broadcast to ``x``: the space is a
        product of lines, so geoopt's ``RiemannianAdam`` keeps Adam's per-entry second moment
        on it (as on ``geoopt.Euclidean``; the inherited per-matrix inner product had made it
        one number per matrix, not Adam)."""
        inner = u * u if v is None else u * v
        return inner.expand(torch.broadcast_shapes(x.shape, inner.shape))
