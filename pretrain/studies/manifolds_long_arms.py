r"""The seed-000 arms at the longer standard configuration: does the ordering of
unconstrained Muon, all-Stiefel and hetero seen at 400 steps hold at 1000?

The configuration of :mod:`geomuon.pretrain.studies.manifolds_long` (GPT 4 × 128, context
128, batch 32, 1000 steps, warmup 50 then cosine to 0.1×, AdamW lr $3\cdot10^{-3}$ on
embeddings, head and gains), with the rows

* ``unconstrained``: the library's Muon (weight decay 0.1);
* ``all_stiefel``: Manifold Muon, Stiefel attention and MLP;
* ``hetero``: Manifold Muon, Stiefel attention, DGram MLP;

each at its own tuned matrix rate, the best point of the 400-step sweep
(``geomuon study manifolds-sweep``, grid spacing ×2: :data:`TUNED_LR`, or the best points of a
rerun sweep given by ``--rates-from PATH``), so that the question is whether the ordering of
the arms *at their best* holds
when the run is longer. The rate is tuned at 400 steps, not at 1000: a longer run may prefer
a smaller one, which the page states beside the numbers. The remaining seed-000 arms are left
out so that the study fits about an hour on two cores.
Mechanism tracked as in the 400-step study:
$\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$ per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

from . import common, manifolds, manifolds_long
from .common import Size, Variant

NAME = "manifolds-long-arms"
TITLE = "The seed-000 arms at the longer standard configuration (1000 steps, 4 × 128)"
SIZES = manifolds_long.SIZES
extra_metrics = manifolds.extra_metrics

COMPARISONS = [
    ("hetero", "all_stiefel", "Final val loss, hetero vs all-Stiefel"),
    ("hetero", "unconstrained", "Final val loss, hetero vs unconstrained Muon"),
    ("all_stiefel", "unconstrained", "Final val loss, all-Stiefel vs unconstrained Muon"),
]


#: The best matrix rate of each arm in the 400-step sweep (its page's "best rate" column).
TUNED_LR = {"unconstrained": 0.04, "all_stiefel": 0.04, "hetero": 0.04}


def variants(size: Size, rates: dict[str, float] = TUNED_LR,
             source: str = "its 400-step sweep's best") -> list[Variant]:
    """Unconstrained Muon, all-Stiefel and hetero (the 400-step study's variants of the same
    names), each at its tuned rate: ``rates`` (default :data:`TUNED_LR`; ``source`` says where
    they come from, on the page)."""
    arms = {v.name: v for v in manifolds.variants(size)}
    return [dataclasses.replace(arms[name], label=f"{arms[name].label} (lr {lr:g}, {source})",
                                hyper={**arms[name].hyper, "lr": lr})
            for name, lr in rates.items()]


def add_options(parser) -> None:
    """This study's own option, beside every study's (:func:`geomuon.pretrain.studies.common.add_arguments`)."""
    parser.add_argument("--rates-from", default=None, metavar="PATH",
                        help="the results.json.gz of a `geomuon study manifolds-sweep` run (or its page folder): each "
                             "arm trains at that sweep's best rate (default: the published sweep's, "
                             + ", ".join(f"{name} {lr:g}" for name, lr in TUNED_LR.items()) + ")")


def configured(args):
    """This study with the rates ``--rates-from`` names (:func:`rates_from`; refused before any
    run), or this module itself without it. The rates reach the runs as each variant's ``lr``,
    which is part of its run key; the command on the page names the file."""
    if args.rates_from is None:
        return sys.modules[__name__]
    rates, steps = rates_from(args.rates_from)
    source = f"best of the {steps}-step sweep in {args.rates_from}"
    study = types.SimpleNamespace(**vars(sys.modules[__name__]))  # every attribute a study has, two replaced
    study.variants = functools.partial(variants, rates=rates, source=source)
    study.report = functools.partial(report, study=study, rates=f"the best points of the {steps}-step sweep in "
                                     f"`{args.rates_from}`")
    return study


def rates_from(path: str) -> tuple[dict[str, float], int]:
    """Each arm's best matrix rate in the manifolds-sweep results at ``path`` (as
    :func:`~geomuon.pretrain.studies.common.read_results` reads them; the best point as that
    sweep's page has it), and the sweep's step count; ``ValueError`` naming the file, and the arm
    where one is missing, for a file that cannot be read or is not a complete manifolds-sweep result."""
    sweep = manifolds.SWEEP
    what = f"pass the results.json.gz of a `geomuon study {sweep.NAME}` run"
    try:
        payload = common.read_results(path)
    except (OSError, ValueError, EOFError) as err:  # missing, not gzip, not JSON
        raise ValueError(f"--rates-from {path}: cannot be read as a study's results ({err}); {what}") from None
    if not isinstance(payload, dict) or payload.get("study") != sweep.NAME:
        study = payload.get("study") if isinstance(payload, dict) else None
        raise ValueError(f"--rates-from {path}: the results of study {study!r}, not of {sweep.NAME}; {what}")
    if not isinstance(payload.get("size"), str) or payload["size"] not in sweep.SIZES:
        raise ValueError(f"--rates-from {path}: a sweep at size {payload.get('size')!r}, none of "
                         f"{sorted(sweep.SIZES)}; {what}")
    size, runs = sweep.SIZES[payload["size"]], payload.get("runs") or {}
    try:  # (only the arms this study trains are needed)
        found = {a.arm.name: a.rate(a.best) for a in sweep.arm_sweeps(runs, size, TUNED_LR)}
    except ValueError as err:  # what the view refuses: an arm without runs on the grid
        raise ValueError(f"--rates-from {path}: {err} at size {payload['size']!r}; {what}") from None
    except (KeyError, TypeError) as err:  # a grid point or seed missing
        raise ValueError(f"--rates-from {path}: an incomplete {sweep.NAME} result (no {err}); {what}") from None
    return {name: found[name] for name in TUNED_LR}, size.steps


def report(results, size, meta, figure_dir, study=None, rates: str | None = None) -> str:
    """The page body: the rows' table, what it says, the loss and σ(W_Q)σ(W_K) curves (``study``:
    the :func:`configured` one, whose arms the rows list; ``rates``: where its rates come from,
    in place of the published 400-step sweep)."""
    figures = [*common.loss_figures(results, figure_dir),
               common.plot_panels(results, lambda e: e["qk_sigma_product"], "σ_max(W_Q)·σ_max(W_K) per layer",
                                  "σ(W_Q)σ(W_K)", figure_dir, "qk_sigma_product.png", logy=True)]
    if rates is None:
        tuned = ("The same arms at 400 steps (3 × 128, context 64, batch 16), at the same tuned rates, are on the "
                 "[manifolds-sweep](manifolds-sweep.md) page; whether their ordering holds at 1000 steps is read off "
                 "its best-point table and this one. The rates were tuned at 400 steps")
    else:
        tuned = f"The rates are {rates}"
    note = (f"{tuned}; the [longer configuration's page](manifolds-long.md) has the library's Muon at the default "
            "0.02 at this size, beside torch.optim.Muon and AdamW.")
    return manifolds_long.page(study or sys.modules[__name__], results, size, figure_dir, COMPARISONS, note, figures)
