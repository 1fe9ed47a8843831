r"""What every seed study shares: variants, the training run, the parallel runner with
its cache, mean ± std aggregation, figures and the results page.

A study module (``geomuon.pretrain.studies.<name>``, listed in
:data:`geomuon.pretrain.studies.STUDIES`) defines

* ``NAME``, ``TITLE`` and ``SIZES = {"full": {...}, "tiny": {...}}`` (see :class:`Size`);
* ``variants(size) -> list[Variant]`` — what is compared, each trained for every seed;
* ``extra_metrics(model, evaluation, memory) -> dict`` — study-specific observables
  added to every evaluation (``evaluation`` is the :class:`geomuon.pretrain.train.Evaluation`
  being scored, ``memory`` a per-run dict kept across evaluations);
* ``report(results, size, meta, figure_dir) -> str`` — the page body from the measured runs.

Every run is one :func:`geomuon.pretrain.train.train` call, in memory (no log, no checkpoint):
the variant's strategy and ``customize`` go through its ``build_assignment`` hook, the
study's observables through its ``extra_metrics`` hook, and every evaluation scores the
same validation windows (:data:`VAL_SEED`), the last one on more of them.

Runs are independent processes (``--jobs``, one torch thread each by default: these
models are too small for two threads to beat two processes). Each run has a folder under
the work directory, named by a hash of everything that defines it (the training code's
:func:`~geomuon.pretrain.provenance.code_fingerprint` included: a record is read back only
by the code that wrote it), and its record is
written there (``record.json``) when it completes, so an interrupted study resumes where
it stopped: complete runs are read back, the rest are trained. A study module may bring
its own ``run(study, size, data_path, work_dir, jobs, threads, fresh)`` with the
signature of :func:`run_all` (a learning-rate sweep runs in stages:
:mod:`geomuon.pretrain.studies.sweep`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gzip
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import platform
import re
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from geomuon.pretrain.provenance import (CHECKOUT, code_fingerprint, file_above, git_commit, machine, markdown_table,
                                         require_writable)

#: Seed of the validation windows: every run of a study is scored on the same text.
VAL_SEED = 1234
#: Bump when a record's fields change meaning (a change of the training code already
#: changes every run's key through its fingerprint).
RECORD_VERSION = 2


# ----------------------------------------------------------------------------- data


_GET_DATA = ("tinyshakespeare.txt (1,115,394 bytes, sha256 86c4e6aa…565ed, e.g. karpathy/char-rnn's "
             "data/tinyshakespeare/input.txt)")


def resolve_data(path: str | None) -> str:
    """The tiny-Shakespeare file given by ``--data`` (required: the studies' numbers are
    on that text, and nothing outside the package is assumed), checked against its sha256
    here, before any folder or worker exists; ``ValueError`` saying what to pass otherwise.
    Any file name works, ':' included (the path never goes through a data spec)."""
    from geomuon.pretrain.data import SHAKESPEARE_SHA256, read_text

    if not path:
        raise ValueError(f"--data PATH is required: the path of a copy of {_GET_DATA}")
    if Path(path).is_dir():  # had been refused as "no such file"
        raise ValueError(f"--data {path}: is a directory; pass the file itself (e.g. "
                         f"{Path(path) / 'tinyshakespeare.txt'}), a copy of {_GET_DATA}")
    # (pathlib drops a trailing "/": "input.txt/" is a path through the file itself)
    blocking = Path(path) if path.endswith(os.sep) and Path(path).is_file() else file_above(Path(path))
    if blocking is not None:  # "notes.txt/input.txt" had been refused as "no such file" too
        raise ValueError(f"--data {path}: {str(blocking)!r} above it is a file, not a directory; pass the path "
                         f"of a copy of {_GET_DATA}")
    if not Path(path).is_file():
        raise ValueError(f"--data {path}: no such file; pass the path of a copy of {_GET_DATA}")
    try:
        read_text(str(path), SHAKESPEARE_SHA256)  # the wrong file had been refused only inside the runs
    except ValueError as err:
        raise ValueError(f"--data {path}: {err}; pass the path of a copy of {_GET_DATA}") from None
    return str(path)


@functools.lru_cache(maxsize=2)
def load_text(path: str):
    """The character-level data of ``path`` (checked against its sha256), cached per
    process: a worker trains many runs on the same text."""
    from geomuon.pretrain.data import shakespeare_data

    return shakespeare_data(path)


# ----------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One arm of a study.

    Attributes:
        name: short identifier (file names, table rows).
        label: what it is, for the page.
        strategy: a name in :data:`geomuon.optimizers.assign.STRATEGIES` or a ``{role: Rule}``
            mapping, as :func:`geomuon.optimizers.assign.assign` takes it (roles it omits use
            AdamW, as for every strategy).
        customize: ``f(model, assignment, hyper) -> assignment`` applied after
            :func:`geomuon.optimizers.assign.assign` (a module-level function, so runs can be
            sent to worker processes).
        hyper: overrides of :class:`geomuon.optimizers.assign.Hyper` fields.
        model: overrides of the model config.
    """

    name: str
    label: str
    strategy: str | dict
    customize: Callable | None = None
    hyper: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)

    def __post_init__(self):
        # named by module and name in the run key, and sent to worker processes by that name: a
        # functools.partial had failed in identity() (no __qualname__), a lambda or a nested function
        # cannot be sent to a worker
        hook = self.customize
        if hook is not None and not (inspect.isfunction(hook) and hook.__qualname__ == hook.__name__):
            raise ValueError(f"Variant {self.name!r}: customize must be a function defined at the top level of a "
                             f"module (a def, found by its name in worker processes), not {hook!r}; wrap what it "
                             "does in one")

    def identity(self) -> dict:
        """Everything that defines the variant, as JSON-able data (for the cache key)."""
        strategy = self.strategy if isinstance(self.strategy, str) else {
            role: rule.describe() for role, rule in sorted(self.strategy.items())
        }
        customize = None if self.customize is None else f"{self.customize.__module__}.{self.customize.__qualname__}"
        return dict(name=self.name, strategy=strategy, customize=customize, hyper=self.hyper, model=self.model)


@dataclass(frozen=True)
class Size:
    """A study's training size and shared hyperparameters (every variant uses them)."""

    model: str  # a name in geomuon.pretrain.model.CONFIGS
    model_overrides: dict
    steps: int
    batch_size: int
    eval_every: int
    eval_batches: int  # validation batches at intermediate evaluations
    final_eval_batches: int  # validation batches at the last evaluation (the table's numbers)
    seeds: tuple[int, ...] = (0, 1, 2)
    lr: float = 0.02
    adamw_lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    w_max: float = 2.0


def size_from(study, name: str, seeds: list[int] | None = None) -> Size:
    """The size ``name`` of ``study`` (``ValueError`` naming the choices otherwise), with ``seeds`` in place of its own when given."""
    if name not in study.SIZES:
        raise ValueError(f"--size {name!r} is unknown for study {study.NAME}; choose one of {sorted(study.SIZES)}")
    size = study.SIZES[name]
    return dataclasses.replace(size, seeds=tuple(seeds)) if seeds is not None else size


# ----------------------------------------------------------------------------- one run


def train_config(size: Size, variant: Variant, seed: int, data_path: str):
    """The :class:`geomuon.pretrain.train.TrainConfig` of one (variant, seed) on the text at
    ``data_path``: in memory, quiet, validation windows drawn with :data:`VAL_SEED`."""
    from geomuon.pretrain.train import TrainConfig

    return TrainConfig(
        model=size.model, model_overrides={**size.model_overrides, **variant.model}, strategy=variant.name,
        data=f"shakespeare:{data_path}", out_dir=None, steps=size.steps, batch_size=size.batch_size, lr=size.lr,
        adamw_lr=size.adamw_lr, weight_decay=size.weight_decay, warmup_steps=size.warmup_steps,
        min_lr_ratio=size.min_lr_ratio, grad_clip=size.grad_clip, w_max=size.w_max,
        eval_every=size.eval_every, eval_batches=size.eval_batches, final_eval_batches=size.final_eval_batches,
        val_seed=VAL_SEED, seed=seed, device="cpu", progress=False, print_table=False,
    )


def assignment_factory(variant: Variant):
    """``build_assignment`` hook of a variant: its hyperparameter overrides, its strategy
    (name or mapping), then its ``customize``."""

    def build_assignment(model, hyper):
        from geomuon.optimizers.assign import assign

        hyper = dataclasses.replace(hyper, **variant.hyper)
        assignment = assign(model, variant.strategy, hyper)
        return assignment if variant.customize is None else variant.customize(model, assignment, hyper)

    return build_assignment


def train_run(study, variant: Variant, size: Size, seed: int, data_path: str) -> dict:
    """Train one (variant, seed) with :func:`geomuon.pretrain.train.train` and return its
    JSON-able record: ``train_loss`` of the steps taken (a step whose loss or gradient
    norm is not finite stops the run untaken and unrecorded), ``steps_done`` their count,
    every evaluation, and ``diverged`` as :func:`geomuon.pretrain.compare.verdict` judges it (a
    non-finite loss, or a final val loss 0.5 nat above the run's best)."""
    from geomuon.pretrain.compare import verdict
    from geomuon.pretrain.train import train

    memory: dict = {}
    data = load_text(data_path)
    result = train(train_config(size, variant, seed, data_path), data, build_assignment=assignment_factory(variant),
                   extra_metrics=lambda model, evaluation: study.extra_metrics(model, evaluation, memory))
    final, best, diverged = verdict(result, divergence_margin=0.5)
    return {
        "variant": variant.name, "seed": seed, "steps": size.steps, "steps_done": result.last_step,
        "diverged": diverged, "final_val_loss": final, "best_val_loss": best,
        "completed": result.last_step == size.steps and result.evals[-1]["step"] == size.steps,
        "train_loss": [result.losses[k] for k in sorted(result.losses)], "evals": result.evals,
        "wall_time": result.wall_time, "assignment": result.assignment.table(),
    }


# ----------------------------------------------------------------------------- runner


@dataclass(frozen=True)
class Job:
    """One training run of a study: a variant × seed at one size, whose record is written
    to ``folder/record.json`` when the run completes."""
    study: str  # name in geomuon.pretrain.studies.STUDIES (its extra_metrics)
    variant: Variant
    seed: int
    size: Size
    data: str
    folder: str
    threads: int


#: The file of a run's folder that holds its finished record (written last, atomically).
RECORD = "record.json"


def _key(study: str, variant: Variant, size: Size, seed: int, data_path: str, threads: int) -> str:
    from geomuon.pretrain.studies import STUDIES

    # threads: a CPU reduction split over another number of threads rounds otherwise, so a
    # rerun with another --threads had put runs of two thread counts in one table
    identity = dict(version=RECORD_VERSION, code=code_fingerprint(), run=_run_definition(), study=study,
                    variant=variant.identity(), hooks=_hook_sources(STUDIES[study].extra_metrics, variant.customize),
                    size=dataclasses.asdict(size) | {"seeds": None}, seed=seed, data=os.path.basename(data_path),
                    threads=threads)
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run_definition() -> str:
    """A hash of what this module makes of a (variant, size, seed): the sources of
    :func:`train_config`, :func:`assignment_factory` and :func:`train_run`, and
    :data:`VAL_SEED`. They live in ``pretrain/studies``, which
    :func:`~geomuon.pretrain.provenance.code_fingerprint` leaves out, so an edited run (another
    validation seed, another option passed to ``train``) had read back the records of the old
    one; the page-writing code beside them stays out of the key."""
    digest = hashlib.sha256(str(VAL_SEED).encode())
    for function in (train_config, assignment_factory, train_run):
        digest.update(inspect.getsource(function).encode())
    return digest.hexdigest()[:16]


def _hook_sources(*hooks: Callable | None) -> str:
    """A hash of the source files that define ``hooks`` (a study's ``extra_metrics``, a
    variant's ``customize``, and what those files hold beside them, such as a capped
    manifold): they decide what a run trains and records, yet live in ``pretrain/studies``,
    which :func:`~geomuon.pretrain.provenance.code_fingerprint` leaves out so that a page's
    wording can change without retraining (an edited ``customize`` had reused the old
    records)."""
    digest = hashlib.sha256()
    for path in sorted({inspect.getsourcefile(hook) for hook in hooks if hook is not None}):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def run_folder(work_dir: Path, study: str, variant: Variant, size: Size, seed: int, data_path: str,
               threads: int) -> Path:
    """The folder of one run under ``work_dir``: ``<variant>-s<seed>-<key>``, the key a hash
    of everything that defines the run, the training code's fingerprint and the torch thread
    count included (so a changed variant, size, engine or ``--threads`` never reuses a record;
    the old folder stays)."""
    name = re.sub(r"[^A-Za-z0-9_.=+-]", "_", variant.name)
    return work_dir / f"{name}-s{seed}-{_key(study, variant, size, seed, data_path, threads)}"


def _run_job(job: Job) -> dict:
    import torch

    from geomuon.pretrain.studies import STUDIES

    torch.set_num_threads(job.threads)
    record = train_run(STUDIES[job.study], job.variant, job.size, job.seed, job.data)
    folder = Path(job.folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_record(folder, record)
    return record


def _write_record(folder: Path, record: dict) -> None:
    """Write ``record`` to ``folder/record.json`` atomically: through a temporary file of this
    writer's own in the same folder (two runs of one study sharing a work directory, the same
    run in both, had shared one ``record.json.tmp``: one writer's ``os.replace`` moved the other's half-written file, or
    found it gone), removed when the write fails. A folder without ``record.json`` is an
    unfinished run; its readers look for that name alone."""
    tmp = folder / f"{RECORD}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "x") as f:
            f.write(json.dumps(record))
        os.replace(tmp, folder / RECORD)
    except BaseException:  # an interrupt as well: no partial file is left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def run_jobs(study, planned: list[tuple[Variant, int]], size: Size, data_path: str, work_dir: Path, jobs: int,
             threads: int, fresh: bool, say=print) -> tuple[dict[tuple[str, int], dict], int]:
    """The records of the ``(variant, seed)`` runs in ``planned``: read from their run folders
    when complete (unless ``fresh``), trained now otherwise, ``jobs`` at a time. Returns
    ``({(variant name, seed): record}, number read back)``. An interrupted call leaves the
    finished runs' records behind, so calling it again trains only the rest."""
    work_dir.mkdir(parents=True, exist_ok=True)
    todo, records = [], {}
    for variant, seed in planned:
        folder = run_folder(work_dir, study.NAME, variant, size, seed, data_path, threads)
        if (folder / RECORD).is_file() and not fresh:
            records[(variant.name, seed)] = json.loads((folder / RECORD).read_text())
        else:
            todo.append(Job(study.NAME, variant, seed, size, data_path, str(folder), threads))
    say(f"study {study.NAME}: {len(planned)} runs; {len(records)} complete, {len(todo)} to train with "
        f"{jobs} process(es) × {threads} thread(s)")
    if todo:
        if jobs == 1:
            finished = map(_run_job, todo)
        else:
            pool = multiprocessing.get_context("spawn").Pool(jobs)
            finished = pool.imap(_run_job, todo)
        try:
            for job, record in zip(todo, finished):
                records[(job.variant.name, job.seed)] = record
                say(f"  {job.variant.name:28s} seed {job.seed}: val loss {record['final_val_loss']:.4f}"
                    f"{' (diverged)' if record['diverged'] else ''} in {record['wall_time']:.0f}s")
        finally:
            if jobs != 1:
                pool.terminate()  # every result has been read; an interrupt must not wait for the rest
                pool.join()
    return records, len(planned) - len(todo)


def run_all(study, size: Size, data_path: str, work_dir: Path, jobs: int, threads: int, fresh: bool,
            say=print) -> tuple[dict[str, list[dict]], dict[str, Variant], int]:
    """Every (variant, seed) record of the study, read back or trained now: ``({variant:
    [records]}`` in the study's variant order, ``{name: variant}``, number read back)."""
    variants = study.variants(size)
    records, cached = run_jobs(study, [(v, s) for v in variants for s in size.seeds], size, data_path, work_dir,
                               jobs, threads, fresh, say)
    return ({v.name: [records[(v.name, s)] for s in size.seeds] for v in variants},
            {v.name: v for v in variants}, cached)


# ----------------------------------------------------------------------------- statistics


def finite(values) -> list[float]:
    """The finite numbers among ``values`` (``None``, NaN and ±inf dropped), as floats."""
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_std(values) -> tuple[float, float, int]:
    """Mean and sample standard deviation (n − 1) of the finite values, and their count;
    the deviation is NaN for fewer than two values (undefined, not zero spread)."""
    vals = finite(values)
    if not vals:
        return math.nan, math.nan, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else math.nan), len(vals)


def fmt(values, digits: int = 3, scientific: bool = False) -> str:
    """``mean ± std`` of the finite values; one finite value alone, marked ``(n = 1)`` (a
    deviation of one value is undefined: ``± 0.000`` had read as no spread); ``(k of n
    finite)`` when some are not finite."""
    values = list(values)
    mean, std, n = mean_std(values)
    if n == 0:
        return "—"
    text = f"{mean:.{digits}e}" if scientific else f"{mean:.{digits}f}"
    if n > 1:
        text += f" ± {std:.1e}" if scientific else f" ± {std:.{digits}f}"
    if n == len(values):
        return text if n > 1 else f"{text} (n = 1)"
    return f"{text} ({n} of {len(values)} finite)"


def separated(a, b) -> bool | None:
    """Whether two sets of seed values differ by more than their spreads:
    $|\\bar a - \\bar b| > s_a + s_b$ (the mean ± std bands do not overlap). ``None``
    when either side has fewer than two finite values."""
    ma, sa, na = mean_std(a)
    mb, sb, nb = mean_std(b)
    if na < 2 or nb < 2:
        return None
    return abs(ma - mb) > sa + sb


def screen_heading(seeds) -> str:
    """The opening of a page's "What the numbers say" section: what :func:`separated` calls
    resolved, and how many seeds the runs had (``seeds``: the size's, ``--seeds`` included;
    the pages had said "three seeds" whatever ``--seeds`` gave)."""
    n = len(seeds)
    return ("## What the numbers say\n\nA difference is called resolved only when the two mean ± std bands do "
            f"not overlap; with {n} seed{'' if n == 1 else 's'} per variant this is a rough screen, not a "
            "significance test.")


def compare_sentence(name_a: str, a, name_b: str, b, what: str, lower_is_better: bool | None = True,
                     digits: int = 3) -> str:
    """One sentence comparing two variants' seed values of ``what``, claiming a difference
    only when :func:`separated` says the bands do not overlap. ``lower_is_better=None``
    (an observable, not a score) says higher/lower instead of better/worse."""
    ma, _, _ = mean_std(a)
    mb, _, _ = mean_std(b)
    verdict = separated(a, b)
    if verdict is None:
        return f"{what}: {name_a} {fmt(a, digits)} vs {name_b} {fmt(b, digits)} (too few finite values to compare)."
    if not verdict:
        return (f"{what}: {name_a} {fmt(a, digits)} vs {name_b} {fmt(b, digits)} — the mean ± std bands "
                f"overlap: no difference resolved at this size.")
    if lower_is_better is None:
        word = "lower" if ma < mb else "higher"
    else:
        word = "better" if (ma < mb) == lower_is_better else "worse"
    return (f"{what}: {name_a} {fmt(a, digits)} vs {name_b} {fmt(b, digits)} — {name_a} is "
            f"{word} by more than the seed spread.")


def final_eval(record: dict) -> dict:
    """The last evaluation of a run record (the one scored on the most validation windows)."""
    return record["evals"][-1]


# ----------------------------------------------------------------------------- figures


def pyplot():
    """matplotlib's ``pyplot`` on the non-interactive Agg backend (figures are files, never windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colours(names):
    """One colour per name, in order, from matplotlib's default cycle."""
    plt = pyplot()
    return {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}


def save(fig, figure_dir: Path, name: str) -> str:
    """Write ``fig`` as ``figure_dir/name.png``, close it, and return the file name for the page."""
    plt = pyplot()
    figure_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure_dir / name, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return name


def plot_curves(results: dict[str, list[dict]], series: Callable[[dict], tuple[list, list]], title: str,
                ylabel: str, figure_dir: Path, name: str, logy: bool = False) -> str:
    """One axis: every seed of every variant as a thin line (one colour per variant)."""
    plt = pyplot()
    colour = colours(results)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for variant, records in results.items():
        for i, record in enumerate(records):
            xs, ys = series(record)
            ax.plot(xs, ys, color=colour[variant], alpha=0.75, lw=1.2, label=variant if i == 0 else None)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    return save(fig, figure_dir, name)


def loss_figures(results: dict[str, list[dict]], figure_dir: Path,
                 train_ylabel: str = "cross-entropy (nats)") -> list[str]:
    """The train-loss (per step) and validation-loss (per evaluation) figures of a page."""
    return [
        plot_curves(results, lambda r: (list(range(len(r["train_loss"]))), r["train_loss"]),
                    "train loss", train_ylabel, figure_dir, "train_loss.png"),
        plot_curves(results, lambda r: ([e["step"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]]),
                    "validation loss", "cross-entropy (nats)", figure_dir, "val_loss.png"),
    ]


def plot_panels(results: dict[str, list[dict]], per_layer: Callable[[dict], dict[str, float]], title: str,
                ylabel: str, figure_dir: Path, name: str, logy: bool = False) -> str:
    """One panel per variant, one colour per layer, every seed drawn."""
    plt = pyplot()
    n = len(results)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False, sharey=True)
    for ax, (variant, records) in zip(axes.flat, results.items()):
        layers = list(per_layer(records[0]["evals"][0]))
        colour = colours(layers)
        for record in records:
            steps = [e["step"] for e in record["evals"]]
            for layer in layers:
                ax.plot(steps, [per_layer(e).get(layer, math.nan) for e in record["evals"]], color=colour[layer],
                        alpha=0.7, lw=1.0, label=layer if record is records[0] else None)
        ax.set_title(variant, fontsize=9)
        ax.set_xlabel("step")
        if logy:
            ax.set_yscale("log")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=6)
    fig.subplots_adjust(hspace=0.45, wspace=0.12)
    fig.suptitle(title)
    return save(fig, figure_dir, name)


# ----------------------------------------------------------------------------- page


#: a published study's records, next to its page: ``<NAME>/results.json.gz``
RESULTS = "results.json.gz"


def read_results(path: str | Path) -> dict:
    """The payload :func:`write_page` stored: a page folder (``docs/results/NAME``) or the file
    itself; non-finite floats, stored by name, read back (:func:`~geomuon.pretrain.train.read_nonfinite`)."""
    from geomuon.pretrain.train import read_nonfinite

    path = Path(path)
    return read_nonfinite(json.loads(gzip.decompress((path / RESULTS if path.is_dir() else path).read_bytes())))


def write_page(study, size_name: str, size: Size, body: str, meta: dict, out_dir: Path,
               results: dict[str, list[dict]], variants: dict[str, Variant]) -> Path:
    """``<out_dir>/<NAME>.md`` (title, status, the study's body, config, provenance) and
    ``<out_dir>/<NAME>/results.json.gz`` (every run's record; see :func:`read_results`)."""
    from geomuon.pretrain.train import spell_nonfinite

    figure_dir = out_dir / study.NAME
    figure_dir.mkdir(parents=True, exist_ok=True)
    # the per-parameter assignment table is the same for every seed: stored once per variant
    identities = {name: {**variants[name].identity(), "assignment": records[0]["assignment"]}
                  for name, records in results.items()}
    runs = {name: [{k: v for k, v in r.items() if k != "assignment"} for r in records] for name, records in results.items()}
    payload = {"study": study.NAME, "size": size_name, "config": dataclasses.asdict(size), **meta,
               "variants": identities, "runs": runs}
    # strict JSON (a NaN metric, e.g. routing churn at the first evaluation, by name): jq and JSON.parse
    # read it; gzip: every run's per-step losses and per-evaluation observables are megabytes of JSON
    # (4x smaller compressed); mtime=0 makes the file a function of its content alone
    strict = json.dumps(spell_nonfinite(payload), default=str, allow_nan=False)
    (figure_dir / RESULTS).write_bytes(gzip.compress(strict.encode(), mtime=0))
    if size_name == "full":
        status = (f"Measured at the study's full default size (`--size full`): {meta['n_runs']} runs "
                  f"({len(results)} variants, seeds as listed), {size.steps} steps each.")
    else:
        status = (f'!!! warning "Not a result"\n    This page was written by a `--size {size_name}` run '
                  f"({size.steps} steps): a smoke test of the study's machinery. Its numbers say "
                  "nothing about the question; run the study at `--size full`.")
    # a sweep varies some of the size's settings per run (its rate, its seeds): the block says so
    # in their place (it had listed the size's lr and seeds as every run's)
    swept = study.swept_settings(size) if hasattr(study, "swept_settings") else {}
    config = json.dumps({"size": size_name, **dataclasses.asdict(size), **swept}, indent=1, default=str)
    uses = (f"Every run uses these settings except those the sweep sets per run ({', '.join(swept)}: described "
            "in place of a value; a run's rate is in its variant's name, and every run's record is in `"
            + RESULTS + "`)") if swept else (
        "Every variant uses these settings (the variants' own changes are listed above and in `" + RESULTS + "`)")
    provenance = markdown_table(["", ""], [
        ["command", f"`{meta['command']}`"],
        ["commit", f"`{meta['commit']}`"],
        ["data", f"`{meta['data']}`"],
        ["date (UTC)", meta["date"]],
        ["wall time", f"{meta['wall_time']:.0f} s ({meta['wall_time'] / 60:.1f} min) for the runs trained now; "
                      f"{meta['cached']} run(s) came from the cache"],
        ["summed run time", f"{meta['run_time']:.0f} s over {meta['n_runs']} runs"],
        ["machine", meta["machine"]],
        ["processes × threads", f"{meta['jobs']} × {meta['threads']}"],
    ])
    text = "\n\n".join([
        f"# {study.TITLE}",
        status,
        body.strip(),
        "## Configuration\n\n" + uses + ":\n\n```json\n" + config + "\n```",
        "## Provenance\n\n" + provenance + f"\n\nEvery run's record (losses, evaluations, the per-parameter "
        f"assignment table) is in [`{study.NAME}/{RESULTS}`]({study.NAME}/{RESULTS}) (gzip-compressed JSON; "
        f"`geomuon.pretrain.studies.common.read_results` reads it).",
    ]) + "\n"
    path = out_dir / f"{study.NAME}.md"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser, study) -> None:
    """The options every study takes."""
    parser.add_argument("--size", default="full", choices=list(study.SIZES),
                        help="full (default: the published size) or tiny (seconds: a smoke test, not a result)")
    parser.add_argument("--data", default=None, metavar="PATH", help=f"required: {_GET_DATA}")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--out", default=None, metavar="DIR",
                     help="directory of the results page, which must not hold one yet (default: a new "
                          "run folder runs/studies/<study>-<UTC time>/ under the current directory)")
    out.add_argument("--publish", action="store_true",
                     help="write the page into docs/results/ of the source checkout (a --size full run only)")
    parser.add_argument("--work-dir", default=None,
                        help="run cache, reused by later runs (default: runs/studies/cache/<study>/)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    # a sweep's seeds are its grid's: it says so itself (the generic help had offered a choice it refuses)
    parser.add_argument("--seeds", default=None, help=getattr(
        study, "SEEDS_HELP", "comma-separated seeds (default: the size's, "
        + "; ".join(f"{name}: {','.join(map(str, size.seeds))}" for name, size in study.SIZES.items()) + ")"))
    parser.add_argument("--fresh", action="store_true", help="retrain runs that are cached")
    if hasattr(study, "add_options"):  # a study's own options (manifolds-long-arms: --rates-from)
        study.add_options(parser)


def run_study(study, args: argparse.Namespace, argv_for_page: list[str] | None = None) -> Path:
    """Run every missing job of ``study`` (cached records are reused), then write its page; returns the page's path."""
    from geomuon.pretrain.data import SHAKESPEARE_SHA256
    from geomuon.pretrain.studies import STUDIES

    if STUDIES.get(study.NAME) is not study:
        # run keys and worker processes find a study by its NAME: an unlisted one (a user's own
        # sweep) had failed with a KeyError traceback
        raise ValueError(f"study {study.NAME!r} is not registered: add it to geomuon.pretrain.studies.STUDIES "
                         "(the run cache and the worker processes find a study by its NAME)")
    if args.seeds is not None and not getattr(study, "TAKES_SEEDS", True):
        # (a sweep's own check compares the size's seeds with its sizes': a --seeds equal to a
        # size's default had passed it and been ignored, the page's command still listing it)
        raise ValueError(f"--seeds: a sweep's seeds are its grid's, whatever --seeds says (got {args.seeds!r}); "
                         "drop --seeds")
    seeds = _seeds(args.seeds) if args.seeds is not None else None
    size = size_from(study, args.size, seeds)
    # one message per option (a shared one had left the user to guess which was wrong)
    for option, value, what in (("--jobs", args.jobs, "parallel runs"), ("--threads", args.threads,
                                                                          "torch threads per run")):
        if value < 1:
            raise ValueError(f"{option} {value}: it counts {what} and must be >= 1")
    for option, value in (("--out", args.out), ("--work-dir", args.work_dir)):
        if value is not None and not value.strip():
            # Path("") is the current directory: "--out $UNSET" had written the page there
            raise ValueError(f"{option} is empty; give a folder, or leave {option} out for its default")
    # a study's own options (add_arguments) give the study that trains and reports, refused here by
    # name, before any folder exists
    study = study.configured(args) if hasattr(study, "configured") else study
    data_path = resolve_data(args.data)
    out_dir = output_dir(study, args)
    work_dir = Path(args.work_dir) if args.work_dir else Path("runs") / "studies" / "cache" / study.NAME
    folders = (("--out", out_dir), ("--work-dir", work_dir))
    for option, folder in folders:
        # a file there, or above it, had raised FileExistsError / NotADirectoryError after all the training
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{option} {str(folder)!r} is a file, not a folder; choose another {option}")
        blocking = file_above(folder)
        if blocking is not None:
            raise ValueError(f"{option} {str(folder)!r}: {str(blocking)!r} above it is a file, not a folder; choose "
                             f"another {option}")
    # the first folder of each path that does not exist yet: the one its mkdir creates, parents included
    created = [next((p for p in reversed((folder, *folder.parents)) if not p.exists()), None) for _, folder in folders]
    try:
        for option, folder in folders:
            require_writable(option, folder)
        commit = git_commit(short=False)  # the code the runs are about to use
        start = time.perf_counter()
        runner = getattr(study, "run", run_all)  # a study with stages (a sweep) brings its own
        results, variants, cached = runner(study, size, data_path, work_dir, args.jobs, args.threads, args.fresh)
    except BaseException:
        # a refused --work-dir had left the --out folder just made; a failed or interrupted
        # study leaves no empty folder behind either (a run's cache is not empty: it stays)
        for (_, folder), top in zip(folders, created):
            _remove_empty(folder, top)
        raise
    wall = time.perf_counter() - start
    runs = [r for records in results.values() for r in records]
    command = "geomuon study " + study.NAME + " " + " ".join(shlex.quote(a) for a in (argv_for_page or []))
    meta = {
        "command": command.strip(), "commit": commit, "data": f"{data_path} (sha256 {SHAKESPEARE_SHA256})",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "wall_time": wall, "run_time": sum(r["wall_time"] for r in runs), "n_runs": len(runs),
        "cached": cached, "jobs": args.jobs, "threads": args.threads,
        "machine": f"{machine()}, torch {_torch_version()}, Python {platform.python_version()}",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    body = study.report(results, size, meta, out_dir / study.NAME)
    return write_page(study, args.size, size, body, meta, out_dir, results, variants)


def _remove_empty(folder: Path, top: Path | None) -> None:
    """Remove ``folder`` and its parents up to ``top`` (the first of them this study created;
    ``None``: none), each only while it is empty."""
    if top is None:
        return
    for path in (folder, *folder.parents):
        try:
            path.rmdir()
        except OSError:  # not empty (a run's record, the other folder) or gone: what is left stays
            return
        if path == top:
            return


def _seeds(text: str) -> list[int]:
    """``--seeds`` as distinct integers, refused by name otherwise (a seed listed twice had
    counted one run twice, and its seed-spread comparisons were of one run with itself)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:  # "--seeds ," had shared one message with --jobs and --threads
        raise ValueError(f"--seeds must name at least one seed, got {text!r}; e.g. --seeds 0,1,2")
    negative = [s for s in seeds if s < 0]
    if negative:
        raise ValueError(f"--seeds must be integers >= 0, got {', '.join(map(str, negative))}")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ValueError(f"--seeds lists {', '.join(map(str, twice))} more than once; give each seed once")
    return seeds


def output_dir(study, args: argparse.Namespace) -> Path:
    """Where the page goes, decided (and refused) before any training: ``--publish`` →
    ``docs/results/`` of the checkout, for a ``--size full`` run only; ``--out DIR`` → DIR,
    unless it already holds this study's page; else a new run folder
    ``runs/studies/<study>-<UTC time>/`` under the current directory."""
    if args.publish:
        if CHECKOUT is None:
            raise ValueError("--publish writes docs/results/ of a source checkout, and this geomuon is an "
                             "installed package; use --out DIR, or run from a clone (`make setup`)")
        if args.size != "full":
            raise ValueError(f"--publish with --size {args.size}: only a --size full run may replace the "
                             "committed results page; drop --publish (the page then goes to a new run folder)")
        return CHECKOUT / "docs" / "results"
    if args.out is not None:
        out = Path(args.out)
        if (out / f"{study.NAME}.md").exists():
            raise ValueError(f"--out {out}: it already holds {study.NAME}.md; choose a new directory "
                             "(results are never overwritten; --publish replaces the committed page)")
        return out
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / "studies" / f"{study.NAME}-{stamp}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(study, argv: list[str] | None = None) -> int:
    """The command line of one study (``geomuon study NAME``): parse ``argv``, run, and return
    the exit code (2 for bad options, 130 when interrupted: the complete runs stay, and the
    same command without ``--fresh`` continues from them)."""
    parser = argparse.ArgumentParser(prog=f"geomuon study {study.NAME}", description=study.TITLE)
    add_arguments(parser, study)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        path = run_study(study, args, argv)
    except ValueError as err:
        print(f"geomuon study {study.NAME}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        again = " ".join(shlex.quote(a) for a in argv if a != "--fresh")
        print(f"geomuon study {study.NAME}: interrupted; the runs that completed are kept in their folders. "
              f"Continue with: geomuon study {study.NAME} {again}", file=sys.stderr)
        return 130
    print(f"results page: {path}")
    return 0
