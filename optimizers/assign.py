r"""Per-module assignment: which geometry and update each weight of a model gets.

Two steps, kept apart so each can be checked on its own:

1. :func:`classify` reads the *role* of every parameter from the module tree. A module
   declares its weights' roles in a ``ROLES = {child attribute: role}`` mapping (as
   ``geomuon.pretrain.model`` does); undeclared ``nn.Embedding`` are embeddings, 1-D tensors are
   vectors, and a short table of conventional child names (``q_proj``, ``gate_proj``,
   ``c_fc``, …, read together with the parent's name) covers foreign models. A weight
   that none of these places is an error, never a silent default; ``roles={name: role}``
   overrides.
2. :func:`assign` applies a *strategy* — a map from role to :class:`Rule`, given by its
   name in :data:`STRATEGIES` or as the mapping itself — and builds the optimizers, one
   per update family, with one param group per (rule, manifold). Weights assigned a
   manifold start on it (a random semi-orthogonal point).

Strategies (the docs' concept pages on manifolds and symmetry explain them):
``adamw`` (baseline), ``unconstrained`` (Muon on hidden matrices), ``torch_muon`` (PyTorch's
own ``torch.optim.Muon`` on hidden matrices, a peer implementation to hold ours against:
docs.pytorch.org/docs/stable/generated/torch.optim.Muon.html); the family of the
module-wise Manifold Muon study (github.com/kiratoyoshihara/module-wise-manifold-muon)
``all_stiefel``, ``all_dgram``, ``hetero`` (Stiefel attention, DGram MLP), ``hetero_inv``;
``symmetry`` (Lau & Su, arXiv:2605.18106: spectral attention, hybrid row-aware MLP input,
right-polar MLP output, row-norm embedding, centered hybrid head, centered left-polar
router) and ``lipschitz`` (Newhouse et al. 2025, arXiv:2507.13338: Muon plus the spectral
soft cap after every step). Everything a strategy does not name goes to AdamW. A
strategy of one's own is a ``{role: Rule}`` mapping passed to :func:`assign` directly
(or registered in :data:`STRATEGIES` to be named on the command line).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from geomuon.manifolds import MatrixManifold

from .manifold_muon import ManifoldMuon
from .base import MatrixOptimizer
from .muon import Muon
from .polar import HybridPolarGradM, LeftPolarGradM, RightPolarGradM, RowNormM
from .regulate import REGULATORS, make_regulator

ATTENTION_ROLES = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_o")
MLP_ROLES = ("mlp_in", "mlp_out", "mlp_gate", "mlp_up", "mlp_down")
ROLES = ATTENTION_ROLES + MLP_ROLES + ("embedding", "lm_head", "router", "vector")

# Conventional child names of foreign models: (child name, parent-name hint or None, role).
_CONVENTIONAL_NAMES = (
    ("q_proj", None, "attn_q"),
    ("k_proj", None, "attn_k"),
    ("v_proj", None, "attn_v"),
    ("o_proj", None, "attn_o"),
    ("out_proj", "attn", "attn_o"),
    ("qkv", None, "attn_qkv"),
    ("c_attn", None, "attn_qkv"),
    ("c_proj", "attn", "attn_o"),
    ("c_proj", "mlp", "mlp_out"),
    ("c_fc", None, "mlp_in"),
    ("fc1", None, "mlp_in"),
    ("fc2", None, "mlp_out"),
    ("gate_proj", None, "mlp_gate"),
    ("up_proj", None, "mlp_up"),
    ("down_proj", None, "mlp_down"),
    ("router", None, "router"),
    ("lm_head", None, "lm_head"),
)


def classify(model: nn.Module, roles: dict[str, str] | None = None) -> dict[str, str]:
    """``{parameter name: role}`` for every trainable parameter of ``model`` (tied tensors
    once, under their first name, as ``named_parameters`` lists them; frozen ones,
    ``requires_grad=False``, are not trained and get no role).

    A role comes from ``roles``, else from a module's ``ROLES`` declaration, else from the
    conventional names. A tensor shared by modules that declare different roles takes the
    first declaration in ``named_modules`` order (a tied GPT's ``wte``, declared as the
    embedding before ``lm_head``); name it in ``roles`` to choose another.

    Raises:
        ValueError: a role in ``roles`` is not one of :data:`ROLES`, a name in ``roles``
            is not a parameter (or is frozen, or a tied alias), a module's ``ROLES`` names
            no attribute or one that holds no weight, or a matrix parameter has no role.
    """
    roles = dict(roles or {})
    every = dict(model.named_parameters())
    names = {name: p for name, p in every.items() if p.requires_grad}
    for name, role in roles.items():
        if role not in ROLES:
            raise ValueError(f"roles[{name!r}] = {role!r} is not a role; use one of {ROLES}")
        if name not in every:
            aliases = {alias: first for alias, first in _aliases(model).items() if alias != first}
            if name in aliases:  # a tied weight is listed under its first name
                raise ValueError(f"roles names {name!r}, which is tied to {aliases[name]!r}: name the role there")
            raise ValueError(f"roles names {name!r}, which is not a parameter of the model")
        if name not in names:  # its role had been dropped without a word
            raise ValueError(f"roles names {name!r}, which is frozen (requires_grad=False) and is not optimized: "
                             "leave it out of roles, or unfreeze it first")
    declared: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for child_name, role in getattr(module, "ROLES", {}).items():
            if role not in ROLES:
                raise ValueError(f"{type(module).__name__}.ROLES[{child_name!r}] = {role!r} is not a role")
            child = getattr(module, child_name, None)
            # a submodule's weight, or a parameter of the module itself (stacked expert weights);
            # None is an optional part the module does not have (a position table)
            weight = child if isinstance(child, nn.Parameter) else getattr(child, "weight", None)
            if isinstance(weight, torch.Tensor):
                declared.setdefault(id(weight), role)
            elif not hasattr(module, child_name):
                raise ValueError(f"{type(module).__name__}.ROLES names {child_name!r}, which is no attribute of "
                                 f"{module_name or 'the model'}")
            elif child is not None:
                # a declaration that reaches no weight (a ModuleList of experts, a float) had been
                # dropped, and the weights it meant were then said to have no declared role
                raise ValueError(f"{type(module).__name__}.ROLES[{child_name!r}] names a {type(child).__name__} "
                                 f"of {module_name or 'the model'}, which has no weight: declare the role in the "
                                 "module that holds the weight, or pass roles={parameter name: role}")
    out = {}
    for name, p in names.items():
        role = roles.get(name) or declared.get(id(p))
        if role is None and p.dim() < 2:
            role = "vector"
        if role is None:
            role = _structural_role(model, name)
        if role is None:
            raise ValueError(
                f"cannot tell the role of parameter {name!r} (shape {tuple(p.shape)}): its module "
                f"declares no ROLES and its name is not a conventional one; pass "
                f"roles={{{name!r}: ROLE}} with ROLE in {ROLES}"
            )
        out[name] = role
    return out


def _structural_role(model: nn.Module, name: str) -> str | None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if isinstance(module, nn.Embedding):
        return "embedding"
    parent_path, _, child = module_path.rpartition(".")
    # the nearest ancestor named for a hint decides: "attn_blocks.0.mlp.c_proj" is an MLP output
    # (a hint anywhere in the path had made it an attention output)
    hints = {hint for conventional, hint, _ in _CONVENTIONAL_NAMES if conventional == child and hint}
    nearest = next((ancestor for ancestor in reversed(parent_path.lower().split("."))
                    if any(hint in ancestor for hint in hints)), "")
    for conventional, parent_hint, role in _CONVENTIONAL_NAMES:
        if child == conventional and (parent_hint is None or parent_hint in nearest):
            return role
    return None


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """How one role is optimised: an update family, an optional manifold, a regulator."""

    update: str  # "adamw", "muon", "torch_muon", "manifold_muon", "row_norm", "right_polar", "left_polar", "hybrid"
    manifold: str | None = None  # a registered manifold name, e.g. "stiefel" (ManifoldMuon only)
    centered: bool = False
    regulate: str | None = None  # a regulator name (REGULATORS), built by rule_regulator

    def describe(self) -> str:
        text = self.update
        if self.manifold:
            text += f"[{self.manifold}]"
        if self.centered:
            text = "centered " + text
        if self.regulate:
            text += f" + {self.regulate}"
        return text


ADAMW = Rule("adamw")


def rule_for(table: dict[str, Rule], role: str) -> Rule:
    """The rule a strategy ``table`` gives a parameter of ``role``: every vector, and every role
    the table leaves out, is AdamW's."""
    return table.get(role, ADAMW) if role != "vector" else ADAMW


def _seed000(attention: Rule, mlp: Rule) -> dict[str, Rule]:
    return {**{r: attention for r in ATTENTION_ROLES}, **{r: mlp for r in MLP_ROLES}}


_STIEFEL = Rule("manifold_muon", "stiefel")
_DGRAM = Rule("manifold_muon", "dgram")
_MUON = Rule("muon")
_TORCH_MUON = Rule("torch_muon")
_CAPPED = Rule("muon", regulate="soft_cap")

#: strategy name → {role: rule}; roles not listed use AdamW.
STRATEGIES: dict[str, dict[str, Rule]] = {
    "adamw": {},
    "unconstrained": _seed000(_MUON, _MUON),
    "torch_muon": _seed000(_TORCH_MUON, _TORCH_MUON),
    "all_stiefel": _seed000(_STIEFEL, _STIEFEL),
    "all_dgram": _seed000(_DGRAM, _DGRAM),
    "hetero": _seed000(_STIEFEL, _DGRAM),
    "hetero_inv": _seed000(_DGRAM, _STIEFEL),
    "symmetry": {
        **{r: _MUON for r in ATTENTION_ROLES},
        # Hidden neurons are the rows of the input/gate/up matrices (permutation-equivariant
        # row-aware update) and the columns of the output matrix (O_m × O_n-equivariant
        # right polar update, which contains those column permutations).
        **{r: Rule("hybrid") for r in ("mlp_in", "mlp_gate", "mlp_up")},
        **{r: Rule("right_polar") for r in ("mlp_out", "mlp_down")},
        "embedding": Rule("row_norm"),
        "lm_head": Rule("hybrid", centered=True),
        "router": Rule("left_polar", centered=True),
    },
    "lipschitz": {
        **{r: _CAPPED for r in ATTENTION_ROLES + MLP_ROLES},
        "lm_head": _CAPPED,
        "router": _CAPPED,
    },
}


@dataclass
class Hyper:
    """Hyperparameters shared by the strategies (the module-wise Manifold Muon study's defaults)."""

    lr: float = 0.02  # matrix updates (Muon, Manifold Muon, the PolarGrad maps)
    adamw_lr: float = 6e-4
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1  # AdamW matrices, the unconstrained Muon baseline, a rule's weight-decay regulator
    momentum: float = 0.95
    nesterov: bool = True
    dual_steps: int | None = None  # Manifold Muon dual-ascent steps (None: optimizer default)
    compute_dtype: torch.dtype | None = None  # directions (None: the optimizers' default; torch_muon: bf16 only)
    w_max: float = 2.0  # Lipschitz strategy: largest RMS→RMS norm of each weight
    # Seed-004 maps: 0 gives unit-scale directions (one lr for every matrix update); the
    # reference's 1 scales by the nuclear norm, which needs a much smaller lr.
    polar_alpha: float = 0.0
    extra: dict = field(default_factory=dict)  # passed to every matrix optimizer


@dataclass
class Row:
    """One line of the assignment table: a parameter, its shape, role and the rule it got."""
    name: str
    shape: tuple[int, ...]
    role: str
    rule: Rule
    tied: str = ""


class Assignment:
    """The optimizers built for a model, the per-parameter table, and a combined
    ``step``/``zero_grad``/``state_dict`` over all of them."""

    def __init__(self, strategy: str, rows: list[Row], optimizers: dict[str, torch.optim.Optimizer]):
        self.strategy = strategy
        self.rows = rows
        self.optimizers = optimizers

    def table(self) -> str:
        header = ("parameter", "shape", "role", "update")
        body = [(r.name + (f" (= {r.tied})" if r.tied else ""), "×".join(map(str, r.shape)), r.role, r.rule.describe()) for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([f"strategy: {self.strategy}", line(header), rule, *map(line, body)])

    @property
    def param_groups(self):
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def check_finite(self) -> None:
        """Report now what each of the package's optimizers leaves for its next step (steps
        skipped for non-finite gradients, a sharded owner's failure): at the end of a run
        there is no next step (:meth:`geomuon.optimizers.base.MatrixOptimizer.check_finite`)."""
        for opt in self.optimizers.values():
            if isinstance(opt, MatrixOptimizer):
                opt.check_finite()

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s output, refusing (``ValueError``, before anything loads) a
        state of other update families, or whose groups hold other parameters or give them
        another manifold, ``centered`` or regulator than this assignment does; where an
        optimizer's own load refuses its part, the optimizers loaded before it are restored."""
        if set(state) != set(self.optimizers):
            raise ValueError(
                f"optimizer state holds {sorted(state)} but strategy {self.strategy!r} builds "
                f"{sorted(self.optimizers)}; resume with the strategy the checkpoint was written with"
            )
        for update, opt in self.optimizers.items():  # all checked before any is loaded
            check_same_groups(update, self.strategy, opt.param_groups, state[update].get("param_groups", []))
        loaded = []
        try:
            for name, opt in self.optimizers.items():
                before = opt.state_dict()  # (a load replaces the state's tensors, never writes into them)
                opt.load_state_dict(state[name])
                loaded.append((opt, before))
        except Exception:
            # an optimizer's own load refused its state (after its users' load hooks ran): the ones
            # loaded before it go back to what they held (they had stayed loaded)
            for opt, before in reversed(loaded):
                opt.load_state_dict(before)
            raise


def check_same_groups(update: str, strategy: str, current: list[dict], saved: list[dict]) -> None:
    """Refuse (``ValueError`` naming optimizer ``update``, the param group and what to do) the
    ``saved`` param groups of a checkpoint when they hold other parameters than ``current``, the
    groups strategy ``strategy`` builds, or the same ones in another order, or give them another
    geometry (:func:`_geometry`): torch maps state by position and replaces the groups' options,
    so ``hetero``'s state had loaded into ``hetero_inv`` and turned it into ``hetero`` (Stiefel
    attention, DGram MLP) under the ``hetero_inv`` label, and the momentum of one weight had
    loaded into another of its shape. Parameters are compared by the groups' ``param_names``
    (a saved group without them: by position; a current one without them: by count). Both
    resumes run it: :meth:`Assignment.load_state_dict` and, per checkpoint folder,
    :func:`geomuon.pretrain.parallel.load_distributed`."""
    advice = "resume with the strategy (and roles) the checkpoint was written with"
    if len(saved) != len(current):
        raise ValueError(f"optimizer state of {update!r} holds {len(saved)} param group(s) but strategy "
                         f"{strategy!r} builds {len(current)}; {advice}")
    for index, (was, now) in enumerate(zip(saved, current)):
        names = now.get("param_names")
        saved_names = was.get("param_names", names)  # a group saved without names: by position
        if len(was["params"]) != len(now["params"]) or (names is not None and list(saved_names) != list(names)):
            raise ValueError(f"optimizer state of {update!r}, group {index}, holds "
                             f"{saved_names or len(was['params'])} but strategy {strategy!r} puts "
                             f"{names or len(now['params'])} there (state is matched by position); {advice}")
        saved_geometry, geometry = _geometry(was), _geometry(now)
        # the manifold by value (the identity of the manifold its spec builds): as printed, a tensor
        # rounds to 4 decimals (another geometry had loaded under this label) and equal manifolds
        # can print differently (arguments in another order)
        differ = [key for key in geometry if key != "manifold" and saved_geometry[key] != geometry[key]]
        if _manifold_identity(was) != _manifold_identity(now):
            differ.insert(0, "manifold")
            if saved_geometry["manifold"] == geometry["manifold"]:
                geometry = {**geometry, "manifold": f"{geometry['manifold']} (its tensor arguments differ from the "
                                                    f"saved ones beyond their printed digits)"}
        if differ:
            who = repr(names[0]) if names else f"param group {index}"
            raise ValueError(f"optimizer state of {update!r} gives {who} (and its group) "
                             + ", ".join(f"{key}={saved_geometry[key]!r}" for key in differ)
                             + f" but strategy {strategy!r} gives it "
                             + ", ".join(f"{key}={geometry[key]!r}" for key in differ) + f"; {advice}")


def _geometry(group: dict) -> dict:
    """What a param group's :class:`Rule` fixes besides its update family, as plain data:
    the manifold (its spec's name and arguments), ``centered`` and the regulator's name (its
    arguments are options, restored from a checkpoint like the learning rate)."""
    manifold, regulate = group.get("manifold"), group.get("regulate")
    if isinstance(manifold, Mapping):
        manifold = f"{manifold['name']}{manifold.get('args') or ''}"
    if isinstance(regulate, Mapping):
        regulate = regulate.get("name", regulate.get("kind"))
    return {"manifold": manifold, "centered": bool(group.get("centered", False)), "regulate": regulate}


def _manifold_identity(group: dict):
    """The identity of the manifold a param group's spec builds (tensors compared by value), or
    the spec as it is where it builds none here (an unknown class: the printed comparison)."""
    manifold = group.get("manifold")
    if not isinstance(manifold, Mapping):
        return manifold
    try:
        return MatrixManifold.from_spec(manifold).identity
    except (ValueError, TypeError):
        return _geometry(group)["manifold"]


_UPDATE_CLASSES = {
    "muon": Muon,
    "manifold_muon": ManifoldMuon,
    "row_norm": RowNormM,
    "right_polar": RightPolarGradM,
    "left_polar": LeftPolarGradM,
    "hybrid": HybridPolarGradM,
}
#: the update families torch's own optimizers run (built by :func:`_build` itself), by class name
_TORCH_UPDATES = {"adamw": "AdamW", "torch_muon": "Muon"}
#: every update family a :class:`Rule` may name
_UPDATES = (*_TORCH_UPDATES, *_UPDATE_CLASSES)
#: the update families with a ``centered`` option (the router's shift-invariant maps)
_CENTERED_UPDATES = ("row_norm", "right_polar", "left_polar", "hybrid")


#: ``torch.optim.Muon``'s update-size rule for the ``torch_muon`` peer: Keller Jordan's original
#: $\sqrt{\max(1, m/n)}$ scale of the orthogonalised momentum (ours uses the same rule).
TORCH_MUON_ADJUST_LR = "original"


def _build(update: str, groups: list[dict], hyper: Hyper) -> torch.optim.Optimizer:
    if update == "adamw":
        return torch.optim.AdamW(groups, lr=hyper.adamw_lr, betas=hyper.adamw_betas, weight_decay=0.0)
    if update == "torch_muon":  # PyTorch's implementation as it ships: its own Newton-Schulz; Hyper.extra
        # reaches it as it reaches every matrix optimizer (torch's options: ns_steps, eps, ...; ours are refused)
        if hyper.compute_dtype not in (None, torch.bfloat16):
            # torch.optim.Muon orthogonalises in bfloat16 whatever it is asked: an fp32 request had
            # been ignored while the run was labelled with it
            raise ValueError(f"Hyper.compute_dtype={hyper.compute_dtype} cannot apply to torch_muon: "
                             "torch.optim.Muon computes its directions in torch.bfloat16; leave it None "
                             "(or bfloat16), or use the 'unconstrained' strategy (the library's Muon)")
        return torch.optim.Muon(groups, lr=hyper.lr, momentum=hyper.momentum, nesterov=hyper.nesterov,
                                weight_decay=0.0, adjust_lr_fn=TORCH_MUON_ADJUST_LR, **hyper.extra)
    cls = _UPDATE_CLASSES[update]
    if update == "muon" and "weight_decay" in hyper.extra:
        # every Muon group sets its own (_group): the extra value had reached the polar maps only
        raise ValueError("Hyper.extra['weight_decay'] cannot reach Muon, whose groups take Hyper.weight_decay "
                         "(0 under a regulator); set Hyper.weight_decay instead")
    kwargs = dict(lr=hyper.lr, momentum=hyper.momentum, **hyper.extra)
    if update in ("muon", "manifold_muon"):
        kwargs["nesterov"] = hyper.nesterov
    else:  # the PolarGrad skeleton (Lau & Su): plain momentum, nuclear-norm exponent alpha
        kwargs["alpha"] = hyper.polar_alpha
    if update == "manifold_muon" and hyper.dual_steps is not None:
        kwargs["dual_steps"] = hyper.dual_steps
    if hyper.compute_dtype is not None:
        kwargs["compute_dtype"] = hyper.compute_dtype
    return cls(groups, **kwargs)


def rule_regulator_options(name: str | None, hyper: Hyper) -> dict:
    """The options of ``hyper`` the regulator of ``Rule.regulate = name`` takes: ``w_max`` where
    the class :data:`REGULATORS` registers under ``name`` has that field (the caps), and
    ``weight_decay`` where it applies one (``applies_weight_decay``: the decays; the soft cap's
    is the decay it assumes). Every rule had been given ``w_max``, and the weight decays, which
    take none, were refused with an error naming an option the user had not set."""
    cls = REGULATORS.get(name) if isinstance(name, str) else None
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    options = {"w_max": hyper.w_max} if "w_max" in fields else {}
    if getattr(cls, "applies_weight_decay", False):
        options["weight_decay"] = hyper.weight_decay
    return options


def rule_regulator(name: str, hyper: Hyper):
    """The regulator of ``Rule.regulate = name``: its class with :func:`rule_regulator_options`."""
    return make_regulator({"name": name, **rule_regulator_options(name, hyper)})


def _group(rule: Rule, params: list[torch.Tensor], hyper: Hyper, decay: bool) -> dict:
    group: dict = {"params": params}
    if rule.update == "adamw":
        group["weight_decay"] = hyper.weight_decay if decay else 0.0
    elif rule.update == "muon":
        # the unconstrained baseline of the module-wise study: decoupled weight decay; the Lipschitz strategy caps instead
        group["weight_decay"] = 0.0 if rule.regulate else hyper.weight_decay
    if rule.manifold:
        group["manifold"] = MatrixManifold.by_name(rule.manifold)()
    if rule.centered:
        group["centered"] = True
    if rule.regulate:
        group["regulate"] = rule_regulator(rule.regulate, hyper)
    return group


def strategy_table(strategy: str | Mapping[str, Rule]) -> tuple[str, dict[str, Rule]]:
    """``(label, {role: rule})`` of a strategy given by name or as a mapping.

    A mapping is checked (every key a role of :data:`ROLES` other than ``"vector"``, which
    is always AdamW; every value a :class:`Rule` with a known update and manifold) and
    labelled by the registered name whose table it equals, else by its rules, e.g.
    ``custom (attention manifold_muon[stiefel]; mlp_in/mlp_out hybrid)``.

    Raises:
        ValueError: an unknown strategy name, role, update or manifold.
        TypeError: ``strategy`` is neither a string nor a mapping, or a value is not a ``Rule``.
    """
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
        return strategy, dict(STRATEGIES[strategy])
    if not isinstance(strategy, Mapping):
        raise TypeError("strategy must be a name in STRATEGIES or a {role: Rule} mapping, "
                        f"got {type(strategy).__name__}")
    table = dict(strategy)
    for role, rule in table.items():
        if role not in ROLES or role == "vector":
            raise ValueError(f"strategy names role {role!r}; a strategy maps roles of {ROLES[:-1]} "
                             "(vectors always use AdamW)")
        if not isinstance(rule, Rule):
            raise TypeError(f"strategy[{role!r}] is a {type(rule).__name__}; use geomuon.optimizers.assign.Rule(...)")
        if rule.update not in _UPDATES:
            raise ValueError(f"strategy[{role!r}] has update {rule.update!r}; choose one of {_UPDATES}")
        if rule.manifold is not None:
            try:
                MatrixManifold.by_name(rule.manifold)
            except ValueError as error:
                raise ValueError(f"strategy[{role!r}]: {error}") from None
        # a rule that cannot do what it says had been accepted and labelled as if it did
        # (Rule("muon", "stiefel") stepped off Stiefel)
        if (rule.manifold is not None) != (rule.update == "manifold_muon"):
            raise ValueError(f"strategy[{role!r}] = {rule}: a manifold goes with update='manifold_muon', which needs "
                             "one (e.g. Rule('manifold_muon', 'stiefel'))")
        if rule.centered and rule.update not in _CENTERED_UPDATES:
            raise ValueError(f"strategy[{role!r}] = {rule}: centered applies to {_CENTERED_UPDATES}")
        if rule.regulate is not None:
            if rule.update in _TORCH_UPDATES:  # (torch's AdamW had carried the key and ignored it)
                raise ValueError(f"strategy[{role!r}] = {rule}: torch.optim.{_TORCH_UPDATES[rule.update]} "
                                 "takes no regulator; regulators go with the library's matrix updates "
                                 f"{tuple(_UPDATE_CLASSES)}")
            try:
                rule_regulator(rule.regulate, Hyper())
            except (ValueError, TypeError) as error:
                raise ValueError(f"strategy[{role!r}].regulate: {error}") from None
    return _label(table), table


def _label(table: dict[str, Rule]) -> str:
    explicit = {role: rule for role, rule in table.items() if rule != ADAMW}  # omitted roles are AdamW too
    for name, known in STRATEGIES.items():
        if explicit == {role: rule for role, rule in known.items() if rule != ADAMW}:
            return name
    roles_of: dict[Rule, list[str]] = {}
    for role in ROLES:
        if role in explicit:
            roles_of.setdefault(explicit[role], []).append(role)
    families = {"attention": ATTENTION_ROLES, "mlp": MLP_ROLES}
    parts = []
    for rule, roles in roles_of.items():
        for family, members in families.items():
            if set(members) <= set(roles):
                roles = [family] + [r for r in roles if r not in members]
        parts.append(f"{'/'.join(roles)} {rule.describe()}")
    return f"custom ({'; '.join(parts) or 'adamw'})"


def assign(
    model: nn.Module,
    strategy: str | Mapping[str, Rule],
    hyper: Hyper | None = None,
    roles: dict[str, str] | None = None,
) -> Assignment:
    """Classify ``model``'s parameters, apply ``strategy`` and build its optimizers.

    ``strategy`` is a name in :data:`STRATEGIES` or a ``{role: Rule}`` mapping (checked
    and labelled by :func:`strategy_table`); roles it omits, and vectors, use AdamW.
    Weights given a manifold are re-initialised on it in place (see :func:`_move_onto`;
    this draws from the global torch RNG). Unknown strategy, role, update or manifold →
    ``ValueError`` naming the valid ones; so is a strategy none of whose non-AdamW roles the
    model has (it would train everything with AdamW), a matrix update given a parameter that
    is not 2-D, and settings the optimizers refuse (checked before any weight moves).
    """
    label, table = strategy_table(strategy)
    hyper = hyper or Hyper()
    role_of = classify(model, roles)
    if not role_of:
        raise ValueError(f"assign: {type(model).__name__} has no trainable parameters (requires_grad=True); "
                         "nothing to optimize")
    named_roles = {role for role, rule in table.items() if rule != ADAMW}
    if named_roles and not named_roles & set(role_of.values()):
        # e.g. {"attn_q": ...} on a fused c_attn (role attn_qkv) had trained everything with AdamW
        raise ValueError(f"assign: strategy {label!r} names roles {sorted(named_roles)}, none of which a trainable "
                         f"parameter of {type(model).__name__} has (its roles: {sorted(set(role_of.values()))}); "
                         "name those roles, or give the parameters roles={name: role}")
    params = dict(model.named_parameters())
    tied = _tied_names(model)
    rows, buckets = [], {}
    for name, role in role_of.items():
        p = params[name]
        rule = rule_for(table, role)
        if rule.update != "adamw" and p.dim() != 2:
            # (the optimizers refused it with advice assign cannot follow, "a param group with
            # update='adamw'"; ManifoldMuon had constrained each [kh, kw] slice of a conv kernel
            # instead of the kernel)
            raise ValueError(f"assign: parameter {name!r} has shape {tuple(p.shape)} and role {role!r}, which "
                             f"strategy {label!r} gives {rule.describe()}; a strategy's matrix updates take 2-D "
                             f"weights: give it roles={{{name!r}: 'vector'}} (AdamW)"
                             + (", or build the optimizer with matrix_view='flatten' (or 'batch') in its group "
                                "yourself" if p.dim() > 2 else ""))
        rows.append(Row(name, tuple(p.shape), role, rule, tied.get(name, "")))
        # AdamW decays matrices only (nanoGPT); one group per (rule, decay)
        key = (rule, rule.update == "adamw" and p.dim() >= 2)
        buckets.setdefault(key, []).append((name, p))
    by_update: dict[str, list[dict]] = {}
    for (rule, decay), named in buckets.items():
        group = _group(rule, [p for _, p in named], hyper, decay)
        group["param_names"] = [name for name, _ in named]  # the optimizers' reports name them
        by_update.setdefault(rule.update, []).append(group)
    try:  # every option checked (by the optimizers) before any weight moves
        optimizers = {update: _build(update, groups, hyper) for update, groups in by_update.items()}
    except (ValueError, TypeError) as error:
        raise ValueError(f"assign: the strategy's optimizers refuse these settings (Hyper or a Rule): {error}") from None
    if "manifold_muon" in optimizers:
        _move_onto(optimizers["manifold_muon"])
    return Assignment(label, rows, optimizers)


def _aliases(model: nn.Module) -> dict[str, str]:
    """``{every name of a parameter: its first name}`` (tied tensors have several)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def _tied_names(model: nn.Module) -> dict[str, str]:
    """``{first name: its other names, comma-separated}`` of every tied parameter (a three-way
    tie had kept one alias)."""
    tied: dict[str, list[str]] = {}
    for name, first in _aliases(model).items():
        if name != first:
            tied.setdefault(first, []).append(name)
    return {first: ", ".join(names) for first, names in tied.items()}


@torch.no_grad()
def _move_onto(optimizer: ManifoldMuon) -> None:
    r"""Put every weight ``optimizer`` constrains on its manifold. A weight already there (a
    model trained with this geometry) is kept, "there" meaning what the optimizer's first step
    accepts: :meth:`~geomuon.optimizers.base.MatrixOptimizer.check_on_manifold`'s tolerance,
    $\max(10^{-5}, 16\,\varepsilon)$ of the weight's dtype (a bf16 weight is on its manifold
    only to its own rounding: a fixed fp32 tolerance had replaced a trained bf16 model's weights
    by random points). Others restart at a random semi-orthogonal point
    (``orthogonal_``: fp32 QR, the distribution of the polar factor of a Gaussian matrix),
    which lies on Stiefel and DGram alike, so the Stiefel/DGram strategies all start from the
    same kind of point; other manifolds project it with ``projx``. (A float64 SVD
    ``projx`` of every GPT-2 matrix costs minutes on a CPU; the QR costs seconds.) The point
    is drawn on the CPU with torch's CPU generator whatever the device, so a seed starts the
    same weights on the CPU and on a GPU."""
    for group in optimizer.param_groups:
        manifold = optimizer._group_manifold(group)
        for p in group["params"]:
            matrix, atol = optimizer._checked_point(group, p, 1e-5)  # the first step's check (_admissible)
            if manifold.check_point_on_manifold(matrix, atol=atol, rtol=1e-5):
                continue
            point = torch.nn.init.orthogonal_(torch.empty(p.shape, dtype=torch.float32)).to(p.device)
            if not manifold.check_point_on_manifold(point):
                point = manifold.projx(point)
            p.copy_(point.to(p.dtype))
