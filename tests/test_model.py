"""The GPT of ``geomuon.pretrain.model``: sizes, variants, observables, bad configs."""

import contextlib
import math
import re
from dataclasses import replace

import pytest
import torch

from geomuon.pretrain.model import CONFIGS, GPT, GPTConfig, MoE, get_config, rotary, softmax_jacobian_frobenius

EPS64 = torch.finfo(torch.float64).eps


def test_gpt2_small_has_124m_parameters():
    config = get_config("gpt2-small")
    model = GPT(config)
    V, T, d, L = config.vocab_size, config.block_size, config.n_embd, config.n_layer
    # tied embedding/head + positions + per block (qkv 3d², proj d², fc 4d², proj 4d², 2 LN gains) + ln_f
    expected = V * d + T * d + L * (12 * d * d + 2 * d) + d
    assert model.num_params() == expected == 124_373_760
    assert round(model.num_params() / 1e6) == 124


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-swiglu", "cpu-moe", "cpu-lipschitz"])
def test_small_configs_forward_backward(name):
    torch.manual_seed(0)
    model = GPT(get_config(name))
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, model.config.vocab_size)
    loss.backward()
    # every weight that the loss reaches at initialisation gets a finite gradient
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_shakespeare_lipschitz_config_matches_seed_003():
    c = CONFIGS["shakespeare-lipschitz"]
    assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.lipschitz) == (3, 256, 4, 256, True)


def test_lipschitz_variant_starts_at_uniform_prediction():
    # Zero-init head → all logits 0 → loss exactly log V; a LayerNorm GPT is not (control).
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 32))
    lipschitz = GPT(get_config("cpu-lipschitz"))
    assert lipschitz(idx, idx)[1].item() == pytest.approx(math.log(256), abs=1e-6)
    assert abs(GPT(get_config("cpu-tiny"))(idx, idx)[1].item() - math.log(256)) > 1e-4


def test_lipschitz_residual_and_embedding():
    torch.manual_seed(0)
    model = GPT(get_config("cpu-lipschitz"))
    idx = torch.randint(0, 256, (3, 10))
    x = model.embed(idx)
    torch.testing.assert_close(x.pow(2).mean(-1), torch.ones(3, 10), rtol=1e-5, atol=0)
    # zero-init output projections: each block returns (1 - a)^2 x
    a = 1 / (2 * model.config.n_layer)
    torch.testing.assert_close(model.h[0](x), (1 - a) ** 2 * x, rtol=1e-6, atol=1e-7)
    weights = model.lipschitz_weights()
    assert len(weights["blocks"]) == model.config.n_layer and weights["residual_weight"] == a
    with pytest.raises(ValueError, match="Lipschitz variant"):
        GPT(get_config("cpu-tiny")).lipschitz_weights()


def test_lipschitz_weights_report_the_residual_weight_the_blocks_use():
    # forward reads each block's residual_weight: an edited one is what the bound must take
    model = GPT(get_config("cpu-lipschitz"))
    for block in model.h:
        block.residual_weight = 0.4
    assert model.lipschitz_weights()["residual_weight"] == 0.4
    model.h[0].residual_weight = 0.3  # one weight per model in the bound: blocks that differ are refused
    with pytest.raises(ValueError, match=r"residual_weight differ \(block 0: 0.3, block 1: 0.4"):
        model.lipschitz_weights()


@pytest.mark.parametrize("name, edit, key, value", [
    ("attn.scale", lambda b: setattr(b.attn, "scale", 4.0), "score_scale", 4.0),
    ("mlp.gelu_scale", lambda b: setattr(b.mlp, "gelu_scale", 60.0), "gelu_scale", 60.0),
    # forward divides the attention's output by 3 only while attn.lipschitz (a bound under the estimate)
    ("attention output scale (attn.lipschitz)", lambda b: setattr(b.attn, "lipschitz", False), "attention_scale", 1.0),
])
def test_lipschitz_weights_report_the_scales_the_blocks_use(name, edit, key, value):
    # the config's scales had been reported for a model whose blocks were edited: the bound of
    # the unedited network (an estimate 12x (attn.scale = 4) or 17x (gelu_scale = 60) above it)
    model = GPT(get_config("cpu-lipschitz"))
    for block in model.h:
        edit(block)
    assert model.lipschitz_weights()[key] == value
    model.h[1] = GPT(get_config("cpu-lipschitz")).h[1]  # one block as built: they differ
    with pytest.raises(ValueError, match=rf"the blocks' {re.escape(name)} differ"):
        model.lipschitz_weights()


def test_rotary_is_an_isometry_and_depends_on_position():
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    y = rotary(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[..., 0, :], x[..., 0, :])  # position 0: angle 0
    assert not torch.allclose(y[..., 1:, :], x[..., 1:, :])


def test_softmax_jacobian_norm_matches_autograd():
    torch.manual_seed(0)
    logits = torch.randn(5, 9, dtype=torch.float64) * 3
    p = logits.softmax(-1)
    for row, prob in zip(logits, p):
        J = torch.autograd.functional.jacobian(lambda z: z.softmax(-1), row)
        # float64 throughout; the formula's cancellation costs at most ~1/‖J‖² ≈ 10³ ulps
        assert softmax_jacobian_frobenius(prob).item() == pytest.approx(J.norm().item(), rel=1e-11)
    one_hot = torch.zeros(4)
    one_hot[1] = 1
    assert softmax_jacobian_frobenius(one_hot).item() == 0.0  # saturated softmax: no gradient


def test_observe_records_attention_logits():
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny")).eval()
    idx = torch.randint(0, 256, (2, 12))
    plain, _ = model(idx)
    with model.observe() as records:
        observed, _ = model(idx)
    # the materialised attention computes the same function as the fused kernel (fp32)
    torch.testing.assert_close(observed, plain, rtol=1e-5, atol=1e-5)
    attn = model.h[0].attn
    x = model.h[0].ln_1(model.embed(idx))
    q, k, _ = attn.c_attn(x).split(model.config.n_embd, dim=2)
    q = q.view(2, 12, attn.n_head, -1).transpose(1, 2)
    k = k.view(2, 12, attn.n_head, -1).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) * attn.scale
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -math.inf)
    assert records["h.0.attn"].max_logit == pytest.approx(scores.max().item(), rel=1e-6)
    assert 0 < records["h.0.attn"].mean_jacobian_norm <= 0.5  # the bound of softmax_jacobian_frobenius
    assert all(layer.record is None for layer in model.attention_layers().values())


def test_observed_attention_metrics_stay_fp32_under_a_bf16_autocast():
    # evaluation runs the model under autocast on a GPU: from the same fp32 q, k, v the logit and
    # Jacobian metrics and the output must be the fp32 ones (bf16 scores move them by ~2^-8)
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny")).eval()
    attn = model.h[0].attn
    q, k, v = (torch.randn(2, attn.n_head, 12, model.config.n_embd // attn.n_head) for _ in range(3))
    results = []
    for context in (contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16)):
        with model.observe() as records, context:
            y = attn._observed_attention(q, k, v)
        record = records["h.0.attn"]
        results.append((y, record.max_logit, record.mean_jacobian_norm))
    (y, logit, jacobian), (y_auto, logit_auto, jacobian_auto) = results
    assert y_auto.dtype == torch.float32 and torch.equal(y_auto, y)
    assert logit_auto == logit and jacobian_auto == jacobian


def test_observed_attention_of_a_float64_model_is_float64():
    # a float64 model's observed forward must be the plain float64 forward: the metrics had cast
    # q, k, v to fp32 (1e-9 apart). Tolerance: the two paths differ by the order of their fp64
    # operations, about eps = 2.2e-16 per operation over ~1e3 accumulated ones; fp32's eps
    # (1.2e-7) is 5e5 times larger, so 1e-12 separates them.
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny")).double().eval()
    idx = torch.randint(0, 256, (2, 12))
    plain, _ = model(idx)
    with model.observe():
        observed, _ = model(idx)
    assert observed.dtype == torch.float64
    assert (observed - plain).abs().max() <= 1e-12


def test_moe_balanced_router_has_unit_aux_loss():
    # Zero router → uniform probabilities P_e = 1/E and Σ f_e = 1 → aux = E Σ f_e / E = 1.
    config = get_config("cpu-moe")
    moe = MoE(config)
    torch.nn.init.zeros_(moe.router.weight)
    moe(torch.randn(2, 8, config.n_embd))
    assert moe.aux_loss.item() == pytest.approx(1.0, abs=1e-6)
    torch.nn.init.normal_(moe.router.weight, std=5.0)  # a skewed router pays more
    moe(torch.randn(2, 8, config.n_embd))
    assert moe.aux_loss.item() > 1.0


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    # an expert skipped for want of tokens had no gradient on that process: FSDP2 reduce-scatters a
    # block's gradients as one buffer, so the processes passed buffers of different sizes (a gloo
    # abort; on NCCL a hang or a wrong sum); every expert runs now, an empty one on a [0, C] batch
    config = get_config("cpu-moe")
    moe = MoE(config)
    x = torch.rand(2, 8, config.n_embd) + 0.1  # positive inputs: a router row's logit grows with its scale
    with torch.no_grad():  # logits ordered expert 0 > 1 > … for every token: only the top_k first get tokens
        moe.router.weight.copy_(torch.arange(config.n_experts, 0, -1.0)[:, None].expand(-1, config.n_embd))
    moe(x).square().sum().backward()
    for e, expert in enumerate(moe.experts):
        for name, p in expert.named_parameters():
            assert p.grad is not None, f"expert {e} {name}"
            assert (p.grad.abs().sum() > 0) == (e < config.moe_top_k), f"expert {e} {name}"


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="unknown model config 'nope'"):
        get_config("nope")
    with pytest.raises(ValueError, match="tie_weights=False"):
        GPTConfig(lipschitz=True)
    model = GPT(get_config("cpu-tiny"))
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


# --------------------------------------------------------------------------------------
# An independent float64 reference, written from the formulas of the module docstring


def reference_rotary(x):
    """RoPE as one rotation matrix per position: block diagonal, block i rotating channels
    (2i, 2i+1) of position t by t·10000^(-2i/D), angles from Python's float64 math."""
    T, D = x.shape[-2:]
    rotations = torch.zeros(T, D, D, dtype=torch.float64)
    for t in range(T):
        for i in range(D // 2):
            angle = t * 10000.0 ** (-2 * i / D)
            c, s = math.cos(angle), math.sin(angle)
            rotations[t, 2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    return torch.einsum("tij,...tj->...ti", rotations, x)


def reference_linear(layer, x):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def reference_layer_norm(layer, x):
    centred = x - x.mean(-1, keepdim=True)
    y = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.weight
    return y + (layer.bias if layer.bias is not None else 0)


def reference_attention(attn, config, x):
    """softmax(q kᵀ·scale + causal mask) v per head, scale 1/sqrt(d_head) (1/d_head and the
    output divided by 3 in the Lipschitz variant)."""
    B, T, d = x.shape
    H, D = config.n_head, d // config.n_head
    if config.fused_qkv:  # GPT-2 layout: rows [q; k; v] of c_attn
        q, k, v = reference_linear(attn.c_attn, x).split(d, dim=-1)
    else:
        q, k, v = (reference_linear(layer, x) for layer in (attn.q, attn.k, attn.v))
    q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v))
    if config.rope:
        q, k = reference_rotary(q), reference_rotary(k)
    scale = 1 / D if config.lipschitz else 1 / math.sqrt(D)
    later = torch.ones(T, T, dtype=torch.bool).triu(1)
    weights = (q @ k.transpose(-1, -2) * scale).masked_fill(later, -math.inf).softmax(-1)
    y = reference_linear(attn.c_proj, (weights @ v).transpose(1, 2).reshape(B, T, d))
    return y / 3 if config.lipschitz else y


def reference_dense_mlp(mlp, config, x):
    """W_down(SiLU(W_gate x) ⊙ W_up x), or c_proj(GELU(c_fc x)) with the exact (erf) GELU,
    divided by 1.1289 in the Lipschitz variant."""
    if config.mlp == "swiglu":
        gate = reference_linear(mlp.w_gate, x)
        return reference_linear(mlp.w_down, gate * torch.sigmoid(gate) * reference_linear(mlp.w_up, x))
    z = reference_linear(mlp.c_fc, x)
    gelu = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    return reference_linear(mlp.c_proj, gelu / (1.1289 if config.lipschitz else 1.0))


def reference_moe(moe, config, x):
    """Token by token: the top-k router probabilities renormalised weight the chosen experts;
    aux = E Σ_e f_e P_e with f_e the fraction of the N·k routing slots sent to e and P_e the
    mean router probability."""
    d, E, k = x.shape[-1], config.n_experts, config.moe_top_k
    tokens = x.reshape(-1, d)
    probs = (tokens @ moe.router.weight.T).softmax(-1)
    out = torch.zeros_like(tokens)
    slots = torch.zeros(E, dtype=torch.float64)
    for n, (token, p) in enumerate(zip(tokens, probs)):
        chosen = sorted(range(E), key=lambda e: -p[e].item())[:k]
        total = sum(p[e] for e in chosen)
        for e in chosen:
            out[n] += p[e] / total * reference_dense_mlp(moe.experts[e], config, token[None])[0]
            slots[e] += 1
    aux = E * (slots / (len(tokens) * k) * probs.mean(0)).sum()
    return out.reshape(x.shape), aux


def reference_gpt(model, idx, targets):
    """Logits and the training loss (mean cross-entropy + moe_aux_weight·Σ aux) of ``model``."""
    config = model.config
    x = model.wte.weight[idx]
    if config.lipschitz:
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    if not config.rope:
        x = x + model.wpe.weight[: idx.size(1)]
    aux_losses = []

    def mlp(block, h):
        if not config.n_experts:
            return reference_dense_mlp(block.mlp, config, h)
        out, aux = reference_moe(block.mlp, config, h)
        aux_losses.append(aux)
        return out

    for block in model.h:
        if config.lipschitz:
            a = 1 / (2 * config.n_layer)
            x = (1 - a) * x + a * reference_attention(block.attn, config, x)
            x = (1 - a) * x + a * mlp(block, x)
        else:
            x = x + reference_attention(block.attn, config, reference_layer_norm(block.ln_1, x))
            x = x + mlp(block, reference_layer_norm(block.ln_2, x))
    if not config.lipschitz:
        x = reference_layer_norm(model.ln_f, x)
    logits = x @ model.lm_head.weight.T
    log_probs = logits - logits.logsumexp(-1, keepdim=True)
    loss = -log_probs.gather(-1, targets[..., None]).mean() + config.moe_aux_weight * sum(aux_losses)
    return logits, loss


SMALL_CONFIGS = [name for name in CONFIGS if not name.startswith("gpt2")]
#: every switch the catalogue's small configs leave at one value, flipped on a LayerNorm model
VARIANTS = [dict(rope=True, fused_qkv=False, bias=True, tie_weights=False),
            dict(n_experts=3, moe_top_k=1, mlp="gelu", bias=True)]
VARIANT_CASES = [(name, {}) for name in SMALL_CONFIGS] + [("cpu-tiny", variant) for variant in VARIANTS]


def random_float64_model(config, seed):
    """``GPT(config)`` in float64 with every parameter drawn at std 0.3 (the Lipschitz variant's zero
    initialisation would leave its attention, MLP and head untested)."""
    torch.manual_seed(seed)
    model = GPT(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


@pytest.mark.parametrize("name, overrides", VARIANT_CASES)
def test_forward_matches_a_float64_reference(name, overrides):
    # RoPE's angles, the MoE routing and the loss had been computed in float32 for a float64 model
    # (errors 5e-9 to 1e-3 on these logits, 5e-7 on the loss). Tolerance: every output is a
    # composition of 2·n_layer + 1 sub-layers of inner products of length <= 1024 = 2^10 (the
    # Shakespeare MLP), each within n·eps of the sum of its absolute terms (Higham's gamma_n), which
    # are at most the largest |logit| times the softmax/LayerNorm gains O(1) here: 2^12·eps relative
    # to that scale leaves a 2^2 margin for the gains (measured: at most 110·eps), and float32
    # (2^29 times eps) stays far outside.
    config = replace(get_config(name, **overrides), block_size=12)
    model = random_float64_model(config, seed=1).train()
    gen = torch.Generator().manual_seed(2)
    idx, targets = (torch.randint(0, config.vocab_size, (2, 7), generator=gen) for _ in range(2))
    logits, loss = model(idx, targets)
    expected_logits, expected_loss = reference_gpt(model, idx, targets)
    scale = expected_logits.abs().max().item()
    assert logits.dtype == loss.dtype == torch.float64
    assert (logits - expected_logits).abs().max().item() <= 2**12 * EPS64 * scale
    assert abs(loss.item() - expected_loss.item()) <= 2**12 * EPS64 * scale


@pytest.mark.parametrize("name, overrides", VARIANT_CASES)
def test_output_at_t_ignores_the_tokens_after_t(name, overrides):
    # Changing the tokens from position 4 on leaves the logits of positions 0..3 where they were:
    # exactly for dense blocks (the same float64 arithmetic per row), and within the round-off of
    # the MoE's expert batches (which regroup when later tokens route elsewhere: a few eps of the
    # largest logit). The later logits do change (the control).
    config = get_config(name, **overrides)
    model = random_float64_model(config, seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    idx = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    changed = idx.clone()
    changed[:, 4:] = (idx[:, 4:] + 1 + torch.randint(0, config.vocab_size - 1, (2, 5), generator=gen)) % config.vocab_size
    before, after = model(idx)[0], model(changed)[0]
    tolerance = 2**4 * EPS64 * before.abs().max().item() if config.n_experts else 0.0
    assert (after[:, :4] - before[:, :4]).abs().max().item() <= tolerance
    assert (after[:, 4:] - before[:, 4:]).abs().max().item() > 1e-3


def test_rotary_is_the_rotation_by_position_times_frequency_in_float64():
    # float32 angles had left a float64 rotation 1.4e-8 from an isometry at 300 positions.
    # Tolerance: the angles t·θ_i < 300 are within 300·eps of exact, so cos/sin (and each
    # rotated pair, a 2-term sum) within ~2^10·eps of the reference; norms likewise.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 300, 8, dtype=torch.float64, generator=gen)
    y = rotary(x)
    assert y.dtype == torch.float64
    assert (y - reference_rotary(x)).abs().max().item() <= 2**10 * EPS64 * x.abs().max().item()
    assert ((y.norm(dim=-1) - x.norm(dim=-1)).abs() / x.norm(dim=-1)).max().item() <= 2**10 * EPS64


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_routing_and_load_balancing_loss_match_a_reference(top_k):
    # top-k renormalised gating and aux = E Σ f_e P_e, token by token in float64 (the router had
    # computed its probabilities in float32: 7e-8 off). Tolerance: inner products of length <= 128
    # (Higham's gamma_n <= 2^7 eps of their absolute sums, <= the output scale here) and a softmax
    # over 4 logits: 2^10·eps of the largest output.
    config = get_config("cpu-moe", moe_top_k=top_k)
    torch.manual_seed(5)
    moe = MoE(config).double()
    with torch.no_grad():
        moe.router.weight.normal_(std=1.0)  # a skewed router: aux > 1
    x = torch.randn(2, 6, config.n_embd, dtype=torch.float64)
    out = moe(x)
    expected, expected_aux = reference_moe(moe, config, x)
    assert out.dtype == moe.aux_loss.dtype == torch.float64
    assert (out - expected).abs().max().item() <= 2**10 * EPS64 * expected.abs().max().item()
    assert abs(moe.aux_loss.item() - expected_aux.item()) <= 2**10 * EPS64 * expected_aux.item()
    if top_k == config.n_experts:  # every expert gets every token: f_e = 1/E, aux = Σ_e P_e = 1
        assert moe.aux_loss.item() == pytest.approx(1.0, abs=2**4 * EPS64)


def expected_parameter_count(config):
    """Parameters by formula: tables, per block attention 4d² (+4d biases), the MLP, the norms."""
    V, T, d, L, h = config.vocab_size, config.block_size, config.n_embd, config.n_layer, config.hidden
    bias = config.bias
    attention = 4 * d * d + (4 * d if bias else 0)
    dense = (2 * d * h + (h + d if bias else 0)) if config.mlp == "gelu" else (3 * d * h + (2 * h + d if bias else 0))
    mlp = config.n_experts * dense + config.n_experts * d if config.n_experts else dense
    norms = 0 if config.lipschitz else (2 if bias else 1) * d * (2 * L + 1)
    tables = V * d + (0 if config.rope else T * d) + (0 if config.tie_weights else V * d)
    return tables + L * (attention + mlp) + norms


@pytest.mark.parametrize("name, overrides", VARIANT_CASES + [("gpt2-small-swiglu", {})])
def test_parameter_counts_follow_the_shapes(name, overrides):
    config = get_config(name, **overrides)
    with torch.device("meta"):  # shapes only: GPT-2 small's 124M weights need no memory
        model = GPT(config)
    assert model.num_params() == expected_parameter_count(config)
    assert (model.lm_head.weight is model.wte.weight) == config.tie_weights


def test_initialisation_is_determined_by_the_seed():
    config = get_config("cpu-small")
    torch.manual_seed(7)
    first = GPT(config).state_dict()
    torch.manual_seed(7)
    again = GPT(config).state_dict()
    torch.manual_seed(8)
    other = GPT(config).state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["h.0.attn.c_attn.weight"], other["h.0.attn.c_attn.weight"])
    # residual projections at init_std/sqrt(2·n_layer), the rest at init_std: the sample std of n
    # normal draws is within 5/sqrt(2n) relative of the true one except with probability 6e-7
    for key, std in (("h.0.attn.c_proj.weight", config.init_std / math.sqrt(2 * config.n_layer)),
                     ("h.0.mlp.c_fc.weight", config.init_std), ("wte.weight", config.init_std)):
        assert first[key].std().item() == pytest.approx(std, rel=5 / math.sqrt(2 * first[key].numel()))


def test_lipschitz_gelu_scale_is_gelu_slope_maximum_rounded_down():
    # The docstring: max GELU' = GELU'(sqrt 2) = 1.1289041..., so GELU/1.1289 is 1.0000037-Lipschitz.
    # GELU'(z) = Φ(z) + z φ(z), float64 to a few eps; GELU'' = φ(z)(2 - z²) vanishes at sqrt 2.
    def gelu_slope(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2))) + z * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)

    peak = gelu_slope(math.sqrt(2))
    assert all(gelu_slope(math.sqrt(2) + step) < peak for step in (-1e-3, 1e-3, -1.0, 1.0))
    assert round(peak, 7) == 1.1289041 and round(peak / 1.1289, 7) == 1.0000037
    model = GPT(get_config("cpu-lipschitz"))
    assert model.h[0].mlp.gelu_scale == 1 / 1.1289


def test_softmax_jacobian_norm_is_at_most_one_half():
    # ‖diag(p) − ppᵀ‖_F <= 1/2 (the docstring's Cauchy–Schwarz argument; it had claimed 1/sqrt(2)),
    # reached at two entries of 1/2; float64, so within a few eps of the bound.
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(4000, 5, dtype=torch.float64, generator=gen) * 3).softmax(-1)
    assert softmax_jacobian_frobenius(p).max().item() <= 0.5 + 4 * EPS64
    half = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert softmax_jacobian_frobenius(half).item() == pytest.approx(0.5, abs=4 * EPS64)


def test_gptconfig_refuses_zero_heads_with_a_message():
    # n_head=0 had raised a bare ZeroDivisionError from the divisibility check
    with pytest.raises(ValueError, match="n_head=0 must be positive"):
        GPTConfig(n_head=0)
    with pytest.raises(ValueError, match="n_head=0 must be positive"):
        GPTConfig(n_head=0, rope=True)


def test_get_config_refuses_an_unknown_override():
    # a misspelt field had raised dataclasses' TypeError about GPTConfig.__init__
    with pytest.raises(ValueError, match=r"\['n_layers'\] are no GPTConfig fields.*'n_layer'"):
        get_config("cpu-tiny", n_layers=3)


def test_get_config_refuses_an_override_set_to_none():
    # None (JSON's null in --model-overrides) had been dropped without a word: {"tie_weights": None}
    # built a tied head, and the run's checkpoint recorded the override as given
    with pytest.raises(ValueError, match=r"\['n_experts', 'tie_weights'\] set to None, which no GPTConfig field takes"):
        get_config("cpu-tiny", tie_weights=None, n_experts=None, n_layer=3)
    from geomuon.pretrain.config import TrainConfig

    with pytest.raises(ValueError, match=r"--model-overrides \{\"tie_weights\": null\}: "
                                         r".*\['tie_weights'\] set to None"):
        TrainConfig(model="cpu-tiny", model_overrides={"tie_weights": None}).validate()
    built = get_config("cpu-tiny", tie_weights=False, n_layer=3)  # control: values apply
    assert (built.tie_weights, built.n_layer) == (False, 3) and built == replace(CONFIGS["cpu-tiny"], tie_weights=False,
                                                                                   n_layer=3)


@pytest.mark.parametrize("idx, targets, message", [
    (torch.zeros(5, dtype=torch.long), None, r"idx of shape \[5\] must be \[batch, sequence length\]"),
    (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), r"idx of shape \[1, 0\]"),
    (torch.zeros(1, 5), None, "idx must be an integer tensor of token ids, got torch.float32"),
    (torch.zeros(1, 5, dtype=torch.bool), None, "idx must be an integer tensor"),
    (torch.full((1, 5), 256), None, r"idx holds token ids from 256 to 256, outside \[0, vocab_size=256\)"),
    (torch.full((1, 5), -1), None, r"idx holds token ids from -1 to -1"),
    (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), "targets of shape .* must have idx's"),
    (torch.zeros(2, 5, dtype=torch.long), torch.zeros(10, dtype=torch.long), r"targets of shape \[10\]"),
    (torch.zeros(2, 5, dtype=torch.long), torch.full((2, 5), 300), "targets holds token ids from 300"),
    (torch.zeros(2, 5, dtype=torch.long), torch.full((2, 5), -100), "targets holds token ids from -100"),
])
def test_forward_refuses_bad_token_ids_by_name(idx, targets, message):
    # these had failed inside the embedding or the cross-entropy ("index out of range in self",
    # "Dimension out of range"), or (an empty sequence, all targets -100) returned a NaN loss
    model = GPT(get_config("cpu-tiny"))
    with pytest.raises(ValueError, match=message):
        model(idx, targets)


def test_forward_takes_token_ids_of_any_integer_dtype():
    # int16/uint8 ids had been refused by the embedding, int32 targets by the cross-entropy
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    idx = torch.randint(0, 200, (2, 6))
    logits, loss = model(idx, idx)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        other_logits, other_loss = model(idx.to(dtype), idx.to(dtype))
        assert torch.equal(other_logits, logits) and torch.equal(other_loss, loss)


def test_observe_refuses_to_nest():
    # a nested observe() had detached the outer context's records on exit: the outer one then
    # recorded nothing more, without a word
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny")).eval()
    idx = torch.randint(0, 256, (1, 8))
    with model.observe() as records:
        with pytest.raises(RuntimeError, match="already being observed"):
            with model.observe():
                pass
        model(idx)
    assert records["h.0.attn"].rows == model.config.n_head * 8  # one row per head and position
