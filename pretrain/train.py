r"""One training loop for one CPU, one GPU and many processes (``torchrun``).

``geomuon pretrain --config demo --strategy hetero --steps 200`` (see ``--help``);
on many processes ``torchrun --nproc_per_node 2 -m geomuon.pretrain.train --parallel ddp …``
(or ``torchrun --no-python … geomuon pretrain …``).

* **Options** are declared once, in :class:`geomuon.pretrain.config.TrainConfig`: every
  value is checked against its range or choices before any data is read, and ``--help``
  is generated from the same table.
* **Run folders are never overwritten.** By default each run writes to a fresh
  ``runs/<strategy>-<UTC time>``; a named ``--out-dir`` that already holds a run is
  refused unless ``--resume`` (continue it) or ``--overwrite`` (replace it).
* **Devices.** CPU runs in fp32. CUDA runs the forward under bf16 autocast (parameters,
  optimizer state and retractions stay fp32) and optionally ``torch.compile``.
* **Batches.** Each optimizer step sums ``grad_accum`` forward/backward passes of
  ``batch_size`` sequences (:func:`accumulate_gradients`): the windows are those of one
  batch of ``grad_accum × batch_size`` sequences drawn for the step, so the step equals
  that larger batch's up to round-off. The training loss stays on the device and is
  brought to the host every ``log_every`` steps (one synchronisation for the steps in
  between, which all keep their loss in :class:`TrainResult`).
* **Many processes.** ``--parallel`` under ``torchrun`` (``WORLD_SIZE > 1``);
  :func:`parallelize` is its one call point. ``ddp`` wraps the model in DDP (gloo on
  CPU, NCCL on GPU), which averages the gradients. Every rank draws the same global
  batch (:meth:`geomuon.pretrain.data.TokenData.batch`) and keeps its slice, so the run
  sees exactly the batches of a single-process run. The optimizer work — the
  orthogonalisations and dual ascents — is **sharded by parameter**: each parameter has
  one owner rank (greedy balance of the matrix work), every rank steps only the
  parameters it owns (the others have ``grad = None`` during the step, which every
  optimizer skips), and the owners' updates are then handed out with one all-gather
  per dtype (:class:`geomuon.pretrain.parallel.OwnerGather`).
  Optimizer state lives only on the owner.
* **Schedules.** Linear warmup then cosine decay to ``min_lr_ratio`` of every group's
  base learning rate (the matrix and AdamW rates share the schedule).
* **Checkpoints** are written atomically (temp file, fsync, ``os.replace``) and the
  previous one is kept as ``ckpt.prev.pt``; a write that fails (a full disk) removes its
  partial file and stops the run with :class:`RunWriteError` naming the file (the
  command line: one line, exit 1), the previous checkpoint intact (so does a log write that
  fails). Resuming restores
  parameters, optimizer state, the step and the log records; batches are a function of
  (seed, step), so the remaining losses and the log are bit-identical to an uninterrupted
  run on CPU.
  Under ``torchrun`` they are **distributed checkpoints** (``torch.distributed.checkpoint``):
  a folder ``dcp-step<N>`` in which every rank writes the shards and optimizer state it
  holds, renamed into place once complete; the latest two are kept
  (:func:`geomuon.pretrain.parallel.save_distributed`; a write that fails on any rank stops
  every rank with :class:`RunWriteError`, the partial folder removed). A run resumes from the newest
  checkpoint of its folder, of either kind, on any number of processes: the tensors are
  read into the new layout (:func:`geomuon.pretrain.parallel.load_distributed`); on the
  same world size the remaining steps are bit-identical to an uninterrupted run.
* **Interrupts.** SIGINT (Ctrl-C) or SIGTERM lets the current step finish, writes a
  checkpoint and raises :class:`TrainingInterrupted`; the command line prints
  ``interrupted at step N; resume with: …`` and exits with 128 + the signal number
  (130, 143). A second signal stops at once (the last checkpoint stays intact). Under
  torchrun the ranks agree on stopping by an all-reduce read back to the host, once every
  ``log_every`` steps (right after the losses come to the host), so a signal to any rank stops
  every rank within ``log_every`` steps; one in the last ``log_every - 1`` steps lets the run
  finish, with its end checkpoint.
* **Metrics** at each eval (rank 0, unwrapped model, fixed val batches): val loss and
  accuracy, max |activation| per block, max attention logit and mean softmax-Jacobian
  norm per layer, σ_max and column-norm spread per matrix, the Lipschitz bound for the
  Lipschitz variant. Everything goes to ``<out_dir>/log.jsonl``, one JSON object a line
  (strict JSON: a float that is not finite is written as the string ``"NaN"``,
  ``"Infinity"`` or ``"-Infinity"``, which :func:`read_log` turns back into the float); with
  ``out_dir=None`` the run stays in memory (no log, no checkpoint, no signal handling) and
  returns everything in :class:`TrainResult`.
* **Hooks** (:func:`train`'s keywords, for code that calls it): ``build_assignment``
  builds the optimizers for a strategy of one's own (a ``{role: Rule}`` mapping, an
  optimizer subclass, an extra regulator…), ``extra_metrics`` adds observables to every
  evaluation.

A run stops early, flagged ``diverged``, when the training loss or the gradient norm is
not finite (seen when the losses reach the host: at the next log step, evaluation or
checkpoint), or when a weight is not finite at a checkpoint (checked before writing it); it
never writes a non-finite checkpoint.

**Resuming** continues only the same run: the options that shape it (:data:`RUN_IDENTITY`),
its data (:attr:`geomuon.pretrain.data.TokenData.identity`: a changed file, vocabulary or set
of shards; not the path it is read from, which may change) and its model's shape are checked
against the checkpoint before any step, and a difference is refused by name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

try:
    import fcntl
except ImportError:  # Windows: run folders are not locked
    fcntl = None

from geomuon.manifolds.linalg import spectral_norm
from geomuon.optimizers.assign import ATTENTION_ROLES, MLP_ROLES, Assignment, Hyper, assign
from geomuon.optimizers.distributed import is_sharded, whole
from geomuon.optimizers.base import MatrixOptimizer
from geomuon.pretrain.config import (MODEL_OPTIONS, TrainConfig, add_options, command_line, from_args, is_template,
                                     launcher_value, option_text)
from geomuon.pretrain.data import BATCH_SEEDING, TokenData, identity_changes, load_data, read_from, spec_source
from geomuon.pretrain.model import GPT, GPTConfig, get_config
from geomuon.pretrain.monitoring import nan_max
from geomuon.pretrain.provenance import code_fingerprint, git_commit, machine
from geomuon.pretrain.parallel import (DCP_FORMAT, DamagedCheckpoint, RunWriteError, agreed, checked_record,
                                      checkpoint_write_error, dcp_folder, dcp_folders, from_rank_0, load_checked,
                                      load_distributed, read_record, save_distributed)
from geomuon.theory.lipschitz import DEFAULT_METHOD, transformer_lipschitz_bound


@dataclass
class TrainResult:
    """What a run returns: train losses by step, eval metrics, divergence verdict, wall time,
    the model and its optimizers."""
    out_dir: str | None
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss
    evals: list[dict] = field(default_factory=list)
    diverged: bool = False
    wall_time: float = 0.0  # seconds, summed over the sessions of a resumed run
    last_step: int = 0
    model: GPT | None = None  # the trained model (unwrapped), on its device
    assignment: Assignment | None = None  # its optimizers (per-parameter table: .table())


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped a run after ``step`` steps; with ``saved``, its checkpoint in
    ``out_dir`` holds them (resume with ``resume=True``); without, the run had diverged and
    nothing was written (``out_dir`` keeps its last finite checkpoint, if any). ``exit_code``
    is 128 + the signal number."""

    def __init__(self, step: int, signum: int, out_dir: str, saved: bool = True):
        self.step, self.signum, self.out_dir, self.saved = step, signum, out_dir, saved
        self.exit_code = 128 + signum
        where = (f"checkpoint in {out_dir!r}" if saved else
                 f"the run had diverged (see log.jsonl), so no checkpoint was written; {out_dir!r} keeps its last "
                 "finite one, if any")
        super().__init__(f"{signal.Signals(signum).name} at step {step}; {where}")


class DataRefusal(ValueError):
    """A refusal of the data this process loaded (:func:`load_run_data`). Under torchrun each rank
    loads its own copy (on several machines, files of its own), so the other ranks may not refuse
    it: the command line prints it on every rank that raises it (the others raise a ``ValueError``
    naming that rank, :func:`agreed_data`). Every other refusal is raised alike on every rank (the
    same options, rank 0's decisions sent to all, the same checkpoint files, and once the ranks
    have agreed on it the same data: :func:`build`'s checks of it and :func:`check_same_run`'s
    comparison of its tokens are plain ``ValueError``) and printed by rank 0 alone."""


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
    """Rank bookkeeping; a no-op when ``WORLD_SIZE`` is unset or 1, unless ``parallel``
    asks for DDP/FSDP2 under ``torchrun`` (``MASTER_ADDR`` set): then one process is a
    world of one, so ``--parallel fsdp`` runs its sharded path (the CUDA smoke test).
    A process group the caller initialized before is used and left to it: :meth:`close`
    destroys only the group this object created (it had destroyed the caller's, whose next
    collective then failed with "Default process group has not been initialized")."""

    def __init__(self, device: str, parallel: str = "none"):
        self.world, self.rank, self.local_rank = map(launcher_value, ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
        self.enabled = self.world > 1 or (parallel != "none" and "MASTER_ADDR" in os.environ)
        self.created_group = self.enabled and not dist.is_initialized()
        if self.created_group:
            nccl = device.startswith("cuda")
            if nccl:  # before the first collective: NCCL runs each rank's on its current device
                torch.cuda.set_device(self.local_rank)
            dist.init_process_group(backend="nccl" if nccl else "gloo")

    @classmethod
    def of_run(cls, cfg: TrainConfig) -> Distributed:
        """The processes of ``cfg``'s run: NCCL where it runs on CUDA, else gloo."""
        return cls("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu", cfg.parallel)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.enabled:
            dist.barrier()

    def largest(self, value: int) -> int:
        """The largest ``value`` over the ranks (an all-reduce of one integer)."""
        if not self.enabled:
            return value
        tensor = torch.tensor([value], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def every(self, flags: torch.Tensor) -> list[bool]:
        """Whether each of ``flags`` (a bool tensor on this rank's device) holds on every rank:
        one all-reduce and one read back to the host."""
        flags = flags.to(torch.int32)
        if self.enabled:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return [bool(flag) for flag in flags.tolist()]

    def close(self):
        """Destroy the process group if this object created it (the caller's stays)."""
        if self.created_group and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- run folders


def literal_out_dir(path: str) -> str:
    """The ``out_dir`` that names the folder ``path`` itself, its braces doubled (``x{b}`` →
    ``x{{b}}``): what a resume command or a second :func:`resolve_out_dir` is given for a
    resolved folder (``x{b}`` itself had been refused as a template with an unknown field)."""
    return path.replace("{", "{{").replace("}", "}}")

#: The files that make a folder hold a run (refused as a fresh run's --out-dir).
RUN_FILES = ("ckpt.pt", "ckpt.prev.pt", "log.jsonl")


def run_files(path: str) -> list[str]:
    """The run files (:data:`RUN_FILES`) and distributed checkpoint folders present in ``path``."""
    return ([name for name in RUN_FILES if os.path.exists(os.path.join(path, name))]
            + [os.path.basename(folder) for _, folder in dcp_folders(path)])


def resolve_out_dir(cfg: TrainConfig) -> str | None:
    """The folder a run writes to: ``cfg.out_dir`` with ``{strategy}`` and ``{time}`` (UTC,
    ``YYYYmmdd-HHMMSS``) filled in — a templated name (:func:`is_template`) that exists already
    gets ``-2``, ``-3``, … — and ``{{``, ``}}`` written as one brace, checked: a folder holding a
    run is refused unless ``cfg.resume`` or ``cfg.overwrite``, and ``cfg.resume`` into one holding
    none. Creates nothing."""
    if cfg.out_dir is None:
        return None
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.strategy)
    try:
        path = cfg.out_dir.format(strategy=label, time=time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"{option_text('out_dir')} {cfg.out_dir!r} is not a folder template ({type(err).__name__}: "
                         f"{err}): its fields are {{strategy}} and {{time}}; write a literal brace as {{{{ or }}}}"
                         ) from None
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option_text('out_dir')} {path!r} is a file, not a folder; choose another one")
    if is_template(cfg.out_dir):  # every run gets its own folder
        base, n = path, 1
        while os.path.exists(path):
            n += 1
            path = f"{base}-{n}"
        return path
    found = run_files(path)
    nothing_to_resume = cfg.resume and not found
    if (nothing_to_resume or found and not (cfg.resume or cfg.overwrite)) and _held(path):
        raise _in_use(path)  # (first: the advice of the refusals below had led to this one second)
    if nothing_to_resume:  # (refused by load_checkpoint, it had loaded the data and built the model first)
        raise nothing_to_continue(path)
    if found and not (cfg.resume or cfg.overwrite):
        raise ValueError(
            f"{option_text('out_dir')} {path!r} already holds a run ({', '.join(found)}); continue it with "
            f"{option_text('resume', True)}, replace it with {option_text('overwrite', True)}, or leave it out "
            "for a fresh folder"
        )
    return path


#: The lock a run holds on its folder while it runs (:class:`RunFolderClaim`).
LOCK_FILE = ".lock"


def nothing_to_continue(path: str, what: str = "run") -> ValueError:
    """The refusal of ``--resume`` into the folder ``path`` that does not exist or holds no run:
    no ``what`` (a ``"run"``, a ``"comparison"``) to continue."""
    there = "holds no run" if os.path.isdir(path) else "does not exist"
    return ValueError(f"{option_text('resume', True)}: {option_text('out_dir')} {path!r} {there}, so there is no "
                      f"{what} to continue; start without {option_text('resume', True)}, or give the folder of the "
                      f"{what} to continue")


def _in_use(path: str) -> ValueError:
    return ValueError(f"{option_text('out_dir')} {path!r} is in use by another run (it holds {LOCK_FILE!r}); wait "
                      "for it to finish or choose another one")


def _held(path: str) -> bool:
    """Whether a running run holds the folder ``path`` (:class:`RunFolderClaim`), asked without
    taking it: a shared lock on its ``.lock`` is refused while one holds it exclusively."""
    if fcntl is None:
        return False
    try:
        with open(os.path.join(path, LOCK_FILE), "rb") as file:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (dropped when the file closes)
    except BlockingIOError:
        return True
    except OSError:  # no .lock: no run has held it
        return False
    return False


class RunFolderClaim:
    """An exclusive lock on a run folder for the run's lifetime: ``fcntl.flock`` on
    ``<folder>/.lock``, which the operating system drops when the process ends, killed or
    not. Two runs started at once into one folder had both passed the checks (no run files
    yet) and then written into each other's checkpoints and log; now the second is refused
    before it loads its data. Where ``fcntl`` is missing (Windows) nothing is locked. A
    folder the claim created, or that its caller created for it (``fresh``: a comparison's
    templated folder), and no run wrote to is removed again by :meth:`release`.

    Only the holder removes ``.lock``, and only while it holds the lock; a claimant whose lock
    is on a file no longer at ``<folder>/.lock`` (it opened the file before the holder removed
    it) drops it and claims again, so that two runs never hold one folder."""

    def __init__(self, path: str, fresh: bool = False):
        self.path, self.fresh = path, fresh
        self.file = None
        while self.file is None:
            self.file = self._locked_file()

    def _locked_file(self):
        """``.lock`` opened and locked (``ValueError`` when another run holds it); ``None`` to
        claim again, when another run's :meth:`release` removed the file or folder meanwhile."""
        self.created = self.fresh or not os.path.exists(self.path)
        lock = os.path.join(self.path, LOCK_FILE)
        try:
            # (a releasing run removes its own folder, never a parent: a FileNotFoundError here is a
            # path that cannot exist, such as a link to a missing folder, which had been taken for
            # the race below and claimed again forever, silently)
            os.makedirs(self.path, exist_ok=True)
        except OSError as err:
            raise ValueError(f"{option_text('out_dir')} {self.path!r} cannot be created ({err.strerror}); choose "
                             "another one") from None
        try:
            file = open(lock, "a")
        except FileNotFoundError:  # a releasing run removed the folder after makedirs
            return None
        except OSError as err:
            raise ValueError(f"{option_text('out_dir')} {self.path!r} cannot be written ({err.strerror}); "
                             "choose another one") from None
        if fcntl is None:
            return file
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(file.fileno()), os.stat(lock)):
                return file
        except BlockingIOError:
            file.close()
            raise _in_use(self.path) from None
        except FileNotFoundError:  # locked after the holder removed it, with the folder
            pass
        file.close()  # a file no longer at .lock: locking it excludes no one
        return None

    def release(self) -> None:
        """Unlock the folder; one the claim created and no run wrote to is removed first, while the
        lock is held: removed after, a run that locked ``.lock`` in between lost it with the
        folder, and a third one could lock a new ``.lock`` and write beside it."""
        if fcntl is None:  # no lock to hold (and Windows removes no file that is open)
            self.file.close()
        with contextlib.suppress(OSError):  # the folder may be gone, or a claimant's new .lock in it: leave it
            if self.created and os.listdir(self.path) == [LOCK_FILE]:  # nothing was written: leave no folder
                os.remove(os.path.join(self.path, LOCK_FILE))
                os.rmdir(self.path)
        self.file.close()


def claim_out_dir(cfg: TrainConfig) -> tuple[str | None, RunFolderClaim | None]:
    """:func:`resolve_out_dir`, then the folder's :class:`RunFolderClaim`; a templated name that
    another run claimed between the two is resolved again (it then exists: the next suffix)."""
    for _ in range(100):
        path = resolve_out_dir(cfg)
        if path is None:
            return None, None
        try:
            return path, RunFolderClaim(path)
        except ValueError:
            if not is_template(cfg.out_dir) or not os.path.isdir(path):
                raise
    raise ValueError(f"{option_text('out_dir')} {cfg.out_dir!r}: no free folder among its first 100 names")


def _prepare_out_dir(path: str, overwrite: bool) -> None:
    """Create the run folder; with ``overwrite`` remove the run files of the run it held."""
    os.makedirs(path, exist_ok=True)
    if overwrite:
        for name in RUN_FILES:
            for leftover in (name, name + ".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(path, leftover))
        for _, folder in dcp_folders(path):
            shutil.rmtree(folder)


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str, payload: dict) -> None:
    """Write ``payload`` atomically to ``path``; the previous file becomes ``*.prev.pt``.
    A write that fails (``OSError``) removes its partial files and raises
    :class:`RunWriteError` naming ``path``, whether an earlier checkpoint is intact,
    and what to do (a full disk had raised a bare ``[Errno 28]`` and left the partial
    ``ckpt.pt.tmp`` taking the space)."""
    tmp = path + ".tmp"
    prev = previous_checkpoint(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            try:  # a hard link keeps `path` valid until the new file replaces it
                os.link(path, prev + ".tmp")
            except OSError:
                shutil.copy2(path, prev + ".tmp")
            os.replace(prev + ".tmp", prev)
        os.replace(tmp, path)
    except OSError as err:
        for partial in (tmp, prev + ".tmp"):
            with contextlib.suppress(OSError):
                os.remove(partial)
        raise checkpoint_write_error(path, err, path if os.path.exists(path) else None) from err


def previous_checkpoint(path: str) -> str:
    """Path of the checkpoint kept before ``path`` was last overwritten (``ckpt.prev.pt``)."""
    return path[: -len(".pt")] + ".prev.pt" if path.endswith(".pt") else path + ".prev"


#: What the checkpoint of a run holds (the tensors and :func:`_run_record`'s plain data).
RUN_CHECKPOINT_KEYS = ("model", "optimizer", "step", "config", "losses", "evals")


def resume_record(out_dir: str) -> tuple[str, dict]:
    """The checkpoint a run in ``out_dir`` resumes from (:func:`checkpoint_to_resume`) and its
    contents: a distributed checkpoint's plain data (its ``"format"`` is
    :data:`~geomuon.pretrain.parallel.DCP_FORMAT`), or a single file's tensors and data.
    ``ValueError`` naming the file when it is damaged or not a geomuon pretrain run's.

    Under torchrun every rank calls it (collective): rank 0 chooses the checkpoint for every rank,
    and whether it is a folder, and the ranks agree on the verdict of its read, so that all resume
    from the same checkpoint or raise the same refusal. Each rank had chosen on its own: one whose
    read of ``ckpt.pt``'s step failed (an I/O error on its machine) compared the times, and went on
    from another checkpoint or into another collective than the others."""
    def chosen() -> tuple[str, bool]:
        path = checkpoint_to_resume(out_dir)
        return path, os.path.isdir(path)

    together = dist.is_initialized()
    path, folder = from_rank_0(chosen, together)
    if folder:
        return path, distributed_record(path, together)
    payload = load_checkpoint(path, together)
    missing = [key for key in RUN_CHECKPOINT_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint {path!r} is not the checkpoint of a geomuon pretrain run (it has no "
                         f"{', '.join(map(repr, missing))}); move it out of {out_dir!r}, or resume a run from "
                         "its own folder")
    return path, payload


def _read_checkpoint(path: str) -> dict:
    payload = load_checked(path)
    if not isinstance(payload, dict) or "model" not in payload:
        raise ValueError("not a geomuon checkpoint")
    return payload


def _first_sentence(err: Exception) -> str:
    """The first sentence of an error (torch's zip errors go on with generic advice)."""
    return str(err).split(". ")[0].strip() or type(err).__name__


def load_checkpoint(path: str, together: bool = False) -> dict:
    """Read a checkpoint; an unreadable one raises ``ValueError`` naming the file and what
    to do: move the previous checkpoint over it when that one loads (it is read to be
    sure), or start again when neither does.

    ``together`` (every rank calls it; collective): every rank reads ``path`` and the ranks agree
    on the verdict, rank 0 alone reads the previous checkpoint, and every rank raises the same
    refusal (a read failing on one rank alone had raised there while the others went on into
    their next collective). Alone, no collective."""
    payload = problem = None  # problem: (what is wrong, whether the file is missing)
    if not os.path.isfile(path):
        problem = f"checkpoint {path!r} does not exist", True
    else:
        try:
            payload = _read_checkpoint(path)
        except Exception as err:  # torch raises several types for a damaged zip archive
            problem = f"checkpoint {path!r} is truncated or corrupt ({_first_sentence(err)})", False
    problem = agreed(problem, together)
    if problem is not None:
        raise from_rank_0(lambda: _refusal(path, *problem), together)
    return payload


def _refusal(path: str, problem: str, missing: bool) -> ValueError:
    """The refusal of the checkpoint ``path`` that cannot be read (``problem``; ``missing``: it
    does not exist) with what to do (:func:`load_checkpoint`)."""
    prev = previous_checkpoint(path)
    if not os.path.isfile(prev):
        if not missing:
            return _start_again(problem)
        if run_files(os.path.dirname(path) or "."):  # a log and no checkpoint: killed before its first
            return ValueError(f"{problem}: the run in its folder stopped before its first checkpoint; start it "
                              f"again with {option_text('overwrite', True)}")
        return ValueError(f"{problem}; start without {option_text('resume', True)}")
    try:
        step = _read_checkpoint(prev).get("step", "?")
    except Exception as err:
        return _start_again(problem, prev, f"corrupt too ({_first_sentence(err)})")
    return ValueError(f"{problem}; the previous checkpoint {prev!r} (step {step}) loads: move it over {path!r} to "
                      "resume from it")


def _start_again(problem: str, previous: str | None = None, damage: str = "damaged too") -> ValueError:
    """The refusal of a damaged checkpoint (``problem``) when no checkpoint of its run can be
    resumed: there is no previous one (``previous`` is ``None``), or ``previous`` is as ``damage``
    says (``"damaged too"``, ``"corrupt too (why)"``)."""
    if previous is None:
        return ValueError(f"{problem}; no previous checkpoint exists: start again with {option_text('overwrite', True)}")
    return ValueError(f"{problem}; the previous checkpoint {previous!r} is {damage}: no checkpoint of this run can be "
                      f"resumed, start again with {option_text('overwrite', True)}")


def checkpoint_to_resume(out_dir: str) -> str:
    """The checkpoint a resumed run starts from: the newest distributed checkpoint folder
    or ``ckpt.pt``, whichever holds the later step (a run may change its number of processes
    between sessions), the one written last for the same step; ``ckpt.pt`` when there is
    neither (:func:`load_checkpoint` says so). The times alone had chosen an older ``ckpt.pt``
    after a copy, ``touch`` or extraction of the folder, and its steps were trained again.

    The folder's step is in its name, ``ckpt.pt``'s in its record (read without its tensors);
    a ``ckpt.pt`` whose step cannot be read is compared by time, so that a damaged newest one
    is still the one chosen, and refused with the previous checkpoint offered."""
    single = os.path.join(out_dir, "ckpt.pt")
    folders = dcp_folders(out_dir)
    if not folders:
        return single
    step, folder = folders[-1]
    if not os.path.exists(single):
        return folder
    single_step = _checkpoint_step(single)
    if single_step is not None and single_step != step:
        return single if single_step > step else folder
    return single if os.path.getmtime(single) > os.path.getmtime(folder) else folder


def _checkpoint_step(path: str) -> int | None:
    """The step the single-file checkpoint ``path`` holds, read with its tensors memory-mapped,
    not read; ``None`` when it cannot be read (:func:`load_checkpoint` then says why)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception:  # torch raises several types for a damaged file
        return None


def distributed_record(folder: str, together: bool) -> dict:
    """The plain data of the distributed checkpoint ``folder``; a damaged one raises
    ``ValueError`` naming it and what to do (resume from the previous folder when that
    one is complete, or start again). ``together`` (under torchrun): every rank reads it and the
    ranks agree on the verdict (:func:`~geomuon.pretrain.parallel.read_record`): a read failing on one
    rank alone had sent that rank to check the previous folder while the others went on, and
    they waited for each other in different collectives."""
    with _previous_offered(folder, together):
        return read_record(folder, together)


@contextlib.contextmanager
def _previous_offered(folder: str, together: bool):
    """A :class:`DamagedCheckpoint` raised inside, about the distributed checkpoint ``folder``,
    raised again as a ``ValueError`` with what to do: resume from the previous folder when that
    one is complete, or start again. ``together`` (under torchrun): every rank enters it alike (the
    same checkpoint files) and the ranks check the previous folder together
    (:func:`~geomuon.pretrain.parallel.checked_record`: each rank its share of the files, one
    verdict for all, so that every rank raises the same refusal; each rank had read every file)."""
    try:
        yield
    except DamagedCheckpoint as err:
        older = [(step, path) for step, path in dcp_folders(os.path.dirname(folder)) if path != folder]
        if not older:
            raise _start_again(str(err))
        step, previous = older[-1]
        try:
            checked_record(previous, together)  # complete means its bytes too: a resume reads them all
        except ValueError:
            raise _start_again(str(err), previous) from None
        raise ValueError(f"{err}; the previous checkpoint {previous!r} (step {step}) is complete: remove "
                         f"{folder!r} to resume from it")


# ----------------------------------------------------------------------------- metrics


@torch.no_grad()
def weight_metrics(assignment: Assignment, model: torch.nn.Module) -> dict[str, dict]:
    """σ_max (exact: the largest singular value, fp32) and column-norm spread max/min on the
    constrained side (the columns of the tall orientation) of every hidden matrix. (A 30-step
    power iteration had logged a lower bound up to 3.6 % low where the top singular values
    cluster: DGram weights, trained q/k.)"""
    sigma, spread = {}, {}
    params = dict(model.named_parameters())
    for row in assignment.rows:
        if row.role in ATTENTION_ROLES + MLP_ROLES + ("router", "lm_head"):
            W = params[row.name].detach().float()
            W = W if W.shape[-2] >= W.shape[-1] else W.mT
            sigma[row.name] = float(spectral_norm(W))
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
    lipschitz_bound: str = DEFAULT_METHOD  # the certified bound of a Lipschitz model ("off": none)

    def windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` token batches ``[batch_size, block_size]`` (int64) on ``device``."""
        for i in range(self.batches):
            x, y = self.data.batch("val", self.batch_size, self.block_size, self.seed, i)
            yield x.to(self.device), y.to(self.device)


@torch.no_grad()
def evaluate(model: GPT, evaluation: Evaluation, autocast=contextlib.nullcontext) -> dict:
    """Validation metrics on ``evaluation``'s windows: loss, accuracy, max activation,
    attention logits and softmax Jacobian (and the certified bound of a Lipschitz model, by the
    method ``evaluation.lipschitz_bound`` names)."""
    from geomuon.pretrain import monitoring

    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    blocks = {f"h.{i}": block for i, block in enumerate(model.h)}
    with model.observe() as attention, monitoring.ActivationMonitor(model, blocks) as monitor:
        for x, y in evaluation.windows():
            with autocast():
                logits, loss = model(x, y)
            total_loss += loss.item() * y.numel()
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
        activation = monitor.summary()
    model.train()
    metrics = {
        "val_loss": total_loss / count,
        "val_acc": correct / count,
        "max_activation": activation.pop("max", math.nan),  # NaN when a block's output held one
        "activation": activation,
        "max_attn_logit": nan_max(r.max_logit for r in attention.values()),
        "attn_logit": {k: r.max_logit for k, r in attention.items()},
        "softmax_jacobian": {k: r.mean_jacobian_norm for k, r in attention.items()},
    }
    if model.config.lipschitz and evaluation.lipschitz_bound != "off":
        metrics["lipschitz_bound"] = transformer_lipschitz_bound(model.lipschitz_weights(),
                                                                 method=evaluation.lipschitz_bound).bound
        metrics["lipschitz_method"] = evaluation.lipschitz_bound
    return metrics


def checked_extra_metrics(extra, record: dict) -> dict:
    """What :func:`train`'s ``extra_metrics`` hook returned for the evaluation ``record``, refused
    (``ValueError`` naming the hook and the key, in memory and on disk alike) unless it is a dict
    of new keys whose values the log can write (:func:`log_line`: numbers, strings, lists, dicts).
    A key of the record had replaced the measured metric (``{"val_loss": …}`` then decided the
    divergence verdict and ``compare``'s table), and a tensor had stopped a run on disk with
    json's "Object of type Tensor is not JSON serializable", naming no hook."""
    if not isinstance(extra, dict):
        raise ValueError(f"extra_metrics returned a {type(extra).__name__}; return a dict of new metrics")
    taken = sorted(set(extra) & set(record))
    if taken:
        raise ValueError(f"extra_metrics returned {', '.join(map(repr, taken))}, which the evaluation measures "
                         "itself; name the hook's metrics otherwise")
    for key, value in extra.items():
        try:
            log_line({key: value})
        except (TypeError, ValueError) as err:
            raise ValueError(f"extra_metrics returned {key!r} = {type(value).__name__}, which the log cannot write "
                             f"({err}); return plain numbers (e.g. float(tensor)), strings, lists or dicts") from None
    return extra


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
    ``build_assignment(model, hyper)`` when given, else ``assign(model, cfg.strategy, hyper)``.
    A learning rate that a soft-capped group cannot hold is refused here
    (:func:`_check_soft_caps`), not at the step the warmup reaches it."""
    model_cfg = model_config(cfg, data)
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
        assignment = assign(model, cfg.strategy, hyper)
    else:
        assignment = build_assignment(model, hyper)
        if not isinstance(assignment, Assignment):
            raise TypeError(f"build_assignment returned a {type(assignment).__name__}; it must return an "
                            "geomuon.optimizers.assign.Assignment (e.g. from geomuon.optimizers.assign.assign)")
    _check_soft_caps(assignment)
    return model, assignment


def load_run_data(cfg: TrainConfig) -> TokenData:
    """``cfg.data`` loaded for ``cfg``'s model: token shards are read against the model's
    ``vocab_size`` (a model with GPT-2's 50257 had been refused shards whose every id is below
    it, because they were always read as a 50304-token vocabulary); a character-level source
    sets its own. A refusal of the data is a :class:`DataRefusal`."""
    vocab_size = get_config(cfg.model, **cfg.model_kwargs()).vocab_size
    try:
        return load_data(cfg.data, vocab_size=vocab_size)
    except ValueError as err:
        raise DataRefusal(str(err)) from None


def agreed_data(cfg: TrainConfig, data: TokenData | None, ddp: Distributed) -> TokenData:
    """``data`` (default: this process's :func:`load_run_data` of ``cfg``), once every rank of a
    torchrun run holds the same (:func:`check_same_data`). A rank whose load, or hash of its
    tokens, fails takes part in that one gather all the same, with its failure: it then raises its
    own exception (a :class:`DataRefusal`, which it prints, where the load refused its data), and
    every other rank a ``ValueError`` naming it. Each rank had loaded alone, and one that failed left the others waiting in the
    gather (gloo until its socket closed; NCCL until its timeout). One process: its own
    exception, and neither hash nor gather."""
    if ddp.world == 1:
        return data or load_run_data(cfg)
    try:
        data = data or load_run_data(cfg)
        mine = data.identity  # (the hash reads every token: a shard's read can fail here too)
    except Exception as err:
        mine = err
    check_same_data(mine, ddp)
    return data


def check_same_data(mine: dict | Exception, ddp: Distributed) -> None:
    """Refuse, on every rank alike, a torchrun run whose ranks read different data: each rank reads
    its own copy (on several machines, files of its own), and ranks of different vocabularies had
    aborted in the model's first broadcast (gloo: "Received data size doesn't match expected
    size"; NCCL waits until its timeout) while ranks of one vocabulary trained on different text.
    Every rank's ``mine`` — its data's :attr:`~geomuon.pretrain.data.TokenData.identity` (its tokens,
    wherever they are read from), or the exception its load raised, sent as its text — is gathered
    in one collective (every rank calls it). A rank whose load failed raises its own exception;
    while any did, the others raise a ``ValueError`` naming those ranks and the first one's
    message; else each identity is compared with rank 0's (:func:`identity_changes`): a
    ``ValueError`` naming the ranks whose data differs and how."""
    failed_here = isinstance(mine, Exception)
    identities = [None] * ddp.world
    dist.all_gather_object(identities, (str(mine) or type(mine).__name__) if failed_here else mine)
    if failed_here:
        raise mine
    failed = [rank for rank, identity in enumerate(identities) if isinstance(identity, str)]
    if failed:
        several = len(failed) > 1
        raise ValueError(f"rank{'s' if several else ''} {', '.join(map(str, failed))} could not read "
                         f"{'their' if several else 'its'} data (rank {failed[0]}: {identities[failed[0]]}); give "
                         f"every process a readable copy of its {option_text('data')}")
    changes = {rank: identity_changes(identities[0], identity) for rank, identity in enumerate(identities)}
    differ = [rank for rank, changed in changes.items() if changed]
    if differ:
        named = ", ".join(map(str, differ))
        raise ValueError(f"rank{'s' if len(differ) > 1 else ''} {named} read other data than rank 0's "
                         f"{identities[0]['source']} (rank {differ[0]}: {'; '.join(changes[differ[0]])}); give "
                         f"every process the same {option_text('data')} file contents")


def model_config(cfg: TrainConfig, data: TokenData) -> GPTConfig:
    """The configuration of ``cfg``'s model on ``data`` (char-level data sets ``vocab_size``)."""
    char_level = data.itos is not None
    return get_config(cfg.model, **cfg.model_kwargs(), **({"vocab_size": data.vocab_size} if char_level else {}))


def _check_soft_caps(assignment: Assignment) -> None:
    r"""Refuse a learning rate that a regulated group (the ``lipschitz`` strategy's soft cap)
    cannot follow (:meth:`~geomuon.optimizers.base.MatrixOptimizer.regulation_refusal`: one
    update can push a singular value further past ``w_max`` than a monotone soft cap can bring
    back). The step refuses such a rate too, so a warmup had reached it mid-run, with nothing of
    the run checkpointed. The schedule's peak is each group's base rate (:func:`lr_factor` ≤ 1),
    and the cap's reach $w_{\max}(1 - \text{lr}\cdot\text{wd}) + \eta(\text{lr})$ is linear in
    the rate for an optimizer's update bound, so its largest value over the schedule is at the
    peak or at most ``w_max`` (where no cap acts): checking the peak checks every step."""
    for optimizer in assignment.optimizers.values():
        if not isinstance(optimizer, MatrixOptimizer):  # (torch's optimizers take no regulator)
            continue
        for index, group in enumerate(optimizer.param_groups):
            peak = float(group["lr"])
            why = optimizer.regulation_refusal(index, peak)
            if why is None:
                continue
            lo, hi = 0.0, peak  # the largest rate that holds: bisection, to float64 round-off
            while lo < (mid := (lo + hi) / 2) < hi:
                lo, hi = (mid, hi) if optimizer.regulation_refusal(index, mid) is None else (lo, mid)
            rate = "adamw_lr" if group.get("update") == "adamw" else "lr"
            usable = (f"use {option_text(rate)} ≤ {_round_down(lo)} or a larger {option_text('w_max')}" if lo > 0
                      else f"no learning rate fits: use a larger {option_text('w_max')}")
            raise ValueError(f"{option_text(rate, peak)} is too large for the soft cap of "
                             f"{type(optimizer).__name__}'s group {index} (the lipschitz strategy's spectral cap, "
                             f"{option_text('w_max')}): one update can push a "
                             f"singular value further past w_max than the cap can bring back ({why}); {usable}")


def _round_down(x: float, digits: int = 3) -> str:
    """``x`` > 0 rounded down to ``digits`` significant digits, as text (a bound to stay below)."""
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return f"{math.floor(x / unit) * unit:.{digits}g}"


@dataclass
class Parallel:
    """How the training step is spread over processes: ``module`` runs the forward and
    backward passes; ``before_step`` and ``after_step`` run around the optimizer step."""
    module: torch.nn.Module
    before_step: Callable[[], None]
    after_step: Callable[[], None]
    #: the whole model for evaluation, called on every rank (FSDP gathers the shards
    #: into a replica); ``None``: the model itself
    full_model: Callable[[], torch.nn.Module] | None = None
    #: ids of the parameters whose optimizer state this rank holds (DDP: its own);
    #: ``None``: every parameter's (its shards under FSDP2)
    owned: set[int] | None = None


def parallelize(model: GPT, assignment: Assignment, cfg: TrainConfig, ddp: Distributed) -> Parallel:
    """The one call point of ``--parallel``: the model as one process trains it (``none``,
    or a single process), DDP with the optimizer work sharded by parameter owner
    (``ddp``), or ``geomuon.pretrain.parallel``'s FSDP2 (``fsdp``)."""
    if not ddp.enabled:
        return Parallel(model, _nothing, _nothing)
    from geomuon.pretrain import parallel

    return (parallel.fsdp if cfg.parallel == "fsdp" else parallel.ddp)(model, assignment, cfg, ddp)


def _nothing() -> None:
    pass


def accumulate_gradients(module: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         autocast=contextlib.nullcontext) -> torch.Tensor:
    r"""Forward and backward of each of the $K$ micro-batches with its loss scaled by $1/K$,
    so the parameters' ``.grad`` holds $\nabla \tfrac1K \sum_k L_k$ — with every $L_k$ the
    mean over the same number of tokens, the gradient of the mean loss of one $K$-times
    larger batch, up to the order of the sums. Returns that mean loss, detached, on the
    device (no host synchronisation). A DDP module averages across processes only at
    the last backward (``no_sync`` before it).

    Shapes: each ``(x, y)`` int64 ``[batch, block_size]``; the loss is fp32 (a scalar)."""
    count = len(micro_batches)
    total = None
    for k, (x, y) in enumerate(micro_batches):
        last = k == count - 1
        with contextlib.nullcontext() if last or not hasattr(module, "no_sync") else module.no_sync():
            with autocast():
                _, loss = module(x, y)
            (loss / count).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total / count


def _micro_batches(data: TokenData, cfg: TrainConfig, step: int, block_size: int, ddp: Distributed,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slices of the step's ``grad_accum`` micro-batches: the rows ``k·B + r·B/w``
    to ``k·B + (r+1)·B/w`` of the ``grad_accum × B`` windows drawn for the step. On CUDA
    they travel from pinned memory, asynchronously: a copy from pageable memory would
    make the host wait for the device at every step."""
    x, y = data.batch("train", cfg.batch_size * cfg.grad_accum, block_size, cfg.seed, step)
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    share = cfg.batch_size // ddp.world
    starts = (k * cfg.batch_size + ddp.rank * share for k in range(cfg.grad_accum))
    return [(x[s : s + share].to(device, non_blocking=True), y[s : s + share].to(device, non_blocking=True))
            for s in starts]


def train(cfg: TrainConfig, data: TokenData | None = None, *,
          build_assignment: AssignmentFactory | None = None,
          extra_metrics: ExtraMetrics | None = None, sharing: list[str] | None = None) -> TrainResult:
    """Run (or resume) one training run; returns the losses, evals and verdict.

    Args:
        cfg: the run (``cfg.validate()`` is called first, then its folder is resolved
            and checked by :func:`resolve_out_dir`: nothing is trained into a folder
            holding another run; and locked for the run by :class:`RunFolderClaim`: nor
            into one another run is writing to).
        data: the token data (default: :func:`load_run_data`).
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
            keys, new ones, are added to the evaluation's record (and log line: the values
            JSON-able; :func:`checked_extra_metrics` refuses others by name). ``evaluation`` is
            the :class:`Evaluation` being scored
            (``evaluation.windows()`` yields its batches).
        sharing: the strategies of a comparison that share ``cfg``'s options (``geomuon
            compare``): an option one of them takes is accepted in every run
            (:meth:`TrainConfig.validate`); default: this run's strategy alone.

    Raises:
        ValueError: a bad configuration, data or checkpoint, before any training step.
        TrainingInterrupted: SIGINT or SIGTERM (runs on disk only), after the checkpoint.
    """
    cfg.validate(named_strategy=build_assignment is None, sharing=sharing)
    if data is not None and data.source != spec_source(cfg.data):
        # the checkpoint records cfg.data, and a resume reloads it: other data had made the run
        # impossible to resume from the command line
        raise ValueError(f"train: the data passed ({data.source!r}) is not cfg.data ({cfg.data!r}); set "
                         "TrainConfig.data to its spec, or pass no data")
    ddp = Distributed.of_run(cfg)
    claim = None
    try:
        out_dir, claim = claimed_by_main(ddp, claim_out_dir, cfg)
        cfg = replace(cfg, out_dir=out_dir)
        stop = _StopRequest() if cfg.out_dir is not None else contextlib.nullcontext(_StopRequest())
        with stop as request:
            result = _train(cfg, data, ddp, build_assignment, extra_metrics, request)
        # every rank past its last collective before any rank tears the group down: a rank
        # destroying it while a peer's gloo work is in flight can abort that peer ("terminate
        # called without an active exception"); on an exception no barrier (a peer may be gone)
        ddp.barrier()
        return result
    finally:
        if claim is not None:
            claim.release()
        ddp.close()


def claimed_by_main(ddp: Distributed, claim: Callable[..., tuple[object, RunFolderClaim | None]], *args
                    ) -> tuple[object, RunFolderClaim | None]:
    """Rank 0's ``claim(*args)``, a value and the :class:`RunFolderClaim` rank 0 then holds (or
    ``None``), as ``(value, claim)`` on every rank, the claim ``None`` on the others; the
    exception it raised, raised on every rank. Rank 0 alone resolves, creates and locks a
    run's folder (every rank had made a templated folder of its own), and one broadcast
    (:func:`~geomuon.pretrain.parallel.from_rank_0`) sends the value or the refusal. A claim the broadcast fails
    after is released before the error is raised: the caller never received it."""
    held = None

    def claimed():
        nonlocal held
        value, held = claim(*args)
        return value

    try:
        value = from_rank_0(claimed, ddp.enabled)
    except BaseException:
        if held is not None:
            held.release()
        raise
    return value, held


class _StopRequest:
    """While entered (in the main thread), SIGINT and SIGTERM only record the signal in
    ``signum``; the loop stops at the end of its step (under torchrun at the next step the
    ranks agree on: see the module docstring). The first signal restores the
    previous handlers, so a second one acts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in self.SIGNALS}
        return self

    def _record(self, signum, frame) -> None:
        self.signum = signum
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


class RunLog:
    """The records of a run in order — kept for the checkpoint, so a resumed run's
    ``log.jsonl`` is the uninterrupted one's — and, on disk, appended to ``log.jsonl``."""

    def __init__(self, path: str | None, records: list[dict]):
        self.records = list(records)
        self.path, self.file = path, None
        if path is not None:
            tmp = path + ".tmp"
            try:
                with open(tmp, "w") as f:
                    f.writelines(log_line(record) for record in self.records)
                os.replace(tmp, path)
                self.file = open(path, "a")
            except OSError as err:  # (a resume's rewrite on a full disk had left the .tmp file)
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise self._write_error(err) from err

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.file is not None:
            try:
                self.file.write(log_line(record))
                self.file.flush()
            except OSError as err:  # (a full disk had raised a bare "[Errno 28]" naming no file)
                # the line stays in the file's buffer: closed here, or the run's final close had
                # flushed it again and raised a bare OSError in place of this one
                with contextlib.suppress(OSError):
                    self.file.close()
                self.file = None
                raise self._write_error(err) from err

    def _write_error(self, err: OSError) -> RunWriteError:
        return RunWriteError(err.errno, f"log {self.path!r} could not be written ({err.strerror or err}); a resume "
                             "rewrites it from the run's last checkpoint: make room and continue with "
                             f"{option_text('resume', True)} (or start again if no checkpoint was written)")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


#: How ``log.jsonl`` spells the floats JSON has no number for (JavaScript's and Python's names).
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def spell_nonfinite(value):
    """``value`` (nested dicts, lists and tuples) with every float that is not finite replaced
    by its name in :data:`NONFINITE`, for strict JSON (a bare ``NaN`` token, Python's default,
    is refused by ``jq`` and ``JSON.parse``); :func:`read_nonfinite` inverts it."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: spell_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [spell_nonfinite(v) for v in value]
    return value


def read_nonfinite(value):
    """``value`` read from JSON with the names of :data:`NONFINITE` back as floats (so a string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` always reads as the float)."""
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: read_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [read_nonfinite(v) for v in value]
    return value


def log_line(record: dict) -> str:
    """``record`` as one line of strict JSON (:func:`spell_nonfinite`)."""
    return json.dumps(spell_nonfinite(record), allow_nan=False) + "\n"


def read_log(path: str) -> list[dict]:
    """The records of a run's ``log.jsonl``, non-finite floats read back (:func:`read_nonfinite`).

    A last line cut short (no newline: the run was killed while writing it, or is writing it
    now) is left out, as a resume leaves it out (it rewrites the log from its checkpoint). Any
    other line that is not a JSON record raises ``ValueError`` naming the file and the line."""
    records = []
    with open(path, "rb") as f:  # bytes: a line whose UTF-8 is cut or damaged is named like the others
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                problem = None if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
            except ValueError as err:
                if not line.endswith(b"\n"):  # the last line, cut short
                    break
                problem = f"{err.msg}: column {err.colno}" if isinstance(err, json.JSONDecodeError) else "not UTF-8"
            if problem:
                raise ValueError(f"log {path!r}: line {number} is not a JSON record ({problem}); the log is damaged: "
                                 "rewrite it from the run's last checkpoint by running the run's command again "
                                 f"with {option_text('resume', True)}, or remove that line")
            records.append(read_nonfinite(record))
    return records


def _records_before(payload: dict) -> list[dict]:
    """The log records of a checkpoint written before checkpoints kept them: its train
    losses and evaluations in step order."""
    start = payload["step"]
    records = [{"kind": "train", "step": s, "loss": v} for s, v in sorted(payload["losses"].items()) if s < start]
    return sorted(records + [e for e in payload["evals"] if e["step"] <= start], key=lambda r: r["step"])


def _train(cfg: TrainConfig, data: TokenData | None, ddp: Distributed, build_assignment: AssignmentFactory | None,
           extra_metrics: ExtraMetrics | None, request: _StopRequest) -> TrainResult:
    device = _device(cfg, ddp)
    data = agreed_data(cfg, data, ddp)  # before the model: its first broadcast assumes one vocabulary
    model, assignment = build(cfg, data, device, build_assignment)
    block_size = model.config.block_size
    say = print if ddp.main else (lambda *a, **k: None)
    if cfg.print_table:
        say(f"model {cfg.model}: {model.num_params():,} parameters; data {data.source}: "
            f"{len(data.train):,} train / {len(data.val):,} val tokens, vocab {data.vocab_size}")
        say(assignment.table())

    on_disk = cfg.out_dir is not None
    result = TrainResult(cfg.out_dir)
    start, records, elapsed_before, provenance = 0, [], 0.0, []
    if on_disk:
        ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
        if cfg.resume:
            resume_from, payload = resume_record(cfg.out_dir)
            check_same_run(payload, cfg, data)
            # (rank 0's verdict: a rank whose stat failed had taken the other branch)
            distributed = payload.get("format") == DCP_FORMAT
            if not distributed:  # a distributed checkpoint loads into the parallelized model, below
                try:
                    model.load_state_dict(payload["model"])
                except RuntimeError as err:  # tensors of another model code (its config matched)
                    detail = " ".join(str(err).split())  # torch's list of the keys and shapes that differ
                    raise ValueError(f"checkpoint {resume_from!r} does not fit the model ({detail[:400]}); resume "
                                     f"with the geomuon version that wrote it, or use a new {option_text('out_dir')}"
                                     ) from None
                assignment.load_state_dict(payload["optimizer"])
            start = result.last_step = payload["step"]
            if cfg.stop_after is not None and cfg.stop_after < start:  # (it had exited 0, "done", training nothing)
                raise ValueError(f"--stop-after {cfg.stop_after} is before the checkpoint's step {start} in "
                                 f"{cfg.out_dir!r}: give a later {option_text('stop_after')}, or leave "
                                 f"{option_text('resume', True)} out for a new run")
            result.losses = {int(k): v for k, v in payload["losses"].items()}
            result.evals = payload["evals"]
            records = payload["log"] if "log" in payload else _records_before(payload)
            elapsed_before = payload.get("wall_time", 0.0)
            provenance = payload.get("provenance", [])  # (checkpoints before it recorded none)
            before, now = data_read_from(payload), read_from(data.source)
            resumed = (f"resumed from {resume_from} at step {start}"  # said once it has loaded (below)
                       + (f"; data read from {now} (before: {before})" if before not in (None, now) else ""))
        elif ddp.main:
            _prepare_out_dir(cfg.out_dir, cfg.overwrite)
        if cfg.print_table:
            say(f"run folder: {cfg.out_dir}")
        ddp.barrier()

    parallel = parallelize(model, assignment, cfg, ddp)
    if on_disk and cfg.resume:
        if distributed:
            # the previous folder may be complete (other settings: none is)
            with _previous_offered(resume_from, dist.is_initialized()):
                load_distributed(resume_from, model, assignment, parallel.owned, payload)
        say(resumed)
    # the log is rewritten from the checkpoint once it has loaded: a refused one leaves the log as it was
    log = RunLog(os.path.join(cfg.out_dir, "log.jsonl") if ddp.main and on_disk else None, records)
    if on_disk and ddp.main:  # rank 0 alone writes the checkpoint's record (git runs once, not on every rank)
        provenance = provenance + [segment_provenance(device, ddp.world, start, data)]
    whole_model = parallel.full_model or (lambda: model)
    train_model = torch.compile(parallel.module) if cfg.compile else parallel.module
    use_bf16 = device.type == "cuda"
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    for group in assignment.param_groups:
        group.setdefault("base_lr", group["lr"])

    end = cfg.stop_after or cfg.steps
    ckpt_every = cfg.ckpt_every or cfg.eval_every
    t0 = time.perf_counter() - elapsed_before
    last_saved: int | None = None  # the last step checkpointed by this session
    resumed_at = start if on_disk and cfg.resume else None  # the step of the checkpoint it resumed from
    val_seed = cfg.seed if cfg.val_seed is None else cfg.val_seed
    pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []  # steps whose loss is on the device

    def run_eval(step: int) -> None:
        evaluated = whole_model()  # every rank: FSDP gathers the shards
        if ddp.main:
            final = step == cfg.steps and cfg.final_eval_batches is not None
            batches = cfg.final_eval_batches if final else cfg.eval_batches
            evaluation = Evaluation(step, data, batches, cfg.batch_size, block_size, val_seed, device,
                                    cfg.lipschitz_bound)
            record = {"kind": "eval", "step": step, "time": time.perf_counter() - t0,
                      **evaluate(evaluated, evaluation, autocast), **weight_metrics(assignment, evaluated)}
            if extra_metrics is not None:
                record.update(checked_extra_metrics(extra_metrics(evaluated, evaluation), record))
            result.evals.append(record)
            log.write(record)
            result.diverged |= not math.isfinite(record["val_loss"])
        # rank 0 evaluated: every rank stops alike (a rank that saved or stepped on alone would
        # wait for its peers in a collective forever)
        result.diverged = bool(ddp.largest(int(result.diverged)))

    def flush() -> bool:
        """Bring the pending losses to the host (one synchronisation) and log them; False
        (and the run flagged diverged) at the first non-finite loss or gradient norm."""
        if not pending:
            return True
        values = torch.stack([torch.stack((loss.float(), norm.float())) for _, _, loss, norm in pending]).tolist()
        for (step, factor, _, _), (loss, norm) in zip(pending, values):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                result.diverged = True
                log.write({"kind": "diverged", "step": step, "loss": loss, "grad_norm": norm})
                warn(f"step {step}: non-finite loss {loss} or gradient norm {norm}; stopping")
                pending.clear()
                return False
            result.losses[step] = loss
            result.last_step = step + 1
            if step % cfg.log_every == 0:
                log.write({"kind": "train", "step": step, "loss": loss, "lr_factor": factor, "grad_norm": norm})
        if progress is not None:
            progress.set_postfix(loss=f"{values[-1][0]:.3f}", refresh=False)
        pending.clear()
        return True

    def warn(text: str) -> None:
        (progress.write if progress is not None else say)(text)  # above the bar, not through it

    def save(step: int) -> bool:
        """Checkpoint the ``step`` steps done: one file, or a distributed checkpoint (every
        rank); whether it was written. Weights that are not finite (a step whose loss and
        gradient were finite can still produce them) are not: the run is flagged diverged
        instead, and the last checkpoint stays its last finite one."""
        nonfinite = _nonfinite_parameters(model, ddp)
        if nonfinite:
            result.diverged = True
            log.write({"kind": "diverged", "step": step - 1, "nonfinite_parameters": nonfinite})
            warn(f"step {step - 1}: non-finite weights in {', '.join(nonfinite)}; stopping without a checkpoint")
            return False
        nonlocal last_saved
        result.wall_time = time.perf_counter() - t0  # what the checkpoint records, and a resume reads back
        last_saved = step
        # rank 0 alone writes the plain data (the other ranks would hash the data for nothing)
        record = _run_record(model, cfg, data, step, result, log, result.wall_time, provenance) if ddp.main else None
        if ddp.enabled:
            save_distributed(dcp_folder(cfg.out_dir, step), model, assignment, record, parallel.owned)
        else:
            save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": assignment.state_dict(), **record})
        return True

    def stop_if_asked(step: int) -> None:
        """After a signal (on any rank): checkpoint the ``step`` steps done, with their losses,
        then stop. Under torchrun the ranks agree by an all-reduce read back to the host (a
        synchronisation), so they ask only right after a step whose losses came to the host
        (``step - 1`` a multiple of ``log_every``), not at every step. A ``step`` the folder's
        newest checkpoint holds already is not written again, so the one before stays."""
        if ddp.enabled and (step - 1) % cfg.log_every:
            return
        signum = ddp.largest(request.signum)
        if signum:  # a run found diverged saves nothing, as at its other checkpoints
            # the folder's newest checkpoint is not written again (a second copy had pushed the
            # distinct checkpoint before it out of ckpt.prev.pt)
            saved = on_disk and flush() and (step in (last_saved, resumed_at) or save(step))
            raise TrainingInterrupted(step, signum, cfg.out_dir, saved=saved)

    progress = _progress(start, end, ddp.main and cfg.progress, f"{cfg.strategy} s{cfg.seed}")
    try:
        if not result.evals:  # the starting point of every curve
            stop_if_asked(start)  # a signal during the set-up
            run_eval(0)
        for step in range(start, end):
            stop_if_asked(step)
            factor = lr_factor(step, cfg)
            for group in assignment.param_groups:
                group["lr"] = group["base_lr"] * factor
            loss = accumulate_gradients(train_model, _micro_batches(data, cfg, step, block_size, ddp, device),
                                        autocast)
            grad_norm = whole(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf")))
            parallel.before_step()
            assignment.step()
            parallel.after_step()
            assignment.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            pending.append((step, factor, _global_mean(loss, ddp), grad_norm))
            done = step + 1
            evaluate_now = done % cfg.eval_every == 0 or done == cfg.steps
            save_now = on_disk and (done % ckpt_every == 0 or done == end)
            if (step % cfg.log_every == 0 or evaluate_now or save_now or done == end) and not flush():
                break
            if progress is not None:
                progress.update(1)
            if evaluate_now:
                run_eval(done)
            if save_now and not result.diverged:
                save(done)
            if result.diverged:
                break
        assignment.check_finite()  # the last step's skips and failures: no next step reports them
    finally:
        log.close()
        if progress is not None:
            progress.close()
    # a run that ends on a checkpoint reports the time that checkpoint records (not of its writing),
    # so reading a finished run back (a resume at its end) reports the same time
    if start == end:
        result.wall_time = elapsed_before
    elif last_saved != result.last_step:
        result.wall_time = time.perf_counter() - t0
    result.model = model
    result.assignment = assignment
    return result


def _progress(start: int, end: int, enabled: bool, desc: str):
    """A tqdm bar over the steps (``None`` when disabled); under another bar (``compare``'s)
    it is placed below it and cleared when done."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=end, initial=start, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr, leave=None)


def _global_mean(loss: torch.Tensor, ddp: Distributed) -> torch.Tensor:
    """The mean of ``loss`` over the ranks, on the device (no host synchronisation)."""
    if ddp.enabled:
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= ddp.world
    return loss


def _nonfinite_parameters(model: GPT, ddp: Distributed) -> list[str]:
    """The names of the parameters holding a value that is not finite on any rank (its shard
    under FSDP2): one reduction per parameter on the device, one all-reduce and one read
    back to the host for all of them."""
    named = list(model.named_parameters())
    finite = torch.stack([(p.to_local() if is_sharded(p) else p).detach().isfinite().all() for _, p in named])
    return [name for (name, _), ok in zip(named, ddp.every(finite)) if not ok]


#: The options a resumed run must share with its checkpoint: those that shape the batches,
#: the model, the schedule and the optimizer steps, and the validation windows (a curve
#: scored on other windows after the resume would step where training did not). The
#: intervals of logs, evaluations and checkpoints may change, and so may ``data``'s
#: spelling: the data's content is compared instead (:func:`check_same_run`).
RUN_IDENTITY = ("model", "strategy", "steps", "batch_size", "grad_accum", "block_size", "n_layer",
                "n_head", "n_embd", "model_overrides", "lr", "adamw_lr", "weight_decay", "warmup_steps",
                "min_lr_ratio", "grad_clip", "dual_steps", "direction_dtype", "w_max", "seed", "val_seed",
                "eval_batches", "final_eval_batches")


def _changed_options(changed: list[str]) -> ValueError:
    return ValueError("--resume with a different run configuration (" + "; ".join(changed)
                      + f"); use the original settings or a new {option_text('out_dir')}")


def check_same_run(record: dict, cfg: TrainConfig, data: TokenData) -> None:
    """Refuse to resume the checkpoint ``record`` (:func:`_run_record`'s data) as the run of
    ``cfg`` on ``data`` unless it is the same run: the options of :data:`RUN_IDENTITY`, the
    batch seeding (:data:`~geomuon.pretrain.data.BATCH_SEEDING`), the data
    (:attr:`~geomuon.pretrain.data.TokenData.identity`: its tokens, wherever they are read
    from) and the model's configuration. ``ValueError`` naming what changed and what to do.

    The model's shape options (:data:`~geomuon.pretrain.config.MODEL_OPTIONS`, ``model_overrides``)
    are compared by the model they build: ``--n-embd 32`` given or left to a config whose width is
    32 is the same run (the options as typed had been compared: ``n_embd: None → 32`` refused it).

    Under torchrun every rank calls it (a collective for a checkpoint that keeps no data identity)
    and checks the data it loaded itself (each rank its own copy, on several machines from files of
    its own), which the ranks have found the same (:func:`agreed_data`), with the checkpoint's
    record, the same on every rank: every rank raises a refusal alike."""
    # a checkpoint written before a field existed ran with that field's default
    saved = {**asdict(TrainConfig()), **record["config"]}
    shape_options = {*MODEL_OPTIONS, "model_overrides"}
    changed = [f"{k}: {saved[k]!r} → {getattr(cfg, k)!r}" for k in RUN_IDENTITY
               if k not in shape_options and saved[k] != getattr(cfg, k)]
    if changed:
        raise _changed_options(changed)
    seeding = record.get("batch_seeding", "linear")  # (checkpoints before it had the linear seeding)
    if seeding != BATCH_SEEDING:
        raise ValueError(f"the checkpoint's run drew its batches by the {seeding!r} seeding, which this geomuon "
                         f"version replaced by {BATCH_SEEDING!r} (geomuon.pretrain.data.BATCH_SEEDING): resumed here "
                         "it would train on other batches; resume with the geomuon version that wrote it, or use a "
                         f"new {option_text('out_dir')}")
    if "data" in record:
        changed, trained_on = identity_changes(record["data"], data.identity), data_read_from(record)
    else:  # (older checkpoints recorded no data identity: the spec alone is compared)
        # each rank compares the spec it was given (a path of its own machine): the first rank's
        # refusal on every rank (a rank refusing alone had left the others in the model's broadcast)
        together = dist.is_initialized()
        where = f" on rank {dist.get_rank()}" if together else ""
        changed = [f"data spec{where}: {saved['data']!r} → {cfg.data!r}, and the checkpoint keeps no sha256 of its "
                   "tokens to compare"] if saved["data"] != cfg.data else None
        changed, trained_on = agreed(changed, together), None
    if changed:
        now = read_from(data.source)
        restore = ("resume under the Python version that started the run (the embedded corpus is its "
                   "pydoc_data)" if trained_on == now == spec_source("embedded")
                   else "restore the data the run was trained on")
        where = "" if trained_on in (None, now) else f", read from {trained_on}"
        raise ValueError(f"--data {cfg.data}: the data differs from the data the run was trained on{where} ("
                         + "; ".join(changed) + f"); {restore}, or use a new {option_text('out_dir')}")
    built = asdict(model_config(cfg, data))
    # the saved options' model as this version builds it: what the options given change, apart
    # from what another geomuon version builds of them (the record's model, below)
    before = asdict(model_config(replace(cfg, **{k: saved[k] for k in shape_options}), data))
    changed = [f"{k}: {v!r} → {built[k]!r}" for k, v in before.items() if built[k] != v]
    if changed:
        raise _changed_options(changed)
    changed = [f"{k}: {v!r} → {built.get(k)!r}" for k, v in record["model_config"].items() if built.get(k) != v]
    if changed:
        raise ValueError(f"the checkpoint's model differs from the one --config {cfg.model} builds now ("
                         + "; ".join(changed) + "); resume with the geomuon version that wrote it, or use a new "
                         f"{option_text('out_dir')}")


def data_read_from(record: dict) -> str | None:
    """Where the run of checkpoint ``record`` last read its data: its last provenance segment's
    (:func:`~geomuon.pretrain.data.read_from`: an absolute path, links resolved), else the source
    it recorded as spelled (checkpoints before segments recorded it), else ``None``."""
    segments = [segment["data"] for segment in record.get("provenance", []) if "data" in segment]
    return segments[-1] if segments else record.get("data", {}).get("source")


def segment_provenance(device: torch.device, world: int, first_step: int, data: TokenData) -> dict:
    """What ran one segment of a run (its start, or a resume): the ``geomuon`` version, the commit
    of its checkout (:func:`~geomuon.pretrain.provenance.git_commit`: ``-dirty`` for uncommitted
    edits) and the fingerprint of its training code, torch's version, the device the run
    resolved (``--device auto`` records ``cpu`` or ``cuda:0``), the processes, the machine and
    where ``data`` was read from (:func:`~geomuon.pretrain.data.read_from`: a resume may read the
    same data from another path): a checkpoint's configuration alone had recorded ``"auto"`` and
    no code, so a run could not be said to have been reproduced."""
    from geomuon import __version__

    return {"first_step": first_step, "geomuon": __version__, "commit": git_commit(), "code": code_fingerprint(),
            "torch": str(torch.__version__), "device": str(device), "world_size": world, "machine": machine(),
            "data": read_from(data.source)}


def _run_record(model: GPT, cfg: TrainConfig, data: TokenData, step: int, result: TrainResult, log: RunLog,
                wall_time: float, provenance: list[dict]) -> dict:
    """What a checkpoint keeps besides the tensors (plain data), :func:`check_same_run`'s
    references among them, and ``provenance``: :func:`segment_provenance` of every segment of
    the run so far, in order (a resume may run other code or another machine; the run's numbers
    are then those of all of them)."""
    return {"step": step, "config": asdict(cfg), "model_config": asdict(model.config), "data": data.identity,
            "batch_seeding": BATCH_SEEDING, "losses": result.losses, "evals": result.evals, "log": log.records,
            "wall_time": wall_time, "provenance": provenance}


# ----------------------------------------------------------------------------- CLI


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Fill the ``geomuon pretrain`` parser: one option per :class:`TrainConfig` field."""
    parser.description = ("Pretrain a GPT with a per-module optimizer strategy (CPU, GPU, torchrun). "
                          "Ctrl-C saves a checkpoint and prints the command that resumes the run.")
    add_options(parser, TrainConfig)
    parser.set_defaults(func=run)


def resume_command(verb: str, *configs, defaults: dict | None = None) -> str:
    """The command that continues an interrupted run (``verb``: ``pretrain`` or
    ``compare``) with the options of ``configs`` (which say ``resume=True``)."""
    world = launcher_value("WORLD_SIZE")
    prefix = f"geomuon {verb}" if world == 1 else f"torchrun --nproc_per_node {world} --no-python geomuon {verb}"
    return command_line(prefix, *configs, exclude=("overwrite",), defaults=defaults)


def printing_rank() -> int | None:
    """This process's ``RANK`` (0 prints), ``None`` where it is not a valid one: then every process
    says what is wrong with it (train's config check refuses it)."""
    try:
        return launcher_value("RANK")
    except ValueError:
        return None


def say_refusal(verb: str, err: ValueError, rank: int | None) -> None:
    """Print ``geomuon <verb>: <err>`` on stderr where it is said. Under torchrun every rank
    raises a refusal alike, and rank 0 says it once; a :class:`DataRefusal` (of the data a rank
    loaded) may be one rank's alone, so each rank that raises one says it, prefixed ``[rank r]`` on
    ranks other than 0 (which rank's data is wrong), in one write of the whole line (ranks writing
    at once had interleaved their lines into one)."""
    if rank in (0, None) or isinstance(err, DataRefusal):
        sys.stderr.write(f"{f'[rank {rank}] ' if rank else ''}geomuon {verb}: {err}\n")


def run(args: argparse.Namespace) -> int:
    """Run ``geomuon pretrain`` with parsed arguments; returns the exit code."""
    cfg = from_args(TrainConfig, args)
    rank = printing_rank()
    main = rank in (0, None)
    try:
        result = train(cfg)
    except ValueError as err:
        say_refusal("pretrain", err, rank)
        return 2
    except RunWriteError as err:
        if main:  # rank 0 alone writes the log, and every rank raises a distributed checkpoint's (it names the rank)
            print(f"geomuon pretrain: {err.strerror}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        if main:
            again = replace(cfg, out_dir=literal_out_dir(stop.out_dir), resume=True, overwrite=False)
            print(f"interrupted at step {stop.step}; resume with: {resume_command('pretrain', again)}"
                  if stop.saved else f"geomuon pretrain: {stop}", file=sys.stderr)
        return stop.exit_code
    if main:
        last = result.evals[-1] if result.evals else None
        measured = f"val_loss={last['val_loss']:.4f} at step {last['step']}" if last else "no evaluation"
        print(f"done: {result.last_step} steps in {result.wall_time:.1f}s, diverged={result.diverged}, "
              f"{measured}, log {os.path.join(result.out_dir, 'log.jsonl')}")
        if result.last_step < cfg.steps and not result.diverged:  # --stop-after: as geomuon compare says it
            again = replace(cfg, out_dir=literal_out_dir(result.out_dir), resume=True, overwrite=False, stop_after=None)
            print(f"continue the run to step {cfg.steps} with: {resume_command('pretrain', again)}")
    return 1 if result.diverged else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m geomuon.pretrain.train")
    add_parser(parser)
    sys.exit(run(parser.parse_args()))
