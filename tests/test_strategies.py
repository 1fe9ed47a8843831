"""The hypothesis strategies deliver what they promise (shape, kind, scale, conditioning)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from geomuon.theory.strategies import matrices, matrix_shapes


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
