r"""The symmetry-compatible family of Lau & Su, arXiv:2605.18106: RowNormM and the PolarGrad optimizers.

One skeleton (Lau & Su): momentum $M \leftarrow \beta M + (1-\beta)G$ ($\beta = 0.95$, no
Nesterov by default), decoupled weight decay $W \leftarrow (1 - \eta\lambda)W$, then
$W \leftarrow W - \eta\,U(M)$ with the update map $U$ of :mod:`geomuon.optimizers.maps`:

| optimizer | $U$ | equivariant under |
|---|---|---|
| :class:`RowNormM` | $\operatorname{diag}(1/(\|m_i\|+\epsilon))M$ | $S_m^\pm\times O_n$ |
| :class:`RightPolarGradM` | $\|M\|_*^\alpha M(M^\top M)^{-1/2}$ | $O_m\times O_n$ |
| :class:`LeftPolarGradM` | $\|M\|_*^\alpha (MM^\top)^{-1/2}M$ | $O_m\times O_n$ |
| :class:`HybridPolarGradM` | $\|R\|_*^\alpha\operatorname{msign}(R)$, $R$ = row-normalized $M$ | $S_m^\pm\times O_n$ |

``centered=True`` (group key) uses the centered map $\Pi^\perp U(\Pi^\perp M)$ (routers,
LM heads: invariant to a shared logit shift). All compute the map in the parameter's
dtype (the polar maps' Polar Express in float32 at least; float16 parameters' map in
float32) unless ``compute_dtype`` says otherwise, and add the update to the parameter in its
dtype. Every group option is checked when the group is added (or loaded).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from geomuon.manifolds.linalg import check_real

from . import maps
from .base import MatrixOptimizer

__all__ = ["RowNormM", "RightPolarGradM", "LeftPolarGradM", "HybridPolarGradM"]


class _MapOptimizer(MatrixOptimizer):
    r"""The PolarGrad skeleton (Lau & Su) around one update map of :mod:`geomuon.optimizers.maps`.

    Args:
        params: parameters or param groups (matrices; ``update="adamw"`` groups for the rest).
        lr: $\eta$ (default ``1e-3``). momentum: $\beta$ (default ``0.95``).
        nesterov: default ``False`` (the reference skeleton).
        weight_decay: decoupled $\lambda$ (default 0).
        alpha: exponent of the nuclear-norm scale of the polar maps (default 1, the
            reference; 0 gives the unit-scale direction). Ignored by RowNormM. A matrix whose
            nuclear-norm scale leaves the dtype's range (a gradient of entries $10^{-43}$ at
            $\alpha = -1$ in float32: $\|M\|_*^{-1} = \infty$) gets a zero update, as the map
            gives (:func:`geomuon.optimizers.maps.right_polar`): its weights move by the weight
            decay only, its momentum as usual, and nothing is reported (the gradient was finite).
        centered: use the centered map (default ``False``).
        eps: the map's epsilon (row-norm floor, or the polar maps' zero threshold on $\|M\|_F$;
            ``None``: the map's default).
        compute_dtype: dtype the map computes in (default: the parameter's, float32 for
            float16 parameters, whose range the polar maps' nuclear-norm scale leaves);
            ``torch.float16`` is refused (see
            :attr:`~geomuon.optimizers.base.MatrixOptimizer.float16_compute`).
        nonfinite, regulate, matrix_view: group keys of :mod:`geomuon.optimizers.base`.
    """

    map_name = ""
    uses_alpha = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        *,
        alpha: float = 1.0,
        centered: bool = False,
        eps: float | None = None,
        compute_dtype: torch.dtype | None = None,
        nonfinite: str = "skip",
        regulate=None,
        matrix_view: str = "batch",
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, alpha=alpha,
            centered=centered, eps=eps, compute_dtype=compute_dtype, nonfinite=nonfinite,
            regulate=regulate, matrix_view=matrix_view,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict, index: int) -> None:
        # before any step: the maps refuse these too, but only inside a step, after the
        # momentum had moved (a retried step counted the gradient twice); a truthy string
        # had switched ``centered`` on
        super()._validate_group(group, index)
        if group["update"] == "adamw":
            return
        where = f"group {index}"
        check_real(where, "alpha", group["alpha"])
        if group["eps"] is not None:
            check_real(where, "eps", group["eps"], lambda x: x >= 0, "a finite number >= 0 (or None)")
        if not isinstance(group["centered"], bool):  # (nesterov: the base class checks it)
            raise ValueError(f"{where}: centered must be True or False, got {group['centered']!r}")

    def _stack_dtype(self, group: dict, p: torch.Tensor) -> torch.dtype:
        # fp16 weights: the map in fp32 (the update is added in fp16 after the lr scales it):
        # a polar map's update is ||M||_* msign(M), whose scale leaves fp16's range (65504) for
        # a 256 x 256 momentum of entries 100, and its fp16 copy had written inf into the weights
        if group["compute_dtype"] is None and p.dtype == torch.float16:
            return torch.float32
        return group["compute_dtype"] or p.dtype

    def _direction(self, group: dict, M: torch.Tensor, params: list[torch.Tensor],
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        name = ("centered_" if group["centered"] else "") + self.map_name
        kwargs = {"alpha": group["alpha"]} if self.uses_alpha else {}
        if group["eps"] is not None:
            kwargs["eps"] = group["eps"]
        return maps.MAPS[name](M, **kwargs)


class RowNormM(_MapOptimizer):
    __doc__ = "RowNormM: $U(M) = \\operatorname{diag}(1/(\\|m_i\\|+\\epsilon))M$.\n\n" + _MapOptimizer.__doc__
    matrix_update = "row_norm"
    map_name = "row_norm"
    uses_alpha = False

    def _rowwise_direction(self, group: dict) -> bool:
        # the centered map mixes rows (it subtracts their mean); the plain one does not
        return not group["centered"]


class RightPolarGradM(_MapOptimizer):
    __doc__ = "RightPolarGradM: $U(M) = \\|M\\|_*^\\alpha M(M^\\top M)^{-1/2}$.\n\n" + _MapOptimizer.__doc__
    matrix_update = "right_polar"
    map_name = "right_polar"


class LeftPolarGradM(_MapOptimizer):
    __doc__ = "LeftPolarGradM: $U(M) = \\|M\\|_*^\\alpha (MM^\\top)^{-1/2}M$ (routers).\n\n" + _MapOptimizer.__doc__
    matrix_update = "left_polar"
    map_name = "left_polar"


class HybridPolarGradM(_MapOptimizer):
    __doc__ = (
        "HybridPolarGradM: $U(M) = \\|R\\|_*^\\alpha\\operatorname{msign}(R)$, $R$ the row-normalized "
        "$M$.\n\n" + _MapOptimizer.__doc__
    )
    matrix_update = "hybrid"
    map_name = "hybrid"
