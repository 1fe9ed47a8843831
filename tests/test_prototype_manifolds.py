"""Manifolds geomuon does not ship, written the way docs/tutorials/custom-manifold.md teaches:
a generalized Stiefel manifold {W : W^T B W = I} with a per-instance SPD B (constraint, adjoint
and defining map only: everything else generic), and fixed column norms {|w_j| = r} with a
per-instance radius, closed-form projections and retraction and a Gram-space form.

Each one passes the manifold contract on several shapes in float64 and float32, is stepped by
ManifoldMuon (float64 and float32, batched, two instances side by side, weight decay), reports
sane certificates, saves and resumes, and has the symmetry the docs say. Deliberate breaks of
each map are negative controls: the contract must name them.
"""

import io

import geoopt
import pytest
import torch

from geomuon.manifolds import MatrixManifold, Oblique, matrix_method
from geomuon.manifolds.capabilities import UnitColumnsGram
from geomuon.optimizers import ManifoldMuon
from geomuon.optimizers.steepest import ACCURATE, FAST, steepest_direction
from geomuon.theory.contracts import check_manifold_contract, default_tolerance
from geomuon.theory.equivariance import DirectionUpdate, OptimizerUpdate, check_equivariance
from test_constraint_manifold import spd  # a float64 SPD matrix, eigenvalues log-spaced
from test_engine import WholeBatchManifoldMuon  # whole same-shape stacks on the CPU too, as on a GPU


class GeneralizedStiefel(MatrixManifold):
    r"""$\{W : W^\top BW = I_n\}$ for a fixed SPD $B$: $F(W) = W^\top BW - I$,
    $L_W(A) = (BW)^\top A + A^\top BW$, $L_W^*(\Lambda) = 2BW\operatorname{sym}(\Lambda)$."""

    name = "PrototypeGeneralizedStiefel"

    def __init__(self, B):
        super().__init__()
        self.B = B

    def shape_problem(self, m, n):
        if m != self.B.size(0):
            return f"B is {self.B.size(0)}x{self.B.size(0)}: W needs {self.B.size(0)} rows, got {m}"
        # n B-orthonormal columns need m >= n
        return super().shape_problem(m, n) or (f"W^T B W = I_{n} needs m >= n, got {m}x{n}" if m < n else None)

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        Bx = self.B.to(x) @ x  # (the engine calls this in bf16 too: B follows x's dtype and device)
        return Bx.mT @ u + u.mT @ Bx

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return self.B.to(x) @ x @ (lam + lam.mT)

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return x.mT @ self.B.to(x) @ x - torch.eye(x.size(-1), dtype=x.dtype, device=x.device)


def _diagonal(M):
    return torch.diagonal(M, dim1=-2, dim2=-1)


class RadiusColumnsGram(UnitColumnsGram):
    r"""The Gram form of $\{|w_j| = r\}$: ``Oblique``'s (the constraint, adjoint, projection and
    Jacobi diagonal do not see $r$) with the retraction $\rho(Y^\top Y) = r\operatorname{diag}(Y^\top Y)^{-1/2}$."""

    def __init__(self, radius):
        self.radius = radius

    def retraction_factor(self, YtY, terms=6, far=None):
        return self.radius * super().retraction_factor(YtY, terms, far)


class ColumnNorms(MatrixManifold):
    r"""$\{W : \|w_j\| = r\ \forall j\}$: $F(W) = \tfrac12(\operatorname{diag}(W^\top W) - r^2)$,
    $L_W(A) = \operatorname{diag}(W^\top A)$, $L_W^*(\lambda) = W\operatorname{diag}(\lambda)$,
    closed-form ``proju``/``projx``/``retr`` and a Gram form."""

    name = "PrototypeColumnNorms"

    def __init__(self, radius=1.0):
        super().__init__()
        self.radius = radius
        self.gram_form = RadiusColumnsGram(radius)  # per instance: its retraction needs the radius

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return (x * u).sum(-2)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return x * lam.unsqueeze(-2)

    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return 0.5 * (x.square().sum(-2) - self.radius**2)

    def constraint_gram_diag(self, x):
        return x.square().sum(-2)

    @matrix_method("u")
    def proju(self, x, u):
        x = x.to(u.dtype)
        return u - x * ((x * u).sum(-2, keepdim=True) / x.square().sum(-2, keepdim=True))

    @matrix_method(finite=True)
    def projx(self, x):
        return self.radius * x / x.norm(dim=-2, keepdim=True)

    @matrix_method("u")
    def retr(self, x, u):
        return self.projx(x + u)


GS_B = spd(6, seed=1)
SHAPES = {GeneralizedStiefel: [(6, 4), (5, 5), (2, 6, 3)], ColumnNorms: [(6, 4), (4, 6), (5, 5), (2, 6, 3)]}
CASES = [(GeneralizedStiefel, (spd(shape[-2], seed=1),), shape) for shape in SHAPES[GeneralizedStiefel]] + [
    (ColumnNorms, (2.5,), shape) for shape in SHAPES[ColumnNorms]]


def _off(manifold, W):
    """Largest |F(W)| entry, float64, relative to the constraint's constant (1 for F = W^T B W - I,
    r^2 / 2 for F = (|w|^2 - r^2) / 2)."""
    residual = manifold.defining_map(W.detach().double()).abs().max()
    return float(residual / manifold.defining_map(torch.zeros_like(W.detach().double())).abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("cls, args, shape", CASES, ids=[f"{c.__name__}-{s}" for c, _, s in CASES])
def test_prototypes_pass_the_contract(cls, args, shape, dtype):
    check_manifold_contract(cls(*args), shape, dtype=dtype)


def test_a_shape_the_manifold_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match=r"size of shape \(4, 6\): W\^T B W = I_6 needs m >= n"):
        GeneralizedStiefel(spd(4)).random(4, 6)
    with pytest.raises(ValueError, match=r"B is 6x6: W needs 6 rows, got 5"):
        GeneralizedStiefel(GS_B).random(5, 3)


# ---------------------------------------------------------------- negative controls: breaks the contract names
class ProjectionForUnitColumns(ColumnNorms):  # drops the 1/|w_j|^2: a projection only at r = 1
    @matrix_method("u")
    def proju(self, x, u):
        x = x.to(u.dtype)
        return u - x * (x * u).sum(-2, keepdim=True)


class RetractsOnlyFromTheManifold(ColumnNorms):  # |x + u_j|^2 = r^2 + |u_j|^2 holds only for x on M
    @matrix_method("u")
    def retr(self, x, u):
        return (x + u) * self.radius / (self.radius**2 + u.square().sum(-2, keepdim=True)).sqrt()


class RetractsToUnitColumns(ColumnNorms):
    @matrix_method("u")
    def retr(self, x, u):
        y = x + u
        return y / y.norm(dim=-2, keepdim=True)


class UnprojectedGradient(ColumnNorms):
    def egrad2rgrad(self, x, u):
        return u


class DoubledGradient(ColumnNorms):
    def egrad2rgrad(self, x, u):
        return 2 * self.proju(x, u)


class DefiningMapForUnitColumns(ColumnNorms):
    @matrix_method(result="multiplier")
    def defining_map(self, x):
        return 0.5 * (x.square().sum(-2) - 1)


class WrongGramDiagonal(ColumnNorms):
    def constraint_gram_diag(self, x):
        return 2 * x.square().sum(-2)


class UnitRadiusGram(RadiusColumnsGram):
    def retraction_factor(self, YtY, terms=6, far=None):
        return torch.diag_embed(_diagonal(YtY).rsqrt())


class GramRetractsToUnitColumns(ColumnNorms):
    def __init__(self, radius=1.0):
        super().__init__(radius)
        self.gram_form = UnitRadiusGram(radius)


class UnscaledGramProjection(RadiusColumnsGram):
    def project(self, D, M):
        return torch.diag_embed(_diagonal(M))


class GramProjectsForUnitColumns(ColumnNorms):
    def __init__(self, radius=1.0):
        super().__init__(radius)
        self.gram_form = UnscaledGramProjection(radius)


class FormSharedByTheClass(ColumnNorms):  # a class-level form cannot know an instance's radius
    gram_form = RadiusColumnsGram(1.0)

    def __init__(self, radius=1.0):
        MatrixManifold.__init__(self)
        self.radius = radius


class RowConstraintWithClosedForms(ColumnNorms):
    """Constrains rows while its set (projx, retr) has unit-norm columns; no defining map."""

    defining_map = MatrixManifold.defining_map
    constraint_gram_diag = MatrixManifold.constraint_gram_diag

    @matrix_method("u", result="multiplier")
    def constraint(self, x, u):
        return (x * u).sum(-1)

    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return x * lam.unsqueeze(-1)


class TransportThatKeepsTheVector(ColumnNorms):
    def transp(self, x, y, v):
        return v


class OneSidedAdjoint(GeneralizedStiefel):  # L* without the symmetrization: not the adjoint
    @matrix_method()
    def constraint_adjoint(self, x, lam):
        return 2 * self.B.to(x) @ x @ lam


class GramDiagonalOfANonDiagonalGram(GeneralizedStiefel):
    """The true diagonal of L L*, which is not diagonal here: the engine would divide by it."""

    def constraint_gram_diag(self, x):
        Bx = self.B.to(x) @ x
        d = _diagonal(Bx.mT @ Bx)
        return 2 * (d.unsqueeze(-1) + d.unsqueeze(-2))


BREAKS = [
    (ProjectionForUnitColumns, "proju_tangent"),
    (RetractsOnlyFromTheManifold, "retr_from_scaled_point"),
    (RetractsToUnitColumns, "retr_on_manifold"),
    (UnprojectedGradient, "egrad2rgrad_tangent"),
    (DoubledGradient, "egrad2rgrad_is_gradient"),
    (DefiningMapForUnitColumns, "random_on_manifold"),
    (WrongGramDiagonal, "constraint_gram_diag"),
    (GramRetractsToUnitColumns, "gram_retraction_on_manifold"),
    (GramProjectsForUnitColumns, "gram_form_matches"),
    (FormSharedByTheClass, "gram_retraction_on_manifold"),
    (RowConstraintWithClosedForms, "proju_matches_constraint"),
    (TransportThatKeepsTheVector, "transp_tangent"),
    (OneSidedAdjoint, "constraint_adjoint"),
    (GramDiagonalOfANonDiagonalGram, "constraint_gram_diag"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("broken, check", BREAKS, ids=[b.__name__ for b, _ in BREAKS])
def test_the_contract_names_each_deliberate_break(broken, check, dtype):
    args = (GS_B,) if issubclass(broken, GeneralizedStiefel) else (2.5,)
    report = check_manifold_contract(broken(*args), (6, 4), dtype=dtype, raise_on_failure=False)
    assert check in [c.name for c in report.failures], report


# (was a bug) a defining map whose multiplier is not the constraint's (rows summed where the constraint sums
# columns, a one-character slip) crashes the contract inside the Gauss-Newton solve with "The expanded
# size of the tensor (6) must match the existing size (4)", naming neither method; ManifoldMuon
# reports the (on-manifold) weight as off its manifold and advises projx, which cannot help.
def test_a_defining_map_of_the_wrong_multiplier_shape_is_named():
    class RowDefiningMap(ColumnNorms):
        @matrix_method(result="multiplier")
        def defining_map(self, x):
            return 0.5 * (x.square().sum(-1) - self.radius**2)

    with pytest.raises((AssertionError, ValueError), match="defining_map"):
        check_manifold_contract(RowDefiningMap(2.5), (6, 4))


# ---------------------------------------------------------------- training
def _steps(params_and_manifolds, gradients, steps, **options):
    """``steps`` WholeBatchManifoldMuon steps on ManifoldParameter copies, gradients[i] fed to parameter i."""
    params = [geoopt.ManifoldParameter(x.clone(), manifold=m) for x, m in params_and_manifolds]
    opt = WholeBatchManifoldMuon(params, **options)
    for _ in range(steps):
        for p, g in zip(params, gradients):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("cls, first, second", [(GeneralizedStiefel, GS_B, spd(6, seed=2)), (ColumnNorms, 2.5, 0.4)],
                         ids=["GeneralizedStiefel", "ColumnNorms"])
def test_two_instances_of_one_shape_are_stepped_each_on_its_own(cls, first, second, dtype):
    # four same-shape weights in one group, two on each instance: each batch must step with its own
    # constraint, as the weight stepped alone (general path for the generalized Stiefel, Gram path for
    # the column norms), with weight decay and certificates on. Not bit for bit: a stack runs its
    # conjugate-gradient and Gauss-Newton loops until every member has converged, so a member takes
    # iterations past its own stop, each moving it by round-off; the contract's margin
    # (default_tolerance: 84 ulps in float32, 4.5e5 in float64) bounds that relative change
    gen = torch.Generator().manual_seed(0)
    manifolds = [cls(first), cls(second), cls(first), cls(second)]
    points = [m.random(6, 4, dtype=dtype, generator=gen).data for m in manifolds]
    grads = [torch.randn(6, 4, dtype=dtype, generator=gen) for _ in manifolds]
    options = dict(lr=0.05, weight_decay=0.1, certify_every=1)
    together, opt = _steps(list(zip(points, manifolds)), grads, 4, **options)
    for i, (x, m) in enumerate(zip(points, manifolds)):
        alone, _ = _steps([(x, m)], [grads[i]], 4, **options)
        assert float((together[i] - alone[0]).norm() / alone[0].norm()) <= default_tolerance(dtype), i
    # on its own manifold to the dtype's round-off (the contract's margin, default_tolerance: about
    # 84 ulps in float32 over sums of n + m terms) ...
    for W, m in zip(together, manifolds):
        assert _off(m, W) <= default_tolerance(dtype)
    # ... and not on the other one (control: the two geometries differ, so a shared batch would show)
    assert _off(manifolds[1], together[0]) > 1e3 * default_tolerance(dtype)
    # certificates: a fraction of the optimal descent, positive and at most 1 up to the dtype's round-off
    certificates = opt.certificates
    assert len(certificates) == 4
    assert all(0.5 < c <= 1 + default_tolerance(dtype) for c in certificates.values()), certificates


def test_the_general_path_certificate_bounds_the_optimum_from_above():
    # what ManifoldMuon's general path runs (FAST, one dual step) with the exact certificate: its dual
    # value must bound every feasible direction's value, here that of a 400-step solve, and its ratio
    # must not exceed the direction's true fraction of that solve's value. Float64 SVD-based values of
    # order 1: relative round-off ~1e-14, checked with the contract's float64 margin
    manifold = GeneralizedStiefel(GS_B)
    gen = torch.Generator().manual_seed(3)
    W = manifold.random(6, 4, dtype=torch.float64, generator=gen)
    G = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    fast = steepest_direction(manifold, W, G, "spectral", FAST.replace(certify="exact"))
    best = steepest_direction(manifold, W, G, "spectral", ACCURATE.replace(steps=400))
    tol = default_tolerance(torch.float64)
    assert float(best.ratio) > 0.95  # the reference is close to the optimum
    assert float(fast.dual) >= float(best.primal) * (1 - tol)
    assert 0 < float(fast.ratio) <= float(fast.primal) / float(best.primal) * (1 + tol)


def test_the_column_norms_gram_path_is_oblique_scaled_by_the_radius():
    # rW' with W' unit-column is on ColumnNorms(r), the tangent spaces agree and the spectral steepest
    # direction is scale-free, so a step of lr on ColumnNorms(r) from rW' is r times Oblique's step of
    # lr / r from W'. Float64 Gram path (compute_dtype=None), three steps: agreement to the contract's
    # float64 margin (1e-10, far above the ~1e-15 round-off of 8x5 products)
    r = 2.5
    gen = torch.Generator().manual_seed(1)
    x = Oblique().random(3, 8, 5, dtype=torch.float64, generator=gen).data
    grads = [torch.randn(3, 8, 5, dtype=torch.float64, generator=gen)]
    common = dict(compute_dtype=None, certify_every=1, matrix_view="batch")
    (scaled,), opt = _steps([(r * x, ColumnNorms(r))], grads, 3, lr=0.05, **common)
    (unit,), reference = _steps([(x, Oblique())], grads, 3, lr=0.05 / r, **common)
    tol = default_tolerance(torch.float64)
    assert float((scaled - r * unit).norm() / scaled.norm()) <= tol
    assert abs(opt.certificates["#0 of param group 0"] - reference.certificates["#0 of param group 0"]) <= tol
    # control: without the lr / r the unit trajectory is another one
    (other,), _ = _steps([(x, Oblique())], grads, 3, lr=0.05, **common)
    assert float((scaled - r * other).norm() / scaled.norm()) > 1e3 * tol


@pytest.mark.parametrize("cls, arg", [(GeneralizedStiefel, GS_B), (ColumnNorms, 2.5)],
                         ids=["GeneralizedStiefel", "ColumnNorms"])
def test_a_resumed_run_takes_the_same_steps(cls, arg):
    # state_dict through torch.save / torch.load(weights_only=True): the group's manifold is plain data
    # (a tensor B included), momentum and warm start come back, and the resumed steps equal the
    # uninterrupted ones bit for bit
    manifold = cls(arg)
    gen = torch.Generator().manual_seed(2)
    x = manifold.random(2, 6, 4, dtype=torch.float64, generator=gen).data
    grads = [torch.randn(2, 6, 4, dtype=torch.float64, generator=gen) for _ in range(4)]

    def run(W, opt, gradients):
        for g in gradients:
            W.grad = g.clone()
            opt.step()

    def build(W):
        return ManifoldMuon([{"params": [W], "manifold": cls(arg)}], lr=0.05, matrix_view="batch")

    straight = torch.nn.Parameter(x.clone())
    run(straight, build(straight), grads)

    W = torch.nn.Parameter(x.clone())
    opt = build(W)
    run(W, opt, grads[:2])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert MatrixManifold.from_spec(state["param_groups"][0]["manifold"]) == manifold
    resumed = torch.nn.Parameter(W.detach().clone())
    opt = build(resumed)
    opt.load_state_dict(state)
    run(resumed, opt, grads[2:])
    assert torch.equal(resumed.detach(), straight.detach())
    # control: resuming without the state (momentum, warm start) takes other steps
    fresh = torch.nn.Parameter(W.detach().clone())
    run(fresh, build(fresh), grads[2:])
    assert not torch.allclose(fresh.detach(), straight.detach())


# ---------------------------------------------------------------- symmetry
def test_column_norms_steepest_direction_has_the_manifolds_symmetry():
    manifold = ColumnNorms(2.5)
    direction = DirectionUpdate(steepest_direction, manifold, solver={"steps": 5})  # (the declared table's 5 steps)
    for group in ("signed-column-permutation", "left-orthogonal"):
        assert check_equivariance(direction, group, (6, 4), seed=0, trials=20).verdict == "holds", group
    # negative control, for the right reason: left rotations preserve the manifold, the row-norm
    # dualizer does not commute with them
    rows = DirectionUpdate(steepest_direction, manifold, solver={"norm": "row", "steps": 5})
    report = check_equivariance(rows, "left-orthogonal", (6, 4), seed=0, trials=20)
    assert report.verdict == "violated" and "does not preserve" not in report.message()


def test_generalized_stiefel_steps_are_right_orthogonal():
    # W -> W Q^T keeps W^T B W = I (Q I Q^T = I); whole ManifoldMuon steps must commute with it
    manifold = GeneralizedStiefel(GS_B)
    steps = OptimizerUpdate(lambda ps: ManifoldMuon(ps, manifold=manifold, lr=0.05, compute_dtype=None),
                            manifold=manifold, steps=2)
    assert check_equivariance(steps, "right-orthogonal", (6, 4), seed=0, trials=20).verdict == "holds"
    # negative control: the column-norm dualizer mixes with right rotations (which keep the manifold)
    columns = DirectionUpdate(steepest_direction, manifold, solver={"norm": "column", "steps": 5})
    report = check_equivariance(columns, "right-orthogonal", (6, 4), seed=0, trials=20)
    assert report.verdict == "violated" and "does not preserve" not in report.message()
