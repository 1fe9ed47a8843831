"""The hypothesis strategies deliver what they promise (shape, kind, scale, conditioning)."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomuon.manifolds import MatrixManifold
from geomuon.theory.contracts import default_tolerance, normal_component
from geomuon.theory.strategies import matrices, matrix_shapes, points_and_tangents, tangent_vectors


@given(orientation=st.sampled_from(["tall", "square", "wide"]), data=st.data())
def test_shapes_have_the_drawn_orientation(orientation, data):
    shape = data.draw(matrix_shapes(orientations=(orientation,), max_batch_dims=2))
    *batch, m, n = shape
    assert len(batch) <= 2
    assert {"tall": m > n, "square": m == n, "wide": m < n}[orientation]


@given(matrices(kinds=("ill_conditioned", "rank_deficient", "column_scaled"), max_condition=1e3))
def test_matrices_respect_scale_and_condition(x):
    assert x.dtype == torch.float64
    rms = x.square().mean(dim=(-2, -1)).sqrt()
    # The RMS is set exactly up to round-off; the range is [1e-3, 1e3].
    assert ((rms >= 1e-3 * (1 - 1e-12)) & (rms <= 1e3 * (1 + 1e-12))).all()
    assert torch.isfinite(x).all()


@given(matrices(matrix_shapes(min_side=2), kinds=("ill_conditioned",), max_condition=1e3))
def test_ill_conditioned_matrices_have_bounded_condition(x):
    s = torch.linalg.svdvals(x)
    condition = s[..., 0] / s[..., -1]
    # Synthesized from exact singular values in [1/kappa, 1]: round-off only (1e-12).
    assert (condition <= 1e3 * (1 + 1e-9)).all()


@given(matrices(matrix_shapes(min_side=2), kinds=("rank_deficient",)))
def test_rank_deficient_matrices_lose_rank(x):
    s = torch.linalg.svdvals(x)
    # Zero singular values come back at round-off: 1e-12 of the largest in float64.
    numerical_rank = (s > 1e-12 * s[..., :1]).sum(-1)
    assert (numerical_rank < s.size(-1)).all()


# --------------------------------------------------------------------------- tangent vectors
# Every built-in manifold, from the registry (as tests/test_manifolds.py takes them).
MANIFOLDS = {cls.name.lower(): cls for cls in MatrixManifold.registered().values()
             if cls.__module__.startswith("geomuon.manifolds.")}


def _relative(a, b):
    """Largest ||a|| / ||b|| over the batch, in float64 (0 where both are zero)."""
    a, b = a.double().norm(dim=(-2, -1)), b.double().norm(dim=(-2, -1))
    return float(torch.where(a == 0, 0.0, a / b.clamp_min(1e-300)).max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", MANIFOLDS)
@given(data=st.data())
def test_drawn_tangent_vectors_are_tangent(name, dtype, data):
    """Half the draws had been full-size normal vectors: hypothesis often draws the point's
    seed again, the raw matrix is then x·H (normal), and its round-off projection was
    rescaled to the drawn norm (|proju(x, v) - v| / |v| of 0.99)."""
    manifold = MANIFOLDS[name]()
    x, v = data.draw(points_and_tangents(manifold, matrix_shapes(min_side=2, max_side=8), dtype=dtype))
    assert (x.dtype, v.dtype) == (dtype, dtype)
    # The contract tolerance (1e-10 in float64, 1e-5 in float32: see default_tolerance),
    # relative to v's own norm: the vector is exact in float64 up to projection round-off
    # (at most 1e-10 at the worst constraint Gram) and then rounded to the dtype (6e-8).
    tol = default_tolerance(dtype)
    assert _relative(normal_component(manifold, x, v), v) <= tol
    assert _relative(manifold.proju(x.double(), v.double()) - v.double(), v) <= tol


def test_tangent_vectors_are_tangent_when_the_raw_matrix_is_the_point_itself():
    """The degenerate draw made certain: the raw matrix lies in the normal space (the point
    itself), so its projection is round-off. A tangent vector of the drawn norm comes back."""
    manifold = MANIFOLDS["stiefel"]()
    x = manifold.projx(torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))

    @given(st.data())
    def check(data):
        v = data.draw(tangent_vectors(manifold, x, kinds=("gaussian",)))
        assert _relative(normal_component(manifold, x, v), v) <= default_tolerance(torch.float64)
        assert v.norm() > 0  # the 6x3 Stiefel tangent space has dimension 15: never zero

    import geomuon.theory.strategies as strategies

    real = strategies.matrices
    # every raw matrix is x scaled: the worst case, which hypothesis hit in half the draws
    strategies.matrices = lambda *args, **kwargs: st.floats(1e-3, 1e3).map(lambda s: s * x)
    try:
        check()
    finally:
        strategies.matrices = real


# --------------------------------------------------------------------------- bad options
@pytest.mark.parametrize("options, message", [
    (dict(orientations="tall"), "orientations must be a tuple of names, got the string 'tall'; write ('tall',)"),
    (dict(orientations=("Tall",)), "unknown orientations ['Tall']"),
    (dict(orientations=()), "orientations is empty"),
    (dict(min_side=3, max_side=3, orientations=("tall",)), "tall shapes need m != n"),
    (dict(min_side=0), "min_side must be a whole number >= 1"),
    (dict(min_side=5, max_side=3), "max_side=3 is below min_side=5"),
    (dict(max_batch=0), "max_batch must be a whole number >= 1"),
    (dict(max_batch_dims=-1), "max_batch_dims must be a whole number >= 0"),
])
def test_matrix_shapes_refuses_bad_options_by_name(options, message):
    # each had drawn squares, all-wide shapes, sizes <= 0 or failed inside hypothesis
    with pytest.raises(ValueError, match=re.escape(f"matrix_shapes: {message}")):
        matrix_shapes(**options)


def test_matrix_shapes_with_equal_sides_still_draws_squares():
    @given(matrix_shapes(min_side=3, max_side=3, orientations=("square",), max_batch_dims=0))
    def check(shape):
        assert shape == (3, 3)

    check()


@pytest.mark.parametrize("options, message", [
    (dict(min_scale=0), "min_scale must be a finite number >= "),
    (dict(min_scale=-1.0), "min_scale must be a finite number >= "),
    (dict(min_scale=1e-50, dtype=torch.float32), "min_scale must be a finite number >= 1.18e-38"),
    (dict(min_scale=10.0, max_scale=1.0), "max_scale must be a finite number >= min_scale=10.0"),
    (dict(max_scale=float("nan")), "max_scale must be a finite number"),
    (dict(max_scale=float("inf")), "max_scale must be a finite number"),
    (dict(max_condition=0.5), "max_condition must be a finite number >= 1"),
    (dict(max_condition=float("inf")), "max_condition must be a finite number >= 1"),
    (dict(dtype=torch.int64), "dtype must be a real floating torch.dtype"),
    (dict(kinds=()), "kinds is empty"),
    (dict(kinds="gaussian"), "kinds must be a tuple of names, got the string 'gaussian'"),
    (dict(kinds=("gauss",)), "unknown kinds ['gauss']"),
    (dict(shape=(3,)), "shape must be (*batch, m, n)"),
    (dict(shape=(0, 3)), "shape must be (*batch, m, n)"),
    (dict(shape=(4, 3), dtype=torch.float32, min_scale=1e38, max_scale=1e38), "max_scale=1e+38 can overflow"),
])
def test_matrices_refuses_bad_options_by_name(options, message):
    # each had drawn zeros, truncated integers, overflowed mid-draw or failed inside hypothesis
    with pytest.raises(ValueError, match=re.escape(f"matrices: {message}")):
        matrices(**options)


@settings(max_examples=60)
@given(data=st.data(), bounds=st.sampled_from([(2.0, 3.0), (0.1, 0.1), (1.0, 1e50), (1e-50, 1.0)]))
def test_matrices_keep_the_rms_within_tight_and_extreme_bounds(data, bounds):
    """The bounds had been rounded in float32 (RMS 3.00000006 > max_scale 3), 1e-50 had
    underflowed to all-zero matrices and 1e50 overflowed mid-draw."""
    low, high = bounds
    x = data.draw(matrices((4, 3), min_scale=low, max_scale=high))
    rms = float(x.square().mean().sqrt())
    # The drawn scale is clamped into [low, high] exactly; the one float64 rescaling then
    # rounds the RMS by a few ulps (1e-15 relative, with margin).
    assert low * (1 - 1e-14) <= rms <= high * (1 + 1e-14)


@given(matrices(matrix_shapes(min_side=2), kinds=("ill_conditioned",), max_condition=1e40))
def test_a_huge_condition_bound_draws_without_overflow(x):
    # 1e40 had overflowed float32's log10 (OverflowError mid-draw)
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_tangent_strategies_refuse_a_bad_relative_norm(value):
    manifold = MANIFOLDS["stiefel"]()
    with pytest.raises(ValueError, match="max_relative_norm must be a finite number > 0"):
        points_and_tangents(manifold, (4, 3), max_relative_norm=value)
    with pytest.raises(ValueError, match="max_relative_norm must be a finite number > 0"):
        tangent_vectors(manifold, torch.eye(4, 3, dtype=torch.float64), max_relative_norm=value)


@given(matrices(matrix_shapes(min_side=1, max_side=8), kinds=("column_scaled",), max_condition=10.0))
def test_column_scaled_matrices_have_bounded_condition(x):
    """The docstring bounds kappa by max_condition for the column-scaled kind too; Gaussian
    columns times the scales had reached kappa = 2e3 at max_condition = 10."""
    s = torch.linalg.svdvals(x)
    condition = s[..., 0] / s[..., -1]
    # A backward-stable SVD moves each singular value by at most p(m, n) eps sigma_max, so
    # the computed kappa is off by a relative kappa p(m, n) eps <= 10 * 64 * 2.2e-16 = 1.4e-13
    # here (p(m, n) <= 64 for sides <= 8): 1e-9 leaves margin and is far below any violation.
    assert (condition <= 10.0 * (1 + 1e-9)).all()


def test_rank_deficient_matrices_are_refused_where_no_nonzero_one_exists():
    """At min(m, n) = 1 the rank-deficient kind had drawn a full-rank Gaussian instead."""
    message = "matrices: kinds=('rank_deficient',) cannot be drawn at shape (1, 5)"
    with pytest.raises(ValueError, match=re.escape(message)):
        matrices((1, 5), kinds=("rank_deficient",))

    @given(matrices(st.just((1, 5)), kinds=("rank_deficient",)))
    def drawn_shape(x):
        pass

    with pytest.raises(ValueError, match=re.escape(message)):
        drawn_shape()


@pytest.mark.parametrize("strategy", ["manifold_points", "tangent_vectors", "points_and_tangents"])
@pytest.mark.parametrize("manifold, message", [
    (MANIFOLDS["stiefel"], "got the class Stiefel; pass Stiefel()"),
    ("stiefel", "(e.g. Stiefel()), got 'stiefel'"),
])
def test_point_strategies_refuse_what_is_not_a_manifold_instance(strategy, manifold, message):
    # the class had failed at the first draw ("projx() missing 1 required positional argument")
    import geomuon.theory.strategies as strategies

    point = torch.eye(4, 3, dtype=torch.float64)
    arguments = (manifold, point) if strategy == "tangent_vectors" else (manifold, (4, 3))
    with pytest.raises(ValueError, match=re.escape(f"{strategy}: manifold must be a MatrixManifold instance")
                       + ".*" + re.escape(message)):
        getattr(strategies, strategy)(*arguments)


def test_tangent_vectors_refuse_an_empty_point():
    # it had been accepted and failed at the first draw, naming `matrices` and not the point
    with pytest.raises(ValueError, match=re.escape("tangent_vectors: point must be a floating tensor [..., m, n] "
                                                   "with every size >= 1, got torch.float64 of shape (0, 3)")):
        tangent_vectors(MANIFOLDS["stiefel"](), torch.zeros(0, 3, dtype=torch.float64))
