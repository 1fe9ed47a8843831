r"""The vocabulary-by-feature space of embeddings and LM heads (LPRO geometry)."""

from __future__ import annotations

from .euclidean import Euclidean
from .oblique import (
    sphere_adjoint,
    sphere_constraint,
    sphere_defining_map,
    sphere_gram_diag,
    sphere_normalize,
    sphere_proju,
)
from .base import MatrixManifold, matrix_method
from .linalg import as_positive

__all__ = ["LPRO"]


class LPRO(Euclidean):
    r"""Embedding / LM-head matrices: vocabulary rows $\times$ features, optional row radius.

    The name is the block's symmetry group, Left Permutation $\times$ Right Orthogonal
    ($S_m \times O_n$): permuting the vocabulary and rotating the feature space. Rows are
    vocabulary items for every shape.

    Without ``radius`` the set is all of $\mathbb{R}^{m\times n}$ (the geometry of
    :class:`~geomuon.manifolds.Euclidean`, multiplier ``[..., 0]``). With a radius $r$ every row
    has norm $r$, $\|w_i\| = r$:

    | map | formula |
    |---|---|
    | constraint | $L_W(A) = \operatorname{rowdot}(W, A)_i = \langle w_i, a_i\rangle$ (``[..., m]``) |
    | adjoint | $L_W^*(\lambda) = \operatorname{diag}(\lambda)W$ |
    | diagonal of $L_WL_W^*$ | $\|w_i\|^2$ |
    | defining map | $F(W)_i = \tfrac12(\|w_i\|^2 - r^2)$ |
    | tangent projection | $P_W(X) = X - \operatorname{diag}(\operatorname{rowdot}(W, X)/\|w_i\|^2)W$ |
    | retraction / ``projx`` | rescale every row of $W + V$ / $X$ to norm $r$ |

    ($\|w_i\|^2 = r^2$ on the manifold; dividing by the actual norm keeps the projection
    orthogonal onto $\ker L_W$ off it, where a zero row constrains nothing and keeps $X$'s row.)
    ``projx`` and the retraction compute in float32 (float64
    for float64 points), the constraint maps in the input's dtype, ``proju`` in ``u``'s; a zero
    row given to ``projx`` raises ``ValueError``.

    Args:
        radius: row norm $r > 0$ (finite), or ``None`` for no constraint.

    Raises:
        TypeError: ``radius`` is not a real number (a bool or a string).
        ValueError: ``radius`` is not finite and positive.
    """

    name = "LPRO"

    def __init__(self, radius: float | None = None):
        super().__init__()
        # as_positive refuses what float() took by accident (True as 1, "2" as 2) and an
        # infinite radius, whose rows had come back infinite from projx
        self.radius = None if radius is None else as_positive("LPRO", "radius (or None for no constraint)", radius)
        # flat without a radius (Euclidean's retraction undoes itself); rows on spheres are not
        self.reversible = self.radius is None

    def extra_repr(self) -> str:
        return "" if self.radius is None else f"radius={self.radius}"

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        if self.radius is None:
            return super().constraint(x, u)
        return sphere_constraint(x, u, -1)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        if self.radius is None:
            return super().constraint_adjoint(x, lam)
        return sphere_adjoint(x, lam, -1)

    @matrix_method(result="multiplier")
    def constraint_gram_diag(self, x):
        if self.radius is None:
            return super().constraint_gram_diag(x)
        return sphere_gram_diag(x, -1)

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        if self.radius is None:
            return super().defining_map(x)
        return sphere_defining_map(x, self.radius, -1)

    @matrix_method("u")
    def proju(self, x, u):
        if self.radius is None:
            return super().proju(x, u)
        return sphere_proju(x, u, -1)

    @matrix_method(finite=True)
    def projx(self, x):
        if self.radius is None:
            return x
        return sphere_normalize(x, self.radius, -1, "LPRO.projx")

    @matrix_method("u")
    def retr(self, x, u):
        if self.radius is None:
            return x + u
        return sphere_normalize(x, self.radius, -1, "LPRO.retr", step=u)

    def logmap(self, x, y):
        if self.radius is None:
            return super().logmap(x, y)
        return MatrixManifold.logmap(self, x, y)

    def component_inner(self, x, u, v=None):
        # entrywise without a radius (Euclidean's); with one, the matrix's inner product
        # (rows on spheres are not a product of lines)
        if self.radius is None:
            return super().component_inner(x, u, v)
        return MatrixManifold.component_inner(self, x, u, v)
