"""The GPT of ``geomuon.pretrain.model``: sizes, variants, observables, bad configs."""

import contextlib
import math

import pytest
import torch

from geomuon.pretrain.model import CONFIGS, GPT, GPTConfig, MoE, get_config, rotary, softmax_jacobian_frobenius


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
    assert 0 < records["h.0.attn"].mean_jacobian_norm < 2**-0.5
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
