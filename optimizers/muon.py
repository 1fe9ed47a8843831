r"""Muon: momentum, then the Newton–Schulz polar factor, batched over same-shape matrices.

A drop-in for ``torch.optim.Muon`` (same arguments, same meaning; every value it refuses is
refused here, and more: a ``momentum`` of 1 or more, a fractional ``ns_steps``, a non-finite
coefficient, a ``nesterov`` other than ``True``/``False`` (torch reads any truthy value: ``1``,
``numpy.True_``), an ``ns_steps`` or ``ns_coefficients`` given as a tensor), with the package's
conventions on top (AdamW groups, batching, non-finite handling, regulation; see
:mod:`geomuon.optimizers.base`). One step, for every matrix $W$ with gradient $G$:

$$B \leftarrow \mu B + (1-\mu)G,\qquad \tilde B = \begin{cases}(1-\mu)G + \mu B & \text{Nesterov}\\ B\end{cases},$$
$$O = \mathrm{NS}^{(a,b,c)}_k\big(\tilde B / \max(\|\tilde B\|_F, \epsilon)\big),\qquad
W \leftarrow (1 - \eta\lambda)W - \eta\,s(m, n)\,O,$$

with $s = \sqrt{\max(1, m/n)}$ (``adjust_lr_fn=None`` or ``"original"``) or
$0.2\sqrt{\max(m, n)}$ (``"match_rms_adamw"``), $(m, n)$ the last two dimensions.

Where it departs from ``torch.optim.Muon`` (torch 2.13): ``eps=0`` floors the norm at the smallest
normal number of its dtype, so a zero momentum gives a zero update (torch's $0/0$ writes NaN into the
weights); for bf16 parameters with ``nesterov=False`` the momentum is the formula's (torch's
Newton–Schulz casts with ``.bfloat16()``, a no-op on a bf16 buffer, and divides it by its norm in
place, so its momentum restarts from norm 1 at every step). From KellerJordan/Muon: its defaults
``lr=0.02, weight_decay=0`` are not these (torch's ``1e-3, 0.1``), a conv kernel takes
``matrix_view="flatten"``, and a ``MuonWithAuxAdam`` group with ``use_muon=False`` becomes an
``update="adamw"`` group (a ``use_muon`` key is refused: it would be kept and never read).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import torch

from geomuon.manifolds.linalg import KELLER_QUINTIC, NSSchedule, check_count, check_real, msign, narrower_range

from .base import MatrixOptimizer, require_number
from .regulate import muon_update_norm

__all__ = ["Muon", "muon_shape_factor"]

DEFAULT_NS_COEFFICIENTS = KELLER_QUINTIC.coefficients[0]
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def muon_shape_factor(rows: int, cols: int, adjust_lr_fn: str | None = None) -> float:
    r"""The factor $s(m, n)$ on ``lr`` of a Muon update of an $m\times n$ matrix, as
    ``torch.optim.Muon`` defines it: $\sqrt{\max(1, m/n)}$ for ``None`` or ``"original"``,
    $0.2\sqrt{\max(m, n)}$ for ``"match_rms_adamw"`` (the update's RMS then matches
    AdamW's, Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982).

    An empty matrix ($n = 0$: no entry to scale) gets $1$: $m/n$ had raised
    ``ZeroDivisionError`` inside the step, after the other matrices had moved."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if cols == 0:
        return 1.0
    return math.sqrt(max(1.0, rows / cols))


def _negative(value) -> bool:
    """Whether ``value`` is a real number below 0 (``False`` for a tensor, a string, NaN)."""
    return isinstance(value, numbers.Real) and value < 0


class Muon(MatrixOptimizer):
    r"""Muon (momentum + orthogonalized update), drop-in for ``torch.optim.Muon``.

    Args:
        params: parameters or param groups. Matrix groups take 2-D parameters
            (``matrix_view="batch"`` or ``"flatten"`` in a group admits 3-D+ ones, see
            :mod:`geomuon.optimizers.base`); ``update="adamw"`` groups take anything.
        lr: learning rate $\eta$, float or 1-element tensor (default ``1e-3``).
        weight_decay: decoupled decay $\lambda$, multiplied by the unadjusted ``lr``
            (default ``0.1``).
        momentum: $\mu$ (default ``0.95``).
        nesterov: Nesterov momentum (default ``True``).
        ns_coefficients: $(a, b, c)$ of the quintic (default Keller Jordan's
            $(3.4445, -4.7750, 2.0315)$).
        eps: floor of $\|\tilde B\|_F$ (default ``1e-7``; at least the smallest normal number of
            the norm's dtype, so ``0`` maps a zero momentum to a zero update, not NaN).
        ns_steps: Newton–Schulz steps, $< 100$ (default ``5``).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.
        compute_dtype: dtype of the Newton–Schulz matmuls (default ``torch.bfloat16``,
            as ``torch.optim.Muon``; ``None`` uses the parameter's dtype). The update is
            added to the parameter in its own dtype. ``torch.float16`` for wider weights
            receives the momentum normalized in their dtype (see :func:`~geomuon.manifolds.linalg.msign`).
        nonfinite: group key of :mod:`geomuon.optimizers.base` (default ``"skip"``).
        regulate: group key of :mod:`geomuon.optimizers.base` (default ``None``).
        matrix_view: group key of :mod:`geomuon.optimizers.base` (default ``"strict"``).

    Raises:
        ValueError: ``lr``/``momentum``/``weight_decay`` not a finite number $\ge 0$
            (``momentum`` $< 1$), a multi-element tensor ``lr``, an unknown ``adjust_lr_fn``,
            ``ns_steps`` not a whole number in $[0, 100)$, ``ns_coefficients`` that are not
            three finite real numbers, a parameter that is not 2-D (under
            ``matrix_view="strict"``), a group with a ``use_muon`` key.
        RuntimeError: at ``step``, for complex parameters or sparse gradients.
    """

    matrix_update = "muon"
    cpu_stack_size = 1  # msign's CPU kernel iterates one matrix at a time
    float16_compute = True  # msign narrows to fp16 after its normalization
    # two one-thread workers, one matrix each at a time: 0.80-0.83x torch.optim.Muon's
    # two-thread step on the 6 x 384 GPT stack (AMD EPYC), bitwise the one-thread update
    parallel_batches = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        compute_dtype: torch.dtype | None = torch.bfloat16,
        nonfinite: str = "skip",
        regulate=None,
        matrix_view: str = "strict",
    ) -> None:
        # torch.optim.Muon's messages for a negative number; anything else that is not admissible (a
        # string, None, NaN) is refused by the group checks, which name the option (lr="0.1" had
        # raised TypeError from the comparison, naming nothing)
        if _negative(lr):
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if _negative(momentum):
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if _negative(weight_decay):
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            compute_dtype=compute_dtype, nonfinite=nonfinite, regulate=regulate, matrix_view=matrix_view,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict, index: int) -> None:
        if "use_muon" in group:
            # KellerJordan/Muon's MuonWithAuxAdam key, kept and never read: a use_muon=False group of
            # 2-D weights (its embedding and head) had taken Muon steps at the lr meant for Adam
            raise ValueError(
                f"group {index}: use_muon={group['use_muon']!r} is a key of KellerJordan/Muon's MuonWithAuxAdam, "
                "which Muon does not read: set update='adamw' in place of use_muon=False and drop use_muon=True; "
                "a group's omitted options take this optimizer's defaults, not MuonWithAuxAdam's (weight_decay 0; "
                "Adam's betas (0.9, 0.95), eps 1e-10)")
        super()._validate_group(group, index)
        if group["update"] == "adamw":
            return
        require_number(index, "eps", group["eps"], lambda x: x >= 0, "a finite number >= 0")
        if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
        # a whole number, not one int() makes whole: 2.7 had run 2 steps, "5" five, True one
        ns_steps = check_count(f"group {index}", "ns_steps", group["ns_steps"], 0)
        if ns_steps >= 100:
            raise ValueError(
                f"group {index}: ns_steps must be in [0, 100) for computational efficiency, got {group['ns_steps']}"
            )
        coefficients = group["ns_coefficients"]
        try:
            count = len(coefficients)
        except TypeError:
            count = None
        if count != 3:
            raise ValueError(f"Coefficients must be a tuple of exactly 3 values (group {index}: ns_coefficients="
                             f"{coefficients!r})")
        # each a finite real number: a NaN had written NaN into the weights with no skip reported
        # (the gradient was finite), a string had failed inside addmm
        for name, value in zip("abc", coefficients):
            check_real(f"group {index}", f"ns_coefficients ({name})", value)

    def _stack_dtype(self, group: dict, p: torch.Tensor) -> torch.dtype:
        # fp16 for wider weights: the momentum stays in their dtype, and msign narrows it after
        # the normalization (the momentum itself may leave fp16's range); bf16 for fp64 weights
        # keeps the bf16 stack (fp32's range holds any momentum, at a quarter of the bytes)
        compute = group["compute_dtype"]
        if compute is None or narrower_range(compute, torch.float32) and narrower_range(compute, p.dtype):
            return p.dtype
        return compute

    def _direction(self, group: dict, M: torch.Tensor, params: list[torch.Tensor],
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        # One fixed quintic, no input scaling beyond the Frobenius norm floored at eps:
        # torch.optim.Muon's iteration, run by the package's kernel.
        return msign(M, coefficients=self._quintic(group), eps=group["eps"], compute_dtype=group["compute_dtype"],
                     buffers=self._scratch())

    @staticmethod
    def _quintic(group: dict) -> NSSchedule:
        return NSSchedule("muon", (tuple(group["ns_coefficients"]),), 1.0, int(group["ns_steps"]))

    def update_bound(self, group: dict):
        r"""$\text{lr}\cdot\sup p^{(K)}\cdot 1.05\cdot\sqrt{\text{fan\_in}/\text{fan\_out}}\;s$ for the
        group's quintic, its step count and its ``adjust_lr_fn`` as they are when it is called (a group
        edited between steps is bound by its new options; :func:`~geomuon.optimizers.regulate.muon_update_norm`,
        the soft cap's default $\eta$ for Keller's quintic and ``"original"``, bitwise)."""
        def bound(lr, shape):
            return muon_update_norm(lr, shape, schedule=self._quintic(group), adjust_lr=group["adjust_lr_fn"] or "original")
        return bound

    def _lr_scale(self, group: dict, shape: tuple[int, ...]) -> float:
        return muon_shape_factor(*shape, group["adjust_lr_fn"])
