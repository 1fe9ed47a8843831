r"""The seed-000 arms at the longer standard configuration: does the ordering of
unconstrained Muon, all-Stiefel and hetero seen at 400 steps hold at 1000?

The configuration of :mod:`geomuon.pretrain.studies.manifolds_long` (GPT 4 × 128, context
128, batch 32, 1000 steps, warmup 50 then cosine to 0.1×, AdamW lr $3\cdot10^{-3}$ on
embeddings, head and gains), with the rows

* ``unconstrained``: the library's Muon (lr 0.02, weight decay 0.1), the same runs as that
  study's row of the same name (same configuration and seeds, trained again here so the
  page stands alone);
* ``all_stiefel``: Manifold Muon, Stiefel attention and MLP (lr 0.02);
* ``hetero``: Manifold Muon, Stiefel attention, DGram MLP (lr 0.02).

Every matrix rate is the seed paper's 0.02, the default the sweep
(``geomuon study manifolds-sweep``) tunes around; the remaining seed-000 arms are left out
so that the study fits one hour on two cores. Mechanism tracked as in the 400-step study:
$\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$ per layer.
"""

from __future__ import annotations

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


def variants(size: Size) -> list[Variant]:
    """Unconstrained Muon, all-Stiefel and hetero (the variants of the 400-step study of the same names)."""
    arms = {v.name: v for v in manifolds.variants(size)}
    return [arms[name] for name in ("unconstrained", "all_stiefel", "hetero")]


def report(results, size, meta, figure_dir) -> str:
    """The page body: the rows' table, what it says, the loss and σ(W_Q)σ(W_K) curves."""
    figures = [*common.loss_figures(results, figure_dir),
               common.plot_panels(results, lambda e: e["qk_sigma_product"], "σ_max(W_Q)·σ_max(W_K) per layer",
                                  "σ(W_Q)σ(W_K)", figure_dir, "qk_sigma_product.png", logy=True)]
    note = ("The same arms at 400 steps (3 × 128, context 64, batch 16) are on the [manifolds page](manifolds.md); "
            "whether their ordering holds at 1000 steps is read off the two pages' tables.")
    return manifolds_long.page(sys.modules[__name__], results, size, figure_dir, COMPARISONS, note, figures)
