r"""Hypothesis strategies: matrix shapes, matrices of controlled conditioning, manifold
points and tangent vectors (generic over any :class:`geomuon.manifolds.MatrixManifold`).

Matrices are synthesized from a drawn seed and a drawn *kind*, so hypothesis explores the
structure (shape, kind, scale, condition number, rank) while the entries come from a
seeded ``torch.Generator``:

* ``"gaussian"``: i.i.d. standard normal entries;
* ``"ill_conditioned"``: $U\operatorname{diag}(\sigma)V^\top$ with Haar frames $U, V$ and
  $\sigma$ log-spaced over $[1/\kappa, 1]$ in shuffled order;
* ``"rank_deficient"``: the same with only $r < \min(m, n)$ nonzero singular values (drawn
  only where $\min(m, n) \ge 2$: the one matrix of rank $< 1$ is zero, which has no RMS to set);
* ``"column_scaled"``: $A\operatorname{diag}(c)$, $A$ the ill-conditioned kind at
  $\sqrt\kappa$ and $c$ log-spaced over $[1/\sqrt\kappa, 1]$ in shuffled order (unsorted
  column norms, what DGram cares about), so that
  $\kappa(A\operatorname{diag}(c)) \le \kappa(A)\,\kappa(\operatorname{diag}(c)) \le \kappa$.

Every matrix is then rescaled so that its RMS entry equals a drawn ``scale`` in
$[10^{-3}, 10^3]$ (log-uniform). The default dtype is float64 (tests of math).

Every option is checked when the strategy is built (``ValueError`` naming it), so a bad
bound fails where it is written, not as a hypothesis error about values it never named.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from geomuon.manifolds.base import MatrixManifold
from geomuon.manifolds.linalg import check_count, check_real

from .groups import haar_orthogonal

__all__ = [
    "MATRIX_KINDS",
    "ORIENTATIONS",
    "float_dtypes",
    "matrix_shapes",
    "matrices",
    "manifold_points",
    "tangent_vectors",
    "points_and_tangents",
]

MATRIX_KINDS = ("gaussian", "ill_conditioned", "rank_deficient", "column_scaled")
#: What :func:`matrix_shapes` can draw: ``"tall"`` ($m > n$), ``"square"``, ``"wide"`` ($m < n$).
ORIENTATIONS = ("tall", "square", "wide")

# A projection onto T_xM whose norm is at most this fraction of its input's carries no
# direction, only round-off. Projection round-off is about 1e-16 of the input in float64,
# and at most 1e-10 of it where the constraint Gram has condition 1e6 (DGram at condition
# 1e3; the contract tolerance of geomuon.theory.contracts); sqrt(eps64) = 1.5e-8 sits above
# both, and a genuine tangent part this small is only replaced by another one.
_DIRECTIONLESS = math.sqrt(torch.finfo(torch.float64).eps)
# Offsets the seed of the fallback Gaussian of tangent_vectors from the seeds `matrices`
# uses: hypothesis redraws one integer often, and the point's own Gaussian is normal-free
# only by chance. An XOR within 32 bits: torch seeds s and s + 2**32 give the same stream.
_FALLBACK_SEED = 0x9E3779B9


def float_dtypes() -> st.SearchStrategy[torch.dtype]:
    """float64 or float32 (the dtypes the manifold contract has tolerances for)."""
    return st.sampled_from([torch.float64, torch.float32])


def _names(where: str, name: str, values, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``values`` as a non-empty tuple of names from ``allowed``, refused by name otherwise
    (a bare string had been sampled as its characters: ``"tall"`` drew 't', 'a', 'l', each
    read as wide; an empty tuple had failed inside hypothesis, naming nothing)."""
    if isinstance(values, str):
        raise ValueError(f"{where}: {name} must be a tuple of names, got the string {values!r}; "
                         f"write ({values!r},) for one")
    if not isinstance(values, (tuple, list)):
        raise ValueError(f"{where}: {name} must be a tuple of names from {allowed}, got {values!r}")
    if not values:
        raise ValueError(f"{where}: {name} is empty; name at least one of {allowed}")
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown {name} {unknown}; choose from {allowed}")
    return tuple(values)


def _check_dtype(where: str, dtype) -> None:
    """Refuse a ``dtype`` that is not a real floating torch dtype (``torch.int64`` had
    truncated the drawn entries, mostly to zero)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{where}: dtype must be a real floating torch.dtype (e.g. torch.float64), got {dtype!r}")


def _check_manifold(where: str, manifold) -> None:
    """Refuse a ``manifold`` that is not a :class:`~geomuon.manifolds.MatrixManifold` instance
    (the class itself had failed at the first draw with "projx() missing 1 required positional
    argument", a name string with "'str' object has no attribute 'projx'")."""
    if isinstance(manifold, MatrixManifold):
        return
    if isinstance(manifold, type) and issubclass(manifold, MatrixManifold):
        raise ValueError(f"{where}: manifold must be a MatrixManifold instance, got the class {manifold.__name__}; "
                         f"pass {manifold.__name__}()")
    raise ValueError(f"{where}: manifold must be a MatrixManifold instance (e.g. Stiefel()), got {manifold!r}")


def _kinds_for(where: str, kinds: tuple[str, ...], shape: tuple[int, ...]) -> tuple[str, ...]:
    r"""The ``kinds`` a ``shape`` can be drawn as: ``"rank_deficient"`` only where
    $\min(m, n) \ge 2$ (it had fallen back to a full-rank Gaussian at $\min(m, n) = 1$);
    ``ValueError`` naming ``kinds`` when none is left."""
    if min(shape[-2:]) >= 2:
        return kinds
    possible = tuple(kind for kind in kinds if kind != "rank_deficient")
    if not possible:
        raise ValueError(f"{where}: kinds=('rank_deficient',) cannot be drawn at shape {shape} (min(m, n) = 1: the "
                         f"only matrix of lower rank is 0); draw shapes with min_side >= 2 or add another kind")
    return possible


def _check_shape(where: str, shape, dtype: torch.dtype, max_scale: float) -> tuple[int, ...]:
    """``shape`` as ``(*batch, m, n)`` of sizes >= 1 whose entries ``dtype`` can hold at RMS
    ``max_scale``, refused by name otherwise (a 1-D shape had failed to unpack, a zero size
    given an empty tensor)."""
    if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) >= 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in shape)):
        raise ValueError(f"{where}: shape must be (*batch, m, n) with every size a whole number >= 1, got {shape!r}")
    m, n = shape[-2:]
    # One entry can carry the whole Frobenius norm: |entry| <= RMS * sqrt(m n).
    largest = torch.finfo(dtype).max / math.sqrt(m * n)
    if max_scale > largest:
        raise ValueError(f"{where}: max_scale={max_scale!r} can overflow {dtype} at shape {tuple(shape)} (an entry "
                         f"can reach max_scale * sqrt(m n)); use max_scale <= {largest:.3g}")
    return tuple(int(k) for k in shape)


def matrix_shapes(
    *,
    min_side: int = 1,
    max_side: int = 12,
    orientations: tuple[str, ...] = ORIENTATIONS,
    max_batch_dims: int = 1,
    max_batch: int = 3,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes ``(*batch, m, n)``: tall ($m > n$), square or wide ($m < n$), optionally batched.

    Every shape drawn has one of ``orientations`` exactly, and ``min_side <= m, n <= max_side``.

    Args:
        min_side: smallest $m$ and $n$, at least 1.
        max_side: largest $m$ and $n$, at least ``min_side``; above it when ``"tall"`` or
            ``"wide"`` is asked for (they need $m \\ne n$).
        orientations: a tuple of names from :data:`ORIENTATIONS`.
        max_batch_dims: most leading batch dimensions (0 for plain matrices).
        max_batch: largest size of a batch dimension, at least 1.

    Raises:
        ValueError: naming the option, when any of these does not hold (checked here, not
            when drawing).
    """
    where = "matrix_shapes"
    orientations = _names(where, "orientations", orientations, ORIENTATIONS)
    check_count(where, "min_side", min_side, least=1)
    check_count(where, "max_side", max_side, least=1)
    if max_side < min_side:
        raise ValueError(f"{where}: max_side={max_side} is below min_side={min_side}")
    uneven = [o for o in orientations if o != "square"]
    if uneven and max_side == min_side:
        # squares had been drawn in their place, silently
        raise ValueError(f"{where}: {' and '.join(uneven)} shapes need m != n, so max_side > min_side; got both "
                         f"{min_side}: raise max_side or ask only for 'square'")
    check_count(where, "max_batch_dims", max_batch_dims, least=0)
    check_count(where, "max_batch", max_batch, least=1)
    return _matrix_shapes(min_side, max_side, orientations, max_batch_dims, max_batch)


@st.composite
def _matrix_shapes(draw, min_side, max_side, orientations, max_batch_dims, max_batch) -> tuple[int, ...]:
    orientation = draw(st.sampled_from(orientations))
    if orientation == "square":
        m = n = draw(st.integers(min_side, max_side))
    else:
        short = draw(st.integers(min_side, max_side - 1))
        long = draw(st.integers(short + 1, max_side))
        m, n = (long, short) if orientation == "tall" else (short, long)
    batch = draw(st.lists(st.integers(1, max_batch), max_size=max_batch_dims))
    return (*batch, m, n)


def _shuffled_logspace(count, condition, generator):
    # math.log10 in float64: torch.log10 of a float32 tensor had rounded the bound (and
    # overflowed above 3.4e38)
    values = torch.logspace(0.0, -math.log10(condition), count, dtype=torch.float64)
    return values[torch.randperm(count, generator=generator)]


def _log_uniform(draw, low: float, high: float) -> float:
    """A number drawn log-uniform in ``[low, high]`` (``0 < low <= high < inf``), exponent in
    float64; clamped, since ``10 ** log10(high)`` can round one ulp above ``high``."""
    return min(max(10 ** draw(st.floats(math.log10(low), math.log10(high))), low), high)


def matrices(
    shape: tuple[int, ...] | st.SearchStrategy | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    min_scale: float = 1e-3,
    max_scale: float = 1e3,
    max_condition: float = 1e3,
) -> st.SearchStrategy[torch.Tensor]:
    r"""Matrices ``[..., m, n]`` of a drawn kind (see the module docstring).

    Each matrix's RMS entry lies in ``[min_scale, max_scale]`` up to the round-off of one
    rescaling and the cast to ``dtype``; the ill-conditioned and column-scaled kinds have
    $\kappa \le$ ``max_condition`` (in float64, up to round-off).

    Args:
        shape: a fixed shape ``(*batch, m, n)`` (sizes >= 1), a strategy of shapes, or
            ``None`` for :func:`matrix_shapes`.
        dtype: a real floating dtype, of the result (synthesized in float64, then cast).
        kinds: a non-empty tuple of names from :data:`MATRIX_KINDS`.
        min_scale: smallest RMS entry (the RMS is drawn log-uniform), at least the smallest
            normal number of ``dtype`` (below it the cast flushes entries toward zero; 0
            had drawn all-zero matrices).
        max_scale: largest RMS entry, finite, at least ``min_scale``; no entry may overflow
            ``dtype`` (``max_scale * sqrt(m n)`` at most its largest number).
        max_condition: largest $\kappa$ of the ill-conditioned and column-scaled kinds,
            finite and at least 1.

    Raises:
        ValueError: naming the option, when any of these does not hold, or when ``kinds`` is
            only ``"rank_deficient"`` and $\min(m, n) = 1$ (a drawn shape is checked when
            drawn, everything else here).
    """
    where = "matrices"
    kinds = _names(where, "kinds", kinds, MATRIX_KINDS)
    _check_dtype(where, dtype)
    tiny = torch.finfo(dtype).tiny
    check_real(where, "min_scale", min_scale, lambda s: s >= tiny,
               f"a finite number >= {tiny:.3g} (the smallest normal {dtype})")
    check_real(where, "max_scale", max_scale, lambda s: s >= min_scale, f"a finite number >= min_scale={min_scale!r}")
    check_real(where, "max_condition", max_condition, lambda c: c >= 1, "a finite number >= 1 (a condition number)")
    if shape is None:
        shape = matrix_shapes()
    if not isinstance(shape, st.SearchStrategy):
        shape = _check_shape(where, shape, dtype, max_scale)
        _kinds_for(where, kinds, shape)
    return _matrices(shape, dtype, kinds, float(min_scale), float(max_scale), float(max_condition))


@st.composite
def _matrices(draw, shape, dtype, kinds, min_scale, max_scale, max_condition) -> torch.Tensor:
    if isinstance(shape, st.SearchStrategy):
        shape = _check_shape("matrices", draw(shape), dtype, max_scale)
    *batch, m, n = shape
    k = min(m, n)
    kind = draw(st.sampled_from(_kinds_for("matrices", kinds, shape)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    condition = _log_uniform(draw, 1.0, max_condition)
    if kind == "gaussian":
        x = torch.randn(*batch, m, n, generator=generator, dtype=torch.float64)
    else:
        # column_scaled splits kappa between A and diag(c): kappa(A diag(c)) <= kappa(A) kappa(diag(c))
        # (a Gaussian A had its own, unbounded, condition: 2e3 at max_condition = 10)
        spectrum = math.sqrt(condition) if kind == "column_scaled" else condition
        sigma = _shuffled_logspace(k, spectrum, generator)
        if kind == "rank_deficient":
            rank = draw(st.integers(1, k - 1))
            sigma = torch.where(torch.arange(k) < rank, sigma.sort(descending=True).values, 0.0)
        left = haar_orthogonal(m, generator, tuple(batch))[..., :k]  # Haar frames [..., m, k]
        right = haar_orthogonal(n, generator, tuple(batch))[..., :k]
        x = (left * sigma) @ right.mT
        if kind == "column_scaled":
            x = x * _shuffled_logspace(n, spectrum, generator)
    scale = _log_uniform(draw, min_scale, max_scale)
    rms = x.square().mean(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-300)
    return (x * (scale / rms)).to(dtype)


def manifold_points(
    manifold,
    shape: tuple[int, ...] | st.SearchStrategy | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    max_condition: float = 1e3,
) -> st.SearchStrategy[torch.Tensor]:
    """Points of ``manifold``: ``manifold.projx`` of a drawn matrix (float64 projection, then cast).

    The projection runs in float64 so a float32 point is the rounding of an exact point.
    The options are checked here as :func:`matrices` checks them, and ``manifold`` must be a
    :class:`~geomuon.manifolds.MatrixManifold` instance (``ValueError`` otherwise).
    """
    _check_manifold("manifold_points", manifold)
    _check_dtype("manifold_points", dtype)
    raw = matrices(shape, dtype=torch.float64, kinds=kinds, max_condition=max_condition)
    return raw.map(lambda x: manifold.projx(x).to(dtype))


def _matrix_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm(dim=(-2, -1), keepdim=True)


def tangent_vectors(
    manifold,
    point: torch.Tensor,
    *,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    max_relative_norm: float = 1.0,
) -> st.SearchStrategy[torch.Tensor]:
    r"""Tangent vectors at ``point``, in its dtype: ``proju`` of a drawn matrix (in float64),
    rescaled per matrix to a drawn norm $\|v\| \in [10^{-3}, 1]\cdot$ ``max_relative_norm``
    $\cdot\|x\|$.

    Every vector is tangent to the precision of ``point``'s dtype relative to its own norm:
    ``proju(point, v) - v`` is round-off of ``v`` (the projection is applied again after
    the drawn matrix's own projection, so the rescaling never magnifies round-off). A
    matrix whose projection is round-off only (it lay in the normal space, as the point's
    own matrix does when hypothesis draws the same seed for both) is replaced by a
    Gaussian one; the vector is exactly zero only where that projects to round-off too
    (the tangent space is $\{0\}$, e.g. a 1x1 Stiefel point).

    Raises:
        ValueError: naming the option, for a ``manifold`` that is not a
            :class:`~geomuon.manifolds.MatrixManifold` instance, unknown ``kinds``, a
            ``max_relative_norm`` that is not finite and > 0, or a ``point`` that is not a
            floating tensor ``[..., m, n]`` of sizes >= 1.
    """
    where = "tangent_vectors"
    _check_manifold(where, manifold)
    kinds = _names(where, "kinds", kinds, MATRIX_KINDS)
    check_real(where, "max_relative_norm", max_relative_norm, lambda r: r > 0, "a finite number > 0")
    if not (isinstance(point, torch.Tensor) and point.dim() >= 2 and point.is_floating_point()
            and point.numel() > 0):
        raise ValueError(f"{where}: point must be a floating tensor [..., m, n] with every size >= 1, got "
                         + (f"{point.dtype} of shape {tuple(point.shape)}" if isinstance(point, torch.Tensor)
                            else type(point).__name__))
    raw = matrices(tuple(point.shape), dtype=torch.float64, kinds=kinds)
    return _tangent_vectors(manifold, point, raw, float(max_relative_norm))


@st.composite
def _tangent_vectors(draw, manifold, point, raw_matrices, max_relative_norm) -> torch.Tensor:
    # computed on the CPU in float64, where the drawn matrices are made (a CUDA point's
    # projection had mixed devices), and returned as the point is
    x = point.detach().to("cpu", torch.float64)
    raw = draw(raw_matrices)
    v = manifold.proju(x, raw)
    # Rescaling a directionless projection (round-off, 1e-16 of |raw|) to a drawn norm had
    # returned full-size normal vectors in about half the draws: redraw those matrices.
    lost = _matrix_norm(v) <= _DIRECTIONLESS * _matrix_norm(raw)
    if bool(lost.any()):
        seed = draw(st.integers(0, 2**32 - 1)) ^ _FALLBACK_SEED
        gaussian = torch.randn(raw.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        source = torch.where(lost, gaussian, raw)
        v = manifold.proju(x, source)
        # still directionless: the tangent space is {0} (or the Gaussian met the point's own
        # matrix), and zero is the one vector sure to be tangent
        v = torch.where(_matrix_norm(v) <= _DIRECTIONLESS * _matrix_norm(source), 0.0, v)
    # v's normal part is round-off of |raw|, up to 1e-10 / 1.5e-8 = 7e-3 of |v| itself (the
    # worst Gram, the smallest kept projection): projecting again makes it round-off of |v|,
    # which the rescaling below keeps relative.
    v = manifold.proju(x, v)
    relative = 10 ** draw(st.floats(-3.0, 0.0)) * max_relative_norm
    norms = _matrix_norm(v)
    target = relative * _matrix_norm(x)
    v = torch.where(norms > 0, v * (target / norms.clamp_min(1e-300)), v)
    return v.to(point)


def points_and_tangents(
    manifold,
    shape: tuple[int, ...] | st.SearchStrategy | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    kinds: tuple[str, ...] = MATRIX_KINDS,
    max_condition: float = 1e3,
    max_relative_norm: float = 1.0,
) -> st.SearchStrategy[tuple[torch.Tensor, torch.Tensor]]:
    """A point of ``manifold`` and a tangent vector there, both in ``dtype`` (see
    :func:`manifold_points` and :func:`tangent_vectors`, whose checks apply here)."""
    _check_manifold("points_and_tangents", manifold)
    check_real("points_and_tangents", "max_relative_norm", max_relative_norm, lambda r: r > 0, "a finite number > 0")
    points = manifold_points(manifold, shape, dtype=dtype, kinds=kinds, max_condition=max_condition)
    return points.flatmap(lambda x: tangent_vectors(manifold, x, kinds=kinds, max_relative_norm=max_relative_norm)
                          .map(lambda v: (x, v)))
