r"""The conventions every matrix optimizer of the package shares.

:class:`MatrixOptimizer` is a ``torch.optim.Optimizer`` whose subclasses only say how a
stack of momentum matrices becomes an update (:meth:`MatrixOptimizer._direction`) and,
if not by $W \leftarrow (1 - \eta\lambda)W - \eta_{\text{adj}}U$, how it is applied
(:meth:`MatrixOptimizer._apply`). The base class provides:

* **Momentum** $B \leftarrow \mu B + (1-\mu)G$ (the ``lerp`` form of ``torch.optim.Muon``);
  Nesterov feeds $(1-\mu)G + \mu B$ to the map.
* **Same-shape batching**: matrices of one group with the same shape, dtype, device (and
  manifold) are stacked ``[B, m, n]`` and go through one kernel call.
* **Matrix views** of parameters with more than two dimensions (group key
  ``matrix_view``): ``"batch"`` treats ``[..., m, n]`` as a batch of matrices (stacked
  MoE experts ``[E, out, in]``); ``"flatten"`` reshapes to ``[shape[0], -1]`` (conv
  kernels ``[out, in, kh, kw]`` → ``[out, in·kh·kw]``, as Keller Jordan's Muon does);
  ``"strict"`` accepts 2-D parameters only (``torch.optim.Muon``'s rule).
* **The AdamW path** (group key ``update="adamw"``, keys ``lr, betas, eps,
  weight_decay``; defaults of ``torch.optim.AdamW`` for the keys the group omits):
  vectors and other non-matrices are declared, never silently sent to a matrix update.
  A tensor with fewer than two dimensions in a matrix group is a ``ValueError`` at
  construction, naming it.
* **Non-finite gradients** (group key ``nonfinite``): ``"skip"`` (default) warns naming
  the parameter and leaves its weights *and* state untouched; ``"raise"`` raises
  ``ValueError``. A gradient whose Frobenius norm overflows its dtype (fp32 entries
  beyond $\sim10^{19}$) counts as non-finite (one fused norm per group decides).
* **Regulation** (group key ``regulate``): a spec for
  :func:`geomuon.optimizers.regulate.make_regulator`, applied after the step as
  ``p.copy_(reg(p, lr=lr, state=self.state[p]))``. A
  :class:`~geomuon.optimizers.regulate.Regulator` given here is stored as its spec.
* **Plain-data param groups**: a group's ``manifold`` and ``regulate`` are stored as
  specs (``MatrixManifold.spec()``, ``Regulator.spec()``) and the live objects derived
  from them, so ``torch.load(path, weights_only=True)`` reads ``state_dict()``.
* ``p.grad is None`` skipped; closures; LR schedulers (``lr`` is read from the group at
  every step, float or 1-element tensor); ``state_dict``/``load_state_dict`` (all state
  is tensors and the groups plain data, so a resumed run is bit-identical on CPU).
* :meth:`MatrixOptimizer.check_on_manifold`: reports (and by default raises for)
  parameters that are not on their group's manifold.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

import torch

from geomuon.manifolds import MatrixManifold
from geomuon.manifolds.linalg import fp32_or_fp64

from .regulate import make_regulator, regulator_spec
from . import distributed as _distributed

__all__ = ["MatrixOptimizer", "ADAMW_DEFAULTS", "MATRIX_VIEWS"]

#: Defaults of an ``update="adamw"`` group for the keys it does not set (torch's AdamW).
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
MATRIX_VIEWS = ("strict", "batch", "flatten")
_NONFINITE = ("skip", "raise")


class MatrixOptimizer(torch.optim.Optimizer):
    """Base class: momentum, batching, AdamW path, non-finite handling, regulation.

    Subclasses set :attr:`matrix_update` (the name of their update, used in messages)
    and implement :meth:`_direction`.
    """

    matrix_update = "matrix"

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        lr = defaults.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        defaults.setdefault("nonfinite", "skip")
        defaults.setdefault("regulate", None)
        defaults.setdefault("matrix_view", "batch")
        defaults.setdefault("update", self.matrix_update)
        self._regulators: list = []
        self._manifolds: dict[int, tuple] = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("update") == "adamw":
            for key, value in ADAMW_DEFAULTS.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        # Param groups hold plain data (specs), so state_dict() loads with weights_only=True;
        # the live regulator is derived from the spec and kept beside the groups.
        group["regulate"] = regulator_spec(group.get("regulate"))
        self._validate_group(group, index)
        self._regulators.append(make_regulator(group["regulate"]))

    def _validate_group(self, group: dict, index: int) -> None:
        for key in ("lr", "weight_decay"):
            value = group.get(key, 0.0)
            if not 0.0 <= float(value):
                raise ValueError(f"group {index}: {key} should be >= 0 but is: {value}")
        if group["nonfinite"] not in _NONFINITE:
            raise ValueError(f"group {index}: nonfinite must be one of {_NONFINITE}, got {group['nonfinite']!r}")
        if group["update"] == "adamw":
            return
        if group["update"] != self.matrix_update:
            raise ValueError(
                f"group {index}: update={group['update']!r}; {type(self).__name__} runs "
                f"{self.matrix_update!r} or 'adamw'"
            )
        if group["matrix_view"] not in MATRIX_VIEWS:
            raise ValueError(f"group {index}: matrix_view must be one of {MATRIX_VIEWS}, got {group['matrix_view']!r}")
        for i, p in enumerate(group["params"]):
            if p.dim() < 2:
                raise ValueError(
                    f"{type(self).__name__}: parameter {self._name(group, i, index)} has shape "
                    f"{tuple(p.shape)}; a {p.dim()}-D tensor has no matrix update. Put it in a "
                    "param group with update='adamw' (or a separate optimizer)"
                )
            if p.dim() > 2 and group["matrix_view"] == "strict":
                raise ValueError(
                    f"{type(self).__name__} only supports 2D parameters whereas we found a parameter "
                    f"with size: {p.size()} ({self._name(group, i, index)}); set matrix_view='batch' "
                    "(stacked matrices [..., m, n]) or 'flatten' (conv kernels) in its group"
                )

    @staticmethod
    def _name(group: dict, i: int, index: int) -> str:
        names = group.get("param_names")
        return repr(names[i]) if names else f"#{i} of param group {index}"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._rebuild_derived_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Optimizer.__getstate__ (pickle, copy.deepcopy) keeps only defaults, state and
        # param_groups; everything else is derived from them and rebuilt here.
        super().__setstate__(state)
        self._rebuild_derived_state()

    def _rebuild_derived_state(self) -> None:
        """Recompute attributes derived from the param groups (subclasses extend it)."""
        self._regulators = [make_regulator(g.get("regulate")) for g in self.param_groups]
        self._manifolds = {}
        for group in self.param_groups:  # resolved now, not in a step
            if group.get("manifold") is not None:
                self._group_manifold(group).identity  # noqa: B018

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = self._params_with_finite_grad(group, index)
            if not params:
                continue
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else float(lr)
            if group["update"] == "adamw":
                self._adamw(group, params, lr)
            else:
                for batch in self._batches(group, params):
                    self._matrix_step(group, batch, lr)
            regulator = self._regulators[index]
            if regulator is not None:
                for p in params:
                    if _distributed.is_sharded(p) and group["update"] != "adamw":
                        continue  # a sharded matrix was regulated whole, on the rank that mapped it
                    _distributed.write_whole(p, regulator(_distributed.whole(p), lr=lr, state=self.state[p]))
        return loss

    def _params_with_finite_grad(self, group: dict, index: int) -> list[torch.Tensor]:
        params, positions = [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            params.append(p)
            positions.append(i)
        if not params:
            return params
        # One fused Frobenius-norm pass (the L2 kernel is ~5x faster than L1 on CPU). A norm
        # that overflows is refused as well: every update here normalizes by it, so a
        # finite gradient beyond the dtype's range would otherwise give a silent zero step.
        # (a DTensor's norms are partial sums: whole() all-reduces them, so ranks agree)
        norms = torch.stack(torch._foreach_norm([p.grad for p in params]))
        finite = _distributed.whole(norms).isfinite().tolist()
        if all(finite):
            return params
        bad = [self._name(group, i, index) for i, ok in zip(positions, finite) if not ok]
        message = (
            f"{type(self).__name__}: non-finite gradient (or one whose Frobenius norm overflows "
            f"its dtype: scale the loss down) in parameter(s) {', '.join(bad)}"
        )
        if group["nonfinite"] == "raise":
            raise ValueError(message + " (nonfinite='raise')")
        warnings.warn(message + "; their step was skipped, weights and state unchanged", RuntimeWarning,
                      stacklevel=3)
        return [p for p, ok in zip(params, finite) if ok]

    def _batches(self, group: dict, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        batches: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            batches.setdefault(self._batch_key(group, p), []).append(p)
        return list(batches.values())

    def _batch_key(self, group: dict, p: torch.Tensor) -> tuple:
        return (self._matrix_shape(group, p), p.dtype, p.device)

    @staticmethod
    def _matrix_shape(group: dict, p: torch.Tensor) -> tuple[int, ...]:
        if group["matrix_view"] == "flatten":
            return (p.shape[0], p[0].numel())
        return tuple(p.shape)

    def _stack_dtype(self, group: dict, p: torch.Tensor) -> torch.dtype:
        """Dtype of the stacked momentum handed to :meth:`_direction` (default: ``p``'s)."""
        return p.dtype

    def _matrix_step(self, group: dict, params: list[torch.Tensor], lr: float) -> None:
        if _distributed.is_sharded(params[0]):  # FSDP2 / DTensor: whole matrices, sharded by matrix
            return _distributed.sharded_matrix_step(self, group, params, lr)
        momentum = group["momentum"]
        grads = [p.grad for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        shape = self._matrix_shape(group, params[0])
        stacked = torch.empty((len(params), *shape), dtype=self._stack_dtype(group, params[0]),
                              device=params[0].device)
        for out, g, b in zip(stacked, grads, bufs):
            # copy_ casts into the stack: one pass, and the stack never aliases the buffer.
            out.copy_((g.lerp(b, momentum) if group["nesterov"] else b).reshape(shape))
        update = self._direction(group, stacked, params)
        self._apply(group, params, update, lr)

    def _direction(self, group: dict, M: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """Map the stacked momentum ``M: [B, *matrix_shape]`` to the update ``[B, ...]``."""
        raise NotImplementedError

    def _rowwise_direction(self, group: dict) -> bool:
        """Whether :meth:`_direction` maps every row (and batch entry) on its own, so a
        shard of rows can be mapped where it lives (default ``False``)."""
        return False

    def _lr_scale(self, group: dict, shape: tuple[int, ...]) -> float:
        """Shape-dependent factor on ``lr`` for the update (1 unless a subclass says)."""
        return 1.0

    def _apply(self, group: dict, params: list[torch.Tensor], update: torch.Tensor, lr: float) -> None:
        """$W \\leftarrow (1 - \\eta\\lambda)W - \\eta\\,s(\\text{shape})\\,U$ (decoupled decay)."""
        weight_decay = group["weight_decay"]
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        scale = self._lr_scale(group, self._matrix_shape(group, params[0])[-2:])
        torch._foreach_add_(params, [u.reshape(p.shape) for u, p in zip(update, params)], alpha=-lr * scale)

    # ------------------------------------------------------------------ AdamW path
    def _adamw(self, group: dict, params: list[torch.Tensor], lr: float) -> None:
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        torch._foreach_add_([s["step"] for s in states], 1.0)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        for p, state in zip(params, states):
            step = state["step"].item()
            bias1 = 1 - beta1**step
            bias2_sqrt = math.sqrt(1 - beta2**step)
            denom = (state["exp_avg_sq"].sqrt() / bias2_sqrt).add_(group["eps"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)

    # ------------------------------------------------------------------ manifold check
    def _manifold_of(self, group: dict, p: torch.Tensor):
        """The manifold a parameter lives on (``None``: unconstrained)."""
        return None

    def _group_index(self, group: dict) -> int:
        """The position of ``group`` in :attr:`param_groups`, found by identity
        (``list.index`` would compare group dicts, and with them their tensors)."""
        return next(i for i, g in enumerate(self.param_groups) if g is group)

    def _group_manifold(self, group: dict) -> MatrixManifold | None:
        """The live manifold of a group whose ``"manifold"`` key holds a spec (plain data,
        see :meth:`geomuon.manifolds.MatrixManifold.spec`), built once per spec object: a
        new spec assigned to the group is picked up, and nothing is hashed in a step."""
        spec = group.get("manifold")
        if spec is None:
            return None
        key = id(group)
        cached = self._manifolds.get(key)
        if cached is None or cached[0] is not spec:
            cached = (spec, MatrixManifold.resolve(spec, f"param group {self._group_index(group)}"))
            self._manifolds[key] = cached
        return cached[1]

    @torch.no_grad()
    def check_on_manifold(self, *, atol: float = 1e-5, rtol: float = 1e-5, raise_error: bool = True):
        """Check that every constrained parameter lies on its manifold.

        Use after loading weights from a checkpoint that may have been edited, or after
        touching parameters by hand. Each point is checked in float32 (float64 for
        float64 parameters) with ``manifold.check_point_on_manifold(explain=True)``;
        ``atol`` is raised to $16\\,\\varepsilon$ of the parameter's dtype, since a bf16
        weight cannot be on a manifold closer than its own rounding.

        Returns:
            list of ``(parameter name, reason)`` for the points that are off.

        Raises:
            ValueError: naming them, when ``raise_error`` and the list is not empty.
        """
        failures = []
        for index, group in enumerate(self.param_groups):
            if group["update"] == "adamw":
                continue
            for i, p in enumerate(group["params"]):
                manifold = self._manifold_of(group, p)
                if manifold is None:
                    continue
                x = _distributed.whole(p.detach()).to(fp32_or_fp64(p.dtype))
                tol = max(atol, 16 * torch.finfo(p.dtype).eps)
                for matrix in [x.reshape(x.shape[0], -1)] if group["matrix_view"] == "flatten" else [x]:
                    ok, reason = manifold.check_point_on_manifold(matrix, explain=True, atol=tol, rtol=rtol)
                    if not ok:
                        failures.append((self._name(group, i, index), reason))
        if failures and raise_error:
            listing = "; ".join(f"{name}: {reason}" for name, reason in failures)
            raise ValueError(
                f"{type(self).__name__}: parameter(s) off their manifold — {listing}. Project them "
                "back with p.copy_(manifold.projx(p)) (or optimizer.project_to_manifolds())"
            )
        return failures

    @torch.no_grad()
    def project_to_manifolds(self) -> None:
        """Move every constrained parameter onto its manifold (``projx`` in float32)."""
        for group in self.param_groups:
            if group["update"] == "adamw":
                continue
            for p in group["params"]:
                manifold = self._manifold_of(group, p)
                if manifold is not None:
                    x = _distributed.whole(p.detach()).to(fp32_or_fp64(p.dtype))
                    view = x.reshape(x.shape[0], -1) if group["matrix_view"] == "flatten" else x
                    _distributed.write_whole(p, manifold.projx(view).reshape(p.shape).to(p.dtype))
