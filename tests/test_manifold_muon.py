"""ManifoldMuon: known optimum, staying on the manifold, certified quality in a run."""

import copy
import re
from functools import partial

import geoopt
import pytest
import torch

from geomuon.manifolds import LPRO, DGram, Euclidean, MatrixManifold, Oblique, Stiefel
from geomuon.manifolds.capabilities import gram_retraction, inv_sqrt_near_identity, series_radius
from geomuon.optimizers import ManifoldMuon, OffManifoldError, gram, manifold_muon, msign, steepest
from geomuon.optimizers.gram import GramSettings, gram_msign, polynomial_inverse_sqrt


@pytest.mark.parametrize("solver", ["dual", "projected"])
def test_stiefel_projection_problem_converges_to_msign_and_stays_on_the_manifold(solver):
    # min ||W - M||_F^2 over W^T W = I has the known solution msign(M).
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(8, 4, generator=gen)
    W = torch.nn.Parameter(Stiefel().random(8, 4, generator=gen).data)
    opt = ManifoldMuon([W], manifold="stiefel", lr=0.05, solver=solver)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 5000, eta_min=1e-4)
    for _ in range(5000):
        W.grad = 2 * (W.detach() - M)
        opt.step()
        sched.step()
    Wd = W.detach()
    assert Wd.dtype == torch.float32
    assert ("dual_correction" in opt.state[W]) == (solver == "dual")  # the solver asked for ran
    # after 5,000 fp32 steps the polished fp32 retraction keeps W^T W = I to 1e-5
    assert (Wd.T @ Wd - torch.eye(4)).abs().max().item() <= 1e-5
    # final lr 1e-4 with unit-norm steps: W sits within ~1e-4 of the optimum
    target = msign(M.double(), method="svd").float()
    assert (Wd - target).abs().max().item() <= 1e-3


@pytest.mark.parametrize("solver", ["dual", "projected"])
def test_dgram_iterates_stay_on_dgram(solver):
    gen = torch.Generator().manual_seed(1)
    # targets with column norms over [0.1, 10]
    M = torch.randn(16, 6, generator=gen) * torch.logspace(-1, 1, 6)
    W = torch.nn.Parameter(DGram().random(16, 6, generator=gen).data)
    opt = ManifoldMuon([W], manifold="dgram", lr=0.05, solver=solver)
    cosine_max = 0.0
    for _ in range(1000):
        W.grad = 2 * (W.detach() - M)
        opt.step()
        q = W.detach() / W.detach().norm(dim=0)
        cosine_max = max(cosine_max, (q.T @ q - torch.eye(6)).abs().max().item())
    # columns stay orthogonal to fp32 round-off at every step (cosines <= 1e-5)
    assert cosine_max <= 1e-5
    assert ("dual_correction" in opt.state[W]) == (solver == "dual")  # the solver asked for ran
    loss = ((W.detach() - M) ** 2).sum().item()
    assert loss < ((DGram().random(16, 6, generator=gen) - M) ** 2).sum().item()


def _regression_run(manifold, shape, steps, seed=0, **kwargs):
    """Noisy least squares with a fresh full-rank batch per step; returns the certified ratios."""
    gen = torch.Generator().manual_seed(seed)
    target = manifold.projx(torch.randn(shape, generator=gen))
    W = torch.nn.Parameter(manifold.projx(torch.randn(shape, generator=gen)))
    opt = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=0.02, certify_every=1, **kwargs)
    ratios = []
    for _ in range(steps):
        X = torch.randn(2 * max(shape), shape[0], generator=gen)
        Y = X @ target + 0.1 * torch.randn(X.shape[0], shape[1], generator=gen)
        W.grad = X.T @ (X @ W.detach() - Y) / X.shape[0]
        opt.step()
        ratios.extend(opt.certificates.values())
    return ratios


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=["stiefel", "dgram"])
def test_default_settings_certify_095_along_a_training_run(manifold):
    ratios = _regression_run(manifold, (192, 64), steps=15)
    # the exact (SVD) certificate of every step's direction, averaged over the run
    assert sum(ratios) / len(ratios) >= 0.95


@pytest.mark.parametrize("manifold,floor", [(Stiefel(), 0.97), (DGram(), 0.92)], ids=["stiefel", "dgram"])
def test_the_projected_solver_certifies_against_a_reference_solve_along_a_training_run(manifold, floor):
    # Its own dual iterate is the projection start, several percent above the optimum;
    # against a 32-step reference solve's dual the same directions certify (measured: Stiefel
    # 0.978 own / 0.983 reference, DGram 0.934 / 0.944, mean over 15 steps of a 192 x 64
    # regression). Control: the reference really tightens the certificate.
    own = _regression_run(manifold, (192, 64), steps=15, solver="projected")
    tight = _regression_run(manifold, (192, 64), steps=15, solver="projected", certify_reference=32)
    assert sum(tight) / len(tight) >= floor
    assert sum(tight) > sum(own)


def test_the_projected_solver_is_refused_where_the_gram_path_does_not_serve():
    with pytest.raises(ValueError, match="solver must be one of"):
        ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold="stiefel", solver="newton")
    with pytest.raises(ValueError, match="solver='projected'.*norm='spectral'"):
        ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold="stiefel", solver="projected", norm="row")
    with pytest.raises(ValueError, match="needs a manifold with a Gram form.*Euclidean"):
        ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold=Euclidean(), solver="projected")
    # a wide Oblique matrix (Oblique does not step wide points transposed) would take the
    # general path with dual steps: refused, not silently served by the other solver
    with pytest.raises(ValueError, match=r"wide \(2 x 4\) on Oblique.*solver='dual'"):
        ManifoldMuon([torch.nn.Parameter(torch.zeros(2, 4))], manifold=Oblique(), solver="projected")
    # the dual options would be ignored (dual_steps=5 ran no dual step): refused by name
    for option in (dict(dual_steps=5), dict(cold_dual_steps=2), dict(dual_alpha=0.5), dict(dual_update="jacobi"),
                   dict(dual_smoothing=0.1)):
        with pytest.raises(ValueError, match=rf"solver='projected' takes no dual.*{next(iter(option))}="):
            ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold="stiefel", solver="projected", **option)
        ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold="stiefel", solver="dual", **option)
    # control: the same parameters are accepted with a Gram-form manifold, and by the dual solver
    ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold="stiefel", solver="projected", polish_rounds=2,
                 gram_dualizer="polar_express", warm_start=False)
    ManifoldMuon([torch.nn.Parameter(torch.zeros(2, 4))], manifold=Stiefel(), solver="projected")
    ManifoldMuon([torch.nn.Parameter(torch.zeros(2, 4))], manifold=Oblique(), solver="dual")
    ManifoldMuon([torch.nn.Parameter(torch.zeros(4, 2))], manifold=Euclidean(), solver="dual")


def test_a_newton_update_is_refused_where_the_gram_form_declares_none():
    # Oblique's Gram form declares no Newton step: dual_update="newton" ran Jacobi's steps, the
    # option silently ignored (bit for bit the jacobi run). Refused by name; the controls: the
    # default and "jacobi" on Oblique, "newton" on the forms that declare one, and "newton" where
    # the Gram path does not run (a wide Oblique matrix takes the general path, whose refusal of
    # Gram options names it)
    def make(manifold, shape=(4, 2), **options):
        return ManifoldMuon([torch.nn.Parameter(torch.zeros(*shape))], manifold=manifold, **options)

    with pytest.raises(ValueError, match=r"dual_update='newton' would be ignored for parameter .*Oblique.*'jacobi'"):
        make(Oblique(), dual_update="newton")
    make(Oblique())
    make(Oblique(), dual_update="jacobi")
    for manifold in ("stiefel", "dgram"):
        make(manifold, dual_update="newton")
    with pytest.raises(ValueError, match="dual_update='newton' would be ignored: they are options of the Gram path"):
        make(Oblique(), shape=(2, 4), dual_update="newton")


@pytest.mark.parametrize("options", [
    dict(solver="projected"), dict(solver="projected", compute_dtype=None), dict(solver="dual"),
    dict(norm="row"), dict(norm="hybrid"), dict(retraction="manifold"),
], ids=["projected-bf16", "projected-points-dtype", "dual", "general-row", "general-hybrid", "general-manifold-retraction"])
def test_weight_decay_on_stiefel_does_not_step_on_a_normal_gradient(options):
    # grad = 2W is normal to Stiefel at W (the gradient of ||W||_F^2, constant on it): no step,
    # with weight decay too. The decayed point cW has W's normal space, but Stiefel's form once
    # projected as if D = I there, leaving (1 - c^2) of the gradient: it moved W by 0.3 in 3
    # steps (both Gram solvers); the general path's engine ran at cW, where Stiefel's proju
    # removes only c^2 of the normal part: 0.06-0.11 in three steps. Nothing may move but the
    # retraction's round-off: per step the retraction of the orthonormal float64 point cW (with
    # a zero direction: the Gram path drops a tangent part at its rounding level, the general
    # path's msign has the point as a fixed point), O(10) products each exact to about n * eps,
    # so 3 steps * 10 products * n * eps bounds it (measured: at most 11 eps).
    gen = torch.Generator().manual_seed(4)
    W = torch.nn.Parameter(Stiefel().random(24, 8, generator=gen, dtype=torch.float64).data)
    start = W.detach().clone()
    opt = ManifoldMuon([W], manifold="stiefel", lr=0.05, weight_decay=0.4, **options)
    for _ in range(3):
        W.grad = 2 * W.detach()
        opt.step()
    assert (W.detach() - start).abs().max().item() <= 3 * 10 * 8 * torch.finfo(torch.float64).eps
    # control: a tangent gradient moves it
    W.grad = torch.randn(24, 8, generator=gen, dtype=torch.float64)
    W.grad -= W.detach() @ (0.5 * (W.detach().T @ W.grad + W.grad.T @ W.detach()))
    opt.step()
    assert (W.detach() - start).abs().max().item() > 1e-2


def test_dual_steps_improve_the_certificate_in_a_run():
    # without polish rounds, which move the direction toward the optimum themselves (ADMM)
    zero = _regression_run(DGram(), (96, 32), steps=10, dual_steps=0, polish_rounds=0)
    two = _regression_run(DGram(), (96, 32), steps=10, dual_steps=2, polish_rounds=0)
    assert sum(two) / len(two) > sum(zero) / len(zero) + 0.02


def test_manifold_parameter_carries_its_manifold_and_wide_matrices_work():
    gen = torch.Generator().manual_seed(2)
    wide = geoopt.ManifoldParameter(Stiefel().random(4, 12, generator=gen), manifold=Stiefel())
    tall = geoopt.ManifoldParameter(DGram().random(12, 4, generator=gen), manifold=DGram())
    opt = ManifoldMuon([wide, tall], lr=0.1)
    for _ in range(5):
        wide.grad = torch.randn(4, 12, generator=gen)
        tall.grad = torch.randn(12, 4, generator=gen)
        opt.step()
    assert opt.check_on_manifold() == []
    assert (wide.detach() @ wide.detach().T - torch.eye(4)).abs().max().item() < 1e-5


def test_euclidean_manifold_gives_a_unit_spectral_step():
    gen = torch.Generator().manual_seed(3)
    W0 = torch.randn(10, 6, generator=gen)
    G = torch.randn(10, 6, generator=gen)
    W = torch.nn.Parameter(W0.clone())
    W.grad = G.clone()
    ManifoldMuon([W], manifold=Euclidean(), lr=0.1, momentum=0.0, nesterov=False,
                 compute_dtype=None, msign_steps=None).step()
    step = (W0 - W.detach()) / 0.1
    # closed form: msign(G) rescaled to spectral norm 1 (Polar Express in fp32)
    assert torch.allclose(step, msign(G.double(), method="svd").float(), atol=1e-4)


@pytest.mark.parametrize("manifold", [Stiefel(), DGram(), Oblique()], ids=["stiefel", "dgram", "oblique"])
def test_gram_form_retraction_is_a_retraction_of_the_stated_order(manifold):
    gen = torch.Generator().manual_seed(4)
    W = manifold.random(20, 6, generator=gen, dtype=torch.float64)
    if isinstance(manifold, DGram):
        W = W * torch.logspace(-1, 1, 6, dtype=torch.float64)  # column norms over [0.1, 10]
    V = manifold.proju(W, torch.randn(20, 6, generator=gen, dtype=torch.float64))
    V = 0.05 * V / torch.linalg.matrix_norm(V, ord=2)
    form = manifold.gram_form
    R = gram_retraction(form, W, V, terms=6)
    assert manifold.check_point_on_manifold(R, atol=1e-12)
    assert torch.allclose(gram_retraction(form, W, torch.zeros_like(V)), W, atol=1e-14)
    # order 1: R(tV) = W + tV + O(t^2), so halving t quarters the gap; order 2 also makes the
    # gap's normal part the whole of it, i.e. the gap's tangent part is O(t^3).
    gaps = [gram_retraction(form, W, t * V, terms=6) - (W + t * V) for t in (1.0, 0.5)]
    assert 3.5 < (gaps[0].norm() / gaps[1].norm()).item() < 4.5
    if form.retraction_order >= 2:
        tangent = [manifold.proju(W, g).norm() for g in gaps]
        assert 7.0 < (tangent[0] / tangent[1]).item() < 9.0
    # negative control: the plain step W + V is off the manifold
    assert not manifold.check_point_on_manifold(W + V, atol=1e-6)


def _dgram_step_across_small_columns(small_norm):
    """A 128 x 128 DGram point whose first 4 column norms are ``small_norm`` (the rest 1) and
    a tangent step of spectral norm 0.02 concentrated on those columns, so that the
    normalized Gram N of Y = W + V is far from I when the small norms are of the step's order."""
    gen = torch.Generator().manual_seed(3)
    manifold = DGram()
    W = manifold.projx(torch.randn(128, 128, generator=gen, dtype=torch.float64))
    norms = torch.ones(128, dtype=torch.float64)
    norms[:4] = small_norm
    W = W / W.norm(dim=0) * norms
    X = 0.01 * torch.randn(128, 128, generator=gen, dtype=torch.float64)
    X[:, :4] = torch.nn.functional.normalize(torch.randn(128, 1, generator=gen, dtype=torch.float64), dim=0)
    V = manifold.proju(W, X)
    return manifold, W, 0.02 * V / torch.linalg.matrix_norm(V, ord=2)


def _column_polar_retraction(W, V):
    """The exact column-norm-keeping polar retraction msign(Y Delta^-1/2) Delta^1/2, fp64 SVD."""
    Y = W + V
    norms = Y.norm(dim=0)
    U, _, Vh = torch.linalg.svd(Y / norms, full_matrices=False)
    return U @ Vh * norms


def test_dgram_gram_retraction_stays_exact_when_a_column_norm_falls_to_the_step():
    # Columns of norm 0.005 under a step of 0.02: ||N - I||_2 = 1.3, beyond the radius 1 of
    # convergence of the binomial series of N^-1/2 (the ManifoldMuon NaN of a DGram run at
    # lr 0.02 had 1.76). The retraction
    # falls back to the eigendecomposition there. Tolerance in fp32, per column relative
    # to its norm: eigh is backward stable (a perturbation of N of n eps ||N|| at most), and
    # N -> N^-1/2 amplifies a relative perturbation by at most kappa(N)/2 (its Frechet
    # derivative), so the factor is within kappa n eps / 2; the product Y rho adds sqrt(n) eps.
    manifold, W, V = _dgram_step_across_small_columns(0.005)
    expected = _column_polar_retraction(W, V)
    Y = W + V
    N = torch.nn.functional.normalize(Y, dim=0).mT @ torch.nn.functional.normalize(Y, dim=0)
    assert torch.linalg.matrix_norm(N - torch.eye(128, dtype=N.dtype), ord=2) > 1.0  # the regime it is about
    kappa = torch.linalg.cond(N).item()
    for dtype in (torch.float32, torch.float64):
        eps = torch.finfo(dtype).eps
        R = gram_retraction(manifold.gram_form, W.to(dtype), V.to(dtype)).double()
        error = ((R - expected).norm(dim=0) / expected.norm(dim=0)).max().item()
        assert error <= (kappa * 128 / 2 + 128**0.5) * eps, (dtype, error)
    # negative control: the series alone, as the retraction was, is off by O(1) here (0.57)
    eye = torch.eye(128, dtype=torch.float64)
    series = Y @ (inv_sqrt_near_identity(N - eye, 6) * (Y.norm(dim=0) / Y.norm(dim=0).unsqueeze(-1)))
    assert ((series - expected).norm(dim=0) / expected.norm(dim=0)).max().item() > 0.1


def test_dgram_gram_retraction_beyond_the_series_needs_no_eigendecomposition(monkeypatch, no_host_reads):
    # The same far regime with the Polar Express dualizer's inverse square root (Cholesky,
    # Polar Express, a series refinement; CUDA's, where eigh would sync). R_0 = C^-1 msign(C)
    # is a polynomial function of N (Polar Express maps C = U S V' to U p(S) V'), and the
    # refinement a series in R_0' N R_0, so the map is N^-1/2 up to round-off: the bound of the
    # test above (Cholesky is backward stable like eigh) plus the rounding of Polar Express's
    # 3 x 8 products and the series', 30 sqrt(n) eps. Measured 2.2e-6 in fp32 (eigh: 1.1e-6).
    manifold, W, V = _dgram_step_across_small_columns(0.005)
    expected = _column_polar_retraction(W, V)
    Y = W + V
    N = torch.nn.functional.normalize(Y, dim=0).mT @ torch.nn.functional.normalize(Y, dim=0)
    kappa = torch.linalg.cond(N).item()
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: pytest.fail("eigh in the far branch"))
    for dtype in (torch.float32, torch.float64):
        eps = torch.finfo(dtype).eps
        with no_host_reads():
            R = gram_retraction(manifold.gram_form, W.to(dtype)[None], V.to(dtype)[None], far=polynomial_inverse_sqrt)
        R = R[0].double()
        error = ((R - expected).norm(dim=0) / expected.norm(dim=0)).max().item()
        assert error <= (kappa * 128 / 2 + 31 * 128**0.5) * eps, (dtype, error)
    # negative control: R_0 alone (no refinement) is off by Polar Express's 6-step error
    R0 = gram_msign(N.float()[None], 6, torch.float32).P[0].double()
    assert torch.linalg.matrix_norm(R0.mT @ N @ R0 - torch.eye(128, dtype=N.dtype), ord=2) > 1e-3


def test_dgram_gram_retraction_takes_the_series_within_its_radius():
    # At column norms of one the same step leaves ||N - I|| ~ 1e-4: the series is selected and
    # the map is bitwise the series (so runs that never leave the radius are unchanged).
    manifold, W, V = _dgram_step_across_small_columns(1.0)
    for dtype in (torch.float32, torch.float64):
        Y = (W + V).to(dtype)
        YtY = Y.mT @ Y
        norms = YtY.diagonal().sqrt()
        N = YtY / (norms.unsqueeze(-1) * norms)
        eye = torch.eye(128, dtype=dtype)
        assert torch.linalg.matrix_norm(N - eye) <= series_radius(6, dtype)
        series = inv_sqrt_near_identity(N - eye, 6) * (norms / norms.unsqueeze(-1))
        assert torch.equal(manifold.gram_form.retraction_factor(YtY), series)


def test_gram_form_retraction_is_the_manifold_retraction_on_stiefel_and_oblique():
    gen = torch.Generator().manual_seed(5)
    for manifold in (Stiefel(), Oblique()):
        W = manifold.random(20, 6, generator=gen, dtype=torch.float64)
        V = 0.05 * manifold.proju(W, torch.randn(20, 6, generator=gen, dtype=torch.float64))
        assert torch.allclose(gram_retraction(manifold.gram_form, W, V, terms=6), manifold.retr(W, V), atol=1e-12)


@pytest.mark.parametrize("solver", ["dual", "projected"])
def test_stiefel_steps_of_any_length_stay_on_the_manifold(solver, monkeypatch):
    # A step of length eta leaves ||Y^T Y - I|| ~ eta^2: the retraction's series diverges
    # beyond 1 (lr = 1 had put W^T W off by 0.3, then 117, then 2e35), so long steps take the
    # branch beyond the series' radius. After three fp32 steps W^T W = I to the 1e-5 of the
    # 5,000-step test (one retraction's round-off is ~ sqrt(n) eps ~ 1e-6).
    def run(lr):
        gen = torch.Generator().manual_seed(3)
        W = torch.nn.Parameter(Stiefel().random(64, 32, generator=gen).data)
        opt = ManifoldMuon([W], manifold="stiefel", lr=lr, solver=solver)
        for _ in range(3):
            W.grad = torch.randn(64, 32, generator=gen)
            opt.step()
        return (W.detach().T @ W.detach() - torch.eye(32)).abs().max().item()

    for lr in (0.5, 1.0, 2.0):
        assert run(lr) <= 1e-5, lr
    # control: the series alone at every length fails at lr = 1
    monkeypatch.setattr(gram, "far_inverse_sqrt", lambda *args: None)
    assert not run(1.0) <= 1e-2


@pytest.mark.parametrize("solver", ["dual", "projected"])
def test_stiefel_steps_within_the_series_radius_take_no_eigendecomposition(solver, monkeypatch):
    # series_covers bounds ||Y^T Y - I|| a priori from lr: at the default lr the retraction
    # never computes the branch beyond the radius (an n x n eigh per matrix); at lr = 0.5 it does
    def far(N):
        raise AssertionError("the far branch was computed")

    monkeypatch.setitem(gram.FAR_INVERSE_SQRTS, "eigh", far)
    gen = torch.Generator().manual_seed(4)
    for lr, computed in ((0.02, False), (0.1, False), (0.5, True)):
        W = torch.nn.Parameter(Stiefel().random(48, 16, generator=gen).data)
        opt = ManifoldMuon([W], manifold="stiefel", lr=lr, solver=solver, gram_dualizer="eigh")
        W.grad = torch.randn(48, 16, generator=gen)
        if computed:
            with pytest.raises(AssertionError, match="far branch"):
                opt.step()
        else:
            opt.step()


def test_stiefel_series_bound_holds_for_the_engines_directions():
    # The a-priori bound of series_covers at the largest lr it admits, against the measured
    # ||Y^T Y - I||_2 of both solvers' steps on GPT-like momenta (low rank, noise, a large
    # normal part), fp32: within the half radius the bound gives the step's terms.
    form = Stiefel().gram_form
    radius = series_radius(6, torch.float32)
    lr = max(k / 1000 for k in range(1, 1000)
             if form.series_covers(gram.DIRECTION_NORM * k / 1000, gram.DIRECTION_NORMAL * k / 1000, 1.0, 6,
                                   torch.float32))
    assert lr >= 0.1  # the default lr 0.02 and the tuned 0.04 are far inside
    # weight decay alone (no step): the bound's |c^2 - 1| is the measured deviation of cW
    W = Stiefel().random(12, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64).data
    for c in (0.9, 0.95, 0.99):
        measured = torch.linalg.matrix_norm((c * W).mT @ (c * W) - torch.eye(5, dtype=torch.float64), 2).item()
        assert form.series_covers(0.0, 0.0, c, 6, torch.float32) == (measured <= radius / 2), c
    gen = torch.Generator().manual_seed(6)
    for m, n in ((192, 48), (64, 64)):
        W = Stiefel().random(2, m, n, generator=gen).data
        G = (torch.randn(2, m, 4, generator=gen) @ torch.randn(2, 4, n, generator=gen)
             + 0.1 * torch.randn(2, m, n, generator=gen) + 3 * W @ torch.randn(2, n, n, generator=gen))
        for settings in (gram.GramSettings(dual_steps=2, polish_rounds=2), gram.GramSettings(solver="projected")):
            A = gram.gram_step(form, W, G, lr, None, settings).direction(W)
            Y = W - lr * A
            deviation = torch.linalg.matrix_norm(Y.mT @ Y - torch.eye(n), 2).max().item()
            assert deviation <= radius / 2, (m, n, settings.solver, deviation)


def test_state_is_small():
    W = torch.nn.Parameter(Stiefel().random(64, 16).data)
    opt = ManifoldMuon([W], manifold="stiefel")
    for _ in range(2):
        W.grad = torch.randn(64, 16)
        opt.step()
    state = opt.state[W]
    assert state["momentum_buffer"].shape == (64, 16)
    assert state["dual_correction"].shape == (16, 16)  # <= n x n


def test_the_gram_solver_defaults_by_device():
    """``eigh`` (exact) on the CPU, Polar Express elsewhere, because CUDA's ``eigh``
    synchronizes with the host; Newton steps with either (conjugate gradients where there
    are no eigenvectors); an explicit choice is kept."""
    from geomuon.optimizers.manifold_muon import gram_solver

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gram_solver(cpu, None, None) == ("newton", "eigh")
    assert gram_solver(cuda, None, None) == ("newton", "polar_express")
    assert gram_solver(cuda, "jacobi", None) == ("jacobi", "polar_express")
    assert gram_solver(cpu, "jacobi", None) == ("jacobi", "eigh")
    assert gram_solver(cpu, None, "polar_express") == ("newton", "polar_express")
    # smoothing reads Q's eigenvalues: a CUDA group that asks for it and leaves the dualizer
    # open gets "eigh" (Polar Express would make the step raise, as an explicit choice is refused)
    assert gram_solver(cuda, None, None, smoothing=0.03) == ("newton", "eigh")


@pytest.mark.parametrize("smoothing", [0.0, 0.03])
def test_a_step_asks_the_gram_solver_with_its_groups_smoothing(smoothing, monkeypatch):
    # what picks "eigh" for a smoothed group on CUDA is the step passing its smoothing on
    from geomuon.optimizers import manifold_muon

    asked = []

    def recording(device, update, dualizer, smoothing=0.0):
        asked.append(smoothing)
        return original(device, update, dualizer, smoothing)

    original = manifold_muon.gram_solver
    monkeypatch.setattr(manifold_muon, "gram_solver", recording)
    W = torch.nn.Parameter(Stiefel().random(24, 8, generator=torch.Generator().manual_seed(0)).data)
    W.grad = torch.randn(24, 8)
    ManifoldMuon([W], manifold="stiefel", lr=0.01, dual_smoothing=smoothing).step()
    assert asked and set(asked) == {smoothing}


def _three_random_steps(manifold, seed, **options):
    """The weights after three ManifoldMuon steps on random gradients from a random 48x16 point."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.nn.Parameter(manifold.random(48, 16, generator=gen).data)
    opt = ManifoldMuon([W], lr=0.05, manifold=manifold, **options)
    for _ in range(3):
        W.grad = torch.randn(48, 16, generator=gen)
        opt.step()
    return W.detach().clone()


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=["stiefel", "dgram"])
@pytest.mark.parametrize("dualizer", ["eigh", "polar_express"])
def test_the_default_polish_is_the_forms_with_either_dualizer(manifold, dualizer, monkeypatch):
    """The default ``polish_rounds`` and ``polish_method`` step bitwise as the form's named
    explicitly, under ``eigh`` (CPU) and Polar Express (CUDA's dualizer, whose polish calls no
    ``eigh``: patched to fail); controls: the default is neither the unpolished step nor the
    other method's."""
    from geomuon.optimizers.gram import POLISH_METHODS
    from geomuon.optimizers.manifold_muon import default_polish_method, default_polish_rounds

    run = partial(_three_random_steps, manifold, 4, gram_dualizer=dualizer)
    rounds, method = manifold.gram_form.polish_rounds, manifold.gram_form.polish_method
    assert rounds >= 1 and default_polish_rounds(manifold) == rounds and default_polish_method(manifold) == method
    default = run()
    assert torch.equal(default, run(polish_rounds=rounds, polish_method=method))
    assert not torch.equal(default, run(polish_rounds=0))
    other, = set(POLISH_METHODS) - {method}
    assert not torch.equal(default, run(polish_method=other))
    if dualizer == "polar_express":
        monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: pytest.fail("eigh under polar_express"))
        assert torch.equal(run(), default)


@pytest.mark.parametrize("manifold,options,expected", [
    (DGram(), {}, [2, 1, 1]),  # the form's floor on the cold first step, then its default
    (DGram(), {"cold_dual_steps": 4}, [4, 1, 1]),
    (DGram(), {"dual_steps": 3}, [3, 3, 3]),  # a floor below the dual steps changes nothing
    (DGram(), {"warm_start": False}, [1, 1, 1]),  # no warm starts: every step takes dual_steps
    (Stiefel(), {}, [2, 2, 2]),  # a form that declares no floor
], ids=["dgram", "dgram-explicit", "dgram-more-steps", "dgram-no-warm-start", "stiefel"])
def test_a_step_without_a_warm_start_takes_the_cold_dual_steps(manifold, options, expected, monkeypatch):
    from geomuon.optimizers import manifold_muon

    taken = []

    def settings(**fields):
        taken.append(fields["dual_steps"])
        return real(**fields)

    real = manifold_muon.GramSettings
    monkeypatch.setattr(manifold_muon, "GramSettings", settings)
    gen = torch.Generator().manual_seed(6)
    W = torch.nn.Parameter(manifold.random(48, 16, generator=gen).data)
    opt = ManifoldMuon([W], lr=0.05, manifold=manifold, **options)
    for _ in range(3):
        W.grad = torch.randn(48, 16, generator=gen)
        opt.step()
    assert taken == expected


def test_dgrams_cold_first_step_is_the_two_step_solve_and_certifies_higher():
    """The default first step on DGram is bitwise the 2-dual-step solve (its form's
    ``cold_dual_steps``) and certifies more than 1 step would; control: forcing 1 cold step
    moves the weights differently."""
    gen = torch.Generator().manual_seed(7)
    start = DGram().projx(torch.randn(96, 32, generator=gen) * torch.logspace(-1, 1, 32))
    grad = torch.randn(96, 32, generator=gen) * torch.logspace(0, -2, 32)

    def first_step(**options):
        W = torch.nn.Parameter(start.clone())
        opt = ManifoldMuon([W], lr=0.05, manifold="dgram", certify_every=1, **options)
        W.grad = grad.clone()
        opt.step()
        return W.detach(), next(iter(opt.certificates.values()))

    default, certified = first_step()
    two, _ = first_step(dual_steps=2, warm_start=False)
    one, certified_one = first_step(cold_dual_steps=1)
    assert torch.equal(default, two)
    assert not torch.equal(default, one)
    assert certified > certified_one


def test_a_negative_cold_dual_step_count_is_refused_by_name():
    W = torch.nn.Parameter(DGram().random(8, 4).data)
    with pytest.raises(ValueError, match="cold_dual_steps must be a whole number >= 0"):
        ManifoldMuon([W], manifold="dgram", cold_dual_steps=-1)


def test_cold_dual_steps_without_warm_starts_is_refused_at_construction_and_after_an_edit():
    # without warm starts every step takes dual_steps: cold_dual_steps would be ignored
    W = torch.nn.Parameter(DGram().random(8, 4).data)
    with pytest.raises(ValueError, match="cold_dual_steps=3 with warm_start=False would be ignored"):
        ManifoldMuon([W], manifold="dgram", cold_dual_steps=3, warm_start=False)
    opt = ManifoldMuon([W], manifold="dgram", cold_dual_steps=3)  # control: it applies with warm starts
    opt.param_groups[0]["warm_start"] = False
    W.grad = torch.randn_like(W)
    before = W.detach().clone()
    with pytest.raises(ValueError, match="cold_dual_steps=3 with warm_start=False"):
        opt.step()
    assert torch.equal(W.detach(), before)


@pytest.mark.parametrize("manifold,update,alpha", [
    (DGram(), None, 1.5),  # the form's over-relaxation of its Newton step
    (DGram(), "jacobi", 1.0),  # declared for the Newton update only
    (Stiefel(), None, 1.0),  # a form that declares none
], ids=["dgram", "dgram-jacobi", "stiefel"])
def test_the_default_dual_step_size_is_the_forms_for_its_newton_update(manifold, update, alpha):
    """The default ``dual_alpha`` steps bitwise as the form's value named explicitly; control:
    where the default is not 1, naming 1 moves the weights differently."""
    from geomuon.optimizers.manifold_muon import default_dual_alpha

    run = partial(_three_random_steps, manifold, 8, dual_update=update)
    assert default_dual_alpha(manifold, update or "newton") == alpha
    default = run()
    assert torch.equal(default, run(dual_alpha=alpha))
    assert torch.equal(default, run(dual_alpha=1.0)) == (alpha == 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_dgrams_over_relaxed_newton_steps_lower_the_dual_faster(seed):
    r"""On a square DGram point with a momentum whose singular values spread over four decades
    (a transformer's, where DGram's dual steps are slow), the form's ``newton_alpha`` leaves a
    lower dual value $\|Z\|_*$ (an upper bound on the optimum, so closer to it) than the
    full step after 1, 2 and 4 steps from a cold start. Float64, dual values near 5: the
    measured gaps are 0.018-0.069 (0.3-1.3 %), the rounding of a nuclear norm about
    $10^{-13}$, so the asserted 0.001 is an effect size, not a tolerance."""
    from geomuon.optimizers.gram import GramSettings, gram_step

    form = DGram().gram_form
    gen = torch.Generator().manual_seed(seed)
    n = 48
    W = DGram().projx(torch.randn(n, n, generator=gen, dtype=torch.float64) * torch.logspace(-0.2, 0.2, n))
    U, V = (torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0] for _ in range(2))
    G = U @ torch.diag(torch.logspace(0, -4, n, dtype=torch.float64)) @ V.T

    def dual_value(steps, alpha):
        settings = GramSettings(dual_steps=steps, alpha=alpha, compute_dtype=None)
        _, _, Z0, S = gram_step(form, W[None], G[None], 0.01, None, settings).direction_factors
        return torch.linalg.matrix_norm(Z0 + W @ S, "nuc").item()

    assert form.newton_alpha > 1
    for steps in (1, 2, 4):
        assert dual_value(steps, form.newton_alpha) < dual_value(steps, 1.0) - 1e-3


def test_a_dual_step_size_outside_its_stable_range_is_refused_by_name():
    # above 2 the relaxed dual step reflects past its fixed point: dual_alpha=4 had grown Oblique's
    # warm start 13x a step, to NaN weights or an eigh error naming no option; 2.2 Stiefel's to 2e7
    W = torch.nn.Parameter(DGram().random(8, 4).data)
    for alpha in (0.0, -1.0, float("nan"), 2.2, 4.0):
        with pytest.raises(ValueError, match=r"dual_alpha must be a number in \(0, 2\]"):
            ManifoldMuon([W], manifold="dgram", dual_alpha=alpha)
    # control: the edge of the range, warm started over 40 steps, keeps its multiplier bounded (at
    # 2.2 Stiefel's had reached 2e7 by then; at 2.0 it stays below 1 on Stiefel, DGram, Oblique)
    # and its weights on the manifold
    for manifold in ("stiefel", "dgram", "oblique"):
        torch.manual_seed(0)
        W = torch.nn.Parameter(manifold_muon.resolve_manifold(manifold, "test").projx(torch.randn(12, 6)))
        opt = ManifoldMuon([W], manifold=manifold, dual_alpha=2.0)
        for _ in range(40):
            W.grad = torch.randn(12, 6)
            opt.step()
        assert opt.state[W]["dual_correction"].abs().max() < 1, manifold
        assert opt.check_on_manifold(raise_error=False) == [], manifold


def test_the_default_gram_solver_on_the_cpu_is_newton_with_eigh():
    """Leaving the solver to its default steps exactly as naming ``newton``/``eigh`` on the
    CPU (bitwise); control: Polar Express with Jacobi steps moves the weights differently."""
    def run(**options):
        gen = torch.Generator().manual_seed(3)
        W = torch.nn.Parameter(Stiefel().random(48, 16, generator=gen).data)
        opt = ManifoldMuon([W], lr=0.05, manifold=Stiefel(), **options)
        for _ in range(3):
            W.grad = torch.randn(48, 16, generator=gen)
            opt.step()
        return W.detach().clone()

    default = run()
    assert torch.equal(default, run(dual_update="newton", gram_dualizer="eigh"))
    assert not torch.equal(default, run(dual_update="jacobi", gram_dualizer="polar_express"))


def _certified_run(params, grads, opt):
    """Step ``opt`` through ``grads``; the certificates after every step."""
    seen = []
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
        seen.append(opt.certificates)
    return seen


@pytest.mark.parametrize("keep_count", [True, False], ids=["resumed", "control-count-dropped"])
def test_a_resumed_run_is_bitwise_the_uninterrupted_one_certificates_included(tmp_path, keep_count):
    # certify_every counts the group's steps; the count travels in the param groups, so a run
    # saved after 3 steps and resumed certifies at steps 4 and 6 exactly as one that never stopped
    gen = torch.Generator().manual_seed(23)
    start = [Stiefel().random(*s, generator=gen).data for s in [(12, 4), (12, 4), (4, 10)]]
    grads = [[torch.randn(w.shape, generator=gen) for w in start] for _ in range(6)]

    def fresh():
        params = [torch.nn.Parameter(w.clone()) for w in start]
        return params, ManifoldMuon([{"params": params, "manifold": "stiefel"}], lr=0.05, certify_every=2)

    params, opt = fresh()
    whole = _certified_run(params, grads, opt)
    first, first_opt = fresh()
    _certified_run(first, grads[:3], first_opt)
    torch.save({"params": [p.detach() for p in first], "opt": first_opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    if not keep_count:
        for group in saved["opt"]["param_groups"]:
            del group["step_count"]  # what a checkpoint without the count would restore
    resumed, resumed_opt = fresh()
    with torch.no_grad():
        for p, w in zip(resumed, saved["params"]):
            p.copy_(w)
    resumed_opt.load_state_dict(saved["opt"])
    rest = _certified_run(resumed, grads[3:], resumed_opt)
    # the update depends on per-matrix state only: bitwise equal either way
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, resumed))
    assert all(whole[3 + k] for k in (0, 2)) and whole[3 + 1] == whole[3 + 0]  # steps 4 and 6 certify
    assert (rest == whole[3:]) == keep_count


def test_a_refused_step_is_not_counted():
    # certify_every counts the group's steps: a step refused before any weight moved (a skip
    # reported under nonfinite="raise", a closure that raises) had been counted, moving every
    # later certificate off the steps the weights took
    gen = torch.Generator().manual_seed(5)
    param = torch.nn.Parameter(Stiefel().random(12, 4, generator=gen).data)
    opt = ManifoldMuon([{"params": [param], "manifold": "stiefel"}], lr=0.05, nonfinite="raise")
    param.grad = torch.full_like(param, float("nan"))
    opt.step()  # skipped on the device; reported at the next step
    param.grad = torch.randn(param.shape, generator=gen)
    before = param.detach().clone()
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    assert torch.equal(param.detach(), before)
    with pytest.raises(ZeroDivisionError):
        opt.step(closure=lambda: 1 / 0)
    assert opt.param_groups[0]["step_count"] == 1
    opt.step()  # the step that runs counts
    assert opt.param_groups[0]["step_count"] == 2 and not torch.equal(param.detach(), before)


def test_polish_rounds_move_the_step_and_keep_it_on_the_manifold():
    # polish_rounds reaches the Gram path (the point differs from the unpolished one) and the
    # polished step is still retracted onto the manifold; a negative count is refused by name.
    gen = torch.Generator().manual_seed(8)
    start = DGram().random(48, 16, generator=gen) * torch.logspace(-0.5, 0.5, 16)
    grad = torch.randn(48, 16, generator=gen)
    points = {}
    for rounds in (0, 2):
        W = torch.nn.Parameter(start.clone())
        opt = ManifoldMuon([W], manifold="dgram", lr=0.05, polish_rounds=rounds)
        W.grad = grad.clone()
        opt.step()
        assert DGram().check_point_on_manifold(W.detach(), atol=1e-5)
        points[rounds] = W.detach()
    assert not torch.allclose(points[0], points[2], atol=1e-5)
    with pytest.raises(ValueError, match="polish_rounds must be a whole number >= 0"):
        ManifoldMuon([torch.nn.Parameter(start.clone())], manifold="dgram", polish_rounds=-1)
    with pytest.raises(ValueError, match=r"polish_method must be one of \('admm', 'alternating'\)"):
        ManifoldMuon([torch.nn.Parameter(start.clone())], manifold="dgram", polish_method="dykstra")
    # the projected solver's rounds always alternate: a method asked of it would be ignored
    with pytest.raises(ValueError, match="solver='projected' takes no dual iterations, so polish_method='admm'"):
        ManifoldMuon([torch.nn.Parameter(start.clone())], manifold="dgram", solver="projected", polish_method="admm")


def _rank_spread_certificate(dtype: torch.dtype, dualizer: str) -> float:
    """ManifoldMuon's certificate of one 4-dual-step DGram step (64 x 64) on a momentum whose
    singular values fall over four decades and then by 1e-6 past the first quarter (the
    rank-spread of a transformer's momentum)."""
    from geomuon.theory.groups import haar_orthogonal

    gen = torch.Generator().manual_seed(0)
    n = 64
    W = DGram().projx(torch.randn(n, n, generator=gen, dtype=torch.float64)) * torch.logspace(-0.1, 0.1, n,
                                                                                              dtype=torch.float64)
    spectrum = torch.logspace(0, -4, n, dtype=torch.float64)
    spectrum[n // 4:] *= 1e-6
    G = (haar_orthogonal(n, gen) * spectrum) @ haar_orthogonal(n, gen).T
    p = torch.nn.Parameter(W.to(dtype))
    opt = ManifoldMuon([p], manifold="dgram", lr=0.02, dual_steps=4, certify_every=1, gram_dualizer=dualizer)
    p.grad = G.to(dtype)
    opt.step()
    return next(iter(opt.certificates.values()))


@pytest.mark.parametrize("dualizer", ["eigh", "polar_express"])
def test_float64_steps_keep_float32s_dualizer_shift(dualizer, monkeypatch):
    # The dualizer's shift regularizes the dual; with float64's own unit round-off DGram's
    # Newton steps stall on a rank-spread momentum (certified 0.809 under eigh, 0.876 under
    # Polar Express, where float32 reaches 0.893). With the float32 floor the float64 step is
    # the float32 step up to float32's rounding of the same products (measured 4e-5 and
    # 1e-5 apart; 0.002 is 50x that and under a fifth of the smaller control gap, 0.017).
    from geomuon.optimizers import manifold_muon

    in_float32 = _rank_spread_certificate(torch.float32, dualizer)
    assert abs(_rank_spread_certificate(torch.float64, dualizer) - in_float32) <= 0.002
    monkeypatch.setattr(manifold_muon, "DUALIZER_SHIFT_EPS", None)  # control: float64's own shift
    assert _rank_spread_certificate(torch.float64, dualizer) < in_float32 - 0.01


def test_a_reference_solve_tightens_the_certificate_and_changes_nothing_else():
    # certify_reference runs a longer dual solve of the same problem at certified steps: the
    # step is bitwise the same, and the certificate divides by the smaller dual value, so it
    # rises, on a rank-spread momentum where one dual step leaves a dual gap, yet stays a
    # certificate: at most 1 (primal <= optimum <= any dual value) up to the float32 SVDs'
    # rounding of the two norms, 8 eps32 relative.
    from geomuon.theory.groups import haar_orthogonal

    gen = torch.Generator().manual_seed(1)
    n = 48
    W = DGram().projx(torch.randn(n, n, generator=gen))
    spectrum = torch.logspace(0, -4, n)
    spectrum[n // 4:] *= 1e-6
    G = (haar_orthogonal(n, gen).float() * spectrum) @ haar_orthogonal(n, gen).float().T
    results = []
    for reference in (0, 32):
        p = torch.nn.Parameter(W.clone())
        opt = ManifoldMuon([p], manifold="dgram", lr=0.02, certify_every=1, certify_reference=reference)
        p.grad = G.clone()
        opt.step()
        results.append((p.detach(), next(iter(opt.certificates.values()))))
    (own_point, own), (point, tightened) = results
    assert torch.equal(point, own_point)
    assert own + 0.01 < tightened <= 1 + 8 * torch.finfo(torch.float32).eps
    with pytest.raises(ValueError, match="certify_reference"):
        ManifoldMuon([torch.nn.Parameter(W.clone())], manifold="dgram", certify_reference=-1)


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=["stiefel", "dgram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_thread_steps_run_in_one_thread_workers_and_equal_the_one_thread_steps(manifold, dtype, monkeypatch,
                                                                                   torch_threads):
    """At 2 threads ManifoldMuon's batches (two shapes, three matrices each: one matrix per
    CPU stack, six parts) run in the workers, and three steps land bit for bit where they land on one
    thread. Controls: an optimizer with ``parallel_batches`` off uses no workers, and the
    two-thread run really stepped (the points moved)."""
    import geomuon.optimizers.base as base

    workers = []
    real = base.in_one_thread_workers
    monkeypatch.setattr(base, "in_one_thread_workers", lambda calls: workers.append(len(calls)) or real(calls))
    gen = torch.Generator().manual_seed(5)
    shapes = [(48, 16)] * 3 + [(16, 40)] * 3
    start = [manifold.projx(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(3)]

    def run(threads, optimizer=ManifoldMuon, **kw):
        with torch_threads(threads):
            ps = [geoopt.ManifoldParameter(w.clone(), manifold=manifold) for w in start]
            opt = optimizer(ps, lr=0.05, **kw)
            for step in grads:
                for p, g in zip(ps, step):
                    p.grad = g.clone()
                opt.step()
            return [p.detach() for p in ps]

    one = run(1)
    assert workers == []
    two = run(2)
    assert workers == [6, 6, 6]
    assert all(torch.equal(a.view(torch.int64 if dtype == torch.float64 else torch.int32),
                           b.view(torch.int64 if dtype == torch.float64 else torch.int32)) for a, b in zip(one, two))
    assert not any(torch.equal(a, w) for a, w in zip(two, start))
    from geomuon.optimizers import Muon

    class SequentialMuon(Muon):
        parallel_batches = False

    workers.clear()
    run(2, SequentialMuon)
    assert workers == []


@pytest.mark.parametrize("options, message", [
    (dict(dual_steps=2.7), "dual_steps must be a whole number >= 0"),  # had been truncated to 2
    (dict(polish_rounds=1.5), "polish_rounds must be a whole number >= 0"),
    (dict(cold_dual_steps=True), "cold_dual_steps must be a whole number >= 0"),
    (dict(dual_steps=float("nan")), "dual_steps must be a whole number >= 0"),  # had been a bare int() error
    (dict(warm_start="no"), "warm_start must be True or False"),  # "no" had been true
    (dict(dual_alpha=float("inf")), r"dual_alpha must be a number in \(0, 2\]"),  # had written NaN weights
    (dict(lr=0.1, weight_decay=10.0), r"lr \* weight_decay must be < 1"),  # a decay factor <= 0: NaN weights
])
def test_options_out_of_range_are_refused_naming_the_option(options, message):
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(8, 4)))
    with pytest.raises(ValueError, match=message):
        ManifoldMuon([p], manifold="stiefel", **options)
    ManifoldMuon([p], manifold="stiefel", dual_steps=3, polish_rounds=1, warm_start=False, dual_alpha=0.5)  # control


@pytest.mark.parametrize("manifold, normal, diagonal", [(Stiefel(), 10.0, True), (DGram(), 100.0, False)])
def test_bf16_points_with_a_mostly_normal_momentum_take_a_step_of_about_lr(manifold, normal, diagonal):
    # bf16 points are off the manifold by bf16 round-off (3e-3); D taken from the column norms
    # was inconsistent with them, and with a momentum mostly normal to the manifold (as near a
    # constrained optimum) one step had moved Stiefel weights by 5e12 (DGram: 270 lr), with no
    # error. The norm of a step is at most ~sqrt(2) lr (a tangent direction of the unit ball).
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(manifold.random(16, 8, dtype=torch.float64).data.to(torch.bfloat16))
    opt = ManifoldMuon([p], manifold=manifold, lr=0.02)
    for _ in range(3):
        W = p.detach().double()
        S = torch.randn(8, 8, dtype=torch.float64, generator=gen)
        S = S + S.mT if diagonal else (S + S.mT).fill_diagonal_(0.0)  # W S, S symmetric: normal to M
        p.grad = (torch.randn(16, 8, dtype=torch.float64, generator=gen) + normal * W @ S).to(torch.bfloat16)
        opt.step()
        assert torch.linalg.matrix_norm(p.detach().double() - W, 2) <= 2 * 0.02
    assert opt.check_on_manifold(raise_error=False) == []


def test_a_regulator_that_takes_points_off_the_manifold_is_refused_when_built():
    # soft_cap on Stiefel had left |W^T W - I| = 0.012 after three steps, silently (and a resumed
    # run then refused the weights); spectral_normalize on Oblique likewise
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 8)))
    # (the soft cap takes its eta, a bound on one update's RMS->RMS norm, from the user here:
    # ManifoldMuon states none, so the default eta is refused)
    soft_cap = {"name": "soft_cap", "eta": 0.05}
    for manifold, regulate in (("stiefel", soft_cap), ("stiefel", "weight_decay"), ("oblique", "spectral_normalize")):
        with pytest.raises(ValueError, match=r"regulate=.* takes points of (Stiefel|Oblique) off it"):
            ManifoldMuon([p], manifold=manifold, regulate=regulate)
    with pytest.raises(ValueError, match="default eta is the optimizer's bound .* give eta"):
        ManifoldMuon([p], manifold="dgram", regulate="soft_cap")
    # controls: a cap DGram's points keep (a spectral function of Q diag(d) is Q diag(f(d))), and
    # one that does not bind at this shape
    for manifold, regulate in (("dgram", "column_cap"), ("dgram", soft_cap), ("stiefel", "hard_cap")):
        p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 8)))  # (a Stiefel point is one of DGram's too)
        opt = ManifoldMuon([p], manifold=manifold, regulate=regulate)
        p.grad = torch.randn(16, 8)
        opt.step()
        assert opt.check_on_manifold(raise_error=False) == [], (manifold, regulate)


@pytest.mark.parametrize("regulate", ["weight_decay", "spectral_weight_decay"])
def test_a_regulator_coupled_to_the_rate_is_refused_at_a_warm_up_rate_of_zero(regulate):
    # at lr=0 (a warm-up's first rate) a weight decay is the identity, and a probe at the group's
    # rate alone had passed it: the warm-up then left Stiefel silently (|W^T W - I| = 0.078 after
    # five steps)
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 8)))
    with pytest.raises(ValueError, match=r"regulate=.* takes points of Stiefel off it"):
        ManifoldMuon([p], manifold="stiefel", lr=0.0, regulate=regulate)
    # control: DGram keeps every rescaling of its points, so its weight decay passes and stays on
    # DGram through the warm-up
    opt = ManifoldMuon([p], manifold="dgram", lr=0.0, regulate="weight_decay")
    for step in range(5):
        opt.param_groups[0]["lr"] = 0.02 * step
        p.grad = torch.randn(16, 8)
        opt.step()
    assert opt.check_on_manifold(raise_error=False) == []


@pytest.mark.parametrize("edit, message", [
    (dict(polish_method="admn"), "group 1: polish_method must be one of"),  # had raised from GramSettings mid-step
    (dict(solver="projected", dual_steps=3), "group 1: solver='projected' takes no dual iterations"),  # ignored
    (dict(polish_rounds=2.5), "group 1: polish_rounds must be a whole number"),  # had been truncated to 2
    (dict(retraction="fuse"), "group 1: retraction must be one of"),  # had taken the general path
    (dict(weight_decay=100.0), r"group 1: lr \* weight_decay must be < 1"),  # had negated the point
])
def test_an_option_edited_between_steps_is_refused_before_any_group_steps(edit, message):
    # param-group edits (a sweep, a schedule) had skipped every check: a typo raised inside the
    # step after group 0 had moved, other edits were ignored or stepped the weights wrongly
    torch.manual_seed(0)
    first, second = (torch.nn.Parameter(Stiefel().projx(torch.randn(16, 8))) for _ in range(2))
    opt = ManifoldMuon([{"params": [first]}, {"params": [second]}], manifold="stiefel")
    for p in (first, second):
        p.grad = torch.randn(16, 8)
    opt.step()
    before = [first.detach().clone(), second.detach().clone()]
    opt.param_groups[1].update(edit)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert torch.equal(first, before[0]) and torch.equal(second, before[1])  # nothing was stepped


def test_a_scheduled_lr_past_the_decay_factor_is_refused_at_the_step_by_value(monkeypatch):
    # a schedule rewrites lr every step: no group check runs for it (that would read a tensor lr),
    # its float value is checked against weight_decay at every step, before any group steps
    torch.manual_seed(0)
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 8)))
    opt = ManifoldMuon([p], manifold="stiefel", weight_decay=0.02)
    p.grad = torch.randn(16, 8)
    opt.step()
    checks = []
    monkeypatch.setattr(opt, "_validate_group", lambda *args: checks.append(args))
    opt.param_groups[0]["lr"] = 49.0  # lr * weight_decay = 0.98: a step (control)
    p.grad = torch.randn(16, 8)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = 60.0
    with pytest.raises(ValueError, match=r"group 0: lr \* weight_decay must be < 1 .*; nothing was stepped"):
        opt.step()
    assert torch.equal(p, before) and checks == []


def test_an_unedited_group_is_not_checked_again_in_a_step(monkeypatch):
    # the check of an edit compares recorded options; a step of unedited groups (and the first
    # step after a state_dict round trip) runs no group check
    torch.manual_seed(0)
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 8)))
    opt = ManifoldMuon([p], manifold="dgram", lr=torch.tensor(0.02), polish_method="alternating")
    opt.load_state_dict(opt.state_dict())
    checks = []
    monkeypatch.setattr(opt, "_validate_group", lambda *args: checks.append(args))
    for _ in range(2):
        p.grad = torch.randn(16, 8)
        opt.step()
    assert checks == []
    opt.param_groups[0]["polish_rounds"] = 3
    p.grad = torch.randn(16, 8)
    opt.step()
    assert len(checks) == 1


@pytest.mark.parametrize("on_stiefel", [True, False], ids=["projected-control", "off"])
def test_a_weight_appended_to_a_group_between_steps_is_checked_on_its_manifold(on_stiefel):
    # a list edit is no option edit (the edited-group check compares options): a weight off
    # Stiefel appended to group["params"] after the first step had been stepped unchecked (silently
    # retracted: Frobenius norm 6.0 -> sqrt(8) in that step). Control: the same weight projected
    # onto Stiefel steps.
    gen = torch.Generator().manual_seed(2)
    a = torch.nn.Parameter(Stiefel().random(16, 8, generator=gen, dtype=torch.float64).data)
    opt = ManifoldMuon([dict(params=[a], param_names=["a"])], manifold="stiefel", lr=0.05)
    a.grad = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    opt.step()
    raw = 0.5 * torch.randn(16, 8, generator=gen, dtype=torch.float64)
    late = torch.nn.Parameter(Stiefel().projx(raw) if on_stiefel else raw)
    opt.param_groups[0]["params"].append(late)
    opt.param_groups[0]["param_names"].append("late")
    late.grad, a.grad = (torch.randn(16, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    before = [a.detach().clone(), late.detach().clone()]
    if on_stiefel:
        opt.step()
        assert not torch.equal(late.detach(), before[1])
    else:
        with pytest.raises(OffManifoldError, match="'late'"):
            opt.step()
        assert torch.equal(late.detach(), before[1])  # not stepped
        assert torch.count_nonzero(opt.state[late]["momentum_buffer"]) == 0  # nor its momentum
    assert not torch.equal(a.detach(), before[0])  # the group's other weight steps either way


@pytest.mark.parametrize("options, message", [
    (dict(lr=torch.tensor(2.0), weight_decay=1.0), r"lr \* weight_decay must be < 1"),  # a float lr was refused
    (dict(dual_alpha=torch.tensor(1.5)), "dual_alpha must be a Python number"),  # read back every step
    (dict(polish_rounds=torch.tensor(2)), "polish_rounds must be a Python number"),
    (dict(polish_method="admm", polish_rounds=0), "polish_method='admm' with polish_rounds=0 would be ignored"),
])
def test_options_a_step_cannot_honour_are_refused(options, message):
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(8, 4)))
    with pytest.raises(ValueError, match=message):
        ManifoldMuon([p], manifold="dgram", **options)
    ManifoldMuon([p], manifold="dgram", lr=torch.tensor(0.02), weight_decay=1.0, polish_method="admm",
                 polish_rounds=1, dual_alpha=1.5)  # control


@pytest.mark.parametrize("norm", ["row", "column"])
@pytest.mark.parametrize("options", [dict(msign_steps=3), dict(msign_method="svd")], ids=["steps", "method"])
def test_a_spectral_kernel_option_is_refused_with_a_norm_that_runs_no_polar_factor(norm, options):
    # the row and column dualizers normalize rows or columns: msign_steps=3 or msign_method="svd"
    # had been accepted and the step was bitwise the default's
    def point(**kwargs):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(Stiefel().random(16, 8, generator=gen, dtype=torch.float64).data)
        opt = ManifoldMuon([p], manifold="stiefel", norm=norm, **kwargs)
        p.grad = torch.randn(16, 8, generator=gen, dtype=torch.float64)
        opt.step()
        return p.detach()

    name = next(iter(options))
    with pytest.raises(ValueError, match=rf"group 0: msign_method=.*msign_steps=.* would be ignored: norm='{norm}'"):
        point(**options)
    point()  # control: the defaults are accepted
    # control: the hybrid norm runs the kernel, so the option is taken and changes the step
    gen = torch.Generator().manual_seed(0)
    W = Stiefel().random(16, 8, generator=gen, dtype=torch.float64).data
    G = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    steps = []
    for kwargs in ({}, options):
        p = torch.nn.Parameter(W.clone())
        opt = ManifoldMuon([p], manifold="stiefel", norm="hybrid", **kwargs)
        p.grad = G.clone()
        opt.step()
        steps.append(p.detach())
    assert not torch.equal(*steps), name
    # control: a row or column group that inherits the kernel from a constructor whose own norm runs
    # it set nothing itself (it could only have restated the module's default to pass)
    q = torch.nn.Parameter(W.clone())
    ManifoldMuon([{"params": [torch.nn.Parameter(W.clone())]}, {"params": [q], "norm": norm}],
                 manifold="stiefel", **options)
    # while a constructor whose own norm runs no polar factor is refused, its groups inheriting the kernel
    with pytest.raises(ValueError, match="would be ignored"):
        ManifoldMuon([q], manifold="stiefel", norm=norm, **options)


def test_without_warm_starts_no_carried_dual_step_is_taken(monkeypatch):
    # the carried step only feeds the next warm start: with warm_start=False it had been computed
    # (one more Newton solve per matrix and step) and thrown away
    updates = []
    newton_update = gram.newton_update
    monkeypatch.setattr(gram, "newton_update", lambda *args: updates.append(1) or newton_update(*args))
    gen = torch.Generator().manual_seed(0)
    start = Stiefel().projx(torch.randn(16, 8, dtype=torch.float64, generator=gen))
    momentum = torch.randn(16, 8, dtype=torch.float64, generator=gen)
    points = {}
    for warm_start in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = ManifoldMuon([p], manifold="stiefel", dual_steps=1, warm_start=warm_start, polish_rounds=0)
        p.grad = momentum.clone()
        updates.clear()
        opt.step()
        points[warm_start] = p.detach()
        assert len(updates) == (2 if warm_start else 1), warm_start  # dual_steps, plus the carried one
    # control: leaving out the carried step keeps the step's own dual steps (the first steps agree)
    assert torch.equal(points[False], points[True])


@pytest.mark.parametrize("manifold,norm,shape,multiplier", [
    ("stiefel", "spectral", (24, 8), (8, 8)), ("stiefel", "spectral", (8, 24), (8, 8)),
    ("oblique", "spectral", (24, 8), (8,)), ("dgram", "spectral", (2, 24, 8), (2, 8, 8)),
    # the general path (steepest_direction: no Gram form for these norms) takes its warm starts unchecked too
    ("stiefel", "row", (24, 8), (8, 8)), ("dgram", "column", (2, 24, 8), (2, 8, 8)),
], ids=["stiefel-tall", "stiefel-wide", "oblique", "dgram-batch", "stiefel-row-general", "dgram-column-batch-general"])
def test_a_loaded_warm_start_of_another_shape_is_refused_by_name_and_changes_nothing(manifold, norm, shape, multiplier):
    # a step takes its warm starts unchecked: a loaded one of another shape had broadcast over the
    # batch (a stacked copy) or failed inside a product of a later step (another size)
    gen = torch.Generator().manual_seed(2)
    start = MatrixManifold.resolve(manifold, "test").random(*shape, generator=gen, dtype=torch.float64).data
    p = torch.nn.Parameter(start.clone())
    opt = ManifoldMuon([p], manifold=manifold, norm=norm)
    for _ in range(2):
        p.grad = torch.randn(shape, generator=gen, dtype=torch.float64)
        opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["dual_correction"].shape == multiplier  # the shape a step keeps
    for bad in ((1, *multiplier), (*multiplier[:-1], multiplier[-1] - 1)):
        tampered = copy.deepcopy(saved)
        tampered["state"][0]["dual_correction"] = torch.zeros(bad, dtype=torch.float64)
        fresh = ManifoldMuon([torch.nn.Parameter(start.clone())], manifold=manifold, norm=norm)
        with pytest.raises(ValueError, match=rf"ManifoldMuon.load_state_dict: state 'dual_correction' of parameter #0 "
                                             rf"of param group 0 {re.escape(str(bad))} must have the multiplier's "
                                             rf"shape {re.escape(str(multiplier))}; the state was saved for another"):
            fresh.load_state_dict(tampered)
        assert len(fresh.state) == 0  # nothing loaded
    # control: the state as saved loads, and the resumed step equals the uninterrupted one
    q = torch.nn.Parameter(p.detach().clone())
    resumed = ManifoldMuon([q], manifold=manifold, norm=norm)
    resumed.load_state_dict(copy.deepcopy(saved))  # (a state dict shares opt's tensors, which its step updates)
    p.grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    q.grad = p.grad.clone()
    opt.step()
    resumed.step()
    assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("norm", ["spectral", "row"])
def test_a_group_edited_to_another_manifold_drops_the_warm_starts_that_no_longer_fit(norm):
    # a Stiefel weight's warm start (its multiplier: n x n) kept through an edit of the group to
    # Oblique (multiplier: n) had failed inside the next step's products (RuntimeError: shape
    # '[24, 8]' is invalid); one that still fits (an edit of weight_decay) is kept
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(Stiefel().random(24, 8, generator=gen, dtype=torch.float64).data)
    opt = ManifoldMuon([p], manifold="stiefel", norm=norm)
    for _ in range(2):
        p.grad = torch.randn(24, 8, generator=gen, dtype=torch.float64)
        opt.step()
    kept = opt.state[p]["dual_correction"]
    assert kept.shape == (8, 8)
    opt.param_groups[0]["weight_decay"] = 0.01  # control: the dual problem's shape is unchanged
    p.grad = torch.randn(24, 8, generator=gen, dtype=torch.float64)
    opt.step()
    assert opt.state[p]["dual_correction"].shape == (8, 8)
    opt.param_groups[0]["manifold"] = "oblique"  # a Stiefel point has unit columns: it is on Oblique
    before = p.detach().clone()
    opt.step()
    assert opt.state[p]["dual_correction"].shape == (8,)  # started cold, kept the new multiplier's shape
    assert not torch.equal(p.detach(), before)
    assert (p.detach().norm(dim=0) - 1).abs().max() <= 64 * torch.finfo(torch.float64).eps  # on Oblique (24 terms)


@pytest.mark.parametrize("path", ["gram", "general"])
def test_a_step_takes_its_own_warm_start_without_a_shape_check(monkeypatch, path):
    # the check of a correction's shape builds the constraint on meta tensors (about 1 % of a
    # 1536x384 Stiefel step on the Gram path; on the general path 0.4 % of a 1536x384 row-norm
    # step, a quarter of a 256x64 one): it runs where a correction comes from outside (gram_step,
    # steepest_direction, load_state_dict), not in the steps that take the optimizer's own warm starts
    calls = []
    check = gram.check_shape_of

    def counted(*args, **kwargs):
        calls.append(args[:2])
        return check(*args, **kwargs)

    monkeypatch.setattr(gram, "check_shape_of", counted)
    monkeypatch.setattr(steepest, "check_shape_of", counted)
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(Stiefel().random(24, 8, generator=gen, dtype=torch.float64).data)
    # the row norm takes the general path (steepest_direction); certify_reference is the Gram path's
    options = dict(certify_reference=4) if path == "gram" else dict(norm="row")
    opt = ManifoldMuon([p], manifold="stiefel", certify_every=2, **options)
    for _ in range(4):  # steps 2-4 warm-started, 2 and 4 certified (the Gram path: a warm-started reference solve)
        p.grad = torch.randn(24, 8, generator=gen, dtype=torch.float64)
        opt.step()
    assert "dual_correction" in opt.state[p] and calls == []
    monkeypatch.setattr(manifold_muon, "check_shape_of", counted)
    opt.load_state_dict(opt.state_dict())
    assert calls == [("ManifoldMuon.load_state_dict", "state 'dual_correction' of parameter #0 of param group 0")]
    p.grad = torch.randn(24, 8, generator=gen, dtype=torch.float64)
    opt.step()
    assert len(calls) == 1  # the loaded warm start was checked once, at the load
    # control: the public entry checks the correction it is given
    W, G, warm = p.detach()[None], p.grad[None], opt.state[p]["dual_correction"][None]
    if path == "gram":
        gram.gram_step(Stiefel().gram_form, W, G, 0.02, warm, GramSettings())
        assert calls[1:] == [("gram_step", "correction")]
    else:
        steepest.steepest_direction(Stiefel(), W, G, "row", "fast", warm_start=warm)
        assert calls[1:] == [("steepest_direction", "warm_start")]


@pytest.mark.parametrize("attribute, value, message", [
    ("dual_steps", 2.5, "dual_steps must be a whole number >= 0, got 2.5"),
    ("cold_dual_steps", -1, "cold_dual_steps must be a whole number >= 0, got -1"),
    ("polish_rounds", True, "polish_rounds must be a whole number >= 0, got True"),
    ("polish_method", "admm_typo", "polish_method must be one of"),
    ("newton_alpha", float("nan"), "newton_alpha must be a number in (0, 2]"),
    ("newton_alpha", 3.0, "newton_alpha must be a number in (0, 2]"),  # diverges warm started
])
def test_a_gram_form_declaring_a_bad_default_is_refused_before_any_step(attribute, value, message):
    # ManifoldMuon read these at a matrix's first step: dual_steps = 2.5 had run as 2 steps, the
    # others failed there naming GramSettings, not the manifold
    from geomuon.manifolds.capabilities import UnitColumnsGram

    class BadForm(UnitColumnsGram):
        pass

    setattr(BadForm, attribute, value)

    class BadOblique(Oblique):
        gram_form = BadForm()

    W = torch.nn.Parameter(Oblique().random(8, 4).data)
    with pytest.raises(ValueError, match=rf"group 0: the manifold BadOblique.* declares a default ManifoldMuon "
                                         rf"cannot take: the Gram form BadForm: .*{re.escape(message)}"):
        ManifoldMuon([W], manifold=BadOblique())
    ManifoldMuon([W], manifold=Oblique())  # control: the form as declared is taken


def test_dgram_steps_of_the_general_path_read_nothing_back(no_host_reads):
    # DGram.retr had read a zero-column flag back in every call: a device sync in every step of
    # ManifoldMuon's general path (norm other than spectral). The first step checks the point
    # (and reports it once on the CPU); the steps after it read nothing.
    manifold = DGram()
    gen = torch.Generator().manual_seed(11)
    W = torch.nn.Parameter(manifold.projx(torch.randn(10, 6, generator=gen, dtype=torch.float64)))
    opt = ManifoldMuon([W], lr=0.02, manifold="dgram", norm="row", compute_dtype=None)
    W.grad = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    opt.step()
    before = W.detach().clone()
    W.grad = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    with no_host_reads():
        opt.step()
    assert not torch.equal(W.detach(), before)  # it stepped
    # on DGram to the float64 retraction's round-off: its cosines within Polar Express's at most
    # 12 steps of 3 products of inner dimension <= m + n = 16, each <= (m + n) eps (scale-free)
    assert manifold.check_point_on_manifold(W.detach(), atol=12 * 3 * 16 * torch.finfo(torch.float64).eps, rtol=0.0)


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0, 4, 4)])
def test_an_empty_matrix_is_refused_by_name_before_any_group_steps(shape):
    # it had been accepted, then refused by its manifold inside step(), unnamed, after the groups
    # before it had moved (a second step then failed in a reshape)
    kept = Stiefel().projx(torch.randn(16, 8, dtype=torch.float64))
    A = torch.nn.Parameter(kept.clone())
    empty = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    view = {"matrix_view": "batch"} if len(shape) == 3 else {}
    refused = rf"parameter .* of shape {re.escape(str(shape))} has no point on Stiefel.*update='adamw' group"
    with pytest.raises(ValueError, match=refused):
        ManifoldMuon([{"params": [A]}, {"params": [empty], **view}], manifold="stiefel")
    optimizer = ManifoldMuon([A], manifold="stiefel")
    with pytest.raises(ValueError, match=refused):
        optimizer.add_param_group({"params": [empty], **view})
    # negative control: the update='adamw' group it is told to use takes it, and a step moves the rest
    optimizer.add_param_group({"params": [empty], "update": "adamw"})
    A.grad, empty.grad = torch.randn_like(A), torch.zeros_like(empty)
    optimizer.step()
    assert not torch.equal(A.detach(), kept) and empty.shape == shape


def test_a_shape_its_manifold_refuses_is_refused_at_construction_naming_the_parameter():
    # a 1 x 8 router (one expert) had been accepted, then refused by CenteredRouterSpace at the first
    # step as "x of shape (1, 8) is invalid", which parameter of the group unsaid
    from geomuon.manifolds import CenteredRouterSpace

    router = CenteredRouterSpace()
    fine = torch.nn.Parameter(router.projx(torch.randn(4, 8, dtype=torch.float64)))
    lone = torch.nn.Parameter(torch.randn(1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"parameter #1 of param group 0 of shape \(1, 8\) has no point on "
                                         r"CenteredRouterSpace.*\(a router needs at least 2 experts"):
        ManifoldMuon([fine, lone], manifold=router)
    ManifoldMuon([fine], manifold=router)  # negative control: a shape it takes is accepted


@pytest.mark.parametrize("manifold,options", [
    (Stiefel(), {}), (DGram(), {}), (Stiefel(), {"solver": "projected"}), (LPRO(radius=1.0), {}),
], ids=["stiefel", "dgram", "stiefel-projected", "lpro-general"])
def test_a_gradient_scaled_by_a_power_of_two_takes_the_same_steps(manifold, options, monkeypatch):
    # Every solver runs on the momentum over a power of two of its largest entry, and momentum and
    # warm starts are exact under a power of two: gradients scaled by 2^-80 (entries of 1e-24,
    # whose squares leave fp32) take the same three steps bit for bit. They had taken no step
    # (Stiefel), or one along another direction (DGram, the projected solver, the general engine
    # on LPRO), silently. (A gradient whose norm overflows is skipped with a warning instead.)
    def run(scale: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(3)
        W = torch.nn.Parameter(manifold.projx(torch.randn(48, 16, generator=gen)))
        opt = ManifoldMuon([W], lr=0.05, manifold=manifold, **options)
        for _ in range(3):
            W.grad = torch.randn(48, 16, generator=gen) * scale
            opt.step()
        return W.detach()

    reference = run(1.0)
    assert torch.equal(run(2.0**-80), reference)
    # control: without the scale (unit_scale returning 1) the same gradients step elsewhere
    for module in (gram, steepest):
        monkeypatch.setattr(module, "unit_scale", lambda X: torch.ones_like(X[..., :1, :1]))
    assert not torch.allclose(run(2.0**-80), reference, rtol=0, atol=1e-2)
