"""The steepest-descent engine: certified quality, closed forms, feasibility, warm starts.

All problems are cold random ones in float64 (the math is checked in fp64; the engine's
own kernels run in that dtype). A *certified* ratio is primal / dual with the dual
value an upper bound on the optimum, so a ratio >= 0.97 is a proof of 97% optimality.
"""

import math

import pytest
import torch

from geomuon.manifolds import CenteredRouterSpace, DGram, Euclidean, Oblique, Stiefel
from geomuon.optimizers import NORMS, msign, steepest_direction

SHAPES = [(96, 32), (384, 128)]


def _problem(m, n, seed, spread=False):
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(m, n, generator=gen, dtype=torch.float64)
    W = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))[0]
    if spread:
        # DGram column norms spread over [0.1, 10] in random order
        d = torch.logspace(-1, 1, n, dtype=torch.float64)[torch.randperm(n, generator=gen)]
        W = W * d
    return W, G


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stiefel_certifies_097(shape):
    W, G = _problem(*shape, seed=0)
    result = steepest_direction(Stiefel(), W, G)
    assert result.steps <= 200
    assert result.ratio.item() >= 0.97


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dgram_spread_norms_certifies_095_and_reference_setting_does_not(shape):
    W, G = _problem(*shape, seed=1, spread=True)
    accurate = steepest_direction(DGram(), W, G)
    assert accurate.steps <= 200
    assert accurate.ratio.item() >= 0.95
    # The unpreconditioned reference setting (-1/4 init, alpha = 0.1, 20 steps), scored by
    # the same honest certificate, stays far below: its step ignores d_i^2 + d_j^2.
    reference = steepest_direction(DGram(), W, G, preset="reference")
    assert reference.ratio.item() < 0.8
    assert accurate.ratio.item() - reference.ratio.item() > 0.15


@pytest.mark.parametrize("manifold,spread", [(Stiefel(), False), (DGram(), True), (Oblique(), False)],
                         ids=["stiefel", "dgram", "oblique"])
def test_direction_is_tangent_unit_and_certificate_is_consistent(manifold, spread):
    W, G = _problem(48, 16, seed=2, spread=spread)
    if isinstance(manifold, Oblique):
        W = manifold.projx(W)
    r = steepest_direction(manifold, W, G, steps=30)
    # exact tangent projection in fp64: the constraint vanishes to round-off (1e-12 x scale)
    scale = W.norm() * r.direction.norm()
    assert manifold.constraint(W, r.direction).abs().max().item() < 1e-12 * scale
    assert torch.linalg.matrix_norm(r.direction, ord=2).item() == pytest.approx(1.0, abs=1e-10)
    assert r.primal.item() == pytest.approx((G * r.direction).sum().item(), rel=1e-12)
    # weak duality: no feasible direction beats the dual value, and the ratio is <= 1
    assert r.ratio.item() <= 1 + 1e-10
    better = steepest_direction(manifold, W, G, steps=100)
    assert better.primal.item() <= r.dual.item() * (1 + 1e-10)


def test_more_steps_certify_more():
    W, G = _problem(96, 32, seed=3, spread=True)
    ratios = [steepest_direction(DGram(), W, G, steps=k).ratio.item() for k in (0, 20, 100)]
    assert ratios[0] < ratios[1] < ratios[2]


@pytest.mark.parametrize(
    "manifold,shape",
    [(Euclidean(), (40, 24)), (CenteredRouterSpace(), (8, 24)), (Stiefel(), (24, 24))],
    ids=["euclidean", "router", "square-stiefel"],
)
def test_closed_forms_are_optimal_without_dual_steps(manifold, shape):
    gen = torch.Generator().manual_seed(4)
    G = torch.randn(shape, generator=gen, dtype=torch.float64)
    W = manifold.projx(torch.randn(shape, generator=gen, dtype=torch.float64))
    r = steepest_direction(manifold, W, G)
    assert r.steps == 0
    # certified optimal up to fp64 round-off of the SVD-based dual
    assert r.ratio.item() == pytest.approx(1.0, abs=1e-9)
    expected = msign(manifold.proju(W, G), method="svd")
    assert torch.allclose(r.direction, expected, atol=1e-9)


@pytest.mark.parametrize("norm", ["row", "column"])
@pytest.mark.parametrize("manifold,spread", [(Stiefel(), False), (DGram(), True)], ids=["stiefel", "dgram"])
def test_other_norms_certify(norm, manifold, spread):
    W, G = _problem(96, 32, seed=5, spread=spread)
    r = steepest_direction(manifold, W, G, norm=norm)
    assert manifold.constraint(W, r.direction).abs().max().item() < 1e-10 * W.norm().item()
    assert NORMS[norm].value(r.direction, True).item() == pytest.approx(1.0, abs=1e-10)
    # Row/column dualizers are exact, so the certificate is as meaningful as for spectral.
    assert r.ratio.item() >= 0.95


def test_hybrid_norm_is_a_heuristic_dualizer_measured_against_the_spectral_ball():
    W, G = _problem(96, 32, seed=6)
    r = steepest_direction(Stiefel(), W, G, norm="hybrid")
    assert not NORMS["hybrid"].exact_dualizer
    assert Stiefel().constraint(W, r.direction).abs().max().item() < 1e-10
    assert 0.5 < r.ratio.item() <= 1 + 1e-10


def test_warm_start_resumes_the_dual():
    W, G = _problem(96, 32, seed=7, spread=True)
    kw = dict(preset=None, alpha=0.8, decay=False, certify="exact")
    first = steepest_direction(DGram(), W, G, steps=30, **kw)
    resumed = steepest_direction(DGram(), W, G, steps=0, warm_start=first.correction, **kw)
    cold = steepest_direction(DGram(), W, G, steps=0, **kw)
    assert resumed.ratio.item() == pytest.approx(first.ratio.item(), abs=1e-9)
    assert resumed.ratio.item() > cold.ratio.item() + 0.02
    assert first.multiplier.shape == (32, 32) and first.correction.shape == (32, 32)


def test_bf16_dual_iterations_keep_an_exact_tangent_fp32_direction():
    W, G = _problem(96, 32, seed=8)
    W, G = W.float(), G.float()
    r = steepest_direction(Stiefel(), W, G, preset="fast", compute_dtype=torch.bfloat16, certify="exact")
    assert r.direction.dtype == torch.float32
    # final projection in fp32: tangent to fp32 round-off (~1e-6 of the O(1) entries)
    assert Stiefel().constraint(W, r.direction).abs().max().item() < 1e-5
    assert r.ratio.item() > 0.9


def test_mostly_normal_gradient_keeps_its_tangent_part_in_bf16():
    # Near a constrained optimum G is almost normal; forming G + L*(Lambda) in bf16 would
    # cancel the tangent part. The engine forms the base point in W's dtype.
    W, G = _problem(96, 32, seed=9)
    W = W.float()
    tangent = Stiefel().proju(W, G.float())
    G = 1e3 * (W @ torch.eye(32)) + tangent
    r = steepest_direction(Stiefel(), W, G, preset="fast", compute_dtype=torch.bfloat16, certify="exact")
    assert r.ratio.item() > 0.85


@pytest.mark.parametrize("norm", list(NORMS))
def test_zero_gradient_gives_zero_direction(norm):
    W, _ = _problem(24, 8, seed=10)
    r = steepest_direction(Stiefel(), W, torch.zeros_like(W), norm=norm)
    assert torch.equal(r.direction, torch.zeros_like(W))
    assert r.ratio.item() == 1.0


def test_batched_problems_are_solved_independently():
    W1, G1 = _problem(48, 16, seed=11)
    W2, G2 = _problem(48, 16, seed=12)
    batched = steepest_direction(Stiefel(), torch.stack([W1, W2]), torch.stack([G1, G2]), steps=20)
    single = steepest_direction(Stiefel(), W2, G2, steps=20)
    assert torch.allclose(batched.direction[1], single.direction, atol=1e-10)
    assert batched.ratio.shape == (2,)


def test_bad_input():
    W, G = _problem(24, 8, seed=13)
    with pytest.raises(ValueError, match="differ"):
        steepest_direction(Stiefel(), W, G[:, :4])
    with pytest.raises(ValueError, match="unknown norm"):
        steepest_direction(Stiefel(), W, G, norm="frobenius")
    with pytest.raises(ValueError, match="unknown preset"):
        steepest_direction(Stiefel(), W, G, preset="fastest")
    with pytest.raises(ValueError, match="init"):
        steepest_direction(Stiefel(), W, G, init="random")


def test_gradient_normal_to_the_manifold_gives_no_step():
    # On O(2), a reflection W and a rotation G make W^T G symmetric: P_W G = 0 exactly, and
    # computed P_W G is round-off. Dualizing that noise would return a unit step in an
    # arbitrary direction (seen as an equivariance failure of ManifoldMuon); the engine
    # must return the zero direction instead. A generic G still gets a unit step.
    a, b = 0.7, 1.9  # angles whose P_W G comes out as round-off (~1e-16), not exact 0
    W = torch.tensor([[math.cos(a), math.sin(a)], [math.sin(a), -math.cos(a)]], dtype=torch.float64)
    G = torch.tensor([[math.cos(b), -math.sin(b)], [math.sin(b), math.cos(b)]], dtype=torch.float64)
    tangent = Stiefel().proju(W, G)
    assert 0 < tangent.abs().max() < 1e-15
    assert steepest_direction(Stiefel(), W, G).direction.abs().max() == 0
    G_generic = torch.tensor([[0.3, -0.9], [0.5, 0.2]], dtype=torch.float64)
    direction = steepest_direction(Stiefel(), W, G_generic).direction
    assert torch.linalg.matrix_norm(direction, ord=2) > 0.99
