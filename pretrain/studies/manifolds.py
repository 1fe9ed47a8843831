r"""Seed 000 at CPU scale: *different layers, different manifolds*.

A small GPT (pre-LayerNorm, GELU, fused ``c_attn``) on character-level tiny Shakespeare,
trained with the five assignments of the seed paper at the same hyperparameters
(``unconstrained``, ``all_stiefel``, ``all_dgram``, ``hetero`` = Stiefel attention +
DGram MLP, ``hetero_inv``), plus the two open questions:

(a) ``hetero_inv+colcap``: DGram attention with a column-norm cap after every step
    (:class:`geomuon.optimizers.regulate.ColumnCap`: a DGram weight's singular values are its
    column norms, so this bounds $\sigma_{\max}(W_Q)\sigma_{\max}(W_K)$);
(b) ``hetero_inv+reference``: DGram attention with the seed code's implementation choices
    instead of ours — the sorted-σ map $\operatorname{polar}(X)\operatorname{diag}(\text{sorted }\sigma(X))$
    in place of the retraction, unpreconditioned dual ascent from $\Lambda_0 = -\tfrac14L_W(G)$
    (20 steps, $\alpha = 0.1(1 - k/K)$, no final tangent projection) and bf16 polar
    factors. Both pieces are written here by composition, on the library's public
    interfaces: :class:`SortedSigmaDGram` subclasses :class:`geomuon.manifolds.DGram`,
    :class:`ReferenceManifoldMuon` subclasses :class:`geomuon.optimizers.ManifoldMuon`.

Mechanism tracked at every evaluation, per layer: $\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$
(row blocks of ``c_attn``), the max attention logit and the mean softmax-Jacobian
Frobenius norm on the fixed validation windows.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch

from geomuon.manifolds import DGram, MatrixManifold, Stiefel
from geomuon.manifolds.base import matrix_method
from geomuon.manifolds.linalg import msign
from geomuon.optimizers import ManifoldMuon
from geomuon.optimizers.manifold_muon import default_dual_steps, default_dual_update, default_polish_rounds
from geomuon.pretrain.provenance import markdown_table

from . import common
from .common import Size, Variant
from .sweep import GRIDS, Grid, LearningRateSweep

NAME = "manifolds"
TITLE = "Different layers, different manifolds (seed 000) at CPU scale"

_MODEL = dict(n_layer=3, n_head=4, n_embd=128, block_size=64)
SIZES = {
    "full": Size(model="cpu-small", model_overrides=_MODEL, steps=400, batch_size=16, eval_every=40,
                 eval_batches=2, final_eval_batches=16, lr=0.02, adamw_lr=3e-3, warmup_steps=20),
    "tiny": Size(model="cpu-tiny", model_overrides=dict(n_layer=1, n_head=2, n_embd=16, block_size=16), steps=3,
                 batch_size=2, eval_every=2, eval_batches=1, final_eval_batches=2, warmup_steps=1),
}
#: Column-norm cap of question (a), in raw units: 1 is the norm of a Stiefel column, so a
#: capped DGram weight has $\sigma_{\max} \le 1$, the spectral bound of Stiefel attention.
COLUMN_CAP = 1.0


# ----------------------------------------------------------------------------- (b) reference choices


class SortedSigmaDGram(DGram):
    r"""DGram with the seed code's map in place of the retraction:
    $X \mapsto \operatorname{msign}_{\text{bf16}}(X)\operatorname{diag}(\sigma_1 \ge \dots \ge \sigma_n)$,
    the polar factor (Polar Express in bf16, as the seed code's msign) times the *sorted*
    singular values of $X = W + V$ (fp32 SVD). It is not a retraction: a point whose
    column norms are not sorted moves even when $V = 0$. Returns fp32 for fp32 input."""

    @matrix_method("u")
    def retr(self, x, u):
        y = x.float() + u.float()
        polar = msign(y, "polar_express", compute_dtype=torch.bfloat16).float()
        return (polar * torch.linalg.svdvals(y).unsqueeze(-2)).to(x.dtype)


def _rms(H: torch.Tensor) -> torch.Tensor:
    return H.pow(2).mean(dim=(-2, -1)).sqrt()


class ReferenceManifoldMuon(ManifoldMuon):
    r"""Manifold Muon with the seed code's solver: dual ascent on $\Lambda$ from
    $\Lambda_0 = -\tfrac14 L_W(G)$, $A_k = \operatorname{msign}_{\text{bf16}}(G + L_W^*(\Lambda_k))$,
    $\Lambda \leftarrow \Lambda - \alpha(1 - k/K)\,L_W(A_k)$ (no Jacobi preconditioning),
    stopping at RMS$(L_W(A_k)) < 10^{-6}$, and the last $A_k$ used as is (no tangent
    projection); then $W \leftarrow R_W(-\eta A)$ with the manifold's ``retr``.

    Written on the constraint interface every manifold exposes (``constraint``,
    ``constraint_adjoint``), so it runs on any of them. Directions in bf16, the rest fp32.
    """

    def __init__(self, params, *, reference_steps: int = 20, reference_alpha: float = 0.1, **kwargs):
        if isinstance(reference_steps, bool) or not isinstance(reference_steps, int) or reference_steps < 1:
            # 0 had left the step without a direction (UnboundLocalError at the first step)
            raise ValueError(f"ReferenceManifoldMuon: reference_steps must be an integer >= 1 (got {reference_steps!r})")
        self.reference_steps = reference_steps
        self.reference_alpha = reference_alpha
        super().__init__(params, **kwargs)
        for group in self.param_groups:  # the seed code's step: its manifold's retr, no warm start
            group.update(retraction="manifold", warm_start=False)

    def _direction(self, group, M, params, keep=None):
        manifold = self._manifold_of(group, params[0])
        W = self._points(group, params)
        G = M.to(W.dtype)
        lam = -0.25 * manifold.constraint(W, G)
        K = self.reference_steps
        # The seed code stops at the first k where every RMS(L_W(A_k)) < 1e-6 and keeps that A_k.
        # Reading that test on the host (a `break`) synchronised the device at every dual step;
        # instead a device flag freezes Λ and A from then on, which leaves the same A.
        converged = torch.zeros((), dtype=torch.bool, device=W.device)
        A = None
        for k in range(K):
            A_k = msign(G + manifold.constraint_adjoint(W, lam), "polar_express", compute_dtype=torch.bfloat16).to(W.dtype)
            H = manifold.constraint(W, A_k)
            A = A_k if A is None else torch.where(converged, A, A_k)
            converged = converged | (_rms(H) < 1e-6).all()
            lam = torch.where(converged, lam, lam - self.reference_alpha * (1 - k / K) * H)
        # ManifoldMuon's batches return new points: decay, then the manifold's own retr (a
        # skipped matrix keeps its old one: ManifoldMuon._apply selects it).
        lr = float(group["lr"])
        return manifold.retr(W * (1.0 - lr * float(group["weight_decay"])), -lr * A)


# ----------------------------------------------------------------------------- variants


def _rebuild_manifold_muon(assignment, cls, adjust_group):
    """Replace the assignment's ManifoldMuon by ``cls`` over the same param groups, each
    passed through ``adjust_group(group) -> group`` (state is empty before training)."""
    old = assignment.optimizers["manifold_muon"]
    groups = [adjust_group(dict(group)) for group in old.param_groups]
    assignment.optimizers["manifold_muon"] = cls(groups)
    return assignment


def _on_dgram(group: dict) -> bool:
    """Whether a param group's manifold (a spec, see ``MatrixManifold.spec``) is DGram."""
    spec = group.get("manifold")
    return spec is not None and isinstance(MatrixManifold.resolve(spec), DGram)


def column_cap(W: torch.Tensor, *, lr: float) -> torch.Tensor:
    r"""Scale every column of the DGram side (rows of a wide ``W``) longer than
    :data:`COLUMN_CAP` back to it: :class:`~geomuon.optimizers.regulate.ColumnCap` with its
RMS→RMS threshold set per shape to the raw norm, $w_{\max} = c\,\sqrt{d_{\text{in}} / d_{\text{out}}}$
    with $c$ = :data:`COLUMN_CAP` and $d_{\text{in}}, d_{\text{out}}$ the fan-in and fan-out.
    Keeps DGram points on DGram. Unchecked, as the optimizer's own regulators run: no host
    read of the weight's finiteness inside a step."""
    from geomuon.optimizers.regulate import ColumnCap, rms_scale

    return ColumnCap(w_max=COLUMN_CAP * rms_scale(W.shape)).unchecked(W, lr=lr)


def column_cap_on_dgram(model, assignment, hyper):
    """Question (a): :func:`column_cap` after every step of the DGram groups."""

    def adjust(group):
        if _on_dgram(group):
            group["regulate"] = column_cap
        return group

    return _rebuild_manifold_muon(assignment, ManifoldMuon, adjust)


def reference_choices_on_dgram(model, assignment, hyper):
    """Question (b): the DGram groups get the seed code's choices (sorted-σ map, reference
    dual ascent, bf16 polar factors); the Stiefel groups keep ours."""
    from geomuon.optimizers.assign import Assignment

    optimizer = assignment.optimizers.pop("manifold_muon")
    ours, reference = [], []
    for group in optimizer.param_groups:
        group = dict(group)
        if _on_dgram(group):
            group["manifold"] = SortedSigmaDGram()
            reference.append(group)
        else:
            ours.append(group)
    optimizers = dict(assignment.optimizers)
    if ours:
        optimizers["manifold_muon"] = ManifoldMuon(ours)
    optimizers["manifold_muon_reference"] = ReferenceManifoldMuon(reference)
    return Assignment(assignment.strategy, assignment.rows, optimizers)


def variants(size: Size) -> list[Variant]:
    """What this study compares at ``size``: one :class:`~geomuon.pretrain.studies.common.Variant` per arm, each trained for every seed."""
    return [
        Variant("unconstrained", "Muon on attention and MLP, decoupled weight decay", "unconstrained"),
        Variant("all_stiefel", "Manifold Muon, Stiefel attention and MLP", "all_stiefel"),
        Variant("all_dgram", "Manifold Muon, DGram attention and MLP", "all_dgram"),
        Variant("hetero", "Stiefel attention, DGram MLP", "hetero"),
        Variant("hetero_inv", "DGram attention, Stiefel MLP", "hetero_inv"),
        Variant("hetero_inv+colcap", f"hetero_inv with the DGram attention's column norms capped at "
                f"{COLUMN_CAP:g} after every step (a Stiefel column's norm, so σ_max ≤ 1 as for Stiefel "
                "attention), question (a)", "hetero_inv", customize=column_cap_on_dgram),
        Variant("hetero_inv+reference", "hetero_inv with the seed code's choices on the DGram attention "
                "(sorted-σ map, reference dual ascent, bf16), question (b)", "hetero_inv",
                customize=reference_choices_on_dgram),
    ]


# ----------------------------------------------------------------------------- observables


@torch.no_grad()
def extra_metrics(model, evaluation, memory) -> dict:
    r"""Per layer: $\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$ (exact, float64 SVD of the row
    blocks of the fused ``c_attn``) and the largest attention column norm (``c_attn`` and
    ``c_proj``; 1 for Stiefel), which shows whether the question-(a) cap was reached."""
    product, column = {}, {}
    for name, layer in model.attention_layers().items():
        d = model.config.n_embd
        W = layer.c_attn.weight.detach().double()
        sq = torch.linalg.matrix_norm(W[:d], ord=2)
        sk = torch.linalg.matrix_norm(W[d:2 * d], ord=2)
        product[name] = float(sq * sk)
        # largest column norm (1 for Stiefel attention; the question-(a) cap's units)
        column[name] = max(float(w.norm(dim=0).max()) for w in (W, layer.c_proj.weight.detach().double()))
    return {"qk_sigma_product": product, "attn_column_norm": column}


# ----------------------------------------------------------------------------- page


def _last(record, key):
    return max(common.final_eval(record)[key].values())


def _growth(record, key):
    """Last over first evaluation of the layer maximum of ``key``."""
    first, last = record["evals"][0], record["evals"][-1]
    return max(last[key].values()) / max(first[key].values())


def _saturation_verdict(dgram: list[float], stiefel: list[float]) -> str:
    """Whether DGram attention shows the consequence the paper proposes for its logit
    growth: a saturated softmax, whose Jacobian norm vanishes."""
    verdict = common.separated(dgram, stiefel)
    if not verdict:
        return "Whether DGram attention's softmax saturates more is therefore not resolved at this size."
    if common.mean_std(dgram)[0] < common.mean_std(stiefel)[0]:
        return ("DGram attention's softmax is closer to saturation (a saturated softmax has a vanishing "
                "Jacobian): the mechanism the paper proposes is visible here, growth and consequence.")
    return ("The Jacobian is larger under DGram attention, not smaller: its softmax has not saturated more "
            "than Stiefel attention's (a saturated softmax has a vanishing Jacobian), so at this size the "
            "mechanism the paper proposes shows only its first half, the growth of σ(W_Q)σ(W_K) and of "
            "the logits.")


def report(results, size, meta, figure_dir) -> str:
    """The results page body (Markdown) from the measured runs: ``results`` maps variant name → run records, figures go to ``figure_dir``."""
    names = list(results)
    rows = []
    for name in names:
        records = results[name]
        rows.append([
            f"`{name}`",
            common.fmt([r["final_val_loss"] for r in records]),
            common.fmt([common.final_eval(r)["val_acc"] for r in records]),
            f"{sum(r['diverged'] for r in records)} of {len(records)}",
            common.fmt([_last(r, "qk_sigma_product") for r in records], 2),
            common.fmt([_last(r, "attn_logit") for r in records], 2),
            common.fmt([min(common.final_eval(r)["softmax_jacobian"].values()) for r in records], 3),
            common.fmt([_last(r, "attn_column_norm") for r in records], 3),
        ])
    header = ["variant", "final val loss", "val accuracy", "diverged",
              "max σ(W_Q)σ(W_K)", "max attention logit", "min softmax-Jacobian norm",
              "max attention column norm"]
    labels = "\n".join(f"* `{v.name}`: {v.label}." for v in variants(SIZES["tiny"]))
    figures = [
        *common.loss_figures(results, figure_dir),
        common.plot_panels(results, lambda e: e["qk_sigma_product"], "σ_max(W_Q)·σ_max(W_K) per layer",
                           "σ(W_Q)σ(W_K)", figure_dir, "qk_sigma_product.png", logy=True),
        common.plot_panels(results, lambda e: e["attn_logit"], "max attention logit per layer", "max logit",
                           figure_dir, "attention_logit.png"),
        common.plot_panels(results, lambda e: e["softmax_jacobian"], "mean softmax-Jacobian norm per layer",
                           "‖J‖_F", figure_dir, "softmax_jacobian.png"),
    ]
    final = {n: [r["final_val_loss"] for r in results[n]] for n in names}
    product = {n: [_last(r, "qk_sigma_product") for r in results[n]] for n in names}
    logit = {n: [_last(r, "attn_logit") for r in results[n]] for n in names}
    growth = {n: [_growth(r, "qk_sigma_product") for r in results[n]] for n in names}
    jacobian = {n: [min(common.final_eval(r)["softmax_jacobian"].values()) for r in results[n]] for n in names}
    findings = [
        common.compare_sentence("hetero", final["hetero"], "all_stiefel", final["all_stiefel"], "Final val loss"),
        common.compare_sentence("hetero", final["hetero"], "unconstrained", final["unconstrained"], "Final val loss"),
        common.compare_sentence("all_stiefel", final["all_stiefel"], "unconstrained", final["unconstrained"],
                                "Final val loss"),
        "Diverged runs (non-finite loss, or final val loss more than 0.5 nat above the run's best): "
        + ", ".join(f"`{n}` {sum(r['diverged'] for r in results[n])}/{len(results[n])}" for n in names) + ".",
        "Mechanism, DGram vs Stiefel attention: "
        + common.compare_sentence("hetero_inv", product["hetero_inv"], "hetero", product["hetero"],
                                  "final max σ(W_Q)σ(W_K)", lower_is_better=None, digits=2)
        + " Growth of that product from initialisation to the end: "
        + ", ".join(f"`{n}` ×{common.fmt(growth[n], 2)}" for n in ("hetero", "hetero_inv", "all_dgram")) + ".",
        common.compare_sentence("hetero_inv", logit["hetero_inv"], "hetero", logit["hetero"],
                                "Final max attention logit", lower_is_better=None, digits=2),
        common.compare_sentence("hetero_inv", jacobian["hetero_inv"], "hetero", jacobian["hetero"],
                                "Final min softmax-Jacobian norm", lower_is_better=None)
        + " " + _saturation_verdict(jacobian["hetero_inv"], jacobian["hetero"]),
        "(a) " + common.compare_sentence("hetero_inv+colcap", final["hetero_inv+colcap"], "hetero_inv",
                                         final["hetero_inv"], "Final val loss"),
        "(a) " + common.compare_sentence("hetero_inv+colcap", product["hetero_inv+colcap"], "hetero_inv",
                                         product["hetero_inv"], "final max σ(W_Q)σ(W_K)", lower_is_better=None, digits=2),
        "(b) " + common.compare_sentence("hetero_inv+reference", final["hetero_inv+reference"], "hetero_inv",
                                         final["hetero_inv"], "Final val loss"),
        "(b) " + common.compare_sentence("hetero_inv+reference", product["hetero_inv+reference"], "hetero_inv",
                                         product["hetero_inv"], "final max σ(W_Q)σ(W_K)", lower_is_better=None, digits=2),
    ]
    steps = size.steps
    start = {n: [max(r["evals"][0]["attn_column_norm"].values()) for r in results[n]] for n in names}
    init = (f"Constrained weights start where `geomuon.optimizers.assign.assign` puts them; measured at step 0, the "
            f"largest attention column norm is {common.fmt(start['hetero_inv'], 3)} under DGram attention "
            f"(`hetero_inv`) and {common.fmt(start['hetero'], 3)} under Stiefel attention (`hetero`).")
    return "\n\n".join([
        "The seed paper trains GPT-2 small for 50k steps on OpenWebText; all-DGram and hetero-inv "
        "diverge there near steps 15–20k, and hetero is best (val loss 3.3544 vs 3.3679 all-Stiefel and "
        "3.3855 unconstrained; the paper's numbers, not ours). This page reruns the comparison on a "
        f"small GPT and character-level tiny Shakespeare for {steps} steps, with the same hyperparameters "
        f"for every variant (Manifold Muon and Muon lr {size.lr:g} with momentum 0.95 Nesterov, as in the "
        f"paper; AdamW lr {size.adamw_lr:g} on embeddings, head and LayerNorm gains, not tuned; warmup "
        f"then cosine decay; Manifold Muon with the library's defaults: {engine_defaults()}).",
        "## Variants\n\n" + labels + "\n\n" + init,
        "## Results\n\nMean ± sample standard deviation over seeds, at the last step, on the same "
        "validation windows for every run. The mechanism columns are the largest value over layers.\n\n"
        + markdown_table(header, rows),
        common.screen_heading(size.seeds) + "\n\n" + "\n".join(f"* {f}" for f in findings)
        + "\n\nThe paper's instability appeared after 15k–20k steps of a 124M-parameter model; a run of "
        f"{steps} steps cannot show whether DGram attention would diverge later. What it can show is the "
        "direction of the mechanism (whether σ(W_Q)σ(W_K) and the attention logits grow faster under "
        "DGram attention, and whether the softmax Jacobian shrinks), which the figures below track.",
        "## Figures\n\n" + "\n\n".join(f"![{f}]({NAME}/{f})" for f in figures),
    ])


def engine_defaults() -> str:
    """ManifoldMuon's default solver on the CPU for Stiefel and DGram, in words, read off the
    optimizer's defaults (so a page never describes an engine it did not run)."""
    def plural(count: int, noun: str) -> str:
        return f"{count} {noun}{'' if count == 1 else 's'}"

    return "; ".join(
        f"{type(m).__name__} {plural(default_dual_steps(m), 'warm-started ' + default_dual_update(m) + ' dual step')} "
        f"and {plural(default_polish_rounds(m), 'polish round')}" for m in (Stiefel(), DGram())
    ) + " (the CPU's eigendecomposition dualizer, Gram-space fp32 retraction)"


#: ``geomuon study manifolds-sweep``: every arm above at its own learning rate.
SWEEP = LearningRateSweep(
    sys.modules[__name__], "manifolds-sweep", "Different layers, different manifolds: every arm at its own learning rate",
    # one extension per arm: seven arms, the reference one ~3x the others' cost, fit an hour on two cores
    grids={"full": Grid(max_extensions=1), "tiny": GRIDS["tiny"]},
    comparisons=[("hetero", "all_stiefel"), ("hetero", "unconstrained"), ("all_stiefel", "unconstrained"),
                 ("all_dgram", "unconstrained"), ("hetero_inv", "unconstrained"),
                 ("hetero_inv+colcap", "hetero_inv"), ("hetero_inv+reference", "hetero_inv")])


def wide_variants(size: Size) -> list[Variant]:
    """``unconstrained`` and ``hetero`` at twice the size's width (same depth, heads and context):
    whether the best learning rate moves when the width doubles."""
    width = 2 * size.model_overrides["n_embd"]
    arms = {v.name: v for v in variants(size)}
    return [dataclasses.replace(arms[name], name=f"{name} wide", label=f"{arms[name].label}; width {width}",
                                model={"n_embd": width}) for name in ("unconstrained", "hetero")]


#: ``geomuon study manifolds-width-sweep``: the learning-rate transfer question, at twice the width.
WIDTH_SWEEP = LearningRateSweep(
    types.SimpleNamespace(NAME=NAME, SIZES=SIZES, variants=wide_variants), "manifolds-width-sweep",
    "Different layers, different manifolds at twice the width: does the best learning rate move?",
    comparisons=[("hetero wide", "unconstrained wide")],
    note="The same two arms at the study's own width are swept on the `manifolds-sweep` page: if the best rate "
         "transfers across width, as the modular norm's scaling claims, the two pages' best rates are the same grid "
         "point.")
