r"""Compare strategies on the same data and schedule: a results table and PNG figures.

``geomuon compare --strategies unconstrained,hetero --seeds 0,1 --steps 200``

Every (strategy, seed) run uses the same :class:`geomuon.pretrain.train.TrainConfig` except
``strategy``, ``seed`` and ``out_dir`` (``<out_dir>/<strategy>-s<seed>``), so the runs see
the same batches for a given seed and the same schedule. A run is **diverged** when it
stopped on a non-finite loss, or when its final val loss exceeds its best val loss by
more than ``divergence_margin`` nats (the "explosive growth that does not recover" of
seed 000).

Figures (matplotlib, Agg backend, written to ``<out_dir>``):

* ``loss.png`` — train loss (smoothed) and val loss against step, one colour per strategy;
* ``sigma_max.png`` — σ_max of every hidden matrix against step, one panel per strategy;
* ``attention_logits.png`` — max attention logit per layer against step, one panel per
  strategy (the seed-000 saturation mechanism: the logits of DGram attention grow).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from geomuon.pretrain.data import load_data
from geomuon.pretrain.train import TrainConfig, TrainResult, add_parser as add_train_parser, train

SEED_STRATEGIES = ("unconstrained", "all_stiefel", "all_dgram", "hetero", "hetero_inv")


@dataclasses.dataclass
class RunSummary:
    """What one (strategy, seed) run of a comparison produced: losses, verdict, wall time."""
    strategy: str
    seed: int
    final_val_loss: float
    best_val_loss: float
    diverged: bool
    wall_time: float
    result: TrainResult


def verdict(result: TrainResult, divergence_margin: float) -> tuple[float, float, bool]:
    """``(final val loss, best val loss, diverged)`` of one run."""
    losses = [e["val_loss"] for e in result.evals]
    final = losses[-1] if losses else math.nan
    finite = [v for v in losses if math.isfinite(v)]
    best = min(finite) if finite else math.nan
    diverged = result.diverged or not math.isfinite(final) or final > best + divergence_margin
    return final, best, diverged


def compare(
    base: TrainConfig,
    strategies: list[str],
    seeds: list[int],
    divergence_margin: float = 0.5,
) -> list[RunSummary]:
    """Run every (strategy, seed) pair on ``base`` and return their summaries."""
    if not strategies or not seeds:
        raise ValueError("compare needs at least one strategy (--strategies) and one seed (--seeds)")
    for strategy in strategies:  # fail before the first run, not after the third
        dataclasses.replace(base, strategy=strategy).validate()
    data = load_data(base.data)
    summaries = []
    for strategy in strategies:
        for seed in seeds:
            cfg = dataclasses.replace(
                base, strategy=strategy, seed=seed, out_dir=os.path.join(base.out_dir, f"{strategy}-s{seed}")
            )
            result = train(cfg, data)
            final, best, diverged = verdict(result, divergence_margin)
            summaries.append(RunSummary(strategy, seed, final, best, diverged, result.wall_time, result))
    return summaries


def results_table(summaries: list[RunSummary]) -> str:
    """Format the comparison as a fixed-width text table, one row per run."""
    header = ("strategy", "seed", "final val loss", "best val loss", "diverged", "wall time")
    rows = [
        (s.strategy, str(s.seed), f"{s.final_val_loss:.4f}", f"{s.best_val_loss:.4f}",
         "yes" if s.diverged else "no", f"{s.wall_time:.1f}s")
        for s in summaries
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def plot(summaries: list[RunSummary], out_dir: str) -> list[str]:
    """Write the three figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(s.strategy for s in summaries))
    colour = {name: plt.cm.tab10(i % 10) for i, name in enumerate(strategies)}
    paths = []

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        steps = sorted(s.result.losses)
        ax_train.plot(steps, _smooth([s.result.losses[k] for k in steps]), color=colour[s.strategy],
                      alpha=0.8, label=f"{s.strategy} s{s.seed}")
        evals = s.result.evals
        ax_val.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", color=colour[s.strategy],
                    label=f"{s.strategy} s{s.seed}")
    ax_train.set(title="train loss (moving average)", xlabel="step", ylabel="cross-entropy (nats)")
    ax_val.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats)")
    ax_val.legend(fontsize=8)
    paths.append(_save(fig, out_dir, "loss.png"))

    for key, title, filename in (
        ("sigma_max", "σ_max per module", "sigma_max.png"),
        ("attn_logit", "max attention logit per layer", "attention_logits.png"),
    ):
        fig, axes = plt.subplots(1, len(strategies), figsize=(4.2 * len(strategies), 4), squeeze=False,
                                 sharey=True)
        for ax, name in zip(axes[0], strategies):
            runs = [s for s in summaries if s.strategy == name]
            first = runs[0].result.evals
            for module in first[0][key] if first else []:
                for run in runs:
                    evals = run.result.evals
                    ax.plot([e["step"] for e in evals], [e[key][module] for e in evals],
                            label=module if run is runs[0] else None)
            ax.set(title=name, xlabel="step", yscale="log")
        axes[0][0].set_ylabel(title)
        axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.suptitle(f"{title} over training")
        paths.append(_save(fig, out_dir, filename))
    return paths


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
    """Fill the ``geomuon compare`` parser: the pretrain options plus strategies and seeds."""
    add_train_parser(parser)
    parser.description = "Train several strategies on the same data and schedule; print a table, write plots."
    parser.add_argument("--strategies", default=",".join(SEED_STRATEGIES),
                        help="comma-separated strategies (default: the five of seed 000)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    parser.add_argument("--divergence-margin", type=float, default=0.5,
                        help="nats above the best val loss that count as diverged")
    parser.set_defaults(func=run, out_dir="runs/compare", progress=False, print_table=False)


def _parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r} must be comma-separated integers, e.g. --seeds 0,1,2") from None
    if not seeds:
        raise ValueError("--seeds is empty; give at least one seed, e.g. --seeds 0")
    return seeds


def run(args: argparse.Namespace) -> int:
    """Run every (strategy, seed) on the same data and schedule; print the table, write the plots."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    base = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        strategies = [s for s in args.strategies.split(",") if s]
        seeds = _parse_seeds(args.seeds)
        summaries = compare(base, strategies, seeds, args.divergence_margin)
    except ValueError as err:
        print(f"geomuon compare: {err}", file=sys.stderr)
        return 2
    print(results_table(summaries))
    for path in plot(summaries, base.out_dir):
        print(f"figure: {path}")
    return 0
