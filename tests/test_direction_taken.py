r"""The direction ManifoldMuon takes inside training, read off the weights and checked independently.

At a recorded step of a small training run (three ``nn.Linear`` weights, tall 48x16, wide 16x48
and square 16x16, in a tanh net fit to a teacher or each in the noisy linear regression of
``bench/manifold_frontier.py``; ManifoldMuon's default settings, momentum as in training) the
test keeps the weight
before the step $W$, the (Nesterov) momentum the step used $G = \mu B + (1-\mu)g$ (the new
buffer $B$ read from the optimizer's state, $g$ the gradient), $\eta$, the decay factor
$c = 1 - \eta\lambda$ and the weight after the step $W'$. A wide weight is read transposed
(the transposed geometry both manifolds document). Then, in float64 and without the library's
engine (only the definitions and ``torch.linalg.svd``):

1. **The direction taken**: the tangent $A$ at $W$ with $R(cW - \eta A) = W'$ for the documented
   retraction $R$ (Stiefel: the polar factor; DGram: the polar factor of the normalized columns
   times the column norms, ``OrthogonalColumnsGram``), by the fixed point
   $A \leftarrow A + \gamma P_W(R(cW - \eta A) - W')$ with $\gamma$ the inverse of $R$'s
   differential on tangent vectors ($c/\eta$ on Stiefel, $1/\eta$ on DGram); it contracts by
   $O(\eta)$ per iteration.
2. **The optimum** of the steepest-descent problem
   $$\mathrm{OPT} = \max\{\langle G, A\rangle : A \in T_W,\ \|A\|_2 \le 1\}
   = \min_{N \in N_W} \|G - N\|_*,$$
   $T_W = \{A : \mathcal C(W^\top A + A^\top W) = 0\}$ ($\mathcal C$ the identity on Stiefel,
   $\operatorname{Off}$ on DGram), $N_W = \{WS : S = S^\top\ (\text{and } \operatorname{diag} S = 0
   \text{ on DGram})\}$ its orthogonal complement, by ADMM on the splitting between $T_W$ and the
   unit spectral ball. Every primal iterate gives a lower bound $\langle G, P_W z\rangle /
   \max(1, \|P_W z\|_2)$, every scaled dual iterate $y$ an upper bound $\|P_W G + P_{N_W} y\|_*$;
   the solve stops once they agree to :data:`GAP`.
3. **The fraction** $\langle G, A\rangle / \|A\|_2 / \mathrm{OPT}$, bounded below by dividing by
   the upper bound (what the targets are checked with) and above by dividing by the lower one
   (what the negative controls are checked with).

Targets: the project's, mean $\ge 0.97$ and minimum $\ge 0.92$ (docs/results/index.md, "Targets
0.97 mean / 0.92 min"), checked where the project claims them (:data:`CLAIMED`). The negative
controls (the
wrong sign, the unprojected $\operatorname{msign}(G)$, and the optimizer itself with its dual
solve and polish turned off, i.e. $P_W\operatorname{msign}(P_WG)$) must fail them.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import pytest
import torch

from geomuon.manifolds import MatrixManifold
from geomuon.optimizers import ManifoldMuon

#: The project's targets for the fraction of the optimal descent (docs/results/index.md).
TARGET_MEAN, TARGET_MIN = 0.97, 0.92
#: Relative duality gap at which a reference solve stops: the fractions are then known to 1e-4,
#: far inside every margin checked here (0.01 and more).
GAP = 1e-4
#: The feasibility ManifoldMuon's first step admits (``check_on_manifold``: max(1e-5, 16 eps) in
#: float32); every point it writes must pass it again.
ON_MANIFOLD_TOL = 1e-5
#: Spectral norm the direction may reach. ManifoldMuon's Gram path keeps $\|\hat A\|_2 \le 1$ only
#: to its polish's accuracy, as its docstring says (here up to 1.07; DGram in GPT training up to 1.22);
#: ``geomuon.optimizers.gram.polish`` documents 1.1-1.3 for the unpolished tangent projection in GPT
#: training, which the polish only lowers: a step longer than that is a regression.
DOCUMENTED_STEP_EXCESS = 1.3
F32_EPS = torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------- float64 reference
# Written from the definitions on purpose (not from geomuon.manifolds or the engine): the point is
# to measure the engine against an implementation that shares none of its code.

def _normal_multiplier(kind: str, W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    r"""$S$ with $P_{N_W}X = WS$ at a tall point $W$ with diagonal $W^\top W$ ($d_i^2$ on its
    diagonal): $S_{ij} = (W^\top X + X^\top W)_{ij} / (d_i^2 + d_j^2)$, zero diagonal on DGram.
    (The points are feasible to 1e-6, so the diagonal Gram costs the projection nothing visible.)"""
    M = W.mT @ X
    d2 = W.square().sum(-2)
    S = (M + M.mT) / (d2.unsqueeze(-1) + d2.unsqueeze(-2))
    return S - torch.diag_embed(torch.diagonal(S)) if kind == "dgram" else S


def _tangent(kind: str, W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """$P_W X$: the orthogonal projection onto the tangent space at the tall point ``W``."""
    return X - W @ _normal_multiplier(kind, W, X)


def _polar(X: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


def _retraction(kind: str, Y: torch.Tensor) -> torch.Tensor:
    r"""The documented retraction of the target $Y = cW - \eta A$: the polar factor (Stiefel), or
    $\operatorname{polar}(Y\Delta^{-1/2})\Delta^{1/2}$, $\Delta = \operatorname{diag}(Y^\top Y)$ (DGram)."""
    if kind == "stiefel":
        return _polar(Y)
    norms = Y.norm(dim=-2)
    return _polar(Y / norms) * norms


def _spectral(X: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(X, 2).item()


def _nuclear(X: torch.Tensor) -> float:
    return torch.linalg.svdvals(X).sum().item()


def _direction_taken(kind: str, W: torch.Tensor, shrink: float, lr: float, W_after: torch.Tensor,
                     iterations: int = 40) -> tuple[torch.Tensor, float]:
    """The tangent ``A`` with ``R(shrink W - lr A) = W_after`` and the largest entry of the residual."""
    gain = (shrink if kind == "stiefel" else 1.0) / lr  # polar(cW + V) = polar(W + V/c) on Stiefel
    A = gain * _tangent(kind, W, shrink * W - W_after)
    for _ in range(iterations):
        A = A + gain * _tangent(kind, W, _retraction(kind, shrink * W - lr * A) - W_after)
    residual = (_retraction(kind, shrink * W - lr * A) - W_after).abs().max().item()
    return A, residual


def _optimum(kind: str, W: torch.Tensor, G: torch.Tensor, max_iterations: int = 20000) -> tuple[float, float]:
    """``(lower, upper)`` bounds on OPT that agree to :data:`GAP` (ADMM, see the module docstring)."""
    tangent_G = _tangent(kind, W, G)
    rho = _spectral(tangent_G)  # the multiplier's scale: the penalty balances <G, A> with ||A||_2 ~ 1
    x = z = u = torch.zeros_like(G)
    lower, upper = -float("inf"), float("inf")
    for k in range(1, max_iterations + 1):
        x = _tangent(kind, W, z - u + G / rho)
        U, s, Vh = torch.linalg.svd(x + u, full_matrices=False)
        z_before, z = z, (U * s.clamp(max=1.0)) @ Vh
        u = u + x - z
        if k % 10:
            continue
        A = _tangent(kind, W, z)
        lower = max(lower, (G * A).sum().item() / max(1.0, _spectral(A)))
        y = rho * u
        upper = min(upper, _nuclear(tangent_G + y - _tangent(kind, W, y)))
        if upper - lower <= GAP * upper:
            return lower, upper
        primal, dual = (x - z).norm().item(), rho * (z - z_before).norm().item()
        if primal > 10 * dual or dual > 10 * primal:  # residual balancing (u is scaled by 1/rho)
            factor = 2.0 if primal > dual else 0.5
            rho, u = rho * factor, u / factor
    raise AssertionError(f"the reference solve did not certify OPT to {GAP} in {max_iterations} iterations "
                         f"(lower {lower}, upper {upper}): raise max_iterations")


def _off_manifold(kind: str, W: torch.Tensor) -> float:
    r"""$\|W^\top W - I\|_{\max}$ (Stiefel) or the largest cosine between two columns (DGram)."""
    if kind == "dgram":
        W = W / W.norm(dim=-2)
    return (W.mT @ W - torch.eye(W.size(-1), dtype=W.dtype)).abs().max().item()


# ----------------------------------------------------------------------------- training
@dataclass
class Step:
    """One recorded step of one matrix, tall (a wide weight transposed), float64."""
    shape: tuple[int, int]  # as stored
    W: torch.Tensor
    G: torch.Tensor
    W_after: torch.Tensor
    lr: float
    shrink: float


SHAPES = ((48, 16), (16, 48), (16, 16))  # tall, wide, square, as stored (out_features x in_features)


def _mlp(kind: str, gen: torch.Generator):
    """x (16) -> tall 48x16 -> tanh -> wide 16x48 -> tanh -> square 16x16, fit to a random teacher of
    the same shape; started at random semi-orthogonal points (what the pretraining strategies
    start from, on Stiefel and DGram alike, so ``kind`` does not enter). Returns the weights and
    the gradient-filling step."""
    layers = [torch.nn.Linear(n, m, bias=False) for m, n in SHAPES]
    teacher = [torch.randn(layer.weight.shape, generator=gen) / layer.in_features ** 0.5 for layer in layers]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.nn.init.orthogonal_(torch.empty(layer.weight.shape), generator=gen))
    weights = [layer.weight for layer in layers]

    def forward(ws, x):
        return torch.tanh(torch.tanh(x @ ws[0].mT) @ ws[1].mT) @ ws[2].mT

    def gradients():  # a fresh batch of 96 > every side: full-rank gradients
        x = torch.randn(96, 16, generator=gen)
        target = forward(teacher, x) + 0.1 * torch.randn(96, 16, generator=gen)
        for w in weights:
            w.grad = None
        (forward(weights, x) - target).square().mean().backward()

    return weights, gradients


def _regression(kind: str, gen: torch.Generator):
    r"""``bench/manifold_frontier.py``'s problem (where the project measured both manifolds' defaults
    against the targets) at these shapes: each ``nn.Linear`` weight fits a noisy linear teacher on
    its manifold, $\tfrac12\|XW - Y\|^2$ over a fresh batch of twice its larger side each step."""
    manifold = MatrixManifold.resolve(kind, "kind")
    teachers = [manifold.projx(torch.randn(shape, generator=gen)) for shape in SHAPES]
    layers = [torch.nn.Linear(n, m, bias=False) for m, n in SHAPES]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(manifold.projx(torch.randn(layer.weight.shape, generator=gen)))
    weights = [layer.weight for layer in layers]

    def gradients():
        for w, teacher in zip(weights, teachers):
            batch = 2 * max(w.shape)
            X = torch.randn(batch, w.size(0), generator=gen)
            Y = X @ teacher + 0.1 * torch.randn(batch, w.size(1), generator=gen)
            w.grad = X.mT @ (X @ w.detach() - Y) / batch

    return weights, gradients


TASKS = {"mlp": _mlp, "regression": _regression}


def _train(kind: str, task: str, steps: int, record: tuple[int, ...], seed: int = 0, **options) -> list[Step]:
    """Train ``TASKS[task]`` with ``ManifoldMuon(manifold=kind, **options)``; the recorded steps of
    every matrix."""
    gen = torch.Generator().manual_seed(seed)
    params, gradients = TASKS[task](kind, gen)
    optimizer = ManifoldMuon(params, manifold=kind, **options)
    group = optimizer.param_groups[0]
    recorded = []
    for step in range(1, steps + 1):
        gradients()
        before = [(p.detach().double().clone(), p.grad.double().clone()) for p in params]
        optimizer.step()
        if step not in record:
            continue
        mu, lr = group["momentum"], group["lr"]
        for p, (W, grad) in zip(params, before):
            buffer = optimizer.state[p]["momentum_buffer"].double()
            G = torch.lerp(grad, buffer, mu) if group["nesterov"] else buffer  # (1 - mu) g + mu B
            W_after = p.detach().double()
            if W.size(0) < W.size(1):  # a wide point steps in the transposed geometry
                W, G, W_after = W.mT, G.mT, W_after.mT
            recorded.append(Step(tuple(p.shape), W, G, W_after, lr, 1.0 - lr * group["weight_decay"]))
    return recorded


@dataclass
class Measured:
    """The direction a step took against the optimum."""
    fraction_low: float  # <G, A>/||A||_2 over OPT's upper bound: at most the true fraction
    fraction_high: float  # ... over OPT's lower bound: at least the true fraction
    descent_low: float  # <G, A>/OPT's upper bound: the first-order descent per unit lr, vs the best
    norm: float  # ||A||_2: the step's spectral length in units of lr
    residual: float  # how well R(cW - lr A) reproduces W'
    off_manifold: float  # of W'


def _measure(kind: str, step: Step, W_after: torch.Tensor | None = None,
             optimum: tuple[float, float] | None = None) -> Measured:
    """``step`` measured (``W_after``: another point reached from the same W, for the controls)."""
    W_after = step.W_after if W_after is None else W_after
    A, residual = _direction_taken(kind, step.W, step.shrink, step.lr, W_after)
    lower, upper = optimum or _optimum(kind, step.W, step.G)
    gain, norm = (step.G * A).sum().item(), _spectral(A)
    return Measured(gain / norm / upper, gain / norm / lower, gain / upper, norm, residual,
                    _off_manifold(kind, W_after))


def _meets_targets(fractions: list[float]) -> bool:
    return statistics.mean(fractions) >= TARGET_MEAN and min(fractions) >= TARGET_MIN


def _summary(kind: str, steps: list[Step], measured: list[Measured]) -> str:
    return "; ".join(f"{kind} {s.shape}: fraction {m.fraction_low:.4f}, |A|_2 {m.norm:.4f}"
                     for s, m in zip(steps, measured))


RECORDED = (1, 12, 24)  # the cold first step (no warm start yet) and two warm ones
#: Where the project claims its targets for a manifold's defaults (docs/results/index.md): Stiefel
#: inside training ("met in every orientation"; here a nonlinear net) and on the frontier's
#: regressions; DGram on the frontier's regressions and on this net, whose square layer its ADMM
#: polish brings to 0.94-0.97 (alternating projections had left it at 0.85-0.88); inside GPT
#: training DGram documents its targets "not met".
CLAIMED = [("stiefel", "mlp"), ("stiefel", "regression"), ("dgram", "mlp"), ("dgram", "regression")]


@functools.cache
def _default_run(kind: str, task: str) -> tuple[list[Step], list[Measured], list[tuple[float, float]]]:
    """``(steps, measured, optima)`` of a default ManifoldMuon run (shared by the tests)."""
    steps = _train(kind, task, steps=max(RECORDED), record=RECORDED)
    optima = [_optimum(kind, s.W, s.G) for s in steps]
    return steps, [_measure(kind, s, optimum=o) for s, o in zip(steps, optima)], optima


@pytest.mark.parametrize("kind, task", CLAIMED)
def test_the_direction_taken_reaches_the_targets_and_the_weights_stay_on_the_manifold(kind, task):
    steps, measured, _ = _default_run(kind, task)
    assert sorted({s.shape for s in steps}) == sorted(SHAPES)
    report = _summary(kind, steps, measured)
    # R(cW - lr A) reproduces W' as well as W' is on the manifold: the documented retraction with
    # the documented lr and decay explains the step exactly, to the points' own round-off
    assert max(m.residual for m in measured) <= ON_MANIFOLD_TOL, report
    assert max(m.off_manifold for m in measured) <= ON_MANIFOLD_TOL, report
    assert _meets_targets([m.fraction_low for m in measured]), report
    # the step is not shortened (its first-order descent per unit lr is the direction's) nor
    # lengthened past what the engine documents for its unpolished direction
    assert min(m.descent_low for m in measured) >= TARGET_MIN, report
    assert max(m.norm for m in measured) <= DOCUMENTED_STEP_EXCESS, report


@pytest.mark.parametrize("task", sorted(TASKS))
def test_square_stiefel_steps_are_exactly_lr_long(task):
    # Square Stiefel's direction is the closed form msign(P_W G), all singular values 1 (the
    # eigendecomposition dualizer, exact to float32 round-off), so ||A||_2 = 1 up to the error
    # of reading A back: W' is rounded to float32 and formed by products of length n = 16, an
    # entry error of at most n * eps32, which becomes n * eps32 / lr in A, at most
    # sqrt(n * n) times that in the spectral norm.
    steps, measured, _ = _default_run("stiefel", task)
    square = [(s, m) for s, m in zip(steps, measured) if s.shape == (16, 16)]
    assert len(square) == len(RECORDED)
    for step, m in square:
        assert abs(m.norm - 1.0) <= 16 * 16 * F32_EPS / step.lr, (step.shape, m.norm)


@pytest.mark.parametrize("kind, task", CLAIMED)
def test_wrong_directions_fail_the_targets(kind, task):
    """Negative controls: the same points stepped along wrong directions, read as the optimizer's
    steps are; each must fail the targets even with the bound most favourable to it."""
    steps, _, optima = _default_run(kind, task)
    reverse, unprojected = [], []
    for step, optimum in zip(steps, optima):
        A, _ = _direction_taken(kind, step.W, step.shrink, step.lr, step.W_after)
        for wrong, into in ((-A, reverse), (_polar(step.G), unprojected)):
            W_after = _retraction(kind, step.shrink * step.W - step.lr * wrong)
            into.append(_measure(kind, step, W_after, optimum).fraction_high)
    assert not _meets_targets(reverse), reverse
    assert not _meets_targets(unprojected), unprojected


@pytest.mark.parametrize("kind, task", CLAIMED)
def test_the_optimizer_without_its_dual_solve_fails_the_targets(kind, task):
    # The projection start P_W msign(P_W G): the optimizer with no dual step, no carried step, no
    # warm start and no polish. The check must tell it from the default's solve.
    solve_off = dict(dual_steps=0, dual_carry=False, warm_start=False, polish_rounds=0)
    steps = _train(kind, task, steps=max(RECORDED), record=RECORDED, **solve_off)
    fractions = [_measure(kind, s).fraction_high for s in steps]
    assert not _meets_targets(fractions), fractions


def test_the_admm_polish_reaches_the_optimum_where_alternating_projections_stall():
    # Every recorded DGram matrix of the MLP run (W and G as the step saw them), through the
    # engine's Gram step with one cold dual step and 200 polish rounds of each method: ADMM
    # converges to OPT (measured 0.9994-1.0000 of its upper bound; the bound's own gap is
    # GAP = 1e-4, and 200 rounds leave ADMM's linear convergence within 6e-4 of its limit, hence
    # 0.999), while alternating projections stop at a feasible point near the start (0.938-0.985
    # of OPT's lower bound: a margin of 0.005 to the 0.99 they must stay under).
    from geomuon.manifolds import DGram
    from geomuon.optimizers.gram import GramSettings, gram_step

    steps, _, optima = _default_run("dgram", "mlp")
    for step, (lower, upper) in zip(steps, optima):
        gains = {}
        for method in ("admm", "alternating"):
            settings = GramSettings(dual_steps=1, carry=False, compute_dtype=None, polish_rounds=200, polish_method=method)
            out = gram_step(DGram().gram_form, step.W[None], step.G[None], step.lr, None, settings)
            T1, T2, Z0, _ = out.direction_factors
            A = step.W @ T1[0] + Z0[0] @ T2[0]
            gains[method] = (step.G * A).sum().item() / max(1.0, _spectral(A))
        assert gains["admm"] >= 0.999 * upper, (step.shape, gains, upper)
        assert gains["alternating"] <= 0.99 * lower, (step.shape, gains, lower)


@pytest.mark.parametrize("kind, task", CLAIMED)
def test_weight_decay_scales_the_point_before_the_retraction(kind, task):
    # Documented: W <- R_{cW}(-lr A), c = 1 - lr * weight_decay. Read with that c, the steps of a
    # run with decay reach the targets; read as if there were no decay (c = 1), they do not
    # (DGram: A gains (1 - c)/lr W = W, a unit multiple of the point; Stiefel: polar(cW - lr A)
    # = polar(W - (lr/c) A), so the square matrix's unit step reads 1/c = 1.02 long).
    steps = _train(kind, task, steps=12, record=(12,), weight_decay=1.0)  # c = 1 - 0.02 * 1.0
    measured = [_measure(kind, s) for s in steps]
    assert _meets_targets([m.fraction_low for m in measured]), _summary(kind, steps, measured)
    assert max(m.residual for m in measured) <= ON_MANIFOLD_TOL
    ignored = [_measure(kind, Step(s.shape, s.W, s.G, s.W_after, s.lr, 1.0)) for s in steps]
    if kind == "dgram":
        assert not _meets_targets([m.fraction_high for m in ignored])
    else:
        square = [m.norm for s, m in zip(steps, ignored) if s.shape == (16, 16)]
        # (the tolerance of test_square_stiefel_steps_are_exactly_lr_long)
        assert square and abs(square[0] - 1 / steps[0].shrink) <= 16 * 16 * F32_EPS / steps[0].lr, square


@pytest.mark.parametrize("kind", ["stiefel", "dgram"])
def test_a_wide_weight_steps_as_its_transpose(kind):
    # A wide weight and a tall copy of its transpose, given transposed gradients, in one
    # optimizer: the documented transposed geometry makes their steps transposes of each other.
    # They differ only by the round-off of products over a differently laid-out operand, which the
    # bf16 dual products can round to their own unit: an entry of A moves by at most 2^-8, of W
    # by lr * 2^-8 per step.
    gen = torch.Generator().manual_seed(3)
    wide = torch.nn.Parameter(torch.nn.init.orthogonal_(torch.empty(16, 48), generator=gen))
    tall = torch.nn.Parameter(wide.detach().mT.clone())
    optimizer = ManifoldMuon([wide, tall], manifold=kind)
    lr, steps = optimizer.param_groups[0]["lr"], 12
    for _ in range(steps):
        X = torch.randn(96, 16, generator=gen)
        Y = torch.randn(96, 48, generator=gen)
        wide.grad = X.mT @ (X @ wide.detach() - Y) / 96
        tall.grad = wide.grad.mT.clone()
        optimizer.step()
    drift = (wide.detach() - tall.detach().mT).abs().max().item()
    assert drift <= steps * lr * 2.0 ** -8, drift
    assert _off_manifold(kind, wide.detach().double().mT) <= ON_MANIFOLD_TOL
