r"""Lipschitz bounds of the seed-003 Lipschitz transformer, and an empirical estimator
to hold them against.

Norms and spaces
----------------
Activations are sequences $X \in \mathbb R^{T\times d}$ (tokens on rows). Their norm is
the **largest per-token RMS norm**

$$\|X\| = \max_t \|x_t\|_{\mathrm{RMS}},\qquad \|x\|_{\mathrm{RMS}} = \|x\|_2/\sqrt{\dim x},$$

on every layer (embedding width $d$, MLP width, vocabulary). A weight $W$
(``[fan_out, fan_in]``) acting on each token then has the RMS→RMS operator norm
$\|W\| = \sqrt{\text{fan\_in}/\text{fan\_out}}\,\sigma_{\max}(W)$ — the norm the
regulators of :mod:`geomuon.optimizers.regulate` cap. The max over tokens is what makes the
bound independent of the sequence length (in the Frobenius norm over the sequence,
causal attention's first token can feed all $T$ outputs and the constant grows like
$\sqrt T$).

Dot-product attention is not globally Lipschitz, so the bound is **local**: it holds for
inputs whose tokens all have RMS at most ``input_radius`` $r_0$ (default 1: the unit-RMS
embedding of the Lipschitz model). This set is convex, so a bound on the Jacobian over it
is a Lipschitz bound on it. Input space of :func:`transformer_lipschitz_bound`: the
embedded sequence entering the first block; output space: the logits.

Composition rules (each proved in its function's docstring):

* composition multiplies constants; a per-token map keeps its constant under the max;
* residual $x \mapsto (1-a)x + a f(x)$: $(1-a) + aL_f$ (:func:`residual_lipschitz`);
* GELU$/1.1289$: $\max|\text{GELU}'| / 1.1289$, with $\max|\text{GELU}'| =
  \text{GELU}'(\sqrt2) = \Phi(\sqrt2) + \sqrt2\,\varphi(\sqrt2) = 1.1289041\ldots$
  (slightly *above* 1.1289, so the scaled GELU is $1.0000037$-Lipschitz, not 1);
* MLP: $\|W_\text{out}\|\,(\max|\text{GELU}'|\cdot s_\text{gelu})\,\|W_\text{in}\|$ with
  $s_\text{gelu} = 1/1.1289$ the forward's scale, counted **once** (the reference code
  divides by 1.1289 a second time in the bound, understating it);
* attention with heads: :func:`attention_lipschitz`. With one head it is DESIGN §5's
  $\tfrac13\|W_o\|(\|W_v\| + 2\|W_v\|r^2\|W_q\|\|W_k\|)$; with $H$ heads the per-head
  slices enter, and a head slice of an orthonormal $W_q$ has RMS→RMS norm $\sqrt H$, so
  the multi-head constant is up to $\sqrt H\,(1 + 2Hr^2)/3$ where the one-head formula
  applied to full matrices would claim $(1 + 2r^2)/3$ (which the empirical estimator
  beats: see the tests).

Dtypes: norms are computed in float64 by SVD (a certificate must not rely on a
power-iteration lower bound); the estimator runs in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

__all__ = [
    "GELU_LIPSCHITZ",
    "REFERENCE_GELU_DIVISOR",
    "rms_operator_norm",
    "token_rms_max",
    "sequence_rms",
    "residual_lipschitz",
    "mlp_lipschitz",
    "attention_lipschitz",
    "AttentionBound",
    "TransformerBound",
    "transformer_lipschitz_bound",
    "EmpiricalLipschitz",
    "empirical_lipschitz",
]

#: $\max_x |\text{GELU}'(x)| = \text{GELU}'(\sqrt 2) = \tfrac12(1 + \operatorname{erf} 1) +
#: 1/(e\sqrt\pi)$ for the exact (erf) GELU: $\text{GELU}'' = \varphi(x)(2 - x^2)$ vanishes at
#: $\pm\sqrt2$, and $\text{GELU}'(-\sqrt2) = 1 - \text{GELU}'(\sqrt2) > -1$.
GELU_LIPSCHITZ = 0.5 * (1.0 + math.erf(1.0)) + math.exp(-1.0) / math.sqrt(math.pi)

#: The divisor the Lipschitz model applies to GELU (seed 003's rounded constant).
REFERENCE_GELU_DIVISOR = 1.1289


def rms_operator_norm(W: torch.Tensor) -> float:
    r"""$\sqrt{\text{fan\_in}/\text{fan\_out}}\,\sigma_{\max}(W)$ of a ``[fan_out, fan_in]``
    matrix, exact (float64 SVD)."""
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ValueError(
            f"rms_operator_norm: expected a [fan_out, fan_in] matrix, got "
            f"{tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__}"
        )
    fan_out, fan_in = W.shape
    sigma = torch.linalg.matrix_norm(W.detach().double(), ord=2).item()
    return math.sqrt(fan_in / fan_out) * sigma


def token_rms_max(X: torch.Tensor) -> torch.Tensor:
    r"""$\max_t \|x_t\|_{\mathrm{RMS}}$ over every dimension but the batch one: ``[B, ..., k]``
    → ``[B]`` (RMS over the last dimension, max over the rest)."""
    rms = X.pow(2).mean(-1).sqrt()
    return rms.reshape(rms.size(0), -1).amax(-1)


def sequence_rms(X: torch.Tensor) -> torch.Tensor:
    r"""$\bigl(\sum_t \|x_t\|_{\mathrm{RMS}}^2\bigr)^{1/2}$ (the Frobenius norm over $\sqrt{\dim x}$):
    ``[B, ..., k]`` → ``[B]``. The norm of the ``sequence_length`` variant of
    :func:`transformer_lipschitz_bound`."""
    return X.pow(2).mean(-1).reshape(X.size(0), -1).sum(-1).sqrt()


def residual_lipschitz(a: float, inner: float) -> float:
    r"""Lipschitz constant of $x \mapsto (1-a)x + a f(x)$ for an $L_f$-Lipschitz $f$ and
    $a \in [0, 1]$: $\|(1-a)(x-y) + a(f(x)-f(y))\| \le ((1-a) + aL_f)\|x-y\|$."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"residual_lipschitz: the residual weight a must lie in [0, 1], got {a}")
    return (1.0 - a) + a * inner


def mlp_lipschitz(
    w_in: torch.Tensor, w_out: torch.Tensor, gelu_scale: float = 1.0 / REFERENCE_GELU_DIVISOR
) -> float:
    r"""$x \mapsto W_\text{out}\,s\,\text{GELU}(W_\text{in}x)$ (per token):
    $\|W_\text{out}\|\cdot s\,$:data:`GELU_LIPSCHITZ`$\cdot\|W_\text{in}\|$ in RMS→RMS norms
    (the RMS norm of the hidden layer is the same on both sides, and GELU acts
    entrywise, so $\|s\,\text{GELU}(a) - s\,\text{GELU}(b)\|_{\mathrm{RMS}} \le
    s\,\text{GELU}_\text{Lip}\|a - b\|_{\mathrm{RMS}}$)."""
    return rms_operator_norm(w_out) * gelu_scale * GELU_LIPSCHITZ * rms_operator_norm(w_in)


@dataclass
class AttentionBound:
    """Constants of one attention sub-layer for inputs of token RMS $\\le$ ``radius``."""

    lipschitz: float
    output_radius: float
    head_terms: list[float] = field(default_factory=list)


def _head_slices(W: torch.Tensor, n_head: int, what: str) -> torch.Tensor:
    rows = W.size(0)
    if rows % n_head:
        raise ValueError(f"attention: {what} has {rows} rows, not divisible by n_head={n_head}")
    return W.detach().double().reshape(n_head, rows // n_head, W.size(1))


def attention_lipschitz(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    *,
    n_head: int,
    score_scale: float,
    attention_scale: float = 1.0 / 3.0,
    radius: float = 1.0,
) -> AttentionBound:
    r"""Lipschitz bound of multi-head causal attention (RoPE allowed) on inputs with token RMS
    $\le r$ (``radius``).

    Head $h$ has slices $W_q^h, W_k^h, W_v^h \in \mathbb R^{d_h\times d}$ (rows
    $hd_h..(h+1)d_h$), scores $s_{ts} = \varsigma\langle q_t, k_s\rangle$ ($\varsigma$ =
    ``score_scale``, $1/d_h$ in the Lipschitz model), $y^h_t = \sum_s p_{ts} v^h_s$, and the
    output is $c\,W_o[y^1; \dots; y^H]$ ($c$ = ``attention_scale``). Write
    $\sigma_{xh} = \sigma_{\max}(W_x^h)$ and $\|x\|_2 \le \sqrt d\,r$.

    *Proof.* $\delta y^h_t = \sum_s p_{ts}\,\delta v^h_s + \sum_s \delta p_{ts}\,v^h_s$. The first
    term has $\ell_2$ norm $\le \max_s \|\delta v^h_s\|_2 \le \sigma_{vh}\sqrt d\,\|\delta X\|$. With
    $\delta p_t = (\operatorname{diag}p_t - p_tp_t^\top)\delta s_t$ the second is
    $\sum_s p_{ts}(\delta s_{ts} - \bar{\delta s_t})(v^h_s - \bar v^h)$, of norm
    $\le \sqrt{\operatorname{Var}_p \delta s}\sqrt{\operatorname{Var}_p v} \le \max_s|\delta s_{ts}|
    \max_s\|v^h_s\|_2$ (Cauchy–Schwarz), with $\max_s\|v^h_s\|_2 \le \sigma_{vh}\sqrt d\,r$ and
    $|\delta s_{ts}| \le \varsigma(\|\delta q_t\|\|k_s\| + \|q_t\|\|\delta k_s\|) \le
    2\varsigma d\,r\,\sigma_{qh}\sigma_{kh}\|\delta X\|$ (RoPE rotates each token: norms unchanged).
    So $\|\delta y^h_t\|_2 \le \sqrt d\,\sigma_{vh}(1 + 2\varsigma d r^2\sigma_{qh}\sigma_{kh})\|\delta X\|$,
    and concatenating, $\|\delta Y_t\|_{\mathrm{RMS}} = \sqrt{\sum_h\|\delta y^h_t\|_2^2/d}$:

    $$L_\text{att} = c\,\|W_o\|\sqrt{\textstyle\sum_h \sigma_{vh}^2\bigl(1 + 2\varsigma d\,r^2\sigma_{qh}\sigma_{kh}\bigr)^2}.$$

    With one head ($\varsigma d = 1$, $\sigma_{xh} = \|W_x\|$) this is
    $c\|W_o\|(\|W_v\| + 2\|W_v\|r^2\|W_q\|\|W_k\|)$, DESIGN §5. Every $y^h_t$ is a convex
    combination of values, so the output radius is $c\|W_o\|\sqrt{\sum_h\sigma_{vh}^2}\;r$.

    Args:
        q: ``[n_head·d_head, d]``.
        k: ``[n_head·d_head, d]``.
        v: ``[n_head·d_head, d]``.
        o: ``[d, n_head·d_head]``.

    Returns:
        :class:`AttentionBound` (``head_terms`` = the per-head square-root terms).
    """
    if n_head < 1:
        raise ValueError(f"attention_lipschitz: n_head must be >= 1, got {n_head}")
    d = q.size(1)
    sigma = {
        name: torch.linalg.matrix_norm(_head_slices(W, n_head, name), ord=2)
        for name, W in (("q", q), ("k", k), ("v", v))
    }
    head_terms = sigma["v"] * (1.0 + 2.0 * score_scale * d * radius**2 * sigma["q"] * sigma["k"])
    outer = attention_scale * rms_operator_norm(o)
    lipschitz = outer * head_terms.pow(2).sum().sqrt().item()
    output_radius = outer * sigma["v"].pow(2).sum().sqrt().item() * radius
    return AttentionBound(lipschitz, output_radius, head_terms.tolist())


@dataclass
class TransformerBound:
    r"""Result of :func:`transformer_lipschitz_bound`.

    ``bound``: Lipschitz constant from the embedded sequence to the logits, in the max
    per-token RMS norm on both sides (multiply by $\sqrt{V/d}$ for per-token $\ell_2$ norms),
    or in :func:`sequence_rms` when a ``sequence_length`` was given.
    ``sublayers``: the constants $L_f$ of each attention and MLP map, in order;
    ``residuals``: $(1-a) + aL_f$ for each; ``radii``: the token-RMS bound of the
    activations entering each sub-layer and, last, entering the head; ``head``: $\|W_\text{head}\|$.
    """

    bound: float
    sublayers: list[float]
    residuals: list[float]
    radii: list[float]
    head: float


def transformer_lipschitz_bound(weights: Mapping, *, sequence_length: int | None = None) -> TransformerBound:
    r"""Lipschitz bound of the seed-003 Lipschitz transformer from its weights.

    ``weights`` (what ``geomuon.pretrain.model.GPT.lipschitz_weights()`` returns):

    * ``"blocks"``: a list, one dict per block with ``"q", "k", "v"`` (``[d, d]``), ``"o"``
      (``[d, d]``), ``"mlp_in"`` (``[hidden, d]``), ``"mlp_out"`` (``[d, hidden]``), all in
      ``nn.Linear`` ``[out, in]`` layout;
    * ``"head"``: ``[vocab, d]``;
    * ``"n_head"``: heads per block. If absent, inferred from the Lipschitz model's
      convention ``score_scale`` $= 1/d_\text{head}$ as $d\cdot$``score_scale``;
    * ``"residual_weight"`` $a$ (default $1/(2N)$), ``"attention_scale"`` (default 1/3),
      ``"score_scale"`` (default $1/d_\text{head}$), ``"gelu_scale"`` (default 1/1.1289),
      ``"input_radius"`` $r_0$ (default 1).

    Forward of each block: $x \leftarrow (1-a)x + a\,\text{attn}(x)$, then
    $x \leftarrow (1-a)x + a\,\text{mlp}(x)$; the logits are $W_\text{head}x$. The radius
    of the activations is propagated with the same rule ($|\text{GELU}(z)| \le |z|$ bounds
    the MLP output by $\|W_\text{out}\|s\|W_\text{in}\|r$) and feeds each attention's bound.

    $$L = \|W_\text{head}\|\prod_{\text{sub-layers } i}\bigl((1-a) + aL_i\bigr).$$

    ``sequence_length`` $T$ switches to the whole-sequence norm :func:`sequence_rms`
    ($\ell_2$ over tokens of per-token RMS) on input and output. Per-token maps keep their
    constants; each attention constant is multiplied by $\sqrt T$, because every output
    token moves by at most $L_\text{att}\max_s\|\delta x_s\| \le L_\text{att}\|\delta X\|$ and
    there are $T$ of them (causal attention really does spread one token's perturbation
    over all later tokens). Sequences up to $T$ tokens are covered.

    Returns:
        :class:`TransformerBound`; norms and spaces as in the module docstring.
    """
    if not isinstance(weights, Mapping) or "blocks" not in weights or "head" not in weights:
        raise ValueError(
            "transformer_lipschitz_bound: weights must be a dict with 'blocks' (list of "
            "{'q','k','v','o','mlp_in','mlp_out'}) and 'head' (see the docstring)"
        )
    blocks = list(weights["blocks"])
    if not blocks:
        raise ValueError("transformer_lipschitz_bound: weights['blocks'] is empty")
    d = blocks[0]["q"].size(1)
    n_head = _n_head(weights, d)
    a = float(weights.get("residual_weight", 1.0 / (2 * len(blocks))))
    score_scale = float(weights.get("score_scale", n_head / blocks[0]["q"].size(0)))
    attention_scale = float(weights.get("attention_scale", 1.0 / 3.0))
    gelu_scale = float(weights.get("gelu_scale", 1.0 / REFERENCE_GELU_DIVISOR))
    radius = float(weights.get("input_radius", 1.0))

    if sequence_length is not None and int(sequence_length) < 1:
        raise ValueError(f"transformer_lipschitz_bound: sequence_length must be >= 1, got {sequence_length}")
    spread = 1.0 if sequence_length is None else math.sqrt(int(sequence_length))
    sublayers, residuals, radii = [], [], []
    bound = 1.0
    for index, block in enumerate(blocks):
        missing = {"q", "k", "v", "o", "mlp_in", "mlp_out"} - set(block)
        if missing:
            raise ValueError(f"transformer_lipschitz_bound: block {index} lacks {sorted(missing)}")
        attention = attention_lipschitz(
            block["q"], block["k"], block["v"], block["o"], n_head=n_head,
            score_scale=score_scale, attention_scale=attention_scale, radius=radius,
        )
        mlp_gain = rms_operator_norm(block["mlp_out"]) * gelu_scale * rms_operator_norm(block["mlp_in"])
        mlp = mlp_lipschitz(block["mlp_in"], block["mlp_out"], gelu_scale)
        for lipschitz, output_radius in ((spread * attention.lipschitz, attention.output_radius), (mlp, None)):
            radii.append(radius)
            sublayers.append(lipschitz)
            residuals.append(residual_lipschitz(a, lipschitz))
            bound *= residuals[-1]
            sublayer_out = output_radius if output_radius is not None else mlp_gain * radius
            radius = (1.0 - a) * radius + a * sublayer_out
    radii.append(radius)
    head = rms_operator_norm(weights["head"])
    return TransformerBound(bound * head, sublayers, residuals, radii, head)


def _n_head(weights: Mapping, d: int) -> int:
    if "n_head" in weights:
        return int(weights["n_head"])
    if "score_scale" not in weights:
        raise ValueError(
            "transformer_lipschitz_bound: weights need 'n_head' (or the Lipschitz model's "
            "'score_scale' = 1/d_head to infer it)"
        )
    inferred = d * float(weights["score_scale"])
    n_head = round(inferred)
    if n_head < 1 or abs(inferred - n_head) > 1e-9 or d % n_head:
        raise ValueError(
            f"transformer_lipschitz_bound: cannot infer n_head from score_scale="
            f"{weights['score_scale']} and d={d}; pass weights['n_head']"
        )
    return n_head


# --------------------------------------------------------------------------------------
# empirical estimator


@dataclass
class EmpiricalLipschitz:
    """Best ratio $\\|f(x) - f(y)\\|/\\|x - y\\|$ found, a lower bound on the Lipschitz
    constant, with the pair that reaches it and every restart's best ratio."""

    estimate: float
    x: torch.Tensor
    y: torch.Tensor
    per_restart: list[float]


def _project_to_radius(X: torch.Tensor, radius: float | None) -> torch.Tensor:
    if radius is None:
        return X
    rms = X.pow(2).mean(-1, keepdim=True).sqrt()
    return X / (rms / radius).clamp_min(1.0)


def empirical_lipschitz(
    f: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    *,
    restarts: int = 8,
    steps: int = 200,
    lr: float = 0.02,
    radius: float | None = 1.0,
    perturbation: float = 0.1,
    in_norm: Callable[[torch.Tensor], torch.Tensor] = token_rms_max,
    out_norm: Callable[[torch.Tensor], torch.Tensor] = token_rms_max,
    generator: torch.Generator | None = None,
) -> EmpiricalLipschitz:
    r"""Lower-bound the Lipschitz constant of ``f`` by gradient ascent over input pairs.

    Each of ``restarts`` pairs $(x, y = x + \delta)$ starts from ``x0`` plus noise (restart 0
    from ``x0`` itself) with a random $\delta$ of relative size ``perturbation``; Adam
    maximizes $\log\|f(x) - f(y)\| - \log\|x - y\|$ in both $x$ and $\delta$, and after each
    step both points are projected back into the domain (token RMS $\le$ ``radius``; ``None``
    = unconstrained). The restarts run as one batch, so ``f`` must map ``[R, ...]`` to
    ``[R, ...]`` row by row. Every evaluated pair is admissible, so the best ratio is a true
    lower bound on the constant over the domain.

    Args:
        f: the map (e.g. the blocks and head of a model, from embedded sequences to logits).
        x0: ``[...]`` one input (no batch dimension), e.g. ``[T, d]``.
        in_norm: ``[R, ...] -> [R]`` norm of the inputs (default: max per-token RMS).
        out_norm: ``[R, ...] -> [R]`` norm of the outputs (default: max per-token RMS).
        generator: for the random starts (default: a fixed seed, for reproducibility).

    Returns:
        :class:`EmpiricalLipschitz`; computed in ``x0.dtype``.
    """
    if restarts < 1 or steps < 0:
        raise ValueError(f"empirical_lipschitz: need restarts >= 1 and steps >= 0, got {restarts}, {steps}")
    generator = generator or torch.Generator(device="cpu").manual_seed(0)
    base = x0.detach()
    scale = base.pow(2).mean().sqrt().clamp_min(torch.finfo(base.dtype).tiny).item()

    def noise(size):
        return torch.randn(size, generator=generator, dtype=base.dtype).to(base.device)

    shape = (restarts,) + tuple(base.shape)
    x = base.expand(shape).clone()
    x[1:] += 0.5 * scale * noise((restarts - 1,) + tuple(base.shape))
    x = _project_to_radius(x, radius).requires_grad_(True)
    delta = (perturbation * scale * noise(shape)).requires_grad_(True)
    optimizer = torch.optim.Adam([x, delta], lr=lr * scale)

    best = torch.full((restarts,), -math.inf, dtype=torch.float64)
    best_x, best_y = x.detach().clone(), x.detach().clone()
    for step in range(steps + 1):
        y = _project_to_radius(x + delta, radius)
        gap = in_norm(y - x)
        ratio = out_norm(f(y) - f(x)) / gap.clamp_min(torch.finfo(base.dtype).tiny)
        with torch.no_grad():
            improved = (ratio.double() > best) & (gap > 0)
            best = torch.where(improved, ratio.double(), best)
            best_x[improved] = x.detach()[improved]
            best_y[improved] = y.detach()[improved]
        if step == steps:
            break
        optimizer.zero_grad()
        (-ratio.clamp_min(torch.finfo(base.dtype).tiny).log().sum()).backward()
        optimizer.step()
        with torch.no_grad():
            x.copy_(_project_to_radius(x, radius))
    winner = int(best.argmax())
    return EmpiricalLipschitz(best[winner].item(), best_x[winner], best_y[winner], best.tolist())
