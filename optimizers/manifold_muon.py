r"""Manifold Muon: steepest descent on a matrix manifold under a norm, then a retraction.

For every matrix $W$ on its manifold $\mathcal M$ with gradient $G$:

$$B \leftarrow \mu B + (1-\mu)G,\qquad \hat A = \arg\max_{A\in T_W\mathcal M,\ \|A\|\le1}
\langle \tilde B, A\rangle\ \text{(the engine, warm-started)},\qquad
W \leftarrow R_W(-\eta\,\hat A),$$

with $\tilde B$ the (Nesterov) momentum of :mod:`geomuon.optimizers.base`, the direction from
:func:`geomuon.optimizers.steepest.steepest_direction` (dual iterations in ``compute_dtype``,
final tangent projection and rescaling in the parameter's dtype) and the manifold's own
retraction in float32 (float64 for float64 parameters; bf16 parameters are upcast).

Per-matrix state: the momentum buffer ($m\times n$) and the dual correction
$\Lambda - \Lambda_0$ used as the next step's warm start (the multiplier's shape:
$n\times n$ for Stiefel/DGram, $n$ for Oblique, nothing for unconstrained manifolds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable

import torch

from geomuon.manifolds import MatrixManifold, retraction_dtype

from .base import MatrixOptimizer
from .steepest import NORMS, steepest_direction

__all__ = ["ManifoldMuon", "resolve_manifold", "polish_retraction", "DEFAULT_DUAL_STEPS"]

#: Default dual steps per optimizer step, chosen on the measured frontier
#: (``bench/manifold_frontier.py``; the table is on the docs' Results page).
DEFAULT_DUAL_STEPS = 1
_REQUIRED = ("constraint", "constraint_adjoint", "constraint_gram_diag", "proju", "retr",
             "check_point_on_manifold")


def resolve_manifold(spec, where: str):
    """A manifold instance from an instance, a registered name (``MatrixManifold.by_name``:
    ``"stiefel"``, ``"dgram"``, ...) or a spec dict; ``ValueError`` naming ``where`` otherwise."""
    if isinstance(spec, (str, Mapping)):
        spec = MatrixManifold.resolve(spec, where)
    missing = [name for name in _REQUIRED if not hasattr(spec, name)]
    if missing:
        raise ValueError(
            f"{where}: {type(spec).__name__} lacks {missing}; ManifoldMuon needs a matrix manifold "
            "with the tangent-constraint interface of CONTRIBUTING.md (a manifolds.* class)"
        )
    return spec


def polish_retraction(manifold, W: torch.Tensor, V: torch.Tensor, *, max_steps: int = 8) -> torch.Tensor:
    r"""Retraction by a few cubic Newton–Schulz polishing steps, for Stiefel and DGram.

    With $Y = W + V$ (transposed when wide) and $D = I$ (Stiefel) or
    $D = \operatorname{diag}(\|y_j\|)$ (DGram), $X_0 = YD^{-1}$ is within $O(\|V\|)$ of
    an orthonormal frame, so the cubic iteration
    $X \leftarrow X - \tfrac12 X(X^\top X - I)$ (error $e \mapsto \tfrac34e^2$) reaches
    round-off in one or two steps, where the manifold's 12-step Polar Express retraction
    pays for a cold start. The result is $\operatorname{msign}(X_0)\,D$:

    * Stiefel: exactly the manifold's retraction $\operatorname{msign}(W + V)$;
    * DGram: $\operatorname{msign}(YD^{-1})D$, a retraction as well ($R(W, 0) = W$, and for
      tangent $V$ the normalized direction's symmetric part $\operatorname{sym}(Q^\top\dot
      X)$ vanishes, so $dR_W = \mathrm{id}$); it keeps column norms like ``DGram.retr``.

    It stops when $\|X^\top X - I\|_F \le 32\,\varepsilon$ (predicting the last step's
    error from the quadratic rate, without another Gram product). Falls back to
    ``manifold.retr`` for other manifolds, when $\sigma_{\max}(X_0)$ may exceed the
    iteration's basin ($\|X_0^\top X_0\|_\infty \ge 2.9$, i.e. a step of norm $\gtrsim 1.4$),
    or when ``max_steps`` do not converge. Computed in float32 (float64 for float64 ``W``).
    """
    from geomuon.manifolds import DGram, Stiefel

    if not isinstance(manifold, (Stiefel, DGram)):
        return manifold.retr(W, V)
    dtype = retraction_dtype(W.dtype)
    Y = W.to(dtype) + V.to(dtype)
    wide = Y.size(-2) < Y.size(-1)
    Y = Y.mT if wide else Y
    scale = Y.norm(dim=-2, keepdim=True) if isinstance(manifold, DGram) else None
    if scale is not None and bool((scale == 0).any()):
        return manifold.retr(W, V)  # raises the manifold's own error for a zero column
    X = Y / scale if scale is not None else Y
    eye = torch.eye(X.size(-1), dtype=dtype, device=X.device)
    tol = 32 * torch.finfo(dtype).eps
    for k in range(max_steps):
        E = X.mT @ X - eye
        err = float(E.norm(dim=(-2, -1)).amax())
        if err <= tol:
            break
        if k == 0 and float((E + eye).abs().sum(-1).amax()) >= 2.9:
            return manifold.retr(W, V)
        X = X - 0.5 * (X @ E)
        if 0.75 * err * err <= tol:
            break
    else:
        return manifold.retr(W, V)
    X = X * scale if scale is not None else X
    return (X.mT if wide else X).to(W.dtype)


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
            constrained weight's scale is the manifold's business).
        manifold: default manifold of the groups that set none.
        norm: ``"spectral"`` (default), ``"row"``, ``"column"`` or ``"hybrid"``.
        dual_steps: dual-ascent steps per optimizer step (default
            :data:`DEFAULT_DUAL_STEPS`; 0 is the projection direction $\Phi(P_W\tilde B)$).
        dual_alpha: constant Jacobi-preconditioned dual step size (default 1).
        warm_start: start each step's dual from the previous correction (default True).
        msign_method: the spectral dualizer's kernel, a method of
            :func:`geomuon.manifolds.linalg.msign` (default ``"polar_express"``).
        msign_steps: its iterations (default 6: the first 6 steps of the Polar Express
            table, singular values within $[0.9935, 1.0012]$; the 5-step table's
            $[0.85, 1.14]$ caps the certified ratio near 0.89).
        compute_dtype: dtype of the dual iterations (default ``torch.bfloat16``).
        retraction: ``"polish"`` (default: :func:`polish_retraction`, a few fp32 cubic
            Newton–Schulz steps for Stiefel/DGram, the manifold's own elsewhere) or
            ``"manifold"`` (always ``manifold.retr``).
        certify_every: every this many steps, compute the exact duality certificate
            of each matrix's direction into :attr:`certificates` (0: never; it costs an
            SVD per matrix).
        nonfinite: group key of :mod:`geomuon.optimizers.base`: ``"skip"`` or ``"raise"``.
        regulate: group key of :mod:`geomuon.optimizers.base`: a regulator spec or ``None``.
        matrix_view: group key of :mod:`geomuon.optimizers.base`: ``"strict"``, ``"batch"`` or
            ``"flatten"``.

    Attributes:
        certificates: ``{parameter name: certified ratio}`` of the last certified step.

    The first step (and the first after :meth:`load_state_dict`) runs
    :meth:`check_on_manifold`, so a weight that left its manifold raises a
    ``ValueError`` naming it instead of being silently retracted.
    """

    matrix_update = "manifold_muon"

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
        dual_steps: int = DEFAULT_DUAL_STEPS,
        dual_alpha: float = 1.0,
        warm_start: bool = True,
        msign_method: str = "polar_express",
        msign_steps: int | None = 6,
        compute_dtype: torch.dtype | None = torch.bfloat16,
        retraction: str = "polish",
        certify_every: int = 0,
        nonfinite: str = "skip",
        regulate=None,
        matrix_view: str = "batch",
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, manifold=manifold,
            norm=norm, dual_steps=dual_steps, dual_alpha=dual_alpha, warm_start=warm_start,
            msign_method=msign_method, msign_steps=msign_steps, compute_dtype=compute_dtype,
            retraction=retraction, certify_every=certify_every, nonfinite=nonfinite, regulate=regulate, matrix_view=matrix_view,
        )
        self.certificates: dict[str, float] = {}
        self._checked = False
        super().__init__(params, defaults)

    def _validate_group(self, group: dict, index: int) -> None:
        super()._validate_group(group, index)
        if group["update"] == "adamw":
            return
        if group["norm"] not in NORMS:
            raise ValueError(f"group {index}: unknown norm {group['norm']!r}; choose one of {list(NORMS)}")
        if group["retraction"] not in ("polish", "manifold"):
            raise ValueError(f"group {index}: retraction must be 'polish' or 'manifold', got {group['retraction']!r}")
        if int(group["dual_steps"]) < 0:
            raise ValueError(f"group {index}: dual_steps must be >= 0, got {group['dual_steps']}")
        manifold = None
        if group["manifold"] is not None:
            # the group keeps the spec (plain data for state_dict); the live one is derived
            manifold = resolve_manifold(group["manifold"], f"param group {index}")
            group["manifold"] = manifold.spec()
            self._manifolds[id(group)] = (group["manifold"], manifold)
            manifold.identity  # computed here, not in a step  # noqa: B018
        for i, p in enumerate(group["params"]):
            own = getattr(p, "manifold", None)
            name = self._name(group, i, index)
            if group["manifold"] is None and own is None:
                raise ValueError(
                    f"ManifoldMuon: parameter {name} has no manifold; set the group's 'manifold' "
                    "(e.g. 'stiefel') or pass a geoopt.ManifoldParameter"
                )
            if own is not None and group["manifold"] is None:
                resolve_manifold(own, f"parameter {name}").identity  # noqa: B018
            elif own is not None and hasattr(own, "constraint") and type(own) is not type(manifold):
                raise ValueError(
                    f"ManifoldMuon: parameter {name} is a ManifoldParameter on {type(own).__name__} "
                    f"but its group says {type(manifold).__name__}"
                )

    def _rebuild_derived_state(self) -> None:
        super()._rebuild_derived_state()
        # Loaded or copied weights may have left their manifold: check again.
        self._checked = False
        self.certificates = getattr(self, "certificates", {})

    def _manifold_of(self, group: dict, p: torch.Tensor):
        return self._group_manifold(group) if group["manifold"] is not None else p.manifold

    def _batch_key(self, group: dict, p: torch.Tensor) -> tuple:
        m = self._manifold_of(group, p)
        return super()._batch_key(group, p) + (m.identity,)

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one step; the first one checks every weight is on its manifold."""
        if not self._checked:
            self.check_on_manifold()
            self._checked = True
        return super().step(closure)

    def _points(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor:
        shape = self._matrix_shape(group, params[0])
        dtype = retraction_dtype(params[0].dtype)
        return torch.stack([p.reshape(shape).to(dtype) for p in params])

    def _direction(self, group: dict, M: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        manifold = self._manifold_of(group, params[0])
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            state["step"] = state.get("step", torch.tensor(0.0)) + 1
        W = self._points(group, params)
        warm = None
        if group["warm_start"] and all("dual_correction" in s for s in states):
            warm = torch.stack([s["dual_correction"] for s in states])
        every = int(group["certify_every"])
        certify = "exact" if every and int(states[0]["step"].item()) % every == 0 else None
        result = steepest_direction(
            manifold, W, M.to(W.dtype), group["norm"], preset=None, steps=int(group["dual_steps"]),
            alpha=float(group["dual_alpha"]), decay=False, tol=0.0, init="projection",
            warm_start=warm, msign_method=group["msign_method"], msign_steps=group["msign_steps"],
            compute_dtype=group["compute_dtype"], certify=certify, track_best=False, exact_norm=False,
            safeguard=True,
        )
        if group["warm_start"] and result.correction is not None:
            for state, correction in zip(states, result.correction):
                state["dual_correction"] = correction.clone()
        if result.ratio is not None:
            index = self.param_groups.index(group)
            for p, ratio in zip(params, result.ratio.reshape(len(params), -1).mean(dim=-1).tolist()):
                position = next(i for i, q in enumerate(group["params"]) if q is p)
                self.certificates[self._name(group, position, index)] = ratio
        return result.direction

    def _apply(self, group: dict, params: list[torch.Tensor], update: torch.Tensor, lr: float) -> None:
        manifold = self._manifold_of(group, params[0])
        W = self._points(group, params)
        if group["weight_decay"] != 0:
            W = W * (1 - lr * group["weight_decay"])
        retract = polish_retraction if group["retraction"] == "polish" else type(manifold).retr
        W = retract(manifold, W, -lr * update.to(W.dtype))
        for p, w in zip(params, W):
            p.copy_(w.reshape(p.shape))
