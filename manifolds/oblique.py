r"""The oblique manifold (unit columns), and the sphere-product maps it shares with LPRO."""

from __future__ import annotations

from .base import MatrixManifold, matrix_method
from .linalg import fp32_or_fp64, largest_entry
from .capabilities import UnitColumnsGram

__all__ = ["Oblique"]


# Maps of a product of spheres of radius r, one sphere per slice along the other axis:
# ``dim=-2`` constrains columns (Oblique), ``dim=-1`` rows (LPRO with a radius).
def sphere_constraint(x, u, dim):
    r"""$\langle x_j, u_j\rangle$ per slice $j$ (the differential of $\tfrac12\|x_j\|^2$)."""
    return (x * u).sum(dim)


def sphere_adjoint(x, lam, dim):
    r"""$\lambda_j x_j$ per slice."""
    return x * lam.unsqueeze(dim)


def sphere_gram_diag(x, dim):
    r"""$\|x_j\|^2$: the operator $L_xL_x^*$ is this diagonal."""
    return x.square().sum(dim)


def sphere_defining_map(x, radius, dim):
    r"""$F(x)_j = \tfrac12(\|x_j\|^2 - r^2)$, so that $dF_x = L_x$."""
    return 0.5 * (x.square().sum(dim) - radius**2)


def sphere_proju(x, u, dim):
    r"""$u_j - \dfrac{\langle x_j, u_j\rangle}{\|x_j\|^2}x_j$ per slice, in ``u``'s dtype."""
    x = x.to(u.dtype)
    return u - x * ((x * u).sum(dim, keepdim=True) / x.square().sum(dim, keepdim=True))


def sphere_normalize(x, radius, dim, who, step=None):
    r"""$r\,y_j/\|y_j\|$ per slice of $y = x + \text{step}$, computed in float32 (float64
    for float64 input) and returned in ``x.dtype``.

    A zero slice has no nearest point on the sphere: ``ValueError`` (a projection reads
    that back). A retraction does not test it: a point on the sphere plus a tangent step
    has $\|x_j + u_j\|^2 = r^2 + \|u_j\|^2 \ge r^2$, so an optimizer step reads nothing back.
    """
    y = x.to(fp32_or_fp64(x.dtype))
    if step is not None:
        y = y + step.to(y.dtype)
    else:
        # a projection's input has any scale: each slice divided by its largest entry first (the
        # result is scale-free), so a squared norm neither overflows (1e20 in fp32 had come back
        # as the zero matrix) nor underflows (a nonzero 1e-300 matrix in fp64 had been "zero"),
        # whatever its neighbours' scale (a column of 1e-25 beside one of 1e20 had been "zero")
        y = y / largest_entry(y, dim)
    norms = y.norm(dim=dim, keepdim=True)
    if step is None and bool((norms == 0).any()):
        slice_name = "column" if dim == -2 else "row"
        raise ValueError(f"{who}: a {slice_name} of the input is zero and cannot be normalized")
    return (y * (radius / norms)).to(x.dtype)


class Oblique(MatrixManifold):
    r"""Unit columns $\mathcal{OB}(m, n) = \{W : \operatorname{diag}(W^\top W) = \mathbf{1}\}$.

    The constrained side is always the columns, for every shape ($m = 1$ gives $\pm 1$
    entries). With $w_j$ the columns:

    | map | formula |
    |---|---|
    | constraint | $L_W(A) = \operatorname{diag}(W^\top A)$ (multiplier ``[..., n]``) |
    | adjoint | $L_W^*(\lambda) = W\operatorname{diag}(\lambda)$ |
    | diagonal of $L_WL_W^*$ | $\|w_j\|^2$ |
    | defining map | $F(W)_j = \tfrac12(\|w_j\|^2 - 1)$ |
    | tangent projection | $P_W(X) = X - W\operatorname{diag}\big(\operatorname{diag}(W^\top X) \oslash (\|w_j\|^2)_j\big)$ |
    | retraction / ``projx`` | normalize the columns of $W + V$ / of $X$ |

    The projection divides by $\|w_j\|^2$ rather than 1, so it stays an orthogonal
    projection at points slightly off the manifold. ``projx`` and the retraction compute
    in float32 (float64 for float64 points), the constraint maps in the input's dtype,
    ``proju`` in ``u``'s. A zero column given to ``projx`` raises ``ValueError``.
    """

    name = "Oblique"
    gram_form = UnitColumnsGram()

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return sphere_constraint(x, u, -2)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return sphere_adjoint(x, lam, -2)

    @matrix_method(result="multiplier")
    def constraint_gram_diag(self, x):
        return sphere_gram_diag(x, -2)

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return sphere_defining_map(x, 1.0, -2)

    @matrix_method("u")
    def proju(self, x, u):
        return sphere_proju(x, u, -2)

    @matrix_method(finite=True)
    def projx(self, x):
        return sphere_normalize(x, 1.0, -2, "Oblique.projx")

    @matrix_method("u")
    def retr(self, x, u):
        return sphere_normalize(x, 1.0, -2, "Oblique.retr", step=u)
