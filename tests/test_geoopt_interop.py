"""geoopt interop: our manifolds inside geoopt.ManifoldParameter, stepped by geoopt's own
Riemannian optimizers, and the torch.jit deprecation warnings of geoopt filtered narrowly.
"""

import subprocess
import sys

import pytest
import torch

from geomuon.manifolds import LPRO, CenteredRouterSpace, Euclidean, Stiefel
from geomuon.theory.contracts import default_tolerance, manifold_residual

import geoopt  # noqa: E402  (after manifolds, which imports it with the jit warnings filtered)
# Every built-in manifold from the registry, plus LPRO with a radius: test_manifolds' table.
from test_manifolds import MANIFOLDS  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    # Tests that draw without an explicit generator stay reproducible.
    torch.manual_seed(0)


OPTIMIZERS = {
    "adam": lambda params: geoopt.optim.RiemannianAdam(params, lr=1e-2),
    "sgd": lambda params: geoopt.optim.RiemannianSGD(params, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("shape", [(12, 5), (5, 12)], ids=["tall", "wide"])
@pytest.mark.parametrize("name", MANIFOLDS)
def test_geoopt_optimizers_stay_on_the_manifold(name, shape, optimizer):
    manifold = MANIFOLDS[name]()
    gen = torch.Generator().manual_seed(0)
    start = manifold.random(*shape, dtype=torch.float32, generator=gen)
    target = torch.randn(shape, generator=gen)
    param = geoopt.ManifoldParameter(start.clone(), manifold=manifold)
    opt = OPTIMIZERS[optimizer]([param])

    def loss():
        return (param - target).square().sum()

    initial = loss().item()
    for _ in range(200):
        opt.zero_grad()
        loss().backward()
        opt.step()
    # Every step ends in a retraction computed in fp32, so the residual stays at fp32
    # round-off (1e-5 relative bound, geomuon.theory.contracts.default_tolerance) after 200 steps.
    assert manifold_residual(manifold, param.detach()) <= default_tolerance(torch.float32)
    assert manifold.check_point_on_manifold(param.detach())
    assert loss().item() < initial  # the optimizer really moved along the manifold


def test_manifold_parameter_rejects_bad_shapes_with_our_reason():
    with pytest.raises(ValueError, match="at least 2 experts"):
        geoopt.ManifoldParameter(torch.randn(1, 4), manifold=CenteredRouterSpace())
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
        geoopt.ManifoldParameter(torch.randn(4), manifold=Stiefel())


def _python(code, cwd):
    # Run in an empty folder (``cwd``): ``python -c`` puts the working directory first on
    # sys.path, and from the repository root the top-level source folders (manifolds/, ...)
    # import as packages of their own, shadowing the installed ``geomuon``.
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_only_geoopt_jit_warnings_are_filtered(tmp_path):
    # With DeprecationWarnings as errors, importing the library by its installed name (which
    # imports geoopt) succeeds; afterwards the same message raised anywhere else is still an
    # error, so the filter did not leak into the process.
    code = (
        "import warnings, geomuon.manifolds, geoopt\n"
        "try:\n"
        "    warnings.warn('`torch.jit.script` is deprecated. elsewhere', DeprecationWarning)\n"
        "except DeprecationWarning:\n"
        "    print('still-an-error')\n"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "still-an-error" in result.stdout


def test_geoopt_alone_still_emits_the_jit_warning(tmp_path):
    # Negative control: without our filter the import fails under -W error. When a geoopt
    # or torch release removes the warning, this fails and the filter can go.
    result = _python("import geoopt", tmp_path)
    assert result.returncode != 0
    assert "torch.jit.script` is deprecated" in result.stderr


@pytest.mark.parametrize("name", MANIFOLDS)
def test_random_and_origin_follow_geoopt_returning_a_manifold_tensor(name):
    manifold = MANIFOLDS[name]()
    gen = torch.Generator().manual_seed(0)
    again = torch.Generator().manual_seed(0)
    for point in (manifold.random(6, 4, generator=gen), manifold.origin(6, 4)):
        assert isinstance(point, geoopt.ManifoldTensor) and point.manifold is manifold
        manifold.assert_check_point_on_manifold(point)
    # geoopt's name for the sampler draws the same point.
    assert torch.equal(manifold.random_naive(6, 4, generator=again), manifold.random(6, 4, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(manifold.origin(6, 4), manifold.origin(6, 4))  # deterministic
    # ManifoldParameter keeps the point's manifold, accepts an interchangeable instance,
    # refuses a different manifold (geoopt compares them with !=).
    point = manifold.random(6, 4)
    assert geoopt.ManifoldParameter(point).manifold is manifold
    assert geoopt.ManifoldParameter(point, manifold=MANIFOLDS[name]()).manifold is manifold
    with pytest.raises(ValueError, match="Manifolds do not match"):
        geoopt.ManifoldParameter(point, manifold=geoopt.Euclidean(ndim=2))


def test_manifolds_are_equal_exactly_when_interchangeable():
    assert Stiefel() == Stiefel() and hash(Stiefel()) == hash(Stiefel())
    assert LPRO(radius=2.0) == LPRO(radius=2) and LPRO(radius=2.0) != LPRO()
    assert Stiefel() != CenteredRouterSpace() and Stiefel() != geoopt.Stiefel(canonical=False)
    assert len({Stiefel(), Stiefel(), LPRO(), LPRO(radius=3.0)}) == 3


@pytest.mark.parametrize("manifold", [Euclidean(), LPRO()], ids=["Euclidean", "LPRO"])
def test_riemannian_adam_on_the_unconstrained_space_is_adam(manifold):
    # the space is a product of lines: RiemannianAdam's second moment must be per entry, as on
    # geoopt.Euclidean; the inherited per-matrix inner product had made it one number per matrix
    # (0.45 apart from Adam after five steps). Tolerance: both compute the same float64
    # expressions in the same order, up to a few roundings per step, 1e-12 relative over 5 steps.
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    grads = [torch.randn(6, 4, dtype=torch.float64, generator=gen) for _ in range(5)]
    ours = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
    plain = torch.nn.Parameter(x0.clone())
    optimizers = geoopt.optim.RiemannianAdam([ours], lr=0.1), torch.optim.Adam([plain], lr=0.1)
    for g in grads:
        ours.grad, plain.grad = g.clone(), g.clone()
        for opt in optimizers:
            opt.step()
    assert (ours.data - plain.data).abs().max() <= 1e-12 * x0.abs().max()
    assert not torch.equal(plain.data, x0)


def test_manifold_muon_refuses_a_geoopt_parameter_its_group_would_step_off_its_manifold():
    # a geoopt.Stiefel parameter in a DGram group had been stepped onto DGram without a word;
    # controls: geoopt's Stiefel in a Stiefel group, and geoopt's default (Euclidean) parameter,
    # which holds every point, in any group
    from geomuon.optimizers import ManifoldMuon

    stiefel = geoopt.Stiefel(canonical=False)
    with pytest.raises(ValueError, match="ManifoldParameter on .* but its group says DGram"):
        ManifoldMuon([geoopt.ManifoldParameter(stiefel.random(6, 4), manifold=stiefel)], manifold="dgram")
    sphere = geoopt.Sphere()
    with pytest.raises(ValueError, match="ManifoldParameter on .* but its group says Stiefel"):
        ManifoldMuon([geoopt.ManifoldParameter(sphere.random(6, 4), manifold=sphere)], manifold="stiefel")
    ManifoldMuon([geoopt.ManifoldParameter(stiefel.random(6, 4), manifold=stiefel)], manifold="stiefel")
    ManifoldMuon([geoopt.ManifoldParameter(Stiefel().random(6, 4).data)], manifold="dgram")


def test_manifold_muon_refuses_a_wrapped_manifold_it_would_half_honour():
    # geoopt.Scaled forwards its base's methods, so it had passed as a manifold: its scale was then
    # honoured by the general path's retraction and dropped by the Gram path and the group's spec
    from geomuon.optimizers import ManifoldMuon

    p = torch.nn.Parameter(Stiefel().random(6, 4).data)
    with pytest.raises(ValueError, match="Scaled is not a geomuon.manifolds.MatrixManifold"):
        ManifoldMuon([p], manifold=geoopt.Scaled(Stiefel(), 100.0))
    with pytest.raises(ValueError, match="Scaled is not a geomuon.manifolds.MatrixManifold"):
        ManifoldMuon([geoopt.ManifoldParameter(p.data.clone(), manifold=geoopt.Scaled(Stiefel(), 100.0))])


def test_manifold_muon_refuses_a_constrained_parameter_in_an_adamw_group():
    # AdamW ignores the manifold: a Stiefel parameter in such a group had left Stiefel at its first
    # step. Control: an unconstrained ManifoldParameter (geoopt's Euclidean default) stays welcome.
    from geomuon.optimizers import ManifoldMuon

    on_stiefel = geoopt.ManifoldParameter(Stiefel().random(6, 4).data, manifold=Stiefel())
    with pytest.raises(ValueError, match="which an update='adamw' group would step off it"):
        ManifoldMuon([{"params": [on_stiefel], "update": "adamw"}])
    ManifoldMuon([{"params": [geoopt.ManifoldParameter(torch.randn(6, 4))], "update": "adamw"}])
