r"""A GPT in one file (nanoGPT-shaped), with the switches the geometry studies need.

* MLP: GELU (``c_fc``/``c_proj``) or SwiGLU (``w_gate``/``w_up``/``w_down``), optionally a
  mixture of experts with a linear router (top-$k$, Switch-style load-balancing loss).
* Normalisation: pre-LayerNorm residual blocks (GPT-2), or the **Lipschitz variant**
  (Newhouse et al. 2025, arXiv:2507.13338; docs: concepts/lipschitz): no LayerNorm, residual $x \leftarrow (1-a)x + a\,f(x)$ with
  $a = 1/(2N)$ for $N$ blocks, attention scores $\times 1/d_\text{head}$, attention output
  $\times 1/3$, $\text{GELU}/1.1289$, unit-RMS token embeddings, RoPE, no biases, zero-init
  output projections and head. :meth:`GPT.lipschitz_weights` hands the weights to
  ``geomuon.theory.lipschitz.transformer_lipschitz_bound``.
* Attention q/k/v fused in one ``c_attn`` (GPT-2 layout, $[3d, d]$) or separate
  ``q``/``k``/``v``; tied or untied head.

Every module declares the *role* of each of its weights in ``ROLES`` (name → role);
``geomuon.optimizers.assign`` reads these declarations from the module tree instead of guessing
from parameter names.

Observables for the saturation mechanism proposed by the module-wise Manifold Muon study (softmax Jacobian vanishing as the
attention logits grow) are recorded only inside :meth:`GPT.observe`, on eval batches:
the attention path then materialises the score matrix (fp32) instead of calling the fused
kernel. Everything computes in the parameters' dtype (fp32), or bf16 under autocast, except the
router's softmax and the loss: fp32 then, float64 for a float64 model.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from geomuon.manifolds.linalg import fp32_or_fp64
from geomuon.pretrain.monitoring import nan_max

#: Layers that normalize their input: none is 1-Lipschitz on the input set the bound covers
#: (:meth:`GPT.lipschitz_weights` refuses a model that holds one)
_NORMALIZATIONS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._BatchNorm,
                   nn.modules.instancenorm._InstanceNorm)


def _of_kind(value, kind: str) -> bool:
    """Whether ``value`` is of the dataclass field type ``kind`` (``"int"``, ``"float"``,
    ``"bool"``, ``"str"``; an int is a float, a bool is no number)."""
    if isinstance(value, bool):
        return kind == "bool"
    return isinstance(value, {"int": int, "float": (int, float), "bool": bool, "str": str}[kind])


@dataclass(frozen=True)
class GPTConfig:
    """Shape and variant of a GPT: sizes, MLP kind (GELU/SwiGLU/MoE), LayerNorm or Lipschitz, head tying."""
    block_size: int = 1024  # context length
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    mlp: str = "gelu"  # "gelu" | "swiglu"
    mlp_hidden: int = 0  # 0: 4·n_embd for GELU, the 8/3·n_embd rounded to 64 for SwiGLU
    n_experts: int = 0  # 0: dense MLP; >0: mixture of experts with a linear router
    moe_top_k: int = 2
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss
    lipschitz: bool = False  # the Lipschitz variant (Newhouse et al. 2025) instead of pre-LayerNorm
    fused_qkv: bool = True  # one c_attn [3d, d] (GPT-2) or separate q, k, v
    rope: bool = False  # rotary positions instead of a learned position table
    tie_weights: bool = True
    bias: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        problems = [f"{f.name}={getattr(self, f.name)!r} must be {f.type}" for f in fields(self)
                    if not _of_kind(getattr(self, f.name), f.type)]
        if problems:  # the checks below compare values: a field of another type had crashed them
            raise ValueError("GPTConfig: " + "; ".join(problems))
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if problems:  # the checks below divide by n_head (n_head=0 had raised a bare ZeroDivisionError)
            raise ValueError("GPTConfig: " + "; ".join(problems))
        for name, least in (("mlp_hidden", 0), ("n_experts", 0)):
            if getattr(self, name) < least:
                problems.append(f"{name}={getattr(self, name)} must be >= {least}")
        if not (math.isfinite(self.moe_aux_weight) and self.moe_aux_weight >= 0):
            problems.append(f"moe_aux_weight={self.moe_aux_weight} must be a finite number >= 0")
        if not (math.isfinite(self.init_std) and self.init_std > 0):
            problems.append(f"init_std={self.init_std} must be a finite number > 0")
        if self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.mlp not in ("gelu", "swiglu"):
            problems.append(f"mlp={self.mlp!r} must be 'gelu' or 'swiglu'")
        if self.n_experts and not 1 <= self.moe_top_k <= self.n_experts:
            problems.append(f"moe_top_k={self.moe_top_k} must be in [1, n_experts={self.n_experts}]")
        if self.rope and (self.n_embd // self.n_head) % 2:
            problems.append("rope needs an even head dimension n_embd/n_head")
        if self.lipschitz and (self.tie_weights or self.bias):
            problems.append("the Lipschitz variant needs tie_weights=False and bias=False")
        if self.lipschitz and not self.rope:
            problems.append("the Lipschitz variant needs rope=True: a learned position table (rope=False) "
                            "moves the embedded tokens off unit RMS, outside the certified bound's domain")
        if self.lipschitz and self.fused_qkv:
            problems.append("the Lipschitz variant needs fused_qkv=False (separate q, k, v: the bound reads "
                            "each head's slices)")
        if self.lipschitz and (self.mlp != "gelu" or self.n_experts):
            problems.append("the Lipschitz variant needs mlp='gelu' and n_experts=0 (the certified bound "
                            "covers the dense GELU MLP only, not SwiGLU or a mixture of experts)")
        if problems:
            raise ValueError("GPTConfig: " + "; ".join(problems))

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return 64 * math.ceil(8 * self.n_embd / 3 / 64)


_LIPSCHITZ = dict(lipschitz=True, fused_qkv=False, rope=True, tie_weights=False, bias=False)

#: Named configurations. Character-level configs get ``vocab_size`` from the data.
CONFIGS: dict[str, GPTConfig] = {
    "gpt2-small": GPTConfig(),
    "gpt2-small-swiglu": GPTConfig(mlp="swiglu"),
    "shakespeare-lipschitz": GPTConfig(
        block_size=256, vocab_size=65, n_layer=3, n_head=4, n_embd=256, **_LIPSCHITZ
    ),
    "cpu-tiny": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=32),
    "cpu-small": GPTConfig(block_size=128, vocab_size=256, n_layer=4, n_head=4, n_embd=128),
    "cpu-swiglu": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=32, mlp="swiglu"),
    "cpu-moe": GPTConfig(
        block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=32, mlp="swiglu", n_experts=4
    ),
    "cpu-lipschitz": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=32, **_LIPSCHITZ),
    "demo": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64),
}


def get_config(name: str, **overrides) -> GPTConfig:
    """A named config with fields overridden.

    Raises ``ValueError`` for an unknown config name, an override that is no ``GPTConfig`` field,
    or one set to ``None`` (no field takes it: ``{"tie_weights": None}``, JSON's null, had been
    dropped without a word, the run recorded as overridden)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS)}")
    field_names = [f.name for f in fields(GPTConfig)]
    unknown = sorted(set(overrides) - set(field_names))
    if unknown:  # dataclasses.replace had raised a TypeError about GPTConfig.__init__
        raise ValueError(f"get_config({name!r}): {unknown} are no GPTConfig fields; choose from {field_names}")
    unset = sorted(k for k, v in overrides.items() if v is None)
    if unset:
        raise ValueError(f"get_config({name!r}): {unset} set to None, which no GPTConfig field takes; give "
                         f"each a value or leave it out for {name!r}'s own")
    return replace(CONFIGS[name], **overrides)


# --------------------------------------------------------------------------------------
# Attention


def rotary(x: torch.Tensor) -> torch.Tensor:
    r"""Rotary position embedding of ``x: [B, H, T, D]``: channels $(2i, 2i+1)$ of position
    $t = 0, 1, \dots$ rotated by $t\,\theta_i$, $\theta_i = 10000^{-2i/D}$,
    $(x_{2i}, x_{2i+1}) \mapsto (x_{2i}\cos t\theta_i - x_{2i+1}\sin t\theta_i,\;
    x_{2i}\sin t\theta_i + x_{2i+1}\cos t\theta_i)$; an isometry for each position.

    The angles are computed in float64 for a float64 ``x`` (float32 ones had left a float64
    rotation 1e-8 away from an isometry) and in float32 otherwise; returns ``x``'s dtype."""
    T, D = x.shape[-2], x.shape[-1]
    wide = fp32_or_fp64(x.dtype)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=wide) / D)
    angles = torch.arange(T, device=x.device, dtype=wide)[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


@dataclass
class AttentionRecord:
    """What one attention layer saw on the observed batches (running maxima/means)."""

    max_logit: float = -math.inf
    jacobian_sum: float = 0.0
    rows: int = 0

    @property
    def mean_jacobian_norm(self) -> float:
        return self.jacobian_sum / max(self.rows, 1)


def softmax_jacobian_frobenius(p: torch.Tensor) -> torch.Tensor:
    r"""$\|\operatorname{diag}(p) - pp^\top\|_F$ for each probability row of ``p``.

    $\|J\|_F^2 = \sum_i p_i^2 - 2\sum_i p_i^3 + (\sum_i p_i^2)^2$; it tends to 0 as the
    softmax saturates to a one-hot row (the vanishing-gradient regime the module-wise study proposes) and is
    at most $1/2$, reached by two entries of $1/2$: $\sum_i p_i^3 \ge (\sum_i p_i^2)^2$
    (Cauchy–Schwarz with weights $p_i$) gives $\|J\|_F^2 \le s - s^2 \le 1/4$ for
    $s = \sum_i p_i^2$. The three terms cancel near saturation (fp32 loses 5 digits at
    $\|J\|_F \approx 0.05$), so this computes in float64; returns float64 of shape
    ``p.shape[:-1]``.
    """
    p = p.double()
    s2 = (p * p).sum(-1)
    return (s2 - 2 * (p * p * p).sum(-1) + s2 * s2).clamp_min(0).sqrt()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection ``c_attn`` and output ``c_proj``."""
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.head_dim = d // config.n_head
        self.fused = config.fused_qkv
        if self.fused:
            self.c_attn = nn.Linear(d, 3 * d, bias=config.bias)
            self.ROLES = {"c_attn": "attn_qkv", "c_proj": "attn_o"}
        else:
            self.q = nn.Linear(d, d, bias=config.bias)
            self.k = nn.Linear(d, d, bias=config.bias)
            self.v = nn.Linear(d, d, bias=config.bias)
            self.ROLES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "c_proj": "attn_o"}
        self.c_proj = nn.Linear(d, d, bias=config.bias)
        self.rope = config.rope
        self.lipschitz = config.lipschitz
        # Lipschitz variant: 1/d_head instead of 1/sqrt(d_head) keeps the score map
        # Lipschitz with a dimension-free constant (Newhouse et al. 2025).
        self.scale = 1.0 / self.head_dim if config.lipschitz else 1.0 / math.sqrt(self.head_dim)
        self.record: AttentionRecord | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        if self.fused:
            q, k, v = self.c_attn(x).split(C, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.rope:
            q, k = rotary(q), rotary(k)
        if self.record is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            y = self._observed_attention(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.c_proj(y)
        return y / 3.0 if self.lipschitz else y

    def _observed_attention(self, q, k, v):
        # the metrics in fp32 under evaluation's bf16 autocast too, and in fp64 for a float64 model
        # (a cast to fp32 had made its evaluation fp32's)
        wide = fp32_or_fp64(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            T = q.size(-2)
            scores = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * self.scale
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, -math.inf)
            record = self.record
            record.max_logit = nan_max((record.max_logit, scores.max().item()))  # a NaN logit stays visible
            p = scores.softmax(dim=-1)
            jac = softmax_jacobian_frobenius(p)
            record.jacobian_sum += jac.sum().item()
            record.rows += jac.numel()
            return (p @ v.to(wide)).to(v.dtype)


# --------------------------------------------------------------------------------------
# MLPs


class MLP(nn.Module):
    """GELU MLP (``c_fc`` → GELU → ``c_proj``); the Lipschitz variant divides GELU by
    1.1289, its Lipschitz constant 1.1289041 rounded down, so the scaled GELU is
    1.0000037-Lipschitz and the block's bound is $1.0000037\\,\\|W_{out}\\|\\|W_{in}\\|$
    (:func:`geomuon.theory.lipschitz.mlp_lipschitz`)."""

    ROLES = {"c_fc": "mlp_in", "c_proj": "mlp_out"}

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.hidden, config.n_embd, bias=config.bias)
        self.gelu_scale = 1 / 1.1289 if config.lipschitz else 1.0

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)) * self.gelu_scale)


class SwiGLU(nn.Module):
    r"""$W_\text{down}\,(\text{SiLU}(W_\text{gate}x) \odot W_\text{up}x)$."""

    ROLES = {"w_gate": "mlp_gate", "w_up": "mlp_up", "w_down": "mlp_down"}

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.n_embd, config.hidden, bias=config.bias)
        self.w_up = nn.Linear(config.n_embd, config.hidden, bias=config.bias)
        self.w_down = nn.Linear(config.hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def dense_mlp(config: GPTConfig) -> nn.Module:
    """The dense MLP the config asks for: SwiGLU or GELU."""
    return SwiGLU(config) if config.mlp == "swiglu" else MLP(config)


class MoE(nn.Module):
    r"""Mixture of experts: a linear router ``[n_experts, d]`` (experts on rows), top-$k$
    gating renormalised over the chosen experts, and the Switch load-balancing loss
    $\text{aux} = E\sum_e f_e P_e$ ($f_e$: fraction of routing slots sent to expert $e$,
    $P_e$: mean router probability), left in ``self.aux_loss`` after each forward."""

    ROLES = {"router": "router"}

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k = config.moe_top_k
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = nn.ModuleList(dense_mlp(config) for _ in range(config.n_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x):
        B, T, C = x.shape
        tokens = x.reshape(-1, C)
        # routing in fp32 under a bf16 autocast, in float64 for a float64 model
        probs = self.router(tokens).to(fp32_or_fp64(x.dtype)).softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            # every expert runs, an empty one on a [0, C] batch: its parameters then get a zero
            # gradient, so every process of a sharded run (FSDP2 reduce-scatters a block's
            # gradients as one buffer) joins the same collectives whatever its tokens
            token_idx, slot = (top_i == e).nonzero(as_tuple=True)
            out.index_add_(0, token_idx, expert(tokens[token_idx]) * top_p[token_idx, slot, None])
        n_experts = len(self.experts)
        routed_fraction = F.one_hot(top_i, n_experts).to(probs.dtype).sum(1).mean(0) / self.top_k
        self.aux_loss = n_experts * (routed_fraction * probs.mean(0)).sum()
        return out.view(B, T, C)


# --------------------------------------------------------------------------------------
# Blocks and the model


class Block(nn.Module):
    """One transformer block: attention then MLP, pre-LayerNorm or Lipschitz residuals."""
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.lipschitz = config.lipschitz
        if not config.lipschitz:
            self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        # a = 1/(2N): the residual is a convex combination, so the block's Lipschitz
        # constant is (1 - a) + a·L_f (docs: concepts/lipschitz).
        self.residual_weight = 1.0 / (2 * config.n_layer)
        self.attn = CausalSelfAttention(config)
        self.mlp = MoE(config) if config.n_experts else dense_mlp(config)

    def forward(self, x):
        if self.lipschitz:
            a = self.residual_weight
            x = (1 - a) * x + a * self.attn(x)
            return (1 - a) * x + a * self.mlp(x)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The GPT language model (nanoGPT layout): embeddings, blocks, LM head; ``forward(idx, targets)``."""
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if config.rope else nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = None if config.lipschitz else nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.ROLES = {"wte": "embedding", "wpe": "embedding", "lm_head": "lm_head"}
        self.apply(self._init_weights)
        n_residual = 2 * config.n_layer
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "w_down.weight")):
                if config.lipschitz:
                    nn.init.zeros_(p)
                else:  # GPT-2: scale residual projections by 1/sqrt(number of residual adds)
                    nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(n_residual))
        if config.lipschitz:
            nn.init.zeros_(self.lm_head.weight)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors once); ``non_embedding`` drops the tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.config.lipschitz:  # unit RMS per token: the input has norm sqrt(d)
            # at least fp32 (bf16 tables), float64 when the model is: the certified bound's
            # domain is token RMS <= 1, which a float32 normalisation misses by ~6e-8
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            x = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True).clamp_min(1e-12))).to(x.dtype)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        return x

    def _check_token_ids(self, name: str, tokens: torch.Tensor) -> None:
        r"""Refuses ``tokens`` (``idx`` or ``targets``) unless it is an integer ``[B, T]`` tensor
        with $1 \le T \le$ ``block_size`` and, on the CPU, ids in $[0, V)$: the embedding and the
        cross-entropy had failed with "index out of range in self" or "Dimension out of range"
        (or refused int16/int32 ids), and an empty sequence had given a NaN loss. Ids on an
        accelerator are not read back (that would synchronise the host every step; the data
        loaders check the ids they read)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.is_complex() \
                or tokens.dtype == torch.bool:
            kind = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"GPT.forward: {name} must be an integer tensor of token ids, got {kind}")
        if tokens.dim() != 2 or tokens.size(1) == 0:
            raise ValueError(f"GPT.forward: {name} of shape {list(tokens.shape)} must be [batch, sequence length] "
                             "with a sequence length of at least 1")
        if tokens.size(1) > self.config.block_size:
            raise ValueError(f"GPT.forward: {name}'s sequence length {tokens.size(1)} exceeds the model's block_size "
                             f"{self.config.block_size}; crop it to the last {self.config.block_size} tokens")
        if tokens.device.type == "cpu" and tokens.numel():
            low, high = (bound.item() for bound in torch.aminmax(tokens))  # one pass
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"GPT.forward: {name} holds token ids from {low} to {high}, outside "
                                 f"[0, vocab_size={self.config.vocab_size})")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits ``[B, T, V]`` and, with ``targets`` (the ids of ``idx``'s shape), the mean
        cross-entropy (plus the MoE load-balancing term ``moe_aux_weight``·Σ aux during
        training), in float32 (float64 for a float64 model).

        Raises ``ValueError`` for ids that are not an integer ``[B, T]`` tensor, a sequence
        longer than ``block_size`` or empty, ``targets`` of another shape, and (CPU) ids
        outside ``[0, vocab_size)``."""
        self._check_token_ids("idx", idx)
        idx = idx.long()  # any integer dtype (the embedding takes int32/int64 only, the cross-entropy int64)
        if targets is not None:
            self._check_token_ids("targets", targets)
            if targets.shape != idx.shape:
                raise ValueError(f"GPT.forward: targets of shape {list(targets.shape)} must have idx's shape "
                                 f"{list(idx.shape)} (the next token of each position)")
            targets = targets.long()
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        # fp32 under a bf16 autocast, float64 for a float64 model (a .float() had cast its loss to fp32)
        loss = F.cross_entropy(logits.to(fp32_or_fp64(logits.dtype)).view(-1, logits.size(-1)), targets.reshape(-1))
        if self.config.n_experts and self.training:
            aux = sum(block.mlp.aux_loss for block in self.h)
            loss = loss + self.config.moe_aux_weight * aux
        return logits, loss

    # ---------------------------------------------------------------- observables

    def attention_layers(self) -> dict[str, CausalSelfAttention]:
        return {f"h.{i}.attn": block.attn for i, block in enumerate(self.h)}

    @contextlib.contextmanager
    def observe(self):
        """Record per-layer attention statistics while inside the context.

        Yields ``{layer name: AttentionRecord}``; the max attention logit and the mean
        softmax-Jacobian Frobenius norm over every causal row seen. Raises ``RuntimeError``
        inside another ``observe()`` of the same model: the inner context's exit had detached
        the outer one's records, which then silently stopped recording."""
        layers = self.attention_layers()
        if any(layer.record is not None for layer in layers.values()):
            raise RuntimeError("GPT.observe(): the model is already being observed; use the records of the "
                               "enclosing observe() context instead of nesting another")
        records = {name: AttentionRecord() for name in layers}
        for name, layer in layers.items():
            layer.record = records[name]
        try:
            yield records
        finally:
            for layer in layers.values():
                layer.record = None

    def _blocks_share(self, name: str, read) -> float:
        """The value ``read(block)`` every block has (the certified bound takes one per model),
        refused by ``name`` where the blocks differ."""
        values = [read(block) for block in self.h]
        if len(set(values)) > 1:
            raise ValueError(f"lipschitz_weights(): the blocks' {name} differ ("
                             + ", ".join(f"block {i}: {v!r}" for i, v in enumerate(values))
                             + f"); the certified bound takes one {name} for every block: set them equal")
        return values[0]

    def lipschitz_weights(self) -> dict:
        """The weights the certified Lipschitz bound needs (Lipschitz variant only).

        Returns ``{"blocks": [{"q", "k", "v", "o", "mlp_in", "mlp_out"}: [out, in]
        tensors], "head": [V, d], "residual_weight": a, "attention_scale": 1/3,
        "score_scale": 1/d_head, "gelu_scale": 1/1.1289, "n_embd": d, "n_head": H, "input_radius": 1}``
        (``a``, the score and GELU scales and the attention output's scale as the blocks hold them
        — 1/3 while ``attn.lipschitz`` — one value each, refused where the blocks differ)
        (:meth:`embed` gives every token RMS exactly 1); tensors are the live parameters
        (detach before modifying).

        Raises ``ValueError`` naming every option the bound does not cover: LayerNorm
        blocks, a learned position table, fused QKV, biases, SwiGLU, a mixture of experts,
        a tied head."""
        c = self.config
        uncovered = {
            "lipschitz=False (LayerNorm blocks)": not c.lipschitz,
            "rope=False (a learned position table)": not c.rope or self.wpe is not None,
            "fused_qkv=True": c.fused_qkv,
            # modules read as they are, not as the config built them: a LayerNorm or a bias attached
            # after construction runs in forward, and had left the bound unchanged (a final
            # LayerNorm: estimate 123.9 against a "bound" of 1.28)
            "a normalization module (ln_f, or a norm layer added after construction)": c.lipschitz and (
                self.ln_f is not None or any(isinstance(m, _NORMALIZATIONS) for m in self.modules())),
            "bias=True (or a Linear bias added after construction)": c.bias or any(
                isinstance(m, nn.Linear) and m.bias is not None for m in self.modules()),
            f"mlp={c.mlp!r} (only 'gelu')": c.mlp != "gelu",
            f"n_experts={c.n_experts} (mixture of experts)": bool(c.n_experts),
            "tie_weights=True": c.tie_weights,
        }
        refused = [option for option, present in uncovered.items() if present]
        if refused:
            raise ValueError(
                "lipschitz_weights() needs the Lipschitz variant as certified; the bound does not cover "
                + ", ".join(refused)
                + "; build the model with get_config('cpu-lipschitz') or GPTConfig(lipschitz=True, "
                "rope=True, fused_qkv=False, bias=False, tie_weights=False, mlp='gelu', n_experts=0)"
            )
        # the constants forward uses, read from the modules (a model edited after construction had
        # been certified with the config's: attn.scale = 4 gave an estimate 12x its "bound")
        residual_weight, score_scale, gelu_scale, attention_scale = (self._blocks_share(name, read) for name, read in (
            ("residual_weight", lambda b: b.residual_weight), ("attn.scale", lambda b: b.attn.scale),
            ("mlp.gelu_scale", lambda b: b.mlp.gelu_scale),
            # (attn.lipschitz = False undoes the 1/3: it had been reported, a "bound" 4.2 under an estimate 5.1)
            ("attention output scale (attn.lipschitz)", lambda b: 1.0 / 3.0 if b.attn.lipschitz else 1.0)))
        blocks = [
            {
                "q": b.attn.q.weight,
                "k": b.attn.k.weight,
                "v": b.attn.v.weight,
                "o": b.attn.c_proj.weight,
                "mlp_in": b.mlp.c_fc.weight,
                "mlp_out": b.mlp.c_proj.weight,
            }
            for b in self.h
        ]
        return {
            "blocks": blocks,
            "head": self.lm_head.weight,
            "residual_weight": residual_weight,
            "attention_scale": attention_scale,
            "score_scale": score_scale,
            "gelu_scale": gelu_scale,
            "n_embd": self.config.n_embd,
            "n_head": self.config.n_head,
            "input_radius": 1.0,
        }
