r"""The oblique manifold (unit columns), and the sphere-product maps it shares with LPRO."""

from __future__ import annotations

import torch

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
    r"""The orthogonal projection onto $\ker L_x$, per slice
    $u_j - \dfrac{\langle \hat x_j, u_j\rangle}{\|\hat x_j\|^2}\hat x_j$ with
    $\hat x_j = x_j / \max_i |x_{ij}|$ (the same map: it is invariant under scaling $x_j$), in
    ``u``'s dtype; ``x`` and ``u`` are ``[..., m, n]`` (batches broadcast).

    The scaling keeps $\|\hat x_j\|^2 \in [1, m]$ (or $[1, n]$) for a slice whose largest entry
    is a normal number, so it neither overflows nor underflows (in float16 a row of norm 300 had
    squared to inf and ``u`` came back unprojected; float32 overflowed at 1e20 and gave inf at
    1e-25). A zero slice $x_j = 0$ constrains nothing ($\langle x_j, \cdot\rangle = 0$), so $u_j$ is kept,
    as the generic projection keeps it (the quotient had been $0/0$: NaN). No host read.
    """
    x = x.to(u.dtype)
    x = x / largest_entry(x, dim)
    squared_norms = x.square().sum(dim, keepdim=True)
    if isinstance(squared_norms, torch.Tensor):  # (the symbolic certificates' slices are nonzero letters)
        # 1 in place of a zero slice's 0: its numerator <x_j, u_j> is exactly 0 too
        squared_norms = torch.where(squared_norms > 0, squared_norms, 1)
    return u - x * ((x * u).sum(dim, keepdim=True) / squared_norms)


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
    # the square root of a sum, not Tensor.norm: torch's float32 norm along a strided dim (the
    # columns) accumulates sequentially on the CPU, 1e-5 relative off at m = 1e5 rows and 2e-4
    # at 1e6 (Oblique's points failed the point check); the sum is pairwise. (The same range:
    # projx has divided by the largest entry, a retraction target has the radius's scale.)
    norms = y.square().sum(dim, keepdim=True).sqrt()
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

    The projection divides by $\|w_j\|^2$ rather than 1, so it stays the orthogonal
    projection onto $\ker L_W$ at points off the manifold, at any scale; a zero column of $W$
    constrains nothing and keeps $X$'s column. ``projx`` and the retraction compute
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
