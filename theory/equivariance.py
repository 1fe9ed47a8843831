r"""Equivariance checks of update maps, manifold steepest directions and optimizer steps,
with three verdicts: **holds**, **violated**, **inconclusive**.

For an update $U$, a group element $g$ and an input $x$ the relative residual is

$$r = \frac{\|U(g\cdot x) - g\cdot U(x)\|_F}{\max(\|U(g\cdot x)\|_F, \|g\cdot U(x)\|_F)},$$

zero exactly when $U$ commutes with $g$ at $x$ (0 when both sides vanish). Three kinds of
update share it, each wrapped in a *subject* that builds examples, evaluates and acts:

* :class:`MapUpdate` — a pure map $D \mapsto U(D)$ (``geomuon.optimizers.maps``); the group
  moves the input with ``act`` and the output with ``act_output``;
* :class:`DirectionUpdate` — the steepest direction $A(W, G)$ of an engine on a
  manifold: $A(g\cdot W, g\cdot G)$ against $g\cdot A(W, G)$, the weights moved by
  ``act_point``, the gradient by ``act_gradient`` (the symmetry of the loss, see
  :mod:`geomuon.theory.groups`);
* :class:`OptimizerUpdate` — whole optimizer steps, momentum and other state included: two
  fresh optimizers start from $W_0$ and $g\cdot W_0$ and receive the gradients $G_t$ and
  $g\cdot G_t$; the residual is $\max_t \|W'_t - g\cdot W_t\|$ relative to the path
  $\sum_{s\le t}\|g\cdot W_s - g\cdot W_{s-1}\|$ travelled so far, or the twin's if longer (a
  tiny learning rate cannot hide a broken step), from the first step that moves either
  trajectory (an optimizer that only sets up its state on its first step is measured from its
  second).

**The tolerance is the map's own noise floor, measured.** An *exactly* equivariant update
computed in floating point differs from $g\cdot U(x)$ only through round-off: the
rounding of $g\cdot x$, amplified by whatever sensitivity the update has at $x$, its own
internal rounding, and the rounding of $g\cdot U(x)$. Each trial re-creates exactly these
perturbations on the same input and measures how far they move the output, in the same
relative measure as $r$:

1. the input perturbed at the round-off of the compute dtype, at $x$ and at $g\cdot x$:
   $x\odot(1 + \delta\xi) + \delta\,\mathrm{rms}(x)\,\xi'$ with $\xi, \xi' \sim \mathcal N(0, 1)$
   entrywise and $\delta = \sqrt n\,\varepsilon$ ($\varepsilon$ = ``torch.finfo(compute_dtype).eps``;
   $\sqrt n$: an inner product of length $n$ accumulated in the dtype has a backward error
   of order $\sqrt n\,u$; half precisions accumulate in float32, so for them
   $\delta = \varepsilon$). The relative part is the rounding of every entry and internal
   cast, the additive part the noise a rotation leaves in exact zeros; probing at $g\cdot x$
   too catches internal round-off that depends on the input's structure (a dense $g\cdot x$
   against a sparse $x$). For optimizer steps and steepest directions the weights are
   perturbed at the storage dtype and the gradients at the compute dtype;
2. the round trip $g^{-1}\cdot(g\cdot x)$ computed in the dtype (two roundings of the very
   action in $r$, where $r$ has one: exact for permutations, normwise for rotations);
3. the output round trip $g^{-1}\cdot(g\cdot U(x))$ against $U(x)$ (the rounding of the
   output action);

and the floor $\nu$ is the largest of them and $\varepsilon$. In the linearized model
both $r$ and each probe are norms of $J\,e$ for the update's Jacobian $J$ at $x$ and a
round-off vector $e$ of the same law, so their ratio is of order one whatever the input's
conditioning: the floor grows with the condition number exactly as much as the update's
own sensitivity does (a polar factor's by $\kappa$, a Gram-based map's by $\kappa^2$), and
not at all for maps insensitive to it (a power iteration, a sign, a row normalization). A
trial

* **holds** when $r \le$ :data:`HOLDS_FACTOR` $\cdot\,\nu$ ($=8\nu$: the probes carry at
  least the action's rounding, so for an equivariant update the ratio is of order one;
  measured on SVD and Newton–Schulz polar factors, one-sided polar maps, row/column
  normalizations and centered maps, 2x2 to 256x128, float32 and float64, over every input
  kind, the largest was 7.7 and 99% stayed below 3.5);
* is **violated** when $r >$ :data:`VIOLATION_FACTOR` $\cdot\,\nu$ ($=64\nu$, eight times
  beyond that) or when $r$ is not finite; before a trial is called violated (or left
  inconclusive) its floor is re-measured with :data:`CONFIRMATION_PROBES` more probes, so a
  map *discontinuous* at $x$ (a sign decided by round-off) is not mistaken for a broken one;
* is **inconclusive** in between, and **unresolved** when $64\nu \ge 2$ (2 is the largest
  relative residual): the update's own round-off is so large there that not even an
  $O(1)$ violation could be called.

**Narrow dtypes: the float64 witness.** In a dtype $d$ narrower than float64 two things
blind the rule above. A map *discontinuous at round-off distance* (an entrywise sign, a
threshold, a gate on one entry) jumps under the probes wherever an entry sits within
$d$'s round-off of the jump: the additive part flips near-zero entries, so in bfloat16 at
64x32 ``sign``'s floor is 0.1-0.9 and nothing resolves, although under signed permutations
$g\cdot x$ is exact and its residual is exactly 0. And $d$'s floor caps what can be seen:
eight bf16 floors are 0.14 at 64x32, more than a row-normalized msign's 0.12 violation.
So every trial in $d$ that is not violated is judged again by its **witness**: the same
input $x$ (every dtype embeds exactly in float64), the update evaluated in float64 and $g$
applied in float64, with the float64 floor recipe — unless the update may round to a
narrower dtype inside (an optimizer or a steepest direction, a stated ``compute_dtype``,
or a map whose float64 output does not move under a relative perturbation of $2^{-30}$),
in which case relative-only probes at $d$'s size on its directions and gradients join the
floor, which keeps
"equivariant up to bfloat16" meaning what it says. By the triangle inequality the dtype
residual differs from the witness's only by the dtype evaluation's own error at $x$ and
$\mathrm{fl}(g\cdot x)$ and the roundings of $g\cdot x$ and $g\cdot U(x)$: round-off, which the
witness leaves out and the dtype trial cannot — provided the two evaluations *are* that
round-off apart: the witness decides wherever it resolves and its output at $x$ is within
:data:`HOLDS_FACTOR` relative-only probes of $d$'s (and at $g\cdot x$ within that many of the
trial's floors; :func:`run_trial`), the trial's ``route`` saying which did; it does not apply to an update that returns a
narrower dtype for float64 inputs, or fails in float64. A violation found in $d$ itself
stands.

A check draws ``trials`` independent trials (default 40; more while fewer than :data:`MIN_TRIALS`
$= 20$ are resolved, below) and is

* *error* if the update raised or returned a non-finite output on any input;
* *violated* if any trial is (the report names the trial, its input kind and scale, the
  group element, the seed and this derivation);
* *holds* if every resolved trial holds and at least :data:`MIN_TRIALS` are resolved (more
  trials are drawn, up to :data:`EXTENSION` times, while fewer are), so a map broken on
  half the draws is missed with probability $\le 2^{-20} < 10^{-6}$;
* *inconclusive* otherwise: some trial between $8\nu$ and $64\nu$ after its confirming
  probes and its witness, or fewer than :data:`MIN_TRIALS` resolved after the extension
  (the update's round-off swamps an $O(1)$ violation on most inputs: check in a wider
  dtype or at a smaller condition).

**Inputs are adversarial by default** (:data:`KINDS`, cycled over trials, each at a scale
from :data:`SCALES`, $10^{-8}$ to $10^8$ in steps of 100 — those nine scales only, not the
range between them (*What the check cannot see*, below); a dtype of narrower range, float16, keeps
the scales it holds, :func:`trial_scales`): Gaussian, condition number ``condition``,
clustered top singular values ($\sigma_2/\sigma_1 \ge 0.999$), exactly repeated ones,
rank-deficient, zero rows and columns, small integers, sparse. Seeds are drawn fresh per
run and printed; ``seed=`` replays a run exactly. A router shift $\mathbf 1v^\top$ is drawn at
the trial's input scale, so that it neither vanishes in nor swamps the input's round-off.
Optimizer steps and steepest directions start from Gaussian points when a manifold's
``projx`` needs them (it refuses zero columns); their gradients get every kind.

**What the check cannot see.** It judges the update at the inputs it draws, against the update's
own response to round-off, so four kinds of break pass it:

* a violation that itself jumps with the input's bits — a dither seeded from a hash of $D$'s
  bytes, $U(D) + c\,\mathrm{rms}(U(D))\,\xi_{\mathrm{hash}(D)}$: every round-off probe reseeds it
  as $g$ does, so residual and floor are the same jump (ratio about 1, within
  :data:`HOLDS_FACTOR`) and the check *holds* while the floor resolves ($64\nu < 2$; at 8x5
  $\nu \approx 1.6c$, so up to $c \approx 0.02$), and is *inconclusive*, never violated, beyond.
  Seed randomness from what the group leaves unchanged (a step counter, a norm), or check the
  update with it fixed;
* a branch on an absolute threshold $T$ of a statistic the group changes
  ($\max_{ij}|D_{ij}| > T$): it breaks only where $D$ and $g\cdot D$ fall on either side of $T$,
  a band of input scales (Gaussian 8x5 inputs of RMS about $T/3.5$ to $T/1.8$, a factor 2)
  narrower than the steps of :data:`SCALES`, so it is found only when a trial's scale falls in
  the band. ``check_equivariance`` takes no scales: judge inputs drawn at the threshold's scale
  (:func:`adversarial_matrix` ``scale=``) with :func:`run_trial`, or check that the branch's
  statistic is invariant (a threshold relative to $\|D\|_F$ is, under the orthogonal groups);
* breaks that need size: an entry of an $m\times n$ input is at most $\sqrt{mn}$ times its RMS
  entry, so a clip at $k$ times the RMS never acts while $mn \le k^2$ (at 8x5 for
  $k \ge \sqrt{40} \approx 6.3$), and the drawn kinds come near that bound only at large sizes
  (sparse and rank-deficient ones: a clip at 10x the RMS held at 64x32 and was violated at
  256x128): check at the shapes the update will see;
* an optimizer whose update changes after the ``steps`` steps it is stepped
  (:class:`OptimizerUpdate`, default 3).

**Structured inputs** (``structured=True``). A map can be equivariant on generic inputs and
broken only on a set of measure zero they never hit: a tie (a one-hot of each column's argmax
gives a tie to the lowest index), an exact zero (a guard that revives a dead column with a fixed
unit vector, $\operatorname{sign}(0) = +1$), exactly repeated singular values or rank 0 (an
identity pattern returned at $D = 0$). The kinds that do hit them (:data:`STRUCTURED_KINDS`) cannot
call it: the probes above break the tie and fill the zero the map jumps at, its floor there is
$O(1)$ and the trial *unresolved* (a *holds* verdict names such kinds, "Not seen"). Whether the
claim holds there is for the user to declare, not for the checker to guess: at those inputs a
correct map may be **set-valued** — the polar factor of a rank-deficient matrix (of 0) is any of a
set, and LAPACK's pick is no equivariant choice; at a tie no single index is — and then only the
generic claim is meant, which the default check tests. ``structured=True`` declares the update
single-valued and equivariant at *every* input. The check then draws
:data:`STRUCTURE_ONLY_KINDS` too (a scaled signed partial permutation: every singular value
exactly equal; an integer matrix of exact low rank; 0), and judges each trial on a structured kind
a second time, at the same input, *exactly*: with an element of the group's exact subgroup
(:meth:`~geomuon.theory.groups.Group.sample_exact`: signed permutations for rotations, powers of
two for scalings, so $g\cdot x$ and both round trips round nothing and keep every tie, zero,
repeated singular value and exact rank of $x$; a shift group's shift only on inputs on its grid)
and probes that keep the structure too (one
relative factor per distinct magnitude of $x$: equal entries stay equal, zeros zero, signs
signs). An exactly equivariant single-valued map's residual there is its own internal round-off,
which those probes re-create; a map that special-cases the structure jumps under neither the
element nor the probes, and is violated. The more decisive of a trial's two verdicts is its own
(``route`` ``"exact element"`` when the exact one decided). The comparison stays at one
representative: at a structured $x$ an equivariant function's value is fixed by $x$'s
stabilizer, so *any* selection from a set of values is violated there — which is why the
declaration is the user's. Limits: exact low rank is kept by the element, not by the probes (a
rank test keyed to round-off is unresolved there; one with a tolerance above round-off is caught
by the ``rank_deficient`` kind already), and a group of one's own without a ``sample_exact`` is
sampled as usual (its rounding leaves the structure: such trials stay unresolved, never a false
alarm). Each structured-kind trial costs about twice the evaluations.

**Batches.** A ``shape`` ``(*batch, m, n)`` checks an update of stacked matrices (the optimizers
batch same-shape parameters): every member of a trial's input is its own draw of the trial's
kind at its scale, and by default its own group element ($g_b$, stacked by
:func:`~geomuon.theory.groups.stack_elements`: the symmetry group of a stack of independent
parameters is the product of theirs), so an update that mixes members — a reduction over the
batch dimension, a stack flattened into one matrix — is violated, and so is a coupling through
each member's invariants (a stack-wide norm, which commutes with every element): such a trial
also compares each member's output with its output alone (:func:`_batch_mates`). One element
shared by the stack (``batch_elements="shared"``, for an update that couples its members on
purpose) moves every member alike, lets such mixing commute and runs no members-alone test. Residual and floor are taken over the whole stack
(its members share a scale, so none is swamped). :func:`hypothesis_cases` draws single matrices.

``compute_dtype`` states the precision to hold: a float32 or float64 check of an update that
computes in bfloat16 internally (Muon's Newton–Schulz) measures its floor at bf16 round-off,
and a *holds* verdict then reads "equivariant up to bfloat16".

Users call :func:`assert_equivariant` from their own tests, :func:`verify_declaration` for a
hypothesis search that shrinks a counterexample, or the CLI ``geomuon check-equivariance``
(:mod:`geomuon.theory.cli`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from geomuon.manifolds.linalg import check_count, check_real
from geomuon.theory.groups import (
    Group,
    GroupElement,
    TwoSidedGroup,
    get_group,
    haar_orthogonal,
    random_signed_permutation,
    sample_shapes,
    stack_elements,
)

__all__ = [
    "KINDS",
    "STRUCTURED_KINDS",
    "STRUCTURE_ONLY_KINDS",
    "SCALES",
    "SCALE_HEADROOM",
    "trial_scales",
    "finer_precision",
    "scale_index",
    "MIN_TRIALS",
    "CONFIRMATION_PROBES",
    "EXTENSION",
    "HOLDS_FACTOR",
    "VIOLATION_FACTOR",
    "VERDICTS",
    "EXIT_CODES",
    "SUB_ROUNDOFF",
    "MapUpdate",
    "NondeterministicUpdateError",
    "InputWrittenError",
    "GroupLeavesManifoldError",
    "DirectionUpdate",
    "OptimizerUpdate",
    "map_residual",
    "direction_residual",
    "step_residual",
    "condition_number",
    "random_matrix",
    "adversarial_matrix",
    "Trial",
    "run_trial",
    "EquivarianceReport",
    "check_equivariance",
    "assert_equivariant",
    "Case",
    "hypothesis_cases",
    "verify_declaration",
]

#: Input kinds a check cycles through (see :func:`adversarial_matrix`).
KINDS = ("gaussian", "conditioned", "clustered", "repeated", "rank_deficient", "zero_lines", "integer", "sparse")
#: Kinds whose structure is exact in floating point — ties, exact zeros, exactly repeated singular
#: values, exact low rank, the zero matrix — which a ``structured`` check also judges exactly
#: (module docstring, *Structured inputs*).
STRUCTURED_KINDS = ("zero_lines", "integer", "sparse", "orthogonal", "low_rank", "zero")
#: The structured kinds only a ``structured`` check draws by default: at them a set-valued map
#: (an SVD polar factor of the zero matrix) has no equivariant value, so an unstructured check
#: leaves them out.
STRUCTURE_ONLY_KINDS = ("orthogonal", "low_rank", "zero")
#: Kinds drawn at unit scale, whatever the trial's scale (their entries are exact small integers).
UNSCALED_KINDS = ("integer", "low_rank", "zero")
#: Input scales (RMS entry), cycled independently of the kinds: $10^{-8}, 10^{-6}, \dots, 10^{8}$.
SCALES = tuple(10.0**k for k in range(-8, 9, 2))
#: Decades of range a trial's scale keeps clear of its dtype's limits (:func:`trial_scales`).
SCALE_HEADROOM = 1e4
#: Resolved trials a *holds* verdict needs: $2^{-20} < 10^{-6}$ chance of missing a map that
#: breaks on half the draws.
MIN_TRIALS = 20
#: A trial holds when its residual is within this many noise floors (see the module docstring).
HOLDS_FACTOR = 8.0
#: A trial is violated when its residual exceeds this many noise floors.
VIOLATION_FACTOR = 64.0

#: Entrywise probes (each at $x$ and at $g\cdot x$) that re-measure the floor of a trial that
#: is not a clear *holds* — every inconclusive one, and violated ones until one is confirmed.
#: A map discontinuous at $x$ (a sign decided by round-off, e.g. the SVD's null pair of a
#: singular square matrix) jumps under each probe with probability about 1/2, so it is
#: mistaken for a violation with probability about $2^{-17}$.
CONFIRMATION_PROBES = 8
#: A check draws up to this many times its ``trials`` while fewer than ``min_trials`` are
#: resolved (an update whose floor is too large on some input kinds).
EXTENSION = 3
#: The verdicts of a check, in order of precedence.
VERDICTS = ("error", "violated", "inconclusive", "holds")
#: CLI exit status of each verdict (2 is a usage error).
EXIT_CODES = {"holds": 0, "violated": 1, "inconclusive": 3, "error": 4}

DERIVATION = (
    "tolerance = the update's own round-off floor on this input, measured: the largest relative output "
    "change under (1) perturbations of x and of g.x at the round-off of {compute} (eps = {eps:.1e}, times "
    "sqrt(n) for float32/64), (2) the round trip g^-1(g x) in {dtype}, (3) the output round trip "
    "g^-1(g U(x)); an exactly equivariant update's residual comes from the same round-off, so it holds "
    "within {holds:g}x the floor and is violated beyond {violated:g}x (inconclusive between)"
)
WITNESS = (
    "; in {dtype} each trial that is not violated is judged again by its float64 witness (same inputs, the "
    "update in float64, g applied in float64, float64 round-off, plus relative probes at {compute}'s size where "
    "the update may round inside), which sees past the rounding of g.x and {compute}'s floor; route "
    "'float64 witness' marks the trials it decided"
)


def _members(x) -> tuple[torch.Tensor, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(t for part in x for t in _members(part))


def _norm(x) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in _members(x)))


def _distance(a, b) -> float:
    return math.sqrt(sum(float((p.double() - q.double()).pow(2).sum()) for p, q in zip(_members(a), _members(b))))


def _relative(actual, expected) -> float:
    r"""$\|a - e\| / \max(\|a\|, \|e\|)$ over (nested) tuples; 0 when both vanish, NaN
    propagates."""
    diff = _distance(actual, expected)
    if diff == 0.0:
        return 0.0
    return diff / max(_norm(actual), _norm(expected))


def _tensors(x) -> bool:
    """Whether ``x`` is a tensor or a non-empty (nested) tuple or list of them."""
    if isinstance(x, torch.Tensor):
        return True
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(_tensors(part) for part in x)


def _copied(x):
    """A (nested) example with every tensor cloned: the update gets inputs it may write to."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    copied = [_copied(part) for part in x]
    return tuple(copied) if isinstance(x, tuple) else copied


def _finite(x) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _members(x))


def map_residual(update: Callable, element: GroupElement, D) -> float:
    r"""$\|U(g\cdot D) - g\cdot U(D)\| / \max(\|U(g\cdot D)\|, \|g\cdot U(D)\|)$ for a pure map
    (``D`` a tensor, or a tuple for joint groups, in which case ``update`` maps tuples to
    tuples)."""
    return _relative(update(element.act(D)), element.act_output(update(D)))


def _direction(engine: Callable, manifold, W, G, solver: dict) -> torch.Tensor:
    result = engine(manifold, W, G, **solver)
    return result if isinstance(result, torch.Tensor) else result.direction


def direction_residual(engine: Callable, manifold, element: GroupElement, W, G, **solver) -> float:
    r"""$\|A(gW, gG) - g\,A(W, G)\| / \max(\cdot)$ for ``A = engine(manifold, W, G, **solver)``
    (a tensor, or a result with a ``direction`` field); $W$ moves by ``act_point``, $G$ by
    ``act_gradient``."""
    A = _direction(engine, manifold, W, G, solver)
    A_g = _direction(engine, manifold, element.act_point(W), element.act_gradient(G), solver)
    return _relative(A_g, element.act_output(A))


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _trajectory(optimizer: torch.optim.Optimizer, gradients: Sequence) -> list[tuple[torch.Tensor, ...]]:
    """The parameters before and after each step with ``gradients`` (one entry per step: a
    tensor, or a tuple with one tensor per parameter in ``param_groups`` order)."""
    params = _parameters(optimizer)
    path = [tuple(p.detach().clone() for p in params)]
    for G in gradients:
        for p, g in zip(params, _members(G)):
            p.grad = g.detach().clone()
        optimizer.step()
        path.append(tuple(p.detach().clone() for p in params))
    return path


def _path_residual(actual: Sequence, expected: Sequence) -> float:
    r"""$\max_t \|a_t - e_t\| / \max(\ell^a_t, \ell^e_t)$, $\ell^e_t = \sum_{s \le t}\|e_s - e_{s-1}\|$
    the path travelled so far (likewise $\ell^a_t$), over the steps $t$ from the first at which
    either path moves (0 for identical paths; at most $2 + \|a_0 - e_0\|/\max(\ell^a_t, \ell^e_t)$).

    The larger of the two paths, as :func:`_relative` takes the larger of two norms: in float32
    a step of $10^{-1}$ on weights of $10^8$ is below their round-off, so whether an entry moves
    is decided by its rounding, and one path moving by an ulp where the other does not had been
    a residual of $\infty$ ("violated") for an exactly equivariant optimizer. Before either path
    has moved their difference is their starts' (a probe's round-off of $W_0$, the round trip
    $g^{-1}(g\cdot W_0)$), not a step's: measured against a path of length 0 it had made the
    floor of an optimizer that only sets up its state on its first step (SOAP's, a delayed
    start) infinite on every trial, and the check inconclusive whatever the optimizer. Paths
    that never move give 0 when identical and $\infty$ otherwise: no step was taken, so such a
    trial is unresolved, never a vacuous *holds*."""
    travelled, travelled_actual, worst, start_gap = 0.0, 0.0, 0.0, 0.0
    for t in range(1, len(expected)):
        # Path length, not distance from the start: a trajectory can come back to W_0 (a
        # rotation and its reverse), where the distance vanishes but the round-off does not.
        travelled += _distance(expected[t], expected[t - 1])
        travelled_actual += _distance(actual[t], actual[t - 1])
        diff = _distance(actual[t], expected[t])
        if math.isnan(diff):
            return math.nan
        path = max(travelled, travelled_actual)
        if path == 0.0:
            start_gap = max(start_gap, diff)
        else:
            worst = max(worst, diff / path)
    return math.inf if max(travelled, travelled_actual) == 0.0 and start_gap > 0 else worst


def _fresh_optimizer(make_optimizer: Callable, start) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(t.detach().clone()) for t in _members(start)]
    optimizer = make_optimizer(params)
    # a factory that returns None (a missing ``return``) had failed inside the first step as
    # "'NoneType' object has no attribute 'param_groups'", naming neither the factory nor the fix
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise TypeError(f"OptimizerUpdate's make_optimizer {getattr(make_optimizer, '__name__', repr(make_optimizer))} "
                        f"returned a {type(optimizer).__name__}, not an optimizer: it must build and return one over "
                        "the parameters it is given, e.g. lambda params: MyOptimizer(params, lr=0.05)")
    return optimizer


def step_residual(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    element: GroupElement,
    start,
    gradients: Sequence,
) -> float:
    r"""Largest $\|W'_t - g\cdot W_t\|$ over the steps $t$, relative to the path travelled so far
    (the longer of the two trajectories', :func:`_path_residual`).

    Two fresh optimizers ``make_optimizer(params)`` are stepped, one from ``start`` ($W_0$,
    a tensor or a tuple for several parameters) with ``gradients`` $G_t$, one from
    $g\cdot W_0$ (``act_point``) with $g\cdot G_t$ (``act_gradient``).
    """
    def pack(tensors):
        return tensors[0] if isinstance(start, torch.Tensor) else tuple(tensors)

    plain = _trajectory(_fresh_optimizer(make_optimizer, start), gradients)
    twin = _trajectory(
        _fresh_optimizer(make_optimizer, element.act_point(start)), [element.act_gradient(G) for G in gradients]
    )
    return _path_residual(twin, [element.act_point(pack(w)) for w in plain])


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


def _with_spectrum(shape, sigma: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    m, n = shape
    r = min(m, n)
    U = haar_orthogonal(m, generator)[:, :r]
    V = haar_orthogonal(n, generator)[:, :r]
    return (U * sigma) @ V.mT


def random_matrix(
    shape: tuple[int, int],
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
    condition: float = 100.0,
) -> torch.Tensor:
    r"""$U\operatorname{diag}(s)V^\top$ with Haar $U, V$ and $s$ geometric from 1 to
    $1/\text{condition}$ (shuffled), so $\kappa_2$ is exactly ``condition``. Computed in
    float64, returned in ``dtype``."""
    r = min(shape)
    s = torch.logspace(0, -math.log10(condition), r, dtype=torch.float64)
    return _with_spectrum(shape, s[torch.randperm(r, generator=generator)], generator).to(dtype)


def adversarial_matrix(
    shape: tuple[int, int],
    kind: str,
    generator: torch.Generator,
    *,
    scale: float = 1.0,
    condition: float = 1e3,
) -> torch.Tensor:
    r"""A float64 ``[m, n]`` matrix of one of the :data:`KINDS` or :data:`STRUCTURE_ONLY_KINDS`, with
    RMS entry ``scale`` (those of :data:`UNSCALED_KINDS` keep their integer entries, unscaled):

    * ``gaussian``: i.i.d. $\mathcal N(0, 1)$;
    * ``conditioned``: :func:`random_matrix` with $\kappa_2$ = ``condition``;
    * ``clustered``: $\sigma_1 = 1$, $\sigma_2 \in [0.999, 1)$, the rest geometric in
      $[1/\text{condition}, 1/2]$ (power iterations and gap-dependent maps fail here);
    * ``repeated``: the top half of the singular values exactly 1, the rest in $[0.1, 0.5]$;
    * ``rank_deficient``: rank $\lceil r/2\rceil - 1$ or 1 (alternating by draw), zero singular values;
    * ``zero_lines``: Gaussian with a quarter of the rows and of the columns (at least one
      each when $m, n \ge 2$) set to zero;
    * ``integer``: entries uniform in $\{-3, \dots, 3\}$ (ties, exact zeros);
    * ``sparse``: Gaussian entries kept with probability 0.1 (at least one);
    * ``orthogonal``: a signed partial permutation times a constant: orthogonal columns (rows,
      when $m < n$) of equal norm, so every singular value is exactly the same, and every
      nonzero entry has the same magnitude (ties);
    * ``low_rank``: $\sum_{k \le \max(1, \lfloor r/2\rfloor)} u_k v_k^\top$, entries of $u_k, v_k$
      uniform in $\{-2, \dots, 2\}$: exact integers, so its rank is exactly at most
      $\lfloor r/2\rfloor$ in floating point (and its entries tie);
    * ``zero``: $D = 0$ (every singular value repeated, every entry tied).
    """
    m, n = shape
    r = min(m, n)
    if kind == "gaussian":
        x = torch.randn(m, n, generator=generator, dtype=torch.float64)
    elif kind == "conditioned":
        x = random_matrix(shape, generator, condition=condition)
    elif kind in ("clustered", "repeated"):
        if kind == "clustered":
            top = torch.tensor([1.0, 1.0 - 1e-3 * float(torch.rand((), generator=generator, dtype=torch.float64))])
            rest = torch.logspace(math.log10(0.5), -math.log10(condition), max(r - 2, 0), dtype=torch.float64)
            sigma = torch.cat([top, rest])[:r]
        else:
            half = (r + 1) // 2
            sigma = torch.cat([torch.ones(half, dtype=torch.float64),
                               torch.linspace(0.5, 0.1, r - half, dtype=torch.float64)])
        x = _with_spectrum(shape, sigma, generator)
    elif kind == "rank_deficient":
        rank = 1 if int(torch.randint(0, 2, (), generator=generator)) else max(1, (r + 1) // 2 - 1)
        sigma = torch.zeros(r, dtype=torch.float64)
        sigma[:rank] = torch.logspace(0, -1, rank, dtype=torch.float64)
        x = _with_spectrum(shape, sigma, generator)
    elif kind == "zero_lines":
        x = torch.randn(m, n, generator=generator, dtype=torch.float64)
        if m >= 2 and n >= 2:
            x[torch.randperm(m, generator=generator)[: max(1, m // 4)]] = 0.0
            x[:, torch.randperm(n, generator=generator)[: max(1, n // 4)]] = 0.0
    elif kind == "integer":
        return torch.randint(-3, 4, (m, n), generator=generator).to(torch.float64)
    elif kind == "sparse":
        x = torch.randn(m, n, generator=generator, dtype=torch.float64)
        keep = torch.rand(m, n, generator=generator) < 0.1
        keep.view(-1)[int(torch.randint(0, m * n, (), generator=generator))] = True
        x = x * keep
    elif kind == "orthogonal":
        x = random_signed_permutation(max(m, n), generator)[:m, :n]
    elif kind == "low_rank":
        rank = max(1, r // 2)
        u, v = (torch.randint(-2, 3, (k, rank), generator=generator).to(torch.float64) for k in (m, n))
        return u @ v.mT
    elif kind == "zero":
        return torch.zeros(m, n, dtype=torch.float64)
    else:
        raise ValueError(f"adversarial_matrix: unknown kind {kind!r}; choose from {KINDS + STRUCTURE_ONLY_KINDS}")
    rms = float(x.pow(2).mean().sqrt())
    return x * (scale / rms) if rms > 0 else x


def _perturbed(x, eps: float, generator: torch.Generator, additive: bool = True, tied: bool = False):
    r"""$x\odot(1 + \varepsilon\xi) + \varepsilon\,\mathrm{rms}(x)\,\xi'$ for every tensor of a
    (nested) example, in its dtype: relative round-off of every entry, plus the normwise
    round-off a rotation leaves in exact zeros (a zero row of $x$ is not zero in $g\cdot x$).
    ``additive=False`` keeps the relative part only (signs and exact zeros kept). ``tied=True``
    keeps every exact structure: $x_{ij}(1 + \varepsilon\xi_{|x_{ij}|})$, one $\xi$ per distinct
    magnitude, so equal entries stay equal, opposite ones opposite, zeros zero (the probes of a
    structured trial: ties, zero lines, a scaled signed permutation's repeated singular values
    and an integer matrix's exact rank are kept; distinct entries get independent round-off)."""
    if isinstance(x, torch.Tensor) and tied:
        wide = x.double()
        magnitudes, which = torch.unique(wide.abs(), return_inverse=True)
        xi = torch.randn(magnitudes.shape, generator=generator, dtype=torch.float64)
        return (wide * (1.0 + eps * xi[which])).to(x.dtype)
    if isinstance(x, torch.Tensor):
        xi = torch.randn((2, *x.shape), generator=generator, dtype=torch.float64)
        wide = x.double()
        rms = wide.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt() if wide.dim() >= 2 else wide.abs()
        return (wide * (1.0 + eps * xi[0]) + (eps * rms * xi[1] if additive else 0.0)).to(x.dtype)
    perturbed = [_perturbed(part, eps, generator, additive, tied) for part in x]
    return tuple(perturbed) if isinstance(x, tuple) else perturbed


def _widened(x):
    """Every tensor of a (nested) example in float64 (values unchanged: every dtype embeds)."""
    if isinstance(x, torch.Tensor):
        return x.double()
    widened = [_widened(part) for part in x]
    return tuple(widened) if isinstance(x, tuple) else widened


class _Subject:
    """Common surface of the three update kinds: ``inputs`` raw matrices (each shaped like
    the group's ``shapes``) make one :meth:`example`; :meth:`evaluate` computes the output,
    :meth:`act` / :meth:`act_output` move example and output, :meth:`relative` compares
    two outputs in the measure of the residual."""

    name: str
    inputs: int

    def example(self, raws: Sequence) -> Any:
        return raws[0]

    def input_kinds(self, kind: str) -> list[str]:
        """The kind of each raw input of a trial of ``kind``: all of it, except a point
        projected onto a manifold, which is drawn Gaussian (``projx`` refuses zero columns)."""
        return [kind] * self.inputs

    def evaluate(self, example) -> Any:
        raise NotImplementedError

    def act(self, element: GroupElement, example) -> Any:
        raise NotImplementedError

    def act_output(self, element: GroupElement, output) -> Any:
        return element.act_output(output)

    def perturb(self, example, storage: float, compute: float, generator: torch.Generator,
                additive: bool = True, tied: bool = False) -> Any:
        """The example at round-off: directions (what the update computes with) at the
        ``compute`` size, weights (stored, never cast) at the ``storage`` size; ``additive``
        and ``tied`` as in :func:`_perturbed`."""
        return _perturbed(example, compute, generator, additive, tied)

    def relative(self, actual, expected) -> float:
        return _relative(actual, expected)


@dataclass
class MapUpdate(_Subject):
    """A pure map ``update(D) -> U`` (tuples in and out for joint groups); the group moves
    ``D`` with ``act`` (shifts included) and ``U`` with ``act_output``."""

    update: Callable
    name: str = ""
    inputs: int = field(default=1, init=False)

    def __post_init__(self):
        self.name = self.name or getattr(self.update, "__name__", repr(self.update))

    def evaluate(self, example):
        # a copy: a map that writes to its input in place (``D.mul_(...)``) would otherwise
        # change the example the later round trips compare against
        try:
            return self.update(_copied(example))
        except (TypeError, AttributeError) as err:
            if isinstance(example, torch.Tensor):
                raise
            # a map of one matrix under a joint group had failed as "sign(): argument 'input' must
            # be Tensor, not tuple", not saying where the tuple came from
            raise TypeError(f"{self.name} failed on the tuple of {len(example)} matrices ({_shape_of(example)}) "
                            "that a joint group (neuron-permutation: gate, up, down) hands the update: it must "
                            "take that tuple and return a tuple of tensors of the same shapes (a map U of one "
                            "matrix applied to each: lambda Ds: tuple(U(D) for D in Ds)); it raised "
                            f"{type(err).__name__}: {err}") from err

    def act(self, element, example):
        return element.act(example)


def _unit_rms_point(manifold, raw: torch.Tensor) -> torch.Tensor:
    r"""``manifold.projx`` of ``raw`` scaled to unit RMS: the trial's adversarial scale is the
    gradient's, and a raw point at $10^{\pm 8}$ tested the manifold's ``projx`` (the generic
    Gauss–Newton iteration does not reach the manifold from that far)."""
    rms = raw.square().mean().sqrt().clamp_min(torch.finfo(raw.dtype).tiny)
    return manifold.projx(raw / rms)


class GroupLeavesManifoldError(ValueError):
    """A group element moved a point of the update's manifold off it, by ``distance``
    (relative) where the check allows ``limit``: the group is no symmetry of the manifold, so
    the update cannot be equivariant under it there (:func:`run_trial` calls the trial
    *violated*, with this message, not a residual of steps taken from off the manifold)."""

    def __init__(self, message: str, distance: float, limit: float):
        super().__init__(message)
        self.distance, self.limit = distance, limit


def _moved_point(manifold, element: GroupElement, W):
    r"""$g\cdot W$, refused (:class:`GroupLeavesManifoldError`) when its linear part is off ``manifold``:
    its relative distance (:func:`~geomuon.theory.contracts.manifold_residual`, float64) above
    $10^{-3} + 16 r_W$, $r_W$ that of $W$ (a symmetry keeps $g\cdot W$ within $W$'s rounding of
    $M$, bf16 included; a group that is none moves it $O(1)$ off: a row permutation of
    unequal fixed row norms, 0.5). Without the check such trials had returned *holds* or
    *violated* about steps taken from points off the manifold."""
    from geomuon.theory.contracts import manifold_residual

    moved = element.act_point(W)
    # the linear part must keep M; a shift is a gauge the update is invariant to, which moves a
    # point off a quotient's representatives by design (router-shift on CenteredRouterSpace)
    linear = dataclasses.replace(element, shift=None).act_point(W) if getattr(element, "shift", None) is not None \
        else moved
    for before, after in zip(_members(W), _members(linear)):
        off, own = manifold_residual(manifold, after), manifold_residual(manifold, before)
        limit = 1e-3 + 16 * own
        if off > limit:
            raise GroupLeavesManifoldError(
                f"the group does not preserve {type(manifold).__name__}: g.W is {off:.2e} (relative) off it where W "
                f"is {own:.1e}, so no update on it is equivariant under this group (check it under the manifold's "
                "symmetries)", off, limit)
    return moved


@dataclass
class DirectionUpdate(_Subject):
    """The steepest direction ``engine(manifold, W, G, **solver)`` on ``manifold``.

    Examples are ``(W, G)`` with ``W`` on the manifold (:func:`_unit_rms_point` of a Gaussian);
    the group moves ``W`` with ``act_point`` (refused when it leaves the manifold,
    :func:`_moved_point`) and ``G`` with ``act_gradient``."""

    engine: Callable
    manifold: Any
    solver: dict = field(default_factory=dict)
    name: str = ""
    inputs: int = field(default=2, init=False)

    def __post_init__(self):
        self.name = self.name or f"steepest[{type(self.manifold).__name__}]"

    def example(self, raws):
        return _unit_rms_point(self.manifold, raws[0]), raws[1]

    def input_kinds(self, kind):
        return ["gaussian", kind]

    def evaluate(self, example):
        W, G = example
        return _direction(self.engine, self.manifold, W, G, self.solver)

    def act(self, element, example):
        W, G = example
        return _moved_point(self.manifold, element, W), element.act_gradient(G)

    def perturb(self, example, storage, compute, generator, additive=True, tied=False):
        W, G = example
        return _perturbed(W, storage, generator, additive, tied), _perturbed(G, compute, generator, additive, tied)


@dataclass
class OptimizerUpdate(_Subject):
    """Whole optimizer steps: ``make_optimizer(params) -> Optimizer`` over fresh
    ``torch.nn.Parameter`` copies of ``W_0`` (one per member for joint groups).

    Examples are ``(W_0, [G_1, ..., G_steps])``; ``W_0`` is put on ``manifold`` when one is
    given (:func:`_unit_rms_point`; the group's move of it is checked, :func:`_moved_point`). The output is the trajectory $W_0, W_1, \\dots$; the group moves weights
    with ``act_point`` and gradients with ``act_gradient``, and the residual is relative to
    the path travelled (:func:`step_residual`). Only the first ``steps`` steps are seen: an
    update that changes after more (a preconditioner refreshed every $k$ steps, a warm-up, a
    cold first step) needs ``steps`` past that point."""

    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    name: str = ""
    manifold: Any = None
    steps: int = 3
    inputs: int = field(default=0, init=False)

    def __post_init__(self):
        self.name = self.name or getattr(self.make_optimizer, "__name__", "optimizer")
        # steps=2.5 had passed and failed every trial's example ("error", blamed on the optimizer)
        check_count("OptimizerUpdate", "steps", self.steps, least=1)
        self.inputs = 1 + self.steps

    def _start(self, raw):
        return _unit_rms_point(self.manifold, raw) if self.manifold is not None else raw

    def input_kinds(self, kind):
        return ["gaussian" if self.manifold is not None else kind] + [kind] * self.steps

    def example(self, raws):
        start = raws[0]
        start = tuple(self._start(t) for t in start) if isinstance(start, tuple) else self._start(start)
        return start, list(raws[1:])

    def evaluate(self, example):
        start, gradients = example
        path = _trajectory(_fresh_optimizer(self.make_optimizer, start), gradients)
        return [w[0] if isinstance(start, torch.Tensor) else w for w in path]

    def act(self, element, example):
        start, gradients = example
        moved = _moved_point(self.manifold, element, start) if self.manifold is not None else element.act_point(start)
        return moved, [element.act_gradient(G) for G in gradients]

    def act_output(self, element, output):
        return [element.act_point(w) for w in output]

    def perturb(self, example, storage, compute, generator, additive=True, tied=False):
        start, gradients = example
        return (_perturbed(start, storage, generator, additive, tied),
                _perturbed(gradients, compute, generator, additive, tied))

    def relative(self, actual, expected):
        return _path_residual(actual, expected)


def _as_subject(update) -> _Subject:
    if isinstance(update, _Subject):
        return update
    optimizer_class = update if isinstance(update, type) else type(update)
    if issubclass(optimizer_class, torch.optim.Optimizer):
        # it had been called as a map, D -> SGD(D), and torch's "params argument given to the
        # optimizer should be an iterable of Tensors" reported as the update's error
        raise TypeError(f"update {optimizer_class.__name__} is an optimizer, not a map D -> U: check its steps with "
                        f"OptimizerUpdate(lambda params: {optimizer_class.__name__}(params, lr=0.05)) as the update "
                        "(from geomuon.theory.equivariance; a factory of fresh optimizers, steps=3 by default)")
    if not callable(update):
        raise TypeError(f"update must be a callable D -> U or a MapUpdate/DirectionUpdate/OptimizerUpdate, "
                        f"got {type(update).__name__}")
    return MapUpdate(update)


def _as_group(group) -> Group:
    """A group given by name, instance or class (instantiated: groups take no arguments)."""
    if isinstance(group, str):
        return get_group(group)
    if isinstance(group, type) and issubclass(group, Group):
        return group()
    if not isinstance(group, Group):
        raise TypeError(f"group must be a Group, a Group subclass or a group name (geomuon.theory.groups.GROUPS), "
                        f"got {type(group).__name__}")
    return group


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def finer_precision(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether ``dtype`` resolves more than ``than`` (a smaller machine epsilon; compared by eps,
    not bytes: float16 is finer than bfloat16 at the same size)."""
    return _eps(dtype) < _eps(than)


@dataclass
class Trial:
    """One (input, group element) draw: the residual, the measured noise floor, the verdict
    (``holds`` / ``inconclusive`` / ``violated`` / ``unresolved`` / ``error``) and what is
    needed to reproduce it."""

    index: int
    kind: str
    scale: float
    residual: float
    floor: float
    verdict: str
    element: GroupElement | None = None
    error: str = ""
    #: ``"dtype"``: measured in the check's dtype; ``"float64 witness"``: the dtype trial could
    #: not decide and the float64 witness at the same inputs did (:func:`run_trial`);
    #: ``"exact element"``: a structured check's exact trial decided (:func:`_structured`).
    route: str = "dtype"

    @property
    def ratio(self) -> float:
        """Residual in noise floors."""
        return self.residual / self.floor if self.floor > 0 else math.inf


def _perturbation(compute_dtype: torch.dtype, example) -> float:
    r"""Relative size of the entrywise probe: $\sqrt n\,\varepsilon$ for float32/float64 (an
    inner product of length $n$ accumulated in the dtype has a backward error of order
    $\sqrt n\,u$), $\varepsilon$ for half precisions (their kernels accumulate in float32, so
    what remains is one rounding per result)."""
    eps = _eps(compute_dtype)
    if torch.finfo(compute_dtype).bits <= 16:
        return eps
    return math.sqrt(max(max(t.shape[-2:]) for t in _members(example))) * eps


def _judge(residual: float, floor: float) -> str:
    if not math.isfinite(residual) or residual > VIOLATION_FACTOR * floor:
        return "violated"
    if VIOLATION_FACTOR * floor >= 2.0:  # 2: the largest relative residual of two outputs
        return "unresolved"

    return "holds" if residual <= HOLDS_FACTOR * floor else "inconclusive"


def _floor(eps: float, changes: Sequence[float]) -> float:
    return max(eps, *(c if math.isfinite(c) else math.inf for c in changes))


class InputWrittenError(RuntimeError):
    """An update wrote into the example it was handed (a steepest-direction engine's ``W`` or
    ``G``, a custom subject's input): the caller's weights or gradient would change under it, and
    the check's later evaluations would see another input. (A :class:`MapUpdate` is handed a copy
    and checked as the function it computes.)"""


def _evaluator(subject: _Subject) -> Callable:
    def evaluate(x):
        # A write into x had surfaced as "not deterministic: seed any randomness, keep no state"
        # (the second call saw the written input), advice that does not fit the defect.
        before = None if isinstance(subject, MapUpdate) else _copied(x)  # a MapUpdate hands its map a copy
        out = subject.evaluate(x)
        written = [] if before is None else [i for i, (now, was) in enumerate(zip(_members(x), _members(before)))
                                             if not torch.equal(now, was)]
        if written:
            which = (("W", "G")[written[0]] if isinstance(subject, DirectionUpdate)
                     else f"member {written[0]} of the example")
            raise InputWrittenError(
                f"{subject.name} writes into its input {which} in place: the caller's tensor changes under it. "
                "Work on a copy inside the update (e.g. G = G.clone() before an in-place operation), or use the "
                "out-of-place operation")
        if not _tensors(out):
            raise TypeError(f"{subject.name} returned a {type(out).__name__}: an update returns a tensor "
                            "(a tuple of tensors under a joint group)")
        if isinstance(subject, MapUpdate) and _layout(out) != _layout(x):
            # a (1, 6, 4) or (3, 6, 4) output of a 6 x 4 input had broadcast through g's action and held;
            # a transposed or list output had been blamed on the group element's sampling
            raise ValueError(f"{subject.name} returned {_layout_text(out)} for {_layout_text(x)}: a map returns "
                             "its input's shape (under a joint group, a tuple of its matrices' shapes)")
        given, returned = (sorted({_dtype_name(t.dtype) for t in _members(part)}) for part in (x, out)) if isinstance(
            subject, MapUpdate) else (None, None)  # (only a map must return its input's dtype)
        if returned != given:
            # a float16 output of a float64 check had held, reported "equivariant" at float64 when the
            # output round trip in float16 had set the floor
            raise TypeError(f"{subject.name} returned {', '.join(returned)} for a {', '.join(given)} input: a map "
                            "returns its input's dtype (cast back with .to(D.dtype)); to hold a narrower precision "
                            "than the input's, state it as compute_dtype (--compute-dtype)")
        if not _finite(out):
            raise FloatingPointError(f"{subject.name} returned a non-finite output (NaN or inf)")
        return out

    return evaluate


def _narrower_than_float64(example) -> bool:
    return any(t.dtype != torch.float64 for t in _members(example))


class NondeterministicUpdateError(RuntimeError):
    """Two evaluations of an update on the same input differed: its noise would enter the
    measured floor and hide a violation of that size, so the trial is an error instead."""


def _round_trips(subject: _Subject, element: GroupElement, example, evaluate: Callable):
    """``(U(x), g.x, U(g.x), residual, [input round trip, output round trip])`` at ``example``
    (module docstring, items 2 and 3); ``U(x)`` is evaluated twice, and outputs that differ
    (bitwise) raise :class:`NondeterministicUpdateError`."""
    out = evaluate(example)
    again = _relative(evaluate(example), out)
    if again != 0.0:
        raise NondeterministicUpdateError(
            f"{subject.name} is not deterministic: two calls on the same input differ by {again:.2e} (relative). "
            "The check compares outputs at different inputs, so the output must depend on the input alone: seed "
            "any randomness inside the update, keep no state between calls (on CUDA, "
            "torch.use_deterministic_algorithms(True))")
    moved = subject.act(element, example)
    out_g = evaluate(moved)
    residual = subject.relative(out_g, subject.act_output(element, out))
    changes = [
        subject.relative(evaluate(subject.act(element.inverse(), moved)), out),
        subject.relative(subject.act_output(element.inverse(), subject.act_output(element, out)), out),
    ]
    return out, moved, out_g, residual, changes


#: Relative size of the probe that tells a float64 evaluation from one that rounds to a
#: narrower dtype inside: $2^{-30}$, below every half precision's and float32's round-off
#: ($2^{-24}$) and far above float64's.
SUB_ROUNDOFF = 2.0**-30


def _witness(subject: _Subject, element: GroupElement, example, *, compute: float, stated_precision: bool,
             generator: torch.Generator, probes: int) -> tuple[float, float, Any, Any] | None:
    r"""Residual and floor of the **float64 witness** of a trial in a narrower dtype $d$: the
    same inputs $x$ (every dtype embeds exactly in float64), the update evaluated in
    float64 and $g$ applied in float64, so the residual carries neither the rounding of
    $g\cdot x$ to $d$ nor $d$'s round-off inside the update. For a map discontinuous at
    round-off distance (a sign near zero, a threshold) that rounding alone moves the output
    by $O(1)$, and for any map $d$'s floor caps what the dtype trial can see (a bf16 floor
    of $2\cdot 10^{-2}$ passes a 0.12 violation within eight floors); the witness sees both
    at float64 resolution.

    Its floor is the float64 recipe (round trips, probes at $\sqrt n\,\varepsilon_{64}$ at
    $x$ and $g\cdot x$), and, for an update that may round to a narrower dtype inside,
    *relative-only* probes $x\odot(1+\delta\xi)$ at $d$'s size $\delta$ as well (they keep
    signs and exact zeros), on what the update computes with (directions, gradients; the
    weights are float64 here and get float64 probes). An update may round inside when it is
    an optimizer or a steepest direction (their step dtypes are their own), when the check
    states a ``compute_dtype``
    narrower than the inputs, or when a map's float64 output does not move at all under a
    relative perturbation of :data:`SUB_ROUNDOFF` (a float64 computation moves; a map that
    quantizes, or is piecewise constant, does not — for the latter the relative probes
    change nothing unless an entry sits at a threshold).

    Returns ``(residual, floor, U(x), U(g x))``, the outputs in float64 (:func:`run_trial`
    compares them with the dtype trial's). ``None`` when the witness does not apply: the
    update returned a dtype other than float64 for float64 inputs (it is not dtype-generic),
    raised, or returned a non-finite output.
    """
    evaluate = _evaluator(subject)
    wide = _widened(example)
    try:
        out64, moved64, out64_g, residual, changes = _round_trips(subject, element, wide, evaluate)
        if _narrower_than_float64(out64):
            return None
        narrow_inside = stated_precision or not isinstance(subject, MapUpdate) or _distance(
            evaluate(_perturbed(wide, SUB_ROUNDOFF, generator, additive=False)), out64) == 0.0
        wide_size = _perturbation(torch.float64, wide)
        for _ in range(probes):
            for point, value in ((wide, out64), (moved64, out64_g)):
                changes.append(subject.relative(evaluate(subject.perturb(point, wide_size, wide_size, generator)),
                                                value))
                if narrow_inside:  # weights are float64 here: only what the update computes with
                    changes.append(subject.relative(
                        evaluate(subject.perturb(point, wide_size, compute, generator, additive=False)), value))
    except Exception:  # the update's float64 path is not the check's subject: no witness
        return None
    return residual, _floor(_eps(torch.float64), changes), out64, out64_g


def run_trial(subject, element: GroupElement, example, *, compute_dtype: torch.dtype,
              generator: torch.Generator, index: int = 0, kind: str = "", scale: float = 1.0,
              probes: int = 1, witness: bool = True, tied: bool = False, members: tuple[int, ...] = ()) -> Trial:
    r"""Residual, noise floor (module docstring) and verdict of ``subject`` under ``element``
    at ``example``, with ``probes`` entrywise probes at $x$ and as many at $g\cdot x$; an
    exception or a non-finite output gives the verdict ``error``. When the example is
    narrower than float64 and this trial is not violated, the float64 witness
    (:func:`_witness`) decides instead wherever it resolves and judges the same function: its
    output at $x$ within :data:`HOLDS_FACTOR` times the change of this trial's output under
    relative-only probes at $x$ (the same input: only round-off inside the dtype may part them),
    and at $g\cdot x$ within :data:`HOLDS_FACTOR` of this trial's floors (an update that takes
    another path in the narrow dtype, a fused low-precision kernel, is judged on that path: a
    10 % bias in a bf16 path had been certified by its exact float64 path, and a +1 on a column
    of a bf16 sign under the O(1) floor of a discontinuous map) (``witness=False``: never).

    ``tied=True`` makes the probes keep the example's exact structure (:func:`_perturbed`) and
    leaves out the witness (its probes do not): the floor of a structured trial, whose element
    acts exactly (module docstring, *Structured inputs*). ``members``: the batch shape of a stack
    whose members are independent parameters (each its own element), whose trial is also an
    independence test (:func:`_batch_mates`) wherever the residual does not decide it."""
    subject = _as_subject(subject)
    evaluate = _evaluator(subject)
    eps = _eps(compute_dtype)
    compute = _perturbation(compute_dtype, example)
    storage = _perturbation(_members(example)[0].dtype, example)
    try:
        out, moved, out_g, residual, changes = _round_trips(subject, element, example, evaluate)
        for _ in range(probes):
            changes.append(subject.relative(evaluate(subject.perturb(example, storage, compute, generator, tied=tied)),
                                            out))
            changes.append(subject.relative(evaluate(subject.perturb(moved, storage, compute, generator, tied=tied)),
                                            out_g))
    except GroupLeavesManifoldError as err:
        return Trial(index, kind, scale, err.distance, err.limit, "violated", element, str(err))
    except Exception as err:  # the update's own failure is a verdict, not a crash of the checker
        return Trial(index, kind, scale, math.nan, math.nan, "error", element, f"{type(err).__name__}: {err}")
    floor = _floor(eps, changes)
    verdict = _judge(residual, floor)
    if members and verdict in ("holds", "inconclusive"):
        try:
            coupled = _batch_mates(subject, evaluate, example, out, floor, members)
        except Exception as err:
            return Trial(index, kind, scale, math.nan, math.nan, "error", element,
                         f"a member of the stack alone: {type(err).__name__}: {err}")
        if coupled is not None:
            return Trial(index, kind, scale, coupled[0], floor, "violated", element, coupled[1], route="members alone")
    if witness and not tied and verdict != "violated" and _narrower_than_float64(example):
        # Its own stream, seeded from the trial's: its draws do not depend on how many probes
        # the dtype trial drew, so more probes only ever add to its floor.
        own = torch.Generator().manual_seed(generator.initial_seed() ^ 0x5EED)
        found = _witness(subject, element, example, compute=compute, generator=own,
                         stated_precision=compute_dtype != _members(example)[0].dtype, probes=probes)
        # the same function: U_d(x) and U_64(x) see the same input, so they differ only by U's
        # round-off inside d, which relative-only probes at d's size reproduce (the rounding of
        # every entry and internal cast, signs and exact zeros kept); U_d(gx) and U_64(gx) also by
        # gx's rounding to d, which this trial's full floor measures. Within HOLDS_FACTOR of them
        # (what a holds verdict itself allows) the witness judges the function the dtype runs.
        # Not the full floor at x: its additive part flips a discontinuous map's near-zero
        # entries (a bf16 sign's floor is O(1) at 64x32), and that floor had let a bf16 sign
        # kernel with a +1 bias on column 0 through as "holds" on its exact float64 path.
        witnessed = None if found is None else _judge(*found[:2])
        if witnessed not in (None, "unresolved") and subject.relative(out_g, found[3]) <= HOLDS_FACTOR * floor:
            try:
                same_input = [subject.relative(evaluate(subject.perturb(example, storage, compute, own,
                                                                        additive=False)), out)
                              for _ in range(probes)]
            except Exception:  # no measure of d's round-off at x: no witness, the dtype verdict stands
                same_input = None
            if same_input is not None and subject.relative(out, found[2]) <= HOLDS_FACTOR * _floor(eps, same_input):
                # the independence test at the witness's resolution too (a bf16 trial's floor had hidden a
                # stack-wide norm that the float64 witness then passed)
                coupled = None
                if members and witnessed in ("holds", "inconclusive"):
                    try:
                        coupled = _batch_mates(subject, evaluate, _widened(example), found[2], found[1], members)
                    except Exception:  # as in _witness: the float64 path is not the check's subject
                        coupled = None
                if coupled is not None:
                    return Trial(index, kind, scale, coupled[0], found[1], "violated", element, coupled[1],
                                 route="float64 witness")
                return Trial(index, kind, scale, found[0], found[1], witnessed, element, route="float64 witness")
    return Trial(index, kind, scale, residual, floor, verdict, element)


def _member(x, b: int, batch: tuple[int, ...]):
    """Member ``b`` (flat index over ``batch``) of every tensor of a (nested) example or output, as
    a stack of one (each tensor ``[*batch, ...]`` becomes ``[1, ..., 1, ...]``)."""
    if isinstance(x, torch.Tensor):
        item = x.shape[len(batch):]
        return x.reshape(-1, *item)[b].reshape(*(1,) * len(batch), *item)
    return type(x)(_member(part, b, batch) for part in x)


def _batch_mates(subject: _Subject, evaluate: Callable, example, out, floor: float,
                 batch: tuple[int, ...]) -> tuple[float, str] | None:
    r"""The independence test of a stack of independent parameters: each member's output $U(x)_b$
    against the output of that member alone, $U(x_b)$ (a stack of one), relative over the stack
    (:func:`_distance`, :func:`_norm`), judged against the trial's own floor (:func:`_judge`);
    ``(relative difference, message)`` when it is violated, else ``None``.

    Why beside the residual: a coupling through quantities each member's element leaves unchanged
    (a stack-wide Frobenius norm, clip or RMS match) commutes with the product group, so the
    residual is round-off, while the member's output depends on its batch-mates (such a map had
    held). Computed apart, a member's output differs from its output in the stack by the batched
    kernels' round-off at most, which the floor's probes measure."""
    count = math.prod(batch)
    together = [_member(out, b, batch) for b in range(count)]
    alone = [evaluate(_member(example, b, batch)) for b in range(count)]
    apart = [_distance(t, a) for t, a in zip(together, alone)]
    size = max(_norm(out), math.sqrt(sum(_norm(a) ** 2 for a in alone)))
    difference = math.sqrt(sum(d * d for d in apart)) / size if any(apart) else 0.0
    if _judge(difference, floor) != "violated":
        return None
    worst = max(range(count), key=apart.__getitem__)
    return difference, (
        f"a member's output depends on its batch-mates: the stack's output differs from its members' own "
        f"outputs (each member alone, a stack of one) by {difference:.2e} relative, "
        f"{difference / floor if floor > 0 else math.inf:.3g}x the noise floor {floor:.2e} (> {VIOLATION_FACTOR:g}x; "
        f"member {worst} most). Stacked parameters are independent: compute each member's output from its own "
        "matrix (a norm, clip or statistic over the whole stack couples them), or check an update that couples "
        "its members on purpose with batch_elements='shared' (--batch-elements shared)")


#: How decisive a trial's verdict is, most first: a structured trial keeps the more decisive of
#: its two judgments (:func:`_structured`).
_DECISIVE = ("error", "violated", "inconclusive", "holds", "unresolved")


def _structured(subject: _Subject, usual: Trial, exact_element: GroupElement, example, *,
                compute_dtype: torch.dtype, generator: torch.Generator) -> Trial:
    r"""A structured check's trial on a structured kind: ``usual`` (its element, the usual
    probes) and the *exact* trial at the same input — ``exact_element`` from the group's exact
    subgroup (:meth:`~geomuon.theory.groups.Group.sample_exact`: $g\cdot x$ and both round trips
    are exact, and keep every tie, zero, repeated singular value and exact rank of $x$, but for a
    shift off its grid) and probes
    that keep the structure too (``tied``), confirmed with :data:`CONFIRMATION_PROBES` before it
    is called violated or left inconclusive. The more decisive of the two is the trial's
    (:data:`_DECISIVE`; the usual one on a tie): a map that jumps exactly at the structure is
    unresolved under the usual probes, which leave it, and judged by the exact ones."""
    if usual.verdict in ("error", "violated"):
        return usual
    exact = run_trial(subject, exact_element, example, compute_dtype=compute_dtype, generator=generator,
                      index=usual.index, kind=usual.kind, scale=usual.scale, tied=True)
    if exact.verdict in ("inconclusive", "violated"):
        exact = run_trial(subject, exact_element, example, compute_dtype=compute_dtype, generator=generator,
                          index=usual.index, kind=usual.kind, scale=usual.scale, tied=True,
                          probes=CONFIRMATION_PROBES)
    exact = dataclasses.replace(exact, route="exact element")
    return min((usual, exact), key=lambda t: _DECISIVE.index(t.verdict))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout(x):
    """The shapes of a (nested) example, nested as it is (tuples and lists alike)."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(_layout(part) for part in x)


def _layout_text(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {'x'.join(map(str, x.shape)) or 'scalar'} tensor"
    return f"a {type(x).__name__} of {len(x)} ({', '.join(_layout_text(part) for part in x)})"


def _shape_of(example) -> str:
    return ", ".join("x".join(str(k) for k in t.shape) for t in _members(example)[:3])


def _element_text(element: GroupElement | None, limit: int = 8) -> str:
    if element is None:
        return "(none)"
    parts = getattr(element, "parts", (element,))
    if all(max(p.left.size(-1), p.right.size(-1)) <= limit for p in parts if hasattr(p, "left")):
        return repr(element)
    return (f"(factors larger than {limit}x{limit}: rerun with the same seed and "
            "`check_equivariance(...).trials[i].element` to inspect it)")


@dataclass
class EquivarianceReport:
    """Trials of one (update, group) check and the verdict (see the module docstring)."""

    update: str
    group: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    compute_dtype: torch.dtype
    seed: int
    trials: list[Trial]
    expect: str = "holds"
    min_trials: int = MIN_TRIALS
    #: The check judged structured inputs exactly (``check_equivariance(structured=True)``).
    structured: bool = False

    @property
    def resolved(self) -> int:
        """Trials whose floor could resolve an $O(1)$ violation."""
        return sum(t.verdict in ("holds", "inconclusive", "violated") for t in self.trials)

    @property
    def verdict(self) -> str:
        """``error``, ``violated``, ``inconclusive`` or ``holds`` (first that applies)."""
        verdicts = {t.verdict for t in self.trials}
        for verdict in ("error", "violated", "inconclusive"):
            if verdict in verdicts:
                return verdict
        return "holds" if self.resolved >= self.min_trials else "inconclusive"

    @property
    def passed(self) -> bool:
        """The verdict is the expected one (``expect`` ``"holds"`` or ``"violated"``)."""
        return self.verdict == self.expect

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_CODES` of the verdict."""
        return EXIT_CODES[self.verdict]

    @property
    def residuals(self) -> list[float]:
        """The residual of every trial."""
        return [t.residual for t in self.trials]

    def worst(self) -> Trial:
        """The trial that decides the verdict: the first error, else the largest residual in
        noise floors among the trials with the verdict."""
        deciding = [t for t in self.trials if t.verdict == self.verdict] or self.trials
        errors = [t for t in deciding if t.verdict == "error"]
        if errors:
            return errors[0]
        return max(deciding, key=lambda t: (not math.isfinite(t.residual), t.ratio))

    def derivation(self) -> str:
        """Why the tolerance is what it is, with this check's dtypes."""
        text = DERIVATION + (WITNESS if self.dtype != torch.float64 else "")
        return text.format(
            compute=_dtype_name(self.compute_dtype), eps=_eps(self.compute_dtype), dtype=_dtype_name(self.dtype),
            holds=HOLDS_FACTOR, violated=VIOLATION_FACTOR,
        )

    def table(self) -> str:
        """One line per trial, then the verdict and its explanation."""
        lines = [
            f"{self.update} under {self.group}, shape {'x'.join(map(str, self.shape))}, {_dtype_name(self.dtype)}"
            + (f" (computing in {_dtype_name(self.compute_dtype)})" if self.compute_dtype != self.dtype else "")
            + f", seed {self.seed}",
            f"{'trial':>5}  {'input':<14} {'scale':>7}  {'residual':>9}  {'floor':>9}  {'ratio':>9}  verdict",
        ]
        for t in self.trials:
            lines.append(f"{t.index:5d}  {t.kind:<14} {t.scale:7.0e}  {t.residual:9.2e}  {t.floor:9.2e}  "
                         f"{t.ratio:9.2e}  {t.verdict}" + (f" ({t.route})" if t.route != "dtype" else ""))
        lines.append(self.message())
        return "\n".join(lines)

    def _unseen(self) -> str:
        """What a *holds* verdict did not see: the unresolved trials by input kind, and the kinds
        none of whose trials resolved. A map wrong only where it also jumps under round-off (a
        sign with sign(0) = +1 on inputs with exact zeros, a zero row mapped to a fixed unit row)
        is unresolved exactly there; the verdict had said "all resolved trials" and named none."""
        unresolved = [t.kind for t in self.trials if t.verdict == "unresolved"]
        if not unresolved:
            return ""
        counts = {kind: unresolved.count(kind) for kind in dict.fromkeys(unresolved)}
        resolved_kinds = {t.kind for t in self.trials if t.verdict != "unresolved"}
        never = [kind for kind in counts if kind not in resolved_kinds]
        text = (f" Not seen: {len(unresolved)} of {len(self.trials)} trials unresolved ("
                + ", ".join(f"{kind} {count}" for kind, count in counts.items())
                + f"): the update's own floor there is >= 1/{VIOLATION_FACTOR:g} (it jumps under round-off: a "
                "discontinuity, or an exact zero or tie it treats specially), so a violation there goes unseen")
        if never:
            text += (f"; no {' or '.join(never)} input resolved at all: check the update's value on such inputs "
                     "directly if they matter")
        structured = [kind for kind in counts if kind in STRUCTURED_KINDS]
        if structured and not self.structured:
            text += (f"; if the update is single-valued on {' and '.join(structured)} inputs (its claim holds there "
                     "too), check with structured=True, which judges them exactly")
        return text + "."

    def message(self) -> str:
        """The verdict in words: the deciding trial, the element, the seed and the derivation;
        for *holds*, also what it did not see (:meth:`_unseen`)."""
        t = self.worst()
        where = (f"trial {t.index} (input {t.kind}, scale {t.scale:.0e}, seed {self.seed}"
                 + (f", judged by its {t.route}" if t.route != "dtype" else "")
                 + f"; replay with seed={self.seed})")
        what = f"{self.update} under {self.group}"
        if self.verdict == "error":
            return f"ERROR: {what} failed at {where}: {t.error}"
        if self.verdict == "violated" and t.error:
            return f"VIOLATED: {what}: {t.error}; at {where}.\ngroup element:\n{_element_text(t.element)}"
        if self.verdict == "violated":
            return (f"VIOLATED: {what}: residual {t.residual:.3e} at {where} is {t.ratio:.3g}x its noise floor "
                    f"{t.floor:.2e} (> {VIOLATION_FACTOR:g}x).\nWhy this tolerance: {self.derivation()}.\n"
                    f"group element:\n{_element_text(t.element)}")
        precision = (f" up to {_dtype_name(self.compute_dtype)}" if self.compute_dtype != torch.float64 else "")
        if self.verdict == "holds":
            return (f"HOLDS: {what} is equivariant{precision}: all {self.resolved} resolved trials within "
                    f"{HOLDS_FACTOR:g}x their noise floor (largest {t.ratio:.2g}x).{self._unseen()}\nWhy this "
                    f"tolerance: {self.derivation()}.")
        unresolved = len(self.trials) - self.resolved
        if any(s.verdict == "inconclusive" for s in self.trials):
            reason = (f"residual {t.residual:.3e} at {where} is {t.ratio:.3g}x its noise floor {t.floor:.2e}: "
                      f"above round-off ({HOLDS_FACTOR:g}x), below a clear violation ({VIOLATION_FACTOR:g}x)")
        elif self.resolved == len(self.trials):
            reason = (f"all {len(self.trials)} trials drawn ({EXTENSION}x the trials asked for, the most a check "
                      f"draws) resolved, but a holds verdict needs {self.min_trials}: ask for trials >= "
                      f"{-(-self.min_trials // EXTENSION)}")
        else:
            reason = (f"only {self.resolved} of {len(self.trials)} trials resolved ({self.min_trials} needed); "
                      f"on {unresolved} the update's own round-off floor is >= 1/{VIOLATION_FACTOR:g}, so not even "
                      "an O(1) violation could be called there — check in a wider dtype or at a smaller condition "
                      "(optimizer steps: also where no step moved the weights — give it more steps, or a "
                      "learning rate whose step the weights' dtype resolves)")
        return f"INCONCLUSIVE: {what}: {reason}.\nWhy this tolerance: {self.derivation()}."


def _raw(shapes, kind, scale, generator, dtype, condition, batch: tuple[int, ...] = ()):
    """One input of a trial: an :func:`adversarial_matrix` per member of ``batch`` (each its own
    draw, all of ``kind`` at ``scale``), stacked to ``[*batch, m, n]``; a tuple for joint groups."""
    if isinstance(shapes[0], (tuple, list)):
        return tuple(_raw(s, kind, scale, generator, dtype, condition, batch) for s in shapes)
    members = [adversarial_matrix(shapes, kind, generator, scale=scale, condition=condition)
               for _ in range(math.prod(batch))]
    return torch.stack(members).reshape(*batch, *shapes).to(dtype)


def _element(sample: Callable, shapes, generator: torch.Generator, batch: tuple[int, ...], shared: bool,
             scale: float) -> GroupElement:
    """A trial's element from ``sample`` (a group's ``sample`` or ``sample_exact``): one per member
    of ``batch`` (:func:`~geomuon.theory.groups.stack_elements`) unless ``shared``, its shift at
    ``scale`` (:func:`_at_scale`)."""
    if not batch or shared:
        return _at_scale(sample(shapes, generator), scale)
    return _at_scale(stack_elements([sample(shapes, generator) for _ in range(math.prod(batch))], batch), scale)


def _at_scale(element: GroupElement, scale: float) -> GroupElement:
    """A shift drawn at the scale of the trial's input (the groups sample it at unit scale),
    so that it neither vanishes in the input's round-off nor swamps it."""
    if getattr(element, "shift", None) is not None:
        return dataclasses.replace(element, shift=element.shift * scale)
    return element


def trial_scales(dtype: torch.dtype) -> tuple[float, ...]:
    r"""The :data:`SCALES` whose inputs ``dtype`` holds: $s$ with
    $s\,h \le$ the dtype's largest finite value and $s / h \ge$ its smallest normal one,
    $h$ = :data:`SCALE_HEADROOM` $= 10^4$. The largest entry of an $m\times n$ input at RMS $s$
    is at most $s\sqrt{mn}$ ($10^2 s$ at $100\times 100$, a sparse input) and a positive
    diagonal group factor scales by up to $10^2$; the smallest singular value of a
    conditioned input is $s/\kappa$ ($10^{-3}s$ at the default $\kappa$). float32, bfloat16
    and float64 keep all of them; float16 (range $6\cdot 10^{-5}$ to $65504$) keeps $s = 1$,
    where a scale of $10^8$ had rounded the input to inf and blamed the update."""
    info = torch.finfo(dtype)
    return tuple(s for s in SCALES if s * SCALE_HEADROOM <= info.max and s / SCALE_HEADROOM >= info.tiny)


#: The dtypes a check runs in (its inputs' and its stated precision).
CHECK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_precision(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> None:
    r"""Refuse a ``dtype`` or ``compute_dtype`` outside :data:`CHECK_DTYPES` (an int dtype had
    failed in ``torch.finfo``, a complex one dropped its imaginary parts), and a
    ``compute_dtype`` finer than ``dtype`` (a smaller $\varepsilon$): inputs in ``dtype`` carry its
    round-off whatever precision is stated, so bf16 inputs checked "in float64" had reported a
    map computing in bf16 as "equivariant" with no precision named."""
    for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
        if value is not None and value not in CHECK_DTYPES:
            raise ValueError(f"{name} must be one of {[str(d) for d in CHECK_DTYPES]}, got {value!r}")
    if compute_dtype is not None and finer_precision(compute_dtype, dtype):
        raise ValueError(f"compute_dtype {_dtype_name(compute_dtype)} is finer than dtype {_dtype_name(dtype)} "
                         f"(eps {_eps(compute_dtype):.1e} < {_eps(dtype):.1e}): the precision to hold is at most "
                         "the inputs'; leave compute_dtype out to hold dtype's, or check with a wider dtype")


def scale_index(trial: int, kinds: int, scales: int) -> int:
    r"""The scale of trial $i$ among ``scales`` when its input kind is $i \bmod k$ ($k$ =
    ``kinds``, $s$ = ``scales``): $(i + \lfloor i / \operatorname{lcm}(k, s)\rfloor) \bmod s$.
    Both cycle at once, so a short check sees many kinds and many scales; the shift after each
    $\operatorname{lcm}(k, s)$ trials moves to the next coset of pairs, so $ks$ trials hold every
    pair. (Scale $i \bmod s$ alone pairs each kind with only $s / \gcd(k, s)$ scales: 3 kinds
    of 9 scales had checked 9 of the 27 pairs however many trials ran.)"""
    return (trial + trial // math.lcm(kinds, scales)) % scales


def _physical_memory() -> int | None:
    """Bytes of physical memory of this machine (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _least_bytes(group: Group, shapes, batch: tuple[int, ...] = ()) -> int:
    r"""A lower bound on the memory a check at ``shapes`` holds at once: one float64 input
    (every trial synthesizes its $m\times n$ matrices in float64) and, for a two-sided group,
    its element's two dense float64 factors, $m^2 + n^2$ entries; each times the members of
    ``batch`` (one element each, at most)."""
    members = shapes if isinstance(shapes[0], (tuple, list)) else [shapes]
    entries = sum(m * n for m, n in members)
    if isinstance(group, TwoSidedGroup):
        entries += sum(m * m + n * n for m, n in members)
    return 8 * entries * math.prod(batch)


def _allocation_failure(err: Exception) -> bool:
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(err)


def _group_label(group: Group) -> str:
    return group.name or type(group).__name__


def _check_group(group: Group, shapes, seed: int, batch: tuple[int, ...] = ()) -> None:
    """Refuse, before any trial, what would make every trial's verdict about the check's inputs
    rather than the update: ``shape`` too large for this machine's memory (the checked size had
    been allocated inside ``sample`` and the failure blamed on the group, "fix the group"), a
    ``sample`` that fails, ignores its generator (two samples from one seed differ: the report's
    "replay with seed=" replays other elements), or draws an element that does not act on a tensor
    of ``shapes`` (each trial had been an *error*, exit 4, blamed on the update)."""
    label = _group_label(group)
    sizes = ", ".join("x".join(map(str, s)) for s in (shapes if isinstance(shapes[0], (tuple, list)) else [shapes]))
    too_large = (f"shape {sizes} is too large to check on this machine: check the largest shape that fits, with "
                 "the same structure (--shape on the CLI); a smaller shape sees the same group but not the breaks "
                 "that need size (every entry is at most sqrt(m*n) x the RMS entry, so a clip at 10 x RMS never "
                 "acts while m*n <= 100)")
    need, have = _least_bytes(group, shapes, batch), _physical_memory()
    if have is not None and need > have:
        raise ValueError(f"{too_large}; it needs at least {need / 2**30:.3g} GiB (its float64 inputs and group "
                         f"factors) and this machine has {have / 2**30:.3g} GiB")

    def refused(err: Exception, what: str) -> ValueError:
        if _allocation_failure(err):
            return ValueError(f"{too_large} (group {label}: {type(err).__name__}: {err})")
        return ValueError(f"group {label}: {what} failed ({type(err).__name__}: {err}); fix the group")

    try:
        first, again = (group.sample(shapes, torch.Generator().manual_seed(seed)) for _ in range(2))
    except Exception as err:
        raise refused(err, f"sample({shapes})") from err
    try:
        probe = _raw(shapes, "gaussian", 1.0, torch.Generator().manual_seed(seed), torch.float64, 1.0)
        moved, moved_again, output = first.act(probe), again.act(probe), first.act_output(probe)
    except Exception as err:
        raise refused(err, f"the action of its element on a tensor of shape {sizes}") from err

    def shaped_like_probe(acted) -> bool:
        return _tensors(acted) and [t.shape for t in _members(acted)] == [t.shape for t in _members(probe)]

    if not (shaped_like_probe(moved) and shaped_like_probe(output)):
        raise ValueError(f"group {label}: sample({shapes}) drew an element whose act or act_output does not map "
                         f"a tensor of shape {sizes} to one of the same shape; fix the group")
    if _distance(moved, moved_again) != 0.0:
        raise ValueError(f"group {label}: two samples from the same seed differ, so a report's seed would not "
                         "replay it: draw every random number from the generator passed to sample (e.g. "
                         "torch.randn(..., generator=generator))")


def _kinds(kinds, structured: bool) -> tuple[str, ...]:
    """``kinds``, by default :data:`KINDS` (and :data:`STRUCTURE_ONLY_KINDS` for a ``structured``
    check); refused unless a non-empty collection of those names (a bare string had been read as
    its letters), as is a ``structured`` that is not a bool."""
    if not isinstance(structured, bool):
        raise ValueError(f"structured must be True or False, got {structured!r}")
    if kinds is None:
        return KINDS + STRUCTURE_ONLY_KINDS if structured else KINDS
    known = KINDS + STRUCTURE_ONLY_KINDS
    if isinstance(kinds, str) or not kinds or set(kinds) - set(known):
        raise ValueError(f"kinds must be a non-empty tuple of names from {known}, got {kinds!r}")
    return tuple(kinds)


def _trial_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed << 16) + index)


def check_equivariance(
    update,
    group: Group | str,
    shape: tuple[int, ...] = (6, 4),
    *,
    trials: int = 40,
    expect: str = "holds",
    dtype: torch.dtype = torch.float64,
    compute_dtype: torch.dtype | None = None,
    condition: float = 1e3,
    seed: int | None = None,
    kinds: Sequence[str] | None = None,
    min_trials: int = MIN_TRIALS,
    structured: bool = False,
    batch_elements: str = "independent",
) -> EquivarianceReport:
    """Run ``trials`` adversarial trials of ``update`` under ``group`` (module docstring).

    Args:
        update: a map ``D -> U`` or a :class:`MapUpdate` / :class:`DirectionUpdate` /
            :class:`OptimizerUpdate`.
        group: a :class:`~geomuon.theory.groups.Group` or its name.
        shape: ``(m, n)``, or ``(*batch, m, n)`` for an update of stacked matrices (module
            docstring, *Batches*); for ``NeuronPermutation`` the SwiGLU triple with
            ``h = m, d = n`` (each member stacked).
        trials: number of (input, element) draws, at least 1; trial ``i`` uses
            ``kinds[i % len(kinds)]`` at scale :func:`scale_index` of :func:`trial_scales`
            (every pair of a kind and a scale within ``len(kinds) * len(scales)`` trials); up to
            :data:`EXTENSION` times more are drawn while fewer than ``min_trials`` are resolved
            and nothing is decided.

        expect: ``"holds"`` or ``"violated"`` (``"fails"`` is accepted for it); sets
            :attr:`EquivarianceReport.passed`.
        dtype: dtype of the inputs (synthesized in float64, then rounded).
        compute_dtype: precision to hold, at most ``dtype``'s (default ``dtype``): the
            round-off of the floor's entrywise probe.
        condition: $\\kappa_2$ of the ``conditioned`` inputs (and the smallest singular value
            of the ``clustered`` ones).
        seed: replays a run; default a fresh random seed, recorded in the report.
        kinds: input kinds from :data:`KINDS` and :data:`STRUCTURE_ONLY_KINDS`; default
            :data:`KINDS`, and all of both for a ``structured`` check.
        min_trials: resolved trials a *holds* verdict needs, at least 1 (with ``trials`` below
            ``min_trials /`` :data:`EXTENSION` a check can find a violation but never hold:
            its *inconclusive* report says so).
        structured: declares that the update is equivariant *at every input*, structured ones
            included — a single-valued claim at ties, exact zeros, exactly repeated singular
            values, low rank and 0 — so each trial on a :data:`STRUCTURED_KINDS` input is also
            judged with an exact element and structure-keeping probes (module docstring,
            *Structured inputs*). Leave it ``False`` for an update that is set-valued there (an
            SVD polar factor of a rank-deficient matrix, an argmax that may pick any of a tie).
        batch_elements: with batch dimensions in ``shape``, ``"independent"`` (one group element
            per member: the symmetry of a stack of independent parameters) or ``"shared"`` (one
            element for the whole stack: for an update that couples its members on purpose).

    Raises:
        TypeError: ``update`` is not callable or is an optimizer (class or instance: wrap a
            factory of it in :class:`OptimizerUpdate`), or ``group`` is neither a group, a group
            class nor a name.
        ValueError: ``trials`` or ``min_trials`` below 1, a ``shape`` that is not
            ``(*batch, m, n)`` of sizes >= 1, an unknown ``expect``, ``batch_elements`` or kind, a
            ``dtype``/``compute_dtype`` other than float16, bfloat16, float32 or float64, a
            ``compute_dtype`` finer than ``dtype``, a ``condition`` below 1 or not finite, a
            ``seed`` outside $[0, 2^{31})$, or a group whose ``sample`` fails (each named: they
            are the check's inputs, not the update's), or ``"independent"`` batch elements of a
            group whose elements do not stack (check it with ``"shared"``).
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    if isinstance(min_trials, bool) or not isinstance(min_trials, int) or min_trials < 1:
        raise ValueError(f"min_trials must be an int >= 1, got {min_trials!r}")
    expect = "violated" if expect == "fails" else expect
    if expect not in ("holds", "violated"):
        raise ValueError(f"expect must be 'holds' or 'violated', got {expect!r}")
    kinds = _kinds(kinds, structured)
    # the check's own inputs, refused by name: an inf condition had built all-NaN inputs (blamed
    # on the update as a non-finite output), an int dtype failed in torch.finfo, a complex one
    # dropped its imaginary parts, a seed of 2^48 overflowed the trial generators' int64
    _check_precision(dtype, compute_dtype)
    if isinstance(condition, bool) or not isinstance(condition, (int, float)) or not (
            math.isfinite(condition) and condition >= 1):
        raise ValueError(f"condition must be a finite number >= 1 (a condition number), got {condition!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31):
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) >= 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in shape)):
        raise ValueError(f"shape must be (m, n) or (*batch, m, n) with every size an int >= 1, got {shape!r}")
    if batch_elements not in ("independent", "shared"):
        raise ValueError(f"batch_elements must be 'independent' or 'shared', got {batch_elements!r}")
    batch, shared = tuple(shape[:-2]), batch_elements == "shared"
    group = _as_group(group)
    subject = _as_subject(update)
    seed = secrets.randbits(31) if seed is None else seed
    compute_dtype = compute_dtype or dtype
    shapes = sample_shapes(group, tuple(shape[-2:]))
    _check_group(group, shapes, seed, batch)
    if batch and not shared:
        try:
            stack_elements([group.sample(shapes, torch.Generator().manual_seed(seed))], (1,))
        except ValueError as err:
            raise ValueError(f"batch_elements='independent': {err}") from None
    scales = trial_scales(dtype)
    results, confirmed = [], False

    def more() -> bool:
        # ``trials`` draws, then more (up to 3x) while too few are resolved for a verdict; an
        # error decides the check at once (its message is the report's)
        if results and results[-1].verdict == "error":
            return False
        if len(results) < trials:
            return True
        decided = any(t.verdict == "violated" for t in results)
        resolved = sum(t.verdict in ("holds", "inconclusive", "violated") for t in results)
        return not decided and resolved < min_trials and len(results) < EXTENSION * trials

    while more():
        i = len(results)
        generator = _trial_generator(seed, i)
        kind = kinds[i % len(kinds)]
        scale = 1.0 if kind in UNSCALED_KINDS else scales[scale_index(i, len(kinds), len(scales))]
        try:
            example = subject.example(
                [_raw(shapes, k, scale, generator, dtype, condition, batch) for k in subject.input_kinds(kind)]
            )
        except Exception as err:
            results.append(Trial(i, kind, scale, math.nan, math.nan, "error", None,
                                 f"building the example failed: {type(err).__name__}: {err}"))
            continue
        element = _element(group.sample, shapes, generator, batch, shared, scale)
        members = () if shared else batch
        trial = run_trial(subject, element, example, compute_dtype=compute_dtype, generator=generator,
                          index=i, kind=kind, scale=scale, members=members)
        if trial.verdict == "inconclusive" or (trial.verdict == "violated" and not confirmed):
            trial = run_trial(subject, element, example, compute_dtype=compute_dtype, generator=generator,
                              index=i, kind=kind, scale=scale, probes=CONFIRMATION_PROBES, members=members)
            confirmed = confirmed or trial.verdict == "violated"
        if structured and kind in STRUCTURED_KINDS:
            # drawn after the usual trial's draws: its elements and probes are those of an
            # unstructured check with the same seed
            exact_element = _element(group.sample_exact, shapes, generator, batch, shared, scale)
            trial = _structured(subject, trial, exact_element, example, compute_dtype=compute_dtype,
                                generator=generator)
        results.append(trial)
    return EquivarianceReport(subject.name, _group_label(group), tuple(shape), dtype, compute_dtype, seed, results, expect,
                              min_trials, structured)


def assert_equivariant(update, group: Group | str, shape: tuple[int, ...] = (6, 4), **kwargs) -> EquivarianceReport:
    """Raise ``AssertionError`` with the trial table unless the verdict is the expected one
    (``holds`` by default; ``expect="violated"`` asserts a counterexample). Arguments as in
    :func:`check_equivariance`; usable in pytest:

    ```python
    from geomuon.theory.equivariance import assert_equivariant
    assert_equivariant(my_map, "bi-orthogonal", shape=(8, 5))
    ```
    """
    report = check_equivariance(update, group, shape, **kwargs)
    if not report.passed:
        raise AssertionError(f"expected {report.expect}, got {report.verdict}\n{report.table()}")
    return report


@dataclass
class Case:
    """One hypothesis-drawn case: a shape, an input kind, scale and condition number, a
    seed, the example built from them and a group element (and, for a structured kind of a
    ``structured`` search, an element of the exact subgroup: :func:`_structured`). Its ``repr``
    prints the (small, after shrinking) matrices, so a falsifying example reads as matrices."""

    shape: tuple[int, int]
    kind: str
    scale: float
    condition: float
    seed: int
    example: Any
    element: GroupElement
    exact_element: GroupElement | None = None

    def __repr__(self) -> str:
        torch.set_printoptions(precision=4, sci_mode=True)
        try:
            return (
                f"Case(shape={self.shape}, kind={self.kind!r}, scale={self.scale:.0e}, "
                f"condition={self.condition:.3g}, seed={self.seed})\n"
                f"example = {self.example!r}\nelement:\n{self.element!r}"
                + ("" if self.exact_element is None else f"\nexact element:\n{self.exact_element!r}")
            )
        finally:
            torch.set_printoptions(profile="default")


def hypothesis_cases(
    subject,
    group: Group | str,
    *,
    orientation: str = "any",
    dims: tuple[int, int] = (2, 6),
    max_condition: float = 1e3,
    dtype: torch.dtype = torch.float64,
    kinds: Sequence[str] | None = None,
    structured: bool = False,
):
    r"""Hypothesis strategy of :class:`Case` for ``subject`` under ``group`` (needs the
    ``test`` extra). Shapes ``m, n`` in ``dims`` (``orientation`` ``"tall"``: $m \ge n$,
    ``"wide"``: $m < n$), an input kind of ``kinds`` at a scale of :data:`SCALES`, condition
    numbers in ``[1, max_condition]`` (scales: :func:`trial_scales` of ``dtype``), matrices seeded
    by a drawn integer; shrinking goes to the smallest shape, a Gaussian input at scale
    $10^{-8}$, condition 1 and seed 0. ``group`` is a :class:`~geomuon.theory.groups.Group`, a
    group class or a name. ``kinds`` and ``structured`` as in :func:`check_equivariance`; a
    structured case of a :data:`STRUCTURED_KINDS` input carries an exact element too. ``ValueError`` before any draw, naming the option, for ``dims`` that
    are not $1 \le$ low $\le$ high (high > low for ``"wide"``), unknown ``kinds``, a bad
    ``max_condition`` or ``orientation``, and a group :func:`check_equivariance` refuses."""
    from hypothesis import strategies as st

    subject = _as_subject(subject)
    group = _as_group(group)  # a name had failed at the first draw ('str' object has no attribute 'sample')
    kinds = _kinds(kinds, structured)  # an unknown one had failed only when hypothesis drew it
    # an inf bound had drawn inf condition numbers (NaN inputs, blamed on the update); one below 1
    # failed inside hypothesis, naming nothing
    check_real("hypothesis_cases", "max_condition", max_condition, lambda c: c >= 1,
               "a finite number >= 1 (a condition number)")
    if orientation not in ("any", "tall", "wide"):
        raise ValueError(f"orientation must be 'any', 'tall' or 'wide', got {orientation!r}")
    # a reversed pair had failed inside hypothesis, naming nothing; a wide square had been widened
    # past dims (m = n = dims[1] drew n = dims[1] + 1)
    if not (isinstance(dims, (tuple, list)) and len(dims) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) for k in dims) and 1 <= dims[0] <= dims[1]):
        raise ValueError(f"hypothesis_cases: dims must be a pair (low, high) of ints with 1 <= low <= high, got "
                         f"{dims!r}")
    low, high = dims
    if orientation == "wide" and low == high:
        raise ValueError(f"hypothesis_cases: orientation 'wide' needs m < n within dims, so high > low; got dims "
                         f"{tuple(dims)}: raise high or ask for orientation 'tall' or 'any'")

    # a group that ignores its generator had made hypothesis report a flaky test, not the group
    _check_group(group, sample_shapes(group, (low, high)), 0)

    @st.composite
    def cases(draw):
        if orientation == "wide":  # m < n
            m = draw(st.integers(low, high - 1))
            n = draw(st.integers(m + 1, high))
        elif orientation == "tall":  # m >= n
            n = draw(st.integers(low, high))
            m = draw(st.integers(n, high))
        else:
            m, n = draw(st.integers(low, high)), draw(st.integers(low, high))
        kind = draw(st.sampled_from(list(kinds)))
        scale = 1.0 if kind in UNSCALED_KINDS else draw(st.sampled_from(trial_scales(dtype)))
        condition = draw(st.floats(1.0, max_condition))
        seed = draw(st.integers(0, 2**31 - 1))
        generator = torch.Generator().manual_seed(seed)
        shapes = sample_shapes(group, (m, n))
        raws = [_raw(shapes, k, scale, generator, dtype, condition) for k in subject.input_kinds(kind)]

        element = _at_scale(group.sample(shapes, generator), scale)
        exact = (_at_scale(group.sample_exact(shapes, generator), scale)
                 if structured and kind in STRUCTURED_KINDS else None)
        return Case((m, n), kind, scale, condition, seed, subject.example(raws), element, exact)

    return cases()


def verify_declaration(
    update,
    group: Group | str,
    expected: str,
    *,
    orientation: str = "any",
    max_condition: float = 1e3,
    max_examples: int | None = None,
    tolerance_cap: float | None = None,
    dtype: torch.dtype = torch.float64,
    compute_dtype: torch.dtype | None = None,
    kinds: Sequence[str] | None = None,
    shrink: bool = True,
    structured: bool = False,
) -> Case | None:
    """Check one declared pair with hypothesis (the trials of :func:`run_trial` on drawn
    :class:`Case` s); raise ``AssertionError`` if it misbehaves.

    * ``expected="holds"``: every drawn case holds (within :data:`HOLDS_FACTOR` noise floors;
      cases the floor cannot resolve are discarded with ``assume``), and its residual is
      within ``tolerance_cap`` if given (a requirement on top of the floor, never a
      loosening); a failure is shrunk and printed as matrices.
    * ``expected="violated"`` (or ``"fails"``): hypothesis searches for a violated case,
      shrinks it (unless ``shrink=False``: the case found is returned as drawn, which spares
      the many evaluations of shrinking an expensive update) and returns it; no such case is
      an error.

    ``max_examples`` defaults to the active hypothesis profile's; ``kinds`` and ``structured`` as
    in :func:`check_equivariance` (a structured case is judged by :func:`_structured`). Needs the
    ``test`` extra.

    Raises ``ValueError`` naming the option, before any example, for an ``expected`` other than
    these, a ``max_examples`` below 1, a ``tolerance_cap`` that is not finite and > 0 or is given
    with ``expected="violated"``, a ``max_condition`` below 1 or not finite, and the dtypes
    :func:`check_equivariance` refuses.
    """
    from hypothesis import Phase, assume, find, given, settings
    from hypothesis.errors import NoSuchExample

    # refused by name before any example (max_examples=0 had run the profile's 100, a NaN cap
    # failed every case after a full shrink, a cap with expected="violated" was ignored)
    where = "verify_declaration"
    if expected not in ("holds", "fails", "violated"):
        raise ValueError(f"expected must be 'holds' or 'violated', got {expected!r}")
    if max_examples is not None:
        check_count(where, "max_examples", max_examples, least=1)
    if tolerance_cap is not None:
        check_real(where, "tolerance_cap", tolerance_cap, lambda cap: cap > 0, "a finite number > 0 (a residual)")
        if expected != "holds":
            raise ValueError(f"{where}: tolerance_cap bounds the residual of a 'holds' declaration; a declared "
                             f"{expected!r} has none: leave it out")
    _check_precision(dtype, compute_dtype)
    group = _as_group(group)
    subject = _as_subject(update)
    compute_dtype = compute_dtype or dtype
    strategy = hypothesis_cases(subject, group, orientation=orientation, max_condition=max_condition, dtype=dtype,
                                kinds=kinds, structured=structured)
    budget = settings(max_examples=settings.default.max_examples if max_examples is None else max_examples,
                      database=None)

    def trial(case, probes=1):
        result = run_trial(subject, case.element, case.example, compute_dtype=compute_dtype,
                           generator=torch.Generator().manual_seed(case.seed), kind=case.kind, scale=case.scale,
                           probes=probes)
        # As in a check: a trial is not called violated (or left inconclusive) before its
        # floor is re-measured with the confirming probes.
        if result.verdict in ("inconclusive", "violated") and probes == 1:
            return trial(case, CONFIRMATION_PROBES)
        if case.exact_element is None:
            return result
        return _structured(subject, result, case.exact_element, case.example, compute_dtype=compute_dtype,
                           generator=torch.Generator().manual_seed(case.seed))


    if expected == "holds":

        @budget
        @given(strategy)
        def must_hold(case):
            result = trial(case)
            assume(result.verdict != "unresolved")
            assert result.verdict == "holds" and (tolerance_cap is None or result.residual <= tolerance_cap), (
                f"{subject.name} under {_group_label(group)}: {result.verdict}, residual {result.residual:.3e} = "
                f"{result.ratio:.3g}x the noise floor {result.floor:.2e}"
                + (f" (cap {tolerance_cap:g})" if tolerance_cap is not None else "")
                + f" (declared: holds). {result.error}"
            )

        must_hold()
        return None
    # trial() confirms with all probes only what one probe does not clear: the confirmed
    # floor is a maximum over a superset of the single probe's draws (same seed, same first
    # draws), so a case not violated with one probe is not violated with all, and the search
    # is the same as with all probes on every candidate, at a fraction of the evaluations.
    search = budget if shrink else settings(budget, phases=[p for p in Phase if p != Phase.shrink])
    try:
        return find(strategy, lambda case: trial(case).verdict == "violated", settings=search)
    except NoSuchExample:
        raise AssertionError(
            f"{subject.name} under {_group_label(group)} is declared to be violated, but no case was beyond "
            f"{VIOLATION_FACTOR:g}x its noise floor"
        ) from None
