r"""Equivariance residuals of update maps, manifold steepest directions and optimizer steps.

For an update $U$ and a group element $g$ the relative residual is

$$r(U, g; x) = \frac{\|U(g\cdot x) - g\cdot U(x)\|_F}{\|U(x)\|_F},$$

zero exactly when $U$ commutes with $g$ at $x$. Three kinds of update share it, each
wrapped in a *subject* that builds examples and measures residuals:

* :class:`MapUpdate` — a pure map $D \mapsto U(D)$ (``geomuon.optimizers.maps``);
* :class:`DirectionUpdate` — the steepest direction $A(W, G)$ of an engine on a
  manifold: $r = \|A(gW, gG) - g\,A(W, G)\| / \|A(W, G)\|$;
* :class:`OptimizerUpdate` — whole optimizer steps, momentum and other state included:
  two copies of the optimizer start from $W_0$ and $g\cdot W_0$, receive gradients $G_t$
  and $g\cdot G_t$ for several steps, and
  $r = \max_t \|W'_t - g\cdot W_t\| / \|W_t - W_0\|$ (relative to the distance travelled,
  not to $\|W\|$, so a tiny learning rate cannot hide a broken step).

*Invariance* (router shifts) is the same check: the group's ``act_output`` ignores the
shift part. Users call :func:`assert_equivariant` from their own tests, or the CLI
``geomuon check-equivariance module:function --group NAME --shape MxN``.

Tolerances (:func:`roundoff_tolerance`) are derived from the dtype, the size, the number of
sequential floating-point stages and the condition number of the example; see there.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from geomuon.theory.groups import Group, GroupElement, get_group, sample_shapes

__all__ = [
    "MapUpdate",
    "DirectionUpdate",
    "OptimizerUpdate",
    "map_residual",
    "direction_residual",
    "step_residual",
    "condition_number",
    "roundoff_tolerance",
    "random_matrix",
    "EquivarianceReport",
    "check_equivariance",
    "assert_equivariant",
    "MUST_FAIL_RESIDUAL",
    "Case",
    "hypothesis_cases",
    "verify_declaration",
]

#: A must-fail pair must show a relative residual at least this large on a counterexample.
MUST_FAIL_RESIDUAL = 1e-2


def _members(x) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _norm(x) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in _members(x)))


def _difference(a, b):
    return tuple(p - q for p, q in zip(_members(a), _members(b)))


def _relative(actual, expected, reference) -> float:
    """$\\|actual - expected\\| / \\|reference\\|$ over tuples (``reference`` may be a norm
    already); 0/0 counts as 0."""
    diff = _norm(_difference(actual, expected))
    ref = reference if isinstance(reference, float) else _norm(reference)
    if diff == 0.0:
        return 0.0
    return diff / ref if ref > 0 else math.inf


def map_residual(update: Callable, element: GroupElement, D) -> float:
    r"""$\|U(g\cdot D) - g\cdot U(D)\| / \|U(D)\|$ for a pure map (``D`` a tensor, or a tuple
    for joint groups, in which case ``update`` maps tuples to tuples)."""
    U = update(D)
    return _relative(update(element.act(D)), element.act_output(U), U)


def _direction(engine: Callable, manifold, W, G, solver: dict) -> torch.Tensor:
    result = engine(manifold, W, G, **solver)
    return result if isinstance(result, torch.Tensor) else result.direction


def direction_residual(engine: Callable, manifold, element: GroupElement, W, G, **solver) -> float:
    r"""$\|A(gW, gG) - g\,A(W, G)\| / \|A(W, G)\|$ for ``A = engine(manifold, W, G,
    **solver)`` (a tensor, or a result with a ``direction`` field)."""
    A = _direction(engine, manifold, W, G, solver)
    A_g = _direction(engine, manifold, element.act_point(W), element.act(G), solver)
    return _relative(A_g, element.act_output(A), A)


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _clone_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A deep copy of an optimizer with its parameters and state, attributes included.

    ``copy.deepcopy`` goes through ``Optimizer.__getstate__``, which keeps only
    ``defaults``, ``state`` and ``param_groups`` and so drops any attribute a subclass set
    in ``__init__``; copying ``__dict__`` with one memo keeps everything, and the state
    stays keyed by the copied parameters."""
    clone = type(optimizer).__new__(type(optimizer))
    clone.__dict__.update(copy.deepcopy(optimizer.__dict__, {}))
    return clone


def step_residual(
    optimizer: torch.optim.Optimizer, element: GroupElement, gradients: Sequence
) -> float:
    r"""Largest $\|W'_t - g\cdot W_t\| / \sum_{s\le t}\|W_s - W_{s-1}\|$ over the steps $t$
    (the residual relative to the path travelled so far).

    ``optimizer`` is left untouched: two deep copies (parameters, state and attributes
    together) are stepped, one from its current parameters $W_0$ with gradients $G_t$, one from
    $g\cdot W_0$ with gradients $g\cdot G_t$. ``gradients`` holds one entry per step: a
    tensor for a single-parameter optimizer, or a tuple with one tensor per parameter (in
    ``param_groups`` order) for joint groups.
    """
    plain, twin = _clone_optimizer(optimizer), _clone_optimizer(optimizer)
    params, twin_params = _parameters(plain), _parameters(twin)
    single = len(params) == 1

    def pack(tensors):
        return tensors[0] if single else tuple(tensors)

    with torch.no_grad():
        for p, q in zip(twin_params, _members(element.act_point(pack(params)))):
            p.copy_(q)
    previous = pack([p.detach().clone() for p in params])
    travelled, worst = 0.0, 0.0
    for G in gradients:
        for p, q, g, g_twin in zip(params, twin_params, _members(G), _members(element.act(G))):
            p.grad, q.grad = g.clone(), g_twin.clone()
        plain.step()
        twin.step()
        current = pack([p.detach().clone() for p in params])
        # Path length, not distance from the start: a trajectory can come back to W_0
        # (a 2x2 rotation and its reverse), where the distance vanishes but the round-off
        # of the steps taken does not.
        travelled += _norm(_difference(current, previous))
        previous = current
        expected = element.act_point(current)
        worst = max(worst, _relative(pack([q.detach() for q in twin_params]), expected, travelled))
    return worst


def condition_number(X) -> float:
    r"""Largest 2-norm condition number $\sigma_1/\sigma_r$ ($r = \min(m, n)$) over the
    matrices of ``X`` (a tensor, a batch, or a tuple); ``inf`` for a rank-deficient one."""
    worst = 1.0
    for t in _members(X):
        s = torch.linalg.svdvals(t.double())
        top, bottom = s[..., 0], s[..., -1]
        if bool((bottom <= 0).any()):
            return math.inf
        worst = max(worst, float((top / bottom).max()))
    return worst


def roundoff_tolerance(
    dtype: torch.dtype, *, condition: float, size: int, depth: int, safety: float = 4.0
) -> float:
    r"""Bound on the relative residual of an *exactly* equivariant update computed in ``dtype``.

    Derivation. A computed update is the exact update of a perturbed input,
    $\tilde U(D) = U(D + E)$, with $\|E\|_F \le c\,\text{depth}\cdot n\cdot u\,\|D\|_F$: each
    of the ``depth`` sequential stages (one Newton–Schulz step, one normalization, one dual
    step) is a few matrix products whose inner sums over at most $n$ terms err by $n u$
    relatively ($u$ = ``torch.finfo(dtype).eps``; $c$ covers the handful of products per
    stage). The relative condition number of the maps here is at most $\sqrt r\,\kappa_2(D)$
    ($\kappa_2 = \sigma_1/\sigma_r$; e.g. the polar factor moves by
    $\|E\|/\sigma_r$ while $\|UV^\top\|_F = \sqrt r$; row and column normalizations are
    better conditioned). The residual compares two such computations (on $D$ and on
    $g\cdot D$), hence

    $$r \le \text{safety}\cdot\text{depth}\cdot n^{3/2}\cdot u\cdot\kappa_2(D),$$

    with ``safety`` $= 2c = 4$. For a non-equivariant update the residual is $O(1)$ instead,
    so the bound separates the two by many orders of magnitude in float64.

    Args:
        dtype: dtype of the computation.
        condition: $\kappa_2$ of the example (:func:`condition_number`).
        size: $n$, the largest dimension of the matrices.
        depth: number of sequential stages of the computation.
        safety: the constant $2c$.
    """
    eps = torch.finfo(dtype).eps
    return safety * depth * size**1.5 * eps * condition


def random_matrix(
    shape: tuple[int, int],
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
    condition: float = 100.0,
) -> torch.Tensor:
    r"""$U\operatorname{diag}(s)V^\top$ with Haar $U, V$ and $s$ geometric from 1 to
    $1/\text{condition}$ (shuffled), so $\kappa_2$ is exactly ``condition``. Computed in
    float64, returned in ``dtype``."""
    from geomuon.theory.groups import haar_orthogonal

    m, n = shape
    r = min(m, n)
    U = haar_orthogonal(m, generator)[:, :r]
    V = haar_orthogonal(n, generator)[:, :r]
    s = torch.logspace(0, -math.log10(condition), r, dtype=torch.float64)
    s = s[torch.randperm(r, generator=generator)]
    return ((U * s) @ V.mT).to(dtype)


def _raw(shapes, generator, dtype, condition):
    if isinstance(shapes[0], (tuple, list)):
        return tuple(random_matrix(s, generator, dtype, condition) for s in shapes)
    return random_matrix(shapes, generator, dtype, condition)


class _Subject:
    """Common surface of the three update kinds.

    ``inputs`` raw matrices (each shaped like the group's ``shapes``) make one example
    (:meth:`example`); :meth:`residual` measures it under an element; :meth:`tolerance`
    is the round-off bound of :func:`roundoff_tolerance` for that example.
    """

    name: str
    inputs: int
    depth: int

    def example(self, raws: Sequence) -> Any:
        raise NotImplementedError

    def residual(self, element: GroupElement, example) -> float:
        raise NotImplementedError

    def directions(self, example) -> list:
        """The matrices whose conditioning governs round-off amplification."""
        raise NotImplementedError

    def scale(self, example) -> float:
        """Ratio of the round-off floor's reference size to the residual's denominator."""
        return 1.0

    #: Exponent of $\kappa_2$ in the update's condition number: 2 for updates computed
    #: through a Gram matrix $D^\top D$ (whose condition number is $\kappa_2(D)^2$).
    condition_power: int = 1

    def condition(self, example) -> float:
        r"""$\kappa_2^{\text{condition\_power}}$ of the worst-conditioned input matrix."""
        mats = [t for x in self.directions(example) for t in _members(x)]
        return max(condition_number(t) for t in mats) ** self.condition_power

    def tolerance(self, example, dtype: torch.dtype) -> float:
        mats = [t for x in self.directions(example) for t in _members(x)]
        size = max(max(t.shape[-2:]) for t in mats)
        return self.scale(example) * roundoff_tolerance(
            dtype, condition=self.condition(example), size=size, depth=self.depth
        )


@dataclass
class MapUpdate(_Subject):
    """A pure map ``update(D) -> U`` (tuples in and out for joint groups).

    ``depth``: sequential stages (default 16: covers a 12-step Polar Express msign plus
    normalizations). ``condition_power``: 2 for maps computed through a Gram matrix
    (one-sided polar maps by coupled Newton–Schulz, 25 stages). ``conditioning``: the
    matrix the map effectively works on, when that is not ``D`` itself (e.g. the centered
    input of a centered map), for the tolerance. ``amplification``: round-off growth the
    condition number does not capture (documented where it is set)."""

    update: Callable
    name: str = ""
    depth: int = 16
    condition_power: int = 1
    conditioning: Callable | None = None
    amplification: float = 1.0
    inputs: int = field(default=1, init=False)

    def scale(self, example) -> float:
        return self.amplification

    def __post_init__(self):
        self.name = self.name or getattr(self.update, "__name__", repr(self.update))

    def example(self, raws):
        return raws[0]

    def residual(self, element, example):
        return map_residual(self.update, element, example)

    def directions(self, example):
        if self.conditioning is None:
            return [example]
        return [tuple(self.conditioning(t) for t in _members(example))]


@dataclass
class DirectionUpdate(_Subject):
    """The steepest direction ``engine(manifold, W, G, **solver)`` on ``manifold``.

    Examples are ``(W, G)`` with ``W = manifold.projx(raw)`` on the manifold. ``depth``
    defaults to 16 per dual step: the solver's iterations compose equivariant maps when the
    group maps the manifold to itself, so round-off grows with the number of steps.
    ``amplification``: the dualizer's largest slope (see :meth:`scale`)."""

    engine: Callable
    manifold: Any
    solver: dict = field(default_factory=dict)
    name: str = ""
    depth: int = 0
    amplification: float = 1.0
    inputs: int = field(default=2, init=False)

    def __post_init__(self):
        self.name = self.name or f"steepest[{type(self.manifold).__name__}]"
        if not self.depth:
            self.depth = 16 * (2 + int(self.solver.get("steps", 20)))

    def example(self, raws):
        return self.manifold.projx(raws[0]), raws[1]

    def residual(self, element, example):
        W, G = example
        return direction_residual(self.engine, self.manifold, element, W, G, **self.solver)

    def directions(self, example):
        return list(example)

    def scale(self, example):
        r"""``amplification`` $\times\, \|G\| / \|P_W G\|$. The direction is normalized to
        norm one, so round-off of size $u\|G\|$ is relative to the tangent part $P_W G$
        (unbounded where $G$ is normal to the manifold and the direction is undetermined).
        The dual iterates $G + L_W^*(\Lambda_k)$ are not conditioned like $G$; where one is
        nearly singular, the dualizer amplifies round-off by its largest slope, which is
        what ``amplification`` carries."""
        W, G = example
        tangent = _norm(self.manifold.proju(W, G))
        return self.amplification * _norm(G) / max(tangent, torch.finfo(torch.float64).tiny)


@dataclass
class OptimizerUpdate(_Subject):
    """Whole optimizer steps: ``make_optimizer(params) -> Optimizer`` over fresh
    ``torch.nn.Parameter`` copies of ``W_0`` (one per member for joint groups).

    Examples are ``(W_0, [G_1, ..., G_steps])``; ``W_0`` is projected onto ``manifold``
    when one is given. The residual is relative to the distance travelled, so the round-off
    floor ($u\\|W\\|$) is scaled by $\\|W_0\\|/\\|W_t - W_0\\|$ (:meth:`scale`)."""

    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    name: str = ""
    manifold: Any = None
    steps: int = 3
    depth: int = 0
    condition_power: int = 1
    inputs: int = field(default=0, init=False)

    def __post_init__(self):
        self.name = self.name or getattr(self.make_optimizer, "__name__", "optimizer")
        self.inputs = 1 + self.steps
        if not self.depth:
            self.depth = 16 * self.steps

    def _start(self, raw):
        return self.manifold.projx(raw) if self.manifold is not None else raw

    def example(self, raws):
        start = raws[0]
        start = tuple(self._start(t) for t in start) if isinstance(start, tuple) else self._start(start)
        return start, list(raws[1:])

    def _optimizer(self, start):
        params = [torch.nn.Parameter(t.detach().clone()) for t in _members(start)]
        return self.make_optimizer(params)

    def residual(self, element, example):
        start, gradients = example
        return step_residual(self._optimizer(start), element, gradients)

    def directions(self, example):
        r"""The start and the matrices the update map sees: the momentum
        $M_t = \beta M_{t-1} + (1-\beta)G_t$ and its Nesterov blend
        $(1-\beta)G_t + \beta M_t$ ($\beta$ = the group's ``momentum``, 0 if it has none).
        A sum of well-conditioned gradients can be ill-conditioned, and that is what
        amplifies round-off."""
        start, gradients = example
        group = self._optimizer(start).param_groups[0]
        beta = float(group.get("momentum", 0.0) or 0.0)
        momentum, seen = None, [start]
        for G in gradients:
            G = _members(G)
            momentum = G if momentum is None else tuple(beta * m + (1 - beta) * g for m, g in zip(momentum, G))
            seen += [momentum, tuple((1 - beta) * g + beta * m for m, g in zip(momentum, G))]
        return seen

    def scale(self, example):
        start, gradients = example
        optimizer = self._optimizer(start)
        params = _parameters(optimizer)
        before = [p.detach().clone() for p in params]
        for G in gradients:
            for p, g in zip(params, _members(G)):
                p.grad = g.clone()
            optimizer.step()
        travelled = _norm(_difference(tuple(p.detach() for p in params), tuple(before)))
        return (_norm(tuple(before)) + travelled) / max(travelled, torch.finfo(torch.float64).tiny)


def _as_subject(update) -> _Subject:
    return update if isinstance(update, _Subject) else MapUpdate(update)


@dataclass
class EquivarianceReport:
    """Per-trial residuals of one (update, group) pair, and the verdict."""

    update: str
    group: str
    expect: str
    residuals: list[float]
    tolerances: list[float]

    @property
    def passed(self) -> bool:
        """``expect="holds"``: every residual within its tolerance. ``expect="fails"``:
        some residual at least :data:`MUST_FAIL_RESIDUAL`."""
        if self.expect == "holds":
            return all(r <= t for r, t in zip(self.residuals, self.tolerances))
        return max(self.residuals) >= MUST_FAIL_RESIDUAL

    def table(self) -> str:
        header = f"{self.update} under {self.group} (expected: {self.expect})"
        lines = [header, f"{'trial':>5}  {'residual':>10}  {'tolerance':>10}  verdict"]
        for i, (r, t) in enumerate(zip(self.residuals, self.tolerances)):
            if self.expect == "holds":
                verdict = "ok" if r <= t else "FAIL"
                bound = f"{t:10.2e}"
            else:
                verdict = "fails (as declared)" if r >= MUST_FAIL_RESIDUAL else "holds here"
                bound = f">={MUST_FAIL_RESIDUAL:8.0e}"
            lines.append(f"{i:5d}  {r:10.2e}  {bound}  {verdict}")
        lines.append("PASS" if self.passed else "FAILURE")
        return "\n".join(lines)


def check_equivariance(
    update,
    group: Group | str,
    shape: tuple[int, int] = (6, 4),
    *,
    trials: int = 8,
    expect: str = "holds",
    dtype: torch.dtype = torch.float64,
    condition: float = 100.0,
    tol: float | None = None,
    generator: torch.Generator | None = None,
) -> EquivarianceReport:
    """Residuals of ``update`` under random elements of ``group`` on random examples.

    Args:
        update: a map ``D -> U`` or a :class:`MapUpdate` / :class:`DirectionUpdate` /
            :class:`OptimizerUpdate`.
        group: a :class:`~geomuon.theory.groups.Group` or its name.
        shape: ``(m, n)``; for ``NeuronPermutation`` the SwiGLU triple with ``h = m, d = n``.
        trials: number of (example, element) draws.
        expect: ``"holds"`` or ``"fails"``.
        dtype: dtype of the examples.
        condition: $\\kappa_2$ of the random matrices (:func:`random_matrix`).
        tol: fixed tolerance; default :func:`roundoff_tolerance` per example.
        generator: source of randomness (default seeded with 0, so runs are reproducible).
    """
    if expect not in ("holds", "fails"):
        raise ValueError(f"expect must be 'holds' or 'fails', got {expect!r}")
    group = get_group(group) if isinstance(group, str) else group
    subject = _as_subject(update)
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    shapes = sample_shapes(group, shape)
    residuals, tolerances = [], []
    for _ in range(trials):
        example = subject.example(
            [_raw(shapes, generator, dtype, condition) for _ in range(subject.inputs)]
        )
        element = group.sample(shapes, generator)
        residuals.append(subject.residual(element, example))
        tolerances.append(tol if tol is not None else subject.tolerance(example, dtype))
    return EquivarianceReport(subject.name, group.name, expect, residuals, tolerances)


def assert_equivariant(update, group: Group | str, shape: tuple[int, int] = (6, 4), **kwargs) -> EquivarianceReport:
    """Raise ``AssertionError`` with the residual table unless ``update`` behaves as
    expected under ``group`` (equivariant by default; ``expect="fails"`` asserts a
    counterexample). Arguments as in :func:`check_equivariance`; usable in pytest::

        from geomuon.theory.equivariance import assert_equivariant
        assert_equivariant(my_map, "bi-orthogonal", shape=(8, 5))
    """
    report = check_equivariance(update, group, shape, **kwargs)
    if not report.passed:
        raise AssertionError(report.table())
    return report


@dataclass
class Case:
    """One hypothesis-drawn case: a shape, a condition number, a seed, the example built
    from them and a group element. Its ``repr`` prints the (small, after shrinking)
    matrices, so a falsifying example reads as matrices."""

    shape: tuple[int, int]
    condition: float
    seed: int
    example: Any
    element: GroupElement

    def __repr__(self) -> str:
        torch.set_printoptions(precision=4, sci_mode=False)
        try:
            return (
                f"Case(shape={self.shape}, condition={self.condition:.3g}, seed={self.seed})\n"
                f"example = {self.example!r}\nelement:\n{self.element!r}"
            )
        finally:
            torch.set_printoptions(profile="default")


def hypothesis_cases(
    subject,
    group: Group,
    *,
    orientation: str = "any",
    dims: tuple[int, int] = (2, 6),
    max_condition: float = 100.0,
    dtype: torch.dtype = torch.float64,
):
    r"""Hypothesis strategy of :class:`Case` for ``subject`` under ``group`` (needs the
    ``test`` extra). Shapes ``m, n`` in ``dims`` (``orientation`` ``"tall"``: $m \ge n$,
    ``"wide"``: $m < n$), condition numbers in ``[1, max_condition]``, matrices from
    :func:`random_matrix` seeded by a drawn integer; shrinking goes to the smallest shape,
    condition 1 and seed 0."""
    from hypothesis import strategies as st

    subject = _as_subject(subject)
    if orientation not in ("any", "tall", "wide"):
        raise ValueError(f"orientation must be 'any', 'tall' or 'wide', got {orientation!r}")

    @st.composite
    def cases(draw):
        m = draw(st.integers(*dims))
        n = draw(st.integers(*dims))
        if orientation != "any" and (m < n) != (orientation == "wide"):
            m, n = n, m
        if orientation == "wide" and m == n:
            n += 1
        condition = draw(st.floats(1.0, max_condition))
        seed = draw(st.integers(0, 2**31 - 1))
        generator = torch.Generator().manual_seed(seed)
        shapes = sample_shapes(group, (m, n))
        raws = [_raw(shapes, generator, dtype, condition) for _ in range(subject.inputs)]
        return Case((m, n), condition, seed, subject.example(raws), group.sample(shapes, generator))

    return cases()


def verify_declaration(
    update,
    group: Group | str,
    expected: str,
    *,
    orientation: str = "any",
    max_condition: float = 100.0,
    max_examples: int | None = None,
    tolerance_cap: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> Case | None:
    """Check one declared pair with hypothesis; raise ``AssertionError`` if it misbehaves.

    * ``expected="holds"``: on every drawn case the residual is within the round-off bound
      and within ``tolerance_cap`` if given (a requirement on top of the derivation, never
      a loosening); a failure is shrunk and printed as matrices.
    * ``expected="fails"``: hypothesis searches for a case with residual at least
      :data:`MUST_FAIL_RESIDUAL`, shrinks it and returns it; no such case is an error.

    ``max_examples`` defaults to the active hypothesis profile's. Needs the ``test`` extra.
    """
    from hypothesis import find, given, settings
    from hypothesis.errors import NoSuchExample

    group = get_group(group) if isinstance(group, str) else group
    subject = _as_subject(update)
    strategy = hypothesis_cases(
        subject, group, orientation=orientation, max_condition=max_condition, dtype=dtype
    )
    budget = settings(max_examples=max_examples or settings.default.max_examples, database=None)
    if expected == "holds":

        @budget
        @given(strategy)
        def must_hold(case):
            residual = subject.residual(case.element, case.example)
            tolerance = subject.tolerance(case.example, dtype)
            if tolerance_cap is not None:
                tolerance = min(tolerance, tolerance_cap)
            assert residual <= tolerance, (
                f"{subject.name} under {group.name}: residual {residual:.3e} > tolerance "
                f"{tolerance:.3e} (declared: holds)"
            )

        must_hold()
        return None
    if expected != "fails":
        raise ValueError(f"expected must be 'holds' or 'fails', got {expected!r}")
    try:
        return find(
            strategy,
            lambda case: subject.residual(case.element, case.example) >= MUST_FAIL_RESIDUAL,
            settings=budget,
        )
    except NoSuchExample:
        raise AssertionError(
            f"{subject.name} under {group.name} is declared to fail, but no case with residual "
            f">= {MUST_FAIL_RESIDUAL:g} was found"
        ) from None
