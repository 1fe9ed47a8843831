r"""The contract every matrix manifold must satisfy, runnable on a user's manifold in one call.

```python
from geomuon.theory.contracts import check_manifold_contract
report = check_manifold_contract(MyManifold(), (64, 32))   # raises AssertionError on failure
print(report)
```

Every check measures a dimensionless residual and compares it with a tolerance derived
from the dtype under test (:func:`default_tolerance`); the measurements themselves run in
float64, so a float32 manifold is judged on its own round-off, not on the checker's.

Distances to the manifold and to tangent spaces are measured through the manifold's own
constraint: the normal component of $v$ at $x$ is $N_x v = L_x^*(L_xL_x^*)^{-1}L_xv$, and
the first-order distance of $x$ to $M = \{F = 0\}$ is the Gauss–Newton step
$\|L_x^*(L_xL_x^*)^{-1}F(x)\|$, taken together with the part of $F(x)$ that step cannot
remove, relative to the scale of $F$'s terms, by the checks that points lie on $M$ (where the
normal space degenerates the step vanishes while $F(x) \ne 0$). A manifold without
``defining_map`` is measured by $\|\operatorname{projx}(x) - x\|$ instead.
"""

from __future__ import annotations

import itertools
import math
import numbers
import types
from dataclasses import dataclass, field

import torch

from geomuon.manifolds.base import MatrixManifold
from geomuon.manifolds.linalg import as_positive, check_count

__all__ = [
    "ContractCheck",
    "ContractReport",
    "check_manifold_contract",
    "default_tolerance",
    "manifold_residual",
    "normal_component",
    "retraction_slope",
]

#: Scales of the Gaussian matrices ``projx`` must bring onto $M$: 10 times closer to and farther
#: from the origin. Not the scales where a float32 sum of squares over- or underflows
#: ($\sim10^{\pm20}$, which a naive $x/\|x\|$ turns into zeros): the base class's own generic
#: Gauss–Newton ``projx`` halves the distance per step from afar and leaves $M$ already at
#: $10^{4}$ and $10^{-5}$ for a generalized Stiefel manifold, so the contract would refuse
#: manifolds built as the tutorial shows.
PROJX_SCALES = (0.1, 10.0)

#: Step $t$ (relative to $\|x\|/\|v\|$) and bound of the float64 central differences: of
#: ``defining_map`` against ``constraint``, and of $dR_x(0) = \mathrm{id}$, where
#: $\frac{R_x(tv) - R_x(-tv)}{2t} - v$ is
#: $\tfrac{t^2}{6}R^{(3)}[v, v, v]$ (relative size $t^2\|v\|^2\kappa^2 \approx 10^{-8}$ for
#: curvature $\kappa \sim 1/\|x\|$ and $\|v\| = \|x\|$) plus round-off $\varepsilon/t \approx 10^{-12}$;
#: the bound $10^{-6}$ sits two orders above both and catches $dR_x(0) = (1 + \delta)\,\mathrm{id}$
#: for $\delta \ge 10^{-6}$ (the log-log slope alone passes $\delta = 10^{-5}$ in float64 and
#: $10^{-3}$ in float32: $\delta t$ hides under $t^2$ over its range of $t$).
CENTRAL_DIFFERENCE_STEP, CENTRAL_DIFFERENCE_BOUND = 1e-4, 1e-6

#: The factor $c$ of the scaled point $cx$ the contract retracts from and checks the Gram form
#: at: what weight decay makes of a point of $M$ before ManifoldMuon's step, $W \leftarrow cW$
#: ($c = 1 - \text{lr}\cdot\text{weight\_decay}$; 0.7 is far past a usual decay, so that a map
#: right only on $M$ is off by an order-one residual, not by round-off).
DECAYED_SCALE = 0.7

#: Smallest accepted log-log slope of $\|R_x(tv) - (x + tv)\|$ against $t$ (2 in theory).
MIN_RETRACTION_SLOPE = 1.9


def default_tolerance(dtype: torch.dtype) -> float:
    """Contract tolerance for relative residuals: 1e-10 in float64, 1e-5 in float32.

    A relative residual of a correct map is its round-off, about $\\varepsilon\\sqrt{mn}$
    ($\\varepsilon$ = ``torch.finfo(dtype).eps``; Frobenius sums of $mn$ rounded terms).
    float64: $10^{-10} \\approx 4.5\\cdot10^{5}\\,\\varepsilon$, above $\\varepsilon\\sqrt{mn}$ for any
    $mn < 2\\cdot10^{11}$. float32: $10^{-5} \\approx 84\\,\\varepsilon$,
    above $\\varepsilon\\sqrt{mn}$ for $mn < 84^2 \\approx 7000$ (a 64x64 matrix is at the edge:
    test a float32 manifold on shapes of that order or smaller, as the test suite does). Both
    are far below any real defect (a wrong formula gives residuals of order 1).
    """
    if dtype == torch.float64:
        return 1e-10
    if dtype == torch.float32:
        return 1e-5
    raise ValueError(f"the manifold contract runs in float32 or float64, got {dtype}")


def _validated_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple ``(..., m, n)`` of ints, each a whole number >= 0 (:func:`check_count`,
    which names it ``shape[i]``), batch sizes >= 1, or a ``ValueError`` saying what is wrong with
    it (an int had raised "'int' object is not iterable", 2.5 became 2, and a batch size of 0
    crashed in ``gram_solve`` with "cannot reshape tensor of 0 elements": an empty batch holds no
    matrix to check). A matrix size of 0 passes: whether the manifold takes an empty matrix is its
    own ``shape_problem``'s to say."""
    where = "check_manifold_contract"
    sizes = () if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__") else tuple(shape)
    if len(sizes) < 2:
        raise ValueError(f"{where}: shape must be a tuple (..., m, n) of at least two whole numbers, got {shape!r}")
    return tuple(int(check_count(where, f"shape[{i}]", size, least=1 if i < len(sizes) - 2 else 0))
                 for i, size in enumerate(sizes))


#: The seeds ``torch.Generator.manual_seed`` takes (a 64-bit word, negative ones wrapped).
SEED_RANGE = (-(2**63), 2**64)


def _validated_options(dtype, seed, tol) -> float:
    """The contract's tolerance, ``tol`` or :func:`default_tolerance` of ``dtype``, after refusing
    (``ValueError`` naming the parameter; ``TypeError`` for a ``tol`` that is no number) a
    ``dtype`` other than float32/float64, a ``seed`` that is not a whole number in
    :data:`SEED_RANGE` (1.5 and $2^{70}$ had raised inside ``manual_seed``, naming no parameter)
    and a ``tol`` that is not a finite number > 0 (NaN had failed every check against a bound
    printed as nan, a negative one raised "math domain error" after the whole run, a string a
    ``TypeError`` at the first comparison), all before any method of the manifold runs."""
    where = "check_manifold_contract"
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{where}: dtype must be torch.float32 or torch.float64, got {dtype!r}")
    whole = isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
    if not (whole and SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise ValueError(f"{where}: seed must be a whole number in [-2**63, 2**64), got {seed!r}")
    return default_tolerance(dtype) if tol is None else as_positive(where, "tol", tol)


def _matrix_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm(dim=(-2, -1))


def normal_component(manifold: MatrixManifold, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""$N_xv = L_x^*(L_xL_x^*)^{-1}L_xv$, the component of ``v`` normal to $T_xM$, in float64."""
    x, v = x.double(), v.double()
    batch = torch.broadcast_shapes(x.shape[:-2], v.shape[:-2])
    x, v = x.expand(*batch, *x.shape[-2:]), v.expand(*batch, *v.shape[-2:])
    return manifold.constraint_adjoint(x, manifold.gram_solve(x, manifold.constraint(x, v)))


def manifold_residual(manifold: MatrixManifold, x: torch.Tensor) -> float:
    r"""Relative distance of ``x`` to the manifold, largest over the batch, measured in float64.

    $\|L_x^*(L_xL_x^*)^{-1}F(x)\| / \|x\|$ (the first Gauss–Newton step) when the manifold
    has a ``defining_map``, else $\|\operatorname{projx}(x) - x\| / \|x\|$. First order: where
    the normal space degenerates it cannot see $F(x) \ne 0$ (the contract's checks that points lie
    on $M$ measure that part of $F(x)$ too).
    """
    x = x.detach().double()
    offset = _gauss_newton_step(manifold, x)[1] if manifold.has_defining_map else manifold.projx(x) - x
    return float((_matrix_norm(offset) / _matrix_norm(x).clamp_min(1e-300)).max())


def _gauss_newton_step(manifold: MatrixManifold, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""$(F(x), L_x^*\Lambda)$ with $\Lambda = (L_xL_x^*)^{-1}F(x)$, at a float64 ``x`` (``ValueError``
    naming ``defining_map`` where $F(x)$ is not shaped as ``constraint``'s multiplier)."""
    manifold._check_defining_map(x)
    residual = manifold.defining_map(x)
    return residual, manifold.constraint_adjoint(x, manifold.gram_solve(x, residual))


def _off_manifold(manifold: MatrixManifold, x: torch.Tensor) -> float:
    r"""What the contract's ``*_on_manifold`` checks measure (float64, largest over the batch):
    :func:`manifold_residual`, and with a ``defining_map`` the part of $F(x)$ its Gauss–Newton
    step cannot remove, relative to the scale of $F$'s terms,

    $$\frac{\|F(x) - L_xL_x^*\Lambda\|}{\|L_x(x)\| + \|F(0)\|},\qquad \Lambda = (L_xL_x^*)^{-1}F(x)$$

    (for $F = q - F(0)$ with $q$ homogeneous of degree $k$, $L_x(x) = k\,q(x)$: round-off, about
    $\varepsilon$, at a point of $M$, and 0 wherever $F(x)$ lies in the range of $L_x$). Where the
    normal space degenerates $F(x)$ leaves that range and the step vanishes with it: the step
    alone had passed ``random``, ``projx`` and ``retr`` of a generalized Stiefel manifold on a
    wide $4\times6$ shape ($x^\top Bx = I_6$ has no solution: rank 4) at $10^{-17}$, its points
    26% off $M$ by $|F|$."""
    if not manifold.has_defining_map:
        return manifold_residual(manifold, x)
    x = x.detach().double()
    residual, step = _gauss_newton_step(manifold, x)

    def size(multiplier):  # per matrix, [*batch]
        return MatrixManifold._flat_multiplier(multiplier.double(), x).norm(dim=-1)

    unreachable = size(residual - manifold.constraint(x, step))
    scale = size(manifold.constraint(x, x)) + size(manifold.defining_map(torch.zeros_like(x)))
    distances = torch.maximum(_matrix_norm(step) / _matrix_norm(x).clamp_min(1e-300),
                              unreachable / scale.clamp_min(1e-300))
    return float(distances.max())


def _float64_point_and_tangent(manifold: MatrixManifold, x: torch.Tensor, direction: torch.Tensor):
    r"""``(projx(x), v)`` in float64, $v = P_x(\text{direction})$ scaled to $\|v\| = \|x\|$ per
    matrix: where the retraction's derivative is measured (the math of the retraction, as the
    capability checks test a form's; a float32 point is off $M$ by its round-off, which a
    difference quotient divides by $t$)."""
    x = manifold.projx(x.double())
    v = manifold.proju(x, direction.double())
    return x, v * (_matrix_norm(x) / _matrix_norm(v).clamp_min(1e-300))[..., None, None]


def _retraction_derivative_error(manifold: MatrixManifold, x: torch.Tensor, v: torch.Tensor) -> float:
    r"""Relative error of the central difference $\frac{R_x(tv) - R_x(-tv)}{2t}$ against $v$,
    largest over the batch, at $t$ = :data:`CENTRAL_DIFFERENCE_STEP` (float64 ``x``, tangent
    ``v`` of norm $\|x\|$: :func:`_float64_point_and_tangent`)."""
    t = CENTRAL_DIFFERENCE_STEP
    slope = (manifold.retr(x, t * v).double() - manifold.retr(x, -t * v).double()) / (2 * t)
    return float((_matrix_norm(slope - v) / _matrix_norm(v).clamp_min(1e-300)).max())


def retraction_slope(
    manifold: MatrixManifold, x: torch.Tensor, v: torch.Tensor, ts: torch.Tensor
) -> tuple[float, list[float]]:
    r"""Log-log slope of $e(t) = \|R_x(tv) - (x + tv)\| / \|x\|$ over the step sizes ``ts``.

    A retraction agrees with $x + tv$ to first order, so $e(t) = O(t^2)$ and the slope
    (least squares over ``ts``, worst matrix of the batch) is about 2. An affine
    retraction ($e \equiv 0$ up to round-off) returns ``inf``.

    Returns:
        ``(slope, errors)`` with the largest error over the batch at each ``t``.
    """
    errors = []
    for t in ts.tolist():
        step = manifold.retr(x, t * v).double()
        errors.append(_matrix_norm(step - (x.double() + t * v.double())) / _matrix_norm(x.double()))
    errors = torch.stack(errors, dim=-1)  # [..., len(ts)]
    worst = errors.reshape(-1, len(ts)).max(dim=0).values.tolist()
    if max(worst) <= 64 * torch.finfo(x.dtype).eps:
        return math.inf, worst
    log_t = ts.double().log()
    log_e = errors.clamp_min(1e-300).log()
    centered_t = log_t - log_t.mean()
    covariance = ((log_e - log_e.mean(-1, keepdim=True)) * centered_t).sum(-1)
    slopes = covariance / centered_t.square().sum()
    return float(slopes.min()), worst


@dataclass
class ContractCheck:
    """One measured property: ``value`` against ``bound`` (``passed`` says which way)."""

    name: str
    value: float
    bound: float
    passed: bool
    note: str = ""

    def __str__(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        return f"{status} {self.name:28s} {self.value:10.3e}  (bound {self.bound:.1e}) {self.note}"


@dataclass
class ContractReport:
    """The outcome of :func:`check_manifold_contract`: one :class:`ContractCheck` per property."""

    manifold: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    checks: list[ContractCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> list[ContractCheck]:
        return [check for check in self.checks if not check.passed]

    def __getitem__(self, name: str) -> ContractCheck:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def __str__(self) -> str:
        head = f"manifold contract: {self.manifold} on {self.shape} in {self.dtype}"
        return "\n".join([head] + [f"  {check}" for check in self.checks])


def check_manifold_contract(
    manifold: MatrixManifold,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    tol: float | None = None,
    raise_on_failure: bool = True,
) -> ContractReport:
    r"""Run the manifold contract on points of ``shape`` in ``dtype``.

    Checks (each a relative residual $\le$ ``tol`` unless said otherwise):

    * ``random`` lands on $M$ with the requested shape and dtype, and passes the manifold's own
      ``check_point_on_manifold`` (what an optimizer asks of its weights);
    * ``projx`` lands on $M$ and fixes points of $M$;
    * ``proju`` lands in $T_xM$, is idempotent and self-adjoint, and equals the projection
      derived from ``constraint``/``constraint_adjoint`` (:meth:`MatrixManifold.proju`);
    * ``constraint_adjoint`` is the adjoint of ``constraint``; ``constraint_gram_diag``
      (when given) is the diagonal of $L_xL_x^*$ on its range; ``defining_map`` (when
      given) has derivative ``constraint`` (central differences, bound $10^{-6}$:
      truncation $h^2 = 10^{-8}$ times the curvature, round-off $\varepsilon/h$);
    * ``retr(x, 0) = x``; ``retr`` lands on $M$ for steps of 0.1, 0.5 and 2 times $\|x\|$, and
      from the scaled point $0.7x$ (:data:`DECAYED_SCALE`, what weight decay makes of $x$
      before ManifoldMuon retracts) for a tangent step of $0.1\|x\|$ (``retr`` must project
      onto $M$, not assume its point on it);
      $\|R_x(tv) - (x + tv)\|$ shrinks like $t^2$ (log-log slope $\ge 1.9$, in float32 also
      over the float64 math at float64's steps); $dR_x(0) = \mathrm{id}$ by a float64 central
      difference (bound $10^{-6}$, :data:`CENTRAL_DIFFERENCE_BOUND`); ``transp``
      lands in the new tangent space and is the identity from $x$ to $x$;
    * ``inner`` is symmetric on tangent vectors and ``inner(x, u)`` is ``inner(x, u, u)``;
    * ``projx`` lands on $M$ also from a point 10 times closer to and farther from the
      origin; ``egrad2rgrad`` is the gradient of the manifold's ``inner``:
      $\langle\text{egrad2rgrad}(x, u), w\rangle_x = \langle u, w\rangle$ for tangent $w$,
      and tangent itself;
    * every method leaves its input tensors as they were, points and vectors (a ``proju`` that
      wrote into its argument had turned the self-adjointness check into a comparison of a
      result with itself), given a Gaussian vector and the scaled point $0.7x$ where they take
      any, and returns the dtype it was given;
    * the declared capabilities agree with the maps (float64): a ``gram_form``'s
      projection, constraint, adjoint and diagonal with the manifold's own, at $x$ and at
      $0.7x$ (a point scaled by weight decay), its retraction on $M$ and first order, its
      ``diagonal_gram`` with $x^\top x$ being diagonal, its optimizer defaults (step and round counts,
      ``newton_alpha``, ``polish_method``) with what ManifoldMuon accepts; a ``dualizer_keeps_tangent`` with the
      declared norms' dualizers of $P_xG$ (msign for the spectral norm) being tangent;
    * geoopt interop: a ``geoopt.ManifoldParameter`` stepped by
      ``geoopt.optim.RiemannianSGD`` (momentum) stays on $M$.

    One call tests one shape: run it on tall, square, wide and batched shapes (a method
    right only for tall matrices passes a tall shape). A failure's message says what the
    failed property asks of which method (:data:`WHAT_TO_FIX`).

    Args:
        manifold: the manifold under test.
        shape: ``(..., m, n)`` of the points: ints, ``m, n >= 0`` and batch sizes ``>= 1``
            (else ``ValueError``).
        dtype: float64 (tolerance $10^{-10}$) or float32 ($10^{-5}$); another dtype is a
            ``ValueError``.
        seed: seeds every random draw (a private ``torch.Generator``): an int in
            $[-2^{63}, 2^{64})$ (else ``ValueError``).
        tol: override of :func:`default_tolerance`, a finite number $> 0$ (else ``ValueError``
            or, for a non-number, ``TypeError``).
        raise_on_failure: raise ``AssertionError`` listing the failed checks.

    Returns:
        The :class:`ContractReport`.
    """
    if not isinstance(manifold, MatrixManifold):
        raise TypeError(
            "check_manifold_contract: expected a geomuon.manifolds.MatrixManifold, got "
            f"{type(manifold).__name__}"
        )
    tol = _validated_options(dtype, seed, tol)
    shape = _validated_shape(shape)
    generator = torch.Generator().manual_seed(seed)
    report = ContractReport(f"{type(manifold).__name__}({manifold.extra_repr()})", shape, dtype)

    def record(name, value, bound=tol, *, at_least=False, note=""):
        passed = value >= bound if at_least else value <= bound
        report.checks.append(ContractCheck(name, float(value), bound, bool(passed), note))

    def gaussian():
        return torch.randn(shape, dtype=dtype, generator=generator)

    def rel(a, b):
        return float((_matrix_norm(a.double()) / _matrix_norm(b.double()).clamp_min(1e-300)).max())

    def inner(a, b):
        return (a.double() * b.double()).sum(dim=(-2, -1))

    x = manifold.random(*shape, dtype=dtype, generator=generator)
    same_kind = tuple(x.shape) == shape and x.dtype == dtype
    record("random_shape_dtype", 0.0 if same_kind else 1.0, 0.0,
           note="" if same_kind else f"got {tuple(x.shape)} {x.dtype}")
    record("random_on_manifold", _off_manifold(manifold, x))
    own = bool(manifold.check_point_on_manifold(x))  # what an optimizer's first step asks of its weights
    record("random_passes_own_check", 0.0 if own else 1.0, 0.0)

    record("projx_on_manifold", _off_manifold(manifold, manifold.projx(gaussian())))
    record("projx_fixes_points", rel(manifold.projx(x) - x, x))

    scaled = [manifold.projx(scale * gaussian()) for scale in PROJX_SCALES]
    record("projx_on_manifold_far_and_near", max(_off_manifold(manifold, y) for y in scaled))

    u, v = gaussian(), gaussian()
    pu, pv = manifold.proju(x, u.clone()), manifold.proju(x, v.clone())
    record("proju_tangent", rel(normal_component(manifold, x, pu), u))
    record("proju_idempotent", rel(manifold.proju(x, pu) - pu, u))
    uv_norms = _matrix_norm(u.double()) * _matrix_norm(v.double())
    asym = (inner(pu, v) - inner(u, pv)).abs() / uv_norms
    record("proju_self_adjoint", float(asym.max()))
    record("proju_matches_constraint", rel(pu - MatrixManifold.proju(manifold, x, u), u))

    batch = shape[:-2]

    def flat(t):  # multiplier-shaped -> [*batch, p] in float64
        return t.double().reshape(*batch, -1)

    lu = manifold.constraint(x, u)
    if lu.numel() > 0:
        lam = torch.randn(lu.shape, dtype=dtype, generator=generator)
        adj = manifold.constraint_adjoint(x, lam)
        pairing = (flat(lu) * flat(lam)).sum(-1) - inner(u, adj)
        scale = (
            flat(lu).norm(dim=-1) * flat(lam).norm(dim=-1)
            + _matrix_norm(u.double()) * _matrix_norm(adj.double())
        )
        # (both terms vanish where L_x is identically 0: DGram with one column)
        record("constraint_adjoint", float((pairing.abs() / scale.clamp_min(1e-300)).max()))
        diag = manifold.constraint_gram_diag(x)
        if diag is not None:
            in_range = manifold.constraint(x, v)
            gram = manifold.constraint(x, manifold.constraint_adjoint(x, in_range))
            mismatch = flat(gram) - flat(diag.expand_as(in_range)) * flat(in_range)
            ratio = mismatch.norm(dim=-1) / flat(gram).norm(dim=-1).clamp_min(1e-300)
            record("constraint_gram_diag", float(ratio.max()))
    if manifold.has_defining_map:
        # A generic (not tangent) direction, so that a wrong normal part of L is caught.
        x64, u64 = x.double(), u.double()
        h = CENTRAL_DIFFERENCE_STEP * float(_matrix_norm(x64).max() / _matrix_norm(u64).max())
        forward = manifold.defining_map(x64 + h * u64)
        central = (forward - manifold.defining_map(x64 - h * u64)) / (2 * h)
        direct = manifold.constraint(x64, u64)
        error = float((central - direct).norm()) / (float(direct.norm()) + 1e-300)
        record("defining_map_derivative", error, CENTRAL_DIFFERENCE_BOUND)

    record("retr_zero", rel(manifold.retr(x, torch.zeros_like(x)) - x, x))
    direction = pu * (_matrix_norm(x) / _matrix_norm(pu).clamp_min(1e-30))[..., None, None]
    far = manifold.retr(x, 0.5 * direction)
    # steps of different lengths across a batch: a retraction that mixes the matrices of a
    # batch (a norm taken over all of them) lands off M only when they differ
    matrices = math.prod(batch)
    # (never exactly 1 times a scale: a 1x1 point stepped by -x lands on the origin)
    spread = (torch.linspace(0.6, 1.4, matrices, dtype=dtype) if matrices > 1 else torch.ones(1, dtype=dtype)
              ).reshape(*batch, 1, 1)  # (linspace of one point is its start: a single matrix keeps its step)
    stepped = [manifold.retr(x, scale * spread * direction) for scale in (0.1, 0.5, 2.0)]
    record("retr_on_manifold", max(_off_manifold(manifold, y) for y in stepped))
    # ManifoldMuon's general path decays first, W <- cW, and retracts from cW along a direction
    # tangent there: a retraction right only from points of M (a sphere's (x + u) / sqrt(1 + |u|^2))
    # had left |W| = 0.64 after 20 steps at weight_decay 0.5, lr 0.05, with no error
    decayed = DECAYED_SCALE * x
    decayed_direction = manifold.proju(decayed, pu)
    decayed_direction = decayed_direction * (_matrix_norm(x) / _matrix_norm(decayed_direction).clamp_min(1e-30)
                                             )[..., None, None]
    from_decayed = manifold.retr(decayed, 0.1 * decayed_direction)
    record("retr_from_scaled_point", _off_manifold(manifold, from_decayed))
    ts = torch.logspace(-4, -2, 5) if dtype == torch.float64 else torch.logspace(-2, -1, 5)
    slope, errors = retraction_slope(manifold, x, direction, ts)
    x64, v64 = _float64_point_and_tangent(manifold, x, direction)
    if dtype != torch.float64:
        # float32's steps (1e-2..1e-1) let t^2 hide a first-order error 1e-3 t: the float64 math at
        # float64's steps as well (the dtype's own run still sees a float32-only defect)
        slope = min(slope, retraction_slope(manifold, x64, v64, torch.logspace(-4, -2, 5))[0])
    record("retr_slope", slope, MIN_RETRACTION_SLOPE, at_least=True,
           note="affine retraction (exact)" if math.isinf(slope) else
           f"errors {errors[0]:.1e}..{errors[-1]:.1e}")
    record("retr_derivative", _retraction_derivative_error(manifold, x64, v64), CENTRAL_DIFFERENCE_BOUND)
    transported = manifold.transp(x, far, pv.clone())
    record("transp_tangent", rel(normal_component(manifold, far, transported), pv))
    record("transp_identity", rel(manifold.transp(x, x, pv.clone()) - pv, pv))

    def metric(a, b=None):
        return torch.as_tensor(manifold.inner(x, a, b)).double()

    # a metric is symmetric, and inner(x, u) (the squared norm RiemannianAdam reads) is inner(x, u, u)
    record("inner_symmetric", float(((metric(pu, pv) - metric(pv, pu)).abs() / uv_norms).max()))
    record("inner_norm_matches", float(((metric(pu) - metric(pu, pu)).abs()
                                        / _matrix_norm(u.double()).square()).max()))
    rgrad = manifold.egrad2rgrad(x, u.clone())
    record("egrad2rgrad_tangent", rel(normal_component(manifold, x, rgrad), u))
    record("egrad2rgrad_is_gradient", float(((metric(rgrad, pv) - inner(u, pv)).abs() / uv_norms).max()))

    # The tensors each method is given, by parameter: every one is checked, the point too (a
    # proju normalising x in place had passed, and rescales the weights ManifoldMuon hands it),
    # each of the dtype under test (a retyping proju had also been blamed on the methods fed its
    # output). The vector is a Gaussian where any matrix is an argument: a tangent one has a
    # normal part of round-off, which an in-place projection left bit for bit as it was (an
    # egrad2rgrad writing into its argument had passed in float32). The point is the decayed 0.7x
    # where ManifoldMuon calls the method: an in-place normalisation leaves a point of M as it is.
    # ((re)scaled here: the checks above may have handed `decayed` to a method that rescaled it)
    arguments = {"projx": {"x": u}, "proju": {"x": DECAYED_SCALE * x, "u": u},
                 "egrad2rgrad": {"x": DECAYED_SCALE * x, "u": u},
                 "retr": {"x": DECAYED_SCALE * x, "u": 0.1 * decayed_direction},
                 "transp": {"x": x, "y": far, "v": 0.1 * direction}}
    written, retyped = [], []
    for name, given in arguments.items():
        given = {key: value.to(dtype).clone() for key, value in given.items()}
        kept = {key: value.clone() for key, value in given.items()}
        out = getattr(manifold, name)(*given.values())
        changed = [key for key in given if not torch.equal(given[key], kept[key])]
        if changed:
            written.append(f"{name} ({', '.join(changed)})")
        if out.dtype != dtype:
            retyped.append(f"{name} -> {out.dtype}")
    record("methods_leave_their_inputs", float(len(written)), 0.0, note=", ".join(written))
    record("methods_keep_the_dtype", float(len(retyped)), 0.0, note=", ".join(retyped))
    _check_capabilities(manifold, x, gaussian(), record)

    geoopt_point = _geoopt_steps(manifold, x, gaussian())
    record("geoopt_sgd_on_manifold", _off_manifold(manifold, geoopt_point))
    produced = [manifold.projx(gaussian()), *scaled, *stepped, from_decayed, geoopt_point]
    _check_own_checks(manifold, x, gaussian(), produced, tol, record)

    if raise_on_failure and not report.passed:
        failed = ", ".join(check.name for check in report.failures)
        fixes = "\n".join(f"  {check.name}: {WHAT_TO_FIX.get(check.name, '')}" for check in report.failures)
        raise AssertionError(f"manifold contract failed ({failed})\n{report}\nwhat to fix:\n{fixes}")
    return report


#: A failed check's name -> what it asks of which method (in the failure's message).
WHAT_TO_FIX = {
    "random_shape_dtype": "random(*shape, dtype=...) must return that shape and dtype",
    "random_on_manifold": "random must return points of M (projx of a Gaussian, by default)",
    "projx_on_manifold": "projx must land on M; the derived projx (Gauss-Newton on defining_map) may need "
                         "more newton_steps, or the manifold its own closed form",
    "projx_on_manifold_far_and_near": "projx must land on M from points 10 times closer to and farther from the "
                                      "origin than a Gaussian, not only from Gaussian ones",
    "projx_fixes_points": "projx must leave points of M where they are",
    "proju_tangent": "proju(x, u) must satisfy constraint(x, proju(x, u)) = 0",
    "proju_idempotent": "proju applied twice must equal proju once",
    "proju_self_adjoint": "proju must be the orthogonal projection: <P u, v> = <u, P v>",
    "proju_matches_constraint": "proju must equal u - L*(LL*)^-1 L u from constraint and constraint_adjoint",
    "constraint_adjoint": "constraint_adjoint must be the adjoint of constraint: <L u, lam> = <u, L* lam>",
    "constraint_gram_diag": "constraint_gram_diag must be the diagonal of L L* (or return None)",
    "defining_map_derivative": "constraint must be the derivative of defining_map",
    "retr_zero": "retr(x, 0) must return x",
    "retr_on_manifold": "retr must land on M for short and long steps",
    "retr_from_scaled_point": "retr(0.7x, u) must land on M: ManifoldMuon's weight decay scales the point (W <- cW) "
                              "before it retracts, so retr must project whatever point it starts from (e.g. "
                              "projx(x + u)), not assume x on M (or do not use weight decay with this manifold)",
    "retr_derivative": "retr's derivative at 0 must be the identity: (R_x(tv) - R_x(-tv)) / 2t -> v (float64)",
    "inner_symmetric": "inner(x, u, v) must equal inner(x, v, u) (a metric is symmetric)",
    "inner_norm_matches": "inner(x, u) must be the squared norm inner(x, u, u), what geoopt's optimizers read",
    "retr_slope": "retr's derivative at 0 must be the identity: R_x(tv) = x + tv + O(t^2)",
    "transp_tangent": "transp(x, y, v) must return a tangent vector at y",
    "transp_identity": "transp(x, x, v) must return v for a tangent v at x",
    "egrad2rgrad_tangent": "egrad2rgrad must return a tangent vector",
    "egrad2rgrad_is_gradient": "egrad2rgrad must be the Riemannian gradient of inner: inner(x, egrad2rgrad(x, u), w) "
                               "= <u, w> for tangent w (the embedded metric: proju)",
    "methods_leave_their_inputs": "these methods wrote into the arguments named in parentheses (the point x, y or "
                                  "the vector): compute out of place",
    "methods_keep_the_dtype": "these methods changed the dtype: return the input's",
    "gram_form_matches": "the declared gram_form's project/constraint/adjoint/gram_diag disagree with the manifold's "
                         "maps (at x or at a scaled 0.7x): fix the form or declare none",
    "gram_form_settings": "the declared gram_form's optimizer defaults (class attributes of GramForm) must be "
                          "valid: whole step and round counts >= 0, retraction_order >= 1, newton_alpha in (0, "
                          "MAX_DUAL_ALPHA], a polish_method of geomuon.manifolds.capabilities.POLISH_METHODS (the note "
                          "names each bad one)",
    "gram_retraction_on_manifold": "the declared gram_form's retraction_factor must land on M",
    "gram_retraction_slope": "the declared gram_form's retraction must be first order: R_W(tV) = W + tV + O(t^2)",
    "gram_newton_matches": "the declared gram_form's Newton step disagrees with its definition: newton_operator must "
                           "be C(D S(lam) P), newton_diagonal its diagonal on the basis C(E_ij), and S(newton_increment"
                           "(D, E)) = E; fix them or declare newton_cg_steps = 0 and has_newton = False",
    "gram_series_covers": "the declared gram_form's series_covers vouches for steps its series alone does not retract "
                          "to the dtype's precision (the engine then drops the exact branch): tighten it, or return "
                          "False",
    "dualizer_keeps_tangent": "dualizer_keeps_tangent says the norm's dualizer of P_x G (msign for the spectral "
                              "norm) is tangent at x, and it is not (the note names the norm): return False for it",
    "gram_form_diagonal_gram": "the gram_form declares diagonal_gram, and W^T W is not diagonal on M: the engine "
                               "would read D from the column norms alone; set diagonal_gram = False",
    "random_passes_own_check": "random() gives points the manifold's own check_point_on_manifold refuses (an "
                               "optimizer refuses them at its first step): make points_on_manifold scale-aware",
    "geoopt_sgd_on_manifold": "geoopt's RiemannianSGD left M: check egrad2rgrad, retr and transp",
    "points_pass_own_check": "check_point_on_manifold refuses points the other maps produced (projx, retr, geoopt "
                             "steps), at sqrt(tol): either those maps leave M where the Gauss-Newton residual "
                             "cannot see it (a zero matrix), or the check is too strict",
    "own_checks_refuse_normal_offsets": "check_point_on_manifold accepted a point moved off M along a normal by a "
                                        "tenth of its norm, or check_vector_on_tangent a normal vector: an optimizer "
                                        "would step such weights (make the checks test F(x) = 0 and L_x(u) = 0)",
}


def _check_capabilities(manifold: MatrixManifold, x: torch.Tensor, g: torch.Tensor, record) -> None:
    """The declared capabilities against the manifold's maps, in float64 (see
    :func:`check_manifold_contract`); a manifold declaring none records nothing."""
    from geomuon.manifolds.capabilities import gram_retraction

    from geomuon.optimizers.steepest import NORMS

    tol = default_tolerance(torch.float64)
    # the math of the declarations, on a float64 point of M (a float32 point is off M by its
    # round-off, which a form's exact identities would see)
    x, g = manifold.projx(x.double()), g.double()
    form = getattr(manifold, "gram_form", None)
    if form is not None:
        invalid = form.invalid_defaults()
        record("gram_form_settings", float(len(invalid)), 0.0, note="; ".join(invalid))
        flip = manifold.transposes_wide and x.size(-2) < x.size(-1)
        W0, X = (x.mT, g.mT) if flip else (x, g)
        shapes = tuple(form.constraint(W0.mT @ X).shape), tuple(manifold.constraint(W0, X).shape)
        if shapes[0] != shapes[1]:  # (broadcasting had compared them, then the adjoint crashed)
            record("gram_form_matches", math.inf, tol, note=f"multiplier shape {shapes[0]} (form) against "
                                                           f"{shapes[1]} (manifold)")
        elif W0.size(-2) >= W0.size(-1):  # the form's maps are stated for tall points
            errors = []
            for W in (W0, DECAYED_SCALE * W0):
                D = W.mT @ W
                lam = form.constraint(W.mT @ X)
                errors += [
                    # (relative to X: where T_WM = {0}, a 1x1 Stiefel point, both projections are round-off)
                    _relative(X - W @ form.project(D, W.mT @ X), MatrixManifold.proju(manifold, W, X), scale=X),
                    _relative(lam, manifold.constraint(W, X)),
                    _relative(W @ form.adjoint(lam), manifold.constraint_adjoint(W, lam)),
                ]
                diag = manifold.constraint_gram_diag(W)
                if diag is not None:
                    errors.append(_relative(form.gram_diag(D).expand_as(lam) * lam, diag.expand_as(lam) * lam))
                if W is W0:  # the engine's Jacobi step divides by gram_diag whatever the manifold declares
                    errors.append(_relative(form.gram_diag(D).expand_as(lam) * lam,
                                            manifold.constraint(W, manifold.constraint_adjoint(W, lam))))
            record("gram_form_matches", max(errors), tol)
            if form.declares_newton:
                record("gram_newton_matches", _newton_mismatch(form, W0, X, torch.Generator().manual_seed(1)), tol)
            covered = _series_overreach(form, W0, MatrixManifold.proju(manifold, W0, X))
            if covered is not None:
                record("gram_series_covers", covered[0], 0.0, note=covered[1])
            if form.diagonal_gram:  # the engine then reads D from the column norms alone
                D = W0.mT @ W0
                off = D - torch.diag_embed(torch.diagonal(D, dim1=-2, dim2=-1))
                record("gram_form_diagonal_gram", float(off.norm() / D.norm().clamp_min(1e-300)), tol)
            V = MatrixManifold.proju(manifold, W0, X)
            V = V * (_matrix_norm(W0) / _matrix_norm(V).clamp_min(1e-300))[..., None, None]
            stepped = gram_retraction(form, W0, 0.3 * V)
            record("gram_retraction_on_manifold", _off_manifold(manifold, stepped.mT if flip else stepped), tol)
            shim = types.SimpleNamespace(retr=lambda W, step: gram_retraction(form, W, step))
            slope, _ = retraction_slope(shim, W0, V, torch.logspace(-4, -2, 5))
            record("gram_retraction_slope", slope, MIN_RETRACTION_SLOPE, at_least=True)
    declared = [name for name in NORMS if manifold.dualizer_keeps_tangent(x, name)]
    if declared:  # every norm an optimizer may ask about (it had been checked for the spectral one only)
        P = manifold.proju(x, g)
        normal = {name: float(normal_component(manifold, x, A).norm() / A.norm().clamp_min(1e-300))
                  for name, A in ((name, _exact_dualizer(name, P)) for name in declared)}
        worst = max(normal, key=normal.get)
        record("dualizer_keeps_tangent", normal[worst], tol, note=f"norms {', '.join(declared)}; worst {worst}")


#: Largest relative disagreement between two probe draws (:func:`_probed_diagonal_mismatch`) taken
#: as "the basis elements of one probe do not interact": what is left then errs every Rayleigh
#: quotient by about as much, 1% of the float64 contract tolerance $10^{-10}$; a valid probe
#: agrees to round-off, $\sim n\varepsilon \approx 10^{-14}$ at $n = 128$.
PROBE_AGREEMENT = 1e-12


def _newton_mismatch(form, W: torch.Tensor, X: torch.Tensor, generator: torch.Generator) -> float:
    r"""Largest relative error of a form's Newton declarations at the tall point ``W`` (float64):
    ``newton_operator`` against its definition $\mathcal C(D\,S(\Lambda)\,P)$ and
    ``newton_diagonal`` against the operator's Rayleigh quotients on the basis
    $\mathcal C(E_{ij})$ of its range (both where ``newton_cg_steps``; probes,
    :func:`_probed_diagonal_mismatch`, where they are exact, else every basis element,
    :func:`_basis_diagonal_mismatch`), ``newton_increment`` against $S(\text{increment}(E)) = E$
    (where ``has_newton``); $P$ symmetric positive definite, as $(Z^\top Z)^{-1/2}$ is. A wrong
    operator had crashed the first step (``eigh`` of a diverged dual).

    A transpose-invariant $\mathcal C$, $\mathcal C(M^\top) = \mathcal C(M)$ (Stiefel's, DGram's;
    tested on a random $M$, which a nonzero linear $\mathcal C(M^\top) - \mathcal C(M)$ fails with
    probability 1), has $\mathcal C(E_{ji}) = \mathcal C(E_{ij})$: half the basis serves."""
    batch, n = W.shape[:-2], W.size(-1)
    D = W.mT @ W
    Z = torch.randn(*batch, n, n, dtype=W.dtype, generator=generator)
    P = torch.linalg.matrix_exp(-0.5 * (Z + Z.mT) / math.sqrt(n))  # symmetric positive definite
    lam = form.constraint(W.mT @ X)
    errors = []
    if form.newton_cg_steps > 0:
        errors.append(_relative(form.newton_operator(D, lam, P), form.constraint(D @ form.adjoint(lam) @ P)))
        declared = form.newton_diagonal(D, P).expand_as(lam)
        symmetric = torch.equal(form.constraint(Z), form.constraint(Z.mT))
        probed = _probed_diagonal_mismatch(form, D, P, declared, symmetric, generator)
        errors.append(_basis_diagonal_mismatch(form, D, P, declared, symmetric) if probed is None else probed)
    if form.has_newton:
        E = form.adjoint(lam)
        errors.append(_relative(form.adjoint(form.newton_increment(D, E)), E))
    return max(errors)


def _probed_diagonal_mismatch(form, D: torch.Tensor, P: torch.Tensor, declared: torch.Tensor, symmetric: bool,
                              generator: torch.Generator) -> float | None:
    r"""The Newton diagonal check of :func:`_newton_mismatch` by about $n$ probes, or ``None``
    where the probes cannot separate the basis elements (then every element is needed).

    A probe is $\Lambda = \mathcal C(Z)$, $Z = \sum_{(i,j) \in R} z_{ij}E_{ij}$ over one round $R$
    of a round-robin tournament on the indices (pairs with disjoint $\{i, j\}$, and one
    $(r, r)$): with $S = \mathcal C^*$, $\langle\mathcal C(E_{ij}), \mathcal A\Lambda\rangle =
    S(\mathcal A\Lambda)_{ij}$ and $\|\mathcal C(E_{ij})\|^2 z_{ij} = S(\Lambda)_{ij}$ where the
    elements of a round interact neither through $\mathcal A$ nor in their supports (a Gram form
    whose maps touch rows and columns $i, j$ only, at a diagonal $D$: Stiefel's, DGram's), so
    $q_{ij} = S(\mathcal A\Lambda)_{ij} / S(\Lambda)_{ij}$, and on the support of $\Lambda$ the entry
    $\mathcal C(q \odot Z) / \Lambda$ is the quotient of the element owning it. Two independent
    draws of $z$ (signs, magnitudes in $[1, 2]$) agree, to :data:`PROBE_AGREEMENT`, exactly
    when (with probability 1) no cross term is left. Every pair $\{i, j\}$ lies in one round of
    the $N = n$ (odd) or $n + 1$ (even) rounds; a $\mathcal C$ that is not transpose-invariant
    takes the rounds again with $E_{ji}$. Error: the largest $|d - q| / |q|$ over the support
    (per entry, where the basis check takes the norm over an element's entries: as strict or
    stricter). $2N$ or $4N$ applications of the operator to $n\times n$ multipliers, against
    $n^2$ (``[k, n, n]`` stacks) of the basis check: at $n = 128$, $O(n^4)$ against $O(n^5)$ work."""
    batch, n = D.shape[:-2], D.size(-1)
    rounds = n | 1
    r, t = torch.arange(rounds).unsqueeze(1), torch.arange(1, rounds // 2 + 1)
    first, second = (r + t) % rounds, (r - t) % rounds  # [rounds, (rounds - 1) / 2]: round r's pairs
    kept = (first < n) & (second < n)  # (the extra index of an even n sits the round out)
    pattern = torch.zeros(rounds, n, n, dtype=D.dtype)
    pattern[r.expand_as(first)[kept], first[kept], second[kept]] = 1.0
    diagonal = torch.arange(n)
    pattern[diagonal, diagonal, diagonal] = 1.0  # round r's (r, r): its index is in no pair there
    if not symmetric:  # E_ji in rounds of their own (the diagonal is in the first already)
        pattern = torch.cat([pattern, (pattern - torch.diag_embed(torch.diagonal(pattern, dim1=-2, dim2=-1))).mT])
    pattern = pattern.reshape(-1, *(1,) * len(batch), n, n)
    draws = torch.rand(2, *pattern.shape[:1], *batch, n, n, dtype=D.dtype, generator=generator)
    signs = torch.randint(0, 2, draws.shape, generator=generator).to(D.dtype) * 2 - 1
    Z = pattern * (1 + draws) * signs  # [2, rounds, *batch, n, n]
    probe = form.constraint(Z)
    paired, norms = form.adjoint(form.newton_operator(D, probe, P)), form.adjoint(probe)
    owned = (Z != 0) & (norms != 0)  # (an element C(E_ij) = 0 owns no entry: 0/0)
    quotient = torch.where(owned, paired / torch.where(owned, norms, 1), 0)
    support = probe != 0
    if not torch.equal(support[0], support[1]):
        return None
    support = support[0]
    if not bool(support.any()):
        return 0.0  # no multiplier anywhere: nothing declared to check
    entry = form.constraint(quotient * Z)[:, support] / probe[:, support]  # [2, entries of the support]
    if float(((entry[0] - entry[1]).abs() / entry[0].abs().clamp_min(1e-300)).max()) > PROBE_AGREEMENT:
        return None
    return float(((declared.expand_as(probe[0])[support] - entry[0]).abs() / entry[0].abs().clamp_min(1e-300)).max())


def _basis_diagonal_mismatch(form, D: torch.Tensor, P: torch.Tensor, declared: torch.Tensor,
                             symmetric: bool) -> float:
    r"""The Newton diagonal check of :func:`_newton_mismatch` on every basis element, for a form
    whose elements the probes cannot separate: the quotient of $B_{ij} = \mathcal C(E_{ij})$ is
    $q_{ij} = \langle B_{ij}, \mathcal A(B_{ij})\rangle / \|B_{ij}\|^2$, compared with the declared
    diagonal on the support of $B_{ij}$ (error $\|d - q_{ij}\| / \|q_{ij}\|$ there, every
    $(i, j)$ and batch entry seen; $j \ge i$ only for a transpose-invariant $\mathcal C$). The
    operator takes one row of the basis per call, a stack ``[k, *batch, n, n]`` (the form's
    maps broadcast over leading dimensions, as torch's do): $n$ calls, not $n^2$."""
    batch, n = D.shape[:-2], D.size(-1)

    def flat(t, leading=0):  # multiplier-shaped [*leading, *batch, ...] -> [*leading, *batch, p]
        return t.reshape(*t.shape[:leading + len(batch)], -1)

    declared = flat(declared)
    errors = [0.0]
    for i in range(n):
        first = i if symmetric else 0
        units = torch.zeros(n - first, n, n, dtype=D.dtype)
        units[:, i, first:] = torch.eye(n - first, dtype=D.dtype)  # units[j - first] = E_ij
        basis = form.constraint(units.reshape(n - first, *(1,) * len(batch), n, n).expand(-1, *batch, n, n))
        applied = flat(form.newton_operator(D, basis, P), 1)
        basis = flat(basis, 1)  # [k, *batch, p]
        support = basis != 0
        # (where B_ij vanishes in a batch entry its quotient is 0/0, outside the support)
        quotient = ((basis * applied).sum(-1) / basis.square().sum(-1).clamp_min(1e-300)).unsqueeze(-1)
        matrix_dims = tuple(range(1, basis.dim()))
        mismatch = torch.where(support, declared - quotient, 0).square().sum(matrix_dims).sqrt()
        size = torch.where(support, quotient, 0).square().sum(matrix_dims).sqrt()
        seen = support.flatten(1).any(-1)
        if bool(seen.any()):
            errors.append(float((mismatch / size.clamp_min(1e-300))[seen].max()))
    return max(errors)


def _series_overreach(form, W: torch.Tensor, V: torch.Tensor) -> tuple[float, str] | None:
    r"""Where a form's ``series_covers`` vouches for a step (:func:`~geomuon.optimizers.gram.far_inverse_sqrt`
    then drops the exact branch), whether its series alone retracts such a step to the dtype's
    precision: the number of vouched-for (dtype, lr, shrink) cases whose series-only point is
    off the exactly retracted one by more than $100\varepsilon$ of the dtype relative (the claim
    puts the truncation below $\varepsilon$; float64 arithmetic). The step from $cW$ is the
    tangent ``V`` scaled to the spectral norm the engine's bound passes
    (:data:`~geomuon.optimizers.gram.DIRECTION_NORM` times lr). ``None`` where it vouches for
    none (an overconfident form had left fp32 weights 1.6e-4 off Stiefel)."""
    from geomuon.manifolds.capabilities import exact_inverse_sqrt
    from geomuon.optimizers.gram import DIRECTION_NORM, DIRECTION_NORMAL

    unit = V / torch.linalg.matrix_norm(V, ord=2).clamp_min(1e-300)[..., None, None]
    vouched, wrong = 0, []
    for dtype, lr, shrink in itertools.product((torch.float32, torch.float64), (0.01, 0.03, 0.1, 0.3, 1.0),
                                               (1.0, 0.98)):
        if not form.series_covers(DIRECTION_NORM * lr, DIRECTION_NORMAL * lr, shrink, 6, dtype):
            continue
        vouched += 1
        Y = shrink * W + DIRECTION_NORM * lr * unit
        series = Y @ form.retraction_factor(Y.mT @ Y, 6, None)
        exact = Y @ form.retraction_factor(Y.mT @ Y, 6, exact_inverse_sqrt)
        if _relative(series, exact) > 100 * torch.finfo(dtype).eps:
            wrong.append(f"{str(dtype).removeprefix('torch.')} lr {lr} shrink {shrink}")
    if not vouched:
        return None
    return float(len(wrong)), (f"series alone off at {', '.join(wrong)}" if wrong else f"{vouched} cases vouched for")


def _check_own_checks(manifold: MatrixManifold, x: torch.Tensor, g: torch.Tensor, produced: list[torch.Tensor],
                      tol: float, record) -> None:
    r"""The manifold's own checks, both ways: what an optimizer trusts (ManifoldMuon refuses
    the weights they refuse and steps the others).

    * Every point the contract produced (``projx`` of Gaussians near and far, the
      retractions, the geoopt steps) passes ``check_point_on_manifold`` at tolerance
      $\sqrt{\text{tol}}$: a gate for points off $M$ by $O(1)$, which the Gauss–Newton
      residual cannot see where the normal space vanishes (at $x = 0$ the step is 0: a
      ``projx`` returning zeros had passed the contract); their accuracy is that residual's.
    * Matrix by matrix, $x + 0.1\|x\|\hat N$ for a unit normal $\hat N$ at $x$ fails
      ``check_point_on_manifold``, and $\hat N$ fails ``check_vector_on_tangent``, at
      their default tolerances (as optimizers call them): a check that accepted everything
      had passed, and ManifoldMuon then retracted weights off $M$ with no error. Matrices
      whose normal space is $\{0\}$ (no constraint) are skipped.
    """
    gate = math.sqrt(tol)
    refused = sum(not manifold.check_point_on_manifold(y, atol=gate, rtol=gate) for y in produced)
    record("points_pass_own_check", float(refused), 0.0,
           note=f"{refused} of {len(produced)} produced points refused" if refused else "")
    shape = x.shape[-2:]
    normal = normal_component(manifold, x, g).reshape(-1, *shape)
    points = x.reshape(-1, *shape)
    sizes, x_sizes = _matrix_norm(normal), _matrix_norm(points.double())
    kept = (sizes > 1e-8 * _matrix_norm(g.double()).reshape(-1)).tolist()
    unit = (normal / sizes.clamp_min(1e-300)[:, None, None]).to(x.dtype)
    off = points + 0.1 * x_sizes[:, None, None].to(x.dtype) * unit
    lax_point = [i for i, k in enumerate(kept) if k and manifold.check_point_on_manifold(off[i])]
    lax_tangent = [i for i, k in enumerate(kept) if k and manifold.check_vector_on_tangent(points[i], unit[i])]
    record("own_checks_refuse_normal_offsets", float(len(lax_point) + len(lax_tangent)), 0.0,
           note=f"accepted: point + normal at matrices {lax_point}, normal as tangent at {lax_tangent}"
           if lax_point or lax_tangent else "")


def _exact_dualizer(norm: str, P: torch.Tensor) -> torch.Tensor:
    r"""The float64 dualizer of ``norm`` at ``P``. The spectral one is msign of the exact
    $P$, whose zero singular values come out at the projection's round-off (a square Stiefel
    tangent $x\cdot$skew is singular in odd dimensions): below $\sqrt\varepsilon\,\sigma_{\max}$
    they are zeros (a Gaussian's projection has a genuine one there with probability
    ~1e-8), where msign's own rank threshold, $\max(m, n)\,\varepsilon\,\sigma_{\max}$, had
    kept one by chance and its arbitrary singular pair ($1/\sqrt5$ of a 5x5 $A$) was blamed
    on the declaration. The others are :data:`~geomuon.optimizers.steepest.NORMS`' own, with
    SVD-exact polar factors."""
    from geomuon.optimizers.steepest import NORMS, SolverSettings

    if norm == "spectral":
        U, S, Vh = torch.linalg.svd(P, full_matrices=False)
        kept = (S > torch.finfo(S.dtype).eps ** 0.5 * S[..., :1]).to(S.dtype)
        return (U * kept.unsqueeze(-2)) @ Vh
    return NORMS[norm].dualize(P, SolverSettings(msign_method="svd", compute_dtype=None))


def _relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """``|a - b| / |scale|`` over all entries, ``scale`` defaulting to ``b`` (float64; matrices or
    multipliers of any shape)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / (b if scale is None else scale.double()).norm().clamp_min(1e-300))


def _geoopt_steps(manifold: MatrixManifold, x: torch.Tensor, target: torch.Tensor, steps: int = 5):
    """A few ``RiemannianSGD`` steps (momentum 0.9) on $\\|W - T\\|^2$ from ``x``."""
    import geoopt  # first imported by geomuon.manifolds.base, which filters its torch.jit warnings

    param = geoopt.ManifoldParameter(x.detach().clone(), manifold=manifold)
    optimizer = geoopt.optim.RiemannianSGD([param], lr=1e-2, momentum=0.9)
    with torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad()
            (param - target).square().sum().backward()
            optimizer.step()
    return param.detach()
