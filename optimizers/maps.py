r"""Update maps: pure functions $U(D)$ from a (momentum) direction to an update.

Every map acts on the last two dimensions of ``[..., m, n]`` (a stack of same-shape
matrices is one call), returns the input's dtype, and sends a zero matrix (and, for the
row/column maps, a zero row/column) to zero, never NaN. Epsilons are keyword arguments
with documented defaults.

Each docstring names the group the map is **equivariant** under, $U(g\cdot D) =
g\cdot U(D)$, where $(P, Q)\cdot D = P D Q^\top$; these claims are what the symmetry
tests check (including negative controls for the groups a map is *not* equivariant
under). Notation: $O_k$ orthogonal matrices, $S_k$ permutations, $S_k^\pm$ signed
permutations.
"""

from __future__ import annotations

from typing import Callable

import torch

from geomuon.manifolds.linalg import check_matrix, check_real, fp32_or_fp64, largest_entry, msign, power_of_two_at_most

__all__ = [
    "UpdateMap",
    "spectral",
    "row_norm",
    "col_norm",
    "right_polar",
    "left_polar",
    "hybrid",
    "centered",
    "sign",
    "MAPS",
]

UpdateMap = Callable[..., torch.Tensor]

#: Default floor added to row/column norms (the reference RowNormM uses $10^{-8}$).
ROW_EPS = 1e-8


def _check(D: torch.Tensor, what: str, *, eps=None, alpha=None) -> None:
    """``D`` a floating matrix (stack); ``eps`` (a floor) finite and >= 0 and ``alpha`` finite
    where given (NaN had given NaN updates, a negative floor divided by about 0)."""
    check_matrix(D, what, "vectors (biases, gains) have no matrix update — send them to the AdamW path")
    if eps is not None:
        check_real(what, "eps", eps, lambda x: x >= 0, "a finite number >= 0")
    if alpha is not None:
        check_real(what, "alpha", alpha)


def spectral(
    D: torch.Tensor,
    *,
    method: str = "polar_express",
    steps: int | None = None,
    compute_dtype: torch.dtype | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    r"""Spectral update (Muon): $U(D) = \operatorname{msign}(D) = UV^\top$.

    The dualizer of the spectral norm: $\arg\max_{\|A\|_2\le 1}\langle D, A\rangle$.

    **Equivariant under** $O_m \times O_n$ (exactly for ``method="svd"``; the Newton–Schulz
    methods are odd matrix polynomials $p(DD^\top)D$, equivariant up to round-off).

    Args:
        D: ``[..., m, n]``.
        method: passed to :func:`geomuon.manifolds.linalg.msign`.
        steps: passed to :func:`geomuon.manifolds.linalg.msign`.
        compute_dtype: passed to :func:`geomuon.manifolds.linalg.msign`.
        eps: floor of $\|D\|_F$ in the normalization (default: :func:`~geomuon.manifolds.linalg.msign`'s,
            $\sqrt{\text{tiny}}$ of the norm's dtype, so the map is scale-free: an absolute
            $10^{-7}$, the default until now, had made ``spectral`` of a $D$ with
            $\|D\|_F = 10^{-11}$ 20 % off its polar factor); zero $D$ gives zero.

    Returns:
        ``[..., m, n]`` in ``D.dtype``; matmuls in ``compute_dtype`` (default ``D.dtype``).
    """
    _check(D, "spectral")
    return msign(D, method=method, steps=steps, compute_dtype=compute_dtype, eps=eps)


def row_norm(D: torch.Tensor, *, eps: float = ROW_EPS) -> torch.Tensor:
    r"""Row normalization (RowNormM): $U(D) = \operatorname{diag}(1/(\|d_i\| + \epsilon))\,D$.

    The dualizer of the max-row-norm $\|A\|_{2\to\infty} = \max_i\|a_i\|$ (rows of the
    ``[out, in]`` layout: one row per output neuron / vocabulary entry).

    **Equivariant under** $S_m^\pm \times O_n$ (signed row permutations on the left, any
    rotation on the right); **not** under $O_m$ (mixing rows changes their norms).

    Args:
        D: ``[..., m, n]``.
        eps: added to each row norm ($10^{-8}$); a zero row stays zero.

    Returns:
        ``[..., m, n]`` in ``D.dtype``, computed in ``D.dtype``.
    """
    _check(D, "row_norm", eps=eps)
    return _normalized(D, -1, eps)


def col_norm(D: torch.Tensor, *, eps: float = ROW_EPS) -> torch.Tensor:
    r"""Column normalization: $U(D) = D\,\operatorname{diag}(1/(\|d^j\| + \epsilon))$.

    The dualizer of the max-column-norm $\|A\|_{1\to 2} = \max_j\|a^j\|$.

    **Equivariant under** $O_m \times S_n^\pm$; **not** under $O_n$.

    Args:
        D: ``[..., m, n]``.
        eps: added to each column norm ($10^{-8}$); a zero column stays zero.

    Returns:
        ``[..., m, n]`` in ``D.dtype``, computed in ``D.dtype``.
    """
    _check(D, "col_norm", eps=eps)
    return _normalized(D, -2, eps)


def _normalized(D: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    r"""``D`` divided by its norms along ``dim`` plus ``eps``, $d_i / (\|d_i\| + \epsilon)$.

    The norm squares the entries, in float32 for every dtype but float64 (fp16's norms too:
    its range ends at 65504), so squares below that dtype's ``tiny`` are lost: at most
    $\sqrt{n\,\text{tiny}}$ of a norm over $n$ entries ($7\cdot10^{-18}$ in float32 at $n = 4096$).
    Where ``eps`` is so large that this is below the output's rounding, $\sqrt{n\,
    \text{tiny}} \le u\,\epsilon$ ($u$ the unit round-off of ``D.dtype``: the default
    $10^{-8}$ in float32 up to $n = 3\cdot10^7$), the plain quotient is exact to rounding; a
    row of norm above $\sqrt{\text{max}}$ ($1.8\cdot10^{19}$ in float32 and bfloat16) then
    comes out as 0, as in :func:`~geomuon.manifolds.linalg.msign` (an optimizer counts such
    a gradient as non-finite and skips it).

    A smaller ``eps`` (0, or ``tiny`` for the exact dualizer) takes each row (column) divided
    by a power of two $2^{k_i}$ that puts its largest entry in $[1, 2)$ (an exact division):
    $d_i/(\|d_i\| + \epsilon) = x_i / (\|x_i\| + \epsilon 2^{-k_i})$ with $\|x_i\| \in
    [1, 2\sqrt n)$ (at least the dtype's $\varepsilon$ for a row of subnormal numbers), and
    the denominator floored at ``tiny``, which no nonzero row meets: any finite row comes out
    as a unit row and a zero row as 0. There the plain quotient had given a row of float32
    entries $10^{-23}$ a norm of 0 (an infinite update at ``eps=0``, one of $10^{15}$ at
    ``eps`` = tiny) and a zero row 0/0 = NaN. It costs about twice the plain quotient."""
    exact = not isinstance(D, torch.Tensor)  # the exact matrices of the symbolic certificates: no rounding to avoid
    if not exact and D.numel() == 0:  # (an empty row has no largest entry)
        return D.clone()
    if exact or (D.shape[dim] * torch.finfo(fp32_or_fp64(D.dtype)).tiny) ** 0.5 <= torch.finfo(D.dtype).eps / 2 * eps:
        if not exact and D.dtype == torch.float16:
            norms = torch.linalg.vector_norm(D, dim=dim, keepdim=True, dtype=torch.float32)
            return (D / (norms + eps)).to(D.dtype)
        return D / (D.norm(dim=dim, keepdim=True) + eps)
    tiny = torch.finfo(D.dtype).tiny
    power_of_two = power_of_two_at_most(largest_entry(D, dim))
    X = D / power_of_two
    # (not in place: the backward of X.norm reads X)
    return X / (X.norm(dim=dim, keepdim=True) + eps / power_of_two).clamp_min(tiny)


def _float64(value):
    """A tensor in float64 (the symbolic certificates' letters as they are)."""
    return value.double() if isinstance(value, torch.Tensor) else value


def _nuclear_power(nuclear: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    r"""$\nu^\alpha$ of each matrix's nuclear norm $\nu$ (``nuclear``, ``[..., 1, 1]``, float64) as a
    factor in ``dtype``, 0 where it is not below half ``dtype``'s largest value: a polar factor's
    entries are at most its largest singular value, about 1, so its product with a factor in range
    stays finite, and a matrix out of range gets a zero update (a tiny $\nu$ at $\alpha < 0$: a
    float32 gradient of entries $10^{-43}$ had given $\nu^{-1} = \infty$ and infinite weights; a huge
    one at $\alpha > 0$; $0^\alpha = \infty$ of the zero matrix). Selected on the device, no host
    read, no pass over the matrix: its step is then a no-op, as msign's beyond its range. The
    symbolic certificates' letters are exact and have no range: taken as they are."""
    scale = nuclear.clamp_min(0).pow(alpha)
    if not isinstance(scale, torch.Tensor):
        return scale
    in_range = scale < torch.finfo(dtype).max / 2  # (NaN compares false)
    return torch.where(in_range, scale, torch.zeros_like(scale)).to(dtype)


def _polar_scaled(D: torch.Tensor, *, alpha: float, eps: float | None) -> torch.Tensor:
    if isinstance(D, torch.Tensor) and D.numel() == 0:  # (an empty matrix has no largest entry to scale by)
        return D.clone()
    compute = fp32_or_fp64(D.dtype)
    X = D.to(compute)
    # D by its largest entry s first (the polar factor does not change; the nuclear norm
    # scales by s): in fp32 the norms of a D of order 1e-20 underflow and of 1e20 overflow
    s = largest_entry(X)
    X = X / s
    # D (D^T D)^{-1/2} = (D D^T)^{-1/2} D = msign(D) for a D of full rank, taken on D itself:
    # through its Gram matrix the condition number squares, and an inverse square root in
    # fp32 was 13 % off the polar factor at cond(D) = 100 (0.5 % at 10); Polar Express on D,
    # 2e-6 (fp32, 384 x 384). A null space is not sent to exactly 0, as the pseudo-inverse root
    # sends it (msign has no rank threshold): its round-off singular values come out up to 4e-3
    # in fp32 and 6e-12 in fp64 (a rank-1 64 x 32 D, measured).
    polar = msign(X, "polar_express")
    # nu = <D, msign(D)> = tr((D^T D)^{1/2}) = ||D||_*, read off the same product (in float64: the
    # product s nu of a float32 D leaves float32's range where nu^alpha need not)
    nuclear = _float64(s) * _float64((X * polar).sum(dim=(-2, -1), keepdim=True))
    out = polar * _nuclear_power(nuclear, alpha, D.dtype) if alpha != 0 else polar
    nonzero = s * X.norm(dim=(-2, -1), keepdim=True) > (eps or 0.0)
    return torch.where(nonzero, out, torch.zeros_like(out)).to(D.dtype)


def right_polar(D: torch.Tensor, *, alpha: float = 1.0, eps: float | None = None) -> torch.Tensor:
    r"""Right polar update (RightPolarGradM): $U(D) = \|D\|_*^{\alpha}\,D\,(D^\top D)^{-1/2}$.

    $D(D^\top D)^{-1/2} = \operatorname{msign}(D)$ is computed on $D$ itself by Polar Express
    (:func:`geomuon.manifolds.linalg.msign`, 12 steps, in float32 at least), not through the
    Gram matrix, whose condition number is $D$'s squared; and
    $\|D\|_* = \operatorname{tr}(D^\top D)^{1/2} = \langle D, \operatorname{msign}(D)\rangle$ is
    read off the same product. $\alpha = 0$ gives Muon's direction $\operatorname{msign}(D)$;
    the reference PolarGrad uses $\alpha = 1$. Since $D f(D^\top D) = f(DD^\top) D$, this is
    the same map as :func:`left_polar`.

    Range: $\|D\|_*^\alpha$ is taken in float64, and a matrix where it is not below half the
    largest value of ``D.dtype`` (float32: $1.7\cdot10^{38}$, e.g. $\|D\|_* < 6\cdot10^{-39}$ at
    $\alpha = -1$, or $D$ of entries $10^{36}$ at $\alpha = 1$) gives **zero**, selected on the
    device with no host read, as msign gives zero beyond its range: an optimizer's step of that
    matrix moves the weights by its weight decay only (no report: the gradient was finite).

    **Equivariant under** $O_m \times O_n$.

    Args:
        D: ``[..., m, n]``.
        alpha: exponent of the nuclear-norm scale.
        eps: a matrix with $\|D\|_F \le$ ``eps`` gives zero (default: only the zero matrix).

    Returns:
        ``[..., m, n]`` in ``D.dtype``; computed in float32 (float64 for float64 input).
    """
    _check(D, "right_polar", eps=eps, alpha=alpha)
    return _polar_scaled(D, alpha=alpha, eps=eps)


def left_polar(D: torch.Tensor, *, alpha: float = 1.0, eps: float | None = None) -> torch.Tensor:
    r"""Left polar update (LeftPolarGradM): $U(D) = \|D\|_*^{\alpha}\,(DD^\top)^{-1/2}D$.

    The same map as :func:`right_polar` (Lau & Su's name for routers
    ``[experts, features]``), computed as it is; zero where its scale leaves the range, as there.

    **Equivariant under** $O_m \times O_n$.

    Args:
        D: ``[..., m, n]``.
        alpha: exponent of the nuclear-norm scale.
        eps: as in :func:`right_polar`.

    Returns:
        ``[..., m, n]`` in ``D.dtype``; computed in float32 (float64 for float64 input).
    """
    _check(D, "left_polar", eps=eps, alpha=alpha)
    return _polar_scaled(D, alpha=alpha, eps=eps)


def hybrid(
    D: torch.Tensor,
    *,
    alpha: float = 1.0,
    eps: float = ROW_EPS,
    method: str = "polar_express",
    steps: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""Hybrid update (HybridPolarGradM): $R = \text{row\_norm}(D)$,
    $U(D) = \|R\|_*^{\alpha}\operatorname{msign}(R)$.

    Rows are equalized first (the vocabulary / neuron side), then the result is
    orthogonalized; $\|R\|_* = \langle R, \operatorname{msign}(R)\rangle$. Zero where the update
    leaves ``D.dtype``'s range (a tiny $\|R\|_*$ at $\alpha < 0$), as :func:`right_polar`.

    **Equivariant under** $S_m^\pm \times O_n$; **not** under $O_m$.

    Args:
        D: ``[..., m, n]``.
        alpha: exponent of the nuclear-norm scale ($1$ in the reference code).
        eps: row-norm floor ($10^{-8}$).
        method: passed to :func:`geomuon.manifolds.linalg.msign`.
        steps: passed to :func:`geomuon.manifolds.linalg.msign`.
        compute_dtype: passed to :func:`geomuon.manifolds.linalg.msign`.

    Returns:
        ``[..., m, n]`` in ``D.dtype``; matmuls in ``compute_dtype`` (default ``D.dtype``).
    """
    _check(D, "hybrid", eps=eps, alpha=alpha)
    R = row_norm(D, eps=eps)
    Q = msign(R, method=method, steps=steps, compute_dtype=compute_dtype)
    if alpha == 0:
        return Q
    # (the zero matrix at alpha < 0: Q = 0 and 0^alpha = inf, whose product had been NaN)
    return Q * _nuclear_power(_float64((R * Q).sum(dim=(-2, -1), keepdim=True)), alpha, Q.dtype)


def _center_rows(D: torch.Tensor) -> torch.Tensor:
    # Pi^perp D = D - (1/m) 1 1^T D: remove the shared shift of every column.
    return D - D.mean(dim=-2, keepdim=True)


def centered(update: UpdateMap) -> UpdateMap:
    r"""Centered form of a map: $U_c(D) = \Pi^\perp\,U(\Pi^\perp D)$, $\Pi^\perp = I - \tfrac1m
    \mathbf 1\mathbf 1^\top$ on the row side.

    For routers and LM heads (rows = experts / vocabulary), whose logits are invariant to
    a shared shift $D \mapsto D + \mathbf 1 v^\top$: the input is centered so the shift
    cannot leak into the update, and the output is re-centered because row scaling (row
    norm, hybrid) does not preserve $\mathbf 1^\top U = 0$.

    **Equivariant under** $S_m \ltimes$ shifts (row permutations; shifts act trivially on
    the output: $U_c(D + \mathbf 1v^\top) = U_c(D)$), times the right group of ``update``
    ($O_n$ for spectral, row-norm, polar and hybrid maps). Sign flips of rows are **not**
    in the group (they move the mean).

    Returns:
        a map with the same keyword arguments and dtype contract as ``update``.
    """

    def centered_update(D: torch.Tensor, **kwargs) -> torch.Tensor:
        _check(D, f"centered({update.__name__})")
        return _center_rows(update(_center_rows(D), **kwargs))

    centered_update.__name__ = f"centered_{update.__name__}"
    centered_update.__qualname__ = centered_update.__name__
    centered_update.__doc__ = f"Centered form of :func:`{update.__name__}` (see :func:`centered`)."
    return centered_update


def sign(D: torch.Tensor) -> torch.Tensor:
    r"""Coordinate-wise sign $U(D) = \operatorname{sign}(D)$ (what Adam-like updates reduce to
    without momentum); $\operatorname{sign}(0) = 0$.

    The negative control of the symmetry tests: **equivariant only under** $S_m^\pm\times
    S_n^\pm$ (signed permutations on both sides), **not** under $O_m$ or $O_n$.

    Returns:
        ``[..., m, n]`` in ``D.dtype``.
    """
    _check(D, "sign")
    return torch.sign(D)


#: Name -> map, for configuration by string (``centered_<name>`` for centered forms).
MAPS: dict[str, UpdateMap] = {
    "spectral": spectral,
    "row_norm": row_norm,
    "col_norm": col_norm,
    "right_polar": right_polar,
    "left_polar": left_polar,
    "hybrid": hybrid,
    "sign": sign,
}
MAPS.update({f"centered_{k}": centered(v) for k, v in list(MAPS.items()) if k != "sign"})
