r"""Hypothesis strategies: matrix shapes, matrices of controlled conditioning, manifold
points and tangent vectors (generic over any :class:`geomuon.manifolds.MatrixManifold`).

Matrices are synthesized from a drawn seed and a drawn *kind*, so hypothesis explores the
structure (shape, kind, scale, condition number, rank) while the entries come from a
seeded ``torch.Generator``:

* ``"gaussian"``: i.i.d. standard normal entries;
* ``"ill_conditioned"``: $U\operatorname{diag}(\sigma)V^\top$ with Haar $U, V$ and
  $\sigma$ log-spaced over $[1/\kappa, 1]$ in shuffled order;
* ``"rank_deficient"``: the same with only $r < \min(m, n)$ nonzero singular values;
* ``"column_scaled"``: Gaussian columns scaled by factors log-spaced over $[1/\kappa, 1]$
  in shuffled order (unsorted column norms, what DGram cares about).

Every matrix is then rescaled so that its RMS entry equals a drawn ``scale`` in
$[10^{-3}, 10^3]$ (log-uniform). The default dtype is float64 (tests of math).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from .groups import haar_orthogonal

__all__ = [
    "MATRIX_KINDS",
    "float_dtypes",
    "matrix_shapes",
    "matrices",
    "manifold_points",
    "tangent_vectors",
    "points_and_tangents",
]

MATRIX_KINDS = ("gaussian", "ill_conditioned", "rank_deficient", "column_scaled")


def float_dtypes() -> st.SearchStrategy[torch.dtype]:
    """float64 or float32 (the dtypes the manifold contract has tolerances for)."""
    return st.sampled_from([torch.float64, torch.float32])


@st.composite
def matrix_shapes(
    draw,
    *,
    min_side: int = 1,
    max_side: int = 12,
    orientations: tuple[str, ...] = ("tall", "square", "wide"),
    max_batch_dims: int = 1,
    max_batch: int = 3,
) -> tuple[int, ...]:
    """Shapes ``(*batch, m, n)``: tall ($m > n$), square or wide ($m < n$), optionally batched.

    Args:
        min_side: smallest $m$ and $n$.
        max_side: largest $m$ and $n$ (tall/wide need ``max_side > min_side``).
        orientations: which of ``"tall"``, ``"square"``, ``"wide"`` to draw.
        max_batch_dims: most leading batch dimensions (0 for plain matrices).
        max_batch: largest size of a batch dimension.
    """
    orientation = draw(st.sampled_from(orientations))
    if orientation == "square" or max_side == min_side:
        m = n = draw(st.integers(min_side, max_side))
    else:
        short = draw(st.integers(min_side, max_side - 1))
        long = draw(st.integers(short + 1, max_side))
        m, n = (long, short) if orientation == "tall" else (short, long)
    batch = draw(st.lists(st.integers(1, max_batch), max_size=max_batch_dims))
    return (*batch, m, n)


def _shuffled_logspace(count, condition, generator):
    exponent = -torch.log10(torch.tensor(condition)).item()
    values = torch.logspace(0.0, exponent, count, dtype=torch.float64)
    return values[torch.randperm(count, generator=generator)]


@st.composite
def matrices(
    draw,
    shape: tuple[int, ...] | st.SearchStrategy | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    min_scale: float = 1e-3,
    max_scale: float = 1e3,
    max_condition: float = 1e3,
) -> torch.Tensor:
    r"""Matrices ``[..., m, n]`` of a drawn kind (see the module docstring).

    Args:
        shape: a fixed shape, a strategy of shapes, or ``None`` for :func:`matrix_shapes`.
        dtype: of the result (synthesized in float64, then cast).
        kinds: subset of :data:`MATRIX_KINDS`.
        min_scale: smallest RMS entry (the RMS is drawn log-uniform).
        max_scale: largest RMS entry.
        max_condition: largest $\kappa$ of the ill-conditioned and column-scaled kinds.
    """
    unknown = set(kinds) - set(MATRIX_KINDS)
    if unknown:
        raise ValueError(f"matrices: unknown kinds {sorted(unknown)}; choose from {MATRIX_KINDS}")
    if shape is None:
        shape = matrix_shapes()
    if isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    *batch, m, n = shape
    k = min(m, n)
    kind = draw(st.sampled_from(kinds))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    condition = 10 ** draw(st.floats(0.0, float(torch.log10(torch.tensor(max_condition)))))
    if kind in ("ill_conditioned", "rank_deficient") and k > 1:
        sigma = _shuffled_logspace(k, condition, generator)
        if kind == "rank_deficient":
            rank = draw(st.integers(1, k - 1))
            sigma = torch.where(torch.arange(k) < rank, sigma.sort(descending=True).values, 0.0)
        left = haar_orthogonal(m, generator, tuple(batch))[..., :k]  # Haar frames [..., m, k]
        right = haar_orthogonal(n, generator, tuple(batch))[..., :k]
        x = (left * sigma) @ right.mT
    else:
        x = torch.randn(*batch, m, n, generator=generator, dtype=torch.float64)
        if kind == "column_scaled":
            x = x * _shuffled_logspace(n, condition, generator)
    scale = 10 ** draw(st.floats(float(torch.log10(torch.tensor(min_scale))),
                                 float(torch.log10(torch.tensor(max_scale)))))
    rms = x.square().mean(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-300)
    return (x * (scale / rms)).to(dtype)


@st.composite
def manifold_points(
    draw,
    manifold,
    shape: tuple[int, ...] | st.SearchStrategy | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    max_condition: float = 1e3,
) -> torch.Tensor:
    """Points of ``manifold``: ``manifold.projx`` of a drawn matrix (float64 projection, then cast).

    The projection runs in float64 so a float32 point is the rounding of an exact point.
    """
    x = draw(matrices(shape, dtype=torch.float64, kinds=kinds, max_condition=max_condition))
    return manifold.projx(x).to(dtype)


@st.composite
def tangent_vectors(
    draw,
    manifold,
    point: torch.Tensor,
    *,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    max_relative_norm: float = 1.0,
) -> torch.Tensor:
    r"""Tangent vectors at ``point``: ``proju`` of a drawn matrix, rescaled per matrix to a
    drawn norm $\|v\| \in [10^{-3}, 1]\cdot$ ``max_relative_norm`` $\cdot\|x\|$ (zero stays zero).
    """
    raw = draw(matrices(tuple(point.shape), dtype=torch.float64, kinds=kinds))
    v = manifold.proju(point.double(), raw)
    relative = 10 ** draw(st.floats(-3.0, 0.0)) * max_relative_norm
    norms = v.norm(dim=(-2, -1), keepdim=True)
    target = relative * point.double().norm(dim=(-2, -1), keepdim=True)
    v = torch.where(norms > 0, v * (target / norms.clamp_min(1e-300)), v)
    return v.to(point.dtype)


@st.composite
def points_and_tangents(
    draw,
    manifold,
    shape: tuple[int, ...] | st.SearchStrategy | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    max_condition: float = 1e3,
    max_relative_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A point of ``manifold`` and a tangent vector there (see :func:`tangent_vectors`)."""
    points = manifold_points(manifold, shape, dtype=dtype, kinds=kinds, max_condition=max_condition)
    x = draw(points)
    v = draw(tangent_vectors(manifold, x, kinds=kinds, max_relative_norm=max_relative_norm))
    return x, v
