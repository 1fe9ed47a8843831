"""A manifold written the way a user would: only its constraint map, the adjoint and a
defining map. The base class must supply the projection (conjugate gradients on
L L* Lambda = L u), projx/retr (Gauss-Newton), the checks, random/origin and geoopt
interop, and the result must match closed forms and pass the whole contract.
"""

import math
import warnings

import pytest
import torch

from geomuon.manifolds import MatrixManifold, Oblique
from geomuon.optimizers import ManifoldMuon
from geomuon.theory.contracts import check_manifold_contract, default_tolerance, manifold_residual


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    # Tests that draw without an explicit generator stay reproducible.
    torch.manual_seed(0)


class UnitColumnsFromMaps(MatrixManifold):
    """diag(W^T W) = 1 from its maps alone (no closed forms, no Gram diagonal)."""

    name = "UnitColumnsFromMaps"

    def constraint(self, x, u):
        return (x * u).sum(-2)

    def constraint_adjoint(self, x, lam):
        return x * lam.unsqueeze(-2)

    def defining_map(self, x):
        return 0.5 * (x.square().sum(-2) - 1)


class GeneralizedStiefel(MatrixManifold):
    """W^T B W = I for a fixed SPD B: here L L* = 2(W^T B^2 W Lambda + Lambda W^T B^2 W) is
    not diagonal, so conjugate gradients has real work to do."""

    name = "GeneralizedStiefel"

    def __init__(self, B):
        super().__init__()
        self.B = B

    def constraint(self, x, u):
        Bx = self.B.to(x.dtype) @ x
        return Bx.mT @ u + u.mT @ Bx

    def constraint_adjoint(self, x, lam):
        return 2 * self.B.to(x.dtype) @ x @ (0.5 * (lam + lam.mT))

    def defining_map(self, x):
        return x.mT @ self.B.to(x.dtype) @ x - torch.eye(x.size(-1), dtype=x.dtype)


def spd(m, condition=10.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    eigenvalues = torch.logspace(0, math.log10(condition), m, dtype=torch.float64)
    return (q * eigenvalues) @ q.mT


@pytest.mark.parametrize("shape", [(9, 4), (4, 9), (3, 6, 5)], ids=["tall", "wide", "batched"])
def test_maps_only_projection_equals_the_oblique_closed_form(shape):
    gen = torch.Generator().manual_seed(1)
    user, closed = UnitColumnsFromMaps(), Oblique()
    x = closed.random(*shape, dtype=torch.float64, generator=gen)
    u = torch.randn(shape, generator=gen, dtype=torch.float64)
    # Same orthogonal projection computed two ways: round-off only (fp64, unit columns).
    difference = (user.proju(x, u) - closed.proju(x, u)).norm() / u.norm()
    assert difference.item() <= 1e-14
    # The Gauss-Newton retraction is a different retraction than normalizing columns, but
    # for a product of spheres both are the radial projection of x + u.
    v = 0.3 * closed.proju(x, u)
    assert torch.allclose(user.retr(x, v), closed.retr(x, v), atol=1e-14)
    assert torch.allclose(user.projx(3 * x + 0.1 * u), closed.projx(3 * x + 0.1 * u), atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", [(9, 4), (4, 9), (3, 6, 5)], ids=["tall", "wide", "batched"])
def test_maps_only_manifold_passes_the_contract(shape, dtype):
    check_manifold_contract(UnitColumnsFromMaps(), shape, dtype=dtype, seed=3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_generalized_stiefel_passes_the_contract(dtype):
    check_manifold_contract(GeneralizedStiefel(spd(8)), (2, 8, 3), dtype=dtype, seed=4)


def test_generalized_stiefel_projection_matches_a_dense_solve():
    B = spd(6, condition=100.0, seed=2)
    manifold = GeneralizedStiefel(B)
    gen = torch.Generator().manual_seed(5)
    x = manifold.random(6, 3, dtype=torch.float64, generator=gen)
    assert manifold_residual(manifold, x) <= 1e-10
    u = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    # Reference: build L as a dense 9 x 18 matrix and project with a least-squares solve.
    basis = torch.eye(18, dtype=torch.float64).reshape(18, 6, 3)
    L = torch.stack([manifold.constraint(x, e).reshape(-1) for e in basis], dim=1)
    normal = L.mT @ torch.linalg.lstsq(L @ L.mT, L @ u.reshape(-1), driver="gelsd").solution
    reference = u - normal.reshape(6, 3)
    assert torch.allclose(manifold.proju(x, u), reference, atol=1e-10 * u.norm().item())


def test_missing_maps_are_named():
    class NoConstraint(MatrixManifold):
        pass

    class NoDefiningMap(UnitColumnsFromMaps):
        defining_map = MatrixManifold.defining_map

    x = Oblique().random(5, 3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="constraint"):
        NoConstraint().proju(x, x)
    with pytest.raises(NotImplementedError, match="defining_map"):
        NoDefiningMap().retr(x, x)
    # The projection still works without a defining map.
    assert NoDefiningMap().proju(x, x).norm() <= 1e-12


def test_unconverged_projection_warns():
    class OneStep(UnitColumnsFromMaps):
        newton_steps = 1

    x = Oblique().random(5, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        OneStep().retr(x, 3 * Oblique().proju(x, torch.randn_like(x)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("degenerate", ["zero_column", "repeated_column"])
def test_a_stalled_projection_warns(degenerate, dtype):
    # Where the normal space degenerates, F(y) leaves the range of L_y and Gauss-Newton steps by
    # nothing: its small-step stop had returned a generalized Stiefel frame 0.58 off M, unwarned.
    manifold = GeneralizedStiefel(spd(6, seed=3).to(dtype))
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(4), dtype=dtype)
    x[:, 1] = 0.0 if degenerate == "zero_column" else x[:, 0]
    with pytest.warns(RuntimeWarning, match="GeneralizedStiefel: the Gauss-Newton projection stalled off"):
        y = manifold.projx(x)
    assert manifold_residual(manifold, y) < default_tolerance(dtype)  # the first-order residual cannot see it
    assert not manifold.check_point_on_manifold(y)
    # control: from a generic matrix it converges, with no warning (the test's filter makes one an error)
    x[:, 1] = torch.randn(6, generator=torch.Generator().manual_seed(5), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert manifold.check_point_on_manifold(manifold.projx(x))


def test_an_adjoint_of_the_wrong_shape_is_named():
    # returning the multiplier's shape (S instead of W S) had failed in the next constraint call,
    # "u of shape (3, 3) does not match the point's matrix shape (5, 3)", blaming a u never passed
    class MultiplierShapedAdjoint(GeneralizedStiefel):
        def constraint_adjoint(self, x, lam):
            return lam + lam.mT

    manifold = MultiplierShapedAdjoint(spd(5))
    x = GeneralizedStiefel(spd(5)).random(5, 3, dtype=torch.float64)
    for call in (lambda: manifold.proju(x, torch.randn_like(x)), lambda: manifold.projx(x),
                 lambda: manifold.retr(x, torch.zeros_like(x)), lambda: manifold.random(5, 3)):
        with pytest.raises(ValueError, match=r"MultiplierShapedAdjoint: constraint_adjoint\(x, lam\) returned shape "
                                             r"\(3, 3\) for x of shape \(5, 3\)"):
            call()
    assert manifold.constraint(x, x).shape == (3, 3)  # control: the constraint itself is fine


def test_a_float32_point_of_a_large_radius_is_a_point_to_the_optimizer():
    # The generic check compared F(x) = (|x|^2 - r^2)/2 with 0 at atol 1e-5: its fp32 round-off
    # grows like r^2, so ManifoldMuon refused fp32 points of LPRO(radius=10) fresh from projx,
    # even after its own advice (project_to_manifolds)
    from geomuon.manifolds import LPRO
    from geomuon.optimizers import ManifoldMuon

    for radius in (10.0, 20.0):
        manifold = LPRO(radius=radius)
        W = torch.nn.Parameter(manifold.projx(torch.randn(64, 32)))
        opt = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=0.02)
        W.grad = torch.randn(64, 32)
        opt.step()
        assert manifold.check_point_on_manifold(W.detach())
        # control: 0.1 % off the radius is still refused
        assert not manifold.check_point_on_manifold(1.001 * W.detach())
    # and a zero matrix is no point of Stiefel (a test on the Gauss-Newton step had passed it:
    # the step vanishes with the normal space, and zero-initialised weights stayed at 0)
    from geomuon.manifolds import Stiefel

    assert not Stiefel().check_point_on_manifold(torch.zeros(16, 16))
    assert not LPRO(radius=10.0).check_point_on_manifold(torch.zeros(16, 16))


def test_the_contract_checks_every_declared_capability():
    from geomuon.manifolds.capabilities import UnitColumnsGram

    class DiagonalClaim(UnitColumnsGram):  # W^T W of unit columns is not diagonal
        diagonal_gram = True

    class MisdeclaredOblique(Oblique):
        name = "MisdeclaredOblique"
        gram_form = DiagonalClaim()

    class RowDualizerClaim(UnitColumnsFromMaps):  # row normalization does not keep unit columns' tangents
        name = "RowDualizerClaim"

        def dualizer_keeps_tangent(self, x, norm):
            return norm == "row"

    # both had passed the contract, and the first steered ManifoldMuon to a certified 0.007 of
    # the optimal descent
    for manifold, failed in ((MisdeclaredOblique(), ["gram_form_diagonal_gram"]),
                             (RowDualizerClaim(), ["dualizer_keeps_tangent"])):
        report = check_manifold_contract(manifold, (6, 4), dtype=torch.float64, raise_on_failure=False)
        assert [c.name for c in report.failures] == failed, report
    # controls: the honest declarations pass
    for manifold in (Oblique(), UnitColumnsFromMaps()):
        assert check_manifold_contract(manifold, (6, 4), dtype=torch.float64, raise_on_failure=False).passed


def test_a_group_that_leaves_the_manifold_is_violated_and_says_so():
    # a group that is no symmetry of the manifold: every trial had stepped from points off it
    # and returned a verdict about them (holds, for a permutation of unequal fixed row norms)
    from geomuon.optimizers.steepest import steepest_direction
    from geomuon.theory.equivariance import DirectionUpdate, check_equivariance

    class FixedRowNorms(MatrixManifold):
        """Row i of norm radii[i]."""

        name = "FixedRowNorms"

        def __init__(self, radii):
            super().__init__()
            self.radii = radii

        def constraint(self, x, u):
            return (x * u).sum(-1)

        def constraint_adjoint(self, x, lam):
            return x * lam.unsqueeze(-1)

        def defining_map(self, x):
            return 0.5 * (x.square().sum(-1) - self.radii.to(x.dtype) ** 2)

    unequal = DirectionUpdate(steepest_direction, FixedRowNorms(torch.arange(1.0, 7.0, dtype=torch.float64)))
    report = check_equivariance(unequal, "permutation", (6, 4), seed=0)  # had held
    assert report.verdict == "violated" and "the group does not preserve FixedRowNorms" in report.message()
    # control: equal norms are preserved by permutations, and the row-wise direction holds
    equal = DirectionUpdate(steepest_direction, FixedRowNorms(torch.ones(6, dtype=torch.float64)))
    assert check_equivariance(equal, "permutation", (6, 4), seed=0).verdict == "holds"
    oblique = DirectionUpdate(steepest_direction, Oblique())
    assert "the group does not preserve Oblique" in check_equivariance(oblique, "row-scaling", (6, 4), seed=0).message()
    assert check_equivariance(oblique, "left-orthogonal", (6, 4), seed=0).verdict == "holds"


def test_optimizer_checks_start_from_points_the_generic_projection_reaches():
    # W_0 had been projx of the raw draw at the trial's scale (1e-8 .. 1e8), which the
    # Gauss-Newton projection of a maps-only manifold does not reach: verdict error
    from geomuon.optimizers import ManifoldMuon
    from geomuon.theory.equivariance import OptimizerUpdate, check_equivariance

    manifold = UnitColumnsFromMaps()
    update = OptimizerUpdate(lambda ps: ManifoldMuon(ps, manifold=manifold, lr=0.05, compute_dtype=None),
                             manifold=manifold, steps=2)
    assert check_equivariance(update, "left-orthogonal", (6, 4), seed=0, trials=20).verdict == "holds"


def test_manifold_muon_refuses_what_it_cannot_step_with_the_manifold_it_names():
    from geomuon.manifolds import LPRO
    from geomuon.optimizers import ManifoldMuon

    # a parameter on a sphere of radius 1 in a group of radius 2 had been stepped on the group's
    import geoopt

    p = geoopt.ManifoldParameter(LPRO(radius=1.0).projx(torch.randn(6, 4)), manifold=LPRO(radius=1.0))
    with pytest.raises(ValueError, match=r"ManifoldParameter on LPRO\{'radius': 1.0\} but its group says "
                                         r"LPRO\{'radius': 2.0\}"):
        ManifoldMuon([{"params": [p], "manifold": LPRO(radius=2.0)}])
    ManifoldMuon([{"params": [p], "manifold": LPRO(radius=1.0)}])  # control: an equal instance

    # a manifold with no defining map and no projx/retr of its own: NotImplementedError at the first step
    class OnlyConstraint(MatrixManifold):
        name = "OnlyConstraint"
        constraint = UnitColumnsFromMaps.constraint
        constraint_adjoint = UnitColumnsFromMaps.constraint_adjoint

    with pytest.raises(ValueError, match="OnlyConstraint defines neither defining_map"):
        ManifoldMuon([torch.nn.Parameter(torch.randn(6, 4))], manifold=OnlyConstraint())

    # a manifold without constraint_adjoint had been taken, then failed inside the first step after
    # the groups before it had moved; refused at construction, naming the group, class and method
    class NoAdjoint(MatrixManifold):
        name = "NoAdjoint"
        constraint = UnitColumnsFromMaps.constraint
        defining_map = UnitColumnsFromMaps.defining_map

    other = torch.nn.Parameter(UnitColumnsFromMaps().projx(torch.randn(6, 4)))
    with pytest.raises(ValueError, match=r"param group 1: NoAdjoint does not define constraint_adjoint\(x, lam\): "):
        ManifoldMuon([{"params": [other], "manifold": UnitColumnsFromMaps()},
                      {"params": [torch.nn.Parameter(torch.randn(6, 4))], "manifold": NoAdjoint()}])
    NoAdjoint.constraint_adjoint = UnitColumnsFromMaps.constraint_adjoint  # control: with it, it is taken
    ManifoldMuon([torch.nn.Parameter(UnitColumnsFromMaps().projx(torch.randn(6, 4)))], manifold=NoAdjoint())


class ZeroRowSums(MatrixManifold):
    """Every row sums to zero: a linear constraint, F(0) = 0, from its maps alone."""

    name = "ZeroRowSums"

    def constraint(self, x, u):
        return u.sum(-1)

    def constraint_adjoint(self, x, lam):
        return lam.unsqueeze(-1).expand(*lam.shape, x.size(-1))

    def defining_map(self, x):
        return x.sum(-1)


def test_a_linear_constraint_is_checked_at_the_size_of_its_terms():
    # F(0) = 0 had meant an absolute tolerance of 1e-5: fp32 rows of 1024 unit entries sum to
    # about 1e-5 of round-off, so projx's own points were refused by ManifoldMuon (whose advice,
    # projx again, could not help), and every converged projx and retr warned "stalled" (L_y(y) =
    # F(y) vanishes at the point, and was the only scale the stall test knew).
    manifold = ZeroRowSums()
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = manifold.projx(torch.randn(16, 1024, generator=gen))
        assert manifold.check_point_on_manifold(x)
        W = torch.nn.Parameter(x.clone())
        opt = ManifoldMuon([W], manifold=manifold, lr=0.05)
        for _ in range(3):
            W.grad = torch.randn(16, 1024, generator=gen)
            opt.step()
    # independently, in float64: recursive summation's bound n u sum|x_i| on each row's fp32 sum
    w = W.detach().double()
    assert bool((w.sum(-1).abs() <= 1024 * 2.0**-24 * w.abs().sum(-1)).all())
    off = x.clone()
    off[0] += 1e-2  # control: a row summing to 10 is off, at any scale of the terms
    assert not manifold.check_point_on_manifold(off)
    off[0] = 5e-7  # and each row at the size of its own terms: one of tiny entries summing to 5e-4 is off
    assert not manifold.check_point_on_manifold(off)


def test_a_manifold_with_a_defining_map_and_no_constraint_checks_its_points():
    # the check of a homogeneous constraint measures its terms through L_x: a manifold that defines
    # F and its own projx but no constraint (F(0) = -1 here) had raised NotImplementedError from it
    class SphereFromMap(MatrixManifold):
        name = "SphereFromMap"

        def defining_map(self, x):
            return (x.square().sum((-2, -1)) - 1).unsqueeze(-1)

        def projx(self, x):
            return x / x.norm(dim=(-2, -1), keepdim=True)

    manifold = SphereFromMap()
    x = manifold.projx(torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    assert manifold.check_point_on_manifold(x)
    assert not manifold.check_point_on_manifold(1.01 * x)  # control


@pytest.mark.parametrize("scale", [1e-8, 1e4, 1e6])
def test_the_generic_projection_lands_from_far_and_near(scale):
    # Old base class: in float32 the conjugate-gradient sums of a right-hand side of 7e12 (from
    # scale 1e6) overflowed, the solve returned 0 and projx stopped at once, 0.5 off M with no
    # warning; and 30 Gauss-Newton steps (each about halving the distance from afar) had left a
    # generalized Stiefel point from 1e4 0.35 off M. Bounds: default_tolerance of each dtype, the
    # contract's (a relative residual of a correct projection is its round-off).
    gen = torch.Generator().manual_seed(0)
    for manifold, dtype in ((UnitColumnsFromMaps(), torch.float32), (GeneralizedStiefel(spd(8)), torch.float64)):
        x = scale * torch.randn(2, 8, 3, dtype=dtype, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # converged: no "did not converge" warning either
            y = manifold.projx(x)
        assert manifold_residual(manifold, y) <= default_tolerance(dtype), (type(manifold).__name__, scale)
