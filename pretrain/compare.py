r"""Compare strategies on the same data and schedule: a results table and PNG figures.

``geomuon compare --strategies unconstrained,hetero --seeds 0,1 --steps 200``

Every (strategy, seed) run uses the same :class:`geomuon.pretrain.train.TrainConfig` except
``strategy``, ``seed`` and ``out_dir`` (``<out_dir>/<strategy>-s<seed>``), so the runs see
the same batches for a given seed and the same schedule. A run is **diverged** when it
stopped on a non-finite loss, or when its final val loss exceeds its best val loss by
more than ``divergence_margin`` nats (the "explosive growth that does not recover" reported by
the module-wise Manifold Muon study, github.com/kiratoyoshihara/module-wise-manifold-muon).
Runs that ``--stop-after`` stopped before ``--steps`` are judged by the first rule alone (the
rest of their schedule may still bring the loss down); the table then heads its column "last
val loss", the summary line names the step they stopped at, and the line before it gives the
command that continues them.

A comparison gets a fresh folder (``runs/compare-<UTC time>``) unless ``--out-dir`` names
one; a folder holding an earlier comparison is refused unless ``--resume`` (finished runs
are read back from their checkpoints, the interrupted one continues) or ``--overwrite``.
``--resume`` names every run the folder holds (``--strategies`` and ``--seeds`` may add runs,
not leave any out): the figures and the table are redrawn from the runs named, and had
silently dropped the others'; to continue some runs alone, resume each with ``geomuon pretrain
--resume --out-dir <folder>/<strategy>-s<seed>`` and the comparison's options.
Ctrl-C checkpoints the running run and prints the command that resumes the comparison. A
progress bar counts the runs, and each run shows its steps below it.

Figures (matplotlib, Agg backend, written to ``<out_dir>``):

* ``loss.png`` — train loss (smoothed) and val loss against step, one colour per strategy;
* ``sigma_max.png`` — σ_max of every hidden matrix against step, one panel per strategy;
* ``attention_logits.png`` — max attention logit per layer against step, one panel per
  strategy (the saturation mechanism the module-wise study proposes: the logits of DGram
  attention grow).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from geomuon.optimizers.assign import STRATEGIES
from geomuon.pretrain.config import (TrainConfig, add_options, field_problems, from_args, is_template, launcher_value,
                                     option, option_text)
from geomuon.pretrain.train import (Distributed, RunFolderClaim, TrainingInterrupted, TrainResult, agreed_data,
                                    check_same_run,
                                    checkpoint_to_resume, claimed_by_main, literal_out_dir, nothing_to_continue,
                                    previous_checkpoint, printing_rank, resolve_out_dir, resume_command, resume_record,
                                    run_files, say_refusal, train)

SEED_STRATEGIES = ("unconstrained", "all_stiefel", "all_dgram", "hetero", "hetero_inv")
FIGURES = ("loss.png", "sigma_max.png", "attention_logits.png")
#: ``geomuon compare``'s own defaults for options it shares with ``geomuon pretrain``.
COMPARE_DEFAULTS = {"out_dir": "runs/compare-{time}", "print_table": False}


@dataclasses.dataclass
class CompareConfig:
    """The options of ``geomuon compare`` besides the training options (each run's
    ``strategy`` and ``seed`` come from here)."""

    strategies: list[str] = option(list(SEED_STRATEGIES), "strategies to train, comma-separated",
                                   choices=lambda: sorted(STRATEGIES))
    seeds: list[int] = option([0], "seeds of every strategy, comma-separated", at_least=0)
    divergence_margin: float = option(0.5, "a final val loss this far above the run's best counts as diverged "
                                      "(not applied to runs --stop-after stopped early)",
                                      unit="nats", at_least=0)


@dataclasses.dataclass
class RunSummary:
    """What one (strategy, seed) run of a comparison produced: losses, verdict, wall time, and
    the length of its schedule, ``steps`` (``--steps``; ``None``: the run is taken to have run it)."""
    strategy: str
    seed: int
    final_val_loss: float
    best_val_loss: float
    diverged: bool
    wall_time: float
    result: TrainResult
    steps: int | None = None

    @property
    def stopped(self) -> bool:
        """Whether the run stopped before its schedule's end on finite losses (``--stop-after``,
        at ``result.last_step``): its "final" val loss is the last one so far."""
        return not self.diverged and not ran_its_schedule(self.result, self.steps)


def ran_its_schedule(result: TrainResult, steps: int | None) -> bool:
    """Whether the run reached its schedule's ``steps`` (``None``: taken as run), not stopped by
    ``--stop-after`` before it."""
    return steps is None or result.last_step >= steps


def verdict(result: TrainResult, divergence_margin: float, steps: int | None = None) -> tuple[float, float, bool]:
    """``(final val loss, best val loss, diverged)`` of one run: diverged when it stopped on a
    non-finite loss, or when its final val loss exceeds its best by more than
    ``divergence_margin`` nats. The second rule judges only a run that ran its schedule's
    ``steps`` (``None``: taken as run): one that ``--stop-after`` stopped earlier has not yet
    shown growth that does not recover (the rest of its schedule, the learning-rate decay among
    it, may bring the loss down), and called diverged it would be named no best run."""
    losses = [e["val_loss"] for e in result.evals]
    final = losses[-1] if losses else math.nan
    finite = [v for v in losses if math.isfinite(v)]
    best = min(finite) if finite else math.nan
    diverged = result.diverged or not math.isfinite(final) or (
        ran_its_schedule(result, steps) and final > best + divergence_margin)
    return final, best, diverged


def comparison_runs(base: TrainConfig, strategies: list[str],
                    seeds: list[int]) -> tuple[str | None, list[TrainConfig]]:
    """The folder of a comparison and the configuration of each of its runs
    (``<folder>/<strategy>-s<seed>``), all checked before the first one trains: a folder
    holding an earlier comparison is refused unless ``--resume`` (finished runs are read
    back, the interrupted one continues, the others start; every run the folder holds must be
    named) or ``--overwrite``. The fresh folder a template (``{time}``) gives is created here,
    after every check, under a name no other comparison holds; the caller removes it again if
    it stops before writing into it."""
    base.validate(named_strategy=False)  # the strategy is each run's
    for name, values in (("strategies", strategies), ("seeds", seeds)):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # the second run of a pair would find the first one's folder after it trained
            raise ValueError(f"{option_text(name, options=CompareConfig)} lists {', '.join(twice)} more than once; "
                             "give each once")
    root = _comparison_folder(base)
    runs_held = _runs_held(root)
    figures = [name for name in FIGURES if root is not None and os.path.exists(os.path.join(root, name))]
    if base.resume and not runs_held:  # (had started a fresh comparison)
        if figures:  # (told to start without --resume, it is refused as a folder holding a comparison)
            raise ValueError(f"{option_text('resume', True)}: {option_text('out_dir')} {root!r} holds the figures "
                             f"of a comparison ({', '.join(figures)}) but none of its runs, so there is no comparison "
                             f"to continue; replace them with {option_text('overwrite', True)}, or choose another "
                             f"{option_text('out_dir')}")
        raise nothing_to_continue(root, "comparison")
    named = {_run_name(strategy, seed) for strategy in strategies for seed in seeds}
    left_out = [entry for entry in runs_held if entry not in named]
    if base.overwrite and left_out:
        # (they had stayed beside the new comparison, and the resume command it printed was then refused)
        raise ValueError(f"{option_text('overwrite', True)}: {root!r} holds runs that "
                         f"{option_text('strategies', options=CompareConfig)} and "
                         f"{option_text('seeds', options=CompareConfig)} leave out ({', '.join(left_out)}): "
                         "--overwrite replaces the runs it names, so those would stay beside the new comparison "
                         "(and a later --resume would be refused); name them too, remove them, or choose another "
                         f"{option_text('out_dir')}")
    if base.resume:  # the figures and the table are redrawn from the runs named: one left out had vanished from them
        if left_out:
            raise ValueError(f"{option_text('resume', True)}: {root!r} holds runs that "
                             f"{option_text('strategies', options=CompareConfig)} and "
                             f"{option_text('seeds', options=CompareConfig)} leave out ({', '.join(left_out)}): "
                             "the figures and the table, redrawn from the runs named, would lose them; name them too "
                             "(a finished run is read back, not trained again), or continue a run <strategy>-s<seed> "
                             "alone with 'geomuon pretrain --resume --out-dir <its folder> --strategy <strategy> "
                             "--seed <seed>' and the comparison's options")
    if root is not None and os.path.isdir(root) and not (base.resume or base.overwrite):
        held = figures + [f"{entry}/{name}" for entry, names in runs_held.items() for name in names]
        if held:
            raise ValueError(f"{option_text('out_dir')} {root!r} already holds a comparison ({', '.join(held[:4])}"
                             f"{', …' if len(held) > 4 else ''}); continue it with {option_text('resume', True)}, "
                             f"replace it with {option_text('overwrite', True)}, or leave it out for a fresh folder")
    runs = []
    for strategy in strategies:
        for seed in seeds:
            folder = None if root is None else os.path.join(root, _run_name(strategy, seed))
            # a run of the comparison may have been checkpointed by one process or by several; a run
            # whose ckpt.pt is gone but whose ckpt.prev.pt is there resumes too, so that load_checkpoint
            # says what to do (started afresh, it had deleted that checkpoint)
            checkpoint = None if folder is None else checkpoint_to_resume(folder)
            resume = base.resume and checkpoint is not None and (
                os.path.exists(checkpoint) or os.path.exists(previous_checkpoint(checkpoint)))
            runs.append(dataclasses.replace(base, strategy=strategy, seed=seed, resume=resume,
                                            out_dir=_run_out_dir(folder),
                                            overwrite=(base.overwrite or base.resume) and not resume))
    for cfg in runs:  # fail before the first run, not after the third
        cfg.validate(sharing=strategies)
        resolve_out_dir(cfg)
    if root is not None and is_template(base.out_dir):
        root = _claim_fresh_folder(base, root)
        runs = [dataclasses.replace(cfg, out_dir=_run_out_dir(os.path.join(root, _run_name(cfg.strategy, cfg.seed))))
                for cfg in runs]
    return root, runs


def _runs_held(root: str | None) -> dict[str, list[str]]:
    """The entries of the comparison folder ``root`` that hold a run, each with its run files
    (:func:`~geomuon.pretrain.train.run_files`), in name order; none where ``root`` is no folder."""
    if root is None or not os.path.isdir(root):
        return {}
    held = {entry: run_files(os.path.join(root, entry)) for entry in sorted(os.listdir(root))}
    return {entry: names for entry, names in held.items() if names}


def _run_name(strategy: str, seed: int) -> str:
    """The folder, inside the comparison's, of its run of ``strategy`` and ``seed``."""
    return f"{strategy}-s{seed}"


def _run_out_dir(folder: str | None) -> str | None:
    """The ``out_dir`` naming the run folder ``folder`` (:func:`~geomuon.pretrain.train.literal_out_dir`:
    a brace in the comparison's folder is no template field)."""
    return None if folder is None else literal_out_dir(folder)


def _comparison_folder(base: TrainConfig) -> str | None:
    """The folder ``base.out_dir`` names for a comparison (a ``{time}`` template: its next free name)."""
    return resolve_out_dir(dataclasses.replace(base, strategy="compare", resume=False, overwrite=True))


def _claim_fresh_folder(base: TrainConfig, root: str) -> str:
    """Create the fresh folder ``root`` that the template ``base.out_dir`` gave, or, when a
    comparison started in the same second created it first, the template's next free name.
    Only resolved, the folder had been given to every comparison started in that second:
    their runs collided ("in use by another run") and their figures overwrote each other's."""
    for _ in range(100):
        try:
            os.makedirs(root)
            return root
        except FileExistsError:
            root = _comparison_folder(base)
        except OSError as err:
            raise ValueError(f"{option_text('out_dir')} {root!r} cannot be created ({err.strerror}); choose "
                             "another one") from None
    raise ValueError(f"{option_text('out_dir')} {base.out_dir!r}: no free folder among its first 100 names")


def compare(
    base: TrainConfig,
    strategies: list[str],
    seeds: list[int],
    divergence_margin: float = 0.5,
) -> list[RunSummary]:
    """Run every (strategy, seed) pair on ``base`` (in ``base.out_dir``, see
    :func:`comparison_runs`) and return their summaries; a progress bar counts the runs
    (``base.progress``), each run shows its own below it. With ``base.resume`` every
    checkpointed run is checked to be the same run (options, data, model:
    :func:`geomuon.pretrain.train.check_same_run`) before the first one trains, so a
    changed option cannot leave the comparison half trained on it. An interrupted run
    raises :class:`geomuon.pretrain.train.TrainingInterrupted` after its checkpoint.

    The comparison holds its folder (:class:`geomuon.pretrain.train.RunFolderClaim`) while it
    runs: a second comparison into that folder is refused ("in use by another run"); two
    started together had both passed the check for an earlier comparison, trained side by side
    and written their figures over each other's. A folder it created (or a template's fresh
    one) and no run wrote to is removed again.

    Under torchrun rank 0 alone resolves, creates and holds the folder, and hands the runs to
    the other ranks over the process group the comparison opens for its runs (every rank had
    created a fresh folder of its own, left empty, or left behind by a killed comparison)."""
    check(CompareConfig(strategies, seeds, divergence_margin))
    base.validate(named_strategy=False)  # before the process group: a bad launch is refused by name
    ddp = Distributed.of_run(base)
    claim, overall, summaries = None, None, []
    try:
        (root, runs), claim = claimed_by_main(ddp, _claimed_comparison, base, strategies, seeds)
        data = agreed_data(base, None, ddp)  # before the checkpoints' checks: they compare each rank's data
        for cfg in runs:
            if cfg.resume:
                # rank 0's folder (a collective: every rank resumes; a rank's own view of the disk had
                # been able to refuse alone, in resolve_out_dir, while the others waited)
                checkpoint, record = resume_record(os.path.join(root, _run_name(cfg.strategy, cfg.seed)))
                try:
                    check_same_run(record, cfg, data)
                except ValueError as err:  # which of the comparison's runs: its checkpoint
                    raise ValueError(f"{checkpoint!r}: {err}") from None
        overall = _runs_bar(len(runs), base.progress)
        for cfg in runs:
            result = train(cfg, data, sharing=strategies)
            final, best, diverged = verdict(result, divergence_margin, cfg.steps)
            summaries.append(RunSummary(cfg.strategy, cfg.seed, final, best, diverged, result.wall_time, result,
                                        cfg.steps))
            if overall is not None:
                overall.set_postfix_str(f"{cfg.strategy} s{cfg.seed}: val {final:.3f}", refresh=False)
                overall.update(1)
    finally:
        if overall is not None:
            overall.close()
        if claim is not None:
            claim.release()
        ddp.close()
    return summaries


def _claimed_comparison(base: TrainConfig, strategies: list[str], seeds: list[int]
                        ) -> tuple[tuple[str | None, list[TrainConfig]], RunFolderClaim | None]:
    """:func:`comparison_runs`, then the claim on the comparison's folder."""
    root, runs = comparison_runs(base, strategies, seeds)
    fresh = root is not None and is_template(base.out_dir)  # comparison_runs created it
    return (root, runs), None if root is None else RunFolderClaim(root, fresh=fresh)


def check(options: CompareConfig) -> None:
    """Refuse bad comparison options (``ValueError`` naming each)."""
    problems = field_problems(options)
    if problems:
        raise ValueError("bad comparison:\n  " + "\n  ".join(problems))


def _runs_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="compare", unit="run", dynamic_ncols=True, file=sys.stderr)


def summary_line(summaries: list[RunSummary], wall_time: float, out_dir: str | None) -> str:
    """The last line of ``geomuon compare``: runs, divergences, time, the best run among those
    that did not diverge (a diverged run's last val loss may come from before it stopped, or
    be the blown-up value itself: it names no winner). Runs that ``--stop-after`` stopped
    (:attr:`RunSummary.stopped`) are said to have stopped, at which step of how many, and
    their val losses are the last ones, not final."""
    diverged = sum(s.diverged for s in summaries)
    line = f"compare: {len(summaries)} runs, {diverged} diverged, {wall_time:.0f}s"
    stopped = [s for s in summaries if s.stopped]
    if stopped:  # at one step: every run of a comparison that did not diverge trains to its --stop-after
        line += f"; stopped at step {stopped[0].result.last_step} of {stopped[0].steps} (--stop-after)"
    converged = [s for s in summaries if not s.diverged]
    if converged:
        best = min(converged, key=lambda s: s.final_val_loss)
        step = best.result.evals[-1]["step"]
        line += (f"; best {'last' if stopped else 'final'} val loss {best.final_val_loss:.4f} "
                 f"({best.strategy} s{best.seed}, step {step})")
    elif summaries:
        line += "; no run finished without diverging"
    return line + (f"; runs and figures in {out_dir}" if out_dir else "")


def results_table(summaries: list[RunSummary]) -> str:
    """Format the comparison as a fixed-width text table, one row per run (its val loss column
    is headed "last val loss" when ``--stop-after`` stopped runs before their schedule's end)."""
    last = "last val loss" if any(s.stopped for s in summaries) else "final val loss"
    header = ("strategy", "seed", last, "best val loss", "diverged", "wall time")
    rows = [
        (s.strategy, str(s.seed), f"{s.final_val_loss:.4f}", f"{s.best_val_loss:.4f}",
         "yes" if s.diverged else "no", f"{s.wall_time:.1f}s")
        for s in summaries
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def plot(summaries: list[RunSummary], out_dir: str) -> list[str]:
    """Write the three figures; returns their paths.

    Loss: one colour per strategy; per-module panels: one colour per module (the same in
    every panel). In both, a run's seed is its line style (:func:`_seed_styles`), so every
    line of a figure has an appearance of its own and the legends name every colour and
    every style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    strategies = list(dict.fromkeys(s.strategy for s in summaries))
    colour = dict(zip(strategies, _distinct_colours(len(strategies))))
    style = _seed_styles(summaries)
    paths = []

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        steps = sorted(s.result.losses)
        ax_train.plot(steps, _smooth([s.result.losses[k] for k in steps]), color=colour[s.strategy],
                      linestyle=style[s.seed], alpha=0.8, label=f"{s.strategy} s{s.seed}")
        evals = s.result.evals
        ax_val.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o", linestyle=style[s.seed],
                    color=colour[s.strategy], label=f"{s.strategy} s{s.seed}")
    ax_train.set(title="train loss (moving average)", xlabel="step", ylabel="cross-entropy (nats)")
    ax_val.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats)")
    ax_val.legend(fontsize=8)
    paths.append(_save(fig, out_dir, "loss.png"))

    for key, title, filename in (
        ("sigma_max", "σ_max per module", "sigma_max.png"),
        ("attn_logit", "max attention logit per layer", "attention_logits.png"),
    ):
        modules = list(dict.fromkeys(module for s in summaries for e in s.result.evals[:1] for module in e[key]))
        module_colour = dict(zip(modules, _distinct_colours(len(modules))))
        fig, axes = plt.subplots(1, len(strategies), figsize=(4.2 * len(strategies), 4), squeeze=False,
                                 sharey=True)
        for ax, name in zip(axes[0], strategies):
            for run in (s for s in summaries if s.strategy == name):
                evals = run.result.evals
                for module in evals[0][key] if evals else []:
                    ax.plot([e["step"] for e in evals], [e[key][module] for e in evals],
                            color=module_colour[module], linestyle=style[run.seed])
            ax.set(title=name, xlabel="step", yscale="log")
        axes[0][0].set_ylabel(title)
        handles = [Line2D([], [], color=module_colour[m], label=m) for m in modules]
        if 1 < len(style) <= len(SEED_LINE_STYLES):  # black: no module colour (tab10, tab20, turbo)
            handles += [Line2D([], [], color="black", linestyle=ls, label=f"seed {seed}") for seed, ls in style.items()]
        axes[0][-1].legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.suptitle(f"{title} over training")
        paths.append(_save(fig, out_dir, filename))
    return paths


#: Line styles of a figure's seeds, in the order the seeds first appear (solid for the first).
SEED_LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def _seed_styles(summaries: list[RunSummary]) -> dict[int, object]:
    """``{seed: line style}``: one style each while :data:`SEED_LINE_STYLES` has enough;
    beyond that every seed is solid (the lines of a module or strategy then form one
    bundle of its colour, as in a spaghetti plot) rather than two seeds sharing a style."""
    seeds = list(dict.fromkeys(s.seed for s in summaries))
    if len(seeds) > len(SEED_LINE_STYLES):
        return dict.fromkeys(seeds, "-")
    return dict(zip(seeds, SEED_LINE_STYLES))


def _distinct_colours(count: int) -> list:
    """``count`` colours no two alike: tab10, tab20 up to 20, else evenly spaced on turbo."""
    import matplotlib.pyplot as plt

    if count <= 10:
        return [plt.cm.tab10(i) for i in range(count)]
    if count <= 20:
        return [plt.cm.tab20(i) for i in range(count)]
    return [plt.cm.turbo(i / (count - 1)) for i in range(count)]


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- CLI


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Fill the ``geomuon compare`` parser: the training options (each run's strategy and
    seed excepted) and :class:`CompareConfig`'s, all from their declarations."""
    parser.description = ("Train several strategies on the same data and schedule; print a table, write plots. "
                          "Ctrl-C saves the running run and prints the command that resumes the comparison.")
    add_options(parser, TrainConfig, exclude=("strategy", "seed"), defaults=COMPARE_DEFAULTS)
    add_options(parser, CompareConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run every (strategy, seed) on the same data and schedule; print the table, write the
    plots, end with a summary line (under torchrun rank 0 alone: the other ranks evaluate
    nothing, so their table had read every run as diverged (val loss nan) and their figures,
    written to the same files, raced rank 0's)."""
    base = from_args(TrainConfig, args)
    options = from_args(CompareConfig, args)
    started = time.perf_counter()
    try:
        summaries = compare(base, options.strategies, options.seeds, options.divergence_margin)
    except ValueError as err:
        say_refusal("compare", err, printing_rank())  # rank 0's, and each rank's own refusal of its data
        return 2
    except TrainingInterrupted as stop:
        if launcher_value("RANK") != 0:
            return stop.exit_code
        # the comparison's folder: the interrupted run's parent (a template's fresh name, resolved)
        folder = None if stop.out_dir is None else literal_out_dir(os.path.dirname(stop.out_dir))  # None: in memory
        again = resume_command("compare", dataclasses.replace(base, out_dir=folder, resume=True, overwrite=False),
                               options, defaults=COMPARE_DEFAULTS)
        # a run found diverged writes no checkpoint at the signal: "at step N" would promise one
        where = "" if stop.saved else (", which had diverged: no checkpoint was written (the run restarts from its "
                                       "last finite checkpoint, if any, else from step 0)")
        print(f"interrupted at step {stop.step} of {stop.out_dir}{where}; resume with: {again}", file=sys.stderr)
        return stop.exit_code
    if launcher_value("RANK") != 0:
        return 0
    # every run is in <folder>/<strategy>-s<seed> (no folder: the comparison ran in memory)
    root = None if base.out_dir is None else os.path.dirname(summaries[0].result.out_dir)
    print(results_table(summaries))
    if root is not None:
        for path in plot(summaries, root):
            print(f"figure: {path}")
        if any(s.stopped for s in summaries):  # (in memory, no run can be continued)
            again = resume_command("compare", dataclasses.replace(base, out_dir=literal_out_dir(root), resume=True,
                                                                  overwrite=False, stop_after=None),
                                   options, defaults=COMPARE_DEFAULTS)
            print(f"continue the runs to step {base.steps} with: {again}")
    print(summary_line(summaries, time.perf_counter() - started, root))
    return 0


if __name__ == "__main__":  # (as `python -m geomuon.pretrain.train`; it had taken any arguments and done nothing)
    parser = argparse.ArgumentParser(prog="python -m geomuon.pretrain.compare")
    add_parser(parser)
    sys.exit(run(parser.parse_args()))
