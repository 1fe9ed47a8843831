"""The steepest-descent engine: certified quality, closed forms, feasibility, warm starts.

All problems are cold random ones in float64 (the math is checked in fp64; the engine's
own kernels run in that dtype). A *certified* ratio is primal / dual with the dual
value an upper bound on the optimum, so a ratio >= 0.97 is a proof of 97% optimality.
"""

import math

import pytest
import torch

from geomuon.manifolds import CenteredRouterSpace, DGram, Euclidean, Oblique, Stiefel
from geomuon.optimizers import NORMS, ManifoldMuon, msign, steepest_direction
from geomuon.optimizers.steepest import SolverSettings

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
    reference = steepest_direction(DGram(), W, G, settings="reference")
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
    kw = dict(alpha=0.8, decay=False, tol=0.0, track_best=False)
    first = steepest_direction(DGram(), W, G, steps=30, **kw)
    resumed = steepest_direction(DGram(), W, G, steps=0, warm_start=first.correction, **kw)
    cold = steepest_direction(DGram(), W, G, steps=0, **kw)
    assert resumed.ratio.item() == pytest.approx(first.ratio.item(), abs=1e-9)
    assert resumed.ratio.item() > cold.ratio.item() + 0.02
    assert first.multiplier.shape == (32, 32) and first.correction.shape == (32, 32)


def test_bf16_dual_iterations_keep_an_exact_tangent_fp32_direction():
    W, G = _problem(96, 32, seed=8)
    W, G = W.float(), G.float()
    r = steepest_direction(Stiefel(), W, G, settings="fast", compute_dtype=torch.bfloat16, certify="exact")
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
    r = steepest_direction(Stiefel(), W, G, settings="fast", compute_dtype=torch.bfloat16, certify="exact")
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


@pytest.mark.parametrize("manifold", [Stiefel(), DGram(), Oblique()], ids=lambda m: type(m).__name__)
def test_a_matrix_meeting_the_tolerance_gets_its_own_result_whatever_its_batch_mates(manifold):
    # the tolerance stop was one flag for the batch: a matrix that met it went on stepping until its
    # batch-mates did, and its direction moved by 2e-11 to 1e-10 from the one it got alone (fp64)
    torch.manual_seed(1)
    W = manifold.projx(torch.randn(4, 12, 5, dtype=torch.float64))
    G = torch.randn(4, 12, 5, dtype=torch.float64)
    G[2] += 30 * W[2] @ torch.randn(5, 5, dtype=torch.float64)  # mostly normal: the slowest to converge
    batched = steepest_direction(manifold, W, G)
    alone = [steepest_direction(manifold, W[i:i + 1], G[i:i + 1]) for i in range(4)]
    assert len({result.steps for result in alone}) > 1  # they meet the tolerance at different steps
    # a batched product may round a few ulps apart from a single one, and up to 100 dual steps
    # carry it at this conditioning (O(10)): 1e3 ulps, a hundred times below the gap above
    for i, result in enumerate(alone):
        assert torch.allclose(batched.direction[i], result.direction[0], rtol=0,
                              atol=1e3 * torch.finfo(torch.float64).eps), i


def test_bad_input():
    W, G = _problem(24, 8, seed=13)
    with pytest.raises(ValueError, match="differ"):
        steepest_direction(Stiefel(), W, G[:, :4])
    with pytest.raises(ValueError, match="unknown norm"):
        steepest_direction(Stiefel(), W, G, norm="frobenius")
    with pytest.raises(ValueError, match="unknown preset"):
        steepest_direction(Stiefel(), W, G, settings="fastest")
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


# --------------------------------------------------------------------- round-off sensitivity


def test_a_closed_form_ignores_the_warm_start():
    # On square Stiefel Phi(P_W G) is tangent: the dual gradient is round-off. Dual steps there
    # only feed round-off into the warm start, and the next direction moves by about
    # round-off / sigma_min(P_W G): in fp32 training this turned a reordered batch sum into a
    # 1e-2 weight drift in 20 steps. The engine and ManifoldMuon take the closed form whatever
    # the warm start says.
    gen = torch.Generator().manual_seed(14)
    W = Stiefel().random(16, 16, generator=gen, dtype=torch.float64).detach()
    G = torch.randn(16, 16, generator=gen, dtype=torch.float64)
    noise = 1e-3 * torch.randn(16, 16, generator=gen, dtype=torch.float64)
    cold = steepest_direction(Stiefel(), W, G, settings="fast")
    warm = steepest_direction(Stiefel(), W, G, settings="fast", warm_start=noise)
    assert torch.equal(cold.direction, warm.direction) and warm.correction is None and warm.steps == 0
    # negative control: at a tall point (no closed form) the same warm start moves the direction
    Wt = Stiefel().random(24, 16, generator=gen, dtype=torch.float64).detach()
    Gt = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    assert not torch.allclose(steepest_direction(Stiefel(), Wt, Gt, settings="fast").direction,
                              steepest_direction(Stiefel(), Wt, Gt, settings="fast", warm_start=noise).direction,
                              atol=1e-6)


def _manifold_muon_point(W, G, correction):
    p = torch.nn.Parameter(W.clone())
    opt = ManifoldMuon([p], lr=0.05, manifold="stiefel", compute_dtype=None)
    p.grad = G.clone()
    if correction is not None:
        opt.state[p]["dual_correction"] = correction.clone()
    opt.step()
    return p.detach()


def test_manifold_muon_takes_the_closed_form_whatever_its_warm_start(monkeypatch):
    gen = torch.Generator().manual_seed(15)
    W = Stiefel().random(16, 16, generator=gen).detach()
    G = torch.randn(16, 16, generator=gen)
    noise = 1e-3 * torch.randn(16, 16, generator=gen)
    assert torch.equal(_manifold_muon_point(W, G, None), _manifold_muon_point(W, G, noise))
    # negative control: without the closed form the warm start takes part in the step
    monkeypatch.setattr(Stiefel, "dualizer_keeps_tangent", lambda self, x, norm: False)
    assert not torch.equal(_manifold_muon_point(W, G, None), _manifold_muon_point(W, G, noise))


def _ulp_apart(G, gen):
    """Every entry moved by one ulp, up or down at random."""
    up = torch.rand(G.shape, generator=gen) < 0.5
    return torch.nextafter(G, torch.where(up, torch.inf, -torch.inf))


def _trajectory(manifold, W0, grads, lr):
    p = torch.nn.Parameter(W0.clone())
    opt = ManifoldMuon([p], lr=lr, manifold=manifold, compute_dtype=None)
    points = []
    for g in grads:
        points.append(p.detach().clone())
        p.grad = g.clone()
        opt.step()
    return p.detach(), points


ULP_CASES = [(Stiefel(), (48, 16)), (Stiefel(), (16, 16)), (DGram(), (48, 16)), (DGram(), (16, 48))]


def _ulp_run(manifold, shape, seed=3, steps=3, lr=0.02):
    gen = torch.Generator().manual_seed(seed)
    W0 = manifold.random(*shape, generator=gen).detach()
    grads = [torch.randn(shape, generator=gen) for _ in range(steps)]
    a, points = _trajectory(manifold, W0, grads, lr)
    b, points_b = _trajectory(manifold, W0, [_ulp_apart(grads[0], gen)] + grads[1:], lr)
    # condition of the steepest direction (the polar factor of the tangent part Z = P_W G has
    # absolute condition 2/(sigma_{n-1} + sigma_n) <= 1/sigma_min, Higham, "Functions of
    # Matrices", Thm 8.9), relative to the gradient's size, worst over the run
    kappa = max((g.double().norm() / torch.linalg.svdvals(manifold.proju(w.double(), g.double()))[-1]).item()
                for w, g in zip(points, grads))
    return a, b, kappa, (points, points_b)


@pytest.mark.parametrize("manifold,shape", ULP_CASES, ids=["stiefel-tall", "stiefel-square", "dgram-tall", "dgram-wide"])
def test_one_ulp_of_the_gradient_moves_the_steps_by_ulp_times_condition(manifold, shape):
    # No discrete switch in the engine (a data-dependent branch, threshold or stopping rule):
    # a 1-ulp change of the first gradient of a warm-started fp32 run moves the weights after
    # 3 steps by at most steps * lr * c * eps * kappa. Derivation of c: each step's direction
    # is a polar factor, whose forward error is (input error + the pipeline's backward error)
    # / sigma_min; the input error is eps ||G||, the backward error of its four m-term fp32
    # products (W^T G, Z0^T Z0, the assembly, the retraction's Gram) at most 4 m eps ||G||,
    # m the long side: c = 4 max(m, n) + 1. Measured ratios d / (steps lr eps kappa): 3-33.
    a, b, kappa, _ = _ulp_run(manifold, shape)
    eps, steps, lr = torch.finfo(torch.float32).eps, 3, 0.02
    bound = steps * lr * (4 * max(shape) + 1) * eps * kappa
    assert 0 < (a - b).norm().item() <= bound


def test_the_ulp_test_catches_a_data_dependent_branch(monkeypatch):
    # negative control: a discrete switch that the two runs straddle (here: "closed form" once
    # the point's entry sum has crossed, from the start's side, a threshold between the two
    # runs' points after step 1; step 1 itself takes the default path in both runs)
    manifold, shape = Stiefel(), (48, 16)
    _, _, _, (points_a, points_b) = _ulp_run(manifold, shape)
    start, first, second = (x.double().sum().item() for x in (points_a[0], points_a[1], points_b[1]))
    assert first != second
    threshold = (first + second) / 2
    start_above = start > threshold
    monkeypatch.setattr(Stiefel, "dualizer_keeps_tangent",
                        lambda self, x, norm: (x.double().sum().item() > threshold) != start_above)
    a, b, kappa, _ = _ulp_run(manifold, shape)
    eps, steps, lr = torch.finfo(torch.float32).eps, 3, 0.02
    assert (a - b).norm().item() > steps * lr * (4 * max(shape) + 1) * eps * kappa


@pytest.mark.parametrize("changes, match", [
    (dict(steps=2.5), "steps must be a whole number"),
    (dict(steps=True), "steps must be a whole number"),
    (dict(alpha=-1.0), "alpha must be a finite number > 0"),
    (dict(alpha=float("nan")), "alpha must be a finite number > 0"),
    (dict(tol=float("nan")), "tol must be a finite number >= 0"),
    (dict(decay="yes"), "decay must be True or False"),
    (dict(msign_method="polar"), "msign_method must be one of"),
    (dict(msign_steps=0), "msign_steps must be a whole number >= 1"),
    (dict(compute_dtype=torch.int32), "compute_dtype must be a real floating"),
    (dict(compute_dtype=torch.float16), "compute_dtype=torch.float16 cannot hold"),
])
def test_solver_settings_refuse_bad_values_by_name(changes, match):
    # each had been taken: 2.5 steps failed inside range(), a negative alpha ascended the dual
    # (ratio 2e-17), NaN reached an SVD, fp16 iterates of entries 1e5 overflowed
    with pytest.raises(ValueError, match=f"SolverSettings: {match}"):
        SolverSettings().replace(**changes)


def test_steepest_direction_refuses_what_it_cannot_take_by_name():
    W = Stiefel().random(6, 3, dtype=torch.float64)
    G = torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="settings must be a SolverSettings"):
        steepest_direction(Stiefel(), W, G, settings={"steps": 3})
    with pytest.raises(ValueError, match="unknown norm 5"):
        steepest_direction(Stiefel(), W, G, norm=5)
    with pytest.raises(ValueError, match=r"W \(torch.float64\) and G \(torch.float32\) must share"):
        steepest_direction(Stiefel(), W, G.float())
    with pytest.raises(ValueError, match=r"W \(torch.bfloat16\) and G \(torch.bfloat16\) must share"):
        steepest_direction(Stiefel(), W.bfloat16(), G.bfloat16())
    steepest_direction(Stiefel(), W, G, settings=SolverSettings(steps=2))  # control
    # a NaN in G had returned a zero direction certified optimal (ratio 1; row and column norms)
    # or an SVD error naming nothing (spectral)
    for name, bad in (("W", (W.clone().index_fill_(0, torch.tensor([0]), math.nan), G)),
                      ("G", (W, G.clone().index_fill_(0, torch.tensor([0]), math.inf)))):
        for norm in ("spectral", "row"):
            with pytest.raises(ValueError, match=rf"steepest_direction: {name} has non-finite entries"):
                steepest_direction(Stiefel(), *bad, norm=norm)


@pytest.mark.parametrize("manifold, multiplier", [(Stiefel(), (3, 3)), (Oblique(), (3,))], ids=["stiefel", "oblique"])
def test_a_warm_start_of_another_shape_is_refused_by_name(manifold, multiplier):
    # a batch of warm starts for one matrix had broadcast its [6, 3] direction to [2, 2, 6, 3] (or
    # [2, 2, 2, 2, 6, 3]), and a warm start of the wrong size failed inside a matrix product
    W = manifold.random(6, 3, dtype=torch.float64)
    G = torch.randn(6, 3, dtype=torch.float64)
    for shape in ((2, *multiplier), (4,) * len(multiplier)):
        with pytest.raises(ValueError, match=rf"steepest_direction: warm_start \({', '.join(map(str, shape))},?\) "
                                             rf"must have the multiplier's shape \({multiplier[0]}"):
            steepest_direction(manifold, W, G, steps=2, warm_start=torch.zeros(shape, dtype=torch.float64))
    # control: a previous result's correction is taken (its shape is the multiplier's)
    first = steepest_direction(manifold, W, G, steps=2)
    assert first.correction.shape == multiplier
    assert steepest_direction(manifold, W, G, steps=2, warm_start=first.correction).direction.shape == W.shape


@pytest.mark.parametrize("norm", ["spectral", "row"])
def test_a_normal_gradient_certifies_the_zero_direction_it_returns(norm):
    # G = W S (S symmetric) is normal to Stiefel at W: the direction is zeroed, and the
    # certificate had described the discarded one (primal 1e-7, ratio 0.53; 1.32 for the row
    # norm, above 1, which a certified fraction of the optimum cannot be)
    W = Stiefel().random(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    S = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    result = steepest_direction(Stiefel(), W, W @ (S + S.mT), norm=norm)
    assert torch.equal(result.direction, torch.zeros_like(W))
    assert float(result.primal) == 0.0 and float(result.ratio) == 1.0
    tangent = steepest_direction(Stiefel(), W, torch.randn(8, 4, dtype=torch.float64), norm=norm)
    assert 0 < float(tangent.ratio) <= 1 + 1e-12  # control: a tangent part keeps its certificate


@pytest.mark.parametrize("manifold", [Euclidean(), Oblique(), Stiefel(), DGram()], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("norm", ["spectral", "row"])
def test_the_engine_is_homogeneous_in_g_across_fp32s_range(manifold, norm):
    # The solve runs on G over a power of two of its largest entry, so a G scaled by 2^k is the same
    # problem bit for bit: the direction is identical and primal, dual, multiplier and correction are
    # scaled by exactly 2^k (multiplying by a power of two is exact). Unscaled, an fp32 G of entries
    # 1e21 squared to inf in msign's normalization (zero direction, ratio 0) and one of 1e-25 to zero.
    # (Not the reference preset: its unpreconditioned dual step, a fixed multiplier change, is not
    # homogeneous and is taken in G's units, as before the scaling; the DGram test above holds it to
    # its published behaviour.)
    from geomuon.optimizers.steepest import ACCURATE as settings, _solve_unit_scaled

    W = manifold.random(3, 12, 6, generator=torch.Generator().manual_seed(1))
    G = torch.randn(3, 12, 6, generator=torch.Generator().manual_seed(0))
    warm = steepest_direction(manifold, W, G, norm, settings, steps=2).correction
    reference = steepest_direction(manifold, W, G, norm, settings, warm_start=warm, steps=2)
    for k in (-90, 75):
        scaled = steepest_direction(manifold, W, G * 2.0**k, norm, settings,
                                    warm_start=None if warm is None else warm * 2.0**k, steps=2)
        assert torch.equal(scaled.direction, reference.direction), k
        for field in ("primal", "dual", "multiplier", "correction"):
            got, want = getattr(scaled, field), getattr(reference, field)
            assert (got is None and want is None) or torch.equal(got, want * 2.0**k), (k, field)
    # A decimal scale is not exact: G's entries round afresh (relative 2^-24), a perturbation the
    # solve's own fp32 round-off (about sqrt(mn) eps on the 12 x 6 matrices) already exceeds; the
    # certified ratio stays the scale-1 problem's within 32 sqrt(mn) eps (measured: 5e-7 of 3.2e-5).
    base = steepest_direction(manifold, W, G, norm, settings).ratio
    tol = 32 * (12 * 6) ** 0.5 * torch.finfo(torch.float32).eps
    for scale in (1e-25, 1e21):
        ratio = steepest_direction(manifold, W, G * scale, norm, settings).ratio
        assert torch.allclose(ratio, base, rtol=0, atol=tol), scale
    # control: the same solve without the scale loses G's direction at 1e21
    unscaled = _solve_unit_scaled(manifold, W, G * 1e21, torch.ones(3), NORMS[norm], settings, None)
    assert not torch.allclose(unscaled.ratio, base, rtol=0, atol=tol)


def test_a_nan_dual_certifies_nan_not_optimal():
    # the ratio had been 1 wherever the dual was not above tiny, a NaN dual included: the
    # unchecked engine (the optimizers' call, which reads nothing back) certified a NaN gradient's
    # direction optimal. Control: a zero G (dual 0) still certifies its zero direction 1.
    from geomuon.optimizers.steepest import unchecked_steepest_direction

    W = Oblique().random(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    G[0, 0] = math.nan
    assert math.isnan(float(unchecked_steepest_direction(Oblique(), W, G, norm="row").ratio))
    assert float(unchecked_steepest_direction(Oblique(), W, torch.zeros_like(G), norm="row").ratio) == 1.0


def test_certified_ratio_refuses_iterates_of_another_shape():
    # an iterate of another shape had broadcast into a "ratio" of 8.5; none had raised from stack()
    from geomuon.optimizers.steepest import certified_ratio

    W = Oblique().random(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    result = steepest_direction(Oblique(), W, G)
    with pytest.raises(ValueError, match=r"certified_ratio: iterate 0 has shape \(5, 3\), G \(6, 3\)"):
        certified_ratio(G, result.direction, torch.randn(5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="certified_ratio: give at least one dual iterate"):
        certified_ratio(G, result.direction)
    assert 0 < float(certified_ratio(G, result.direction, G)) <= 1  # control: Z = G bounds the optimum


def test_the_hybrid_direction_is_scale_free():
    # its row normalization had floored row norms at 1e-8, so G * 1e-5 moved the direction by
    # 0.5; with the dtype's tiny as the floor it is degree 0 in G. Tolerance: both runs round
    # the same normalized rows in float64, then 12 Polar Express steps: 1e-10.
    W = Stiefel().random(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    reference = steepest_direction(Stiefel(), W, G, norm="hybrid").direction
    for scale in (1e-5, 1e-12):
        scaled = steepest_direction(Stiefel(), W, G * scale, norm="hybrid").direction
        assert (scaled - reference).abs().max() <= 1e-10, scale
