r"""Manifold Muon: steepest descent on a matrix manifold under a norm, then a retraction.

For every matrix $W$ on its manifold $\mathcal M$ with gradient $G$:

$$B \leftarrow \mu B + (1-\mu)G,\qquad \hat A = \arg\max_{A\in T_W\mathcal M,\ \|A\|\le1}
\langle \tilde B, A\rangle\ \text{(the engine, warm-started)},\qquad
W \leftarrow R_W(-\eta\,\hat A),$$

with $\tilde B$ the (Nesterov) momentum of :mod:`geomuon.optimizers.base`. The engine's
$\hat A$ is an approximate maximizer, tangent to round-off; it lies in the unit ball exactly
on the general path (a final rescale to norm 1 in the group's norm, not a clip: every
general-path step but a zero one has length $\eta$ in that norm) and to the polish's accuracy
on the Gram path, whose direction is tangent after its last projection but may leave the
ball: measured inside GPT training (``tests/test_direction_taken.py``'s reading of the
weights), $\|\hat A\|_2 \le 1.008$ on Stiefel and up to $1.22$ on DGram (square matrices,
one polish round), so a DGram step can be up to that factor longer than $\eta$ in the
spectral norm. Certificates (``certify_every``) divide the descent by $\max(1, \|\hat A\|_2)$.

Two paths, one engine (the same dual ascent from the projection start, the same final
tangent projection):

* **Gram space** (:func:`geomuon.optimizers.gram.gram_step`), for a manifold that declares
  a :attr:`~geomuon.manifolds.MatrixManifold.gram_form` (Stiefel, DGram, Oblique) under the
  spectral norm: dual iterations on $n\times n$ matrices, the manifold's Gram-form
  retraction folded into one $m\times n$ assembly, the dtype of every product stated there.
* **General** (:func:`geomuon.optimizers.steepest.steepest_direction`), for every other
  manifold × norm: dual iterations on $m\times n$ iterates in ``compute_dtype``, then the
  manifold's ``retr`` in float32 (float64 for float64 parameters). On CUDA this path reads
  back to the host in every step: its feasibility rescale takes $\sigma_{\max}$ from
  ``torch.linalg.eigvalsh`` of the small Gram (equivariant, where a power iteration from a
  fixed start is not), and CUDA's ``eigvalsh`` checks its convergence flag on the host.
  The Gram path, what the pretraining strategies take, reads nothing back.

Per-matrix state: the momentum buffer ($m\times n$) and the dual correction
$\Lambda - \Lambda_0$ used as the next step's warm start (the multiplier's shape:
$n\times n$ for Stiefel/DGram, $n$ for Oblique, nothing for unconstrained manifolds).

Per-batch contract: :meth:`ManifoldMuon._direction` maps the stacked momentum of a
same-shape batch to the stacked **new points** $R_W(-\eta\hat A)$ (the retraction is part of
the assembly), and :meth:`ManifoldMuon._apply` writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Iterable

import torch

from geomuon.manifolds import MatrixManifold
from geomuon.manifolds.capabilities import DUAL_ALPHA_RANGE, admissible_dual_alpha
from geomuon.manifolds.linalg import fp32_or_fp64
from geomuon.manifolds.linalg import MSIGN_METHODS, POLAR_EXPRESS, check_shape_of, shape_on_meta

from .base import MatrixOptimizer, OffManifoldError, require_number
from .distributed import is_sharded
from .regulate import make_regulator, unchecked_regulation
from .gram import DUALIZERS, POLISH_METHODS, SOLVERS, UPDATES, GramSettings, unchecked_gram_step
from .steepest import FAST, NORMS, certified_ratio, unchecked_steepest_direction

__all__ = ["ManifoldMuon", "resolve_manifold", "default_dual_steps", "default_cold_dual_steps", "default_polish_rounds", "default_polish_method",
           "default_dual_alpha", "default_dual_update", "gram_solver", "DEFAULT_DUAL_STEPS", "DEFAULT_DUAL_UPDATE",
           "DUALIZER_SHIFT_EPS"]

#: Default dual steps per optimizer step, chosen on the measured frontier
#: (``bench/manifold_frontier.py``; the table is on the docs' Results page).
DEFAULT_DUAL_STEPS = 1
#: Default dual update of the Gram path (``"newton"`` or ``"jacobi"``) on a form that declares a
#: Newton step, with either dualizer (:func:`default_dual_update`), chosen on the same frontier.
DEFAULT_DUAL_UPDATE = "newton"
#: The Gram path's floor on the unit round-off of the dualizer's shift
#: (``GramSettings.shift_eps``): float32's in every dtype. The shift regularizes the dual
#: as well as absorbing round-off, and DGram's Newton step needs it: replaying the certified
#: steps of a GPT run's square DGram matrices (singular values of the momentum spread over
#: ten decades), the default step certified 0.61 mean / 0.03 min in float64 with float64's
#: shift (0.12 / 0.05 with 8 dual steps) against 0.82 / 0.71 in float32 (``"eigh"``), and
#: 0.71 / 0.00 against 0.82 / 0.71 under ``"polar_express"`` (Cholesky factorizations that
#: fail give zero steps); with this floor float64 certifies as float32 to three digits.
DUALIZER_SHIFT_EPS = torch.finfo(torch.float32).eps
_RETRACTIONS = ("fused", "manifold")
#: The spectral dualizer's kernel and iterations by default (``msign_method``, ``msign_steps``).
DEFAULT_MSIGN_METHOD, DEFAULT_MSIGN_STEPS = "polar_express", 6
#: The norms whose dualizer runs that kernel, as :data:`~geomuon.optimizers.steepest.NORMS`
#: declares them (the row and column dualizers normalize rows or columns, with no polar factor).
_MSIGN_NORMS = tuple(name for name, norm in NORMS.items() if norm.polar_factor)


def default_dual_steps(manifold) -> int:
    """ManifoldMuon's default dual steps on ``manifold``: its Gram form's ``dual_steps`` where
    it declares one (chosen on the measured frontier per manifold), else
    :data:`DEFAULT_DUAL_STEPS`."""
    form = getattr(manifold, "gram_form", None)
    return DEFAULT_DUAL_STEPS if form is None else form.dual_steps


def default_cold_dual_steps(manifold, dual_steps: int) -> int:
    """ManifoldMuon's default dual steps, with warm starts on, in a step that has no warm
    start yet: ``dual_steps``, or the Gram form's ``cold_dual_steps`` where it declares
    more."""
    form = getattr(manifold, "gram_form", None)
    return dual_steps if form is None else max(dual_steps, form.cold_dual_steps)


def default_polish_method(manifold) -> str:
    """ManifoldMuon's default ``polish_method`` on ``manifold``: its Gram form's
    ``polish_method`` (ADMM where the dual optimum is rank-deficient and msign of a dual iterate
    cannot reach it, alternating projections where the dual steps converge; each form's comment
    gives the measurements); ``"admm"`` off the Gram path, which has no polish."""
    form = getattr(manifold, "gram_form", None)
    return form.polish_method if form is not None else "admm"


def default_polish_rounds(manifold) -> int:
    """ManifoldMuon's default ``polish_rounds`` on ``manifold``: its Gram form's
    ``polish_rounds`` (chosen on the certificate inside GPT training), with either dualizer
    (``"eigh"`` clips by an eigendecomposition, ``"polar_express"`` by matrix products:
    :data:`geomuon.optimizers.gram.UNIT_BALLS`); 0 off the Gram path, which has no polish."""
    form = getattr(manifold, "gram_form", None)
    return form.polish_rounds if form is not None else 0


def default_dual_alpha(manifold, update: str) -> float:
    """ManifoldMuon's default ``dual_alpha`` for the Gram path's ``update`` on ``manifold``: its
    Gram form's ``newton_alpha`` for the Newton update (DGram over-relaxes, 1.5), else 1 (the
    Jacobi update, the general path)."""
    form = getattr(manifold, "gram_form", None)
    return form.newton_alpha if form is not None and update == "newton" else 1.0


def _check_form_defaults(manifold, where: str) -> None:
    """Refuse (``ValueError`` naming ``where``, the manifold, its form and the attribute) a Gram
    form whose declared optimizer defaults ManifoldMuon cannot take: called when a group is
    checked, so a bad declaration stops the run before any step."""
    form = getattr(manifold, "gram_form", None)
    invalid = form.invalid_defaults() if form is not None else []
    if invalid:
        raise ValueError(f"{where}: the manifold {_described(manifold)} declares a default ManifoldMuon cannot "
                         f"take: {'; '.join(invalid)}; fix its gram_form (check_manifold_contract checks it)")


def default_dual_update(manifold) -> str:
    """The dual update ManifoldMuon's Gram path takes on ``manifold`` by default (either
    dualizer): :data:`DEFAULT_DUAL_UPDATE` where its Gram form declares a Newton step, else
    ``"jacobi"`` (what :func:`geomuon.optimizers.gram.newton_update` falls back to)."""
    form = getattr(manifold, "gram_form", None)
    return DEFAULT_DUAL_UPDATE if form is not None and form.declares_newton else "jacobi"


def gram_solver(device: torch.device, update: str | None, dualizer: str | None,
                smoothing: float = 0.0) -> tuple[str, str]:
    r"""The Gram path's ``(dual update, dualizer)`` for matrices on ``device``, where the group
    left either as ``None``.

    The dualizer defaults to ``"eigh"`` on the CPU (one exact $n\times n$ eigendecomposition
    costs less than Polar Express on the Cholesky factor there) and to ``"polar_express"``
    elsewhere: on CUDA ``torch.linalg.eigh`` synchronizes the device with the host (it
    checks its convergence flag; see the ``torch.linalg.eigh`` documentation), which the
    step must not do, and solves batched $n > 32$ problems one matrix at a time, while Polar
    Express is matrix products only. The update defaults to :data:`DEFAULT_DUAL_UPDATE` with
    either: with ``"eigh"`` Stiefel's Newton step is the closed form in the eigenbasis, with
    ``"polar_express"`` every form's is conjugate gradients on its frozen tangency equation
    (:func:`geomuon.optimizers.gram.newton_update`). ``smoothing`` $> 0$ needs the eigenvalues
    (:func:`geomuon.optimizers.gram.eigen_dualizer`), so it takes ``"eigh"`` on every device.
    """
    if dualizer is None:
        dualizer = "eigh" if device.type == "cpu" or smoothing else "polar_express"
    return update or DEFAULT_DUAL_UPDATE, dualizer


def resolve_manifold(spec, where: str):
    """A manifold instance from an instance, a registered name (``MatrixManifold.by_name``:
    ``"stiefel"``, ``"dgram"``, ...) or a spec dict; ``ValueError`` naming ``where`` otherwise."""
    if isinstance(spec, (str, Mapping)):
        spec = MatrixManifold.resolve(spec, where)
    if not isinstance(spec, MatrixManifold):
        # (an object with the methods by attribute had passed: geoopt.Scaled forwards its base's,
        # and its scale was then honoured on some paths and dropped on others)
        raise ValueError(
            f"{where}: {type(spec).__name__} is not a geomuon.manifolds.MatrixManifold, whose tangent-constraint "
            "interface ManifoldMuon steps with (CONTRIBUTING.md): pass a geomuon.manifolds class, or subclass "
            "MatrixManifold")
    if not spec.has_defining_map and (
            type(spec).projx is MatrixManifold.projx or type(spec).retr is MatrixManifold.retr):
        # (the generic projx and retr project along normal spaces onto F = 0: the first step had
        # raised NotImplementedError)
        raise ValueError(f"{where}: {type(spec).__name__} defines neither defining_map(x) nor its own projx and "
                         "retr, so it has no retraction to step with; define defining_map (F with M = {F = 0})")
    missing = [name for name in ("constraint(x, u)", "constraint_adjoint(x, lam)")
               if getattr(type(spec), name.partition("(")[0]) is getattr(MatrixManifold, name.partition("(")[0])]
    if missing:
        # (found only inside the first step, after the groups before it had moved)
        raise ValueError(f"{where}: {type(spec).__name__} does not define {' or '.join(missing)}: the tangent "
                         "constraint L_x(u) = 0 and its adjoint, which the steepest-descent engine steps with "
                         "(CONTRIBUTING.md, 'Adding a manifold')")
    return spec


#: learning rates at which a group's regulator is probed besides the group's own
#: (:func:`_regulator_leaves`): a schedule changes the rate after the check, and a regulator
#: coupled to it (weight decay) is the identity at a warm-up's rate 0.
PROBE_RATES = (1e-3, 1e-1)


def _regulator_leaves(manifold, regulator, shape: tuple[int, int], rates: tuple[float, ...]) -> bool:
    """Whether three applications of ``regulator`` at one of the learning ``rates`` take a
    float64 point of ``manifold`` off it, for a generic point and for one whose columns lean
    together (a large top singular value where the manifold allows one: a spectral regulator
    acts only there)."""
    raw = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    points = (manifold.projx(raw), manifold.projx(raw + 4 * raw[:, :1]))
    for lr in dict.fromkeys(rates):
        for point in points:
            for _ in range(3):  # a regulator coupled to lr moves a little each step
                point = unchecked_regulation(regulator, point, lr=lr, state={})
            if not manifold.check_point_on_manifold(point, atol=1e-6):
                return True
    return False


def _described(manifold) -> str:
    """A manifold's class and constructor arguments (two instances of one class differ there)."""
    if isinstance(manifold, MatrixManifold):
        return f"{type(manifold).__name__}{manifold.spec()['args']}"
    return repr(manifold)


def _leaves_own(own, manifold: MatrixManifold, shape: tuple[int, ...]) -> bool:
    """Whether stepping a parameter of ``own`` manifold on its group's ``manifold`` can take it
    off ``own``: for a geomuon manifold, unless the two are interchangeable (instances compared,
    not classes: a sphere of radius 1 in a group of radius 2 had been stepped on the group's);
    for another geoopt manifold (``geoopt.Stiefel``, ``geoopt.Sphere``: they had been stepped on
    the group's without a word), when it refuses a float64 point of ``manifold`` (its
    ``geoopt.Euclidean`` default holds every point)."""
    if isinstance(own, MatrixManifold):
        return own.identity != manifold.identity
    return not own.check_point_on_manifold(manifold.random(*shape, dtype=torch.float64))


def _holds_every_point(own, p: torch.Tensor) -> bool:
    """Whether ``own`` constrains nothing at ``p``'s shape: a geomuon manifold whose constraint
    has no multiplier (Euclidean, LPRO without a radius), or another geoopt manifold that accepts
    a Gaussian point of ``p``'s shape and dtype (``geoopt.Euclidean``, a ManifoldParameter's
    default)."""
    if isinstance(own, MatrixManifold):
        return own.constraint(p.detach(), p.detach()).numel() == 0
    probe = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(0)).to(p.device)
    return bool(own.check_point_on_manifold(probe))


#: Options of the dual iterations (``None``: the manifold's default), which
#: ``solver="projected"`` does not run.
_DUAL_OPTIONS = ("dual_steps", "cold_dual_steps", "dual_alpha", "dual_update", "polish_method")
#: Options only the Gram path reads (``None``: the default), which the general path would ignore.
_GRAM_OPTIONS = ("dual_update", "gram_dualizer", "polish_rounds", "polish_method")


def _options_set(group: dict, keys: tuple[str, ...]) -> list[str]:
    """``key=value`` of each of ``keys`` (``None`` by default) set in ``group``, and of a nonzero
    ``dual_smoothing`` (a Gram-path dual option, default 0): the options a path would ignore."""
    named = [f"{key}={group[key]!r}" for key in keys if group.get(key) is not None]
    return named + ([f"dual_smoothing={group['dual_smoothing']!r}"] if group["dual_smoothing"] else [])
#: Options a step converts with ``int``/``float``: a tensor there would be read back to the host
#: at every step (``lr`` alone may be a tensor, an operand of the update).
_NUMBER_OPTIONS = ("weight_decay", "dual_steps", "cold_dual_steps", "dual_alpha", "msign_steps", "polish_rounds",
                   "dual_smoothing", "certify_every", "certify_reference")


class ManifoldMuon(MatrixOptimizer):
    r"""Muon on a matrix manifold, for any manifold × norm the engine serves.

    Args:
        params: parameters or param groups; each matrix gets its manifold from its group
            (key ``manifold``: an instance or a name) or, if it is a
            ``geoopt.ManifoldParameter``, from itself.
        lr: $\eta$ (default ``0.02``, the seed paper's).
        momentum: $\mu$ (default ``0.95``).
        nesterov: Nesterov momentum (default ``True``).
        weight_decay: $W \leftarrow (1-\eta\lambda)W$ before the retraction (default 0: a
            constrained weight's scale is the manifold's business); $\eta\lambda < 1$ (a
            tensor ``lr`` is checked at its value when the group is checked).
        manifold: default manifold of the groups that set none.
        norm: ``"spectral"`` (default), ``"row"``, ``"column"`` or ``"hybrid"``.
        solver: the Gram path's direction: ``"dual"`` (default: dual iterations in Gram
            space, :func:`geomuon.optimizers.gram.gram_step`) or ``"projected"`` (no dual:
            the polar factor of the projected momentum on the $m\times n$ matrix in
            ``compute_dtype``, as Muon computes it, then ``polish_rounds`` rounds;
            :func:`geomuon.optimizers.gram.projected_step`). On the fast-bf16 CPU of the
            results page a Stiefel step costs about 60 % of the default's for a direction
            about 1 % further from the optimum inside GPT training (0.970 / 0.956 against
            0.978 / 0.954, mean / min); on DGram the dual steps matter more. It needs the
            Gram path: a manifold with a Gram form, the spectral norm, ``msign_method=
            "polar_express"`` and ``retraction="fused"``; the dual options and
            ``warm_start`` do not apply.
        dual_steps: dual-ascent steps per optimizer step (default ``None``:
            :func:`default_dual_steps` of the matrix's manifold; 0 is the projection
            direction $\Phi(P_W\tilde B)$, plus the carried step when warm-started).
        cold_dual_steps: with ``warm_start``, the dual steps of a step that has no warm start
            yet (the first step; after loading a state saved without one). Default ``None``:
            :func:`default_cold_dual_steps` (DGram: at least 2, where one certified its
            first step at 0.918 of the optimum on ``bench/manifold_frontier.py``'s GPT set).
            Refused with ``warm_start=False``, where every step takes ``dual_steps``.
        dual_alpha: dual step size, in units of the full Newton or Jacobi step (default
            ``None``: :func:`default_dual_alpha`, 1 except for the Newton update on a form
            that declares over-relaxation: DGram's 1.5 raised its in-run certificate from
            0.926 / 0.755 to 0.935 / 0.800, mean / min, at no cost); at most
            :data:`~geomuon.manifolds.capabilities.MAX_DUAL_ALPHA` (2).
        dual_update: the Gram path's dual step: ``"newton"`` (Su's fixed point: the Lyapunov
            step in $Z^\top Z$'s eigenbasis on Stiefel with ``"eigh"``, conjugate gradients on
            DGram and with ``"polar_express"``; where the manifold's Gram form declares one, and
            refused where it declares none) or ``"jacobi"`` (:mod:`geomuon.optimizers.gram`); the
            general path is Jacobi.
            Default ``None``: ``"newton"`` (:func:`gram_solver`).
        gram_dualizer: the Gram path's $(Z^\top Z)^{-1/2}$: ``"eigh"`` (exact) or
            ``"polar_express"`` (Polar Express on the Cholesky factor).
            Default ``None``: ``"eigh"`` on the CPU, ``"polar_express"`` on other devices
            (:func:`gram_solver`: CUDA's ``eigh`` synchronizes with the host), ``"eigh"``
            everywhere with ``dual_smoothing`` > 0 (it reads the eigenvalues).
        warm_start: start each step's dual from the previous correction (default True).
        msign_method: the spectral dualizer's kernel, a method of
            :func:`geomuon.manifolds.linalg.msign` (default ``"polar_express"``), for the
            ``"spectral"`` and ``"hybrid"`` norms (``"row"`` and ``"column"`` refuse another).
        msign_steps: its iterations (default 6: the first 6 steps of the Polar Express
            table, singular values within $[0.9935, 1.0012]$; the 5-step table's
            $[0.85, 1.14]$ caps the certified ratio near 0.89); like ``msign_method``, refused
            with ``"row"`` and ``"column"``. The Gram path's dual solver with
            ``gram_dualizer="eigh"`` (the CPU default) takes its polar factors exactly and runs
            no steps.
        compute_dtype: dtype of the dual iterations (default ``torch.bfloat16``); ``torch.float16``
            is refused (see :attr:`~geomuon.optimizers.base.MatrixOptimizer.float16_compute`).
        dual_carry: take one more dual step after the last iterate into the warm start
            (Gram path, with ``warm_start``: without it the step is not taken; default True:
            the dual ascent advances every optimizer step even with ``dual_steps=0``, for the
            price of two $n\times n$ products).
        polish_rounds: rounds of the Gram path's polish of its direction toward the steepest-descent
            optimum (:func:`geomuon.optimizers.gram.polish`; default ``None``:
            :func:`default_polish_rounds` of the matrix's manifold), one $n\times n$
            eigendecomposition each (``"eigh"``) or about 50 $n\times n$ products
            (``"polar_express"``, no host sync). DGram inside GPT training (1 dual step, mean /
            min fraction of the optimum): alternating, 1 round 0.935 / 0.799, 2 rounds 0.952 /
            0.830; ADMM, 1 round 0.924 / 0.778, 2 rounds 0.954 / 0.8235, 3 rounds 0.967 / 0.860.
        polish_method: ``"admm"`` (ADMM started from the last dual iterate: toward the
            optimum) or ``"alternating"`` (projections onto the unit ball and the tangent
            space: toward the feasible set), :data:`geomuon.optimizers.gram.POLISH_METHODS`;
            default ``None``: :func:`default_polish_method` of the matrix's manifold (Stiefel
            alternating, DGram ADMM). The dual solver's option: ``solver="projected"`` refuses it,
            and so does ``polish_rounds=0`` (no round would run).
        dual_smoothing: $c$ of the Gram path's smoothed dual
            $\operatorname{tr}(Z^\top Z + \mu I)^{1/2}$, $\sqrt\mu = c\,\|Z\|_*/n$
            (:func:`geomuon.optimizers.gram.eigen_dualizer`; ``"eigh"`` dualizer only): its
            optimum's direction is tangent and certifies $\ge 1 - 0.301c$, where the unsmoothed
            dual is nonsmooth (a rank-spread momentum). Default 0.
        retraction: ``"fused"`` (default: a manifold with a Gram form retracts inside the
            Gram-space assembly with the form's retraction; any other manifold with its
            ``retr``) or ``"manifold"`` (always the general path and ``manifold.retr``).
        certify_every: every this many steps, compute the exact duality certificate
            of each matrix's direction into :attr:`certificates` (0: never; it costs an
            SVD per matrix).
        certify_reference: dual steps of a reference solve of the same problem (same point,
            momentum and warm start; it changes nothing) run only at certified steps, whose
            dual iterate tightens the certificate: it divides by the smaller of the two
            dual values, both upper bounds on the optimum, so it approaches the fraction of
            the optimal descent the direction achieves (0, the default: the step's own
            dual iterate). Matrices on the Gram path (:mod:`geomuon.optimizers.gram`) only;
            others certify against their own iterate.
        nonfinite: group key of :mod:`geomuon.optimizers.base`: ``"skip"`` or ``"raise"``.
        regulate: group key of :mod:`geomuon.optimizers.base`: a regulator spec or ``None``.
        matrix_view: group key of :mod:`geomuon.optimizers.base`: ``"strict"``, ``"batch"`` or
            ``"flatten"``.

    Attributes:
        certificates: ``{parameter name: certified ratio}`` of the last certified step.

    The options are checked when a group is added or loaded, and again at the next step, before
    any group steps, when a param-group edit changed one (the base's rule; ``lr`` each step
    against ``weight_decay`` where it is a float). Options other than ``lr`` are Python
    numbers: a step would read a tensor back to the host. The Gram path's own options
    (``dual_update``, ``gram_dualizer``, ``polish_rounds``, ``polish_method``,
    ``dual_smoothing``) are refused in a group none of whose matrices takes that path.

    Each param group counts its optimizer steps in its key ``"step_count"`` (what
    ``certify_every`` counts): the groups are saved by :meth:`state_dict`, copied by
    ``copy.deepcopy`` and pickled, so a resumed run certifies at the same steps as an
    uninterrupted one. (The update itself depends on the per-matrix state only: momentum,
    warm start and step count tensors.)

    Every weight's first step (after construction, :meth:`load_state_dict` or
    ``add_param_group``; a weight without a gradient then, at its first step with one) checks on
    the device that it is on its manifold (:meth:`step`), so a weight that left its manifold
    raises :class:`~geomuon.optimizers.base.OffManifoldError` (a ``ValueError``) naming it
    instead of being silently retracted; the step reads nothing back from the device (a sharded
    group's step reads its flags: :meth:`step`).
    """

    matrix_update = "manifold_muon"
    parallel_batches = True  # eigendecompositions and n x n elementwise work: 1.5x, not 2x, from a 2nd thread
    # one matrix per CPU stack, the same bits: fewer page faults where the process has not
    # allocated much else (GPT-2-small block, one thread, paired runs: Stiefel 42-53k faults
    # and 2318-2327 ms per step -> 0 and 2243-2247 ms; DGram 62-186k and 3699-4114 ms -> 0
    # and 3601-3737 ms); in the step benchmark's process the faults stay (87k, 153k)
    cpu_stack_size = 1

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        *,
        manifold=None,
        norm: str = "spectral",
        solver: str = "dual",
        dual_steps: int | None = None,
        cold_dual_steps: int | None = None,
        dual_alpha: float | None = None,
        dual_update: str | None = None,
        gram_dualizer: str | None = None,
        warm_start: bool = True,
        msign_method: str = DEFAULT_MSIGN_METHOD,
        msign_steps: int | None = DEFAULT_MSIGN_STEPS,
        compute_dtype: torch.dtype | None = torch.bfloat16,
        dual_carry: bool = True,
        polish_rounds: int | None = None,
        polish_method: str | None = None,
        dual_smoothing: float = 0.0,
        retraction: str = "fused",
        certify_every: int = 0,
        certify_reference: int = 0,
        nonfinite: str = "skip",
        regulate=None,
        matrix_view: str = "batch",
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, manifold=manifold,
            norm=norm, solver=solver, dual_steps=dual_steps, cold_dual_steps=cold_dual_steps, dual_alpha=dual_alpha, dual_update=dual_update,
            gram_dualizer=gram_dualizer, warm_start=warm_start,
            msign_method=msign_method, msign_steps=msign_steps, compute_dtype=compute_dtype,
            dual_carry=dual_carry, polish_rounds=polish_rounds, polish_method=polish_method, dual_smoothing=dual_smoothing, retraction=retraction, certify_every=certify_every, certify_reference=certify_reference, nonfinite=nonfinite, regulate=regulate, matrix_view=matrix_view,
        )
        self._certified: dict[str, torch.Tensor] = {}
        self._unchecked: set[int] = set()  # ids of the weights not yet checked on their manifold
        self._checks = 0  # weights checked on their manifold so far (step reports after a step that checked)
        super().__init__(params, defaults)

    @property
    def certificates(self) -> dict[str, float]:
        """``{parameter name: certified ratio}`` of the last certified step (read back from
        the device here, never inside a step)."""
        return {name: float(ratio) for name, ratio in self._certified.items()}

    def _check_scheduled(self, group: dict, index: int, *, in_step: bool = False) -> None:
        r"""The base's, and ``lr`` * ``weight_decay`` < 1 for a matrix group: the decay factor
        $1 - \eta\lambda$ scales the point (a factor <= 0 had scaled it to 0 or through it). A
        tensor ``lr`` is read when the group is checked, not in a step."""
        super()._check_scheduled(group, index, in_step=in_step)
        if group["update"] == "adamw" or in_step and isinstance(group["lr"], torch.Tensor):
            return
        if float(group["lr"]) * float(group["weight_decay"]) >= 1:
            raise ValueError(f"group {index}: lr * weight_decay must be < 1 (the decay factor 1 - lr * weight_decay "
                             f"scales the point), got {group['lr']} * {group['weight_decay']}"
                             + ("; nothing was stepped" if in_step else ""))

    def _validate_group(self, group: dict, index: int) -> None:
        super()._validate_group(group, index)
        if group["update"] == "adamw":
            for i, p in enumerate(group["params"]):
                own = getattr(p, "manifold", None)
                # AdamW ignores a manifold: a ManifoldParameter on a constrained one had left it
                if own is not None and not _holds_every_point(own, p):
                    raise ValueError(f"group {index}: parameter {self._name(group, i, index)} is a ManifoldParameter "
                                     f"on {_described(own)}, which an update='adamw' group would step off it; give "
                                     "it a ManifoldMuon group (drop update='adamw')")
            return
        if group["msign_method"] not in MSIGN_METHODS:
            raise ValueError(f"group {index}: msign_method must be one of {MSIGN_METHODS}, "
                             f"got {group['msign_method']!r}")
        if group["msign_steps"] is not None:
            require_number(index, "msign_steps", group["msign_steps"], lambda x: x >= 1 and x == int(x),
                           "an integer >= 1 (or None)")
        require_number(index, "certify_every", group["certify_every"], lambda x: x >= 0 and x == int(x),
                       "an integer >= 0 (0: never)")
        if group["norm"] not in NORMS:
            raise ValueError(f"group {index}: unknown norm {group['norm']!r}; choose one of {list(NORMS)}")
        kernel = (group["msign_method"], group["msign_steps"])
        # a kernel the group inherited from a constructor whose own norm runs it is no request of this group's
        inherited = (kernel == (self.defaults["msign_method"], self.defaults["msign_steps"])
                     and self.defaults["norm"] in _MSIGN_NORMS)
        if group["norm"] not in _MSIGN_NORMS and kernel != (DEFAULT_MSIGN_METHOD, DEFAULT_MSIGN_STEPS) and not inherited:
            # the row and column dualizers run no polar factor: the kernel had been accepted and ignored
            raise ValueError(f"group {index}: msign_method={group['msign_method']!r}, msign_steps="
                             f"{group['msign_steps']!r} would be ignored: norm={group['norm']!r} dualizes with no "
                             f"polar factor (only {_MSIGN_NORMS} run one); leave them out or choose such a norm")
        if group["retraction"] not in _RETRACTIONS:
            raise ValueError(f"group {index}: retraction must be one of {_RETRACTIONS}, got {group['retraction']!r}")
        if group["solver"] not in SOLVERS:
            raise ValueError(f"group {index}: solver must be one of {SOLVERS}, got {group['solver']!r}")
        if group["solver"] == "projected" and (group["norm"], group["msign_method"], group["retraction"]) != (
                "spectral", "polar_express", "fused"):
            raise ValueError(f"group {index}: solver='projected' is the Gram path's: it needs norm='spectral', "
                             "msign_method='polar_express' and retraction='fused' (got "
                             f"{group['norm']!r}, {group['msign_method']!r}, {group['retraction']!r})")
        if group["solver"] == "projected":
            # the dual options would be ignored: a user setting dual_steps=5 got no dual step
            ignored = _options_set(group, _DUAL_OPTIONS)
            if ignored:
                raise ValueError(f"group {index}: solver='projected' takes no dual iterations, so "
                                 f"{', '.join(ignored)} would be ignored; leave them out or use solver='dual'")
        if group["dual_update"] not in (*UPDATES, None):
            raise ValueError(f"group {index}: dual_update must be one of {UPDATES} (or None: by the dualizer), "
                             f"got {group['dual_update']!r}")
        if group.get("polish_method") not in (*POLISH_METHODS, None):
            raise ValueError(f"group {index}: polish_method must be one of {POLISH_METHODS} (or None: the manifold's "
                             f"default), got {group['polish_method']!r}")
        if group.get("polish_method") is not None and group.get("polish_rounds") == 0:
            # no round runs: the method had been accepted and ignored
            raise ValueError(f"group {index}: polish_method={group['polish_method']!r} with polish_rounds=0 would be "
                             "ignored (no polish round runs); leave polish_method out or set polish_rounds >= 1")
        if group.get("cold_dual_steps") is not None and group["warm_start"] is False:
            # every step starts cold and takes dual_steps: the option had been accepted and ignored
            raise ValueError(f"group {index}: cold_dual_steps={group['cold_dual_steps']!r} with warm_start=False "
                             "would be ignored (it sets the dual steps of a warm-started run's first step; without "
                             "warm starts every step takes dual_steps); leave cold_dual_steps out or set dual_steps")
        if group["gram_dualizer"] not in (*DUALIZERS, None):
            raise ValueError(f"group {index}: gram_dualizer must be one of {DUALIZERS} (or None: by the device), "
                             f"got {group['gram_dualizer']!r}")
        # counts are whole numbers (2.7 had become 2), flags booleans ("no" had been true), the
        # step size finite (inf had written NaN weights)
        for key in ("dual_steps", "cold_dual_steps", "polish_rounds", "certify_reference"):
            if group.get(key) is not None:
                require_number(index, key, group[key], lambda x: x >= 0 and x == int(x) and not isinstance(
                    group[key], bool), "a whole number >= 0" + ("" if key == "certify_reference" else
                                                              " (or None: the manifold's default)"))
        if group["dual_alpha"] is not None:
            # (4.0 had grown the Gram path's warm start 13x a step, to NaN weights or an unnamed eigh error)
            require_number(index, "dual_alpha", group["dual_alpha"], admissible_dual_alpha,
                           f"{DUAL_ALPHA_RANGE} (or None: the manifold's default)")
        for key in ("warm_start", "dual_carry"):
            if not isinstance(group[key], bool):
                raise ValueError(f"group {index}: {key} must be True or False, got {group[key]!r}")
        for key in _NUMBER_OPTIONS:
            if isinstance(group.get(key), torch.Tensor):
                raise ValueError(f"group {index}: {key} must be a Python number, got a tensor (the step would read "
                                 f"it back to the host); pass {key}={group[key].item()!r}")
        require_number(index, "dual_smoothing", group["dual_smoothing"], lambda x: x >= 0, "a finite number >= 0")
        if float(group["dual_smoothing"]) and group["gram_dualizer"] == "polar_express":
            raise ValueError(f"group {index}: dual_smoothing needs gram_dualizer='eigh' (mu is read off the "
                             "eigenvalues of Z^T Z)")
        manifold = None
        if group["manifold"] is not None:
            # the group keeps the spec (plain data for state_dict); the live one is derived
            manifold = resolve_manifold(group["manifold"], f"param group {index}")
            group["manifold"] = manifold.spec()
            self._manifolds[id(group)] = (group["manifold"], manifold)
            manifold.identity  # computed here, not in a step  # noqa: B018
            _check_form_defaults(manifold, f"group {index}")
        for i, p in enumerate(group["params"]):
            own = getattr(p, "manifold", None)
            name = self._name(group, i, index)
            if group["manifold"] is None and own is None:
                # (a sharded one had been told to pass the ManifoldParameter it had been given)
                lost = (" (it is a DTensor: fully_shard replaces a geoopt.ManifoldParameter by a plain DTensor "
                        "parameter, and its manifold is lost)" if is_sharded(p) else "")
                raise ValueError(
                    f"ManifoldMuon: parameter {name} has no manifold{lost}; set the group's 'manifold' "
                    "(e.g. 'stiefel') or pass a geoopt.ManifoldParameter"
                )
            owner = manifold
            if own is not None and group["manifold"] is None:
                owner = resolve_manifold(own, f"parameter {name}")
                owner.identity  # noqa: B018
                _check_form_defaults(owner, f"parameter {name}")
            elif own is not None and _leaves_own(own, manifold, tuple(p.shape)):
                raise ValueError(
                    f"ManifoldMuon: parameter {name} is a ManifoldParameter on {_described(own)} but its group "
                    f"says {_described(manifold)}; give them the same manifold"
                )
            # (its manifold had refused it at the first step, naming no parameter, after earlier groups had moved)
            problem = "it is empty" if p.numel() == 0 else owner.shape_problem(*self._matrix_shape(group, p)[-2:])
            if problem is not None:
                raise ValueError(f"ManifoldMuon: parameter {name} of shape {tuple(p.shape)} has no point on "
                                 f"{_described(owner)} ({problem}); give it a manifold of its shape, or an "
                                 "update='adamw' group")
            if group["solver"] == "projected":
                self._check_projected(group, p, owner, name)
        forms = self._gram_forms(group, index, manifold)
        self._refuse_gram_options_off_the_gram_path(group, index, forms)
        self._refuse_newton_without_a_newton_step(group, index, forms)
        if group["regulate"] is not None:
            self._refuse_regulators_that_leave(group, index, manifold)

    def _gram_forms(self, group: dict, index: int, manifold) -> list[tuple[int, Any, Any]]:
        """``(position, manifold, Gram form or None)`` of each parameter of group ``index``
        (:meth:`_gram_form`; ``manifold``: the group's, else each parameter's own)."""
        forms = []
        for i, p in enumerate(group["params"]):
            owner = manifold if manifold is not None else resolve_manifold(p.manifold, f"param group {index}")
            forms.append((i, owner, self._gram_form(group, owner, self._matrix_shape(group, p))))
        return forms

    def _refuse_newton_without_a_newton_step(self, group: dict, index: int, forms: list) -> None:
        """Refuse ``dual_update="newton"`` in a group with a matrix whose Gram form declares no Newton
        step (``declares_newton``: Oblique's): its dual steps would be Jacobi's, the option ignored
        (its default, ``None``, takes whichever the form has). ``forms``: :meth:`_gram_forms`."""
        if group["dual_update"] != "newton":
            return
        for i, owner, form in forms:
            if form is not None and not form.declares_newton:
                raise ValueError(
                    f"group {index}: dual_update='newton' would be ignored for parameter {self._name(group, i, index)}: "
                    f"the Gram form of {_described(owner)} declares no Newton step (has_newton or newton_cg_steps), "
                    "so its dual steps are Jacobi's; leave dual_update out (None: the form's own) or use 'jacobi'")

    def _refuse_gram_options_off_the_gram_path(self, group: dict, index: int, forms: list) -> None:
        """Refuse the Gram path's options (:data:`_GRAM_OPTIONS`, a nonzero ``dual_smoothing``) in
        a group none of whose matrices takes that path (``forms``: :meth:`_gram_forms`): the general
        path would ignore them (``norm="row"`` with ``polish_rounds=3`` had run no polish)."""
        ignored = _options_set(group, _GRAM_OPTIONS)
        if not ignored or not forms or any(form is not None for _, _, form in forms):
            return
        raise ValueError(
            f"group {index}: {', '.join(ignored)} would be ignored: they are options of the Gram path, which no "
            f"matrix of the group takes (it needs norm='spectral', msign_method='polar_express', "
            f"retraction='fused', a manifold with a Gram form, and tall or square matrices or a manifold that "
            f"steps wide ones transposed; here norm={group['norm']!r}, msign_method={group['msign_method']!r}, "
            f"retraction={group['retraction']!r}); leave them out")

    def _refuse_regulators_that_leave(self, group: dict, index: int, manifold) -> None:
        """Refuse a group regulator that takes points of the group's manifold off it: the
        regulator runs after the retraction, so such a pair had left the weights off the
        manifold with no error (soft_cap on Stiefel: |W^T W - I| = 0.012 after three steps;
        a resumed run then refused them). Probed when the group is checked
        (:func:`_regulator_leaves`) for every manifold and shape of the group, at the group's
        learning rate and at :data:`PROBE_RATES` (a weight decay had passed a warm-up's lr=0 and
        then left Stiefel)."""
        regulator = make_regulator(group["regulate"])
        rates = (float(group["lr"]), *PROBE_RATES)
        probed = set()
        for p in group["params"]:
            owner = resolve_manifold(manifold if manifold is not None else p.manifold, f"param group {index}")
            shape = tuple(self._matrix_shape(group, p)[-2:])
            if (id(owner), shape) not in probed and _regulator_leaves(owner, regulator, shape, rates):
                raise ValueError(
                    f"group {index}: regulate={group['regulate']!r} takes points of {type(owner).__name__} off it "
                    "(it runs after the retraction, and ManifoldMuon keeps weights on their manifold): use that "
                    "regulator with Muon, or a manifold whose points it keeps (column_cap keeps DGram's)")
            probed.add((id(owner), shape))

    def _check_projected(self, group: dict, p: torch.Tensor, manifold, name: str) -> None:
        """Refuse, before any step, a matrix that ``solver="projected"`` cannot step: the solver
        is the Gram path's, which needs the manifold's Gram form and, for a wide matrix, a
        manifold that steps wide points transposed."""
        if getattr(manifold, "gram_form", None) is None:
            raise ValueError(f"ManifoldMuon: parameter {name}: solver='projected' needs a manifold with a Gram "
                             f"form (Stiefel, DGram, Oblique), not {type(manifold).__name__}; use solver='dual'")
        rows, cols = self._matrix_shape(group, p)[-2:]
        if rows < cols and not manifold.transposes_wide:
            raise ValueError(f"ManifoldMuon: parameter {name} is wide ({rows} x {cols}) on "
                             f"{type(manifold).__name__}, which does not step wide points transposed: "
                             "solver='projected' serves tall and square ones only; use solver='dual'")

    def _check_loaded_state(self, group: dict, p: torch.Tensor, key: str, value: torch.Tensor, name: str) -> None:
        """A saved warm start ``"dual_correction"`` has the shape of its parameter's multiplier (its
        manifold's ``constraint`` at the parameter's matrix shape): a step takes the warm starts it
        holds unchecked (:func:`~geomuon.optimizers.gram.unchecked_gram_step`,
        :func:`~geomuon.optimizers.steepest.unchecked_steepest_direction`), and one of another
        shape had broadcast over its batch or failed inside a product."""
        if key != "dual_correction" or group["update"] == "adamw":
            return
        # resolved here, not through the cache of live groups (_group_manifold: keyed by the group's id)
        manifold = resolve_manifold(p.manifold if group["manifold"] is None else group["manifold"], f"parameter {name}")
        point = torch.empty(self._matrix_shape(group, p), device="meta")
        check_shape_of(f"{type(self).__name__}.load_state_dict", f"state 'dual_correction' of parameter {name}",
                       value, manifold.constraint, point, point,
                       what_to_do="the state was saved for another model (or its groups in another order)")

    def _state_dtype(self, key: str, p: torch.Tensor) -> torch.dtype | None:
        # the warm start lives in the retraction dtype (fp32 for bf16 weights): a bf16 copy
        # changed a resumed run's next step by 5e-4
        return fp32_or_fp64(p.dtype) if key == "dual_correction" else super()._state_dtype(key, p)

    def _group_checked(self, group: dict, index: int, added: list | None = None) -> None:
        # a group added after the first step, or edited (its manifold, say): its weights are
        # checked at their next step, as the first step checks every weight (unchecked, an
        # off-manifold weight was stepped to a norm of 5e9 in one step); a group whose params
        # alone changed, the weights put into them (a weight taken out of one rank's list and
        # checked there alone would gather on that rank only)
        if group["update"] != "adamw":
            self._unchecked.update(id(p) for p in (group["params"] if added is None else added))
            if added is None:
                self._drop_misfit_warm_starts(group)

    def _drop_misfit_warm_starts(self, group: dict) -> None:
        """Drop the warm starts of ``group`` that no longer have its multiplier's shape (an edit to
        another manifold or norm, say): those weights' next step starts cold. A step takes its warm
        starts unchecked, and one of another shape had failed inside a product mid-step
        (``RuntimeError: shape '[24, 8]' is invalid``); a warm start that still fits is kept (an
        edit of ``weight_decay`` or ``dual_steps`` leaves the dual problem's shape as it was)."""
        for p in group["params"]:
            state = self.state.get(p, {})
            if "dual_correction" in state:
                point = torch.empty(self._matrix_shape(group, p), device="meta")
                shape = shape_on_meta(self._manifold_of(group, p).constraint, point, point)
                if shape is not None and state["dual_correction"].shape != shape:
                    del state["dual_correction"]

    def _check_every_weight(self) -> None:
        """Check every constrained weight again at its next step (:meth:`_admissible`)."""
        self._unchecked = {id(p) for group in self.param_groups if group["update"] != "adamw"
                           for p in group["params"]}

    def _rebuild_derived_state(self) -> None:
        super()._rebuild_derived_state()
        # Loaded or copied weights may have left their manifold: check again.
        self._check_every_weight()
        self._certified = getattr(self, "_certified", {})
        self._checks = getattr(self, "_checks", 0)

    def _manifold_of(self, group: dict, p: torch.Tensor):
        return self._group_manifold(group) if group["manifold"] is not None else p.manifold

    def _batch_key(self, group: dict, p: torch.Tensor) -> tuple:
        m = self._manifold_of(group, p)
        return super()._batch_key(group, p) + (m.identity,)

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one step; a weight's first step with a gradient (after construction,
        :meth:`load_state_dict`, ``add_param_group``, an edited group or its appending to a
        group's ``params``) checks it is on its manifold, on the
        device (:meth:`_admissible`), and raises :class:`~geomuon.optimizers.base.OffManifoldError` naming the weights off
        theirs once the flags are on the host: at the end of this step on the CPU, at the
        next step or :meth:`check_finite` elsewhere. Those weights are not stepped.
        With sharded (``DTensor``) parameters that check runs at the group's finiteness read
        (:meth:`_finite_on_host`), once the ranks' options and parameters are compared: every
        rank gathers each matrix to check whole (one all-gather per matrix) and reads the
        group's flags back, one more host synchronisation per such group on CUDA, at the
        first step and again after those events; the weights off their manifold are left out
        of the step on every rank and raise
        :class:`~geomuon.optimizers.base.OffManifoldError` at the end of this step (the group's
        other weights step, as in one process)."""
        self._check_edited_groups()  # first: an edited group's weights are among those this step checks
        checks = self._checks  # (not the size of _unchecked: a sharded step adds the weights other ranks check)
        counts = [group.get("step_count", 0) for group in self.param_groups]
        for group, count in zip(self.param_groups, counts):
            group["step_count"] = count + 1  # the step's certificates read it
        try:
            loss = self._step_checked(closure)
        except Exception:
            # a refused step (a skip reported under nonfinite="raise", an inadmissible group, a
            # failing closure) raises before any weight moves: it is not a step, and the
            # certificates must stay on the steps the weights took
            for group, count in zip(self.param_groups, counts):
                group["step_count"] = count
            raise
        if self._checks > checks:  # this step checked weights (non-finite skips: reported at the next step)
            self._report_skips(wait=False, nonfinite=False)
        return loss

    def _report_skips(self, wait: bool, nonfinite: bool = True) -> dict[str, int]:
        try:
            return super()._report_skips(wait, nonfinite)
        except OffManifoldError:
            self._check_every_weight()  # check again until every weight is on its manifold
            raise

    def _admissible(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor | None:
        """``[B]`` bool: whether each matrix not checked yet (its first step, see the class
        docstring) is on its manifold, by the manifold's device-side
        :meth:`~geomuon.manifolds.MatrixManifold.points_on_manifold` with the tolerances of
        :meth:`check_on_manifold` (a matrix of a ``"batch"`` view: every slice), true for the
        matrices checked at earlier steps; ``None`` (all) when every matrix is. A manifold whose
        check is host-side only is checked here on the host. (A sharded matrix is gathered whole
        for it: :meth:`_finite_on_host`.)"""
        if group["update"] == "adamw" or self._unchecked.isdisjoint(map(id, params)):
            return None
        flags = []
        for p in params:
            if id(p) not in self._unchecked:  # checked at an earlier step
                flags.append(torch.ones((), dtype=torch.bool, device=p.device))
                continue
            self._unchecked.discard(id(p))
            self._checks += 1
            matrix, tol = self._checked_point(group, p, 1e-5)
            manifold = self._manifold_of(group, p)
            on = manifold.points_on_manifold(matrix, atol=tol, rtol=1e-5)
            if on is None:  # a documented host read, for manifolds without a device check
                on = torch.tensor(manifold.check_point_on_manifold(matrix, atol=tol, rtol=1e-5), device=p.device)
            flags.append(on.all())
        return torch.stack(flags)

    def _pending_checks(self, group: dict, params: list[torch.Tensor]) -> list[bool] | None:
        return None if group["update"] == "adamw" else [id(p) in self._unchecked for p in params]

    def _add_checks(self, group: dict, params: list[torch.Tensor]) -> None:
        self._unchecked.update(map(id, params))

    def _points(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor:
        """The stacked points ``[B, *matrix_shape]`` in the retraction dtype (fp32, fp64 for
        fp64); one contiguous matrix already in it is viewed, not copied (a CPU stack holds one):
        the step only reads its points, and :meth:`_apply` writes a weight after its step."""
        shape = self._matrix_shape(group, params[0])
        dtype = fp32_or_fp64(params[0].dtype)
        if len(params) == 1 and params[0].dtype == dtype and params[0].is_contiguous():
            return params[0].view(1, *shape)
        return torch.stack([p.reshape(shape).to(dtype) for p in params])

    def _gram_form(self, group: dict, manifold, shape: tuple[int, ...]):
        """The manifold's Gram form when the Gram path serves this batch, else ``None``: the
        spectral norm with the Polar Express dualizer and the fused retraction, on a shape
        whose Gram side is the short one (a manifold that does not transpose wide points
        would work on the long side)."""
        form = getattr(manifold, "gram_form", None)
        if form is None or group["norm"] != "spectral" or group["msign_method"] != "polar_express":
            return None
        if group["retraction"] != "fused" or (shape[-2] < shape[-1] and not manifold.transposes_wide):
            return None
        return form

    def _direction(self, group: dict, M: torch.Tensor, params: list[torch.Tensor],
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        """The stacked new points $R_{cW}(-\\eta\\hat A)$ of a same-shape batch (see the module
        docstring), in the retraction dtype; ``M`` is the stacked momentum ``[B, *shape]``. A
        matrix with ``keep`` false (a skipped step) keeps its point (:meth:`_apply` selects it),
        its warm start and its step count exactly (no retraction round-off); a zero momentum
        that is kept is a step (decay and retraction apply)."""
        manifold = self._manifold_of(group, params[0])
        states = [self.state[p] for p in params]
        warm_starts = [group["warm_start"] and "dual_correction" in s for s in states]
        if any(warm_starts) and not all(warm_starts):
            # a batch-mate's first step (or first gradient) beside warm-started matrices: each
            # part steps as it would alone (a whole-batch stack had cold-started every matrix)
            parts = [[i for i, w in enumerate(warm_starts) if w is flag] for flag in (True, False)]
            points = torch.cat([self._direction(group, M[part], [params[i] for i in part],
                                                None if keep is None else keep[part]) for part in parts])
            order = [i for part in parts for i in part]
            return points[sorted(range(len(order)), key=order.__getitem__)]
        W = self._points(group, params)
        G = M.to(W.dtype)
        for i, state in enumerate(states):
            state["step"] = state.get("step", torch.tensor(0.0)) + (1 if keep is None else keep[i])
        lr = group["lr"]  # a float, or a 1-element tensor used as one (never read back)
        lr = lr.reshape(()) if isinstance(lr, torch.Tensor) else float(lr)
        shrink = 1.0 - lr * float(group["weight_decay"]) if group["weight_decay"] else 1.0
        warm = None
        if all(warm_starts):
            warm = torch.stack([s["dual_correction"] for s in states])
        every = int(group["certify_every"])
        certify = bool(every) and group["step_count"] % every == 0
        solver = group
        if group["dual_steps"] is None:
            solver = dict(group, dual_steps=default_dual_steps(manifold))
        if group["warm_start"] and warm is None:
            cold = group.get("cold_dual_steps")  # (absent from a group saved before it existed: the default)
            cold = default_cold_dual_steps(manifold, int(solver["dual_steps"])) if cold is None else int(cold)
            solver = dict(solver, dual_steps=cold)
        if manifold.dualizer_keeps_tangent(W, group["norm"]):
            # A closed form (square Stiefel, the centered router): the direction is
            # Phi(P_W G) with no dual step. Its dual gradient is round-off, so dual steps would
            # only feed round-off into the warm start, which the next direction amplifies by
            # 1/sigma_min(P_W G) (measured: 1e-2 weight drift in 20 fp32 steps of a GPT's
            # square attention projection from a reordered batch sum).
            solver, warm = dict(solver, dual_steps=0, dual_carry=False, polish_rounds=0), None
        form = self._gram_form(group, manifold, W.shape)
        if form is not None:
            point, correction, ratio = self._gram_path(solver, manifold, form, W, G, lr, shrink, warm, certify,
                                                       params[0].dtype)
        else:
            point, correction, ratio = self._general_path(solver, manifold, W, G, lr, shrink, warm, certify)
        if group["warm_start"] and correction is not None:
            if warm is not None and keep is not None:
                correction = torch.where(keep.reshape(-1, *(1,) * (correction.dim() - 1)), correction, warm)
            # views of this step's fresh stack (no copy): nothing else holds or writes it
            for state, value in zip(states, correction):
                state["dual_correction"] = value
        if ratio is not None:
            index = self._group_index(group)
            for p, value in zip(params, ratio.reshape(len(params), -1).mean(dim=-1)):
                position = next(i for i, q in enumerate(group["params"]) if q is p)
                self._certified[self._name(group, position, index)] = value
        return point

    def _gram_path(self, group, manifold, form, W, G, lr, shrink, warm, certify, stored):
        flip = W.size(-2) < W.size(-1)  # transposed geometry for wide points
        Wt, Gt = (W.mT, G.mT) if flip else (W, G)
        shape = Wt.shape
        update, dualizer = gram_solver(W.device, group["dual_update"], group["gram_dualizer"],
                                       float(group.get("dual_smoothing", 0.0)))
        polish = group.get("polish_rounds")  # (absent from a group saved before it existed: the default)
        polish = default_polish_rounds(manifold) if polish is None else int(polish)
        method = group.get("polish_method") or default_polish_method(manifold)  # (absent before it existed)
        alpha = group["dual_alpha"]
        alpha = default_dual_alpha(manifold, update) if alpha is None else float(alpha)
        settings = GramSettings(
            solver=group.get("solver", "dual"),  # (absent from a group saved before it existed)
            # the carried step goes into the next warm start only: without warm starts it is not taken
            dual_steps=int(group["dual_steps"]), carry=bool(group["dual_carry"]) and bool(group["warm_start"]),
            alpha=alpha,
            update=update, dualizer=dualizer,
            msign_steps=POLAR_EXPRESS.default_steps if group["msign_steps"] is None else int(group["msign_steps"]),
            compute_dtype=group["compute_dtype"], polish_rounds=polish, polish_method=method,
            smoothing=float(group.get("dual_smoothing", 0.0)), shift_eps=DUALIZER_SHIFT_EPS,
            stored_dtype=stored if torch.finfo(stored).eps > torch.finfo(W.dtype).eps else None,
        )
        flat = (-1, *shape[-2:])
        if warm is not None:
            warm = warm.reshape(-1, *warm.shape[W.dim() - 2:])
        # the warm start is this optimizer's own, or checked at load_state_dict and at a group edit
        # (_drop_misfit_warm_starts): no per-step shape check
        out = unchecked_gram_step(form, Wt.reshape(flat), Gt.reshape(flat), lr, warm, settings, shrink)
        point = out.point.reshape(shape)
        correction = None
        if out.correction is not None:
            correction = out.correction.reshape(*shape[:-2], *out.correction.shape[1:])
        ratio = None
        if certify:
            Wf = shrink * Wt.reshape(flat)
            iterates = [out.dual_iterate(Wf)]
            reference = int(group.get("certify_reference", 0))  # (absent from a group saved before it existed)
            if reference:
                solve = replace(settings, solver="dual", dual_steps=reference, polish_rounds=0)
                iterates.append(unchecked_gram_step(form, Wt.reshape(flat), Gt.reshape(flat), lr, warm, solve,
                                                    shrink).dual_iterate(Wf))
            # the tangent part, in the points' dtype: the projected solver's direction is tangent
            # only to its compute dtype, and its normal part is not a step (the retraction removes
            # it); projected at W itself (cW has the same normal space)
            direction = out.direction(Wf)
            W_flat = Wt.reshape(flat)
            direction = direction - W_flat @ form.project(W_flat.mT @ W_flat, W_flat.mT @ direction)
            ratio = certified_ratio(Gt.reshape(flat), direction, *iterates).reshape(shape[:-2])
        # a wide point leaves as a transposed view: _apply's keep-or-move selection writes it
        # into the weight in one pass (a transposing copy first: 0.88 against 0.68 ms for one
        # 384x1536 selection and write, one AMX Xeon thread)
        return (point.mT if flip else point), correction, ratio

    def _general_path(self, group, manifold, W, G, lr, shrink, warm, certify):
        r"""$R_{cW}(-\eta\hat A)$ with $\hat A$ the engine's direction at $W$ itself: $cW$ has $W$'s
        tangent space (every constraint is homogeneous in $W$), but is off the manifold, where a
        manifold's ``proju`` is no projection (Stiefel's at $cW$ removes $c^2$ of the normal part:
        a normal gradient had moved a decayed Stiefel weight by 0.11 in three steps)."""
        decayed = W if not isinstance(shrink, torch.Tensor) and shrink == 1.0 else W * shrink
        alpha = group["dual_alpha"]
        alpha = default_dual_alpha(manifold, "jacobi") if alpha is None else float(alpha)  # its dual steps are Jacobi's
        settings = FAST.replace(steps=int(group["dual_steps"]), alpha=alpha,
                                msign_method=group["msign_method"], msign_steps=group["msign_steps"],
                                compute_dtype=group["compute_dtype"], certify="exact" if certify else None)
        # the warm start is this optimizer's own, or checked at load_state_dict and at a group edit
        # (_drop_misfit_warm_starts): no per-step shape check
        result = unchecked_steepest_direction(manifold, W, G, group["norm"], settings, warm_start=warm)
        point = manifold.retr(decayed, -lr * result.direction.to(W.dtype))
        return point, result.correction, result.ratio

    def _apply(self, group: dict, params: list[torch.Tensor], update: torch.Tensor, lr: float,
               keep: torch.Tensor | None = None) -> None:
        """Write the new points :meth:`_direction` returned (decay and retraction are in them)
        where ``keep`` (a skipped matrix keeps its weight exactly): one selection per matrix,
        written into the weight where the dtypes agree (``torch.where`` takes no narrower
        ``out``; fp32 back to bf16 is exact where the weight is kept)."""
        for i, (p, w) in enumerate(zip(params, update)):
            w = w.reshape(p.shape)
            if keep is None:
                p.copy_(w)
            elif w.dtype == p.dtype:
                torch.where(keep[i], w, p, out=p)
            else:
                p.copy_(torch.where(keep[i], w, p))
