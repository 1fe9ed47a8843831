r"""The configuration of a training run, described once.

Every field of :class:`TrainConfig` carries an :class:`Option` (its ``dataclasses``
metadata): the help text, the unit, the range or the choices. That one table is read
three times:

* :func:`field_problems` checks each value against its option — type, finiteness, range,
  choices — and :meth:`TrainConfig.validate` adds the relations between fields (warmup
  shorter than the schedule, …), so a bad value is refused with a message naming the
  option before any data is read or any step is taken;
* :func:`add_options` builds the ``argparse`` options of ``geomuon pretrain`` (and
  ``geomuon compare``) from it, so ``--help`` lists the valid values, the units and the
  defaults;
* :func:`command_line` writes the command that reproduces a configuration (the
  "resume with:" line of an interrupted run).

A dataclass of one's own gets the same treatment by declaring its fields with
:func:`option` (``geomuon compare``'s options do).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shlex
import string
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields

import torch

from geomuon.optimizers.assign import (ROLES, STRATEGIES, Hyper, Rule, classify, rule_for, rule_regulator_options,
                                      strategy_table)
from geomuon.pretrain.data import DATA_SYNTAX, spec_problem
from geomuon.pretrain.model import CONFIGS, GPT, GPTConfig, get_config
from geomuon.theory.lipschitz import DEFAULT_METHOD, METHODS

#: TrainConfig fields that set a GPTConfig field through their own option.
MODEL_OPTIONS = ("block_size", "n_layer", "n_head", "n_embd")

#: Placeholders of ``--out-dir``: ``{strategy}`` and ``{time}`` (UTC, to the second).
FRESH_RUN_DIR = "runs/{strategy}-{time}"

#: How a run can be spread over processes (``--parallel``).
PARALLEL_MODES = ("none", "ddp", "fsdp")

#: Upper bound of ``--lr``, ``--adamw-lr`` and ``--weight-decay``: far above any working value,
#: and 32 orders of magnitude below float32's largest number (3.4e38), which leaves room for
#: the factors the optimizers multiply a rate by before it becomes an fp32 scalar (shape
#: factors, β corrections, lr·weight_decay: about 1e6 at most). --lr 3e38 had passed and
#: then crashed mid-run with a RuntimeError.
MAX_RATE = 1e6

#: Upper bound of ``--seed``: ``torch.manual_seed`` takes seeds up to $2^{64} - 1$ (a larger one had
#: passed the check and failed after the data was read, with torch's "Overflow when unpacking long
#: long", which names no option).
MAX_SEED = 2**64 - 1

#: Options that reach only some rules of a strategy: field -> (whether a rule takes it, which
#: rules do). A value other than the default that no strategy of the run (or of the comparison)
#: takes, on the roles the model's parameters have, is refused: ``--lr 0.05 --strategy adamw`` had
#: trained at ``--adamw-lr`` without a word, ``--w-max`` had been described as capping DGram's
#: columns, which no DGram rule reads, and ``--adamw-lr`` had been ignored by ``--strategy symmetry``
#: on a Lipschitz model (no gains or biases: no parameter is left to AdamW).
RULE_OPTIONS: dict[str, tuple[Callable[[Rule], bool], str]] = {
    "lr": (lambda rule: rule.update != "adamw", "the matrix updates other than AdamW (AdamW takes --adamw-lr)"),
    "adamw_lr": (lambda rule: rule.update == "adamw", "the parameters AdamW updates (vectors, and the matrices a "
                 "strategy leaves to AdamW)"),
    "direction_dtype": (lambda rule: rule.update != "adamw", "the matrix updates other than AdamW"),
    "dual_steps": (lambda rule: rule.update == "manifold_muon", "Manifold Muon's matrices"),
    "w_max": (lambda rule: "w_max" in rule_regulator_options(rule.regulate, Hyper()),
              "the matrices whose regulator is a cap (the lipschitz strategy's soft cap)"),
}


@dataclass(frozen=True)
class Option:
    """What one configuration field accepts and how ``--help`` describes it.

    ``at_least`` / ``above`` / ``at_most`` bound a number (inclusive, exclusive,
    inclusive); ``choices`` returns the valid names (called when needed, so a registry
    filled later is seen); ``flag`` replaces the default ``--field-name``; ``syntax``
    describes the form of a string (shown in ``--help``). Floats must be finite."""

    help: str
    unit: str = ""
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    choices: Callable[[], Iterable[str]] | None = None
    flag: str | None = None
    syntax: str = ""

    def valid_values(self) -> str:
        """The valid values in words: ``≥ 1``, ``> 0``, ``in [0, 1]``, ``one of …`` (an integer
        bound in full: ``:g`` had written $2^{64} - 1$ as 1.84467e+19, a value it is not)."""
        if self.choices is not None:
            return "one of: " + ", ".join(self.choices())

        def spell(bound: float) -> str:
            return str(bound) if isinstance(bound, int) else f"{bound:g}"

        if self.at_least is not None and self.at_most is not None:
            return f"in [{spell(self.at_least)}, {spell(self.at_most)}]"
        bounds = [f"{sign} {spell(bound)}" for sign, bound in (("≥", self.at_least), (">", self.above),
                                                                ("≤", self.at_most)) if bound is not None]
        return " and ".join(bounds) or self.syntax

    def problem(self, flag: str, kind: type, value) -> str | None:
        """Why ``value`` is not valid for this option (``None`` if it is)."""
        if kind is bool and not isinstance(value, bool):
            return f"{flag} must be true or false (got {value!r})"
        if kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and not isinstance(value, int)):
                return f"{flag} must be {'an integer' if kind is int else 'a number'} (got {value!r})"
            if not math.isfinite(value):
                return f"{flag} must be a finite number {self.valid_values()} (got {value!r})".replace("  ", " ")
            if ((self.at_least is not None and value < self.at_least)
                    or (self.above is not None and value <= self.above)
                    or (self.at_most is not None and value > self.at_most)):
                return f"{flag} must be {self.valid_values()} (got {value!r})"
        if kind is str and not isinstance(value, str):
            return f"{flag} must be a string (got {value!r})"
        if kind is dict and not isinstance(value, dict):
            return f"{flag} must be a JSON object (got {value!r})"
        if self.choices is not None and value not in set(self.choices()):
            return f"{flag} {value!r} is unknown; choose {self.valid_values()}"
        return None


def option(default, help: str, **described) -> dataclasses.Field:
    """A dataclass field whose :class:`Option` is built from ``help`` and ``described``
    (a mutable default is copied for each instance)."""
    metadata = {"option": Option(help, **described)}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _choices(table: dict) -> Callable[[], list[str]]:
    return lambda: sorted(table)


@dataclass
class TrainConfig:
    """Everything a training run depends on; one command-line option per field
    (``geomuon pretrain --help`` lists them with their valid values)."""

    model: str = option("demo", "model configuration", choices=_choices(CONFIGS), flag="--config")
    strategy: str = option("adamw", "optimizer per module (with a build_assignment hook: the run's label)",
                           choices=_choices(STRATEGIES))
    data: str = option("embedded", "training text or tokens", syntax=" | ".join(DATA_SYNTAX))
    out_dir: str | None = option(
        FRESH_RUN_DIR, "folder of the run's log.jsonl and checkpoints; {strategy} and {time} (UTC) are "
        "filled in, so every run gets a fresh folder; a folder that holds a run is refused unless "
        "--resume or --overwrite (None from Python: in memory only)", syntax="PATH")
    steps: int = option(200, "length of the schedule", unit="optimizer steps", at_least=1)
    stop_after: int | None = option(None, "stop at this step (resume later) without changing the schedule",
                                    unit="steps", at_least=1)
    batch_size: int = option(16, "sequences per forward pass, all processes together", unit="sequences",
                             at_least=1)
    grad_accum: int = option(1, "forward/backward passes summed into each optimizer step (each step sees "
                             "grad_accum × batch_size sequences)", unit="passes", at_least=1)
    block_size: int | None = option(None, "context length (default: the model configuration's)",
                                    unit="tokens", at_least=1)
    n_layer: int | None = option(None, "transformer blocks (default: the model configuration's)", at_least=1)
    n_head: int | None = option(None, "attention heads (default: the model configuration's)", at_least=1)
    n_embd: int | None = option(None, "model width (default: the model configuration's)", at_least=1)
    model_overrides: dict = option({}, "other GPTConfig fields, e.g. '{\"tie_weights\": false}'",
                                   syntax="JSON object")
    lr: float = option(0.02, "learning rate of the matrix optimizers", above=0, at_most=MAX_RATE)
    adamw_lr: float = option(6e-4, "learning rate of AdamW (embeddings, gains, AdamW-assigned matrices)",
                             above=0, at_most=MAX_RATE)
    weight_decay: float = option(0.1, "decoupled weight decay of AdamW and of the unregulated Muon matrices "
                                 "(the unconstrained strategy's)", at_least=0, at_most=MAX_RATE)
    warmup_steps: int = option(10, "linear warmup before the cosine decay (< --steps)", unit="steps",
                               at_least=0)
    min_lr_ratio: float = option(0.1, "learning rate the cosine reaches at step --steps, as a fraction of the peak "
                                      "(the last step taken, steps - 1, runs just above it)", at_least=0, at_most=1)
    grad_clip: float = option(1.0, "largest global gradient norm, 0 disables clipping", at_least=0)
    dual_steps: int | None = option(None, "dual-ascent steps of Manifold Muon (default: the optimizer's)",
                                    at_least=0)
    direction_dtype: str = option("default", "compute dtype of the optimizer directions",
                                  choices=lambda: ("default", "fp32", "bf16"))
    w_max: float = option(2.0, "the RMS→RMS spectral cap of the regulated matrices (the lipschitz strategy's "
                          "soft cap)", above=0)
    lipschitz_bound: str = option(
        DEFAULT_METHOD, "certified Lipschitz bound logged at each evaluation of a Lipschitz model (off: none); "
        "joint is the tightest and the slowest (one CPU thread, GPT-2 small's shape d = 768, 12 layers, "
        "12 heads: joint about 3.4 min, aligned about 26 s)", choices=lambda: ("off", *METHODS))
    eval_every: int = option(50, "evaluate every this many steps (and at the end)", unit="steps", at_least=1)
    eval_batches: int = option(4, "validation batches per evaluation", unit="batches", at_least=1)
    final_eval_batches: int | None = option(None, "validation batches of the last evaluation "
                                            "(default: --eval-batches)", unit="batches", at_least=1)
    val_seed: int | None = option(None, "seed of the validation windows (default: --seed)", at_least=0)
    log_every: int = option(10, "write the training loss every this many steps; the loss stays on the "
                            "device in between (no host sync per step)", unit="steps", at_least=1)
    ckpt_every: int = option(0, "checkpoint every this many steps, 0: at each evaluation (always at the "
                             "end and on SIGINT/SIGTERM)", unit="steps", at_least=0)
    seed: int = option(0, "seed of the initialisation and the training batches", at_least=0, at_most=MAX_SEED)
    device: str = option("auto", "where to train (auto: CUDA when available)",
                         choices=lambda: ("auto", "cpu", "cuda"))
    parallel: str = option("none", "how to spread the run over torchrun processes",
                           choices=lambda: PARALLEL_MODES)
    compile: bool = option(False, "torch.compile the model")
    resume: bool = option(False, "continue the run in --out-dir from its checkpoint")
    overwrite: bool = option(False, "replace the run in --out-dir (its log and checkpoints)")
    progress: bool = option(True, "show a progress bar")
    print_table: bool = option(True, "print the model summary and the assignment table before training")

    def model_kwargs(self) -> dict:
        """The GPTConfig fields this run sets: ``model_overrides``, then the model options
        given (the ones not ``None``); what :func:`~geomuon.pretrain.train.build` and
        :meth:`validate` both pass to ``get_config``."""
        return {**self.model_overrides, **{n: getattr(self, n) for n in MODEL_OPTIONS if getattr(self, n) is not None}}

    def validate(self, named_strategy: bool = True, sharing: Iterable[str] | None = None) -> None:
        """Everything that can be checked without touching data: fail before training.
        ``named_strategy=False`` (a run whose optimizers a ``build_assignment`` hook
        builds) accepts any ``strategy`` label. ``sharing``: the strategies that share these
        options (a comparison's; default: this run's), of which one must take each option of
        :data:`RULE_OPTIONS` set to other than its default."""
        problems = field_problems(self, skip=() if named_strategy else ("strategy",))
        check_unused = named_strategy and not problems and not self.resume  # (a resume must repeat the run's options)
        roles = None  # the roles of the model's parameters, once its configuration builds
        if isinstance(self.data, str) and (problem := spec_problem(self.data)):
            problems.append(f"--data: {problem}")
        if isinstance(self.model_overrides, dict):
            known = {f.name for f in fields(GPTConfig)}
            for key in self.model_overrides:
                if key not in known:
                    problems.append(f"--model-overrides names {key!r}, not a GPTConfig field; "
                                    f"choose from {sorted(known)}")
                elif key in MODEL_OPTIONS and getattr(self, key) is not None:
                    problems.append(f"{key} is set by both --{key.replace('_', '-')} {getattr(self, key)} and "
                                    f"--model-overrides {key}={self.model_overrides[key]!r}; keep one of them")
            character_level = isinstance(self.data, str) and not self.data.startswith("tokens:")
            if "vocab_size" in self.model_overrides and character_level:
                problems.append(f"--model-overrides sets vocab_size={self.model_overrides['vocab_size']!r}, which "
                                f"the character-level --data {self.data!r} sets itself; leave it out")
            elif not problems and self.model in CONFIGS:  # the model's own checks, before the data is read
                try:
                    model = get_config(self.model, **self.model_kwargs())
                except (TypeError, ValueError) as err:
                    problems.append(f"--config {self.model} with --model-overrides "
                                    f"{json.dumps(self.model_overrides)}: {err}; change --model-overrides")
                else:
                    problems += self._unused_lipschitz_bound(model)
                    roles = parameter_roles(model) if check_unused else None
        if check_unused:
            problems += self.unused_options([self.strategy] if sharing is None else list(sharing), roles)
        if named_strategy and self.direction_dtype == "fp32" and self.strategy in STRATEGIES and any(
                rule.update == "torch_muon" for rule in strategy_table(self.strategy)[1].values()):
            # (assign refuses it too, but a comparison had trained its other strategies first)
            problems.append(f"--direction-dtype fp32 cannot apply to --strategy {self.strategy}: torch.optim.Muon "
                            "computes its directions in bf16; use --direction-dtype default or bf16")
        if self.out_dir == "":  # names no folder (compare's check for an earlier comparison in it had been
            # skipped, its figures written over the current directory's; a run failed only when it started)
            problems.append("--out-dir '' names no folder; name one (e.g. --out-dir runs/my-run), or leave --out-dir "
                            "out for a fresh folder")
        for flag, does in (("resume", "continue"), ("overwrite", "replace")):
            if self.out_dir is None and getattr(self, flag):
                problems.append(f"--{flag} needs an --out-dir holding the run (got out_dir=None: the run stays in "
                                f"memory); give the folder of the run to {does}")
        if self.resume and self.overwrite:
            problems.append("--resume and --overwrite are both given: --resume continues the run in --out-dir, "
                            "--overwrite replaces it; choose one")
        if self.resume and isinstance(self.out_dir, str) and _names_a_template(self.out_dir):
            problems.append(f"--resume needs the --out-dir of the run to continue (got the template "
                            f"{self.out_dir!r}); give its folder, as the interrupted run printed it")
        if self.overwrite and isinstance(self.out_dir, str) and _names_a_template(self.out_dir):
            # (it had been ignored: the template gave a fresh '-2' folder, and the run it meant stayed)
            problems.append(f"--overwrite would be ignored: --out-dir {self.out_dir!r} is a template, which names a "
                            "fresh folder for every run; give the folder of the run to replace")
        if _numbers(self.warmup_steps, self.steps) and not 0 <= self.warmup_steps < self.steps:
            problems.append(f"--warmup-steps must be in [0, steps={self.steps}) (got {self.warmup_steps}); lower "
                            "--warmup-steps or raise --steps")
        if self.stop_after is not None and _numbers(self.stop_after, self.steps) and self.stop_after > self.steps:
            problems.append(f"--stop-after must be in [1, steps={self.steps}] (got {self.stop_after}); lower "
                            "--stop-after or raise --steps")
        if self.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda was asked for but CUDA is not available; use --device cpu")
        launcher = {}
        for name in LAUNCHER_VARIABLES:
            try:
                launcher[name] = launcher_value(name)
            except ValueError as err:
                problems.append(str(err))
        world = launcher.get("WORLD_SIZE", 1)
        if world > 1 and self.parallel == "none":
            problems.append(f"{world} processes (WORLD_SIZE) but --parallel none; choose --parallel ddp or fsdp")
        if self.parallel != "none" and "MASTER_ADDR" not in os.environ:  # (it had run as one plain process)
            problems.append(f"--parallel {self.parallel} runs under torchrun (MASTER_ADDR is unset here, so this would "
                            "be one ordinary process); launch with torchrun --nproc-per-node N -m geomuon ..., or use "
                            "--parallel none")
        if self.parallel == "fsdp" and importlib.util.find_spec("geomuon.pretrain.parallel") is None:
            problems.append("--parallel fsdp needs geomuon.pretrain.parallel, which this version does not "
                            "have; use --parallel ddp")
        if _numbers(self.batch_size) and self.batch_size % world:
            problems.append(f"--batch-size {self.batch_size} must be a multiple of the {world} processes "
                            f"(WORLD_SIZE); give a multiple of {world} or launch another number of processes")
        if problems:
            raise ValueError("bad training config:\n  " + "\n  ".join(problems))


    def _unused_lipschitz_bound(self, model: GPTConfig) -> list[str]:
        """A ``--lipschitz-bound`` other than the default for a model without the Lipschitz
        architecture, whose evaluations log no bound (it had been accepted and ignored); a resume
        repeats the run's options, as :meth:`unused_options` lets it."""
        if model.lipschitz or self.resume or self.lipschitz_bound in (DEFAULT_METHOD, "off"):
            return []
        return [f"--lipschitz-bound {self.lipschitz_bound} would be ignored: --config {self.model} is not a Lipschitz "
                "model (lipschitz=False), and the bound is certified and logged only for those; leave it out or "
                "choose a Lipschitz configuration (e.g. --config cpu-lipschitz)"]

    def unused_options(self, strategies: list[str], roles: Iterable[str] | None = None) -> list[str]:
        """Why each option of :data:`RULE_OPTIONS` set to other than its default is taken by no
        rule of ``strategies`` (names of :data:`~geomuon.optimizers.assign.STRATEGIES`; others
        are left to their own check) on ``roles``, the roles of the model's parameters
        (:func:`parameter_roles`; default: every role of :data:`~geomuon.optimizers.assign.ROLES`).
        A role a strategy leaves out, and every vector, is AdamW's, as ``assign`` gives it."""
        named = [name for name in strategies if name in STRATEGIES]
        of_model = "" if roles is None else f" on the parameters of --config {self.model}"
        roles = ROLES if roles is None else tuple(roles)
        rules = [rule_for(STRATEGIES[name], role) for name in named for role in roles]
        defaults = {f.name: f.default for f in fields(self)}
        problems = []
        for name, (takes, takers) in RULE_OPTIONS.items():
            value = getattr(self, name)
            if named and value != defaults[name] and not any(takes(rule) for rule in rules):
                flag = "--" + name.replace("_", "-")
                who = (f"--strategy {named[0]} has none" if len(named) == 1
                       else f"none of --strategies {','.join(named)} has any") + of_model
                problems.append(f"{flag} {value} would be ignored: it reaches {takers}, and {who}; leave it out "
                                "or choose a strategy that takes it")
        return problems


@functools.lru_cache(maxsize=32)  # a comparison validates one model configuration once per run
def parameter_roles(model: GPTConfig) -> frozenset[str]:
    """The roles (:data:`~geomuon.optimizers.assign.ROLES`) of the trainable parameters of the GPT
    ``model`` describes, as :func:`~geomuon.optimizers.assign.classify` gives them. They depend on
    the kinds of modules, not on their number or sizes, so a copy with one block, a vocabulary of 2
    and a context of 2 is built (milliseconds even for GPT-2 small; on the meta device the first
    initialisation imports torch._dynamo, seconds), its initialisation drawn from a forked RNG so
    the caller's random state is left as it was."""
    one_block = dataclasses.replace(model, n_layer=1, vocab_size=2, block_size=2)
    with torch.random.fork_rng(devices=[]):
        return frozenset(classify(GPT(one_block)).values())


#: The launcher's variables (torchrun's) and the least value each may take.
LAUNCHER_VARIABLES = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0}


def launcher_value(name: str) -> int:
    """The launcher's variable ``name`` (:data:`LAUNCHER_VARIABLES`) as an integer (its least
    value where it is unset); ``ValueError`` naming it when it is set to anything else (``int()``
    had raised "invalid literal" naming nothing)."""
    least = LAUNCHER_VARIABLES[name]
    text = os.environ.get(name, str(least))
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(f"environment variable {name}={text!r} is not an integer >= {least}; torchrun sets it: "
                         f"unset it to run one process, or launch with torchrun --nproc-per-node N")
    return value


def _numbers(*values) -> bool:
    """Whether every value is a number (a relation is checked only between valid fields)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


# ----------------------------------------------------------------------------- reading the table


def _options(cls) -> Iterable[tuple[dataclasses.Field, Option, type, bool]]:
    """``(field, option, item type, is a list)`` of every declared field of ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        kind = hints[f.name]
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        many = typing.get_origin(kind) is list
        yield f, opt, (typing.get_args(kind)[0] if many else typing.get_origin(kind) or kind), many


def option_text(name: str, value=..., options: type | None = None) -> str:
    """The option ``name`` of ``options`` (a dataclass of :func:`~geomuon.pretrain.config.option`
    fields; default :class:`TrainConfig`; ``geomuon compare``'s options) as both of its callers spell it,
    for a message that says what to do: a refusal raised by :func:`train` reaches the command line
    and a Python caller of ``train(TrainConfig(...))`` alike, and had named only the flags
    ("continue it with --resume"). ``--out-dir (out_dir)``; with ``value``, ``--resume
    (resume=True)``, ``--no-progress (progress=False)``, ``--lr 0.01 (lr=0.01)``."""
    declared = {f.name: f for f in fields(options or TrainConfig)}[name]
    flag = _flag(declared, declared.metadata["option"])
    if value is ...:
        return f"{flag} ({name})"
    if isinstance(value, bool):
        return f"{flag if value else '--no-' + flag[2:]} ({name}={value})"
    if isinstance(value, float):  # 1.0 as the command line takes it: 1
        return f"{flag} {value:g} ({name}={value:g})"
    return f"{flag} {value} ({name}={value!r})"


def is_template(out_dir: str) -> bool:
    """Whether ``out_dir`` has replacement fields (``{strategy}``, ``{time}``), i.e. names a fresh
    folder for every run; a literal brace written ``{{`` or ``}}`` is none. (A name that
    ``str.format`` changed had counted as a template, so ``x{{b}}``'s run, in ``x{b}``, could be
    neither resumed nor refused: another run went to ``x{b}-2``.) ``ValueError`` for a lone brace."""
    return any(name is not None for _, name, _, _ in string.Formatter().parse(out_dir))


def _names_a_template(out_dir: str) -> bool:
    """:func:`is_template`, a lone brace counting as one (its own refusal names it at the run)."""
    try:
        return is_template(out_dir)
    except ValueError:
        return True


def _flag(f, opt: Option) -> str:
    return opt.flag or "--" + f.name.replace("_", "-")


def _optional(cls, name: str) -> bool:
    kind = typing.get_type_hints(cls)[name]
    return type(None) in typing.get_args(kind)


def field_problems(config, skip: Iterable[str] = ()) -> list[str]:
    """What is wrong with each declared field of ``config`` on its own (type, range,
    choices), in declaration order; fields named in ``skip`` are not checked."""
    problems = []
    for f, opt, kind, many in _options(type(config)):
        value = getattr(config, f.name)
        if f.name in skip or (value is None and _optional(type(config), f.name)):
            continue
        flag = _flag(f, opt)
        if many:
            if not isinstance(value, (list, tuple)) or not value:
                problems.append(f"{flag} must name at least one value (got {value!r})")
                continue
            problems += [p for item in value if (p := opt.problem(flag, kind, item))]
        elif problem := opt.problem(flag, kind, value):
            problems.append(problem)
    return problems


def json_object(text: str) -> dict:
    """A command-line JSON object (``--model-overrides '{"tie_weights": false}'``)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _comma_list(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]

    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse names it in its error message
    return parse


def add_options(parser: argparse.ArgumentParser, cls, *, exclude: Iterable[str] = (),
                defaults: dict | None = None) -> None:
    """One ``argparse`` option per declared field of ``cls`` (but those in ``exclude``);
    ``defaults`` replaces some defaults (shown as such in ``--help``)."""
    exclude, defaults = set(exclude), defaults or {}
    for f, opt, kind, many in _options(cls):
        if f.name in exclude:
            continue
        default = defaults.get(f.name, f.default if f.default is not MISSING else f.default_factory())
        flag = _flag(f, opt)
        unit = f" [{opt.unit}]" if opt.unit else ""
        valid = opt.valid_values()
        shown = json.dumps(default) if isinstance(default, dict) else (
            ",".join(map(str, default)) if many else default)
        parts = [opt.help + unit, valid, "" if default is None else f"default: {shown}"]
        text = "; ".join(p for p in parts if p).replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=text)
            continue
        parse = {int: int, float: float, str: str, dict: json_object}[kind]
        parser.add_argument(flag, dest=f.name, type=_comma_list(parse) if many else parse, default=default,
                            metavar=f.name.upper(), help=text)


def from_args(cls, args: argparse.Namespace):
    """An instance of ``cls`` from the parsed options (a field without an option keeps its default)."""
    return cls(**{f.name: getattr(args, f.name) for f, *_ in _options(cls) if hasattr(args, f.name)})


def command_line(prefix: str, *configs, exclude: Iterable[str] = (), defaults: dict | None = None) -> str:
    """The shell command ``prefix`` followed by every option of ``configs`` that differs
    from its default (``defaults`` replaces some, as in :func:`add_options`; ``exclude``
    leaves some out), quoted for a POSIX shell."""
    words = shlex.split(prefix)
    exclude, defaults = set(exclude), defaults or {}
    for config in configs:
        for f, opt, kind, many in _options(type(config)):
            value = getattr(config, f.name)
            default = defaults.get(f.name, f.default if f.default is not MISSING else f.default_factory())
            if f.name in exclude or value == default or value is None:
                continue
            flag = _flag(f, opt)
            if kind is bool:
                words.append(flag if value else "--no-" + flag[2:])
            else:
                words += [flag, json.dumps(value) if kind is dict else (
                    ",".join(map(str, value)) if many else str(value))]
    return shlex.join(words)
