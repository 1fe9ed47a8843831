r"""One training loop for one CPU, one GPU and many processes (``torchrun``).

``geomuon pretrain --config demo --strategy hetero --steps 200`` (see ``--help``);
on many processes ``torchrun --nproc_per_node 2 -m geomuon.pretrain.train --config … --strategy …``
(or ``torchrun --no-python … geomuon pretrain …``).

* **Devices.** CPU runs in fp32. CUDA runs the forward under bf16 autocast (parameters,
  optimizer state and retractions stay fp32) and optionally ``torch.compile``.
* **Many processes.** Under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in DDP
  (gloo on CPU, NCCL on GPU), which averages the gradients. Every rank draws the same
  global batch (:meth:`geomuon.pretrain.data.TokenData.batch`) and keeps its slice, so the run
  sees exactly the batches of a single-process run. The optimizer work — the
  orthogonalisations and dual ascents — is **sharded by parameter**: each parameter has
  one owner rank (greedy balance of the matrix work), every rank steps only the
  parameters it owns (the others have ``grad = None`` during the step, which every
  optimizer skips), and each updated parameter is then broadcast from its owner. Ranks
  therefore hold bit-identical parameters and each does ≈ 1/world of the optimizer work.
  Optimizer state lives only on the owner; checkpoints gather it on rank 0.
* **Schedules.** Linear warmup then cosine decay to ``min_lr_ratio`` of every group's
  base learning rate (the matrix and AdamW rates share the schedule, as in seed 000).
* **Checkpoints** are written atomically (temp file, fsync, ``os.replace``) and the
  previous one is kept as ``ckpt.prev.pt``. Resuming restores parameters, optimizer
  state, the step and the log; batches are a function of (seed, step), so the remaining
  losses are bit-identical to an uninterrupted run on CPU.
* **Metrics** at each eval (rank 0, unwrapped model, fixed val batches): val loss and
  accuracy, max |activation| per block, max attention logit and mean softmax-Jacobian
  norm per layer, σ_max and column-norm spread per matrix, the Lipschitz bound for the
  Lipschitz variant. Everything goes to ``<out_dir>/log.jsonl``; with ``out_dir=None``
  the run stays in memory (no log, no checkpoint) and returns everything in
  :class:`TrainResult`.
* **Hooks** (:func:`train`'s keywords, for code that calls it): ``build_assignment``
  builds the optimizers for a strategy of one's own (a ``{role: Rule}`` mapping, an
  optimizer subclass, an extra regulator…), ``extra_metrics`` adds observables to every
  evaluation.

A run stops early, flagged ``diverged``, when the training loss or the gradient norm is
not finite; it never writes a non-finite checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist

from geomuon.manifolds.linalg import power_iteration
from geomuon.optimizers.assign import ATTENTION_ROLES, MLP_ROLES, STRATEGIES, Assignment, Hyper, assign
from geomuon.pretrain.data import TokenData, load_data
from geomuon.pretrain.model import CONFIGS, GPT, GPTConfig, get_config

#: TrainConfig fields that set a GPTConfig field through their own option.
_MODEL_OPTIONS = ("block_size", "n_layer", "n_head", "n_embd")


@dataclass
class TrainConfig:
    """Everything a training run depends on; one CLI option per field (``geomuon pretrain --help``)."""
    model: str = "demo"  # a name in geomuon.pretrain.model.CONFIGS
    strategy: str = "adamw"  # a name in geomuon.optimizers.assign.STRATEGIES (with a build_assignment hook: the run's label)
    data: str = "embedded"  # see geomuon.pretrain.data.load_data
    out_dir: str | None = "runs/pretrain"  # None: in memory only (no log, no checkpoints)
    steps: int = 200  # length of the schedule
    stop_after: int | None = None  # stop at this step (resume later) without changing the schedule
    batch_size: int = 16  # global batch, in sequences
    block_size: int | None = None  # context (default: the model config's)
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    model_overrides: dict = field(default_factory=dict)  # other GPTConfig fields, e.g. {"tie_weights": false} (JSON)
    lr: float = 0.02  # matrix updates
    adamw_lr: float = 6e-4
    weight_decay: float = 0.1
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables
    dual_steps: int | None = None
    direction_dtype: str = "default"  # "default" | "fp32" | "bf16": optimizer direction compute dtype
    w_max: float = 2.0
    eval_every: int = 50
    eval_batches: int = 4
    final_eval_batches: int | None = None  # batches of the evaluation at the last step (None: eval_batches)
    val_seed: int | None = None  # seed of the validation windows (None: the run's seed)
    log_every: int = 1
    ckpt_every: int = 0  # 0: checkpoint at each eval and at the end
    seed: int = 0
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    compile: bool = False
    resume: bool = False
    progress: bool = True
    print_table: bool = True  # print the model summary and the assignment table before training

    def validate(self, named_strategy: bool = True) -> None:
        """Everything that can be checked without touching data: fail before training.
        ``named_strategy=False`` (a run whose optimizers a ``build_assignment`` hook
        builds) accepts any ``strategy`` label."""
        problems = []
        if self.model not in CONFIGS:
            problems.append(f"--config {self.model!r} is unknown; choose one of {sorted(CONFIGS)}")
        if named_strategy and self.strategy not in STRATEGIES:
            problems.append(f"--strategy {self.strategy!r} is unknown; choose one of {sorted(STRATEGIES)}")
        for name in ("steps", "batch_size", "eval_batches", "log_every"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be ≥ 1 (got {getattr(self, name)})")
        if self.final_eval_batches is not None and self.final_eval_batches < 1:
            problems.append(f"--final-eval-batches must be ≥ 1 (got {self.final_eval_batches})")
        if not isinstance(self.model_overrides, dict):
            problems.append(f"--model-overrides must be a JSON object (got {self.model_overrides!r})")
        else:
            known = {f.name for f in fields(GPTConfig)}
            for key in self.model_overrides:
                if key not in known:
                    problems.append(f"--model-overrides names {key!r}, not a GPTConfig field; "
                                    f"choose from {sorted(known)}")
                elif key in _MODEL_OPTIONS and getattr(self, key) is not None:
                    problems.append(f"{key} is set by both --{key.replace('_', '-')} and --model-overrides; keep one")
        if self.out_dir is None and self.resume:
            problems.append("--resume needs an --out-dir holding the checkpoint (out_dir is None)")
        if not 0 <= self.warmup_steps < self.steps:
            problems.append(f"--warmup-steps must be in [0, steps={self.steps}) (got {self.warmup_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"--min-lr-ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.stop_after is not None and not 0 < self.stop_after <= self.steps:
            problems.append(f"--stop-after must be in (0, steps={self.steps}] (got {self.stop_after})")
        if self.direction_dtype not in ("default", "fp32", "bf16"):
            problems.append(f"--direction-dtype must be default, fp32 or bf16 (got {self.direction_dtype!r})")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device must be auto, cpu or cuda (got {self.device!r})")
        if self.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda was asked for but CUDA is not available; use --device cpu")
        for name in ("lr", "adamw_lr"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name.replace('_', '-')} must be > 0")
        if problems:
            raise ValueError("bad training config:\n  " + "\n  ".join(problems))


@dataclass
class TrainResult:
    """What a run returns: train losses by step, eval metrics, divergence verdict, wall time,
    the model and its optimizers."""
    out_dir: str | None
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss
    evals: list[dict] = field(default_factory=list)
    diverged: bool = False
    wall_time: float = 0.0
    last_step: int = 0
    model: GPT | None = None  # the trained model (unwrapped), on its device
    assignment: Assignment | None = None  # its optimizers (per-parameter table: .table())


# ----------------------------------------------------------------------------- helpers


def lr_factor(step: int, cfg: TrainConfig) -> float:
    r"""Warmup then cosine: $\min(1, (s+1)/w)$ for $s < w$, then
    $r + (1-r)\tfrac12(1 + \cos(\pi (s-w)/(S-w)))$ with $r$ = ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def owners(params: list[torch.Tensor], world: int) -> list[int]:
    """Owner rank of each parameter: greedy, largest matrix work first (∝ m·n·min(m, n)
    for a polar factor), so every rank does about 1/world of the orthogonalisations."""
    cost = [p.numel() * (min(p.shape[-2:]) if p.dim() >= 2 else 1) for p in params]
    load = [0] * world
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -cost[i]):
        rank = min(range(world), key=lambda r: load[r])
        owner[i] = rank
        load[rank] += cost[i]
    return owner


class Distributed:
    """Rank bookkeeping; a no-op when ``WORLD_SIZE`` is unset or 1."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world > 1
        if self.enabled and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.enabled:
            dist.barrier()

    def close(self):
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- checkpoints


def _portable_state(assignment: Assignment) -> dict:
    """Optimizer states without the live objects of the groups (manifolds, regulators):
    those are rebuilt by the strategy and re-attached on load."""
    state = assignment.state_dict()
    for opt_state in state.values():
        for group in opt_state["param_groups"]:
            group.pop("manifold", None)
            group.pop("regulate", None)
    return state


def _load_portable_state(assignment: Assignment, state: dict) -> None:
    for name, opt in assignment.optimizers.items():
        if name in state:
            for saved, live in zip(state[name]["param_groups"], opt.param_groups):
                for key in ("manifold", "regulate"):
                    if key in live:
                        saved[key] = live[key]
    assignment.load_state_dict(state)


def save_checkpoint(path: str, payload: dict) -> None:
    """Write ``payload`` atomically to ``path``; the previous file becomes ``*.prev.pt``."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        prev = previous_checkpoint(path)
        try:  # a hard link keeps `path` valid until the new file replaces it
            os.link(path, prev + ".tmp")
        except OSError:
            shutil.copy2(path, prev + ".tmp")
        os.replace(prev + ".tmp", prev)
    os.replace(tmp, path)


def previous_checkpoint(path: str) -> str:
    """Path of the checkpoint kept before ``path`` was last overwritten (``ckpt.prev.pt``)."""
    return path[: -len(".pt")] + ".prev.pt" if path.endswith(".pt") else path + ".prev"


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint; an unreadable one raises ``ValueError`` naming the file and the
    previous checkpoint to fall back on."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist; start without --resume")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(payload, dict) or "model" not in payload:
            raise ValueError("not a geomuon checkpoint")
    except Exception as err:  # torch raises several types for a damaged zip archive
        prev = previous_checkpoint(path)
        hint = (
            f"the previous checkpoint {prev!r} is intact: move it over {path!r} to resume from it"
            if os.path.isfile(prev)
            else "no previous checkpoint exists; restart without --resume"
        )
        raise ValueError(f"checkpoint {path!r} is truncated or corrupt ({err}); {hint}") from None
    return payload


# ----------------------------------------------------------------------------- metrics


@torch.no_grad()
def weight_metrics(assignment: Assignment, model: torch.nn.Module) -> dict[str, dict]:
    """σ_max (power iteration, fp32, 30 steps) and column-norm spread max/min on the
    constrained side (the columns of the tall orientation) of every hidden matrix."""
    sigma, spread = {}, {}
    params = dict(model.named_parameters())
    for row in assignment.rows:
        if row.role in ATTENTION_ROLES + MLP_ROLES + ("router", "lm_head"):
            W = params[row.name].detach().float()
            W = W if W.shape[-2] >= W.shape[-1] else W.mT
            sigma[row.name] = float(power_iteration(W, steps=30)[0])
            norms = W.norm(dim=-2)
            spread[row.name] = float(norms.max() / norms.min().clamp_min(1e-30))
    return {"sigma_max": sigma, "column_spread": spread}


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's validation windows: batches ``0 … batches-1`` of
    :meth:`geomuon.pretrain.data.TokenData.batch` on the ``"val"`` split with ``seed`` (the same
    windows at every evaluation of a run). :func:`evaluate` scores them; the
    ``extra_metrics`` hook of :func:`train` receives this object to read them too."""

    step: int
    data: TokenData
    batches: int
    batch_size: int
    block_size: int
    seed: int
    device: torch.device

    def windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` token batches ``[batch_size, block_size]`` (int64) on ``device``."""
        for i in range(self.batches):
            x, y = self.data.batch("val", self.batch_size, self.block_size, self.seed, i)
            yield x.to(self.device), y.to(self.device)


@torch.no_grad()
def evaluate(model: GPT, evaluation: Evaluation, autocast=contextlib.nullcontext) -> dict:
    """Validation metrics on ``evaluation``'s windows: loss, accuracy, max activation,
    attention logits and softmax Jacobian (and the certified bound of a Lipschitz model)."""
    from geomuon.pretrain import monitoring

    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    activation: dict[str, float] = {}
    blocks = {f"h.{i}": block for i, block in enumerate(model.h)}
    with model.observe() as attention, monitoring.ActivationMonitor(model, blocks) as monitor:
        for x, y in evaluation.windows():
            with autocast():
                logits, loss = model(x, y)
            total_loss += loss.item() * y.numel()
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
        activation = monitor.summary()
    activation.pop("max", None)
    model.train()
    metrics = {
        "val_loss": total_loss / count,
        "val_acc": correct / count,
        "max_activation": max(activation.values(), default=float("nan")),
        "activation": activation,
        "max_attn_logit": max(r.max_logit for r in attention.values()),
        "attn_logit": {k: r.max_logit for k, r in attention.items()},
        "softmax_jacobian": {k: r.mean_jacobian_norm for k, r in attention.items()},
    }
    if model.config.lipschitz:
        from geomuon.theory.lipschitz import transformer_lipschitz_bound

        metrics["lipschitz_bound"] = transformer_lipschitz_bound(model.lipschitz_weights()).bound
    return metrics


# ----------------------------------------------------------------------------- the loop


def _device(cfg: TrainConfig, ddp: Distributed) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(ddp.local_rank)
    return torch.device("cuda", ddp.local_rank)


AssignmentFactory = Callable[[GPT, Hyper], Assignment]
ExtraMetrics = Callable[[GPT, Evaluation], dict]


def build(cfg: TrainConfig, data: TokenData, device: torch.device,
          build_assignment: AssignmentFactory | None = None) -> tuple[GPT, Assignment]:
    """The model (seeded init, same on every rank) and its optimizers:
    ``build_assignment(model, hyper)`` when given, else ``assign(model, cfg.strategy, hyper)``."""
    char_level = data.itos is not None
    options = {name: getattr(cfg, name) for name in _MODEL_OPTIONS}
    model_cfg = get_config(
        cfg.model,
        **{**cfg.model_overrides, **{k: v for k, v in options.items() if v is not None}},
        **({"vocab_size": data.vocab_size} if char_level else {}),
    )
    if data.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"data {data.source} has vocab {data.vocab_size} > the model's {model_cfg.vocab_size}; "
            f"use a config with a larger vocab_size"
        )
    data.check_context(model_cfg.block_size)
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg).to(device)
    direction = {"default": None, "fp32": torch.float32, "bf16": torch.bfloat16}[cfg.direction_dtype]
    hyper = Hyper(
        lr=cfg.lr,
        adamw_lr=cfg.adamw_lr,
        weight_decay=cfg.weight_decay,
        dual_steps=cfg.dual_steps,
        compute_dtype=direction,
        w_max=cfg.w_max,
    )
    if build_assignment is None:
        return model, assign(model, cfg.strategy, hyper)
    assignment = build_assignment(model, hyper)
    if not isinstance(assignment, Assignment):
        raise TypeError(f"build_assignment returned a {type(assignment).__name__}; it must return an "
                        "geomuon.optimizers.assign.Assignment (e.g. from geomuon.optimizers.assign.assign)")
    return model, assignment


def train(cfg: TrainConfig, data: TokenData | None = None, *,
          build_assignment: AssignmentFactory | None = None,
          extra_metrics: ExtraMetrics | None = None) -> TrainResult:
    """Run (or resume) one training run; returns the losses, evals and verdict.

    Args:
        cfg: the run (``cfg.validate()`` is called first).
        data: the token data (default: ``load_data(cfg.data)``).
        build_assignment: ``f(model, hyper) -> Assignment`` building the optimizers of the
            freshly initialised ``model`` from the :class:`geomuon.optimizers.assign.Hyper` made of
            ``cfg`` — e.g. ``lambda model, hyper: assign(model, {role: Rule(...)}, hyper)``
            for a strategy of one's own, or a function that then swaps an optimizer or adds
            a regulator to a group. Default ``assign(model, cfg.strategy, hyper)``; with a
            hook ``cfg.strategy`` is only the run's label (progress bar, checkpoint). It
            runs on every rank and must build the same assignment each time (a resumed
            run loads its optimizer state into it).
        extra_metrics: ``f(model, evaluation) -> dict`` called at every evaluation (rank
            0, the unwrapped model, in training mode) after the built-in metrics; its
            keys are added to the evaluation's record (and log line: keep the values
            JSON-able). ``evaluation`` is the :class:`Evaluation` being scored
            (``evaluation.windows()`` yields its batches).
    """
    cfg.validate(named_strategy=build_assignment is None)
    ddp = Distributed("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    try:
        return _train(cfg, data, ddp, build_assignment, extra_metrics)
    finally:
        ddp.close()


def _train(cfg: TrainConfig, data: TokenData | None, ddp: Distributed,
           build_assignment: AssignmentFactory | None, extra_metrics: ExtraMetrics | None) -> TrainResult:
    if cfg.batch_size % ddp.world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of the {ddp.world} processes")
    device = _device(cfg, ddp)
    data = data or load_data(cfg.data)
    model, assignment = build(cfg, data, device, build_assignment)
    block_size = model.config.block_size
    say = print if ddp.main else (lambda *a, **k: None)
    if cfg.print_table:
        say(f"model {cfg.model}: {model.num_params():,} parameters; data {data.source}: "
            f"{len(data.train):,} train / {len(data.val):,} val tokens, vocab {data.vocab_size}")
        say(assignment.table())

    on_disk = cfg.out_dir is not None
    if on_disk:
        os.makedirs(cfg.out_dir, exist_ok=True)
        ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
        log_path = os.path.join(cfg.out_dir, "log.jsonl")
    result = TrainResult(cfg.out_dir)
    start = 0
    if cfg.resume:
        payload = load_checkpoint(ckpt_path)
        _check_same_run(payload["config"], cfg)
        model.load_state_dict(payload["model"])
        _load_portable_state(assignment, payload["optimizer"])
        start = payload["step"]
        result.losses = {int(k): v for k, v in payload["losses"].items()}
        result.evals = payload["evals"]
        say(f"resumed from {ckpt_path} at step {start}")
    if ddp.main and on_disk:
        _rewrite_log(log_path, start, result)

    params = [p for group in assignment.param_groups for p in group["params"]]
    owner = owners(params, ddp.world)
    mine = [p for p, r in zip(params, owner) if r == ddp.rank]
    others = [p for p, r in zip(params, owner) if r != ddp.rank]
    train_model = model
    if ddp.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, find_unused_parameters=bool(model.config.n_experts))
    if cfg.compile:
        train_model = torch.compile(train_model)
    use_bf16 = device.type == "cuda"
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    for group in assignment.param_groups:
        group.setdefault("base_lr", group["lr"])

    end = cfg.stop_after or cfg.steps
    ckpt_every = cfg.ckpt_every or cfg.eval_every
    local = slice(ddp.rank * cfg.batch_size // ddp.world, (ddp.rank + 1) * cfg.batch_size // ddp.world)
    progress = _progress(range(start, end), ddp.main and cfg.progress, cfg.strategy)
    t0 = time.perf_counter()
    log = open(log_path, "a") if ddp.main and on_disk else None
    val_seed = cfg.seed if cfg.val_seed is None else cfg.val_seed

    def run_eval(step: int) -> None:
        if ddp.main:
            final = step == cfg.steps and cfg.final_eval_batches is not None
            batches = cfg.final_eval_batches if final else cfg.eval_batches
            evaluation = Evaluation(step, data, batches, cfg.batch_size, block_size, val_seed, device)
            record = {"kind": "eval", "step": step, "time": time.perf_counter() - t0,
                      **evaluate(model, evaluation, autocast), **weight_metrics(assignment, model)}
            if extra_metrics is not None:
                record.update(extra_metrics(model, evaluation))
            result.evals.append(record)
            _write(log, record)
            result.diverged |= not math.isfinite(record["val_loss"])

    try:
        if start == 0:  # the starting point of every curve
            run_eval(0)
        for step in progress:
            factor = lr_factor(step, cfg)
            for group in assignment.param_groups:
                group["lr"] = group["base_lr"] * factor
            x, y = data.batch("train", cfg.batch_size, block_size, cfg.seed, step)
            x, y = x[local].to(device), y[local].to(device)
            with autocast():
                _, loss = train_model(x, y)
            loss.backward()
            loss_value = _global_mean(loss.detach(), ddp)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
            if not (math.isfinite(loss_value) and math.isfinite(float(grad_norm))):
                result.diverged = True
                _write(log, {"kind": "diverged", "step": step, "loss": loss_value, "grad_norm": float(grad_norm)})
                say(f"step {step}: non-finite loss {loss_value} or gradient norm {float(grad_norm)}; stopping")
                break
            for p in others:  # sharded step: only the owner updates a parameter
                p.grad = None
            assignment.step()
            if ddp.enabled:
                for p, r in zip(params, owner):
                    dist.broadcast(p.data, src=r)
            assignment.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            result.losses[step] = loss_value
            result.last_step = step + 1
            if step % cfg.log_every == 0:
                _write(log, {"kind": "train", "step": step, "loss": loss_value, "lr_factor": factor,
                             "grad_norm": float(grad_norm)})
            if hasattr(progress, "set_postfix"):
                progress.set_postfix(loss=f"{loss_value:.3f}")
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                run_eval(done)
            if on_disk and (done % ckpt_every == 0 or done == end):
                _checkpoint(ckpt_path, model, assignment, cfg, done, result, ddp)
            if result.diverged:
                break
    finally:
        if log is not None:
            log.close()
    result.wall_time = time.perf_counter() - t0
    result.model = model
    result.assignment = assignment
    return result


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, dynamic_ncols=True, file=sys.stderr)


def _global_mean(loss: torch.Tensor, ddp: Distributed) -> float:
    if ddp.enabled:
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= ddp.world
    return float(loss)


def _write(log, record: dict) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()


def _rewrite_log(path: str, start: int, result: TrainResult) -> None:
    """A fresh run starts an empty log; a resumed one keeps the records before its step."""
    records = [{"kind": "train", "step": s, "loss": v} for s, v in sorted(result.losses.items()) if s < start]
    records += [e for e in result.evals if e["step"] <= start]
    records.sort(key=lambda r: r["step"])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


_RUN_IDENTITY = ("model", "strategy", "data", "steps", "batch_size", "block_size", "n_layer", "n_head",
                 "n_embd", "model_overrides", "lr", "adamw_lr", "weight_decay", "warmup_steps", "min_lr_ratio",
                 "seed")


def _check_same_run(saved: dict, cfg: TrainConfig) -> None:
    # a checkpoint written before a field existed ran with that field's default
    saved = {**asdict(TrainConfig()), **saved}
    changed = [f"{k}: {saved[k]!r} → {getattr(cfg, k)!r}" for k in _RUN_IDENTITY if saved[k] != getattr(cfg, k)]
    if changed:
        raise ValueError("--resume with a different run configuration (" + "; ".join(changed)
                         + "); use the original settings or a new --out-dir")


def _checkpoint(path, model, assignment, cfg, step, result, ddp: Distributed):
    state = _portable_state(assignment)
    if ddp.enabled:  # each rank holds the state of the parameters it owns: merge them
        gathered = [None] * ddp.world
        dist.all_gather_object(gathered, state)
        for other in gathered:
            for name, opt_state in other.items():
                state[name]["state"].update(opt_state["state"])
    if ddp.main:
        save_checkpoint(path, {
            "model": model.state_dict(),
            "optimizer": state,
            "step": step,
            "config": asdict(cfg),
            "model_config": asdict(model.config),
            "losses": result.losses,
            "evals": result.evals,
        })
    ddp.barrier()


# ----------------------------------------------------------------------------- CLI


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Fill the ``geomuon pretrain`` parser: one option per :class:`TrainConfig` field."""
    parser.description = "Pretrain a GPT with a per-module optimizer strategy (CPU, GPU, torchrun)."
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--config" if f.name == "model" else "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {"int": int, "float": float, "str": str, "dict": json_object}[f.type.split(" ")[0]]
            parser.add_argument(flag, dest=f.name, type=kind, default=default, help=f"default: {default}")
    parser.set_defaults(func=run)


def json_object(text: str) -> dict:
    """A command-line JSON object (``--model-overrides '{"tie_weights": false}'``)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run ``geomuon pretrain`` with parsed arguments; returns the exit code."""
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    try:
        result = train(cfg)
    except ValueError as err:
        print(f"geomuon pretrain: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        last = result.evals[-1] if result.evals else {}
        print(f"done: {result.last_step} steps in {result.wall_time:.1f}s, diverged={result.diverged}, "
              f"val_loss={last.get('val_loss', float('nan')):.4f}, log {os.path.join(cfg.out_dir, 'log.jsonl')}")
    return 1 if result.diverged else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m geomuon.pretrain.train")
    add_parser(parser)
    sys.exit(run(parser.parse_args()))
