r"""The longer, standard configuration, with two peer rows: is the library's Muon row where
PyTorch's own Muon and a tuned AdamW put it?

Character-level tiny Shakespeare; GPT with 4 layers × 128, 4 heads, context 128, batch
32, 1000 steps; linear warmup over 50 steps, then cosine decay to 0.1× the peak; AdamW
($\beta = (0.9, 0.95)$, lr $3\cdot10^{-3}$, weight decay 0.1 on matrices, none on gains
and biases) on the embeddings, head and gains; global gradient-norm clip 1. Three rows,
measured in the same runs (same initialisation and batches per seed):

* ``torch_muon``: ``torch.optim.Muon`` on the attention and MLP matrices (lr 0.02,
  ``adjust_lr_fn="original"``, momentum 0.95 Nesterov, no weight decay;
  docs.pytorch.org/docs/stable/generated/torch.optim.Muon.html) + AdamW on the rest;
* ``unconstrained``: the library's :class:`geomuon.optimizers.Muon` on the same matrices
  (lr 0.02, the same $\sqrt{\max(1, m/n)}$ scale, decoupled weight decay 0.1) + AdamW;
* ``adamw``: AdamW on every parameter (lr $3\cdot10^{-3}$, weight decay 0.1).

The manifold arms at this size are the study ``manifolds-long-arms``
(:mod:`geomuon.pretrain.studies.manifolds_long_arms`): they cost about twice as much per step,
and the two together do not fit one hour on two cores.
"""

from __future__ import annotations

import sys

from geomuon.pretrain.provenance import markdown_table

from . import common
from .common import Size, Variant

NAME = "manifolds-long"
TITLE = "The longer standard configuration: the library's Muon beside torch.optim.Muon and AdamW"

#: GPT 4 × 128, 4 heads, context 128 (the model configuration ``cpu-small``, stated in full).
MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128)
SIZES = {
    "full": Size(model="cpu-small", model_overrides=MODEL, steps=1000, batch_size=32, eval_every=100,
                 eval_batches=2, final_eval_batches=16, lr=0.02, adamw_lr=3e-3, weight_decay=0.1,
                 warmup_steps=50, min_lr_ratio=0.1),
    "tiny": Size(model="cpu-tiny", model_overrides=dict(n_layer=1, n_head=2, n_embd=16, block_size=16), steps=3,
                 batch_size=2, eval_every=2, eval_batches=1, final_eval_batches=2, warmup_steps=1),
}


def variants(size: Size) -> list[Variant]:
    """The three rows: torch's Muon, the library's Muon, AdamW everywhere."""
    return [
        Variant("torch_muon", "torch.optim.Muon on attention and MLP (lr 0.02, adjust_lr_fn=\"original\", no "
                "weight decay) + AdamW on embeddings, head and gains", "torch_muon"),
        Variant("unconstrained", "the library's Muon on attention and MLP (decoupled weight decay) + AdamW on "
                "the rest", "unconstrained"),
        Variant("adamw", "AdamW on every parameter", "adamw"),
    ]


def extra_metrics(model, evaluation, memory) -> dict:
    """None: the rows are compared on the losses the training loop records."""
    return {}


def results_table(results: dict[str, list[dict]]) -> str:
    """Final val loss, val accuracy and diverged runs per row, mean ± std over seeds."""
    rows = [[f"`{name}`", common.fmt([r["final_val_loss"] for r in records], 4),
             common.fmt([common.final_eval(r)["val_acc"] for r in records], 4),
             ", ".join(f"{r['final_val_loss']:.4f}" for r in records),
             f"{sum(r['diverged'] for r in records)} of {len(records)}"] for name, records in results.items()]
    return markdown_table(["row", "final val loss", "val accuracy", "per seed", "diverged"], rows)


#: The comparisons of the page: (row, row, what is compared).
COMPARISONS = [
    ("unconstrained", "torch_muon", "Final val loss, the library's Muon vs torch.optim.Muon"),
    ("torch_muon", "adamw", "Final val loss, torch.optim.Muon vs AdamW"),
    ("unconstrained", "adamw", "Final val loss, the library's Muon vs AdamW"),
]
#: How the rows differ beyond their names (quoted on the page).
ROWS_NOTE = ("The two Muon rows differ in the implementation (Newton–Schulz coefficients and steps, momentum "
             "bookkeeping) and in the weight decay (the library's unconstrained baseline decays its matrices by "
             "0.1, torch's row does not, as the peer configuration specifies).")


def page(study, results, size, figure_dir, comparisons, rows_note: str, figures: list[str]) -> str:
    """The body of a page at this configuration: rows, the results table, the ``comparisons``
    (``(row, row, what)``, claimed only when the seed bands separate) and ``figures``."""
    final = {n: [r["final_val_loss"] for r in records] for n, records in results.items()}
    findings = [common.compare_sentence(a, final[a], b, final[b], what, digits=4) for a, b, what in comparisons]
    return "\n\n".join([
        "## Rows\n\n" + "\n".join(f"* `{v.name}`: {v.label}." for v in study.variants(size)) + "\n\n" + rows_note,
        f"## Results\n\n{size.steps} steps, seeds {', '.join(map(str, size.seeds))}; the final validation loss is "
        f"measured on {size.final_eval_batches} batches of {size.batch_size} windows of the validation split, the "
        "same windows for every run. Mean ± sample standard deviation over seeds.\n\n" + results_table(results),
        common.screen_heading(size.seeds) + "\n\n" + "\n".join(f"* {f}" for f in findings),
        "## Figures\n\n" + "\n\n".join(f"![{f}]({study.NAME}/{f})" for f in figures),
    ])


def report(results, size, meta, figure_dir) -> str:
    """The page body: the rows' table, what it says, the loss curves."""
    return page(sys.modules[__name__], results, size, figure_dir, COMPARISONS, ROWS_NOTE,
                common.loss_figures(results, figure_dir))
