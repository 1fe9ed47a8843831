r"""Weight regulation applied after each optimizer step: enforced Lipschitz bounds
(Newhouse et al. 2025, "Training Transformers with Enforced Lipschitz Constants",
arXiv:2507.13338).

Every regulator here is a map $W \mapsto W'$ on ``[..., fan_out, fan_in]`` weights
(PyTorch ``nn.Linear`` layout, batched over leading dimensions) that controls the
**RMS→RMS operator norm**

$$\|W\|_{\mathrm{RMS}\to\mathrm{RMS}} = \sqrt{\tfrac{\text{fan\_in}}{\text{fan\_out}}}\;\sigma_{\max}(W),$$

the norm in which a unit-RMS input gives an output of RMS at most $\|W\|$. Each regulator
rescales to $M = \sqrt{\text{fan\_in}/\text{fan\_out}}\,W$, acts on the singular values of
$M$ (threshold ``w_max`` is in RMS→RMS units) and scales back.

Protocol (see ``CONTRIBUTING.md``): a regulator is a callable
``reg(W, *, lr, state=None) -> W'``. ``lr`` is the learning rate of the step just taken
(lr-coupled regulators and the soft cap's coupling read it); ``state`` is an optional
per-parameter ``dict`` (an optimizer passes ``self.state[p]``) where power-iteration
regulators keep their warm-start vector. ``lr`` is a float, or a 0-dim tensor (a schedule
on the device): a tensor is an operand, never read back, so no regulator reads a value
to the host (except ``hard_cap`` with adaptive ``levels``, which reads one bound), and
it is not validated either (a float is: finite and $\ge 0$). Regulators are functional:
they never write into ``W``; the optimizer copies the result into the parameter. An entry a
regulator leaves as it is (every entry of a weight inside the ball) comes back bit for bit.
:func:`make_regulator` builds one from ``None | str | dict | Regulator | callable |
list`` (a list is applied in order).

Dtypes: every regulator computes in float32 (float64 for float64 weights; bf16/fp16
weights are upcast) and returns ``W.dtype``. The guarantees below are those of the result in
the compute dtype: rounding it to bf16/fp16 (unit round-off $u = 2^{-8}$ / $2^{-11}$) moves each
entry in the normal range by at most $u$ of itself, so every singular value by at most
$u\|W'\|_F$ (a bf16 weight capped at $w_{\max}$ comes back slightly above it, about $10^{-3}$
relative).

Costs for an $m\times n$ matrix, $k = \min(m, n)$, one matmul $\approx 2mnk$ FLOPs:

| regulator | guarantee on $\|W'\|_{\mathrm{RMS}\to\mathrm{RMS}}$ | cost |
|---|---|---|
| ``weight_decay`` | none (shrinks all $\sigma$ by $1-\text{lr}\cdot\text{wd}$) | 1 scale |
| ``spectral_normalize`` | $\le w_{\max}\,\sigma_{\max}/\hat\sigma$ (the $\hat\sigma$ error) | Gram + ``steps`` block products |
| ``spectral_hammer`` | $\sigma_{\max}\to w_{\max}$ if one $\sigma$ exceeds, up to the $\hat\sigma$ error | same + rank-1 |
| ``spectral_weight_decay`` | none (shrinks the top $\sigma$ only) | same + rank-1 |
| ``soft_cap`` | $\le w_{\max}$ if $\sigma \le k$ before (Muon coupling) | 4 matmuls, no SVD |
| ``hard_cap`` | $\le w_{\max}(1 + \beta)$, $\beta = 5.8\cdot10^{-9} + 2(\sqrt m + \sqrt n)u$; $= \min(\sigma, w_{\max})$ up to round-off outside a band below $w_{\max}$ ($2\cdot10^{-6}$ wide in float32 at $n = 256$: see :class:`HardCap`) | 2 msign + 4 matmuls per pass, + 1 sign and 3 matmuls once |
| ``column_cap`` | $\le w_{\max}$ for DGram (orthogonal columns) | 1 column-norm |

The three spectral regulators estimate the top singular triplet $\hat\sigma$ by block
power iteration (8 vectors, 16 steps, on the short-side Gram matrix: a $k\times k$ Gram
product, then $16$ products $k\times k$ by $k\times 8$ and thin QRs). The estimate is a
lower bound; its relative error decays like $(\sigma_9/\sigma_1)^{64}$ (measured in float64 over
20 spectra: at most $4.7\cdot10^{-3}$ at $\sigma_9/\sigma_1 = 0.9$, $7.8\cdot10^{-6}$ at 0.8, round-off
below about 0.6), and it is off by at most $\sigma_1 - \sigma_9$ (a cluster of 9+ singular values
at the top, e.g. right after a hard cap) from a start block with a component along the top
singular vectors. No bound holds beyond that: a weight whose top singular vectors are orthogonal
to the (fixed) start block is estimated below them, since the iteration reaches them only through
round-off (9 singular values 1.3 orthogonal to it and 8 of 1 along it, float32: $\hat\sigma = 1$,
and ``spectral_normalize`` left the weight at $1.3\,w_{\max}$; warm-started, the next call found the
top). Passing ``state`` warm-starts the block across steps (each regulator of a chain from its own
entry, see :class:`Chain`).

Non-finite weights raise ``ValueError`` in ``reg(W, ...)`` (a regulator never hands a NaN
back as weights), and so does a non-finite result of finite weights (a safeguard, see the
range below); :meth:`Regulator.unchecked`, the optimizer's path, reads neither back.

Range: the spectral regulators, ``hard_cap`` and ``column_cap`` compute on the weight (or
column) divided by a power of two near its largest entry (exact, so the same result bit for
bit where the unscaled arithmetic would neither over- nor underflow), so no Gram matrix or
squared norm leaves the dtype's range: finite weights give finite results wherever
$\sqrt{\text{fan\_in}/\text{fan\_out}}\,W$ and its top singular value are representable
(float32: below $3.4\cdot10^{38}$), and ``hard_cap`` caps there. ``soft_cap``'s guard first
scales a weight outside the ball down to $\sigma_{\max} = k$ (with ``guard_steps=0`` its
products square the weight as it is). ``weight_decay`` only scales. An empty ($0\times n$)
weight is returned as it is.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping, Union

import torch

from geomuon.manifolds.linalg import (
    KELLER_QUINTIC,
    NSSchedule,
    POLAR_EXPRESS,
    as_positive,
    as_real,
    check_count,
    check_matrix,
    fixed_start,
    fp32_or_fp64,
    largest_entry,
    power_of_two_at_most,
    msign,
    polar_express_steps,
    power_iteration,
    rms_scale,
    sym,
)

__all__ = [
    "Regulator",
    "Chain",
    "WeightDecay",
    "SpectralNormalize",
    "SpectralHammer",
    "SpectralWeightDecay",
    "SoftCap",
    "HardCap",
    "HARD_CAP_METHODS",
    "ColumnCap",
    "make_regulator",
    "regulator_spec",
    "WARM_START_KEY",
    "warm_start_key",
    "is_warm_start_key",
    "soft_cap_alpha",
    "soft_cap_alpha_tensor",
    "soft_cap_polynomial",
    "ns_output_max",
    "ns_output_bound",
    "muon_update_norm",
    "rms_scale",
    "rms_spectral_norm",
    "REGULATORS",
    "unchecked_regulation",
    "requires_matrices",
    "regulator_after",
    "regulator_refusal",
    "regulator_assumed_weight_decay",
    "UpdateBound",
]

#: ``(lr, shape) -> eta``: an optimizer's bound on the RMS→RMS norm of one update of a matrix
#: of ``shape`` (``[..., fan_out, fan_in]``) at rate ``lr`` (a float, or a 0-dim tensor kept on
#: the device), what :meth:`Regulator.after` receives.
UpdateBound = Callable[[Union[float, torch.Tensor], tuple], Union[float, torch.Tensor]]


# --------------------------------------------------------------------------------------
# shared helpers


def _check_weight(W: Any, who: str) -> None:
    check_matrix(W, who, "1-D tensors (biases, gains) have no spectral norm: leave them unregulated")


def _fraction(value: Any, name: str, who: str) -> float:
    value = as_real(who, name, value)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"{who}: {name} must lie in [0, 1), got {value}")
    return value


def _scaled(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(s, M / s)``, ``s`` ``[..., 1, 1]`` the power of two at most each matrix's largest entry
    (:func:`power_of_two_at_most`): ``M / s`` has entries in $(-2, 2)$, so its Gram matrix has
    entries below $4\max(m, n)$ whatever the weight's scale, and ``(M / s) * s`` is ``M`` (up
    to entries below $2^{-126}$ of the largest in float32, which go subnormal)."""
    s = power_of_two_at_most(largest_entry(M))
    return s, M / s


def rms_spectral_norm(W: torch.Tensor) -> torch.Tensor:
    r"""Exact RMS→RMS norm $\sqrt{\text{fan\_in}/\text{fan\_out}}\,\sigma_{\max}(W)$ (SVD), ``[...]``.

    The independent reference the tests measure regulators with; computed in float64.
    """
    _check_weight(W, "rms_spectral_norm")
    if W.size(-2) == 0 or W.size(-1) == 0:  # no singular value: the norm of the zero map
        return torch.zeros(W.shape[:-2], dtype=torch.float64, device=W.device)
    return rms_scale(W.shape) * torch.linalg.matrix_norm(W.double(), ord=2)


#: Squarings of the Ritz matrix in :func:`_top_ritz_vector`: its $2^{32}$-th power keeps only the
#: eigenvalues within a factor $1 - 5\cdot10^{-9}$ of the largest, below the round-off of a float32
#: Gram (float64 ties closer than that are taken as ties: a vector of their span, whose Rayleigh
#: quotient is within $5\cdot10^{-9}$ of the top, far inside the subspace iteration's own error).
_RITZ_SQUARINGS = 32


def _top_ritz_vector(T: torch.Tensor) -> torch.Tensor:
    r"""A unit top eigenvector of the symmetric positive semi-definite ``T`` ``[..., b, b]`` (the
    Ritz matrix of :func:`_top_singular_triplet`), ``[..., b]``, by products only (no
    eigensolver: ``torch.linalg.eigh`` reads its convergence flag back to the host on CUDA).

    $T^{2^k}/\|T^{2^k}\|_F$ by :data:`_RITZ_SQUARINGS` normalized squarings tends to the
    projector on the top eigenspace (each eigenvalue ratio $\lambda_i/\lambda_1$ is raised to
    the power $2^k$), whose column of largest norm is a top eigenvector (it has norm at least
    $b^{-1/2}$ of the projector's). ``T`` is first divided by its largest entry (a diagonal one,
    at most $\lambda_1$), so no norm below over- or underflows whatever the weight's scale. A zero
    ``T`` gives a zero vector."""
    tiny = torch.finfo(T.dtype).tiny
    largest = T.abs().amax((-2, -1), keepdim=True)
    P = T / torch.where(largest > 0, largest, torch.ones_like(largest))
    for _ in range(_RITZ_SQUARINGS):
        P = P @ P
        P = 0.5 * (P + P.mT) / torch.linalg.matrix_norm(P).clamp_min(tiny)[..., None, None]
    column = P.norm(dim=-2).argmax(-1, keepdim=True)  # [..., 1]
    v = torch.gather(P, -1, column.unsqueeze(-2).expand(*P.shape[:-1], 1)).squeeze(-1)
    return v / v.norm(dim=-1, keepdim=True).clamp_min(tiny)


#: The per-parameter state entry where the power-iteration regulators keep their warm start
#: (an orthonormal block, in the regulator's compute dtype: fp32 for bf16/fp16 weights): a single
#: regulator's, and the first of a :class:`Chain`'s (the others: :func:`warm_start_key`).
WARM_START_KEY = "regulate_v"


def is_warm_start_key(key: str) -> bool:
    """Whether state entry ``key`` holds a power-iteration warm start (of any slot)."""
    return key == WARM_START_KEY or key.startswith(WARM_START_KEY + ".")


def warm_start_key(slot: int) -> str:
    """The state entry of the warm start in ``slot``: :data:`WARM_START_KEY` for slot 0 (a single
    regulator, the first power-iteration regulator of a :class:`Chain`), ``"regulate_v.{slot}"``
    for the ``slot``-th after it (a chain's regulators had shared one entry, whose block of one
    width never fitted the next regulator: each started cold at every step)."""
    return WARM_START_KEY if slot == 0 else f"{WARM_START_KEY}.{slot}"


def _top_singular_triplet(
    M: torch.Tensor, steps: int, block: int, state: dict | None, key: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""$(\hat\sigma, \hat u, \hat v)$, ``[...], [..., m], [..., n]``: the top singular
    triplet by block power (subspace) iteration with Rayleigh–Ritz. The regulators pass the
    weight divided by a power of two near its largest entry (:func:`_scaled`): the Gram matrix
    of the weight itself overflowed in float32 from entries near $10^{19}$ (NaN weights came
    back).

    With $G$ the short-side Gram matrix ($M^\top M$ for tall, $MM^\top$ for wide) and an
    orthonormal block $V$ of ``block`` columns: ``steps`` times $V \leftarrow
    \operatorname{qr}(GV)$, then $\hat v$ = top eigenvector of $V^\top G V$ mapped back
    (:func:`_top_ritz_vector`) and $\hat\sigma = \|M\hat v\|$, a lower bound on $\sigma_{\max}$. The relative error
    of $\hat\sigma^2$ decays like $(\sigma_{b+1}/\sigma_1)^{4\,\text{steps}}$ ($b$ = ``block``)
    instead of plain power iteration's $(\sigma_2/\sigma_1)^{4\,\text{steps}}$: a capped or normalized
    weight has a flat top spectrum ($\sigma_2/\sigma_1 \approx 0.998$ under Muon), where a
    single vector does not converge. The block is read from and written to
    ``state[key]`` when a state dict is given (warm start).
    """
    wide = M.size(-2) < M.size(-1)
    X = M.mT if wide else M
    gram = X.mT @ X
    width = min(block, X.size(-1))
    V = None
    if state is not None:
        cached = state.get(key)
        if isinstance(cached, torch.Tensor) and cached.shape == X.shape[:-2] + (X.size(-1), width):
            V = cached.to(M.dtype)
    if V is None:
        V = fixed_start((X.size(-1), width), X.dtype, X.device).expand(*X.shape[:-2], -1, -1)
    V = torch.linalg.qr(V).Q
    for _ in range(steps):
        V = torch.linalg.qr(gram @ V).Q
    if state is not None:
        state[key] = V.detach().clone()
    v = (V @ _top_ritz_vector(V.mT @ gram @ V).unsqueeze(-1)).squeeze(-1)
    Xv = (X @ v.unsqueeze(-1)).squeeze(-1)
    sigma = Xv.norm(dim=-1)
    u = Xv / sigma.unsqueeze(-1).clamp_min(torch.finfo(M.dtype).tiny)
    return (sigma, v, u) if wide else (sigma, u, v)


#: name → regulator class; every :class:`Regulator` subclass with a ``name`` adds itself.
REGULATORS: dict[str, type[Regulator]] = {}


class Regulator:
    r"""Base class: subclasses implement :meth:`regulate` on the RMS-scaled matrix
    $M = \sqrt{\text{fan\_in}/\text{fan\_out}}\,W$ in the compute dtype.

    ``__call__(W, *, lr, state=None)`` validates ``W``, scales, calls :meth:`regulate`,
    scales back and returns ``W.dtype``.
    """

    #: key under which :func:`make_regulator` finds this class; a subclass that sets it
    #: registers itself in :data:`REGULATORS` (a name already taken is a ``TypeError``)
    name: str = ""
    #: whether its ``weight_decay`` is a decay it applies (:class:`WeightDecay`,
    #: :class:`SpectralWeightDecay`), not one it assumes the optimizer applied (:class:`SoftCap`)
    applies_weight_decay: bool = False

    def __init_subclass__(cls, register: bool = True, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if not register or not name:
            return
        known = REGULATORS.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"regulator name {name!r} of {cls.__module__}.{cls.__qualname__} is already taken by "
                f"{known.__module__}.{known.__qualname__}; give the new class its own `name`"
            )
        REGULATORS[name] = cls

    def spec(self) -> dict:
        """This regulator as plain data, ``{"name": ..., field: value}``, the ``dict`` form
        :func:`make_regulator` accepts (what a param group stores, so a checkpoint loads with
        ``torch.load(weights_only=True)``). Fields are the dataclass fields.

        Raises:
            TypeError: a field is not plain data (e.g. a callable ``eta``).
        """
        if not self.name or REGULATORS.get(self.name) is not type(self):
            raise TypeError(f"{type(self).__name__} has no registered name; set `name = \"...\"` on the class")
        spec = {"name": self.name}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (value is None or isinstance(value, (bool, int, float, str))):
                raise TypeError(
                    f"{type(self).__name__}.{field.name} = {value!r} is not plain data, so the "
                    "regulator cannot be stored in a checkpoint; use a number (or a Regulator "
                    "subclass computing it)"
                )
            spec[field.name] = value
        return spec

    def after(self, update_bound: UpdateBound | None) -> Regulator:
        r"""This regulator as it runs after an optimizer's update whose RMS→RMS norm, for a
        matrix of ``shape`` at rate ``lr``, is at most ``update_bound(lr, shape)`` (``None``: the
        optimizer states no bound). The optimizer calls it when it builds a group's regulator;
        a regulator that does not read the update's size (every one but :class:`SoftCap` with
        its default ``eta``) is itself."""
        return self

    def refusal(self, lr: float, shape: tuple[int, int]) -> str | None:
        """Why this regulator cannot follow one update at the float rate ``lr`` of a matrix of
        ``shape`` (``None``: it can). An optimizer asks before any group steps, so a refused
        step moves nothing."""
        return None

    @property
    def assumed_weight_decay(self) -> float:
        """The decoupled weight decay this regulator assumes the optimizer applied before the
        update (:class:`SoftCap`'s ``weight_decay``; 0 for the others): an optimizer refuses a
        group that applies less, whose weights the assumption would under-estimate."""
        return 0.0

    def __call__(self, W: torch.Tensor, *, lr: float, state: dict | None = None) -> torch.Tensor:
        _check_weight(W, type(self).__name__)
        if not isinstance(lr, torch.Tensor):
            # checked before the refusal computes with it: a NaN rate had been refused as
            # soft_cap_alpha's `wd` or muon_update_norm's `lr`, a string one by a bare TypeError
            lr = as_positive(type(self).__name__, "lr", lr, zero=True)
            if (why := self.refusal(lr, tuple(W.shape[-2:]))) is not None:
                raise ValueError(why)  # what an optimizer asks before its step
        if not torch.isfinite(W).all():
            raise ValueError(
                f"{type(self).__name__}: the weight has non-finite entries; regulation cannot "
                "repair it (check the optimizer's nonfinite handling and the learning rate)"
            )
        out = self.unchecked(W, lr=lr, state=state)
        # a safeguard for weights beyond the documented range (see the module docstring): a
        # finite weight must not come back as NaN or inf unnoticed
        if not torch.isfinite(out).all():
            raise ValueError(
                f"{type(self).__name__}: a finite weight (largest entry {W.abs().max().item():.3g}) gave a "
                f"non-finite result: its RMS->RMS norm is beyond {W.dtype}'s range for this regulator; "
                "rescale the weight first"
            )
        return out

    def unchecked(self, W: torch.Tensor, *, lr: float | torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """:meth:`__call__` without its finiteness test (a host read of the weight): what an
        optimizer step runs, whose weights stay finite because a non-finite gradient makes
        the step of its matrix a no-op on the device. A tensor ``lr`` is passed on as a
        0-dim tensor, unread. :meth:`refusal` is not asked: an optimizer asks it before any group
        steps."""
        _check_weight(W, type(self).__name__)
        if isinstance(lr, torch.Tensor):
            lr = lr.reshape(())
        else:
            lr = as_positive(type(self).__name__, "lr", lr, zero=True)
        if W.size(-2) == 0 or W.size(-1) == 0:  # no singular value to act on: every bound holds as it is
            return W.detach().clone()
        scale = rms_scale(W.shape)
        weight = W.detach().to(fp32_or_fp64(W.dtype))
        M = weight * scale
        out = self.regulate(M, lr=lr, state=state)
        # an entry the regulator left as it was is the weight's own: (w * scale) / scale is w only up
        # to one rounding, which had moved about 1 in 9 entries of a float32 or float64 weight by an
        # ulp at every step of a regulator that did nothing (a weight inside the ball)
        return torch.where(out == M, weight, out / scale).to(W.dtype)

    def regulate(self, M: torch.Tensor, *, lr: float, state: dict | None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        # (private attributes are not options: a chain's warm-start slot)
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class _PowerIterationRegulator(Regulator, register=False):
    r"""A regulator that estimates the top singular triplet by block power iteration
    (:func:`_top_singular_triplet` with its ``steps`` and ``block``), warm-started from the state
    entry ``_warm_start_key``: :data:`WARM_START_KEY`, or the slot a :class:`Chain` gives it."""

    _warm_start_key = WARM_START_KEY

    def _top_triplet(self, unit: torch.Tensor, state: dict | None):
        return _top_singular_triplet(unit, self.steps, self.block, state, self._warm_start_key)


# --------------------------------------------------------------------------------------
# the regulators


def _decay_refusal(regulator: "Regulator", lr: float, flips: str) -> str | None:
    r"""A decay's refusal: a factor $1 - \eta\lambda$ below 0 would flip ``flips`` (asked before
    any group steps: raised inside the step, the other groups' weights had moved)."""
    if lr * regulator.weight_decay > 1:
        return (f"{type(regulator).__name__}: lr * weight_decay = {lr * regulator.weight_decay} > 1 would flip "
                f"{flips}; lower lr or weight_decay")
    return None


@dataclass(repr=False)
class WeightDecay(Regulator):
    r"""lr-coupled decoupled weight decay $W \leftarrow (1 - \text{lr}\cdot\text{wd})\,W$.

    Applied after the step (the reference applies it before; the two orders differ by
    $O(\text{lr}^2\,\text{wd})$). No norm guarantee. Cost: one scaling.
    """

    weight_decay: float = 0.1
    name = "weight_decay"
    applies_weight_decay = True

    def __post_init__(self):
        self.weight_decay = as_positive("WeightDecay", "weight_decay", self.weight_decay, zero=True)

    def refusal(self, lr, shape):
        return _decay_refusal(self, lr, "the weights' sign")

    def regulate(self, M, *, lr, state):
        return M * (1.0 - lr * self.weight_decay)


@dataclass(repr=False)
class SpectralNormalize(_PowerIterationRegulator):
    r"""Spectral normalization $W \leftarrow W / \max(1, \hat\sigma/w_{\max})$.

    $\hat\sigma$: RMS→RMS top singular value by block power iteration (``block`` vectors,
    ``steps`` steps; see the module docstring), a lower bound. What holds is the estimate's
    bound: on the same block, $\hat\sigma(W') = \min(\hat\sigma, w_{\max}) \le w_{\max}$, so

    $$\|W'\|_{\mathrm{RMS}\to\mathrm{RMS}} \le w_{\max}\,\sigma_{\max}(W)/\hat\sigma(W),$$

    above $w_{\max}$ by the estimate's error ratio (scale-free, so the same for $W$ and $W'$): about
    $(\sigma_9/\sigma_1)^{64}$ relative for a generic start, unbounded for a weight whose top
    singular vectors the start block misses (the module docstring's example: $1.3\,w_{\max}$). Warm
    start through ``state`` to make it small. Shrinks all singular values together. Cost: one
    $k\times k$ Gram product, then ``steps`` products $k\times k$ by $k\times$ ``block`` and thin
    QRs ($k$ the short side).
    """

    w_max: float = 1.0
    steps: int = 16
    block: int = 8
    name = "spectral_normalize"

    def __post_init__(self):
        self.w_max = as_positive("SpectralNormalize", "w_max", self.w_max)
        self.steps, self.block = check_count("SpectralNormalize", "steps", self.steps, 1), \
            check_count("SpectralNormalize", "block", self.block, 1)

    def regulate(self, M, *, lr, state):
        s, unit = _scaled(M)
        sigma = self._top_triplet(unit, state)[0][..., None, None]
        # sigma is sigma-hat / s: M w / sigma-hat = unit (w / sigma), and M = unit s; one pass,
        # and no factor of sigma-hat itself, which need not be representable (sigma * s = inf
        # still compares right)
        return unit * torch.where(sigma * s > self.w_max, self.w_max / sigma, s)


@dataclass(repr=False)
class SpectralHammer(_PowerIterationRegulator):
    r"""Spectral hammer: set the top singular value to $w_{\max}$ when it exceeds it,
    $W \leftarrow W - (\hat\sigma - w_{\max})^+\,\hat u\hat v^\top$.

    Only the top direction moves (suited to AdamW). The guarantee $\sigma_{\max} \le
    w_{\max}$ holds when a single singular value exceeds $w_{\max}$; a Muon update moves
    every singular value by up to $\eta$ at once, so under Muon the hammer does not bound
    the norm (measured: 3.1 $w_{\max}$ after 500 steps at $w_{\max} = 1$) — use
    ``soft_cap`` or ``hard_cap`` there. Cost: :class:`SpectralNormalize`'s estimate and a
    rank-1 update.
    """

    w_max: float = 1.0
    steps: int = 16
    block: int = 8
    name = "spectral_hammer"

    def __post_init__(self):
        self.w_max = as_positive("SpectralHammer", "w_max", self.w_max)
        self.steps, self.block = check_count("SpectralHammer", "steps", self.steps, 1), \
            check_count("SpectralHammer", "block", self.block, 1)

    def regulate(self, M, *, lr, state):
        s, unit = _scaled(M)
        sigma, u, v = self._top_triplet(unit, state)
        excess = (sigma * s.squeeze(-1).squeeze(-1) - self.w_max).clamp_min(0.0)  # (sigma is sigma-hat / s)
        return M - excess[..., None, None] * u.unsqueeze(-1) * v.unsqueeze(-2)


@dataclass(repr=False)
class SpectralWeightDecay(_PowerIterationRegulator):
    r"""Spectral weight decay: shrink only the top singular value,
    $W \leftarrow W - \text{lr}\cdot\text{wd}\cdot\hat\sigma\,\hat u\hat v^\top$
    (lr-coupled like decoupled weight decay). No norm guarantee. Cost:
    :class:`SpectralNormalize`'s estimate and a rank-1 update.
    """

    weight_decay: float = 0.1
    steps: int = 16
    block: int = 8
    name = "spectral_weight_decay"
    applies_weight_decay = True

    def __post_init__(self):
        self.weight_decay = as_positive("SpectralWeightDecay", "weight_decay", self.weight_decay, zero=True)
        self.steps, self.block = check_count("SpectralWeightDecay", "steps", self.steps, 1), \
            check_count("SpectralWeightDecay", "block", self.block, 1)

    def refusal(self, lr, shape):
        return _decay_refusal(self, lr, "the top singular direction")

    def regulate(self, M, *, lr, state):
        shrink = lr * self.weight_decay
        s, unit = _scaled(M)
        sigma, u, v = self._top_triplet(unit, state)
        return M - (shrink * sigma)[..., None, None] * s * u.unsqueeze(-1) * v.unsqueeze(-2)  # (sigma-hat / s) s


# --------------------------------------------------------------------------------------
# spectral soft cap and its coupling with Muon


def soft_cap_polynomial(sigma, alpha: float):
    r"""The soft cap's scalar map $f_\alpha(\sigma) = g(\sigma) + \alpha\,g(\sigma)^3$ with
    $g(\sigma) = \sigma - \alpha\sigma^3$ (two odd cubic steps). Works on floats, numpy
    arrays and tensors alike.

    $f_\alpha'(\sigma) = (1 + 3\alpha g^2)(1 - 3\alpha\sigma^2)$, so $f_\alpha$ increases
    exactly on $[0, 1/\sqrt{3\alpha}]$.
    """
    g = sigma - alpha * sigma**3
    return g + alpha * g**3


#: $f_{1/(3k^2)}(k)/k = 62/81$: the smallest ratio $w_{\max}/k$ a soft cap monotone on
#: $[0, k]$ can reach (see :func:`soft_cap_alpha`).
SOFT_CAP_MIN_RATIO = 62.0 / 81.0


@lru_cache(maxsize=4096)
def soft_cap_alpha(w_max: float, wd: float, eta: float) -> float:
    r"""Soft-cap strength $\alpha$ that keeps singular values at most $w_{\max}$.

    After decay and one update of RMS→RMS norm at most $\eta$, a weight with
    $\sigma \le w_{\max}$ has $\sigma \le k = w_{\max}(1 - \text{wd}) + \eta$. The soft cap
    must map $[0, k]$ into $[0, w_{\max}]$; with $f_\alpha$ monotone this is $f_\alpha(k) =
    w_{\max}$, i.e. the quartic

    $$-k^9\alpha^4 + 3k^7\alpha^3 - 3k^5\alpha^2 + (k - w_{\max}) = 0.$$

    With $\beta = \alpha k^2$ it reads $h(\beta) = 1 - 3\beta^2 + 3\beta^3 - \beta^4 =
    w_{\max}/k$, and $h'(\beta) = -\beta(6 - 9\beta + 4\beta^2) < 0$ for $\beta > 0$
    (the quadratic has no real root), so the smallest real root $\ge 0$ is the unique
    one. $f_\alpha$ is monotone on $[0, k]$ iff $3\alpha k^2 \le 1$, i.e.
    $\beta \le 1/3$, where $h(1/3) = 62/81$. Hence:

    * $k \le w_{\max}$: no cap is needed, returns $0$;
    * $w_{\max}/k \ge 62/81$: returns the root, found by bisection on $[0, 1/3]$ to
      float64 round-off;
    * otherwise no monotone soft cap exists (the root's $f_\alpha$ would peak above
      $w_{\max}$ inside $[0, k]$, e.g. $w_{\max} = 1, \eta = 1$): raises ``ValueError``.

    Args:
        w_max: RMS→RMS cap, $> 0$.
        wd: weight-decay factor applied this step ($\text{lr}\cdot\text{weight\_decay}$),
            in $[0, 1)$; $0$ is the conservative choice when unsure.
        eta: the largest RMS→RMS norm of one update, $\ge 0$ (see
            :func:`muon_update_norm`).

    Returns:
        $\alpha \ge 0$ as a Python float (float64).
    """
    w_max = as_positive("soft_cap_alpha", "w_max", w_max)
    wd = _fraction(wd, "wd", "soft_cap_alpha")
    eta = as_positive("soft_cap_alpha", "eta", eta, zero=True)
    k = w_max * (1.0 - wd) + eta
    ratio = w_max / k
    if ratio >= 1.0:
        return 0.0
    if ratio < SOFT_CAP_MIN_RATIO:
        max_eta = w_max / SOFT_CAP_MIN_RATIO - w_max * (1.0 - wd)
        raise ValueError(
            f"soft_cap_alpha: eta={eta:.6g} is too large for w_max={w_max:.6g} (wd={wd:.6g}): "
            f"k = w_max(1-wd)+eta = {k:.6g} > (81/62) w_max, and no soft cap monotone on [0, k] "
            f"maps it to w_max. Use eta <= {max_eta:.6g} (lower the learning rate or raise "
            "w_max), or the exact 'hard_cap' regulator."
        )

    h = _soft_cap_ratio
    lo, hi = 0.0, 1.0 / 3.0  # h(lo) >= ratio >= h(hi)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if h(mid) > ratio:
            lo = mid
        else:
            hi = mid
    beta = lo if abs(h(lo) - ratio) <= abs(h(hi) - ratio) else hi
    return beta / k**2


def _soft_cap_ratio(beta):
    r"""$h(\beta) = f_\alpha(k)/k = 1 - 3\beta^2 + 3\beta^3 - \beta^4$, $\beta = \alpha k^2$ (floats or tensors)."""
    return 1.0 - 3.0 * beta**2 + 3.0 * beta**3 - beta**4


#: bisection steps of :func:`soft_cap_alpha_tensor`: $2^{-64}/3$ is below float64's
#: resolution of $\beta \le 1/3$, as the host bisection's stopping rule reaches.
SOFT_CAP_BISECTION_STEPS = 64


def soft_cap_alpha_tensor(w_max: float, wd: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    r""":func:`soft_cap_alpha` for a learning rate that lives on the device: ``wd`` and ``eta``
    are tensors (broadcast together), the result a float64 tensor, and nothing is read back
    (a fixed :data:`SOFT_CAP_BISECTION_STEPS`-step bisection of the same quartic, in float64).

    The checks that need a value on the host cannot raise here: $k \le w_{\max}$ gives 0 as
    there, and an $\eta$ too large for a monotone cap ($w_{\max}/k < 62/81$, where
    :func:`soft_cap_alpha` raises) gives the strongest monotone cap $\beta = 1/3$, which
    maps $k$ to $\tfrac{62}{81}k > w_{\max}$: the bound is then lost. Check a schedule's peak
    rate with :func:`soft_cap_alpha` once on the host.
    """
    # k in float64 from the start: formed in a float32 rate's dtype, it had been rounded before the
    # float64 bisection (a float64 weight then came out up to 1e-7 past w_max)
    k = w_max * (1.0 - torch.as_tensor(wd, dtype=torch.float64)) + torch.as_tensor(eta, dtype=torch.float64)
    ratio = w_max / k
    # h < 1 on (0, 1/3]: a ratio >= 1 (no cap needed) keeps lo = 0; a ratio below 62/81
    # moves lo up to 1/3
    lo, hi = torch.zeros_like(k), torch.full_like(k, 1.0 / 3.0)
    for _ in range(SOFT_CAP_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        above = _soft_cap_ratio(mid) > ratio
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return lo / k**2


def ns_output_max(schedule: NSSchedule = KELLER_QUINTIC, steps: int | None = None) -> float:
    r"""Largest singular value a Newton–Schulz schedule can output: $\sup_{x \in (0,
    1/s]} p_K \circ \dots \circ p_1(x)$ with $s$ the schedule's input scale (the input is
    normalized by $s\|X\|_F$, so every normalized singular value lies there).

    Evaluated in float64 on a grid of $2\cdot10^6$ uniform plus $2\cdot10^5$ log-spaced
    points (the composed polynomial is smooth; the grid misses the supremum by about
    $10^{-9}$: $1.202368604$ against the rigorous enclosure's $1.202368605$ for Keller's quintic,
    far inside the $5\%$ margin of :func:`muon_update_norm`).
    Keller's quintic, 5 steps: $1.20237$. This is the $\eta$ per unit learning rate of a
    Muon update in exact arithmetic; bf16 adds up to a few $10^{-3}$ relative, hence the
    margin of :func:`muon_update_norm`.
    """
    n_steps = schedule.default_steps if steps is None else int(steps)
    return _ns_output_max(schedule.coefficients, schedule.input_scale, n_steps)


@lru_cache(maxsize=32)
def _ns_output_max(coefficients, input_scale: float, steps: int) -> float:
    top = 1.0 / input_scale
    x = torch.cat(
        [
            torch.linspace(0.0, top, 2_000_001, dtype=torch.float64)[1:],
            torch.logspace(-9, math.log10(top), 200_000, dtype=torch.float64),
        ]
    )
    for k in range(steps):
        a, b, c = coefficients[min(k, len(coefficients) - 1)]
        x = a * x + b * x**3 + c * x**5
    return float(x.max())


@lru_cache(maxsize=32)
def ns_output_bound(schedule: NSSchedule = KELLER_QUINTIC, steps: int | None = None) -> float:
    r"""A rigorous upper bound on every singular value a Newton–Schulz schedule can
    output, $\sup_{x \in [0, 1/s]} p_K \circ \dots \circ p_1(x)$: the upper end of the exact
    enclosure :func:`geomuon.theory.symbolic.ns_output_range` (exact critical points of
    each step, rounded outward to 50 decimals), rounded up to the next float64.
    Keller's quintic, 5 steps: $1.2023705$. Computed once per schedule (sympy, cached).
    """
    from geomuon.theory.symbolic import ns_output_range

    n_steps = schedule.default_steps if steps is None else int(steps)
    _, high = ns_output_range(schedule.coefficients, n_steps, lo=0, hi=1, input_scale=schedule.input_scale)
    return math.nextafter(float(high), math.inf)


def muon_update_norm(
    lr: float,
    shape: tuple[int, ...] | torch.Size,
    *,
    schedule: NSSchedule = KELLER_QUINTIC,
    adjust_lr: str | None = "original",
    margin: float = 1.05,
) -> float:
    r"""Recommended $\eta$ for the soft cap under Muon: an upper bound on the RMS→RMS norm
    of one Muon update of a ``[..., fan_out, fan_in]`` weight.

    A Muon update is $\text{lr}\cdot c(\text{shape})\cdot O$ with $\sigma(O) \le$
    :func:`ns_output_bound` (Keller's quintic: $1.20237$; a rigorous bound, where the
    grid maximum :func:`ns_output_max` can only underestimate), so

    $$\eta = \text{lr}\cdot \text{ns\_max}\cdot\text{margin}\cdot
      \sqrt{\text{fan\_in}/\text{fan\_out}}\; c(\text{shape}),$$

    with $c$ the shape factor of ``torch.optim.Muon`` (and ``geomuon.optimizers.Muon``):
    ``"original"`` $\sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}$ (so the product is
    $\max(1, \sqrt{\text{fan\_in}/\text{fan\_out}})$), ``"match_rms_adamw"``
    $0.2\sqrt{\max(\text{fan\_out}, \text{fan\_in})}$, or ``None`` for an update already
    scaled to unit RMS→RMS norm (the reference code's $\sqrt{\text{fan\_out}/\text{fan\_in}}$
    scaling). The default ``margin=1.05`` covers bf16 rounding of the iteration. An empty
    weight (``fan_out`` or ``fan_in`` 0) has no singular value: $\eta = 0$.

    The reference NanoGPT script uses $\text{lr}\times 1.14502\times 1.05$: $1.14502$ is the
    output maximum of *its own* NS table. For Keller's quintic the maximum is $1.20237$,
    and $1.14502\times1.05 = 1.2023$ leaves no margin at all, so use this function (or
    $1.20237\times$ margin) rather than the reference's constant.
    """
    from .muon import muon_shape_factor  # at call time: muon imports base, which imports this module

    if adjust_lr not in ("original", "match_rms_adamw", None):
        raise ValueError(
            f"muon_update_norm: adjust_lr must be 'original', 'match_rms_adamw' or None, "
            f"got {adjust_lr!r}"
        )
    # (a negative lr or NaN had given a negative or NaN eta, and a margin below 1 a bound below the
    # iteration's own maximum: the soft cap then fails at the step, or holds no longer)
    lr = lr if isinstance(lr, torch.Tensor) else as_positive("muon_update_norm", "lr", lr, zero=True)
    margin = as_real("muon_update_norm", "margin", margin)
    if not (math.isfinite(margin) and margin >= 1):
        raise ValueError(
            f"muon_update_norm: margin must be a finite number >= 1 (it widens the rigorous bound on the "
            f"Newton-Schulz output for rounding; below 1 eta would not bound the update), got {margin!r}"
        )
    fan_out, fan_in = shape[-2], shape[-1]
    if fan_out == 0 or fan_in == 0:
        # an empty matrix's update is the zero map, of norm 0 (its fan ratio had raised
        # ZeroDivisionError in the optimizer's pre-step check of a soft cap)
        return lr * 0.0
    if adjust_lr is None:
        shape_factor = math.sqrt(fan_out / fan_in)
    else:
        shape_factor = muon_shape_factor(fan_out, fan_in, adjust_lr)
    return lr * ns_output_bound(schedule) * margin * rms_scale(shape) * shape_factor


EtaSpec = Union[float, Callable[[float, tuple], float], None]


@dataclass(repr=False)
class SoftCap(Regulator):
    r"""Spectral soft cap (Newhouse et al. 2025), co-designed with Muon's fixed update norm.

    Two odd polynomial steps on the RMS-scaled weight,

    $$M \leftarrow M - \alpha\,M(M^\top M),\qquad M \leftarrow M + \alpha\,M(M^\top M),$$

    map every singular value by $f_\alpha$ (:func:`soft_cap_polynomial`): 4 matmuls (the
    Gram matrix on the short side and a product, twice), no SVD, no power iteration.
    $\alpha$ = :func:`soft_cap_alpha` $(w_{\max}, \text{lr}\cdot\text{weight\_decay}, \eta)$,
    recomputed (cached) whenever lr changes. If every singular value was
    $\le w_{\max}$ before the step and the update's RMS→RMS norm is $\le \eta$, every
    singular value is $\le w_{\max}$ after.

    Args:
        w_max: RMS→RMS cap.
        eta: the update-norm bound: ``None`` (default) = :func:`muon_update_norm` for this
            weight's shape at this ``lr`` (Keller's NS, ``adjust_lr="original"``, margin
            1.05; another optimizer, ``adjust_lr="match_rms_adamw"`` or another Newton-Schulz
            schedule needs its own bound); a float = a fixed bound; a callable
            ``(lr, shape) -> float`` (for direct calls: an optimizer's ``regulate=`` stores its
            regulator as plain data, :meth:`Regulator.spec`, and refuses it; override
            :meth:`eta_for` in a subclass there).
        weight_decay: the optimizer's decoupled weight-decay coefficient *applied before
            the step* (tightens $k$); ``0`` is always safe.
        guard_steps: power iterations of a cheap guard: if the estimate of $\sigma_{\max}$
            exceeds $\max(k, w_{\max})$ (weights not yet inside the ball: at initialisation,
            after a manual edit, or when $\eta$ was underestimated), the matrix is first scaled
            down to $\sigma_{\max} = \max(k, w_{\max})$, because beyond $1/\sqrt{3\alpha}$ the
            polynomial decreases and then explodes ($k \le w_{\max}$ means $\alpha = 0$: the
            guard alone brings the weight back to $w_{\max}$). The guard is a lower bound;
            initialize weights inside the ball (e.g. apply ``hard_cap`` once) for the
            guarantee. ``0`` disables it.

    Raises ``ValueError`` when $\eta$ is too large for $w_{\max}$ (:func:`soft_cap_alpha`): at
    construction for a fixed ``eta`` that no learning rate makes feasible, else at the call.
    Cost: 4 matmuls (+ ``guard_steps`` mat-vec pairs).
    """

    w_max: float = 1.0
    eta: EtaSpec = None
    weight_decay: float = 0.0
    guard_steps: int = 4
    name = "soft_cap"

    def __post_init__(self):
        self.w_max = as_positive("SoftCap", "w_max", self.w_max)
        self.weight_decay = as_positive("SoftCap", "weight_decay", self.weight_decay, zero=True)
        if not (self.eta is None or callable(self.eta)):
            self.eta = as_positive("SoftCap", "eta", self.eta, zero=True)
            self._refuse_infeasible_eta()
        self.guard_steps = check_count("SoftCap", "guard_steps", self.guard_steps, 0)

    def _refuse_infeasible_eta(self) -> None:
        r"""Refuse a fixed ``eta`` that no learning rate makes feasible now, not in the first
        step (which raised after the update had moved the weights). The smallest
        $k = w_{\max}(1 - \text{lr}\cdot\text{weight\_decay}) + \eta$ of any step is
        $w_{\max} + \eta$ without weight decay, and tends to $\eta$ as
        $\text{lr}\cdot\text{weight\_decay} \to 1$ with it; the cap needs
        $k \le \tfrac{81}{62}w_{\max}$ (:func:`soft_cap_alpha`)."""
        if self.weight_decay == 0:
            try:
                soft_cap_alpha(self.w_max, 0.0, self.eta)  # its own test, so construction and step agree
            except ValueError:
                raise ValueError(
                    f"SoftCap: eta={self.eta:.6g} is too large for w_max={self.w_max:.6g} at every learning "
                    "rate (weight_decay=0, so k = w_max + eta > (81/62) w_max, and no monotone soft cap maps "
                    f"it to w_max); use eta <= {self.w_max / SOFT_CAP_MIN_RATIO - self.w_max:.6g}, a larger "
                    "w_max, or the exact 'hard_cap'"
                ) from None
        elif self.eta > 0 and self.w_max / self.eta <= SOFT_CAP_MIN_RATIO:  # (soft_cap_alpha's ratio w_max / k)
            raise ValueError(
                f"SoftCap: eta={self.eta:.6g} is too large for w_max={self.w_max:.6g} at every learning rate "
                "(k = w_max (1 - lr * weight_decay) + eta > eta >= (81/62) w_max); use eta < "
                f"{self.w_max / SOFT_CAP_MIN_RATIO:.6g}, a larger w_max, or the exact 'hard_cap'"
            )

    @property
    def assumed_weight_decay(self) -> float:
        return self.weight_decay

    def after(self, update_bound: UpdateBound | None) -> SoftCap:
        r"""With the default ``eta``: this cap with $\eta$ = the optimizer's ``update_bound``
        (the default's :func:`muon_update_norm` holds for Keller's Muon with
        ``adjust_lr="original"`` only: Muon with ``"match_rms_adamw"`` had pushed the RMS→RMS norm
        to 1.054 at ``w_max = 1``, the PolarGrad maps to 1.03). An optimizer that states no
        bound is refused: give ``eta``."""
        if self.eta is not None or type(self).eta_for is not SoftCap.eta_for:  # (a subclass's own eta)
            return self
        if update_bound is None:
            raise ValueError(
                "soft_cap: its default eta is the optimizer's bound on the RMS->RMS norm of one update, and this "
                "optimizer (or this group's update) states none; give eta (a float: an upper bound on that norm at "
                "the group's largest learning rate)")
        bound = copy.copy(self)
        bound.eta = update_bound
        return bound

    def refusal(self, lr: float, shape: tuple[int, int]) -> str | None:
        try:
            soft_cap_alpha(self.w_max, self._decay(lr), self.eta_for(lr, shape))
        except ValueError as err:
            return str(err).rstrip(".")
        return None

    def _decay(self, lr: float | torch.Tensor) -> float | torch.Tensor:
        """``lr * weight_decay``, refused by name at 1 or above (a rate on the device is not read back)."""
        wd = lr * self.weight_decay
        if not isinstance(wd, torch.Tensor) and wd >= 1:  # (soft_cap_alpha's error named its own `wd`)
            raise ValueError(
                f"SoftCap: lr * weight_decay = {wd:.6g} must be below 1 (weight_decay is the optimizer's decay "
                f"of the step, whose factor 1 - lr * weight_decay is not positive at lr={lr:.6g}); lower lr or "
                "weight_decay"
            )
        return wd

    def eta_for(self, lr: float | torch.Tensor, shape: tuple[int, ...]) -> float | torch.Tensor:
        r"""$\eta$ at this ``lr``: a float, or a tensor where ``lr`` is one (never read back)."""
        if self.eta is None:
            return muon_update_norm(lr, shape)
        if callable(self.eta):
            eta = self.eta(lr, tuple(shape))
            return eta if isinstance(eta, torch.Tensor) else float(eta)
        return self.eta

    def regulate(self, M, *, lr, state):
        wd = self._decay(lr)
        eta = self.eta_for(lr, tuple(M.shape))
        on_device = isinstance(wd, torch.Tensor) or isinstance(eta, torch.Tensor)
        if on_device:
            # a rate on the device: alpha there too (alpha = 0 leaves X as it is: X + 0 * Y = X), and
            # wd, eta and the guard's k in float64 as on the host (torch.as_tensor had made a float eta
            # float32: at a float64 rate the cap let a float64 weight 3.5e-9 past w_max)
            wd, eta = torch.as_tensor(wd, dtype=torch.float64), torch.as_tensor(eta, dtype=torch.float64)
            alpha = soft_cap_alpha_tensor(self.w_max, wd, eta).to(M.device)
        else:
            alpha = soft_cap_alpha(self.w_max, wd, eta)
        if self.guard_steps > 0:
            # the largest sigma the map keeps at most w_max: k where it caps (f(k) = w_max), w_max where
            # alpha = 0 (k <= w_max, the identity). The guard had been skipped at alpha = 0 (lr = 0, or a
            # decay lr * wd * w_max >= eta), which returned a weight of RMS norm 30 at w_max = 1 as it was
            k = self.w_max * (1.0 - wd) + eta
            reach = torch.as_tensor(k).clamp_min(self.w_max) if on_device else max(k, self.w_max)
            sigma, _ = power_iteration(M, steps=self.guard_steps)
            M = M / (sigma / reach).clamp_min(1.0)[..., None, None]
        if not on_device and alpha == 0.0:
            return M
        wide = M.size(-2) < M.size(-1)
        X = M.mT if wide else M
        for coefficient in (-alpha, alpha):
            X = X + coefficient * (X @ (X.mT @ X))
        return X.mT if wide else X


# --------------------------------------------------------------------------------------
# exact hard cap and the DGram column cap


#: The msign methods :class:`HardCap` accepts: those whose sign tends to the exact one as the
#: steps grow (Polar Express repeats $(15/8, -5/4, 3/8)$, which fixes 1 with slope 0; the SVD is
#: exact). The other :data:`~geomuon.manifolds.linalg.MSIGN_METHODS` are 5-step tables whose
#: repeated last step does not fix 1.
HARD_CAP_METHODS = ("polar_express", "svd")

_LOG_FLOAT64_MAX = math.log(torch.finfo(torch.float64).max)


@lru_cache(maxsize=32)
def _hard_cap_sign_profile(steps: int) -> tuple[float, dict[torch.dtype, float]]:
    r"""What :class:`HardCap`'s guarantees read off its symmetric sign, ``steps`` Polar Express steps
    $p = p_{\text{steps}}\circ\dots\circ p_1$ on eigenvalues $y \in [-1/1.01, 1/1.01]$ (the input
    divided by $1.01$ times a bound on its norm): ``(K, r)``.

    * $K = \sup_{y > 0} y\,(1 - p(y))/2$: the sign's error weighted by the eigenvalue, which bounds
      what an unresolved singular value keeps (:class:`HardCap`; 20 steps: $1.1\cdot10^{-8}$).
    * ``r[dtype]`` $= \sup\{y : |1 - p(y)| > \varepsilon_{\text{dtype}}\}$: the sign is $\pm1$ within
      the dtype's $\varepsilon$ on every $|y| \ge r$ (20 steps: $3.7\cdot10^{-7}$ for float32,
      $6.0\cdot10^{-7}$ for float64).

    Scanned in float64 on $y_k = 10^{-k/200}/1.01$ down to $10^{-20}$ (every bracket
    $[y_{k+1}, y_k]$ bounded by its ends, $p$ increasing there: $K$ and $r$ are rounded up by at most
    one grid step, 1.2%). Near 1 the scan tracks $e = 1 - y$ through each step,
    $e \mapsto 1 - p_j(1 - e)$ expanded in $e$, so $1 - p$ keeps its relative accuracy where $p$
    itself rounds to 1."""
    grid = 10 ** (-torch.arange(0, 200 * 20 + 1, dtype=torch.float64) / 200) / POLAR_EXPRESS.input_scale
    y, e = grid, 1 - grid
    for a, b, c in POLAR_EXPRESS.step_coefficients(steps):
        e = torch.where(y < 0.5, 1 - y, e)  # 1 - y is exact enough below 1/2; above, only e keeps its digits
        y = y * (a + y * y * (b + c * y * y))
        e = (1 - (a + b + c)) + e * ((a + 3 * b + 5 * c) - e * ((3 * b + 10 * c) - e * ((b + 10 * c) - e * (5 * c - e * c))))
    gap = torch.where(y < 0.5, 1 - y, e)  # 1 - p(y_k)
    K = float((grid[:-1] * gap[1:].clamp_min(0)).max()) / 2
    resolution = {}
    for dtype in (torch.float32, torch.float64):
        unresolved = (gap.abs() > torch.finfo(dtype).eps).nonzero()
        resolution[dtype] = float(grid[max(int(unresolved.min()) - 1, 0)]) if unresolved.numel() else 0.0
    return K, resolution


@dataclass(repr=False)
class HardCap(Regulator):
    r"""Hard cap $\sigma \mapsto \min(\sigma, w_{\max})$ of every singular value, through msign,
    no SVD (or through the SVD, ``method="svd"``).

    One pass at level $c$, on the tall orientation ($M = U\Sigma V^\top$, $m \ge n$; wide
    matrices are transposed): with $Q = \operatorname{msign}(M) = UV^\top$ and the
    spectral projector onto the singular values above $c$,

    $$\Pi = \tfrac12\bigl(I + \operatorname{sign}(M^\top M - c^2 I)\bigr) = V\,\mathbb 1[\Sigma > c]\,V^\top$$

    (the polar factor of a symmetric matrix is its matrix sign), the capped matrix is

    $$M' = M(I - \Pi) + c\,Q\Pi = U\bigl(\Sigma\,\mathbb 1[\Sigma\le c] + c\,\mathbb 1[\Sigma > c]\bigr)V^\top = U\min(\Sigma, c)V^\top,$$

    because $M\Pi = U\Sigma\mathbb 1[\Sigma>c]V^\top$ and $Q\Pi = U\mathbb 1[\Sigma>c]V^\top$.
    Where the iterative sign is inexact, a singular value gets $\pi \in [0, 1]$ and becomes
    $(1-\pi)\sigma + \pi c$. Two choices keep that away from the values below $c$:

    * The sign's input is $A = M^\top M - (c^2 + t)I$ divided by $1.01(B + t)$, $B = \max(c^2,
      b^2 - c^2)$ from a bound $b \ge \sigma_{\max}$ (so $\|A\|_2 \le B + t$), not by its Frobenius
      norm, which is up to $\sqrt n$ times larger. The sign is $\pm1$ within $\varepsilon$ on
      $|y| \ge r_{\text{eff}} = r + 2(\sqrt m + \sqrt n)\,u$ ($r$ its resolution,
      :func:`_hard_cap_sign_profile`; the round-off of the Gram matrix, at most about
      $\sqrt m\,u\,b^2 \le 2\sqrt m\,u\,B$ from its length-$m$ dot products, and of the iteration's
      $n$-term sums; $u$ the unit round-off), and the threshold sits $t = 1.01\,r_{\text{eff}}
      (B + t)$ *above* $c^2$: every $\sigma \le c$ is resolved to $\pi = 0$ and kept, every
      $\sigma^2 \ge c^2 + 2t$ is capped to $c$, and one in between ends in $[c, \sigma]$, so
      $\sigma_{\max} \le b' = \sqrt{c^2 + 2t}$ after the pass.
    * The last level ($c = w_{\max}$) ends with a pass that only sees singular values at most $b'$:
      with $A_1 = M_1^\top M_1 - c^2I$ ($\|A_1\|_2 \le B_1 = \max(c^2, 2t)$, $= c^2$ in the levels'
      range) and $\Pi_1$ from its sign, $M_2 = M_1 - M_1\Pi_1A_1/(2c^2)$ maps
      $\sigma \mapsto \sigma\,(1 - \pi(\sigma^2/c^2 - 1)/2)$: a resolved $\sigma \in (c, b']$ to
      $\sigma(3 - \sigma^2/c^2)/2 \in [c(1 - \tfrac32\varepsilon^2), c]$ ($\sigma = c(1 + \varepsilon)$),
      no second msign of $M$. Its own unresolved band is a factor $B/B_1$ (up to $\rho^2 - 1$)
      narrower than a level's.

    Guarantees (within the levels' range; beyond it, below, with a larger $x$): the last pass
    sees $x = B_1/c^2 = \max(1, 2t/c^2) = 1$. In exact arithmetic an unresolved $\sigma > c$ keeps
    $(1 - \pi)(\sigma - c) \le c\cdot1.01Kx/2$ and an unresolved $\sigma < c$ rises by at most
    $c\cdot1.01Kx$ ($K$ of :func:`_hard_cap_sign_profile`, $\sigma^2 - c^2 = 1.01B_1y$), so

    $$\sigma_{\max}(M') \le w_{\max}(1 + \beta),\qquad \beta = 1.01\,K\,x/2 + 2(\sqrt m + \sqrt n)\,u,$$

    the last term the round-off of the last pass (its Gram matrix, and the result's entries:
    their rounding moves $\sigma_{\max}$ by at most $\sqrt n\,u\,\sigma_{\max}$). 20 steps, $m = n =
    512$: $\beta = 5.4\cdot10^{-6}$ in float32, $5.8\cdot10^{-9}$ in float64 (the $K$ term). Every
    $\sigma < c$ is kept up to round-off, except in the band $c - \sigma < c\,w$, $w =
    1.01\,r_{\text{eff}}\,x/2$ (the last pass's unresolved eigenvalues), where it is raised towards
    $c$, never past $c(1 + \beta)$: $w = 2.1\cdot10^{-6}$ (float32) and $3.0\cdot10^{-7}$ (float64)
    at $n = 256$, $4.0\cdot10^{-6}$ in float32 at $n = 1024$. A $\sigma \in (c, b']$ the level left
    above $c$ ends in $[c(1 - \tfrac32\varepsilon^2), c]$, $\sigma = c(1 + \varepsilon)$. Round-off
    elsewhere: the last level's Gram matrix is rounded by about $\sqrt m\,u\,\sigma_{\max}^2$, which
    moves the values near $c$ by up to about that over $2c$ (Weyl). Measured, half the singular
    values at $15c$ or $1000c$ and the rest at $c(1 + \delta)$, $10^{-7} \le \delta \le 10^{-2}$,
    or spread from $c(1 - 10^{-8})$ to $0.3c$, $n \le 512$: largest excess $2.9\cdot10^{-7}$ in
    float32, $1.7\cdot10^{-10}$ in float64 (the threshold at $c^2$ normalized by the Frobenius norm
    had left $3.7\cdot10^{-5}$ and $2\cdot10^{-5}$ at $n = 512$); values below $c$ raised by at most
    $5.7\cdot10^{-9}$ in float64 (and moved by $10^{-15}$ beyond $10^{-4}$ of $c$); in float32,
    with half the values at $15c$, those within $10^{-4}$ of $c$ moved by up to $3.4\cdot10^{-5}$
    ($n = 256$, round-off, both directions) and those further away by $10^{-6}$.

    Dynamic range: a level resolves $\sigma^2 - c^2$ relative to $B \approx b^2$, so a
    single pass cannot separate $\sigma = c(1 \pm 10^{-4})$ next to $\sigma = 10^4c$. The
    cap therefore descends through levels $c\rho^{J-1}, \dots, c\rho, c$
    ($\rho$ = ``ratio``), with $J$ the smallest integer such that $\rho^J c$ exceeds the
    Schatten-8 bound $\|(M^\top M)^2\|_F^{1/4} \ge \sigma_{\max}$; since
    $\min(\min(\sigma, c_1), c_2) = \min(\sigma, c_2)$ for $c_2 \le c_1$, the result is the
    same cap. A level below the top has $b \le \rho c\sqrt{1 + 2t/(\rho c)^2}$, so $B \le
    (\rho^2 - 1)c^2$ up to that factor. A weight already inside the ball (bound $\le c$) is
    returned unchanged after one Gram product. No fixed polynomial (the reference's 4-step hard
    cap only works for $\sigma \le 3.5$).

    Scale: the passes run on $M/s$ at levels $c/s$, $s$ a power of two near $M$'s largest
    entry ($s\min(\sigma/s, c/s) = \min(\sigma, c)$, and the scaling is exact), so the cap
    holds for every finite weight whose top singular value is representable (the Gram matrix
    and msign's normalization overflowed in float32 from $\sigma_{\max} \approx 3\cdot10^{12}$).

    Args:
        w_max: RMS→RMS cap.
        method: one of :data:`HARD_CAP_METHODS`: ``"polar_express"`` (default) or ``"svd"``
            (a reference: $U\min(\Sigma, c)V^\top$ from the SVD of $M/s$ in one pass at
            $w_{\max}$, exact up to the SVD's backward error, about $u\,\sigma_{\max}$ on every
            singular value; no band). The construction needs a sign that tends to the exact
            one as ``sign_steps`` grow; the 5-step tables (``"newton_schulz"``,
            ``"polar_express_5"``) repeat a last step that does not fix 1 (Keller's maps 1 to
            0.70; ``polar_express_5``'s fixed point is 1.035), so their "projector" is not one
            and the capped norm stayed at 2.6 (``"newton_schulz"``) and 1.012 ($w_{\max} = 1$).
            They are refused (``ValueError``) rather than left to break the bound.
        sign_steps: Polar Express steps of each symmetric sign. Its float64 resolution $r$ must
            be below $1/(4\rho^2)$, so that a level's shift $t \approx 1.01\,r\,\rho^2c^2$ stays
            below $c^2/2$ and the last pass sees $x = 1$: 9 or more for ``ratio=16`` (8 resolve
            only down to $0.95$; 7 and fewer never reach $\varepsilon$, and 6 and fewer overshoot
            1, :func:`_hard_cap_sign_profile`); refused at construction (``ValueError``). 20:
            $r = 3.7\cdot10^{-7}$ (float32), $K = 1.1\cdot10^{-8}$.
        ratio: level ratio $\rho$ of one pass, finite and $\ge\sqrt2$ (at $\rho = \infty$ no
            level runs: nothing would be capped). Below $\sqrt2$ a level's $B$ is $c^2$ (the
            values far below $c$) whatever $\rho$, so a pass resolves no finer, while the passes
            grow as $\log(\text{bound}/c)/\log\rho$ (``ratio=1.0001`` had run 27,700 passes on
            a weight at $16c$); refused (``ValueError``).
        levels: 0 (default): $J$ adaptive as above, which reads the bound back to the host
            once per call (a device sync on a GPU); $J \ge 1$: always the $J$ levels
            $c\rho^{J-1}, \dots, c$, no host read, each level a no-op (the matrix kept
            bitwise) on a matrix whose bound is at or below it. The same cap wherever the
            bound is at most $c\rho^J$; above that the top level's $B$, hence $t$, grows with the
            bound, and so do the last pass's $x = \max(1, 2t/c^2)$, $\beta$ and the band (the
            guarantee above, with that $x$, still holds). The top level $c\rho^{J-1}$ must be a
            finite float64.

    Cost per pass: one msign of the $m\times n$ matrix, one sign of an $n\times n$ symmetric
    matrix (``sign_steps`` steps of 3 products) and 4 matmuls (about 3 Muon orthogonalizations);
    the last level's extra pass adds one Gram product, one more $n\times n$ sign and 2 matmuls
    (about two thirds of a pass for a square matrix). One level whenever
    $\sigma_{\max} \le \rho c / n^{1/8}$, which covers a weight capped at the previous
    step plus one optimizer update (``levels=1`` in an optimizer's loop: every step pays
    that pass, the adaptive cap only when the bound exceeds $c$).
    """

    w_max: float = 1.0
    method: str = "polar_express"
    sign_steps: int = 20
    ratio: float = 16.0
    levels: int = 0
    name = "hard_cap"

    def __post_init__(self):
        self.w_max = as_positive("HardCap", "w_max", self.w_max)
        self.sign_steps = check_count("HardCap", "sign_steps", self.sign_steps, 1)
        if self.method not in HARD_CAP_METHODS:
            raise ValueError(
                f"HardCap: method must be one of {HARD_CAP_METHODS}, the msign methods exact enough "
                f"for the cap, got {self.method!r} (the 5-step tables' sign does not converge, and "
                "the weight stays above w_max)"
            )
        self.ratio = as_real("HardCap", "ratio", self.ratio)
        if not (math.isfinite(self.ratio) and self.ratio >= math.sqrt(2)):
            raise ValueError(
                f"HardCap: ratio must be a finite number >= sqrt(2), got {self.ratio} (below sqrt(2) a pass "
                "resolves no finer while the passes grow as 1/log(ratio)); choose one in [sqrt(2), 16] (default 16)"
            )
        coarse = _hard_cap_sign_profile(self.sign_steps)[1][torch.float64] if self.method == "polar_express" else 0.0
        if coarse >= 1 / (4 * self.ratio**2):
            raise ValueError(
                f"HardCap: sign_steps={self.sign_steps} resolves eigenvalues only down to {coarse:.2g} of the bound in "
                f"float64, too coarse for ratio={self.ratio:g} (it must be below 1 / (4 ratio^2) = "
                f"{1 / (4 * self.ratio**2):.2g}); use more sign_steps (default 20) or a smaller ratio"
            )
        self.levels = check_count("HardCap", "levels (0: adaptive)", self.levels, 0)
        if self.levels and math.log(self.w_max) + (self.levels - 1) * math.log(self.ratio) >= _LOG_FLOAT64_MAX:
            raise ValueError(
                f"HardCap: the top level w_max * ratio^(levels - 1) of levels={self.levels} overflows "
                "float64; use fewer levels or a smaller ratio"
            )

    def regulate(self, M, *, lr, state):
        wide = M.size(-2) < M.size(-1)
        X = M.mT if wide else M
        s, unit, gram = self._scaled_gram(X)
        # Schatten-8 norm ||(X^T X)^2||_F^(1/4) >= sigma_max (within a factor n^(1/8)), in units of s
        bound = (gram @ gram).norm(dim=(-2, -1), keepdim=True).sqrt().sqrt()
        levels = self.levels
        if not levels:
            # in float64, where bound * s is exact (a power of two) for float32 weights
            top = (bound.double() * s.double()).amax().item() if bound.numel() else 0.0  # (an empty batch)
            if top <= self.w_max:
                return M
            if not math.isfinite(top):
                raise ValueError(f"HardCap: the weight's norm bound is {top}: non-finite weights, or a norm "
                                 "beyond float64's range; rescale the weight")
        if self.method == "svd":  # the SVD needs no descent: one pass at w_max
            c = self._level(0, s)
            # in float64: float32's (LAPACK gesdd) had failed to converge on a 512 x 512 matrix with
            # 256 equal singular values
            U, S, Vh = torch.linalg.svd(unit.double(), full_matrices=False)
            capped = ((U * torch.minimum(S, c[..., 0].double()).unsqueeze(-2)) @ Vh).to(X.dtype) * s
            X = torch.where(bound > c, capped, X)
            return X.mT if wide else X
        levels = levels or math.ceil(math.log(top / self.w_max) / math.log(self.ratio))
        m, n = X.shape[-2:]
        eye = torch.eye(n, dtype=X.dtype, device=X.device)
        resolution = _hard_cap_sign_profile(self.sign_steps)[1][X.dtype]
        unit_roundoff = torch.finfo(X.dtype).eps / 2
        # r_eff of the class docstring, times the sign's input scale: every level's and the last pass's
        reach = POLAR_EXPRESS.input_scale * (resolution + 2 * (math.sqrt(m) + math.sqrt(n)) * unit_roundoff)
        b, s_level = bound, s  # b >= sigma_max of X / s_level
        for level in reversed(range(levels)):
            if level < levels - 1:  # as the previous pass left it (sigma_max <= b), rescaled
                s_previous = s_level
                s_level, unit, gram = self._scaled_gram(X)
                b = b * (s_previous / s_level)  # (a power of two: exact)
            c = self._level(level, s_level)
            capped, t = self._cap_once(unit, gram, c, b, eye, reach)
            if level == 0:
                capped = self._settle(capped, c, t, eye)
            # a pass at a level at or above the matrix's bound keeps it bitwise (selected on the device)
            run = bound > self._level(level, s)
            X = torch.where(run, capped * s_level, X)
            b = torch.where(run, (c**2 + 2 * t).sqrt(), b)
        return X.mT if wide else X

    @staticmethod
    def _scaled_gram(X):
        r"""$(s, X/s, (X/s)^\top(X/s))$ (:func:`_scaled` and the Gram matrix): the
        cap commutes with scaling, $s\min(\sigma/s, c/s) = \min(\sigma, c)$, and on $X/s$ neither
        the Gram, the bound nor msign's Frobenius normalization over- or underflows (in fp32 the
        Gram of $X$ overflowed from entries near $10^{19}$, and msign's norm of $X^\top X - c^2I$ from
        $\sigma_{\max}$ near $3\cdot10^{12}$). Each pass rescales: a descent from $\sigma_{\max} =
        10^{150}$ to $c = 1$ had left the Gram at $10^{-300}$, whose norm underflows in float64."""
        s, unit = _scaled(X)
        return s, unit, unit.mT @ unit

    def _level(self, level: int, s: torch.Tensor) -> torch.Tensor:
        r"""Level $c\rho^\text{level}$ in units of ``s``, ``[..., 1, 1]`` in ``s.dtype``: divided in
        float64, so that a level beyond float32's range does not become inf before the division."""
        return ((self.w_max * self.ratio**level) / s.double()).to(s.dtype)

    def _sign(self, A, norm_bound):
        r"""Symmetric sign of ``A`` ``[..., n, n]``, $\|A\|_2 \le$ ``norm_bound`` ``[..., 1, 1]``:
        ``sign_steps`` Polar Express steps on $A/(1.01\,\text{norm\_bound})$ (msign would divide
        by the Frobenius norm, up to $\sqrt n$ times larger, and resolve that much less)."""
        Y = (A / (POLAR_EXPRESS.input_scale * norm_bound)).reshape(-1, *A.shape[-2:])  # (the step takes one batch dim)
        return sym(polar_express_steps(Y, self.sign_steps)).reshape(A.shape)

    def _cap_once(self, X, gram, c, b, eye, reach):
        r"""One level of the class docstring on the tall ``X`` (Gram ``gram``, level ``c``,
        ``b`` $\ge \sigma_{\max}$, all in one unit; ``eye`` the $n\times n$ identity, ``reach``
        $1.01\,r_{\text{eff}}$): ``(capped, t)``, the capped matrix and the threshold's shift $t$
        (the capped $\sigma_{\max} \le \sqrt{c^2 + 2t}$)."""
        B = torch.maximum(c**2, b**2 - c**2)  # >= ||X^T X - c^2 I||_2
        t = reach * B / (1 - reach)  # t = reach (B + t): the threshold c^2 + t is out of reach of every sigma <= c
        projector = 0.5 * (eye + self._sign(gram - (c**2 + t) * eye, B + t))
        return X - (X - c * msign(X, method=self.method)) @ projector, t

    def _settle(self, X, c, t, eye):
        r"""The last level's final pass at ``c`` on ``X``, whose $\sigma_{\max} \le \sqrt{c^2 + 2t}$:
        $X - X\Pi_1A_1/(2c^2)$ (class docstring). $\|A_1\|_2 \le \max(c^2, 2t)$, about $\rho^2$
        times less than a level's $B$, and its unresolved band that much narrower."""
        A = X.mT @ X - c**2 * eye
        projector = 0.5 * (eye + self._sign(A, torch.maximum(c**2, 2 * t)))
        return X - (X @ projector) @ A / (2 * c**2)


@dataclass(repr=False)
class ColumnCap(Regulator):
    r"""Column-norm cap for DGram weights (orthogonal columns, so the singular values are
    the column norms): scale every column (RMS-scaled) of norm above $w_{\max}$ down to
    $w_{\max}$. Exact for DGram points; for other matrices it caps column norms, not
    $\sigma_{\max}$.

    ``side``: ``"columns"``, ``"rows"``, or ``"auto"`` (default: columns for tall, rows for
    wide matrices, the side DGram constrains in its transposed geometry).
    Cost: one norm per column (of the column divided by a power of two near its largest
    entry: exact, and finite for every finite weight).
    """

    w_max: float = 1.0
    side: str = "auto"
    name = "column_cap"

    def __post_init__(self):
        self.w_max = as_positive("ColumnCap", "w_max", self.w_max)
        if self.side not in ("auto", "columns", "rows"):
            raise ValueError(
                f"ColumnCap: side must be 'auto', 'columns' or 'rows', got {self.side!r}"
            )

    def regulate(self, M, *, lr, state):
        rows = self.side == "rows" or (self.side == "auto" and M.size(-2) < M.size(-1))
        dim = -1 if rows else -2
        # each column by a power of two near its largest entry before the norm squares it (the
        # norm had overflowed to inf in fp32 from entries near 1e19, and the column became 0);
        # a capped column is (M / s) (w / ||M / s||), one kept is (M / s) s: one pass, and no
        # norm of M itself formed
        s = power_of_two_at_most(largest_entry(M, dim))
        unit = M / s
        norms = unit.norm(dim=dim, keepdim=True)
        return unit * torch.where(norms * s > self.w_max, self.w_max / norms, s)


# --------------------------------------------------------------------------------------
# composition and construction


class Chain(Regulator, register=False):
    """Several regulators applied in order (what a list spec builds); each sees the
    previous one's output and the same ``lr`` and ``state``.

    Each power-iteration regulator (``spectral_normalize``, ``spectral_hammer``,
    ``spectral_weight_decay``) keeps its own warm start: the ``j``-th of them in the order they
    run (counted through nested chains) in the state entry :func:`warm_start_key` ``(j)``, so the
    first in :data:`WARM_START_KEY` as a single regulator does. The slots follow from the spec
    alone: a resumed run (``state_dict`` round trip) finds each block where it left it. A
    regulator given in a slot other than 0 is copied (the one given is left as it is)."""

    name = "chain"

    def __init__(self, regulators: Iterable[Callable]):
        self.regulators, _ = _in_warm_start_slots(regulators, 0)

    def spec(self) -> list:
        """The list spec of the chained regulators (see :meth:`Regulator.spec`)."""
        return [regulator_spec(regulator) for regulator in self.regulators]

    def unchecked(self, W, *, lr, state=None):
        for regulator in self.regulators:
            W = unchecked_regulation(regulator, W, lr=lr, state=state)
        return W

    def after(self, update_bound):
        return Chain(regulator_after(r, update_bound) for r in self.regulators)

    @property
    def assumed_weight_decay(self):
        return max(map(regulator_assumed_weight_decay, self.regulators), default=0.0)

    def refusal(self, lr, shape):
        return next((why for r in self.regulators if (why := regulator_refusal(r, lr, shape))), None)


def _in_warm_start_slots(regulators: Iterable[Callable], first: int) -> tuple[list, int]:
    """``regulators`` with the power-iteration ones' warm starts in the slots ``first``,
    ``first + 1``, ... in the order they run (through nested chains, copied), and the next free slot."""
    placed, slot = [], first
    for regulator in regulators:
        if isinstance(regulator, Chain):
            regulator = copy.copy(regulator)
            regulator.regulators, slot = _in_warm_start_slots(regulator.regulators, slot)
        elif isinstance(regulator, _PowerIterationRegulator):
            if regulator._warm_start_key != warm_start_key(slot):
                regulator = copy.copy(regulator)
                regulator._warm_start_key = warm_start_key(slot)
            slot += 1
        placed.append(regulator)
    return placed, slot


def regulator_after(regulator: Callable | None, update_bound: UpdateBound | None) -> Callable | None:
    """:meth:`Regulator.after` of a :class:`Regulator`; any other callable (or ``None``) as it is."""
    return regulator.after(update_bound) if isinstance(regulator, Regulator) else regulator


def regulator_refusal(regulator: Callable | None, lr: float, shape: tuple[int, int]) -> str | None:
    """:meth:`Regulator.refusal` of a :class:`Regulator`; ``None`` for any other callable."""
    return regulator.refusal(lr, shape) if isinstance(regulator, Regulator) else None


def regulator_assumed_weight_decay(regulator: Callable | None) -> float:
    """:attr:`Regulator.assumed_weight_decay` of a :class:`Regulator`; 0 for any other callable."""
    return regulator.assumed_weight_decay if isinstance(regulator, Regulator) else 0.0


def requires_matrices(regulator: Callable | None) -> bool:
    """Whether ``regulator`` refuses tensors below 2-D (every :class:`Regulator`, and a
    :class:`Chain` holding one; a bare callable is the caller's to know)."""
    if isinstance(regulator, Chain):
        return any(requires_matrices(r) for r in regulator.regulators)
    return isinstance(regulator, Regulator)


def unchecked_regulation(regulator: Callable, W: torch.Tensor, *, lr: float, state: dict | None = None):
    """``regulator(W, lr=lr, state=state)`` without the finiteness test of a
    :class:`Regulator` (:meth:`Regulator.unchecked`); any other callable is called as is."""
    if isinstance(regulator, Regulator):
        return regulator.unchecked(W, lr=lr, state=state)
    return regulator(W, lr=lr, state=state)


def regulator_spec(spec: Any) -> Any:
    """``regulate=`` as plain data for a param group: a :class:`Regulator` (instance or
    class) becomes its spec or name, lists are converted item by item, a dict is copied with
    its numpy scalars as the Python values they hold, ``None`` and names stay. A bare callable stays as it
    is (it has no plain form: such a group's optimizer state loads only with
    ``weights_only=False``)."""
    if isinstance(spec, Regulator):
        return spec.spec()
    if isinstance(spec, type) and issubclass(spec, Regulator):
        return spec().spec()
    if isinstance(spec, (list, tuple)):
        return [regulator_spec(item) for item in spec]
    if isinstance(spec, Mapping):
        return {key: _plain(value) for key, value in spec.items()}
    return spec


def _plain(value: Any) -> Any:
    """A numpy scalar (``np.float64``, ``np.int64``, ``np.bool_``, ``np.str_``, a 0-d array) as
    the Python value it holds, anything else as it is: ``torch.load(weights_only=True)`` refuses
    numpy's types, and a spec with ``w_max=np.float64(2.0)`` had saved a state dict that then
    failed to load."""
    return value.item() if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 else value


def make_regulator(spec: Any) -> Callable | None:
    r"""Build a regulator from a param group's ``regulate=`` value.

    * ``None`` → ``None`` (no regulation; the optimizer skips the call);
    * ``"soft_cap"`` (a name in :data:`REGULATORS`) → that regulator with defaults;
    * ``{"name": "soft_cap", "w_max": 2.0, ...}`` → the regulator with those arguments
      (``"kind"`` is accepted for ``"name"``, not both; a name is a string);
    * a :class:`Regulator` (or a subclass: built with its defaults) or any callable
      ``f(W, *, lr[, state])`` → itself (a callable without ``state`` is wrapped);
    * a list/tuple of specs → :class:`Chain`, applied in order.

    The result is called as ``reg(W, lr=lr, state=self.state[p])`` and returns the new
    weight (same shape and dtype); ``state`` may be omitted.

    Raises ``TypeError``/``ValueError`` naming the bad part of the spec.
    """
    if spec is None:
        return None
    if isinstance(spec, Regulator):
        return spec
    if isinstance(spec, type) and issubclass(spec, Regulator):
        return spec()
    if isinstance(spec, str):
        return _regulator_class(spec)()
    if isinstance(spec, Mapping):
        options = dict(spec)
        if "name" in options and "kind" in options:
            raise ValueError(
                f"make_regulator: a dict spec gives 'name' ({options['name']!r}) or its alias 'kind' "
                f"({options['kind']!r}), not both"
            )
        name = options.pop("name", options.pop("kind", None))
        if name is None:
            raise ValueError(
                f"make_regulator: a dict spec needs a 'name' key (one of {sorted(REGULATORS)}), "
                f"got keys {sorted(spec)}"
            )
        cls = _regulator_class(name)
        try:
            return cls(**options)
        except TypeError as error:
            raise TypeError(f"make_regulator: bad options for {name!r}: {error}") from None
    if isinstance(spec, (list, tuple)):
        regulators = [make_regulator(item) for item in spec]
        return Chain(r for r in regulators if r is not None)
    if callable(spec):
        return _StatelessCallable(spec) if not _accepts_state(spec) else spec
    raise TypeError(
        "make_regulator: regulate= must be None, a name, a dict with 'name', a Regulator, "
        f"a callable or a list of these; got {type(spec).__name__}"
    )


class _StatelessCallable:
    """Adapter for a user callable ``f(W, *, lr)`` that takes no ``state``."""

    def __init__(self, function: Callable):
        self.function = function

    def __call__(self, W, *, lr, state=None):
        return self.function(W, lr=lr)

    def __repr__(self) -> str:
        return f"{self.function!r}"


def _accepts_state(function: Callable) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume the protocol
        return True
    return any(p.name == "state" or p.kind is p.VAR_KEYWORD for p in parameters)


def _regulator_class(name: str) -> type[Regulator]:
    if not isinstance(name, str):  # (a list had failed as an unhashable dict key)
        raise TypeError(
            f"make_regulator: a regulator name must be a string, one of {sorted(REGULATORS)}; got {name!r}"
        )
    try:
        return REGULATORS[name]
    except KeyError:
        raise ValueError(
            f"make_regulator: unknown regulator {name!r}; choose one of {sorted(REGULATORS)}"
        ) from None
