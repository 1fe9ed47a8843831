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
  weight_decay`` (and ``nonfinite``, ``regulate``; the matrix update's options are refused);
  defaults of ``torch.optim.AdamW`` for the keys the group omits):
  vectors and other non-matrices are declared, never silently sent to a matrix update.
  A momentum-cycling schedule (``OneCycleLR``, ``CyclicLR``: ``cycle_momentum=True``) cycles
  the matrix groups' ``momentum``; an AdamW group keeps its ``betas`` (torch writes
  ``momentum`` into every group; AdamW does not read it): give AdamW its own
  ``torch.optim.AdamW`` and scheduler where $\beta_1$ must cycle.
  A tensor with fewer than two dimensions in a matrix group is a ``ValueError`` at
  construction, naming it.
* **Non-finite gradients** (group key ``nonfinite``), with no host read in the step: a
  matrix whose gradient is non-finite, or whose Frobenius norm overflows its dtype (fp32
  entries beyond $\sim10^{19}$; one fused norm per batch decides), gets a no-op step on
  the device — weights, momentum, dual correction and step count unchanged (one exception:
  a ManifoldMuon matrix skipped on its very first step keeps a zero warm start, so its next
  step takes the warm dual steps, not the cold ones: whether it moved is known only on the
  device) — and is
  reported, naming the parameter, at the start of the next :meth:`MatrixOptimizer.step`
  (whatever has reached the host by then; on CPU, everything) or at
  :meth:`MatrixOptimizer.check_finite` (which reads it now): ``"skip"`` (default) warns,
  ``"raise"`` raises ``ValueError``. This is the contract of a skipped step in mixed
  precision training (``torch.amp.GradScaler`` skips ``optimizer.step`` on an inf; optax's
  ``apply_if_finite`` counts skipped steps in its state): the weights are never touched by
  a non-finite gradient, and the error reaches the user at a point that does not stall the
  device. **Exception: sharded** (``DTensor``) groups. Their step has no device-side skip,
  so each sharded param group's finiteness flags (one per matrix; the ranks' squared norms
  summed in float64) are read back to the host before it steps — one device-to-host read per
  sharded group per step, and one more per device mesh before its first group's (the ranks'
  options compared, :func:`~geomuon.optimizers.distributed.compare_options`), each of which
  on CUDA waits for the device (NCCL collectives do not) — and a non-finite matrix is left
  out of the step on every rank and reported at once.
* **Regulation** (group key ``regulate``): a spec for
  :func:`geomuon.optimizers.regulate.make_regulator`, applied after the step as
  ``p.copy_(reg(p, lr=lr, state=self.state[p]))`` (a skipped matrix keeps its weight; the
  regulator runs without its finiteness test, :meth:`~geomuon.optimizers.regulate.Regulator.unchecked`). A
  :class:`~geomuon.optimizers.regulate.Regulator` given here is stored as its spec.
* **Plain-data param groups**: a group's ``manifold`` and ``regulate`` are stored as
  specs (``MatrixManifold.spec()``, ``Regulator.spec()``) and the live objects derived
  from them, so ``torch.load(path, weights_only=True)`` reads ``state_dict()``.
* ``p.grad is None`` skipped; closures; LR schedulers (``lr`` is read from the group at
  every step, float or 1-element tensor; a tensor enters the update as a 0-dim operand,
  never read back, so a schedule may live on the device — regulators receive it as it is); ``state_dict``/``load_state_dict`` (all state
  is tensors and the groups plain data, so a resumed run is bit-identical on CPU).
* **Edited groups**: a group's options are checked when it is added or loaded, and a
  param-group edit between steps is checked at the next :meth:`MatrixOptimizer.step`
  before any group steps (the whole group again where an option changed; the values of
  :data:`SCHEDULED_OPTIONS`, which schedules rewrite, at every step; floats only).
* :meth:`MatrixOptimizer.check_on_manifold`: reports (and by default raises for)
  parameters that are not on their group's manifold (a host read, outside any step). In a
  step, a subclass refuses matrices on the device through :meth:`MatrixOptimizer._admissible`
  (ManifoldMuon's first step: weights off their manifold), with the non-finite no-op and a
  deferred :class:`OffManifoldError`.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import warnings
from functools import partial
from typing import Any, Iterable, Iterator

import torch

from geomuon.manifolds import MatrixManifold
from geomuon.manifolds.linalg import ScratchBuffers, check_compute_dtype, fp32_or_fp64, in_one_thread_workers

from .regulate import (UpdateBound, is_warm_start_key, make_regulator, regulator_after, regulator_assumed_weight_decay,
                       regulator_refusal, regulator_spec, requires_matrices, unchecked_regulation)
from . import distributed as _distributed

__all__ = ["MatrixOptimizer", "OffManifoldError", "ADAMW_DEFAULTS", "MATRIX_VIEWS"]

#: Defaults of an ``update="adamw"`` group for the keys it does not set (torch's AdamW).
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
#: The keys an ``update="adamw"`` group reads (the others are the matrix update's).
_ADAMW_GROUP_KEYS = {"params", "param_names", "update", "nonfinite", "regulate", *ADAMW_DEFAULTS}
#: ``torch.optim.AdamW``'s options that an ``update="adamw"`` group does not implement, with
#: torch's defaults, which it steps as; a value true where the default is not is refused (it
#: had been kept and ignored: a group with ``maximize=True`` minimized), a false one is the
#: default's behaviour (``foreach=False``).
_UNIMPLEMENTED_ADAMW_OPTIONS = {name: option.default for name, option in
                                inspect.signature(torch.optim.AdamW.__init__).parameters.items()
                                if name not in ("self", "params", *ADAMW_DEFAULTS)}
#: State entries shaped like their parameter (momentum and AdamW moments), checked on load.
_PARAMETER_SHAPED_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq")
MATRIX_VIEWS = ("strict", "batch", "flatten")
_NONFINITE = ("skip", "raise")
#: Group options a schedule rewrites at every step (torch's LR schedulers ``lr``; OneCycleLR and
#: CyclicLR ``momentum`` or ``betas``): :meth:`MatrixOptimizer.step` checks their values each
#: step (floats only: a tensor is never read in a step), not against the options as checked.
SCHEDULED_OPTIONS = ("lr", "momentum", "betas")
#: What the snapshot of checked options holds for a scheduled option that is a host value (any
#: float: a schedule's change is no edit); a tensor is held as itself, so swapping one in is an edit.
_HOST_VALUE = object()


class _Listed(tuple):
    """The snapshot of a group's ``params``: the tensors it lists, compared by identity
    (:func:`_same_option`; ``==`` would compare the tensors' values)."""


class _Structure:
    """The snapshot of a dict or list option (a manifold's or a regulator's spec): its nesting, its
    plain values (numbers, strings, ``None``) by type and value and any other value by identity
    (:class:`_Same`), so that an edit in place counts as an edit (a spec's ``radius`` edited in
    place had been stepped with the old manifold and saved with the new value, which then failed
    to resume)."""

    def __init__(self, value) -> None:
        self.value, self.contents = value, _contents(value)


class _Same:
    """A value of a :class:`_Structure` compared by identity: a tensor (``==`` would compare its
    values, reading a device back) or an array (whose ``==`` is no bool). Held here, so that its
    ``id`` is not reused by a value put in its place."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and self.value is other.value

    __hash__ = None


_PLAIN_TYPES = (bool, int, float, complex, str, bytes, type(None))


def _contents(value):
    if isinstance(value, dict):
        return ("dict", tuple((key, _contents(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_contents(item) for item in value))
    return (type(value), value) if type(value) in _PLAIN_TYPES else _Same(value)


def _same_option(before, now) -> bool:
    """Whether a group option is unchanged since it was checked: the same object, or an equal
    plain value of the same type. A tensor counts as changed unless it is the same object; a
    dict or list (:class:`_Structure`) unless it is the same object with the same contents; a
    group's parameters (:class:`_Listed`) are unchanged if it lists the same tensors, by identity
    (an option's tuple of numbers, Muon's ``ns_coefficients``, compares by value: an equal tuple
    put back had counted as an edit, the group checked again at every step)."""
    if before is now:
        return True
    if isinstance(before, _Listed):
        return type(now) is _Listed and len(before) == len(now) and all(b is n for b, n in zip(before, now))
    if isinstance(before, _Structure):
        return type(now) is _Structure and before.value is now.value and before.contents == now.contents
    if isinstance(before, torch.Tensor) or type(before) is not type(now):
        return False
    return before == now


class MatrixOptimizer(torch.optim.Optimizer):
    """Base class: momentum, batching, AdamW path, non-finite handling, regulation.

    Subclasses set :attr:`matrix_update` (the name of their update, used in messages)
    and implement :meth:`_direction`.
    """

    matrix_update = "matrix"
    #: Whether the same-shape batches of a step run in one-thread worker threads on a CPU with
    #: several threads (:meth:`_matrix_steps`): for updates dominated by work that scales poorly
    #: across threads. An update that depends on nothing but its own matrix and state is then
    #: bitwise the one-thread one (with whole-batch stacks, ManifoldMuon's would not be where a
    #: batch mixes warm-started matrices with ones that have no warm start yet: that cold-starts
    #: the whole stack, but not every part; its CPU stacks hold one matrix).
    parallel_batches = False
    #: Matrices per stacked step on a CPU (``None``: the whole same-shape batch). Stacking
    #: pays on an accelerator (one kernel per product for the batch); on a CPU an update
    #: whose kernel maps one matrix at a time anyway pays only for the batch-sized
    #: temporaries, which glibc hands back to the system after each step and faults in
    #: again at the next, while one matrix's fit the thread's reused scratch (Muon on the
    #: 6 x 384 GPT stack, AMD EPYC, one thread: 7-11k page faults and 1.08x
    #: torch.optim.Muon's step with whole batches, 0-0.4k and 1.02-1.06x one matrix at a
    #: time). The result is the same: no update depends on its batch-mates.
    cpu_stack_size: int | None = None
    #: Whether ``compute_dtype=torch.float16`` is accepted: only where the update narrows to
    #: it after a normalization (Muon's msign). Elsewhere fp16's range (normal numbers from
    #: 6.1e-5 to 65504) cannot hold the raw momentum or the products formed from it: a
    #: gradient of norm 1e5 gave NaN weights, one of 1e-9 no step.
    float16_compute = False

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        lr = defaults.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        defaults.setdefault("nonfinite", "skip")
        defaults.setdefault("regulate", None)
        defaults.setdefault("matrix_view", "batch")
        defaults.setdefault("update", self.matrix_update)
        self._regulators: list[tuple] = []  # per group: (the spec it was built from, the regulator)
        self._manifolds: dict[int, tuple] = {}
        self._skipped = _SkippedSteps(_report_nonfinite)
        self._refused = _SkippedSteps(_report_off_manifold)
        self._checked_options: list[dict] = []  # per group: its options as last checked
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("update") == "adamw":
            # the matrix update's options in an AdamW group would be kept and ignored (momentum=0.5
            # had done nothing; a scheduler cycling "momentum" never reached its betas)
            ignored = sorted(set(param_group) & set(self.defaults) - _ADAMW_GROUP_KEYS)
            if ignored:
                raise ValueError(f"{type(self).__name__}: an update='adamw' group takes "
                                 f"{sorted(_ADAMW_GROUP_KEYS - {'params'})}, not {ignored} (options of the matrix "
                                 "update, which AdamW would ignore); set betas for AdamW's momentum")
            unimplemented = {key: param_group[key] for key, default in _UNIMPLEMENTED_ADAMW_OPTIONS.items()
                             if key in param_group and bool(param_group[key]) != bool(default)}
            if unimplemented:
                raise ValueError(f"{type(self).__name__}: an update='adamw' group steps as torch.optim.AdamW with "
                                 f"{_UNIMPLEMENTED_ADAMW_OPTIONS}, not {unimplemented}; leave them out, or give "
                                 "those parameters a torch.optim.AdamW of their own")
            for key, value in ADAMW_DEFAULTS.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        try:
            group["regulate"] = regulator_spec(group.get("regulate"))
            self._validate_group(group, index)
            self._regulators.append((None, None))
            self._group_regulator(group, index)
            self._checked_options.append(self._options_of(group))  # (the regulator's spec as normalized)
            self._group_checked(group, index)
        except Exception:
            # a refused group leaves the optimizer as it was (torch had already appended it, and
            # the next step then failed on a group without a regulator slot)
            self.param_groups.pop()
            del self._regulators[index:]
            self._manifolds.pop(id(group), None)
            raise

    def _group_regulator(self, group: dict, index: int):
        """The live regulator of group ``index``, built from its ``"regulate"`` spec once per
        spec object (param groups hold plain data, so ``state_dict()`` loads with
        ``weights_only=True``): a spec assigned to the group between steps is normalized,
        checked and used from the next step on (it had been ignored until a reload)."""
        spec = group.get("regulate")
        built_from, regulator = self._regulators[index]
        if built_from is not spec:  # (None, None) to start: a group without a regulator builds nothing
            group["regulate"] = spec = regulator_spec(spec)
            bound = None if group["update"] == "adamw" else self.update_bound(group)
            try:
                regulator = regulator_after(make_regulator(spec), bound)
            except ValueError as err:
                raise ValueError(f"{type(self).__name__}: group {index}, regulate={spec!r}: {err}") from None
            # (a matrix group's vectors are refused by _validate_group already)
            if group["update"] == "adamw" and requires_matrices(regulator):  # now, not after other groups moved
                self._refuse_vectors(group, index, f"its group's regulate={spec!r} acts on matrices (a vector has "
                                                   "no spectral norm): set regulate=None in its param group")
            self._regulators[index] = (spec, regulator)
        return regulator

    def _refuse_undecayed_soft_cap(self, group: dict, index: int) -> None:
        r"""Refuse a group whose regulator assumes more decoupled weight decay than the group
        applies (:attr:`~geomuon.optimizers.regulate.Regulator.assumed_weight_decay`: the soft
        cap's $k = w_{\max}(1 - \text{lr}\,\text{wd}) + \eta$ would under-estimate the weight, which
        came back 1.9 % over $w_{\max}$). Part of the group's validation, so a group edited between
        steps and a loaded state dict are checked too (a refused load changes nothing)."""
        if group.get("regulate") is None:
            return
        try:
            spec = regulator_spec(group["regulate"])
            assumed = regulator_assumed_weight_decay(make_regulator(spec))
        except (ValueError, TypeError):  # a bad spec: refused by name where the regulator is built
            return
        applied = float(group["weight_decay"])
        if assumed > applied:
            raise ValueError(
                f"{type(self).__name__}: group {index}, regulate={spec!r} assumes weight_decay="
                f"{assumed:g} applied before each update, but the group applies weight_decay={applied:g}, so the "
                f"cap would be exceeded: give the group weight_decay={assumed:g}, or the regulator one <= "
                f"{applied:g} (0 is always safe)")

    def update_bound(self, group: dict) -> UpdateBound | None:
        r"""``(lr, shape) -> eta``: a bound on the RMS→RMS norm of one update of this matrix
        group, for the regulators that read it (:meth:`~geomuon.optimizers.regulate.Regulator.after`:
        the soft cap's default $\eta$), from the group's options when its regulator is built;
        ``None`` (the default): the optimizer states none, and such a regulator needs its own."""
        return None

    def _refuse_vectors(self, group: dict, index: int, why: str) -> None:
        """Raise ``ValueError`` naming the first parameter of ``group`` below 2-D, and ``why``."""
        for i, p in enumerate(group["params"]):
            if p.dim() < 2:
                raise ValueError(f"{type(self).__name__}: parameter {self._name(group, i, index)} has shape "
                                 f"{tuple(p.shape)}; {why}")

    def _validate_group(self, group: dict, index: int) -> None:
        require_number(index, "weight_decay", group["weight_decay"], lambda x: x >= 0, "a finite number >= 0")
        self._refuse_undecayed_soft_cap(group, index)
        if group["nonfinite"] not in _NONFINITE:
            raise ValueError(f"group {index}: nonfinite must be one of {_NONFINITE}, got {group['nonfinite']!r}")
        if group["update"] == "adamw":
            betas = group["betas"]
            if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
                raise ValueError(f"group {index}: betas must be a pair (beta1, beta2), got {betas!r}")
            self._check_scheduled(group, index)
            require_number(index, "eps", group["eps"], lambda x: x >= 0, "a finite number >= 0")
            return
        if group["update"] != self.matrix_update:
            raise ValueError(
                f"group {index}: update={group['update']!r}; {type(self).__name__} runs "
                f"{self.matrix_update!r} or 'adamw'"
            )
        if group["matrix_view"] not in MATRIX_VIEWS:
            raise ValueError(f"group {index}: matrix_view must be one of {MATRIX_VIEWS}, got {group['matrix_view']!r}")
        if "betas" in group:  # AdamW's momentum in a matrix group: kept and never read
            raise ValueError(f"group {index}: a {group['update']!r} group reads momentum, not betas (AdamW's option, "
                             "which it would ignore); set momentum, or update='adamw' for an AdamW group")
        self._check_scheduled(group, index)
        if not isinstance(group.get("nesterov", False), bool):  # a truthy string ("no") had switched it on
            raise ValueError(f"group {index}: nesterov must be True or False, got {group['nesterov']!r}")
        if "compute_dtype" in group:
            check_compute_dtype(f"group {index}", "compute_dtype", group["compute_dtype"],
                                float16=self.float16_compute)
        self._refuse_vectors(group, index, "a tensor below 2-D has no matrix update. Put it in a param group "
                                           "with update='adamw' (or a separate optimizer)")
        for i, p in enumerate(group["params"]):
            if p.dim() > 2 and group["matrix_view"] == "strict":
                raise ValueError(
                    f"{type(self).__name__} only supports 2D parameters whereas we found a parameter "
                    f"with size: {p.size()} ({self._name(group, i, index)}); set matrix_view='batch' "
                    "(stacked matrices [..., m, n]) or 'flatten' (conv kernels) in its group"
                )

    @functools.cached_property
    def _option_keys(self) -> tuple[str, ...]:
        """The keys of a group's options: the defaults' and an AdamW group's (not ``params``)."""
        # sorted: a set's order depends on the process's hash seed (the ranks compare them in order)
        return tuple(sorted((self.defaults.keys() | ADAMW_DEFAULTS.keys()) - {"params"}))

    def _option_value(self, group: dict, key: str):
        """What the snapshot of checked options holds for ``key`` (:data:`_HOST_VALUE` for a
        scheduled option's host value, the tuple of the tensors for ``params``)."""
        value = group.get(key)
        if key == "params":
            return _Listed(value)
        if isinstance(value, (dict, list)):
            return _Structure(value)
        if key in SCHEDULED_OPTIONS and not isinstance(value, torch.Tensor):
            return _HOST_VALUE
        return value

    def _options_of(self, group: dict) -> dict:
        """The group's options as they are now (:meth:`_option_value` of each key), and its
        parameters: a tensor put into or taken out of ``params`` between steps edits the group
        (an appended 1-D tensor had reached the matrix update unrefused)."""
        return {key: self._option_value(group, key) for key in (*self._option_keys, "params")}

    def _group_checked(self, group: dict, index: int, added: list | None = None) -> None:
        """Called when group ``index`` has passed its checks, added or edited; ``added``: when
        only its ``params`` changed, the tensors put into them (default: nothing; ManifoldMuon
        checks those weights, or every weight of the group, on their manifold at their next step)."""

    def _check_edited_groups(self) -> None:
        """Before any group steps: check again (:meth:`_validate_group`) every group whose
        options were edited since they were checked (a param-group edit had skipped every check:
        ``nesterov="no"`` switched Nesterov on, a typo'd ManifoldMuon ``polish_method`` raised
        mid-step after earlier groups had moved), and the values of
        :data:`SCHEDULED_OPTIONS` of every group (:meth:`_check_scheduled`). Host values only;
        a tensor ``lr`` is read where its group was edited, a tensor swapped in for it included
        (its check reads it, once; a schedule's in-place update keeps the tensor)."""
        for index, group in enumerate(self.param_groups):
            checked = self._checked_options[index]
            edited = [key for key, value in checked.items() if not _same_option(value, self._option_value(group, key))]
            if edited:
                # rebuilt from the edited specs (an edit in place keeps the spec object they are cached by)
                self._manifolds.pop(id(group), None)
                self._regulators[index] = (None, None)
                try:
                    self._validate_group(group, index)
                except ValueError as err:
                    name = f"{type(self).__name__}: "  # (said once: some refusals name the optimizer already)
                    raise ValueError(f"{name}{str(err).removeprefix(name)} (an edited param group; nothing was stepped)") from None
                self._group_regulator(group, index)  # (an edited spec normalized now, before it is recorded)
                self._checked_options[index] = self._options_of(group)
                listed = {id(p) for p in checked["params"]}  # (alive, in the snapshot: no id reused)
                self._group_checked(group, index, [p for p in group["params"] if id(p) not in listed]
                                    if edited == ["params"] else None)
            else:  # (a re-validated group's scheduled values were checked with it)
                self._check_scheduled(group, index, in_step=True)

    def _check_scheduled(self, group: dict, index: int, *, in_step: bool = False) -> None:
        """``lr`` a finite number >= 0, ``momentum`` (a matrix group) or each of ``betas`` (an AdamW
        group) in [0, 1): the options a schedule rewrites (:data:`SCHEDULED_OPTIONS`), checked
        with the group and again at every step (``in_step``: a tensor is not read there;
        ``momentum`` = 1.5 written by hand had stepped)."""
        for key, value in self._scheduled_values(group):
            if in_step and isinstance(value, torch.Tensor):
                continue
            admissible, what = (lambda x: x >= 0, "a finite number >= 0") if key == "lr" else \
                (lambda x: 0 <= x < 1, "a number in [0, 1)")
            try:
                require_number(index, key, value, admissible, what)
            except ValueError as err:
                if not in_step:
                    raise
                raise ValueError(f"{type(self).__name__}: {err}; nothing was stepped") from None

    @staticmethod
    def _scheduled_values(group: dict) -> list[tuple[str, Any]]:
        """``(name, value)`` of the group's :data:`SCHEDULED_OPTIONS` that its update reads."""
        if group["update"] == "adamw":
            return [("lr", group["lr"]), *((f"betas[{k}]", beta) for k, beta in enumerate(group["betas"]))]
        return [("lr", group["lr"]), ("momentum", group["momentum"])]

    def regulation_refusal(self, index: int, lr: float) -> str | None:
        """Why group ``index``'s regulator cannot follow one update of its matrices at the float
        rate ``lr`` (``None``: it can, or the group has none): the soft cap's reach past what it
        can bring back. :meth:`step` asks at the group's rate before any group steps (it had
        raised inside the step, after earlier groups and this one had moved); a training loop
        can ask at the schedule's peak before the first step."""
        group = self.param_groups[index]
        regulator = self._group_regulator(group, index)
        if regulator is None:
            return None
        shapes = {tuple(p.shape if group["update"] == "adamw" else self._matrix_shape(group, p)[-2:])
                  for p in group["params"]}
        for shape in sorted(shapes):
            why = regulator_refusal(regulator, lr, shape)
            if why is not None:
                return f"regulate={group['regulate']!r} at lr={lr:g} and shape {shape}: {why}"
        return None

    def _regulated(self, group: dict, regulator, W: torch.Tensor, lr: float | torch.Tensor,
                   state: dict) -> torch.Tensor:
        """The group's regulator on ``W`` (a whole parameter) as the group steps it: a matrix
        group's regulator sees the matrices of its ``matrix_view`` (a flattened kernel's
        ``[out, -1]``, not its ``[kh, kw]`` slices); returned in ``W``'s shape."""
        if group["update"] == "adamw":
            return unchecked_regulation(regulator, W, lr=lr, state=state)
        matrices = W.reshape(self._matrix_shape(group, W))
        return unchecked_regulation(regulator, matrices, lr=lr, state=state).reshape(W.shape)

    @staticmethod
    def _name(group: dict, i: int, index: int) -> str:
        names = group.get("param_names")
        return repr(names[i]) if names else f"#{i} of param group {index}"

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter with the name this optimizer's errors, warnings and reports (e.g.
        :meth:`check_finite`, ``ManifoldMuon.certificates``) give it: the group's
        ``param_names`` entry quoted, or ``#i of param group k``."""
        for index, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                yield self._name(group, i, index), p

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, with the saved groups completed and checked first:
        keys a saved group lacks (one of ``torch.optim.Muon``, or of an older version) take
        this optimizer's defaults, every group passes the checks a new group passes, and
        every state tensor shaped like its parameter must match it; a refusal names the
        group, option or parameter and changes nothing. Skipped steps not yet reported are
        reported first (they belong to the run so far).

        The checks run as torch's last load pre-hook, registered for this call only: after the
        user's (``register_load_state_dict_pre_hook``, e.g. one that remaps the state of renamed
        or reordered parameters, as torch's documentation advises), so they see the state that
        loads, and torch runs every pre- and post-hook once. Where both the saved groups and this
        optimizer's carry ``param_names``, they must agree: torch maps state by position, and the
        momentum of one same-shaped weight had loaded into another when a model listed its
        modules in another order."""
        self._report_skips(wait=True)

        def check_loadable(optimizer: MatrixOptimizer, loading: dict[str, Any]) -> None:
            nonlocal state_dict
            optimizer._check_loadable(loading)
            state_dict = loading  # torch's shallow copy, or the dict a user's pre-hook returned

        handle = self.register_load_state_dict_pre_hook(check_loadable)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
        # (torch's load ends in __setstate__, which completed the groups and rebuilt the derived state)
        # torch casts every floating state entry but "step" to its parameter's dtype; an entry
        # kept in another precision (:meth:`_state_dtype`) is taken from the saved tensor
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                dtype = self._state_dtype(key, p)
                if dtype is not None and isinstance(value, torch.Tensor) and not _distributed.is_sharded(value):
                    self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)

    def _complete_group(self, group: dict) -> dict:
        """``group`` with the keys it lacks set as :meth:`add_param_group` sets them."""
        if group.get("update", self.defaults["update"]) == "adamw":
            for key, value in ADAMW_DEFAULTS.items():
                group.setdefault(key, value)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        group["regulate"] = regulator_spec(group.get("regulate"))
        return group

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Refuse (``ValueError``) a state dict whose groups this optimizer would refuse, or
        whose parameter-shaped state does not fit the parameters it maps to (it had been
        loaded, and the next step moved other parameters before failing): another shape, or
        ``DTensor`` shards for a plain parameter and the other way round (under FSDP2,
        ``state_dict()`` is one rank's view: shards, and the whole-matrix state of the
        matrices that rank owns only). Counts that do not match are left to torch's own message."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(c["params"]) for s, c in zip(saved_groups, self.param_groups)):
            return
        for index, (saved, current) in enumerate(zip(saved_groups, self.param_groups)):
            saved_names, names = saved.get("param_names"), current.get("param_names")
            if saved_names is not None and names is not None and list(saved_names) != list(names):
                was, now = next((a, b) for a, b in zip(saved_names, names) if a != b)
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param group {index} was saved with {was!r} where this "
                    f"optimizer has {now!r} (torch maps state by position): build the optimizer with the "
                    "parameters in the saved order, or remap the state in a load_state_dict pre-hook")
            group = self._complete_group({**saved, "params": current["params"]})
            try:
                self._validate_group(group, index)
            except ValueError as err:
                raise ValueError(f"{type(self).__name__}.load_state_dict: the saved {err}") from None
            for i, (saved_id, p) in enumerate(zip(saved["params"], current["params"])):
                for key, value in state_dict.get("state", {}).get(saved_id, {}).items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    name = (f"{type(self).__name__}.load_state_dict: state {key!r} of parameter "
                            f"{self._name(current, i, index)}")
                    if key in _PARAMETER_SHAPED_STATE and value.shape != p.shape:
                        raise ValueError(
                            f"{name} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}: the state was "
                            "saved for another model (or its groups in another order)")
                    # a shard is parameter-shaped state of a sharded parameter, and only that is (the
                    # whole-matrix state of a sharded one, a warm start or step count, is a plain tensor)
                    shard, wanted = _distributed.is_sharded(value), _distributed.is_sharded(p)
                    if shard and not (key in _PARAMETER_SHAPED_STATE and wanted):
                        raise ValueError(
                            f"{name} is a DTensor shard (optimizer.state_dict() of an FSDP2 run: one rank's view, "
                            "without the whole-matrix state other ranks own), the parameter "
                            f"{'a DTensor' if wanted else 'a plain tensor'}: save and load the "
                            "optimizer state of a sharded run with geomuon.pretrain.parallel.save_distributed and "
                            "load_distributed (any world size)")
                    if key in _PARAMETER_SHAPED_STATE and wanted and not shard:
                        raise ValueError(
                            f"{name} is a plain tensor, the parameter a DTensor (FSDP2-sharded): load a one-process "
                            "state before sharding (geomuon.pretrain.parallel.fsdp then shards it with the model), "
                            "or save and load with geomuon.pretrain.parallel.save_distributed and load_distributed")
                    self._check_loaded_state(group, p, key, value, self._name(current, i, index))

    def _check_loaded_state(self, group: dict, p: torch.Tensor, key: str, value: torch.Tensor, name: str) -> None:
        """Refuse (``ValueError``) the saved tensor ``value`` of state ``key`` for parameter ``p``
        (named ``name``) of the completed saved ``group``, beyond the base's checks of
        :meth:`_check_loadable` (default: nothing more to check)."""

    def _state_dtype(self, key: str, p: torch.Tensor) -> torch.dtype | None:
        """The dtype of state entry ``key`` of ``p`` where it is not ``p``'s (``None``: ``p``'s,
        as torch's ``load_state_dict`` casts it): the regulators' warm start is kept in their
        compute dtype (fp32 for bf16/fp16 weights; a bf16 copy had moved a resumed run's
        weights by 0.03)."""
        return fp32_or_fp64(p.dtype) if is_warm_start_key(key) else None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Optimizer.__getstate__ (pickle, copy.deepcopy) keeps only defaults, state and
        # param_groups; everything else is derived from them and rebuilt here.
        # A loaded group may lack keys (torch.optim.Muon's, an older version's): completed before
        # the derived state reads them (Muon's update bound had raised KeyError mid-load).
        super().__setstate__(state)
        for group in self.param_groups:
            self._complete_group(group)
        self._rebuild_derived_state()

    def _rebuild_derived_state(self) -> None:
        """Recompute attributes derived from the param groups (subclasses extend it)."""
        self._regulators = [(None, None) for _ in self.param_groups]
        for index, group in enumerate(self.param_groups):
            self._group_regulator(group, index)
        self._checked_options = [self._options_of(group) for group in self.param_groups]  # (checked on load)
        self._manifolds = {}
        # positions refer to these groups: a loaded state starts afresh
        self._skipped = _SkippedSteps(_report_nonfinite)
        self._refused = _SkippedSteps(_report_off_manifold)
        for group in self.param_groups:  # resolved now, not in a step
            if group.get("manifold") is not None:
                self._group_manifold(group).identity  # noqa: B018

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step; returns the closure's loss if given.

        No value is read back from the device (see :meth:`check_finite` for how skipped
        steps are reported), except in a sharded (``DTensor``) param group: one read of its
        finiteness flags per group and step (:meth:`_finite_on_host`; a trainable group without
        a gradient on this rank reads too, a frozen one does not), and before the first such
        read on a device mesh one of the ranks' options compared, each a host synchronisation
        on CUDA; and where a group's regulator reads one (the adaptive
        :class:`~geomuon.optimizers.regulate.HardCap`, ``levels=0``, its default, reads its norm
        bound once per call; ``levels=1`` reads nothing)."""
        self._check_edited_groups()
        return self._step_checked(closure)

    @torch.no_grad()
    def _step_checked(self, closure=None):
        """:meth:`step` once the edited groups are checked (a subclass that checks them first,
        for work of its own before the step, calls this)."""
        self._report_skips(wait=False)
        regulators = [self._group_regulator(group, index) for index, group in enumerate(self.param_groups)]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [self._params_with_grad(group) for group in self.param_groups]
        # every group checked before any group steps: a refusal (the same on every rank) leaves
        # nothing half-stepped and no rank waiting in a collective
        read = []  # per group: the DTensor parameters whose finiteness its step reads (check_group's rule)
        checks = []  # per such group: _pending_checks' answer for them, checked here (no group has stepped)
        for index, (group, (params, _)) in enumerate(zip(self.param_groups, stepped)):
            read.append(_distributed.check_group(self, group, index, params))
            checks.append(self._pending_checks(group, read[index]) if read[index] else None)
            # hooks out of contract, refused here (in the step, earlier groups had stepped): an answer
            # of the wrong length (zip would pair flags with other weights), no _add_checks (the base's
            # refusal, by name: an override takes no weight to check)
            if checks[index] is not None:
                if len(checks[index]) != len(read[index]):
                    raise ValueError(f"{type(self).__name__}._pending_checks answered {len(checks[index])} flags for "
                                     f"the {len(read[index])} sharded parameters it was given: answer one per "
                                     "parameter, in order; nothing was stepped")
                self._add_checks(group, [])
            if params and regulators[index] is not None and not isinstance(group["lr"], torch.Tensor):
                if (why := self.regulation_refusal(index, float(group["lr"]))) is not None:
                    raise ValueError(f"{type(self).__name__}: group {index}, {why}; nothing was stepped")
        for index, (group, (params, positions)) in enumerate(zip(self.param_groups, stepped)):
            if read[index]:  # collective: with or without a gradient here (check_group's rule)
                params = self._finite_on_host(group, index, params, positions, read[index], checks[index])
            if not params:
                continue
            lr = group["lr"]  # a tensor lr stays one: an operand of the update, never read back
            lr = lr.reshape(()) if isinstance(lr, torch.Tensor) else float(lr)
            keep: dict[int, torch.Tensor] = {}
            if group["update"] == "adamw":
                self._adamw(group, params, lr, self._keep(group, index, params, positions, keep))
            else:
                batches = [(batch, self._keep(group, index, batch, positions, keep))
                           for batch in self._batches(group, params)]
                self._matrix_steps(group, batches, lr)
            regulator = regulators[index]
            if regulator is not None:
                for p in params:
                    if _distributed.is_sharded(p) and group["update"] != "adamw":
                        continue  # a sharded matrix was regulated whole, on the rank that mapped it
                    whole = _distributed.whole(p)
                    kept = keep.get(id(p))
                    state = self.state[p]
                    before = dict(state) if kept is not None else None
                    out = self._regulated(group, regulator, whole, lr, state)
                    if kept is not None:
                        out = torch.where(kept, out, whole)
                        # a skipped step leaves the regulator's state too (its warm start had
                        # moved); an entry it made now has no earlier value to keep
                        for key, value in state.items():
                            old = before.get(key)
                            if value is not old and isinstance(old, torch.Tensor) and old.shape == value.shape:
                                state[key] = torch.where(kept, value, old)
                    _distributed.write_whole(p, out)
        return loss

    @torch.no_grad()
    def check_finite(self) -> dict[str, int]:
        """Report the steps skipped for non-finite gradients now (a host read: call it where
        the loss is read, e.g. at a log step, and once after training).

        :meth:`step` never waits for the device (sharded groups excepted: they read their flags
        and report in the step, see :meth:`_finite_on_host`): it records, per matrix, whether the
        gradient was finite, makes the update of a non-finite one a no-op on the device,
        and reports what has already reached the host at the start of the next
        :meth:`step` — a ``RuntimeWarning`` (``nonfinite="skip"``) or a ``ValueError``
        (``"raise"``) naming the parameters. This method reports the rest without waiting
        for a next step.

        Returns:
            ``{parameter name: steps skipped}`` newly reported by this call.

        Raises:
            ValueError: naming the parameters of ``nonfinite="raise"`` groups that skipped.
            RuntimeError: naming the sharded (``DTensor``) matrices whose owner rank failed in
                a step (see :mod:`geomuon.optimizers.distributed`), on every rank, if no
                later step has raised it yet.
        """
        _distributed.read_failures(self)
        return self._report_skips(wait=True)

    def _report_skips(self, wait: bool, nonfinite: bool = True) -> dict[str, int]:
        """Report the skipped steps that have reached the host (all of them with ``wait``):
        non-finite gradients (warn or raise, by the group's ``nonfinite``; left for later
        with ``nonfinite=False``), then matrices :meth:`_admissible` refused
        (:class:`OffManifoldError`). Returns the non-finite counts reported."""
        skipped = self._skipped.report(self, wait) if nonfinite else {}
        self._refused.report(self, wait)
        return skipped

    def _params_with_grad(self, group: dict) -> tuple[list[torch.Tensor], dict[int, int]]:
        """The group's parameters that have a gradient, and ``{id(p): position in the group}``."""
        params, positions = [], {}
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            params.append(p)
            positions[id(p)] = i
        return params, positions

    def _keep(self, group: dict, index: int, params: list[torch.Tensor], positions: dict[int, int],
              keep: dict[int, torch.Tensor]) -> torch.Tensor | None:
        r"""``[B]`` bool on the device: which of ``params`` have a finite gradient (recorded
        for the deferred report and in ``keep`` by ``id``); ``None`` for sharded parameters
        (filtered on the host already).

        One fused Frobenius-norm pass (the L2 kernel is ~5x faster than L1 on CPU). In a matrix
        group a norm that overflows counts as non-finite: every matrix update normalizes by it,
        so a finite gradient beyond the dtype's range would otherwise give a silent zero step.
        AdamW groups take their norms in fp32 (fp64 for fp64), as ``torch.optim.AdamW`` steps
        a finite fp16 gradient whose fp16 norm overflows.
        """
        if _distributed.is_sharded(params[0]):
            return None
        if group["update"] == "adamw":  # no normalization there: only a NaN or inf entry skips
            norms = [torch.linalg.vector_norm(p.grad, dtype=fp32_or_fp64(p.grad.dtype)) for p in params]
        else:
            norms = torch._foreach_norm([p.grad for p in params])
        finite = torch.stack(norms).isfinite()
        where = [positions[id(p)] for p in params]
        self._skipped.record(index, where, group["nonfinite"], finite)
        admissible = self._admissible(group, params)
        if admissible is not None:
            self._refused.record(index, where, "raise", admissible)
            finite = finite & admissible
        keep.update((id(p), k) for p, k in zip(params, finite))
        return finite

    def _admissible(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor | None:
        """``[B]`` bool on the device: which of ``params`` may step this time, besides having
        a finite gradient (``None``, the default: all). A refused matrix's step is a no-op,
        like a non-finite one's, and is reported as an :class:`OffManifoldError` (see
        :meth:`_report_skips`); no host read in one process (a sharded group's flags are read with
        its finiteness, :meth:`_finite_on_host`, after the ranks' options are compared)."""
        return None

    def _pending_checks(self, group: dict, params: list[torch.Tensor]) -> list[bool] | None:
        """For a sharded group: whether :meth:`_admissible` checks each of ``params`` (the group's
        ``DTensor`` parameters) at its next step with a gradient; ``None``, the default: the
        optimizer checks no weight. A read: the sharded finiteness read (:meth:`_finite_on_host`)
        sums these flags over the group's mesh and hands the weights that any rank checks to
        :meth:`_add_checks`, so every rank gathers the same weights to check."""
        return None

    def _add_checks(self, group: dict, params: list[torch.Tensor]) -> None:
        """Have :meth:`_admissible` check ``params`` (sharded weights of ``group``) at this step:
        the weights that some rank of the group's mesh checks (:meth:`_finite_on_host`, on every
        rank, wherever :meth:`_pending_checks` is not ``None``). An optimizer that checks weights
        overrides both (without this one, a rank had gathered a weight to check it alone)."""
        raise NotImplementedError(
            f"{type(self).__name__} overrides _pending_checks (it checks weights) but not _add_checks: define "
            "_add_checks(group, params) to check those weights at this step too (every rank of the mesh checks "
            "the weights that any rank checks)")

    def _finite_on_host(self, group: dict, index: int, params: list[torch.Tensor], positions: dict[int, int],
                        tracked: list[torch.Tensor], checks: list[bool] | None) -> list[torch.Tensor]:
        r"""Sharded parameters: the non-finite check, read back to the host now (the sharded step
        has no device-side skip: the host reads of a step, see :meth:`step`), so every rank
        drops the same matrices. ``params``: the group's parameters with a gradient on this rank
        (possibly none); ``tracked``: all its ``DTensor`` parameters, where
        :func:`~geomuon.optimizers.distributed.check_group` says the group is read (every rank of
        the group's mesh calls this for every group with a trainable ``DTensor`` parameter,
        gradients or not); ``checks``: :meth:`_pending_checks` of ``tracked``, one flag per
        parameter (its length refused by :meth:`step` before any group stepped), or ``None``.

        One all-reduce (sum) over the mesh of a fixed-length vector, the same length on every
        rank whichever gradients exist: for each sharded parameter $p_j$ of the group
        (in the group's order), this rank's share $s_{j,r}$ of $\|G_j\|_F^2$ and a presence
        flag $h_{j,r} \in \{0, 1\}$ (1: ``p.grad`` exists here; a missing gradient shares 0).
        Summed, $\|G_j\|_F = (\sum_r s_{j,r})^{1/2}$ and $c_j = \sum_r h_{j,r}$; a parameter with
        $0 < c_j < $ the mesh's size has a gradient on some ranks only, and every rank raises
        the same ``ValueError`` naming it (its step would wait in collectives the other ranks
        never enter; a hang until the process group's timeout before). $s_{j,r}$ is the squared
        norm of the rank's piece of ``torch.linalg.vector_norm(p.grad)`` (a DTensor: partial
        over the mesh dimensions the gradient is sharded on, divided by the size of each one
        it is replicated on, so the sum over all ranks counts it once), formed in fp32 (fp64
        for fp64), as the one-process ``_foreach_norm`` accumulates it; a matrix group then
        rounds the norm to the gradient's dtype (:meth:`_keep`'s test: a norm beyond the
        dtype's range skips). Combined in fp16, the squares of a finite gradient's shard norms
        had overflowed (two shards of 6000 I_64, norm 48000: inf). The same read carries the
        failure flags of earlier sharded steps on the group's mesh
        (:func:`~geomuon.optimizers.distributed.read_failures`, which raises for them), and two
        more 0/1 entries per parameter for host state that a rank may hold alone while the
        ranks' options agree (a ``load_state_dict`` on some ranks only, say):
        whether the rank holds its whole-matrix replica
        (:func:`~geomuon.optimizers.distributed.holds_replica`; held on some ranks only, every rank
        drops it), and, where the optimizer checks weights (:meth:`_pending_checks`), whether the
        rank checks it at this step (some rank does: every rank does, :meth:`_add_checks`). A rank
        that gathered a weight to check it alone, or sent its momentum against a replica where
        another sent the weights, had left the others in another collective.

        Before that all-reduce, whose length is fixed by ``tracked`` and by whether the optimizer
        checks weights, the first sharded
        group of the step on its mesh compares the options and parameters of the mesh's groups
        across its ranks (:func:`~geomuon.optimizers.distributed.compare_options`: one all-reduce
        of 2 int64 and a host read of its own): a rank whose group listed a parameter more had
        sent a longer vector into it, and gloo had aborted the processes; now every rank raises
        ``ValueError`` naming the group and its parameters on each rank."""
        mesh = tracked[0].device_mesh
        dtensor = _distributed._dtensor_module()
        # each gradient's norm in its own wide dtype (a missing one's: its parameter's), as _keep
        # takes it; the all-reduce in the parameters' widest, the same on every rank whichever
        # gradients exist (a gradient's dtype may differ from its parameter's: grad_dtype)
        dtypes = [(p if p.grad is None else p.grad).dtype for p in tracked]
        # float64 whatever the dtypes: the same on every rank, and no finite gradient's square overflows it
        # (in a float32 reduction an fp64 gradient of norm 1e20 had become inf and been skipped)
        reduced = torch.float64
        zero = torch.zeros((), dtype=reduced, device=tracked[0].to_local().device)
        one = torch.ones_like(zero)
        # host state a rank may hold alone (a load_state_dict on some ranks only, say), as
        # 0/1 entries summed with the norms: every rank then gathers and sends the same (the
        # lengths are the same on every rank: the class and group["update"] were compared)
        held = [one if _distributed.holds_replica(self, p) else zero for p in tracked]
        pending = [] if checks is None else [one if checked else zero for checked in checks]
        shares, present = [], []
        for p, dtype in zip(tracked, dtypes):
            if p.grad is None:
                shares.append(zero)
                present.append(zero)
                continue
            norm = torch.linalg.vector_norm(p.grad, dtype=fp32_or_fp64(dtype))
            share = norm.to_local().square()  # squared in the norm's dtype, as DTensor's own reduction
            for dim, placement in enumerate(norm.placements):
                if placement.is_replicate():
                    share = share / mesh.size(dim)
            shares.append(share.to(reduced))
            present.append(one)
        _distributed.compare_options(self, mesh, zero.device)  # (the norms above are queued first)
        summed = dtensor.DTensor.from_local(torch.stack(shares + present + held + pending), mesh,
                                            [dtensor.Partial("sum")] * mesh.ndim, run_check=False).full_tensor()
        k = len(tracked)
        # the sum rounded to the norm's dtype before the root: beyond its range it is inf there
        norms = [square.to(fp32_or_fp64(dtype)).sqrt() for square, dtype in zip(summed[:k], dtypes)]
        if group["update"] != "adamw":  # AdamW does not normalize: only a NaN or inf entry skips
            norms = [n.to(dtype) for n, dtype in zip(norms, dtypes)]
        finite = torch.stack([n.isfinite() for n in norms]).to(reduced)
        host = _distributed.read_failures(self, torch.cat([finite, summed[k:]]), mesh)
        finite, counts, held, pending = host[:k], host[k:2 * k], host[2 * k:3 * k], host[3 * k:]
        for p, count in zip(tracked, held):
            if 0 < count < mesh.size():  # a replica some ranks hold: every rank sends the weights
                _distributed.forget_replica(self, p)
        if checks is not None:  # a check some rank wants: every rank makes it
            self._add_checks(group, [p for p, count in zip(tracked, pending) if count])
        position = {id(p): i for i, p in enumerate(group["params"])}
        partial = [f"{self._name(group, position[id(p)], index)} (on {int(count)} of {mesh.size()} ranks)"
                   for p, count in zip(tracked, counts) if 0 < count < mesh.size()]
        if partial:
            raise ValueError(
                f"{type(self).__name__}: group {index}, parameter(s) {', '.join(partial)} have a gradient on "
                "some ranks only (p.grad is None on the others); a sharded step is collective, so every rank "
                "needs the same parameters' gradients: set the gradient on every rank (zeros where a rank has "
                "none) or set it to None on every rank; this group and the groups after it were not stepped")
        finite_of = {id(p): ok for p, ok in zip(tracked, finite)}
        kept = [p for p in params if finite_of[id(p)]]
        if len(kept) < len(params):
            bad = {self._name(group, positions[id(p)], index): 1 for p in params if not finite_of[id(p)]}
            _report_nonfinite(self, group["nonfinite"], bad, stacklevel=4)
        # then the optimizer's own check (_admissible; ManifoldMuon: on its manifold), after the
        # comparison: a rank whose group listed a parameter more had gathered it to check while the
        # others compared their options (gloo: a timeout on one rank, a closed connection on the
        # other). Its [B] flags are read to the host here (the sharded step has no device-side
        # skip); a matrix that fails is left out and recorded as _keep records it in one process.
        admissible = self._admissible(group, kept)
        if admissible is None:
            return kept
        on = admissible.cpu()
        self._refused.record(index, [positions[id(p)] for p in kept], "raise", on)
        return [p for p, ok in zip(kept, on.tolist()) if ok]

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

    def _matrix_steps(self, group: dict, batches: list[tuple[list[torch.Tensor], torch.Tensor | None]],
                      lr: float | torch.Tensor) -> None:
        """:meth:`_matrix_step` of every ``(batch, keep)``, on a CPU each batch cut into stacks
        of :attr:`cpu_stack_size` (where set) or, with :attr:`parallel_batches` and $k > 1$
        threads, into up to $k$ parts; the parts run one after the other, or with
        :attr:`parallel_batches` on a CPU with $k > 1$ threads by
        :func:`~geomuon.manifolds.linalg.in_one_thread_workers` (sharded parameters step in
        order, whole: their steps communicate)."""
        threads = torch.get_num_threads()
        on_cpu = all(p.device.type == "cpu" and not _distributed.is_sharded(p) for batch, _ in batches for p in batch)
        parallel = self.parallel_batches and threads > 1 and on_cpu
        calls = []
        for batch, keep in batches:
            if on_cpu and self.cpu_stack_size:
                parts = -(-len(batch) // self.cpu_stack_size)
            elif parallel:
                parts = min(threads, len(batch))
            else:
                parts = 1
            bounds = [len(batch) * i // parts for i in range(parts + 1)]
            for start, stop in zip(bounds, bounds[1:]):
                calls.append(partial(self._matrix_step, group, batch[start:stop], lr,
                                     None if keep is None else keep[start:stop]))
        if parallel:
            in_one_thread_workers(calls)
        else:
            for call in calls:
                call()

    def _scratch(self) -> ScratchBuffers:
        """The calling thread's reused temporaries (steps run in worker threads with
        :attr:`parallel_batches`), freed with the thread; made on first use, so a loaded or
        copied optimizer starts without them."""
        local = self.__dict__.setdefault("_scratch_local", threading.local())
        if not hasattr(local, "buffers"):
            local.buffers = ScratchBuffers()
        return local.buffers

    def _temporary(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a temporary of the step: on a CPU the thread's :meth:`_scratch` buffer
        (fresh memory costs page faults there, see :class:`~geomuon.manifolds.linalg.ScratchBuffers`),
        elsewhere a fresh tensor (a caching allocator reuses it, and a buffer kept between
        steps would hold accelerator memory the forward pass needs). A CPU thread so keeps a
        few matrices per shape between steps (Muon at the 6 x 384 GPT set: 18.6 MiB per
        thread beside 40.5 MiB of weights; the same per thread for a deeper stack of those
        shapes)."""
        if device.type == "cpu":
            return self._scratch()(role, shape, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device)

    def _stack_dtype(self, group: dict, p: torch.Tensor) -> torch.dtype:
        """Dtype of the stacked momentum handed to :meth:`_direction` (default: ``p``'s)."""
        return p.dtype

    def _matrix_step(self, group: dict, params: list[torch.Tensor], lr: float,
                     keep: torch.Tensor | None = None) -> None:
        r"""Momentum, the stacked map and the update of one same-shape batch.

        ``keep`` (``[B]`` bool on the device, ``None``: all) makes a skipped matrix's step a
        no-op without reading it back: its gradient enters with its non-finite entries set
        to 0 (``nan_to_num``: a finite gradient is unchanged) and momentum weight 0, so
        $B + 0\cdot(G' - B) = B$ exactly, and its stacked momentum is multiplied by 0. Masks
        are multiplications, passes as cheap as a copy (``torch.where`` with a broadcast
        0-dim condition is ~20x slower on CPU). Cost of the mask: ``nan_to_num`` (one read,
        one write of the gradient) and the multiplication by the 0/1, written into the stack (the
        copy into it is that pass): computed in the momentum's dtype, then rounded to the
        stack's. Rounded first, a skipped matrix's finite fp32 momentum above bf16's range
        (3.39e38) had become inf, and $0\cdot\infty$ = NaN reached the weights.
        """
        if _distributed.is_sharded(params[0]):  # FSDP2 / DTensor: whole matrices, sharded by matrix
            return _distributed.sharded_matrix_step(self, group, params, lr)
        momentum = group["momentum"]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        shape = self._matrix_shape(group, params[0])
        stack_shape, dtype, device = (len(params), *shape), self._stack_dtype(group, params[0]), params[0].device
        # reused memory where a CPU stack is bounded (cpu_stack_size); a whole batch's would
        # keep a copy of the group's weights between steps
        if self.cpu_stack_size:
            stacked = self._temporary("stack", stack_shape, dtype, device)
        else:
            stacked = torch.empty(stack_shape, dtype=dtype, device=device)
        if keep is None:
            grads = [p.grad for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            for out, g, b in zip(stacked, grads, bufs):
                if group["nesterov"]:
                    torch.lerp(g.reshape(shape), b.reshape(shape), momentum, out=out)
                else:
                    out.copy_(b.reshape(shape))
        else:
            grad = params[0].grad  # one sanitized copy at a time, in one buffer (a batch shares shape and dtype)
            clean = self._temporary("gradient", grad.shape, grad.dtype, grad.device)
            for out, p, b, k in zip(stacked, params, bufs, keep.to(bufs[0].dtype)):
                g = torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0, out=clean)
                _lerp_kept_(b, g, 1 - momentum, k)
                # the Nesterov lerp in place (a mixed-dtype lerp is ~2x slower); a skipped matrix's
                # momentum is exactly zero (G' and B are finite): times its 0/1 before any rounding
                torch.mul((g.lerp_(b, momentum) if group["nesterov"] else b).reshape(shape), k, out=out)
        update = self._direction(group, stacked, params, keep)
        self._apply(group, params, update, lr, keep)

    def _direction(self, group: dict, M: torch.Tensor, params: list[torch.Tensor],
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        """Map the stacked momentum ``M: [B, *matrix_shape]`` to the update ``[B, ...]``;
        ``keep`` as in :meth:`_matrix_step` (``[B]`` bool on the device, ``None``: all).

        ``M`` is a temporary of the step (:meth:`_temporary`: on a CPU, memory the next matrix
        reuses): read it during the call, keep nothing that aliases it.

        A matrix whose step is skipped arrives as an exact zero and must leave as one (every
        map of :mod:`geomuon.optimizers.maps` does: ``msign(0) = 0``, ``row_norm(0) = 0``, ...;
        the non-finite test of every optimizer checks it); a subclass whose update is not
        additive keeps a skipped matrix's old point in its :meth:`_apply` (:class:`ManifoldMuon`).
        A zero momentum with ``keep`` true is a step like any other (weight decay still applies)."""
        raise NotImplementedError

    def _rowwise_direction(self, group: dict) -> bool:
        """Whether :meth:`_direction` maps every row (and batch entry) on its own, so a
        shard of rows can be mapped where it lives (default ``False``)."""
        return False

    def _lr_scale(self, group: dict, shape: tuple[int, ...]) -> float:
        """Shape-dependent factor on ``lr`` for the update (1 unless a subclass says)."""
        return 1.0

    def _apply(self, group: dict, params: list[torch.Tensor], update, lr: float,
               keep: torch.Tensor | None = None) -> None:
        r"""$W \leftarrow (1 - \eta\lambda)W - \eta\,s(\text{shape})\,U$ (decoupled decay); a
        matrix with ``keep`` false is not decayed (a factor 1 on the device) and its $U$ is 0.
        The decay factor $1 - \eta\lambda$ multiplies in fp32 (fp64 for fp64), with or without
        ``keep`` (:func:`_scale_`), so sharded and one-process steps decay alike."""
        weight_decay = group["weight_decay"]
        scale = self._lr_scale(group, self._matrix_shape(group, params[0])[-2:])
        updates = [u.reshape(p.shape) for u, p in zip(update, params)]
        if weight_decay != 0:  # one formula for both paths (on fp16 DTensors, _foreach_mul_ had landed 1 ulp off)
            decay = 1 - lr * weight_decay
            factors = [decay] * len(params) if keep is None else _where_kept(keep.to(fp32_or_fp64(params[0].dtype)), decay)
            for p, factor in zip(params, factors):
                _scale_(p, factor)
        # a skipped matrix's update is already 0 (its momentum was, and every map sends 0 to 0)
        if isinstance(lr, torch.Tensor):  # addcmul computes in the parameter's dtype (U may be bf16)
            for p, u in zip(params, updates):
                p.addcmul_(u, -lr * scale)
        else:
            torch._foreach_add_(params, updates, alpha=-lr * scale)

    # ------------------------------------------------------------------ AdamW path
    def _adamw(self, group: dict, params: list[torch.Tensor], lr: float, keep: torch.Tensor | None) -> None:
        r"""``torch.optim.AdamW``'s update; with ``keep`` false a parameter's step, moments
        and step count stay as they were (masked on the device, bias corrections from the
        step count tensor, so nothing is read back)."""
        beta1, beta2 = group["betas"]
        for i, p in enumerate(params):
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if state["step"].device != p.device:  # a checkpoint written with a CPU step count
                state["step"] = state["step"].to(p.device)
            kept = torch.ones((), dtype=p.dtype, device=p.device) if keep is None else keep[i].to(p.dtype)
            g = p.grad if keep is None else torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0).mul_(kept)
            step = state["step"].add_(kept)
            wide = None if keep is None else keep[i].to(fp32_or_fp64(p.dtype))  # the factors' 0/1, in fp32

            def factor(value):  # value where kept, 1 where not
                return value if wide is None else _where_kept(wide, value)

            if group["weight_decay"] != 0:
                _scale_(p, factor(1 - lr * group["weight_decay"]))
            _lerp_kept_(state["exp_avg"], g, 1 - beta1, kept)
            _scale_(state["exp_avg_sq"], factor(beta2)).addcmul_(g, g, value=1 - beta2)
            counted = step.clamp_min(1)  # a first step that is skipped divides by 1 - beta^1
            bias1, bias2 = _bias_correction(beta1, counted, p.dtype), _bias_correction(beta2, counted, p.dtype)
            bias2_sqrt = bias2.sqrt()
            # fp16's smallest subnormal (6e-8) is above the default eps: its denominator in fp16
            # is 0 wherever the second moment is, and 0/0 had written NaN into the weights
            second = state["exp_avg_sq"].float() if p.dtype == torch.float16 else state["exp_avg_sq"]
            denom = (second.sqrt() / bias2_sqrt).add_(group["eps"])
            if keep is not None and group["eps"] == 0:  # a skipped entry's 0 / 0 -> 0 / 1
                denom.add_(1 - kept)
            p.addcdiv_(state["exp_avg"] * (-lr * kept / bias1), denom)

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
            OffManifoldError: (a ``ValueError``) naming them, when ``raise_error`` and the list
                is not empty.
        """
        failures = []
        for index, group in enumerate(self.param_groups):
            if group["update"] == "adamw":
                continue
            for i, p in enumerate(group["params"]):
                manifold = self._manifold_of(group, p)
                if manifold is None:
                    continue
                matrix, tol = self._checked_point(group, p, atol)
                ok, reason = manifold.check_point_on_manifold(matrix, explain=True, atol=tol, rtol=rtol)
                if not ok:
                    failures.append((self._name(group, i, index), reason))
        if failures and raise_error:
            listing = "; ".join(f"{name}: {reason}" for name, reason in failures)
            raise OffManifoldError(
                f"{type(self).__name__}: parameter(s) off their manifold — {listing}. Project them "
                "back with p.copy_(manifold.projx(p)) (or optimizer.project_to_manifolds())"
            )
        return failures

    @staticmethod
    def _checked_point(group: dict, p: torch.Tensor, atol: float) -> tuple[torch.Tensor, float]:
        r"""The matrix view of ``p`` as checked, in float32 (float64 for float64), and the
        absolute tolerance $\max(\text{atol}, 16\varepsilon)$ of ``p``'s dtype."""
        x = _distributed.whole(p.detach()).to(fp32_or_fp64(p.dtype))
        view = x.reshape(x.shape[0], -1) if group["matrix_view"] == "flatten" else x
        return view, max(atol, 16 * torch.finfo(p.dtype).eps)

    @torch.no_grad()
    def project_to_manifolds(self) -> None:
        """Move every constrained parameter onto its manifold (``projx`` in float32). A sharded
        (``DTensor``) parameter is gathered, projected whole on every rank and keeps its rows;
        its next step costs no skipped step (the owner's replica is dropped: its weights travel
        once, as in a first step)."""
        for group in self.param_groups:
            if group["update"] == "adamw":
                continue
            for p in group["params"]:
                manifold = self._manifold_of(group, p)
                if manifold is not None:
                    x = _distributed.whole(p.detach()).to(fp32_or_fp64(p.dtype))
                    view = x.reshape(x.shape[0], -1) if group["matrix_view"] == "flatten" else x
                    _distributed.write_whole(p, manifold.projx(view).reshape(p.shape).to(p.dtype))
                    _distributed.forget_replica(self, p)


def require_number(index: int, name: str, value, admissible, what: str) -> None:
    """Refuse, at construction, option ``name`` of param group ``index`` whose ``value`` is not
    a finite number with ``admissible(value)`` (NaN and infinities are never admissible: they
    reach the weights as NaN, or as a silent no-op step); the message names the group, the
    option and ``what`` it must be."""
    if isinstance(value, torch.Tensor):  # its value, detached (float() of a requires_grad tensor warns)
        value = value.detach()
    try:  # (a 1-element tensor lr is a number; a bool or a string is not, though float() takes them)
        number = math.nan if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, RuntimeError):
        number = math.nan
    if not (math.isfinite(number) and admissible(number)):
        raise ValueError(f"group {index}: {name} must be {what}, got {value!r}")


def _lerp_kept_(average: torch.Tensor, end: torch.Tensor, weight: float, kept: torch.Tensor) -> torch.Tensor:
    r"""``average`` $\leftarrow$ ``lerp(average, end, weight)`` in place where ``kept`` (a 0-dim 0/1 of
    ``average``'s dtype), else unchanged, with no host read. fp32 and fp64 take the weight
    ``kept * weight``; a lower precision would round that tensor weight to its own dtype (in
    bf16 1 - 0.95 = 0.05 became 0.05005, where torch's float weight is not rounded), so there
    the weight stays a float and the end point becomes ``average`` itself where not kept (a 0/1
    lerp, exact; ``end`` is not written)."""
    if average.dtype in (torch.float32, torch.float64):
        return average.lerp_(end, kept * weight)
    return average.lerp_(end.lerp(average, 1 - kept), weight)


def _bias_correction(beta: float, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r"""Adam's $1 - \beta^t$ from the step count tensor (no host read), as
    $-\operatorname{expm1}(t\ln\beta)$ in the parameter's precision (fp32 for bf16/fp16): in
    fp32, $1 - \beta^t$ itself cancels ($1 - 0.999$ kept 5 digits, an update 7e-6 off
    ``torch.optim.AdamW``'s, which computes it on the host in float64)."""
    log_beta = math.log(beta) if beta > 0 else -math.inf  # beta = 0: 1 - 0^t = 1 for t >= 1
    return -torch.expm1(step.to(fp32_or_fp64(dtype)) * log_beta)


def _scale_(tensor: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    r"""``tensor`` $\leftarrow c\,$``tensor`` in place, $c$ = ``factor`` (a float, or a 0-dim
    tensor: a factor per matrix on the device, :func:`_where_kept`), with no host read: the
    product formed in fp32 (fp64 for fp64) and rounded once to ``tensor``'s dtype, as
    ``tensor.mul_(float)`` forms it. A factor near 1 must not be rounded to a bf16/fp16 tensor
    first: in bf16 $1 - 0.02\cdot 0.1 = 0.998$ is $0.99609375$ (a decay 2x too strong) and
    AdamW's $\beta_2 = 0.999$ is $1$ (a second moment that never decays). A ``DTensor`` is
    scaled on its local shard (elementwise)."""
    if _distributed.is_sharded(tensor):
        _scale_(tensor.to_local(), factor)
        return tensor
    wide = fp32_or_fp64(tensor.dtype)
    if tensor.dtype == wide or not isinstance(factor, torch.Tensor):
        return tensor.mul_(factor)
    return tensor.copy_(tensor.to(wide).mul_(factor.to(wide)))


def _where_kept(kept: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` where ``kept`` is 1 and 1 where it is 0, exactly (``kept`` holds 0s and 1s):
    a factor that leaves a skipped matrix as it was and rounds like ``value`` itself."""
    return kept * value + (1 - kept)


class OffManifoldError(ValueError):
    """A matrix optimizer refused to step parameters that are off their manifold (a
    ``ValueError``): raised by ManifoldMuon's first step and by ``check_on_manifold``, naming
    the parameters; their step was skipped, weights and state unchanged. Project them back
    with ``p.copy_(manifold.projx(p))`` and step again."""


def _report_off_manifold(optimizer, mode: str, refused: dict[str, int], stacklevel: int) -> None:
    """Raise :class:`OffManifoldError` naming the parameters in ``refused`` (``{name: steps}``)."""
    raise OffManifoldError(
        f"{type(optimizer).__name__}: parameter(s) off their manifold — {', '.join(refused)}; their step was "
        "skipped, weights and state unchanged. Project them back with p.copy_(manifold.projx(p)) (or "
        "optimizer.project_to_manifolds()); optimizer.check_on_manifold() says what is wrong"
    )


def _report_nonfinite(optimizer, mode: str, skipped: dict[str, int], stacklevel: int) -> None:
    """Warn (``mode="skip"``) or raise (``"raise"``) naming the parameters in ``skipped``
    (``{name: steps skipped}``)."""
    listing = ", ".join(f"{name} ({count} step{'s' if count > 1 else ''})" for name, count in skipped.items())
    message = (
        f"{type(optimizer).__name__}: non-finite gradient (or one whose Frobenius norm overflows its dtype: "
        f"scale the loss down) in parameter(s) {listing}; their step was skipped, weights and state unchanged"
    )
    if mode == "raise":
        raise ValueError(message + " (nonfinite='raise')")
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


class _SkippedSteps:
    r"""Counts, per matrix, of the steps skipped for one reason (a non-finite gradient, a
    point off its manifold), reported without a host sync in the step by ``report``
    (``report(optimizer, mode, {name: new count}, stacklevel)``, which warns or raises).

    Every step adds, on the device, ``counts += ~ok`` for each same-shape batch; on CUDA
    it then copies the counts to pinned host memory without blocking and records an event.
    :meth:`report` with ``wait=False`` (the start of the next step) reports only counts that
    are already on the host — on CPU the counts are host memory, on CUDA the copy whose
    event has completed (``Event.query`` does not wait) — and reads them through NumPy, a
    host-memory view, never a device read; ``wait=True`` (:meth:`MatrixOptimizer.check_finite`)
    reads the device counts now.
    """

    def __init__(self, report) -> None:
        self._entries: dict[tuple, dict] = {}
        self._report = report

    def record(self, group_index: int, positions: list[int], mode: str, ok: torch.Tensor) -> None:
        """Count a skipped step for every matrix whose ``ok`` (``[B]`` bool) is false."""
        key = (group_index, tuple(positions))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = dict(
                group=group_index, positions=positions, mode=mode, reported=[0] * len(positions),
                counts=torch.zeros(len(positions), dtype=torch.int64, device=ok.device),
                host=None, event=None,
            )
        entry["mode"] = mode
        entry["counts"] += ~ok
        if ok.device.type == "cuda":
            if entry["host"] is None:
                entry["host"] = torch.zeros(len(positions), dtype=torch.int64, pin_memory=True)
            entry["host"].copy_(entry["counts"], non_blocking=True)
            entry["event"] = torch.cuda.Event()
            entry["event"].record(torch.cuda.current_stream(ok.device))  # the copy's stream, whatever device is current

    def report(self, optimizer, wait: bool) -> dict[str, int]:
        news: dict[str, dict[str, int]] = {}
        for entry in self._entries.values():
            if wait:
                counts = entry["counts"].tolist()
            elif entry["host"] is None:
                counts = entry["counts"].numpy().tolist()  # CPU: host memory, no device read
            elif entry["event"] is not None and entry["event"].query():
                counts = entry["host"].numpy().tolist()  # the completed pinned copy
            else:
                continue
            group = optimizer.param_groups[entry["group"]]
            for j, (count, seen) in enumerate(zip(counts, entry["reported"])):
                if count > seen:
                    name = optimizer._name(group, entry["positions"][j], entry["group"])
                    news.setdefault(entry["mode"], {})[name] = count - seen
                    entry["reported"][j] = count
        for mode in ("skip", "raise"):
            if mode in news:
                self._report(optimizer, mode, news[mode], stacklevel=4)
        return {name: count for listing in news.values() for name, count in listing.items()}
