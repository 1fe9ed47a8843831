r"""The seed-000 arms at the longer standard configuration: does the ordering of
unconstrained Muon, all-Stiefel and hetero seen at 400 steps hold at 1000?

The configuration of :mod:`geomuon.pretrain.studies.manifolds_long` (GPT 4 × 128, context
128, batch 32, 1000 steps, warmup 50 then cosine to 0.1×, AdamW lr $3\cdot10^{-3}$ on
embeddings, head and gains), with the rows

* ``unconstrained``: the library's Muon (weight decay 0.1);
* ``all_stiefel``: Manifold Muon, Stiefel attention and MLP;
* ``hetero``: Manifold Muon, Stiefel attention, DGram MLP;

each at its own tuned matrix rate, the best point of the 400-step sweep
(``geomuon study manifolds-sweep``, grid spacing ×2: :data:`TUNED_LR`), so that the question is whether the ordering of the arms *at their best* holds
when the run is longer. The rate is tuned at 400 steps, not at 1000: a longer run may prefer
a smaller one, which the page states beside the numbers. The remaining seed-000 arms are left
out so that the study fits about an hour on two cores.
Mechanism tracked as in the 400-step study:
$\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$ per layer.
"""

from __future__ import annotations

import dataclasses
import sys

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


def variants(size: Size) -> list[Variant]:
    """Unconstrained Muon, all-Stiefel and hetero (the 400-step study's variants of the same
    names), each at its tuned rate :data:`TUNED_LR`."""
    arms = {v.name: v for v in manifolds.variants(size)}
    return [dataclasses.replace(arms[name], label=f"{arms[name].label} (lr {lr:g}, its 400-step sweep's best)",
                                hyper={**arms[name].hyper, "lr": lr})
            for name, lr in TUNED_LR.items()]


def report(results, size, meta, figure_dir) -> str:
    """The page body: the rows' table, what it says, the loss and σ(W_Q)σ(W_K) curves."""
    figures = [*common.loss_figures(results, figure_dir),
               common.plot_panels(results, lambda e: e["qk_sigma_product"], "σ_max(W_Q)·σ_max(W_K) per layer",
                                  "σ(W_Q)σ(W_K)", figure_dir, "qk_sigma_product.png", logy=True)]
    note = ("The same arms at 400 steps (3 × 128, context 64, batch 16), at the same tuned rates, are on the "
            "[manifolds-sweep](manifolds-sweep.md) page; whether their ordering holds at 1000 steps is read off its "
            "best-point table and this one. "
            "The rates were tuned at 400 steps; the [longer configuration's page](manifolds-long.md) has the "
            "library's Muon at the default 0.02 at this size, beside torch.optim.Muon and AdamW.")
    return manifolds_long.page(sys.modules[__name__], results, size, figure_dir, COMPARISONS, note, figures)
