r"""Certified Lipschitz bounds of the Lipschitz transformer of Newhouse et al., *Training
Transformers with Enforced Lipschitz Constants* (2025), and an empirical estimator to hold
them against.

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
* attention with heads: :func:`attention_lipschitz`. With one head it is Newhouse et al.'s
  $\tfrac13\|W_o\|(\|W_v\| + 2\|W_v\|r^2\|W_q\|\|W_k\|)$; with $H$ heads the per-head
  slices enter, and a head slice of an orthonormal $W_q$ has RMS→RMS norm $\sqrt H$, so
  the multi-head constant is up to $\sqrt H\,(1 + 2Hr^2)/3$ where the one-head formula
  applied to full matrices would claim $(1 + 2r^2)/3$ (which the empirical estimator
  beats: see the tests).

Every constant above is the **simple** bound (``method="simple"``). ``method="tight"``
shares the query between heads in attention's score path (up to $\sqrt H$ smaller),
centres the MLP's Jacobian at $\text{GELU}' = 1/2$, and bounds the whole-sequence norm by
$\sqrt T$ times the per-token bound. ``method="aligned"`` is the tight bound
with the query path's value–key cross-covariance bounded by the alignment
$\nu_h = \max_u\|W_v^hu\|\|W_k^hu\|$ of each head's value and key slices instead of
$\sigma_{vh}\sigma_{kh}$; see :func:`attention_lipschitz`, :func:`residual_mlp_bound`,
:func:`transformer_lipschitz_bound`. Each is never above the next (``METHODS`` order).

The default ``method="joint"`` does not multiply: it follows the set of reachable token vectors
and of their perturbations through the network (:func:`transformer_lipschitz_bound`), so a
direction one layer amplifies counts in the next only as far as the next layer's weights
amplify *that* direction.

**Exact arithmetic.** Every bound is about the real-valued network on the domain
(:func:`certify_domain`); for the float32/bf16 network add the rounding term of
:func:`rounding_error_bound`.

Dtypes: norms are computed in float64 by SVD and the alignments $\nu_h$ by float64
``eigvalsh`` at an explicit $\tau$ (a certificate must not rely on a power-iteration lower
bound); :func:`transformer_lipschitz_bound` copies the weights to float64 on the CPU first, whatever
their dtype and device. The estimator runs in the input's dtype and device (use float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from geomuon.manifolds.linalg import as_count, as_positive, as_real, rms_scale

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
    "ResidualMLPBound",
    "residual_mlp_bound",
    "METHODS",
    "DEFAULT_METHOD",
    "TransformerBound",
    "transformer_lipschitz_bound",
    "EmpiricalLipschitz",
    "SEARCHES",
    "certify_domain",
    "empirical_lipschitz",
    "rounding_error_bound",
]

#: $\max_x |\text{GELU}'(x)| = \text{GELU}'(\sqrt 2) = \tfrac12(1 + \operatorname{erf} 1) +
#: 1/(e\sqrt\pi)$ for the exact (erf) GELU: $\text{GELU}'' = \varphi(x)(2 - x^2)$ vanishes at
#: $\pm\sqrt2$, and $\text{GELU}'(-\sqrt2) = 1 - \text{GELU}'(\sqrt2) > -1$.
GELU_LIPSCHITZ = 0.5 * (1.0 + math.erf(1.0)) + math.exp(-1.0) / math.sqrt(math.pi)

#: The divisor the Lipschitz model applies to GELU (the reference code's rounded constant).
REFERENCE_GELU_DIVISOR = 1.1289


#: The bounds of this module, tightest first: ``"joint"`` (the default), ``"aligned"``, ``"tight"``,
#: ``"simple"``. ``"joint"`` is a composition rule: a single sub-layer's constant under it is the aligned one.
METHODS = ("joint", "aligned", "tight", "simple")
#: The bound every function of this module computes unless told otherwise: the tightest.
DEFAULT_METHOD = METHODS[0]


def rms_operator_norm(W: torch.Tensor) -> float:
    r"""$\sqrt{\text{fan\_in}/\text{fan\_out}}\,\sigma_{\max}(W)$ of a ``[fan_out, fan_in]``
    matrix, exact (float64 SVD); NaN for a matrix with a NaN or infinite entry (the bounds that
    call it refuse such weights by name first)."""
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ValueError(
            f"rms_operator_norm: expected a [fan_out, fan_in] matrix, got "
            f"{tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__}"
        )
    if W.is_complex():  # the float64 cast had dropped the imaginary part: the norm of another matrix
        raise TypeError(f"rms_operator_norm: W must be real, got {W.dtype}")
    if not W.numel():  # (fan_out = 0 had divided by zero: a bare ZeroDivisionError)
        raise ValueError(f"rms_operator_norm: W is {W.size(0)}x{W.size(1)}, an empty matrix: the RMS of a "
                         "0-dimensional vector is undefined")
    if not bool(torch.isfinite(W).all()):
        # NaN, as a diverged run's metrics record it (a NaN entry had failed the SVD, "did not converge")
        return math.nan
    sigma = torch.linalg.matrix_norm(W.detach().double(), ord=2).item()
    return rms_scale(W.shape) * sigma


def token_rms_max(X: torch.Tensor) -> torch.Tensor:
    r"""$\max_t \|x_t\|_{\mathrm{RMS}}$ over every dimension but the batch one: ``[B, ..., k]``
    → ``[B]`` (RMS over the last dimension, max over the rest)."""
    mean_square = X.pow(2).mean(-1)
    # the max before the root: the same value (the root is monotone and correctly rounded), and
    # a finite gradient where a token does not move (the root's slope at 0 is infinite)
    return mean_square.reshape(mean_square.size(0), -1).amax(-1).sqrt()


def sequence_rms(X: torch.Tensor) -> torch.Tensor:
    r"""$\bigl(\sum_t \|x_t\|_{\mathrm{RMS}}^2\bigr)^{1/2}$ (the Frobenius norm over $\sqrt{\dim x}$):
    ``[B, ..., k]`` → ``[B]``. The norm of the ``sequence_length`` variant of
    :func:`transformer_lipschitz_bound`."""
    return X.pow(2).mean(-1).reshape(X.size(0), -1).sum(-1).sqrt()


def residual_lipschitz(a: float, inner: float) -> float:
    r"""Lipschitz constant of $x \mapsto (1-a)x + a f(x)$ for an $L_f$-Lipschitz $f$ and
    $a \in [0, 1]$: $\|(1-a)(x-y) + a(f(x)-f(y))\| \le ((1-a) + aL_f)\|x-y\|$."""
    a = _residual_weight("residual_lipschitz", "a", a)
    inner = as_real("residual_lipschitz", "inner", inner)
    if not inner >= 0:  # a negative or NaN inner constant had given a negative or NaN one (inf: no bound, kept)
        raise ValueError(f"residual_lipschitz: inner must be a Lipschitz constant (a number >= 0), got {inner}")
    return (1.0 - a) + (a * inner if a else 0.0)  # (a = 0 is the identity whatever f is: not 0 * inf)


def _residual_weight(where: str, name: str, a) -> float:
    """``a`` as a float in $[0, 1]$, refused by ``name`` otherwise (a bool, a string, ``None`` and NaN too:
    ``True`` had been 1, a string had failed in a comparison that named no option)."""
    a = as_real(where, name, a)
    if not 0.0 <= a <= 1.0:  # (NaN fails this too)
        raise ValueError(f"{where}: {name} (a residual weight) must lie in [0, 1], got {a}")
    return a


def mlp_lipschitz(
    w_in: torch.Tensor, w_out: torch.Tensor, gelu_scale: float = 1.0 / REFERENCE_GELU_DIVISOR
) -> float:
    r"""$x \mapsto W_\text{out}\,s\,\text{GELU}(W_\text{in}x)$ (per token):
    $\|W_\text{out}\|\cdot s\,$:data:`GELU_LIPSCHITZ`$\cdot\|W_\text{in}\|$ in RMS→RMS norms
    (the RMS norm of the hidden layer is the same on both sides, and GELU acts
    entrywise, so $\|s\,\text{GELU}(a) - s\,\text{GELU}(b)\|_{\mathrm{RMS}} \le
    s\,\text{GELU}_\text{Lip}\|a - b\|_{\mathrm{RMS}}$)."""
    _check_mlp("mlp_lipschitz", w_in, w_out, gelu_scale)
    return rms_operator_norm(w_out) * gelu_scale * GELU_LIPSCHITZ * rms_operator_norm(w_in)


def _check_mlp(where: str, w_in, w_out, gelu_scale: float, radius: float = 1.0) -> None:
    """Refuse an MLP whose ``w_out`` does not map back from ``w_in``'s hidden width, or a
    non-positive ``gelu_scale`` (a negative one had given a negative constant) or radius."""
    _require_matrix(where, "w_in", w_in)
    hidden, d = w_in.shape
    _require_matrix(where, "w_out", w_out, (d, hidden))
    as_positive(where, "gelu_scale", gelu_scale)
    as_positive(where, "radius", radius, zero=True)


@dataclass
class AttentionBound:
    """Constants of one attention sub-layer for inputs of token RMS $\\le$ ``radius``:
    ``lipschitz`` (the bound of ``method``; the aligned one for ``"joint"``), ``output_radius``, the
    per-head terms of the simple bound, and the value–key alignments $\\nu_h$ of the aligned
    bound (empty for the others)."""

    lipschitz: float
    output_radius: float
    head_terms: list[float] = field(default_factory=list)
    alignments: list[float] = field(default_factory=list)


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
    method: str = DEFAULT_METHOD,
) -> AttentionBound:
    r"""Lipschitz bound of multi-head causal attention (RoPE allowed) on inputs with token RMS
    $\le r$ (``radius``).

    Head $h$ has slices $W_q^h, W_k^h, W_v^h \in \mathbb R^{d_h\times d}$ (rows
    $hd_h..(h+1)d_h$), scores $s_{ts} = \varsigma\langle q_t, k_s\rangle$ ($\varsigma$ =
    ``score_scale``, $1/d_h$ in the Lipschitz model), $y^h_t = \sum_s p_{ts} v^h_s$, and the
    output is $c\,W_o[y^1; \dots; y^H]$ ($c$ = ``attention_scale``). Write
    $\sigma_{xh} = \sigma_{\max}(W_x^h)$, $\sigma_x = \sigma_{\max}(W_x)$ for the whole
    matrix, and $\|x\|_2 \le \sqrt d\,r$.

    *Proof.* $\delta y^h_t = \sum_s p_{ts}\,\delta v^h_s + \sum_s p_{ts}\,\delta s_{ts}(v^h_s - \bar v^h)$
    (value path, then score path: $\delta p_t = (\operatorname{diag}p_t - p_tp_t^\top)\delta s_t$,
    $\bar v^h = \sum_s p_{ts}v^h_s$). The value path is a convex combination of
    $W_v^h\delta x_s$, of norm $\le \sigma_{vh}\sqrt d\,\|\delta X\|$. Split
    $\delta s_{ts} = \varsigma\langle \delta q_t, k_s\rangle + \varsigma\langle q_t, \delta k_s\rangle$
    (RoPE rotates each token: norms unchanged).

    * *Query path:* $\varsigma\sum_s p_{ts}(v_s - \bar v)k_s^\top\delta q_t = \varsigma\,C^h\delta q^h_t$
      with the cross-covariance $C^h = \operatorname{Cov}_p(v^h, k^h)$,
      $\|C^h\| \le \sqrt{\lambda_{\max}\operatorname{Cov}_p v\;\lambda_{\max}\operatorname{Cov}_p k}
      \le \sigma_{vh}\sigma_{kh}\,d r^2$.
    * *Key path:* by Cauchy–Schwarz in $L^2(p)$,
      $\|\sum_s p_{ts}(v_s - \bar v)\langle q_t, \delta k_s\rangle\| \le
      \sqrt{\mathbb E_p\|v - \bar v\|^2}\,\max_s|\langle q_t,\delta k_s\rangle| \le
      \sigma_{vh}\sqrt d\, r\cdot\|q^h_t\|\,\sigma_{kh}\sqrt d\,\|\delta X\|$.

    **Simple bound** (``method="simple"``): bound each head alone,
    $\|\delta q^h_t\|, \|q^h_t\| \le \sigma_{qh}\sqrt d\,(\|\delta X\|, r)$, so
    $\|\delta y^h_t\|_2 \le \sqrt d\,\sigma_{vh}(1 + 2\varsigma d r^2\sigma_{qh}\sigma_{kh})\|\delta X\|$
    and, concatenating ($\|\delta Y_t\|_{\mathrm{RMS}} = \sqrt{\sum_h\|\delta y^h_t\|_2^2/d}$),

    $$L^\text{simple}_\text{att} = c\,\|W_o\|\sqrt{\textstyle\sum_h \sigma_{vh}^2\bigl(1 + 2\varsigma d\,r^2\sigma_{qh}\sigma_{kh}\bigr)^2}.$$

    Here and below $\|W_o\| = \sigma_{\max}(W_o)$: it maps the concatenation's $\ell_2$ norm to
    the output's, and both are divided by $\sqrt d$. It is $W_o$'s RMS→RMS norm when
    $Hd_h = d$ (the GPT's case); narrower heads make the RMS→RMS norm
    $\sqrt{Hd_h/d}\,\sigma_{\max}(W_o)$ the smaller one, which would understate the bound.

    **Tight bound** (``method="tight"``): the heads share one query. Stacked over heads, the query
    path is $\varsigma\operatorname{blockdiag}_h(C^h)\,W_q\delta x_t$, of norm
    $\le \varsigma\,\mu\, d r^2\,\sigma_q\sqrt d\,\|\delta X\|$ with
    $\mu = \max_h\sigma_{vh}\sigma_{kh}$; the key path is, head by head,
    $\le \varsigma\sigma_{vh}\sigma_{kh}\,d\,r\,\|\delta X\|\,\|q^h_t\|$, and
    $\sqrt{\sum_h\|q^h_t\|^2} = \|W_q x_t\| \le \sigma_q\sqrt d\,r$. The value paths stack to
    $\le\sqrt{\sum_h\sigma_{vh}^2}\sqrt d\,\|\delta X\|$ (each head's is a point of
    $W_v^h$ of the ball). Each path also keeps its head-by-head bound, so with
    $\kappa = \min\bigl(\mu\,\sigma_q,\ \sqrt{\sum_h(\sigma_{vh}\sigma_{kh}\sigma_{qh})^2}\bigr)$

    $$L_\text{att} = \min\Bigl(c\,\|W_o\|\Bigl(\sqrt{\textstyle\sum_h\sigma_{vh}^2} + 2\varsigma d\,r^2\kappa\Bigr),\
    L^\text{simple}_\text{att}\Bigr),$$

    which gains up to $\sqrt H$ when the slices have similar norms (a head slice of a
    near-isometric $W_q$ has $\sigma_{qh} \approx \sigma_q$). Both are bounds; the first alone
    can exceed the simple one by Minkowski's inequality, when one head carries the values and
    another the scores, hence the minimum.

    **Aligned bound** (``method="aligned"``, and ``"joint"`` for one sub-layer): the query
    path's cross-covariance is bounded by the *alignment* of the value and key slices rather
    than the product of their
    norms. With $A_h = W_v^{h\top}W_v^h$, $B_h = W_k^{h\top}W_k^h$ and
    $M = \mathbb E_p[x_sx_s^\top]$ ($\operatorname{tr}M \le d r^2$,
    $\operatorname{Cov}_p x \preceq M$), for unit $a, b$ and any $\tau > 0$, writing
    $\alpha = W_v^{h\top}a$ (the centring moves onto the first factor since
    $\sum_s p_{ts}(x_s - \bar x) = 0$; RoPE rotates $k_s$, so $|\langle b, k_s\rangle| \le
    \|W_k^hx_s\|$; and $2|\alpha\beta| \le \tau\alpha^2 + \beta^2/\tau$):

    $$|a^\top C^h b| \le \sum_s p_{ts}|\langle\alpha, x_s - \bar x\rangle|\,\|W_k^hx_s\|
    \le \tfrac12\operatorname{tr}\bigl(M(\tau\,W_v^{h\top}aa^\top W_v^h + B_h/\tau)\bigr)
    \le \tfrac12\operatorname{tr}\bigl(M(\tau A_h + B_h/\tau)\bigr) = \tfrac12\,\mathbb E_p\|N_\tau x_s\|^2
    \le \tfrac12\,d r^2\,\lambda_{\max}(\tau A_h + B_h/\tau),$$

    with $N_\tau = [\sqrt\tau\,W_v^h;\ W_k^h/\sqrt\tau]$ ($aa^\top \preceq I$; the joint bound of
    :func:`transformer_lipschitz_bound` stops before the last step and takes the sup over its token set),

    so $\|C^h\| \le \nu_h\,d r^2$ with
    $\nu_h = \min_{\tau>0}\tfrac12\lambda_{\max}(\tau A_h + B_h/\tau) \le \sigma_{vh}\sigma_{kh}$
    ($\tau = \sigma_{kh}/\sigma_{vh}$). Every $\tau$ gives a valid bound (the minimum is
    found by golden-section search in $\log\tau$, on which $\lambda_{\max}$ is unimodal: it is
    convex in $\tau$); by Brickman's theorem (the joint numerical range of two quadratic forms
    is convex for $d \ge 3$) and minimax, $\nu_h = \max_{\|u\|=1}\|W_v^hu\|\,\|W_k^hu\|$,
    the constant of an antipodal pair $\pm\sqrt d\,r\,u$ without RoPE, so the step is exact
    for one head's query path. The key path keeps its bound, and

    $$L^\text{aligned}_\text{att} = c\,\|W_o\|\Bigl(\sqrt{\textstyle\sum_h\sigma_{vh}^2} +
    \varsigma d\,r^2(\kappa_q + \kappa)\Bigr),\quad
    \kappa_q = \min\bigl(\max_h\nu_h\,\sigma_q,\ \sqrt{\textstyle\sum_h(\nu_h\sigma_{qh})^2}\bigr) \le \kappa,$$

    never above the tight bound. On the trained catalogue $\nu_h/(\sigma_{vh}\sigma_{kh}) =
    0.79$–$0.98$ (Muon with the cap leaves the slices' row spaces partly aligned), so the gain is
    at most 11 % of the score path.

    With one head ($\varsigma d = 1$, $\sigma_{xh} = \|W_x\|$) both are the one-head formula
    of Newhouse et al., *Training Transformers with Enforced Lipschitz Constants* (2025),
    $c\|W_o\|(\|W_v\| + 2\|W_v\|r^2\|W_q\|\|W_k\|)$. Every $y^h_t$ is a convex
    combination of values, so the output radius is $c\|W_o\|\sqrt{\sum_h\sigma_{vh}^2}\;r$.

    Args:
        q: ``[n_head·d_head, d]``.
        k: ``[n_head·d_head, d]``.
        v: ``[n_head·d_head, d]``.
        o: ``[d, n_head·d_head]``.
        method: ``"aligned"``, ``"tight"`` or ``"simple"``; ``"joint"`` (the default) is ``"aligned"`` for one
            sub-layer (:data:`METHODS`).

    Returns:
        :class:`AttentionBound` (``head_terms`` = the per-head square-root terms of the
        simple bound).
    """
    # a whole number of any real type (2.0 had failed inside reshape, True had been one head)
    n_head = as_count("attention_lipschitz", "n_head", n_head, 1)
    method = _sublayer_method(method, "attention_lipschitz")
    _require_matrix("attention_lipschitz", "q", q)
    for name, W, shape in (("k", k, q.shape), ("v", v, q.shape), ("o", o, (q.size(1), q.size(0)))):
        _require_matrix("attention_lipschitz", name, W, tuple(shape))
    as_positive("attention_lipschitz", "score_scale", score_scale)
    as_positive("attention_lipschitz", "attention_scale", attention_scale)
    as_positive("attention_lipschitz", "radius", radius, zero=True)
    d = q.size(1)
    sigma = {
        name: torch.linalg.matrix_norm(_head_slices(W, n_head, name), ord=2)
        for name, W in (("q", q), ("k", k), ("v", v))
    }
    score = 2.0 * score_scale * d * radius * radius  # (a float product overflows to inf; ** raised OverflowError)
    head_terms = sigma["v"] * (1.0 + score * sigma["q"] * sigma["k"])
    # the heads' outputs are bounded in l2 per token (sqrt(d) r units), so W_o enters by its l2
    # norm; its RMS->RMS norm sqrt(H d_head / d) sigma(W_o) is the same only for H d_head = d, and
    # with narrower heads had made the bound unsound (1/3 of a one-token map certified 0.236)
    outer = attention_scale * _sigma(o)
    values = sigma["v"].pow(2).sum().sqrt().item()
    alignments = []
    lipschitz = outer * head_terms.pow(2).sum().sqrt().item()
    if method != "simple":
        key_path = _score_path_factor(sigma["v"] * sigma["k"], sigma["q"], q)
        query_path = key_path
        if method == "aligned":
            nu = _value_key_alignment(_head_slices(v, n_head, "v"), _head_slices(k, n_head, "k"), sigma["v"], sigma["k"])
            query_path, alignments = _score_path_factor(nu, sigma["q"], q), nu.tolist()
        # both are bounds, and the shared-query form can be the larger one (Minkowski: one head
        # carrying the values, another the scores had put "tight" above "simple")
        lipschitz = min(lipschitz, outer * (values + score / 2 * (query_path + key_path)))
    return AttentionBound(lipschitz, outer * values * radius, head_terms.tolist(), alignments)


def _score_path_factor(coupling: torch.Tensor, sigma_q: torch.Tensor, q: torch.Tensor) -> float:
    r"""$\min\bigl(\max_h\gamma_h\,\sigma_{\max}(W_q),\ \sqrt{\sum_h(\gamma_h\sigma_{qh})^2}\bigr)$ for the
    per-head couplings $\gamma_h$ (the heads share the query, or each keeps its own)."""
    shared_query = coupling.max().item() * _sigma(q)
    per_head = (coupling * sigma_q).pow(2).sum().sqrt().item()
    return min(shared_query, per_head)


#: Golden-section steps of :func:`_value_key_alignment` (the bracket shrinks by 0.618 per step).
_ALIGNMENT_STEPS = 60
#: Largest $|\log\tau|$ at which the search is centred: keeps $\tau$ and $1/\tau$ finite when a slice is 0.
_LOG_TAU_RANGE = 20.0


def _value_key_alignment(v_heads: torch.Tensor, k_heads: torch.Tensor, sigma_v: torch.Tensor,
                         sigma_k: torch.Tensor) -> torch.Tensor:
    r"""$\nu_h = \min_{\tau>0}\tfrac12\lambda_{\max}(\tau W_v^{h\top}W_v^h + W_k^{h\top}W_k^h/\tau)$ per head
    (float64), from the slices ``[H, d_h, d]`` and their spectral norms $\sigma_{vh}$, $\sigma_{kh}$ ``[H]``
    (the search's centre), capped at $\sigma_{vh}\sigma_{kh}$ (its value at $\tau = \sigma_{kh}/\sigma_{vh}$);
    see :func:`attention_lipschitz`. Any $\tau$ bounds $\nu_h$ from above, so the search's
    accuracy affects tightness, never soundness.

    The $d\times d$ matrix is $N_\tau^\top N_\tau$ with $N_\tau = [\sqrt\tau\,W_v^h;\ W_k^h/\sqrt\tau]$
    ($2d_h\times d$), and $N_\tau^\top N_\tau$ and $N_\tau N_\tau^\top =
    \bigl[\begin{smallmatrix}\tau W_vW_v^\top & W_vW_k^\top\\ W_kW_v^\top & W_kW_k^\top/\tau\end{smallmatrix}\bigr]$
    have the same nonzero eigenvalues: each step takes the smaller of the two ($2d_h \times 2d_h$
    once $2d_h < d$, which is every model with more than two heads)."""
    d_head, d = v_heads.shape[-2:]
    if 2 * d_head < d:
        first, second = v_heads @ v_heads.transpose(-1, -2), k_heads @ k_heads.transpose(-1, -2)
        cross = v_heads @ k_heads.transpose(-1, -2)

        def gram(tau):  # N N^T
            return torch.cat([torch.cat([tau * first, cross], -1), torch.cat([cross.transpose(-1, -2), second / tau], -1)], -2)
    else:
        first, second = v_heads.transpose(-1, -2) @ v_heads, k_heads.transpose(-1, -2) @ k_heads

        def gram(tau):  # N^T N
            return tau * first + second / tau
    def half_lambda_max(log_tau):
        return 0.5 * torch.linalg.eigvalsh(gram(log_tau.exp().reshape(-1, 1, 1)))[..., -1]

    return torch.minimum(_least_over_log_tau(half_lambda_max, sigma_v, sigma_k, _ALIGNMENT_STEPS), sigma_v * sigma_k)


def _least_over_log_tau(f, reach_v: torch.Tensor, reach_k: torch.Tensor, steps: int) -> torch.Tensor:
    r"""The least value of ``f`` (``[H]`` values of $\log\tau$ to ``[H]`` values) met by a golden-section
    search for its minimum over $\log\tau$, per entry, in the bracket $\log(R_k/R_v) \pm 4$ (``reach_v``,
    ``reach_k``: $R_v$, $R_k$ ``[H]``, float64; the centre clamped to $\pm$:data:`_LOG_TAU_RANGE`,
    so a zero slice keeps $\tau$ finite). Each step evaluates ``f`` once. The alignments it serves
    are bounds at every $\tau$, so the least value met is one, and the search's accuracy affects
    tightness only."""
    tiny = torch.finfo(reach_v.dtype).tiny
    centre = (reach_k.clamp_min(tiny).log() - reach_v.clamp_min(tiny).log()).clamp(-_LOG_TAU_RANGE, _LOG_TAU_RANGE)
    golden = (math.sqrt(5) - 1) / 2
    low, high = centre - 4.0, centre + 4.0
    left, right = high - golden * (high - low), low + golden * (high - low)
    at_left, at_right = f(left), f(right)
    least = torch.minimum(at_left, at_right)
    for _ in range(steps):
        go_right = at_left > at_right  # the minimum is right of `left`: the bracket becomes [left, high]
        low, high = torch.where(go_right, left, low), torch.where(go_right, high, right)
        left, right = torch.where(go_right, right, high - golden * (high - low)), torch.where(go_right, low + golden * (high - low), left)
        fresh = f(torch.where(go_right, right, left))
        at_left, at_right = torch.where(go_right, at_right, fresh), torch.where(go_right, fresh, at_left)
        least = torch.minimum(least, fresh)
    return least


def _check_method(method: str, where: str) -> None:
    if method not in METHODS:
        raise ValueError(f"{where}: method must be one of {METHODS}, got {method!r}")


def _sublayer_method(method: str, where: str) -> str:
    """The method one sub-layer's constant uses: ``"joint"`` composes, and bounds each sub-layer as ``"aligned"``."""
    _check_method(method, where)
    return "aligned" if method == "joint" else method


def _sigma(W: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(W.detach().double(), ord=2).item()


@dataclass
class ResidualMLPBound:
    r"""Constants of the residual MLP sub-layer $x \mapsto (1-a)x + a\,W_\text{out}\,s\,\text{GELU}(W_\text{in}x)$:
    ``lipschitz`` (the whole residual map) and ``output_radius`` (for inputs of token
    RMS $\le$ ``radius``)."""

    lipschitz: float
    output_radius: float


def residual_mlp_bound(
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    *,
    residual_weight: float,
    gelu_scale: float = 1.0 / REFERENCE_GELU_DIVISOR,
    radius: float = 1.0,
    method: str = DEFAULT_METHOD,
) -> ResidualMLPBound:
    r"""Lipschitz constant and output radius of the residual MLP sub-layer, per token.

    Write $a$ = ``residual_weight``, $s$ = ``gelu_scale``, $z = W_\text{in}x$,
    $P = W_\text{out}W_\text{in}$ ($d\times d$: its RMS→RMS norm is $\sigma_{\max}$) and
    $g_\pm$ the extremes of $\text{GELU}'$: $g_+$ = :data:`GELU_LIPSCHITZ` and $g_- = 1 - g_+$
    ($\text{GELU}'(-x) = 1 - \text{GELU}'(x)$).

    **Simple** (``method="simple"``): $(1-a) + a\,s\,g_+\|W_\text{out}\|\|W_\text{in}\|$ and
    radius $(1-a)r + a\,s\|W_\text{out}\|\|W_\text{in}\|r$ ($|\text{GELU}(z)| \le |z|$).

    **Tight** (``method="tight"``, ``"aligned"`` and ``"joint"``, which share it). *Lipschitz:*
    the Jacobian is $(1-a)I + a s W_\text{out}DW_\text{in}$
    with $D = \operatorname{diag}\text{GELU}'(z)$, $g_- \le D \le g_+$. With the midpoint
    $m = (g_+ + g_-)/2 = 1/2$ and $\rho = (g_+ - g_-)/2 = g_+ - 1/2$, $\|D - mI\| \le \rho$, so

    $$L = \sigma_{\max}\bigl((1-a)I + a s m P\bigr) + a s\rho\,\|W_\text{out}\|\|W_\text{in}\|.$$

    *Radius:* $\text{GELU}(z) = z\,\Phi(z)$ with $\Phi \in [0, 1]$, so the output is
    $((1-a)I + \tfrac{as}2P)x + a s W_\text{out}((\Phi - \tfrac12)\odot z)$ with
    $|\Phi - \tfrac12| \le \tfrac12$:

    $$r' = \Bigl(\sigma_{\max}\bigl((1-a)I + \tfrac{as}{2}P\bigr) + \tfrac{as}{2}\|W_\text{out}\|\|W_\text{in}\|\Bigr)r.$$

    Both are at most the simple constants (triangle inequality on the first term), and
    gain when $P$ is not aligned with the identity.
    """
    method = _sublayer_method(method, "residual_mlp_bound")
    _check_mlp("residual_mlp_bound", w_in, w_out, gelu_scale, radius)
    a = _residual_weight("residual_mlp_bound", "residual_weight", residual_weight)
    gain = rms_operator_norm(w_out) * rms_operator_norm(w_in) * gelu_scale
    simple = ResidualMLPBound(residual_lipschitz(a, gain * GELU_LIPSCHITZ), ((1 - a) + a * gain) * radius)
    if method == "simple":
        return simple
    P = w_out.detach().double() @ w_in.detach().double()
    # the same centred linear part serves both: GELU' and GELU(z)/z both have midpoint 1/2
    centred = _sigma((1 - a) * torch.eye(P.size(0), dtype=P.dtype, device=P.device) + a * gelu_scale * 0.5 * P)
    # at most the simple constants in exact arithmetic; the minimum keeps them so after rounding
    # (an aligned P had put "tight" one ulp above "simple")
    return ResidualMLPBound(min(centred + a * (GELU_LIPSCHITZ - 0.5) * gain, simple.lipschitz),
                            min((centred + a * 0.5 * gain) * radius, simple.output_radius))


@dataclass
class TransformerBound:
    r"""Result of :func:`transformer_lipschitz_bound`.

    ``bound``: Lipschitz constant from the embedded sequence to the logits, in the max
    per-token RMS norm on both sides (multiply by $\sqrt{V/d}$ for per-token $\ell_2$ norms),
    or in :func:`sequence_rms` when a ``sequence_length`` was given.
    ``sublayers``: the constants $L_f$ of each attention and MLP map, in order;
    ``residuals``: the constant of each residual sub-layer ($(1-a) + aL_f$ for attention);
    ``radii``: the token-RMS bound of the activations entering each sub-layer and, last,
    entering the head; ``head``: $\|W_\text{head}\|$; ``method``: one of :data:`METHODS`.
    With a ``sequence_length`` $T$, ``sublayers`` and ``residuals`` are those of the rule that gave
    ``bound`` (see :func:`transformer_lipschitz_bound`): the attention constants times $\sqrt T$ (rule (i)),
    or the per-token ones when $\sqrt T$ times the per-token bound (rule (ii)) is the smaller.
    """

    bound: float
    sublayers: list[float]
    residuals: list[float]
    radii: list[float]
    head: float
    method: str = DEFAULT_METHOD


def transformer_lipschitz_bound(
    weights: Mapping, *, sequence_length: int | None = None, method: str = DEFAULT_METHOD
) -> TransformerBound:
    r"""Certified Lipschitz bound of the Lipschitz transformer from its weights.

    ``weights`` (what ``geomuon.pretrain.model.GPT.lipschitz_weights()`` returns):

    * ``"blocks"``: a list, one dict per block with ``"q", "k", "v"`` (``[H d_head, d]``: ``[d, d]`` in the
      GPT), ``"o"`` (``[d, H d_head]``), ``"mlp_in"`` (``[hidden, d]``), ``"mlp_out"`` (``[d, hidden]``), all
      in ``nn.Linear`` ``[out, in]`` layout;
    * ``"head"``: ``[vocab, d]``;
    * ``"n_head"``: heads per block. If absent, inferred from the Lipschitz model's
      convention ``score_scale`` $= 1/d_\text{head}$ as (rows of ``q``)$\cdot$``score_scale``;
      ``"n_embd"`` (optional): the width $d$, checked against the weights;
    * ``"residual_weight"`` $a$ (default $1/(2N)$), ``"attention_scale"`` (default 1/3),
      ``"score_scale"`` (default $1/d_\text{head}$), ``"gelu_scale"`` (default 1/1.1289),
      ``"input_radius"`` $r_0$ (default 1).

    Forward of each block: $x \leftarrow (1-a)x + a\,\text{attn}(x)$, then
    $x \leftarrow (1-a)x + a\,\text{mlp}(x)$; the logits are $W_\text{head}x$. Composition
    multiplies the residual sub-layers' constants:

    $$L = \|W_\text{head}\|\prod_{\text{sub-layers } i} L^\text{res}_i,$$

    with $L^\text{res} = (1-a) + aL_\text{att}$ (:func:`attention_lipschitz`) and the MLP's
    residual constant from :func:`residual_mlp_bound`. The radius of the activations
    entering each sub-layer is propagated with the sub-layers' output radii and feeds each
    attention's bound. ``method="aligned"`` uses the aligned attention bound and the tight
    MLP bound, ``method="tight"`` the tight ones, ``method="simple"`` the per-head,
    triangle-inequality ones (all kept to compare).

    **Joint bound** (``method="joint"``, the default): the smaller of the aligned product
    and a bound that follows *sets* of token vectors through the whole network instead of
    multiplying worst cases. A token set is $K = \sum_iA_i\mathbb B$ (a Minkowski sum of linear
    images of the unit $\ell_2$ ball; convex and symmetric). Two sets are propagated in
    $\ell_2$ units: $X_\ell$ holds every activation token $x_t$ entering sub-layer $\ell$
    ($X_0 = \sqrt d\,r_0\mathbb B$), and $G_\ell$ holds every token $\delta x_t$ of
    $J_\ell\cdots J_1\,\delta X$, the Jacobian product at any point of the domain applied to a
    perturbation of max token RMS $\le 1$ ($G_0 = \sqrt d\,\mathbb B$). The rules, for every
    token $t$ at once:

    * *Attention values.* $\sum_sp_{ts}W_v^hz_s \in W_v^hK$ whenever every $z_s \in K$ (a
      convex combination of points of a convex set), whatever the attention weights; heads
      and the residual add, so $(1-a)z_t + a\,c\sum_hW_o^h\sum_sp^h_{ts}W_v^hz_s \in
      (1-a)K + a\sum_h cW_o^hW_v^hK$: the generators become $(1-a)A_i$ and $a\,cW_o^hW_v^hA_i$.
      This is what a product of norms cannot see: $\|W_v^{h'}W_o^hW_v^h\|$ along a path, not
      $\|W_v^{h'}\|\|W_o^h\|\|W_v^h\|$.
    * *Attention scores* (perturbations only). With $R_{xh} = \sup_{X}\|W_x^hx\|$ (capped by
      $\sigma_{xh}$ times the aligned radius) and $D_{xh} = \sup_{G}\|W_x^h\delta\|$, the
      proof of :func:`attention_lipschitz` gives $\|\operatorname{Cov}_p(v^h, k^h)\| \le
      \tfrac12\mathbb E_p\|N_\tau x_s\|^2$ for every $\tau > 0$, $N_\tau = [\sqrt\tau\,W_v^h;\ W_k^h/\sqrt\tau]$,
      with every $x_s \in X$, so $\|\operatorname{Cov}_p(v^h, k^h)\| \le
      \gamma_h = \min(R_{vh}R_{kh},\ \nu_h\sup_X\|x\|^2,\ \min_\tau\tfrac12\sup_X\|N_\tau x\|^2)$ (the last
      is the alignment measured on the set, :func:`_set_alignment`; the first two are its values
      for the ball around $X$ and at $\tau = R_{kh}/R_{vh}$), and head $h$'s score path is
      $\varsigma(\gamma_h\|W_q^h\delta x_t\| + R_{vh}D_{kh}\|W_q^hx_t\|)$ and, stacked over heads,
      at most $\varsigma(\sup_G\|\Gamma W_q\delta\| + \sup_X\|\mathrm K W_q x\|)$ with
      $\Gamma = \operatorname{blockdiag}(\gamma_hI)$, $\mathrm K = \operatorname{blockdiag}(R_{vh}D_{kh}I)$
      (or the shared-query and per-head forms, whichever is smaller). This ball, mapped by
      $a\,cW_o$, is one more generator of $G$.
    * *MLP.* The Jacobian is $M + as\,W_\text{out}(D - \tfrac12)W_\text{in}$ with
      $M = (1-a)I + \tfrac{as}2W_\text{out}W_\text{in}$ and $\|D - \tfrac12\| \le \rho$, so
      $G \mapsto MG + as\rho\,(\sup_G\|W_\text{in}\delta\|)\,W_\text{out}\mathbb B$; and
      $\text{GELU}(z) = \tfrac z2 + (\Phi(z) - \tfrac12)z$ with $|\Phi - \tfrac12| \le \tfrac12$ gives
      $X \mapsto MX + \tfrac{as}2(\sup_X\|W_\text{in}x\|)\,W_\text{out}\mathbb B$.

    Every $\sup$ over a set is bounded from above by the semidefinite relaxation of
    :func:`_relaxed_sup`. The domain is convex, so
    $f(y) - f(x) = \int_0^1J(x + \tau(y-x))(y-x)\,d\tau$ has every token in the convex set
    $\|y - x\|\,W_\text{head}G_\text{last}$, and

    $$L_\text{joint} = \sup_{g\in G_\text{last}}\|W_\text{head}g\|_2/\sqrt V.$$

    Attention multiplies the number of generators by $1 + H$; a set that would pass
    $\min(256, 2^{24}/d^2)$ of them (:func:`_generator_cap`) is merged into one ellipsoid containing
    its sum first (:func:`_merged`), and so is a set that the score or MLP ball takes past it. ``radii`` are then the smaller of the
    aligned and the joint radii ($\sup_X\|x\|$); ``sublayers`` and ``residuals`` stay the aligned
    ones. The sets are of token vectors, so the whole-sequence norm uses the per-token joint
    bound times $\sqrt T$ (rule (ii) below).

    **Exact arithmetic.** The certificate is a statement about the real-valued network.
    A float32 or bf16 evaluation adds rounding error that is not proportional to
    $\|x - y\|$ (one rounding of one input can produce a ratio far above $L$); bound the
    implemented network with :func:`rounding_error_bound`:
    $\|\hat f(x) - \hat f(y)\| \le L\|x - y\| + 2E$.

    ``sequence_length`` $T$ switches to the whole-sequence norm :func:`sequence_rms`
    ($\ell_2$ over tokens of per-token RMS) on input and output, for sequences up to $T$
    tokens. Two bounds hold and the smaller is returned (``method="simple"``: (i) alone): (i) per-token
    maps keep their constants and each attention constant is multiplied by $\sqrt T$ (every output token
    moves by at most $L_\text{att}\max_s\|\delta x_s\| \le L_\text{att}\|\delta X\|$ and there
    are $T$ of them); (ii) $\|\delta Y\|_\text{seq} \le \sqrt T\,\|\delta Y\|_{\max} \le
    \sqrt T\,L\,\|\delta X\|_{\max} \le \sqrt T\,L\,\|\delta X\|_\text{seq}$ with the per-token
    bound $L$.

    Returns:
        :class:`TransformerBound`; norms and spaces as in the module docstring.
    """
    _check_weights("transformer_lipschitz_bound", weights)
    _check_method(method, "transformer_lipschitz_bound")
    weights = _float64_on_cpu(weights)  # (blocks may be a generator: read once, here)
    _refuse_unmodelled(weights)
    blocks = weights["blocks"]
    if not blocks:
        raise ValueError("transformer_lipschitz_bound: weights['blocks'] is empty")
    if sequence_length is not None:
        spread = math.sqrt(as_count("transformer_lipschitz_bound", "sequence_length", sequence_length, 1))
        through_sequence = _propagate(weights, blocks, spread, method)
        per_token = _propagate(weights, blocks, 1.0, method)
        if method != "simple" and spread * per_token.bound < through_sequence.bound:
            per_token.bound *= spread
            return per_token
        return through_sequence
    return _propagate(weights, blocks, 1.0, method)


#: The keys :func:`transformer_lipschitz_bound` models: the weights' and the architecture's.
_MODEL_KEYS = {"blocks", "head", "n_embd", "n_head", "residual_weight", "attention_scale", "score_scale",
               "gelu_scale", "input_radius"}
_BLOCK_KEYS = {"q", "k", "v", "o", "mlp_in", "mlp_out"}


def _check_weights(where: str, weights) -> None:
    """Refuse ``weights`` unless it is a dict with ``"blocks"``, an iterable of per-block dicts (not one
    dict, a tensor or a string), and ``"head"``, naming what is missing (a list or ``None`` had failed with
    "not a mapping", a missing key with a bare ``KeyError``, ``blocks=3`` with "not iterable")."""
    if not isinstance(weights, Mapping) or "blocks" not in weights or "head" not in weights:
        raise ValueError(
            f"{where}: weights must be a dict with 'blocks' (list of "
            "{'q','k','v','o','mlp_in','mlp_out'}) and 'head' (GPT.lipschitz_weights() returns one)"
        )
    blocks = weights["blocks"]
    if isinstance(blocks, (Mapping, torch.Tensor, str)) or not isinstance(blocks, Iterable):
        raise ValueError(f"{where}: weights['blocks'] must be a list of per-block dicts "
                         f"{sorted(_BLOCK_KEYS)}, got a {type(blocks).__name__}")


def _refuse_unmodelled(weights: Mapping) -> None:
    """Refuse a weights dict with entries the bound does not model (a position table, biases,
    LayerNorm gains, ...: a hand-built dict of such a model would otherwise get a bound that
    ignores them), naming them."""
    extra = sorted(set(weights) - _MODEL_KEYS)
    for index, block in enumerate(weights["blocks"]):
        if isinstance(block, Mapping):
            extra += [f"blocks[{index}][{key!r}]" for key in sorted(set(block) - _BLOCK_KEYS)]
    if extra:
        raise ValueError(
            f"transformer_lipschitz_bound: {', '.join(map(str, extra))} not modelled by the bound (it covers "
            f"the Lipschitz model's {sorted(_BLOCK_KEYS)} per block, 'head' and the scalars "
            f"{sorted(_MODEL_KEYS - {'blocks', 'head'})}); a learned position table, biases or LayerNorm are "
            "outside it: train with the Lipschitz configuration (GPT.lipschitz_weights())"
        )


def _float64_on_cpu(weights: Mapping) -> dict:
    """``weights`` (``"blocks"`` any iterable) with every tensor detached and in float64 on the CPU (a copy
    unless it is one already; nothing here writes to it), refusing weight matrices (``"head"``, the
    blocks' entries) that are not real floating point (``TypeError`` naming the key): the certificate's
    arithmetic (SVDs, eigendecompositions, the token sets) is float64 whatever the training dtype
    and device, so a model training on a GPU is certified by the same computation as on the CPU."""

    def converted(value, name=None):
        if not isinstance(value, torch.Tensor):
            return value
        # a weight matrix (``name`` given) must be real floating: the cast had dropped a complex
        # weight's imaginary part (certifying another network) and taken bool and int weights
        if name is not None and not value.is_floating_point():
            raise TypeError(f"transformer_lipschitz_bound: {name} must be a real floating-point tensor, got "
                            f"{value.dtype}; the bound is for the real-valued network")
        return value.detach().to("cpu", torch.float64)

    result = {key: converted(value, key if key == "head" else None) for key, value in weights.items()}
    result["blocks"] = [
        {name: converted(value, f"blocks[{index}][{name!r}]") for name, value in block.items()}
        if isinstance(block, Mapping) else block
        for index, block in enumerate(weights["blocks"])
    ]
    return result


@dataclass(frozen=True)
class _Architecture:
    """The scalars of the Lipschitz model that every composition reads (see
    :func:`transformer_lipschitz_bound` for the keys and their defaults)."""

    d: int
    n_head: int
    residual_weight: float
    score_scale: float
    attention_scale: float
    gelu_scale: float
    input_radius: float

    @classmethod
    def of(cls, weights: Mapping, blocks: list) -> "_Architecture":
        """The scalars of ``weights`` (defaults where absent), after checking every matrix's
        shape and finiteness and every scalar's range, naming the key: a negative scale had
        lowered the bound below a ratio the model reaches, a NaN one made it NaN (which every
        ``bound > limit`` gate passes)."""
        where = "transformer_lipschitz_bound"
        for index, block in enumerate(blocks):
            if not isinstance(block, Mapping):
                raise ValueError(f"{where}: weights['blocks'][{index}] must be a dict of {sorted(_BLOCK_KEYS)}, "
                                 f"got {type(block).__name__}")
            missing = _BLOCK_KEYS - set(block)
            if missing:
                raise ValueError(f"{where}: block {index} lacks {sorted(missing)}")
        _require_matrix(where, "blocks[0]['q']", blocks[0]["q"])
        heads_width, d = blocks[0]["q"].shape
        if "n_embd" in weights and as_count(where, "n_embd", weights["n_embd"]) != d:
            raise ValueError(f"{where}: n_embd = {weights['n_embd']} but the blocks' matrices are {d} wide")
        attention = {"q": (heads_width, d), "k": (heads_width, d), "v": (heads_width, d), "o": (d, heads_width)}
        for index, block in enumerate(blocks):
            for key, shape in attention.items():
                _require_matrix(where, f"blocks[{index}][{key!r}]", block[key], shape)
            _require_matrix(where, f"blocks[{index}]['mlp_in']", block["mlp_in"], (None, d))
            _require_matrix(where, f"blocks[{index}]['mlp_out']", block["mlp_out"], (d, block["mlp_in"].size(0)))
        _require_matrix(where, "head", weights["head"], (None, d))
        n_head = _n_head(weights, heads_width)
        if heads_width % n_head:
            raise ValueError(f"{where}: the blocks' q, k and v have {heads_width} rows, not divisible by "
                             f"n_head = {n_head}")
        scalars = {"score_scale": n_head / heads_width, "attention_scale": 1.0 / 3.0,
                   "gelu_scale": 1.0 / REFERENCE_GELU_DIVISOR, "input_radius": 1.0}
        values = {key: as_positive(where, key, weights.get(key, default)) for key, default in scalars.items()}
        residual_weight = _residual_weight(where, "residual_weight",
                                           weights.get("residual_weight", 1.0 / (2 * len(blocks))))
        return cls(d=d, n_head=n_head, residual_weight=residual_weight, **values)


def _require_matrix(where: str, name: str, W, shape: tuple[int | None, int | None] = (None, None)) -> None:
    """Refuse a weight that is not a finite, real floating-point, non-empty 2-D tensor of ``shape`` (``None``:
    any size), naming it: the float64 cast had dropped a complex weight's imaginary part (``mlp_lipschitz`` of
    an imaginary ``w_in`` was 0), and the whole-model bound refuses int and bool weights likewise."""
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        got = f"a {W.dim()}-D tensor" if isinstance(W, torch.Tensor) else type(W).__name__
        raise ValueError(f"{where}: {name} must be a 2-D tensor, got {got}")
    if not W.numel():  # (its RMS->RMS norm divides by fan_out: a bare ZeroDivisionError)
        raise ValueError(f"{where}: {name} is {W.size(0)}x{W.size(1)}, an empty matrix; every width must be >= 1 "
                         "(a sub-layer that contributes nothing is one with zero weights of its full shape)")
    if not W.is_floating_point():
        raise TypeError(f"{where}: {name} must be a real floating-point tensor, got {W.dtype}; the bound is for "
                        "the real-valued network")
    if any(want is not None and have != want for have, want in zip(W.shape, shape)):
        expected = "x".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"{where}: {name} is {W.size(0)}x{W.size(1)}, expected {expected} (the blocks' width "
                         "and hidden sizes must agree)")
    if not bool(torch.isfinite(W).all()):
        raise ValueError(f"{where}: {name} has non-finite entries (NaN or inf): no bound holds for it")


def _propagate(weights: Mapping, blocks: list, spread: float, method: str) -> TransformerBound:
    arch = _Architecture.of(weights, blocks)
    a, radius = arch.residual_weight, arch.input_radius
    sublayers, residuals, radii, alignments = [], [], [], []
    for block in blocks:
        attention = attention_lipschitz(
            block["q"], block["k"], block["v"], block["o"], n_head=arch.n_head,
            score_scale=arch.score_scale, attention_scale=arch.attention_scale, radius=radius, method=method,
        )
        radii.append(radius)
        alignments.append(attention.alignments)
        sublayers.append(spread * attention.lipschitz)
        residuals.append(residual_lipschitz(a, sublayers[-1]))
        radius = (1.0 - a) * radius + a * attention.output_radius
        mlp = residual_mlp_bound(block["mlp_in"], block["mlp_out"], residual_weight=a, gelu_scale=arch.gelu_scale,
                                 radius=radius, method=method)
        radii.append(radius)
        sublayers.append(mlp_lipschitz(block["mlp_in"], block["mlp_out"], arch.gelu_scale))
        residuals.append(mlp.lipschitz)
        radius = mlp.output_radius
    radii.append(radius)
    head = rms_operator_norm(weights["head"])
    factors = residuals + [head]
    # a zero factor makes the map constant from there on (constant 0), where 0 * inf (a constant that
    # overflowed earlier, e.g. at a huge input_radius) had made the bound NaN, which passes every `bound > limit`
    bound = 0.0 if 0.0 in factors else math.prod(factors)
    result = TransformerBound(bound, sublayers, residuals, radii, head, method)
    if method == "joint" and spread == 1.0:
        joint, joint_radii = _joint_bound(weights, blocks, arch, radii, alignments)
        result.bound = min(result.bound, joint)
        result.radii = [min(r, j) for r, j in zip(radii, joint_radii)]
    return result


def _n_head(weights: Mapping, heads_width: int) -> int:
    r"""``weights["n_head"]``, or $H = Hd_h\cdot\varsigma$ from the Lipschitz model's ``score_scale``
    $\varsigma = 1/d_h$ and the ``heads_width`` $Hd_h$ (rows of $W_q$). Not the model width $d$: heads
    narrower than the model ($Hd_h < d$) had been split into $d\varsigma$ heads, and one head of width 4 in a
    model of width 8 was certified as two heads of width 2 (0.33 for a map whose constant exceeds 1.1)."""
    if "n_head" in weights:
        n_head = as_count("transformer_lipschitz_bound", "n_head", weights["n_head"])
        if n_head < 1:
            raise ValueError(f"transformer_lipschitz_bound: n_head must be >= 1, got {n_head}")
        return n_head
    if "score_scale" not in weights:
        raise ValueError(
            "transformer_lipschitz_bound: weights need 'n_head' (or the Lipschitz model's "
            "'score_scale' = 1/d_head to infer it)"
        )
    inferred = heads_width * as_real("transformer_lipschitz_bound", "score_scale", weights["score_scale"])
    n_head = round(inferred) if math.isfinite(inferred) else 0
    if n_head < 1 or abs(inferred - n_head) > 1e-9 or heads_width % n_head:
        raise ValueError(
            f"transformer_lipschitz_bound: cannot infer n_head from score_scale="
            f"{weights['score_scale']} and the {heads_width} rows of q; pass weights['n_head']"
        )
    return n_head


# --------------------------------------------------------------------------------------
# the joint composition: reachable token sets

#: Generators a token set keeps before they are merged into one ellipsoid (attention multiplies
#: their number by $1 + H$; the merge keeps memory and time bounded on deep models, at some tightness).
_MAX_GENERATORS = 256
#: Entries of a token set's generators (float64: 128 MiB) past which it is merged: the cap on their
#: number falls as $2^{24}/d^2$ beyond $d = 256$, so the work per set operation, $N d^3$, stays
#: within $2^{24}d$ multiply-adds (GPT-2 small, $d = 768$: 28 generators) while the cap is at least
#: $1 + H$; below that (GPT-2 medium, $d = 1024$, $H = 16$: cap 16) a merged set's $1 + H$ value
#: images are formed and merged again at every attention.
_MAX_SET_ENTRIES = 2**24
#: Most reweighting steps of :func:`_relaxed_sup_of_grams`; every step's value is a bound, the smallest is kept.
_SUP_STEPS = 30
#: Relative gap below the top eigenvalue within which :func:`_relaxed_sup_of_grams` treats eigenvectors as tied.
_TOP_EIGENSPACE = 1e-9
#: :func:`_relaxed_sup_of_grams` stops once a step improves its bound by less than this (relative).
_SUP_STALL = 1e-12
#: Floor of :func:`_relaxed_sup_of_grams`'s weights relative to the largest (keeps $1/w_i$ finite).
_SMALLEST_WEIGHT = 1e-12


def _generator_cap(d: int) -> int:
    """The most generators a token set of dimension ``d`` keeps (at least 1)."""
    return max(1, min(_MAX_GENERATORS, _MAX_SET_ENTRIES // (d * d)))


def _square_generator(A: torch.Tensor) -> torch.Tensor:
    r"""A ``[d, d]`` generator of the set $A\mathbb B$ for ``A`` of ``[d, k]`` (float64): ``A``
    padded with zero columns when $k \le d$ (exact), else $R^\top$ from the QR factorization
    $A^\top = QR$ ($Q$ has orthonormal columns, so $Q^\top\mathbb B_k = \mathbb B_d$ and
    $A\mathbb B = R^\top\mathbb B$; Householder QR is backward stable, so the set moves by
    round-off of $\|A\|$ only, where a matrix square root of $AA^\top$ would move it by
    $\sqrt u\,\|A\|$)."""
    d, k = A.shape[-2:]
    if k <= d:
        return torch.nn.functional.pad(A, (0, d - k))
    return torch.linalg.qr(A.transpose(-1, -2), mode="r").R.transpose(-1, -2)


class _TokenSet:
    r"""A convex symmetric set of token vectors $K = \sum_iA_i\mathbb B$: the Minkowski sum of
    the images of the unit $\ell_2$ ball $\mathbb B$ under the square ``generators`` $A_i$
    (``[N, d, d]``, float64)."""

    def __init__(self, generators: torch.Tensor):
        self.generators = _merged(generators)

    def map(self, M: torch.Tensor) -> torch.Tensor:
        """The generators $MA_i$ of $MK$ (``M`` ``[m, d]``; ``[N, m, d]``). Any rows of them, or
        rows scaled, generate the image under the same rows of $M$: what :func:`_relaxed_sup`
        bounds the norm of."""
        return M @ self.generators

    def residual_values(self, a: float, values: torch.Tensor) -> torch.Tensor:
        r"""The generators of $(1-a)K + a\sum_hV_hK$ (``values`` ``[H, d, d]``; ``[N(1 + H), d, d]``).
        A set whose $N(1 + H)$ would pass the cap is merged into one ellipsoid first (:func:`_merged`),
        so the products are never formed beyond it and the $H$ value images stay apart."""
        generators = self.generators
        if generators.size(0) * (1 + values.size(0)) > _generator_cap(generators.size(-1)):
            generators = _merged(generators, cap=1)
        return torch.cat([(1 - a) * generators, a * (values[:, None] @ generators[None]).flatten(0, 1)])

    def sup_norm(self, W: torch.Tensor | None = None) -> float:
        r"""An upper bound on $\sup_{y\in K}\|Wy\|_2$ ($W$ ``[m, d]``; the identity when ``None``):
        :func:`_relaxed_sup` of the $WA_i$, or of the $RA_i$ for the QR factor $R$ of a $W$ with
        more rows than columns ($\|Wy\| = \|Ry\|$: smaller products)."""
        if W is None:
            return _relaxed_sup(self.generators)
        return _relaxed_sup(self.map(torch.linalg.qr(W, mode="r").R if W.size(0) > W.size(1) else W))


def _relaxed_sup(products: torch.Tensor) -> float:
    r"""An upper bound on $\sup_{y\in K}\|y\|_2$ for $K = \sum_iB_i\mathbb B$, ``products`` $B_i$
    (``[N, m, d]``, float64): :func:`_relaxed_sup_of_grams` of their Grams $B_iB_i^\top$."""
    return _relaxed_sup_of_grams(products @ products.transpose(-1, -2))


def _relaxed_sup_of_grams(grams: torch.Tensor) -> float:
    r"""An upper bound on $\sup_{y\in K}\|y\|_2$ for $K = \sum_iB_i\mathbb B$ from the Grams
    $B_iB_i^\top$ (``grams`` ``[N, m, m]``, float64).

    The supremum is $\max_{\|u\|=1}\sum_i\|B_i^\top u\|$ (the support function of a Minkowski
    sum is the sum of the support functions). For any weights $w_i > 0$, Cauchy–Schwarz gives
    $\sum_i\|B_i^\top u\| \le \bigl(\sum_iw_i\bigr)^{1/2}\bigl(u^\top\textstyle\sum_iB_iB_i^\top/w_i\,u\bigr)^{1/2}$,
    so

    $$\sup_{y\in K}\|y\| \le \Bigl(\textstyle\sum_iw_i\;\lambda_{\max}\bigl(\sum_iB_iB_i^\top/w_i\bigr)\Bigr)^{1/2}$$

    for every $w$ (a semidefinite relaxation of the maximum; for a maximiser $u$ the best $w$
    is $w_i = \|B_i^\top u\|$). Starting from $w_i = \|B_i\|_F$, each step moves $w_i$ halfway
    (geometrically) to $\bigl(\sum_k\|B_i^\top u_k\|^2\bigr)^{1/2}$ over the top eigenvectors
    $u_k$ (ties are common: symmetric sets); the smallest value is returned.

    *Round-off.* The sum is of the computed $B_iB_i^\top$, each positive semidefinite to
    round-off of its own size, so a small weight divides only the round-off of a small $B_i$
    (forming $W(\sum_iA_iA_i^\top/w_i)W^\top$ instead divides that of $\|W\|^2\|A_i\|^2$, which
    cancels to a wrong, even negative, top eigenvalue when $W$ annihilates $A_i$).
    $\lambda_{\max}$ is float64 ``eigh``'s."""
    diagonals = grams.diagonal(dim1=-2, dim2=-1)
    # a non-finite entry of B_i makes its row's diagonal entry of B_i B_i^T non-finite (inf, or NaN), so the
    # diagonals tell as well as every entry, for a fraction of the reads
    if not torch.isfinite(diagonals).all():
        return math.inf  # no bound (never the smallest value): a non-finite weight reached this set
    size = diagonals.sum(-1).clamp_min(0).sqrt()  # ||B_i||_F
    if not size.max() > 0:
        return 0.0
    weights = size.clamp_min(size.max() * _SMALLEST_WEIGHT)
    best = math.inf
    for _ in range(_SUP_STEPS):
        top_values, top_vectors = torch.linalg.eigh(torch.tensordot(weights.reciprocal(), grams, dims=1))
        value = math.sqrt(weights.sum().item() * max(top_values[-1].item(), 0.0))
        if value >= best * (1 - _SUP_STALL):
            break
        best = value
        top = top_vectors[:, top_values >= top_values[-1] * (1 - _TOP_EIGENSPACE)]  # the u_k
        spread = ((grams @ top) * top).sum((-2, -1)).clamp_min(0).sqrt()  # (sum_k u_k^T B_i B_i^T u_k)^(1/2)
        if not spread.max() > 0:
            break
        weights = (weights * spread.clamp_min(spread.max() * _SMALLEST_WEIGHT)).sqrt()  # damped: ties oscillate
    return best


#: Golden-section steps of :func:`_set_alignment` (a bracket of width 8 in $\log\tau$ shrinks to $5\cdot10^{-4}$).
_SET_ALIGNMENT_STEPS = 20


def _set_alignment(values: torch.Tensor, keys: torch.Tensor, reach_v: torch.Tensor, reach_k: torch.Tensor) -> torch.Tensor:
    r"""Per head $h$, a bound $\gamma_h \ge \|\operatorname{Cov}_p(v^h, k^h)\|$ for attention reading tokens of a
    set $K$ (see :func:`attention_lipschitz`'s aligned step, which ends in $\tfrac12\mathbb E_p\|N_\tau x_s\|^2$):

    $$\gamma_h = \min_{\tau>0}\tfrac12\sup_{x\in K}\|N_\tau x\|^2,\qquad N_\tau = \bigl[\sqrt\tau\,W_v^h;\ W_k^h/\sqrt\tau\bigr],$$

    from the images of $K$'s generators ``values`` $W_vA_i$ and ``keys`` $W_kA_i$ (``[N, H d_h, d]``,
    float64; head $h$ is row block $h$) and upper bounds ``reach_v``, ``reach_k`` (``[H]``) on
    $R_{vh} = \sup_K\|W_v^hx\|$, $R_{kh}$; returns ``[H]`` float64. Each sup is bounded by
    :func:`_relaxed_sup_of_grams`: the Grams of the images under $N_\tau$ are those of
    $[W_v^hA_i; W_k^hA_i]$ conjugated by $\operatorname{diag}(\sqrt\tau, 1/\sqrt\tau)$, so one product
    serves every $\tau$; :func:`_least_over_log_tau` searches $\tau$ (any $\tau$ is a bound).

    This is the value–key alignment $\nu_h$ measured on the set instead of the ball around it:
    before relaxation it is at most $\nu_h\sup_K\|x\|^2$ (as $\sup_K\|N_\tau x\|^2 \le
    \lambda_{\max}(N_\tau^\top N_\tau)\sup_K\|x\|^2$) and $R_{vh}R_{kh}$ (at $\tau = R_{kh}/R_{vh}$). It is at least
    $\sup_K\|W_v^hx\|\,\|W_k^hx\|$, and above it on sets that are not ellipsoids: the proof needs the
    $\tau$ form, not that product. A head with $R_{vh}R_{kh} = 0$ gets 0."""
    heads = reach_v.numel()
    stacked = [torch.cat([v, k], dim=-2) for v, k in zip(values.chunk(heads, dim=-2), keys.chunk(heads, dim=-2))]
    grams = [rows @ rows.transpose(-1, -2) for rows in stacked]
    d_head = values.size(-2) // heads

    def half_squares(log_tau: torch.Tensor) -> torch.Tensor:
        out = []
        for gram, t in zip(grams, log_tau.tolist()):
            scale = torch.tensor([math.exp(t / 2)] * d_head + [math.exp(-t / 2)] * d_head, dtype=gram.dtype)
            sup = _relaxed_sup_of_grams(gram * scale[:, None] * scale[None, :])
            out.append(0.5 * sup * sup)
        return torch.tensor(out, dtype=torch.float64)

    least = _least_over_log_tau(half_squares, reach_v, reach_k, _SET_ALIGNMENT_STEPS)
    return torch.where((reach_v == 0) | (reach_k == 0), torch.zeros_like(least), least)


def _merged(generators: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    r"""``generators`` if at most ``cap`` (default :func:`_generator_cap`), else one ellipsoid containing their
    sum: $\sum_iA_i\mathbb B \subseteq C\mathbb B$ with $C = [A_1/\sqrt{w_1}, \dots, A_N/\sqrt{w_N}]$,
    $\sum_iw_i = 1$ (its support function $\|C^\top u\| = (\sum_i\|A_i^\top u\|^2/w_i)^{1/2} \ge
    \sum_i\|A_i^\top u\|$ by Cauchy–Schwarz), $w_i \propto \|A_i\|_F$, which minimises
    $\|C\|_F$; as one square generator by :func:`_square_generator`."""
    if generators.size(0) <= (_generator_cap(generators.size(-1)) if cap is None else cap):
        return generators
    size = torch.linalg.matrix_norm(generators).clamp_min(torch.finfo(generators.dtype).tiny)
    scaled = generators / (size / size.sum()).sqrt()[:, None, None]
    return _square_generator(torch.cat(list(scaled), dim=-1))[None]


def _joint_bound(weights: Mapping, blocks: list, arch: _Architecture, radii: list[float],
                 alignments: list[list[float]]) -> tuple[float, list[float]]:
    r"""The joint bound (``method="joint"``) and the radii it propagates; see
    :func:`transformer_lipschitz_bound`. ``radii`` and each block's value–key ``alignments``
    $\nu_h$ are the aligned propagation's (the radii also hold, and cap these). Each of
    $W_q, W_k, W_v$ maps each set once; heads are row blocks of those images."""
    d, H, a, c, varsigma = arch.d, arch.n_head, arch.residual_weight, arch.attention_scale, arch.score_scale
    s, rho = arch.gelu_scale, GELU_LIPSCHITZ - 0.5
    identity = torch.eye(d, dtype=torch.float64)
    rms = math.sqrt(d)  # the l2 norm of a token of RMS 1
    X = _TokenSet((rms * arch.input_radius * identity)[None])  # activations
    G = _TokenSet((rms * identity)[None])  # their perturbations, per unit of input perturbation
    joint_radii = []

    def per_head(products: torch.Tensor) -> torch.Tensor:
        """The relaxed sup of each head's row block of ``products`` (``[N, H d_head, d]``)."""
        return torch.tensor([_relaxed_sup(rows) for rows in products.chunk(H, dim=-2)], dtype=torch.float64)

    def heads_scaled(products: torch.Tensor, scale: torch.Tensor) -> float:
        """The relaxed sup of ``products`` with head h's rows scaled by ``scale[h]``."""
        return _relaxed_sup(scale.repeat_interleave(products.size(-2) // H)[:, None] * products)

    for index, block in enumerate(blocks):  # float64 on the CPU already (_float64_on_cpu)
        q, k, v, o = (block[name] for name in ("q", "k", "v", "o"))
        x_radius = min(X.sup_norm(), rms * radii[2 * index])
        joint_radii.append(x_radius / rms)
        slices = {name: _head_slices(W, H, name) for name, W in (("q", q), ("k", k), ("v", v))}
        sigma = {name: torch.linalg.matrix_norm(W, ord=2) for name, W in slices.items()}
        on_X = {name: X.map(W) for name, W in (("q", q), ("k", k), ("v", v))}
        q_on_G, k_on_G = G.map(q), G.map(k)
        reach = {name: torch.minimum(per_head(on_X[name]), sigma[name] * x_radius) for name in on_X}
        # ||Cov_p(v^h, k^h)|| <= the alignment on X, <= R_vh R_kh and <= nu_h |x|^2 (the aligned bound's step)
        ball = torch.minimum(reach["v"] * reach["k"],
                             torch.tensor(alignments[index], dtype=torch.float64) * x_radius * x_radius)
        coupling = torch.minimum(ball, _set_alignment(on_X["v"], on_X["k"], reach["v"], reach["k"]))
        query_path = min(coupling.max().item() * _relaxed_sup(q_on_G), heads_scaled(q_on_G, coupling))
        key_weight = reach["v"] * per_head(k_on_G)
        key_path = min(key_weight.max().item() * _relaxed_sup(on_X["q"]), (key_weight * reach["q"]).norm().item(),
                       heads_scaled(on_X["q"], key_weight))
        values = c * o.reshape(d, H, -1).transpose(0, 1) @ slices["v"]  # [H, d, d]: c W_o^h W_v^h
        X = _TokenSet(X.residual_values(a, values))
        G = _TokenSet(torch.cat([G.residual_values(a, values),
                                 (a * c * varsigma * (query_path + key_path) * _square_generator(o))[None]]))
        x_radius = min(X.sup_norm(), rms * radii[2 * index + 1])
        joint_radii.append(x_radius / rms)
        w_in, w_out = block["mlp_in"], block["mlp_out"]
        linear = (1 - a) * identity + a * s * 0.5 * (w_out @ w_in)
        out = _square_generator(w_out)
        X = _TokenSet(torch.cat([X.map(linear), (a * s * 0.5 * X.sup_norm(w_in) * out)[None]]))
        G = _TokenSet(torch.cat([G.map(linear), (a * s * rho * G.sup_norm(w_in) * out)[None]]))
    joint_radii.append(min(X.sup_norm(), rms * radii[-1]) / rms)
    head = weights["head"]
    return G.sup_norm(head) / math.sqrt(head.size(0)), joint_radii


# --------------------------------------------------------------------------------------
# empirical estimator


@dataclass
class EmpiricalLipschitz:
    """Best ratio $\\|f(x) - f(y)\\|/\\|x - y\\|$ found, a lower bound on the Lipschitz
    constant, with the pair that reaches it, every restart's best ratio, and the best
    ratio of each search (``"near"``, ``"far"``, ``"token"``, ``"pairs"``, ``"jacobian"``)."""

    estimate: float
    x: torch.Tensor
    y: torch.Tensor
    per_restart: list[float]
    by_search: dict[str, float] = field(default_factory=dict)


def _project_to_radius(X: torch.Tensor, radius: float | None) -> torch.Tensor:
    if radius is None:
        return X
    rms = X.pow(2).mean(-1, keepdim=True).sqrt()
    return X / (rms / radius).clamp_min(1.0)


def _unit_token_rms(G: torch.Tensor) -> torch.Tensor:
    return G / G.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(G.dtype).tiny)


def _unit_sequence_rms(G: torch.Tensor) -> torch.Tensor:
    norm = sequence_rms(G).reshape((-1,) + (1,) * (G.dim() - 1))
    return G / norm.clamp_min(torch.finfo(G.dtype).tiny)


def _dual_token_rms_max(D: torch.Tensor) -> torch.Tensor:
    """A linear functional at which $\\langle u, D\\rangle$ is $D$'s max-token norm (up to scale):
    $D$ restricted to its largest token."""
    rms = D.pow(2).mean(-1)
    flat = rms.reshape(rms.size(0), -1)
    mask = torch.zeros_like(flat)
    mask[torch.arange(flat.size(0)), flat.argmax(-1)] = 1.0
    return D * mask.reshape(rms.shape).unsqueeze(-1)


#: For the norms of this module: (the input unit vector maximizing a linear functional,
#: the output functional dual to a vector), what the Jacobian power iteration needs.
_POWER_STEPS = {
    token_rms_max: (_unit_token_rms, _dual_token_rms_max),
    sequence_rms: (_unit_sequence_rms, lambda D: D),
}

#: The pair searches of :func:`empirical_lipschitz`.
SEARCHES = ("near", "far", "token", "pairs")

#: Relative noise on the antipodal tokens of the ``"pairs"`` starts.
_PAIR_NOISE = 0.3


def certify_domain(X: torch.Tensor, radius: float = 1.0) -> None:
    r"""Raise ``ValueError`` unless every token (last dimension) of ``X`` has RMS at most
    ``radius`` (relative slack of 4 float64 ulps): the domain of every bound here.

    ``radius`` must be a finite number $\ge 0$ and ``X`` a non-empty floating tensor; a NaN
    token is outside the domain (no comparison holds for it)."""
    radius = as_positive("certify_domain", "radius", radius, zero=True)
    if not (isinstance(X, torch.Tensor) and X.is_floating_point()):
        raise TypeError(f"certify_domain: X must be a floating-point tensor, got "
                        f"{X.dtype if isinstance(X, torch.Tensor) else type(X).__name__}")
    if X.numel() == 0:
        raise ValueError(f"certify_domain: X of shape {tuple(X.shape)} has no entries: no token to certify")
    largest = X.detach().double().pow(2).mean(-1).sqrt().max().item()
    # written as "not <=": NaN (a NaN token, which max propagates) fails it, where "largest >
    # bound" had passed every NaN input
    if not largest <= radius * (1 + 4 * torch.finfo(torch.float64).eps):
        # every digit: a float32 token normalised to RMS 1 can be an ulp above it, which 6 digits had
        # printed as "RMS 1 (input_radius=1)"
        token = "a token has NaN entries" if math.isnan(largest) else f"a token has RMS {largest!r}"
        raise ValueError(
            f"input outside the certified domain: {token} (input_radius={radius!r}); the bound holds only for "
            "token RMS <= input_radius (the Lipschitz model's embedding gives 1; normalise in float64)"
        )


def empirical_lipschitz(
    f: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    *,
    restarts: int = 8,
    steps: int = 200,
    lr: float = 0.02,
    radius: float | None = 1.0,
    perturbation: float = 0.1,
    searches: tuple[str, ...] = SEARCHES,
    power_steps: int = 20,
    ascent_steps: int = 0,
    ascent_lr: float = 0.003,
    near: float = 1e-4,
    in_norm: Callable[[torch.Tensor], torch.Tensor] = token_rms_max,
    out_norm: Callable[[torch.Tensor], torch.Tensor] = token_rms_max,
    generator: torch.Generator | None = None,
) -> EmpiricalLipschitz:
    r"""Lower-bound the Lipschitz constant of ``f`` by adversarial search over input pairs
    and power iteration on its Jacobian; run it in float64.

    *Pair searches* (``searches``, ``restarts`` pairs each, one batch): each pair
    $(x, y)$ starts from ``x0`` plus noise (the first of each search but ``"pairs"`` from ``x0`` itself)
    and Adam maximizes $\log\|f(y) - f(x)\| - \log\|y - x\|$ in $x$ and the offset, both
    points projected back into the domain (token RMS $\le$ ``radius``; ``None`` =
    unconstrained) after each step:

    * ``"near"``: $y = x + \epsilon\,u/\|u\|$ with $\epsilon$ = ``near`` times the input
      scale: the local slope in direction $u$;
    * ``"far"``: a free offset, starting at relative size ``perturbation``;
    * ``"token"``: a free offset on one token (token $j \bmod T$ for restart $j$; in causal
      attention the first token feeds every output);
    * ``"pairs"``: a free offset from a structured start, tokens $2i, 2i+1$ at $\pm u_i$ (a
      fresh random $u_i$ per pair and restart, plus 30 % noise, at ``x0``'s RMS): attention's
      score path is largest when a query splits its attention between opposite tokens, a
      configuration random starts rarely reach (on the trained ``cpu-lipschitz`` models it
      raised the best estimate by up to a quarter).

    *Jacobian power iteration* (``power_steps``, for this module's norms): from the point of
    each restart's best pair where the slope along it is largest (17 points of the
    segment), iterate $u \leftarrow$ the output functional dual to $J\delta$,
    $\delta \leftarrow$ the unit input maximizing $\langle J^\top u, \delta\rangle$ (a
    generalized power method for mixed norms, monotone in $\|J\delta\|$), with $J\delta$
    measured by the symmetric pair $x \pm \epsilon\delta$ and $J^\top u$ by one backward pass.

    *Jacobian ascent* (``ascent_steps``, after the power iteration): the centre $x$ moves too,
    by Adam (learning rate ``ascent_lr`` times the input scale) on $\log$ of the symmetric-pair
    slope at the current direction, while each step still takes one power update of $\delta$:
    an alternating ascent of the local slope $\|J(x)\delta\|$ over the point and the direction
    together, where the ``"near"`` search moves the direction by Adam steps alone (for the same
    norms as the power iteration; otherwise neither runs). On the trained
    3-layer, 4-head ``cpu-lipschitz`` model at length 64, 1200 steps from the power iteration's
    best pair raised the estimate 47.8 → 53.9 (``ascent_lr`` 0.002) and 54.7 (0.004); at
    ``lr`` (0.02) the centre overshoots and it stayed at 48.0.

    Every reported ratio is that of an evaluated pair of admissible inputs, so the result
    is a true lower bound on the constant over the domain (no finite-difference
    approximation enters it).

    *Budget.* The defaults are sized for tests. On a trained model the estimate keeps rising
    with the sequence length and the search budget: on the 3-layer, 4-head ``cpu-lipschitz``
    model after 1000 steps it is 27.1 over lengths up to 16 with 8 restarts of 300 steps,
    and 45.0 at its context length 64 with 8 restarts of 1200 steps (51.3 with 32 restarts).
    More power steps or a larger ``lr`` did not help (``bench/lipschitz_tightness.py``
    runs the larger search). Attack at the model's context length and raise ``steps``
    before reading a bound's slack off the ratio.

    Args:
        f: the map (e.g. the blocks and head of a model, from embedded sequences to logits);
            it must map ``[B, ...]`` to ``[B, ...]`` row by row.
        x0: ``[...]`` one input (no batch dimension), e.g. ``[T, d]``, finite and in the domain.
            Its RMS is the input scale of the noise, offsets and steps below; for ``x0 = 0`` the
            scale is ``radius`` (1 when ``None``).
        restarts: a whole number $\ge 1$.
        steps: a whole number $\ge 0$ (as are ``power_steps`` and ``ascent_steps``).
        lr: a finite number $> 0$, relative to the input scale (as are ``ascent_lr``, ``near``
            and ``perturbation``).
        radius: the domain's token-RMS radius, a finite number $> 0$, or ``None``.
        searches: a non-empty subset of :data:`SEARCHES` (any iterable of their names, read once).
        in_norm: ``[B, ...] -> [B]`` norm of the inputs (default: max per-token RMS).
        out_norm: ``[B, ...] -> [B]`` norm of the outputs (default: max per-token RMS).
            The power iteration runs when both are :func:`token_rms_max` or
            :func:`sequence_rms`.
        generator: for the random starts (default: a fixed seed, for reproducibility).

    Returns:
        :class:`EmpiricalLipschitz`; computed in ``x0.dtype`` (use float64: in float32 the
        rounding error of $f$ dominates near pairs, see :func:`rounding_error_bound`).

    Raises:
        ValueError: an option or ``x0`` outside the above (named; ``TypeError`` for a bool
            or a string), or no evaluated pair gave a finite ratio (``f`` returned NaN or
            inf), where an estimate of $-\infty$ had come back.
    """
    where = "empirical_lipschitz"
    restarts = as_count(where, "restarts", restarts, 1)
    steps, power_steps, ascent_steps = (as_count(where, name, value) for name, value in
                                        (("steps", steps), ("power_steps", power_steps), ("ascent_steps", ascent_steps)))
    # each scales a step or an offset: at 0 or NaN no admissible pair was evaluated (estimate -inf)
    lr, ascent_lr, near, perturbation = (as_positive(where, name, value) for name, value in
                                         (("lr", lr), ("ascent_lr", ascent_lr), ("near", near),
                                          ("perturbation", perturbation)))
    # read once, here: the check had used up a generator, and the search ran no pair (an IndexError)
    if not isinstance(searches, str) and isinstance(searches, Iterable):
        searches = tuple(searches)
    if not isinstance(searches, tuple) or set(searches) - set(SEARCHES) or not searches:
        raise ValueError(f"empirical_lipschitz: searches must be a non-empty subset of {SEARCHES}, got {searches}")
    if not (isinstance(x0, torch.Tensor) and x0.is_floating_point()):
        raise TypeError(f"{where}: x0 must be a floating-point tensor, got "
                        f"{x0.dtype if isinstance(x0, torch.Tensor) else type(x0).__name__}")
    if not x0.numel() or not x0.dim():  # (a 0-D x0, with no token dimension, had failed in an index)
        raise ValueError(f"{where}: x0 of shape {tuple(x0.shape)} is empty or has no token dimension (the last): "
                         "give one input, e.g. [T, d]")
    if not bool(torch.isfinite(x0).all()):  # (it had failed in Adam, as "Invalid learning rate: nan")
        raise ValueError(f"{where}: x0 has non-finite entries (NaN or inf)")
    if radius is not None:
        # radius 0 leaves one point, and no pair
        certify_domain(x0, as_positive(where, "radius", radius))
    generator = generator or torch.Generator(device="cpu").manual_seed(0)
    base = x0.detach()
    tiny = torch.finfo(base.dtype).tiny
    # the input scale of every noise, offset and step: x0's RMS, or the domain's radius (1 when
    # unconstrained) for x0 = 0, which is in the domain: its RMS had scaled them all to 1e-308
    # and the estimate was -inf
    scale = base.pow(2).mean().sqrt().item() or (1.0 if radius is None else radius)
    column = (-1,) + (1,) * base.dim()

    def noise(size):
        return torch.randn(size, generator=generator, dtype=base.dtype).to(base.device)

    kinds = [search for search in searches for _ in range(restarts)]
    shape = (len(kinds),) + tuple(base.shape)
    x = base.expand(shape).clone()
    moved = torch.tensor([j % restarts != 0 for j in range(len(kinds))], device=base.device)
    x[moved] += 0.5 * scale * noise(shape)[moved]
    positions = max(1, base[..., 0].numel())
    pairs = [j for j, kind in enumerate(kinds) if kind == "pairs"]
    if pairs:  # tokens 2i, 2i+1 at +-u_i, with noise, at x0's RMS
        u = noise((len(pairs), (positions + 1) // 2, base.size(-1))).repeat_interleave(2, dim=1)[:, :positions]
        sign = torch.tensor([(-1.0) ** t for t in range(positions)], dtype=base.dtype, device=base.device)
        tokens = u * sign.reshape(1, -1, 1) + _PAIR_NOISE * noise(u.shape)
        x[pairs] = (scale * tokens / tokens.pow(2).mean(-1, keepdim=True).sqrt()).reshape((len(pairs),) + base.shape)
    x = _project_to_radius(x, radius).requires_grad_(True)
    offset = (perturbation * scale * noise(shape)).requires_grad_(True)
    # which entries each pair may move: all, or one token
    mask = torch.ones(shape[:-1] + (1,), dtype=base.dtype, device=base.device)
    for j, kind in enumerate(kinds):
        if kind == "token":
            one = torch.zeros(positions, dtype=base.dtype, device=base.device)
            one[(j % restarts) % positions] = 1.0
            mask[j] = one.reshape(tuple(base.shape[:-1]) + (1,))
    is_near = torch.tensor([kind == "near" for kind in kinds], device=base.device).reshape(column)
    _check_batch_shapes(where, f, in_norm, out_norm, x.detach())
    optimizer = torch.optim.Adam([x, offset], lr=lr * scale)

    # on x0's device: a CPU tensor here had made the first comparison with a CUDA ratio fail
    best = torch.full((len(kinds),), -math.inf, dtype=torch.float64, device=base.device)
    best_x, best_y = x.detach().clone(), x.detach().clone()
    for step in range(steps + 1):
        moved_by = offset * mask
        unit = near * scale * moved_by / in_norm(moved_by).clamp_min(tiny).reshape(column)
        y = _project_to_radius(x + torch.where(is_near, unit, moved_by), radius)
        gap = in_norm(y - x)
        ratio = out_norm(f(y) - f(x)) / gap.clamp_min(tiny)
        with torch.no_grad():
            improved = (ratio.double() > best) & (gap > 0)
            best = torch.where(improved, ratio.double(), best)
            best_x[improved] = x.detach()[improved]
            best_y[improved] = y.detach()[improved]
        if step == steps:
            break
        # the gradients of the search's own variables only: backward() had also accumulated into the
        # parameters of f (a model's .grad, between a training step's backward and its update, came back changed)
        x.grad, offset.grad = torch.autograd.grad(-ratio.clamp_min(tiny).log().sum(), [x, offset])
        optimizer.step()
        with torch.no_grad():
            x.copy_(_project_to_radius(x, radius))
    by_search = {s: max(best[j].item() for j, kind in enumerate(kinds) if kind == s) for s in searches}

    if (power_steps or ascent_steps) and in_norm in _POWER_STEPS and out_norm in _POWER_STEPS:
        power = _jacobian_power_iteration(f, best_x, best_y, power_steps, ascent_steps, near * scale,
                                          ascent_lr * scale, radius, in_norm, out_norm)
        by_search["jacobian"] = power[0].max().item()
        take = power[0] > best
        best = torch.where(take, power[0], best)
        best_x[take], best_y[take] = power[1][take], power[2][take]
    winner = int(best.argmax())
    if best[winner].item() == -math.inf:
        raise ValueError(f"{where}: no evaluated pair gave a finite ratio: f returned non-finite values, or every "
                         "pair collapsed to one point")
    return EmpiricalLipschitz(best[winner].item(), best_x[winner], best_y[winner], best.tolist(), by_search)


def _check_batch_shapes(where: str, f, in_norm, out_norm, x: torch.Tensor) -> None:
    r"""Refuse ``f``, ``in_norm`` or ``out_norm`` unless they map the batch ``x`` (``[B, ...]``) row by row, to
    ``[B, ...]`` and ``[B]``: one evaluation of each, and of ``f`` on the first row alone, before the search
    (a norm returning one number for the whole batch had been broadcast over it, and an ``f`` mixing the
    rows, e.g. a batch mean or BatchNorm in training mode, had given an "estimate" of 6669 for a map of
    constant 5: neither was a ratio of any pair). The first row alone must match within
    $\sqrt{\varepsilon}$ of its scale: a batched evaluation rounds a few ulps per operation away from a
    single row's, far below that, and a row-mixing ``f`` moves it by $O(1)$."""
    batch = x.size(0)
    with torch.no_grad():
        out = f(x)
        if not (isinstance(out, torch.Tensor) and out.dim() and out.size(0) == batch):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{where}: f must map a batch [B, ...] to [B, ...] row by row (a tensor); for B = {batch} "
                             f"it returned {got}")
        if batch > 1:
            alone, together = f(x[:1]), out[:1]
            scale = together.abs().max().clamp_min(torch.finfo(together.dtype).tiny)
            tolerance = torch.finfo(out.dtype).eps ** 0.5 * scale
            if alone.shape != together.shape or (alone - together).abs().max() > tolerance:
                raise ValueError(f"{where}: f must map a batch [B, ...] row by row: its first row alone gives another "
                                 "result than in the batch (does f mix the rows, e.g. a batch mean or BatchNorm in "
                                 "training mode, or draw random numbers?); evaluate the model in eval mode")
        for name, norm, value in (("in_norm", in_norm, x), ("out_norm", out_norm, out)):
            norms = norm(value)
            if not (isinstance(norms, torch.Tensor) and norms.shape == (batch,)):
                got = tuple(norms.shape) if isinstance(norms, torch.Tensor) else type(norms).__name__
                raise ValueError(f"{where}: {name} must map [B, ...] to the [B] norms of the rows; for B = {batch} "
                                 f"it returned {got}")


def _jacobian_power_iteration(f, x, y, steps, ascent_steps, step_size, lr, radius, in_norm, out_norm):
    """Best symmetric-pair slope per row, and its pairs: ``steps`` power steps at a fixed centre, then
    ``ascent_steps`` that also move the centre (see :func:`empirical_lipschitz`)."""
    unit_in, _ = _POWER_STEPS[in_norm]
    _, dual_out = _POWER_STEPS[out_norm]
    tiny = torch.finfo(x.dtype).tiny
    column = (-1,) + (1,) * (x.dim() - 1)
    direction = unit_in(y - x)

    def slope(centre, direction):
        plus = _project_to_radius(centre + step_size * direction, radius)
        minus = _project_to_radius(centre - step_size * direction, radius)
        change = f(plus) - f(minus)
        gap = in_norm(plus - minus)
        return out_norm(change).double() / gap.clamp_min(tiny), gap, change, minus, plus

    with torch.no_grad():
        along = torch.linspace(0, 1, 17, dtype=x.dtype, device=x.device)
        slopes = torch.stack([slope(x + tau * (y - x), direction)[0] for tau in along])
        centre = x + along[slopes.argmax(0)].reshape(column) * (y - x)
    centre.requires_grad_(True)
    optimizer = torch.optim.Adam([centre], lr=lr)
    best = torch.full((x.size(0),), -math.inf, dtype=torch.float64, device=x.device)
    best_x, best_y = x.clone(), y.clone()
    for step in range(steps + ascent_steps + 1):
        ascending = steps <= step < steps + ascent_steps
        with torch.set_grad_enabled(ascending):
            ratio, gap, change, minus, plus = slope(centre, direction)
        with torch.no_grad():
            improved = (ratio > best) & (gap > 0)
            best = torch.where(improved, ratio, best)
            best_x[improved], best_y[improved] = minus[improved], plus[improved]
        if step == steps + ascent_steps:
            break
        point = centre.detach().clone().requires_grad_(True)
        (pullback,) = torch.autograd.grad((f(point) * dual_out(change.detach())).sum(), point)
        if ascending:  # the centre climbs the slope measured along the direction it had
            (centre.grad,) = torch.autograd.grad(-ratio.clamp_min(tiny).log().sum(), [centre])  # (not f's parameters)
            optimizer.step()
            with torch.no_grad():
                centre.copy_(_project_to_radius(centre, radius))
        direction = unit_in(pullback)
    return best, best_x, best_y


# --------------------------------------------------------------------------------------
# rounding


def _gamma(n: int, unit_roundoff: float) -> float:
    if n * unit_roundoff >= 1:
        raise ValueError(f"rounding_error_bound: n·u = {n * unit_roundoff:g} >= 1, no bound")
    return n * unit_roundoff / (1 - n * unit_roundoff)


def _rope_rounding(d_head: int, sequence_length: int, unit_roundoff: float, elementwise_ulps: float) -> float:
    r"""First-order bound $\varepsilon_\text{rope}$ on $\|\hat R_tx - R_tx\| / \|x\|$ for the rotary embedding
    of :func:`geomuon.pretrain.model.rotary` computed with unit round-off $u$ (that of the network's dtype,
    at least that of the angles' wider dtype), at every position $t \le T - 1$, $T$ = ``sequence_length``.

    Pair $i$ of a head of width $D$ = ``d_head`` is rotated by $\phi = t\theta_i$,
    $\theta_i = 10^{4e_i}$ with $e_i = -2i/D \in (-1, 0]$. The code computes $\hat e_i = e_i(1 + \delta)$
    ($|\delta| \le u$), $\hat\theta_i = 10^{4\hat e_i}(1 + \delta')$ ($|\delta'| \le eu$, $e$ =
    ``elementwise_ulps``) and $\hat\phi = t\hat\theta_i(1 + \delta'')$, so

    $$|\hat\phi - \phi| \le (T - 1)\,\max_i\theta_i\bigl(|e_i|\ln 10^4 + e + 1\bigr)u =: \alpha,$$

    and a rotation by the wrong angle moves a pair by $\|R(\hat\phi) - R(\phi)\| = 2|\sin\tfrac{\hat\phi - \phi}2|
    \le \min(\alpha, 2)$ of its norm. $\cos\hat\phi$ and $\sin\hat\phi$ are each off by at most $(e + 1)u$
    (the function, then the cast to the network's dtype), a perturbation of the $2\times2$ rotation of norm
    $\le \sqrt2(e + 1)u$; and $x_1c - x_2s$, $x_1s + x_2c$ (two products and a sum each) err by
    $\gamma_2(|x_1c| + |x_2s|) \le \gamma_2\|(x_1, x_2)\|$ each, $\sqrt2\gamma_2$ of the pair together.
    The bound is the same for every pair, so it holds for the whole head vector:

    $$\varepsilon_\text{rope} = \min(\alpha, 2) + \sqrt2(e + 1)u + \sqrt2\gamma_2.$$"""
    exponents = [-2 * i / d_head for i in range(d_head // 2)]  # (none for d_head < 2: no rotation)
    angle = max((10.0 ** (4 * e) * (abs(e) * math.log(1e4) + elementwise_ulps + 1) for e in exponents), default=0.0)
    return (min((sequence_length - 1) * angle * unit_roundoff, 2.0) + math.sqrt(2) * (elementwise_ulps + 1) * unit_roundoff
            + math.sqrt(2) * _gamma(2, unit_roundoff))


#: The dtypes :func:`rounding_error_bound` has a rounding model for.
_ROUNDING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _coarsest_weight_dtype(weights: Mapping) -> torch.dtype:
    """The dtype of largest unit round-off among the weight matrices of ``weights`` (``"blocks"`` a list,
    every matrix real floating point): the one the network computes in, refused (``ValueError``) when
    :func:`rounding_error_bound` has no model for it."""
    matrices = [weights["head"], *(W for block in weights["blocks"] for W in block.values())]
    coarsest = max((W.dtype for W in matrices), key=lambda dtype: torch.finfo(dtype).eps)
    if coarsest not in _ROUNDING_DTYPES:
        raise ValueError(f"rounding_error_bound: the weights are {coarsest}, which has no rounding model here; "
                         f"pass dtype, one of {_ROUNDING_DTYPES}")
    return coarsest


def _abs_rms_norm(W: torch.Tensor) -> float:
    return rms_operator_norm(W.detach().double().abs())


def rounding_error_bound(
    weights: Mapping, *, dtype: torch.dtype | None = None, sequence_length: int, elementwise_ulps: float = 4.0
) -> float:
    r"""First-order bound $E$ on $\max_t\|\hat f(X)_t - f(X)_t\|_{\mathrm{RMS}}$: the implemented
    network $\hat f$ (every operation in ``dtype``) against the exact one, for inputs of
    token RMS $\le r_0$ and sequences of at most ``sequence_length`` tokens. With it the
    implemented network satisfies

    $$\|\hat f(x) - \hat f(y)\| \le L\|x - y\| + 2E,$$

    which no bound of the form $L\|x-y\|$ can give: one rounding of one input entry moves
    $\hat f$ by rounding noise of order $uL$ times the activations, whatever $\|x - y\|$ is.

    *Model* (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1, §3.5): unit
    round-off $u$ ($2^{-24}$ float32, $2^{-8}$ bf16); an inner product of length $n$ has
    error $\le \gamma_n\sum_i|a_ib_i|$, $\gamma_n = nu/(1 - nu)$, so a matmul on a token
    of RMS $r$ errs by $\le \gamma_{n+1}\||W|\|r$ (RMS→RMS norm of the entrywise absolute
    value); ``elementwise_ulps`` bounds $\exp$, erf-GELU, scalings and the residual
    combination ($\le$ that many $u$ of their output); the softmax over $\le T$ scores has
    relative error $\le (T + e)\,u$ per probability, $e$ = ``elementwise_ulps``. Errors of the
    inputs of a sub-layer propagate through its exact constant $L_i$ (first order: second
    order terms in $u$ are dropped, i.e. $u\,L \ll 1$), so with $\varepsilon_i$ the error a
    sub-layer makes on exact inputs and $L^\text{res}_j$ the residual constants of
    :func:`transformer_lipschitz_bound`,

    $$E = \|W_\text{head}\|\sum_i \varepsilon_i\prod_{j > i}L^\text{res}_j + \gamma_{d+1}\||W_\text{head}|\|\,r_\text{final}.$$

    Attention's $\varepsilon$: the $q, k, v$ errors (scores move by $\le \varsigma(\|\delta q\|\|k\| +
    \|q\|\|\delta k\|) + \gamma_{d_h}\varsigma\|q\|\|k\|$, which moves $y$ by at most that times
    $\max\|v\|$, as in :func:`attention_lipschitz`), where $\delta q$ and $\delta k$ include RoPE's
    rounding (:func:`_rope_rounding`: the angles $t\theta_i$ are computed, so the error grows with the
    position, up to $T - 1$), the softmax and $PV$ errors, and
    $W_o$'s; each head averages its own values, so the heads' sizes and errors enter $y$ (the
    heads side by side) in squares, $(\sum_h\sigma(W_v^h)^2)^{1/2}$, not as $\sigma(W_v)$. The MLP's: $W_\text{in}$'s error through $s\,g_+\|W_\text{out}\|$, GELU's, and
    $W_\text{out}$'s. Autocast (bf16 matmuls, float32 softmax) is covered by the bf16 bound.

    This is a procedure under a stated model (correctly rounded elementary operations up to
    ``elementwise_ulps``, no overflow), not a certificate of a particular kernel library; the test
    suite checks it against a float64 evaluation and against the one-ulp counterexample.

    Args:
        dtype: the dtype every operation computes in (float32, bfloat16, float16 or float64). ``None``
            (the default): the weights' own, the coarsest if they differ, since an ``nn.Linear`` computes
            in its weight's dtype (a float32 default had bounded a bfloat16 model by float32's $u$, 5x
            below its measured error), but never finer than float32: a float64 copy of a model is what
            :func:`empirical_lipschitz` attacks, and the network it stands for runs in float32 or
            coarser (pass ``torch.float64`` for one that runs in float64). Pass ``torch.bfloat16`` for
            float32 weights under bf16 autocast.

    Raises:
        ValueError: ``dtype``'s range may not hold an intermediate value (bounded through
            $\sigma_{\max}(|W|)$ and the radii, partial sums included; float16's 65504 on large
            weights), where the error is unbounded; or options as named.

    Returns:
        $E$ in the max per-token RMS norm of the logits (float).
    """
    if dtype is not None and dtype not in _ROUNDING_DTYPES:
        raise ValueError(f"rounding_error_bound: dtype must be one of {_ROUNDING_DTYPES} or None (the weights' "
                         f"dtype), got {dtype}")
    T = as_count("rounding_error_bound", "sequence_length", sequence_length, 1)
    # a negative count had lowered E below the rounding it bounds (unsound), a NaN made it NaN
    elementwise_ulps = as_positive("rounding_error_bound", "elementwise_ulps", elementwise_ulps, zero=True)
    _check_weights("rounding_error_bound", weights)
    weights = {**weights, "blocks": list(weights["blocks"])}  # (a generator of blocks: read once, here)
    exact = transformer_lipschitz_bound(weights)  # (refuses weights that are not real floating point, by key)
    if dtype is None:
        dtype = max(_coarsest_weight_dtype(weights), torch.float32, key=lambda kind: torch.finfo(kind).eps)
    u = torch.finfo(dtype).eps / 2
    blocks = weights["blocks"]
    arch = _Architecture.of(weights, blocks)
    d, d_head = arch.d, blocks[0]["q"].size(0) // arch.n_head
    a, score_scale, c, s = arch.residual_weight, arch.score_scale, arch.attention_scale, arch.gelu_scale
    elementwise = elementwise_ulps * u
    rope = _rope_rounding(d_head, T, u, elementwise_ulps)
    local = []
    # Higham's model holds only without overflow: an l2 bound on every token vector (which bounds its entries),
    # partial sums included (|sum_j w_ij x_j| <= (|W||x|)_i, so sigma(|W|) ||x||), before and after each scaling
    peaks = []
    for index, block in enumerate(blocks):
        r = exact.radii[2 * index]
        norms = {name: rms_operator_norm(block[name]) for name in ("mlp_in", "mlp_out")}
        # q, k, v, o: per-token l2 errors and magnitudes (sqrt(d) r scale), so the weights enter by
        # their l2 norms (their RMS norms are those only when H d_head = d, and smaller for wider heads)
        scale = math.sqrt(d) * r
        sigma = {name: _sigma(block[name]) for name in "qko"}  # (W_v enters by its heads, below)
        sigma_abs = {name: _sigma(block[name].abs()) for name in "qkvo"}
        size = {name: sigma[name] * scale for name in "qk"}
        # the matmul's error, then RoPE's on the rotated vector (relative to its size): the rotation
        # had been taken as exact, and a float32 query at position 948 of 1024 moved the output by 1.9 E
        err = {name: _gamma(d + 1, u) * sigma_abs[name] * scale + rope * size[name] for name in "qk"}
        score_error = score_scale * (err["q"] * size["k"] + size["q"] * err["k"]
                                     + _gamma(d_head + 1, u) * size["q"] * size["k"])
        softmax_error = (T + elementwise_ulps) * u
        # y, the heads side by side: each head averages its own values over the tokens, so the heads'
        # sizes and errors add in squares (sigma(W_v) bounds one head's; H heads attending H tokens
        # had reached sqrt(H) times that)
        v_heads = _head_slices(block["v"], arch.n_head, "v")
        y_size = math.hypot(*torch.linalg.matrix_norm(v_heads, ord=2).tolist()) * scale
        v_error = _gamma(d + 1, u) * math.hypot(*torch.linalg.matrix_norm(v_heads.abs(), ord=2).tolist()) * scale
        y_error = v_error + (score_error + softmax_error + _gamma(T + 1, u)) * y_size
        attention = c * (sigma["o"] * y_error + _gamma(d + 1, u) * sigma_abs["o"] * y_size) / math.sqrt(d)
        attention += elementwise * c * sigma["o"] * y_size / math.sqrt(d)
        r_mlp = exact.radii[2 * index + 1]
        hidden_size = norms["mlp_in"] * r_mlp
        abs_norms = {name: _abs_rms_norm(block[name]) for name in ("mlp_in", "mlp_out")}
        hidden_error = _gamma(d + 1, u) * abs_norms["mlp_in"] * r_mlp
        gelu_error = s * (GELU_LIPSCHITZ * hidden_error + 2 * elementwise * hidden_size)
        mlp = (norms["mlp_out"] * gelu_error
               + _gamma(block["mlp_out"].size(1) + 1, u) * abs_norms["mlp_out"] * s * hidden_size)
        # residual (1-a)x + a f: the products and the sum, a few ulps of the result
        local.append(a * attention + elementwise * exact.radii[2 * index + 1])
        local.append(a * mlp + elementwise * exact.radii[2 * index + 2])
        reach = {name: sigma_abs[name] * scale for name in "qkv"}
        hidden = block["mlp_in"].size(0)
        hidden_reach = abs_norms["mlp_in"] * r_mlp * math.sqrt(hidden)  # (the RMS norms of |W|, in l2 units)
        peaks += [scale, *reach.values(), max(score_scale, 1.0) * reach["q"] * reach["k"],
                  max(c, 1.0) * sigma_abs["o"] * y_size, max(s, 1.0) * hidden_reach,
                  abs_norms["mlp_out"] * math.sqrt(d / hidden) * s * hidden_reach]
    head_abs_norm = _abs_rms_norm(weights["head"])
    peaks.append(head_abs_norm * exact.radii[-1] * math.sqrt(weights["head"].size(0)))
    # the computed values are within a factor 1 + gamma < 2 of these (first order, as above)
    if not 2 * max(peaks) <= torch.finfo(dtype).max:
        raise ValueError(f"rounding_error_bound: the {dtype} network can overflow (an intermediate value of "
                         f"magnitude up to {max(peaks):.3g}, past the largest {dtype} {torch.finfo(dtype).max:.3g}) "
                         "and its error is then unbounded; use a wider dtype (torch.float32 or torch.bfloat16)")
    total = 0.0
    for i, epsilon in enumerate(local):
        total += epsilon * math.prod(exact.residuals[i + 1:])
    return exact.head * total + _gamma(d + 1, u) * head_abs_norm * exact.radii[-1]
