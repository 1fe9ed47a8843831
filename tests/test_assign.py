"""Per-module assignment: role classification, strategies, weights on their manifold."""

import pytest
import torch
import torch.nn as nn

from geomuon.manifolds import DGram, Stiefel
from geomuon.optimizers import ManifoldMuon, Muon
from geomuon.optimizers.assign import (ATTENTION_ROLES, MLP_ROLES, ROLES, STRATEGIES, Assignment, Hyper, Rule, assign,
                                      classify)
from geomuon.pretrain.model import GPT, get_config
from test_packaging_manifold_spec import WeightedSphere  # a user's manifold with a tensor argument


def test_classify_gpt2_layout_with_fused_qkv_and_tied_head():
    roles = classify(GPT(get_config("cpu-tiny")))
    assert roles["h.0.attn.c_attn.weight"] == "attn_qkv"
    assert roles["h.0.attn.c_proj.weight"] == "attn_o"
    assert roles["h.0.mlp.c_fc.weight"] == "mlp_in"
    assert roles["h.0.mlp.c_proj.weight"] == "mlp_out"  # same child name as attn_o: parent decides
    assert roles["wte.weight"] == "embedding" and "lm_head.weight" not in roles  # tied: listed once
    assert roles["h.0.ln_1.weight"] == "vector"


def test_classify_separate_qkv_swiglu_moe_and_untied_head():
    lip = classify(GPT(get_config("cpu-lipschitz")))
    assert [lip[f"h.1.attn.{c}.weight"] for c in "qkv"] == ["attn_q", "attn_k", "attn_v"]
    assert lip["lm_head.weight"] == "lm_head"
    moe = classify(GPT(get_config("cpu-moe")))
    assert moe["h.0.mlp.router.weight"] == "router"
    assert {moe[f"h.0.mlp.experts.3.{c}.weight"] for c in ("w_gate", "w_up", "w_down")} == {
        "mlp_gate", "mlp_up", "mlp_down"}


class Foreign(nn.Module):
    """A model that declares no ROLES (conventional names) plus one odd matrix."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.self_attn = nn.ModuleDict({n: nn.Linear(8, 8) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.mlp = nn.ModuleDict({n: nn.Linear(8, 8) for n in ("gate_proj", "up_proj", "down_proj")})
        self.mystery = nn.Linear(8, 8, bias=False)


def test_foreign_model_needs_overrides_for_unknown_matrices():
    model = Foreign()
    with pytest.raises(ValueError, match=r"role of parameter 'mystery.weight'.*roles=\{'mystery.weight'"):
        classify(model)
    roles = classify(model, roles={"mystery.weight": "lm_head"})
    assert roles["embed_tokens.weight"] == "embedding"
    assert roles["self_attn.q_proj.weight"] == "attn_q" and roles["mlp.down_proj.weight"] == "mlp_down"
    assert roles["self_attn.q_proj.bias"] == "vector" and roles["mystery.weight"] == "lm_head"
    with pytest.raises(ValueError, match="'attention' is not a role"):
        classify(model, roles={"mystery.weight": "attention"})
    with pytest.raises(ValueError, match="not a parameter"):
        classify(model, roles={"nothing.weight": "lm_head"})


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="unknown strategy 'stiefel'.*all_stiefel"):
        assign(GPT(get_config("cpu-tiny")), "stiefel")


def test_mapping_strategy_is_applied_like_a_named_one():
    """A ``{role: Rule}`` mapping builds exactly what the same table does under its name
    (same rows, same starting points), is labelled by that name, and registers nothing."""
    registered = dict(STRATEGIES)
    built = {}
    for strategy in ("hetero", dict(STRATEGIES["hetero"])):
        torch.manual_seed(0)
        model = GPT(get_config("cpu-tiny"))
        assignment = assign(model, strategy)
        built[isinstance(strategy, dict)] = (assignment, {n: p.detach().clone() for n, p in model.named_parameters()})
    (named, named_params), (mapped, mapped_params) = built[False], built[True]
    assert mapped.strategy == "hetero" and mapped.table() == named.table()
    assert all(torch.equal(named_params[n], mapped_params[n]) for n in named_params)
    assert STRATEGIES == registered  # assign never writes into the registry


def test_mapping_strategy_leaves_omitted_roles_to_adamw_and_gets_a_readable_label():
    stiefel = Rule("manifold_muon", "stiefel")
    strategy = {**{role: stiefel for role in ATTENTION_ROLES}, "mlp_in": Rule("hybrid")}
    assignment = assign(GPT(get_config("cpu-tiny")), strategy)
    assert assignment.strategy == "custom (attention manifold_muon[stiefel]; mlp_in hybrid)"
    updates = {row.role: row.rule for row in assignment.rows}
    assert updates["attn_qkv"] == stiefel and updates["mlp_in"] == Rule("hybrid")
    assert updates["mlp_out"].update == "adamw" and updates["embedding"].update == "adamw"
    assert set(assignment.optimizers) == {"manifold_muon", "hybrid", "adamw"}
    assert assignment.table().startswith("strategy: custom (attention")


@pytest.mark.parametrize("strategy, error, match", [
    ({"attention": Rule("muon")}, ValueError, r"role 'attention'"),
    ({"vector": Rule("muon")}, ValueError, r"role 'vector'.*vectors always use AdamW"),
    ({"attn_q": "muon"}, TypeError, r"strategy\['attn_q'\] is a str; use geomuon.optimizers.assign.Rule"),
    ({"attn_q": Rule("sgd")}, ValueError, r"update 'sgd'; choose one of .*'muon'"),
    ({"attn_q": Rule("manifold_muon", "sphere")}, ValueError, r"strategy\['attn_q'\]: unknown manifold 'sphere'; registered: .*'Stiefel'"),
    (["attn_q"], TypeError, r"strategy must be a name in STRATEGIES or a \{role: Rule\} mapping, got list"),
])
def test_bad_mapping_strategies_are_rejected(strategy, error, match):
    with pytest.raises(error, match=match):
        assign(GPT(get_config("cpu-tiny")), strategy)


def test_every_role_known_to_every_strategy_is_a_role():
    for table in STRATEGIES.values():
        assert set(table) <= set(ROLES)


@pytest.mark.parametrize("strategy", ["all_stiefel", "all_dgram", "hetero", "hetero_inv"])
def test_seed000_strategies_put_weights_on_their_manifold(strategy):
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    assignment = assign(model, strategy, Hyper())
    expected = {
        "all_stiefel": ("stiefel", "stiefel"),
        "all_dgram": ("dgram", "dgram"),
        "hetero": ("stiefel", "dgram"),
        "hetero_inv": ("dgram", "stiefel"),
    }[strategy]
    manifold_of = {"stiefel": Stiefel(), "dgram": DGram()}
    params = dict(model.named_parameters())
    for row in assignment.rows:
        if row.role.startswith("attn"):
            kind = expected[0]
        elif row.role.startswith("mlp"):
            kind = expected[1]
        else:
            assert row.rule.update == "adamw"
            continue
        assert row.rule.manifold == kind
        ok, reason = manifold_of[kind]._check_point_on_manifold(params[row.name].detach(), atol=1e-5, rtol=1e-5)
        assert ok, f"{row.name} not on {kind}: {reason}"
    # the Gaussian init was off every manifold: the weights were moved (control)
    assert not torch.equal(params["h.0.mlp.c_fc.weight"], initial["h.0.mlp.c_fc.weight"])
    assert strategy in assignment.table() and "h.0.attn.c_attn.weight" in assignment.table()


def test_weights_already_on_their_manifold_are_kept():
    # A DGram point with distinct column norms (e.g. a trained model) is on DGram: kept.
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    assign(model, "all_dgram")
    with torch.no_grad():
        for block in model.h:
            block.mlp.c_fc.weight.mul_(torch.linspace(0.5, 3.0, block.mlp.c_fc.weight.shape[1]))
    trained = model.h[1].mlp.c_fc.weight.detach().clone()
    assign(model, "all_dgram")
    assert torch.equal(model.h[1].mlp.c_fc.weight, trained)
    assign(model, "all_stiefel")  # not on Stiefel: moved
    assert not torch.equal(model.h[1].mlp.c_fc.weight, trained)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_trains_one_step_on_every_layout(strategy):
    for config in ("cpu-tiny", "cpu-moe", "cpu-lipschitz"):
        torch.manual_seed(0)
        model = GPT(get_config(config))
        assignment = assign(model, strategy, Hyper(lr=0.01, adamw_lr=1e-3))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        idx = torch.randint(0, 256, (2, 16))
        model(idx, idx)[1].backward()
        assignment.step()
        moved = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()
                 and not torch.equal(p, before[n])]
        assert moved, f"{strategy} on {config}: no parameter moved"
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_check_finite_reports_the_last_steps_skips():
    # a step skipped for a non-finite gradient is reported at the next step; at the end of a
    # run there is none, so the trainer asks the assignment (optimizers without such a report,
    # torch's AdamW here, are passed over)
    import warnings

    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    assignment = assign(model, "hetero", Hyper(lr=0.01, adamw_lr=1e-3))
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)[1].backward()
    model.h[0].mlp.c_fc.weight.grad[0, 0] = float("nan")  # a ManifoldMuon matrix
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assignment.step()  # no report inside the step that saw it
    with pytest.warns(RuntimeWarning, match=r"h\.0\.mlp\.c_fc\.weight"):
        assignment.check_finite()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assignment.check_finite()  # reported once


def _group_of(optimizer, parameter):
    return next(group for group in optimizer.param_groups if any(p is parameter for p in group["params"]))


def test_torch_muon_peer_builds_torchs_muon_on_hidden_matrices_and_adamw_on_the_rest():
    """The ``torch_muon`` peer strategy: ``torch.optim.Muon`` (lr = the matrix lr, no weight
    decay, ``adjust_lr_fn="original"``, Nesterov momentum 0.95) holds exactly the attention and
    MLP matrices; AdamW (its lr, betas (0.9, 0.95)) holds embeddings, gains and biases, decaying
    the matrices only. Control: ``unconstrained`` puts the same matrices in the library's Muon
    with weight decay, so the two rows differ in exactly the implementation and the decay."""
    hyper = Hyper(lr=0.02, adamw_lr=3e-3, weight_decay=0.1)
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    assignment = assign(model, "torch_muon", hyper)
    assert set(assignment.optimizers) == {"torch_muon", "adamw"}
    muon, adamw = assignment.optimizers["torch_muon"], assignment.optimizers["adamw"]
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    roles = classify(model)
    params = dict(model.named_parameters())
    hidden = {n for n, r in roles.items() if r in ATTENTION_ROLES + MLP_ROLES}
    assert hidden and {n for n, p in params.items() if any(p is q for g in muon.param_groups for q in g["params"])} == hidden
    assert {n for n, p in params.items() if any(p is q for g in adamw.param_groups for q in g["params"])} == (
        set(params) - hidden)
    for group in muon.param_groups:
        assert (group["lr"], group["weight_decay"], group["adjust_lr_fn"]) == (0.02, 0.0, "original")
        assert (group["momentum"], group["nesterov"]) == (0.95, True)
    assert _group_of(adamw, params["wte.weight"])["weight_decay"] == 0.1  # nanoGPT: matrices decay
    assert _group_of(adamw, params["h.0.ln_1.weight"])["weight_decay"] == 0.0  # gains do not
    assert all(g["lr"] == 3e-3 and g["betas"] == (0.9, 0.95) for g in adamw.param_groups)
    assert "torch_muon" in assignment.table().splitlines()[0]

    ours = assign(GPT(get_config("cpu-tiny")), "unconstrained", hyper).optimizers["muon"]
    assert type(ours) is not torch.optim.Muon
    assert {g["weight_decay"] for g in ours.param_groups} == {0.1}


def test_torch_muon_peer_trains_and_checkpoints():
    """One step moves every hidden matrix (torch's Muon updates each one with its polar factor),
    and its state round-trips ``torch.load(weights_only=True)`` like every strategy's."""
    import io

    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    assignment = assign(model, "torch_muon", Hyper())
    before = model.h[0].attn.c_attn.weight.detach().clone()
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)[1].backward()
    assignment.step()
    assert not torch.equal(model.h[0].attn.c_attn.weight, before)
    buffer = io.BytesIO()
    torch.save(assignment.state_dict(), buffer)
    buffer.seek(0)
    fresh = assign(GPT(get_config("cpu-tiny")), "torch_muon", Hyper())
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    key = next(iter(assignment.optimizers["torch_muon"].state_dict()["state"]))
    assert torch.equal(fresh.optimizers["torch_muon"].state_dict()["state"][key]["momentum_buffer"],
                       assignment.optimizers["torch_muon"].state_dict()["state"][key]["momentum_buffer"])


def test_frozen_parameters_are_left_alone_and_the_optimizers_name_what_they_step():
    # a frozen pretrained weight had been listed, re-initialised on Stiefel and stepped; the
    # optimizers' reports had said '#1 of param group 0'
    import warnings

    model = nn.Module()
    model.attn = nn.Module()
    model.attn.q_proj = nn.Linear(8, 8, bias=False)
    model.attn.o_proj = nn.Linear(8, 8, bias=False)
    model.attn.q_proj.requires_grad_(False)
    frozen = model.attn.q_proj.weight.detach().clone()
    assignment = assign(model, "all_stiefel")
    assert [row.name for row in assignment.rows] == ["attn.o_proj.weight"]
    assert torch.equal(model.attn.q_proj.weight, frozen)
    model.attn.o_proj.weight.grad = torch.full((8, 8), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assignment.step()
    (optimizer,) = assignment.optimizers.values()
    with pytest.warns(RuntimeWarning, match="in parameter\\(s\\) 'attn.o_proj.weight'"):
        assert optimizer.check_finite() == {"'attn.o_proj.weight'": 1}
    # nothing trainable: an error, not an assignment that does nothing
    model.attn.o_proj.requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters"):
        assign(model, "all_stiefel")


def _two_roles() -> nn.Module:
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.q_proj = nn.Linear(8, 8, bias=False)
    model.mlp = nn.Module()
    model.mlp.fc1 = nn.Linear(8, 16, bias=False)
    return model


@pytest.mark.parametrize("rule, message", [
    (Rule("muon", "stiefel"), "a manifold goes with update='manifold_muon'"),  # had stepped off Stiefel
    (Rule("manifold_muon"), "a manifold goes with update='manifold_muon', which needs one"),
    (Rule("muon", centered=True), "centered applies to"),
    (Rule("torch_muon", regulate="soft_cap"), "torch.optim.Muon takes no regulator"),
    (Rule("adamw", regulate="soft_cap"), "torch.optim.AdamW takes no regulator"),  # had been carried and ignored
    (Rule("muon", regulate="bogus"), r"strategy\['attn_q'\].regulate"),
])
def test_rules_that_cannot_do_what_they_say_are_refused(rule, message):
    with pytest.raises(ValueError, match=message):
        assign(_two_roles(), {"attn_q": rule})


@pytest.mark.parametrize("name", ["weight_decay", "spectral_weight_decay", "spectral_normalize", "spectral_hammer",
                                  "soft_cap", "hard_cap", "column_cap"])
def test_a_rules_regulator_takes_the_hyper_options_its_class_takes(name):
    # every rule had been given w_max: the weight decays, which take none, were refused with an
    # error naming w_max, an option the user had not set. A decay takes Hyper.weight_decay as the
    # decay it applies; the soft cap's weight_decay (the decay it assumes) stays its own.
    hyper = Hyper(w_max=3.0, weight_decay=0.05)
    decays = name in ("weight_decay", "spectral_weight_decay")
    model = _two_roles()
    assignment = assign(model, {"mlp_in": Rule("muon", regulate=name)}, hyper)
    (group,) = [g for opt in assignment.optimizers.values() for g in opt.param_groups if g.get("regulate")]
    spec = group["regulate"]
    assert spec["name"] == name
    assert spec.get("w_max") == (None if decays else 3.0), spec
    assert (spec.get("weight_decay") == 0.05) == decays, spec
    if name == "weight_decay":  # and it decays: a zero gradient leaves (1 - lr wd) W
        before = model.mlp.fc1.weight.detach().clone()
        model.mlp.fc1.weight.grad = torch.zeros_like(before)
        assignment.step()
        # rtol: the rounding of the factor and of the product, one float32 eps each
        torch.testing.assert_close(model.mlp.fc1.weight.detach(), before * (1 - hyper.lr * hyper.weight_decay),
                                   rtol=2 * torch.finfo(torch.float32).eps, atol=0)


def test_settings_are_checked_before_any_weight_moves():
    # a bad Hyper had been refused after q_proj was re-initialised on Stiefel
    model = _two_roles()
    before = model.attn.q_proj.weight.detach().clone()
    with pytest.raises(ValueError, match="refuse these settings.*lr must be"):
        assign(model, {"attn_q": Rule("manifold_muon", "stiefel"), "mlp_in": Rule("muon")}, Hyper(lr=-1.0))
    assert torch.equal(model.attn.q_proj.weight, before)
    # control: the same strategy with a good Hyper moves the weight onto Stiefel
    assign(model, {"attn_q": Rule("manifold_muon", "stiefel"), "mlp_in": Rule("muon")}, Hyper())
    assert Stiefel().check_point_on_manifold(model.attn.q_proj.weight.detach())


def test_roles_of_parameters_tied_weights_and_kernels_are_named():
    # a ROLES entry naming an nn.Parameter child had been ignored ("declares no ROLES"), a ROLES
    # typo skipped, a tied alias called "not a parameter", a three-way tie's table dropped a
    # name, and a conv kernel's [kh, kw] slices were put on Stiefel one by one
    class Experts(nn.Module):
        ROLES = {"w_in": "mlp_in"}

        def __init__(self):
            super().__init__()
            self.w_in = nn.Parameter(torch.randn(32, 8))

    assert classify(Experts()) == {"w_in": "mlp_in"}

    class Typo(Experts):
        ROLES = {"w_inn": "mlp_in"}

    with pytest.raises(ValueError, match="ROLES names 'w_inn', which is no attribute"):
        classify(Typo())
    model = GPT(get_config("cpu-tiny"))
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(ValueError, match="roles names 'lm_head.weight', which is tied to 'wte.weight'"):
        classify(model, {"lm_head.weight": "lm_head"})
    three = nn.Module()
    three.emb = nn.Embedding(16, 8)
    three.lm_head = nn.Linear(8, 16, bias=False)
    three.aux_head = nn.Linear(8, 16, bias=False)
    three.lm_head.weight = three.aux_head.weight = three.emb.weight
    (row,) = assign(three, "adamw").rows
    assert row.tied == "lm_head.weight, aux_head.weight"
    net = nn.Module()
    net.mlp = nn.Module()
    net.mlp.fc1 = nn.Conv2d(3, 16, 3)
    with pytest.raises(ValueError, match=r"'mlp.fc1.weight' has shape \(16, 3, 3, 3\).*'vector'"):
        assign(net, "all_stiefel")


def _one_step(model, assignment):
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)[1].backward()
    assignment.step()


def test_another_strategys_state_is_refused_before_anything_loads():
    # hetero's state had loaded into hetero_inv (same update families, same group sizes) and
    # replaced its groups: the attention matrices then stepped on Stiefel under the hetero_inv label
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny"))
    hetero = assign(model, "hetero")
    _one_step(model, hetero)
    saved = hetero.state_dict()
    target = assign(GPT(get_config("cpu-tiny")), "hetero_inv")
    with pytest.raises(ValueError, match=r"'manifold_muon' gives 'h.0.attn.c_attn.weight' .*manifold='Stiefel' but "
                                         r"strategy 'hetero_inv' gives it manifold='DGram'; resume with the strategy"):
        target.load_state_dict(saved)
    assert all(not opt.state for opt in target.optimizers.values())  # AdamW's state was not loaded either
    assert [g["manifold"]["name"] for g in target.optimizers["manifold_muon"].param_groups] == ["DGram", "Stiefel"]
    # control: the strategy it was written with loads it, geometry and momentum
    again = assign(GPT(get_config("cpu-tiny")), "hetero")
    again.load_state_dict(saved)
    assert [g["manifold"]["name"] for g in again.optimizers["manifold_muon"].param_groups] == ["Stiefel", "DGram"]
    assert len(again.optimizers["manifold_muon"].state) == len(hetero.optimizers["manifold_muon"].state) > 0


def test_state_of_other_parameters_in_the_same_group_shapes_is_refused():
    # two models whose Muon groups have equal sizes but hold other parameters: torch maps state
    # by position, so q's momentum had become k's
    def model(first, second):
        net = nn.Module()
        net.attn = nn.Module()
        setattr(net.attn, first, nn.Linear(8, 8, bias=False))
        setattr(net.attn, second, nn.Linear(8, 8, bias=False))
        return net

    source = model("q_proj", "k_proj")
    written = assign(source, "unconstrained")
    source.attn.q_proj.weight.grad = torch.ones(8, 8)
    source.attn.k_proj.weight.grad = torch.ones(8, 8)
    written.step()
    with pytest.raises(ValueError, match=r"holds \['attn.q_proj.weight', 'attn.k_proj.weight'\] but strategy "
                                         r"'unconstrained' puts \['attn.k_proj.weight', 'attn.q_proj.weight'\]"):
        assign(model("k_proj", "q_proj"), "unconstrained").load_state_dict(written.state_dict())


def test_bf16_weights_trained_on_their_manifold_are_kept():
    # assign's check had used a fixed 1e-5: a bf16 weight, on Stiefel only to its own rounding
    # (ManifoldMuon's first step accepts 16 eps of bf16), was replaced by a random point
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny")).to(torch.bfloat16)
    initial = model.h[0].attn.c_attn.weight.detach().clone()
    assignment = assign(model, "all_stiefel")
    assert not torch.equal(model.h[0].attn.c_attn.weight, initial)  # control: the Gaussian init is moved
    _one_step(model, assignment)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    again = assign(model, "all_stiefel")
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    _one_step(model, again)  # the optimizer agrees they are on Stiefel (no OffManifoldError)


def test_the_nearest_ancestor_tells_attention_from_mlp():
    # a hint anywhere in the path had decided: every MLP c_proj under "attn_blocks" was an attention output
    def block() -> nn.Module:
        net = nn.Module()
        net.attn, net.mlp = nn.Module(), nn.Module()
        net.attn.c_proj = nn.Linear(8, 8, bias=False)
        net.mlp.c_proj = nn.Linear(32, 8, bias=False)
        return net

    for outer in ("attn_blocks", "mlp_mixer"):
        model = nn.Module()
        setattr(model, outer, nn.ModuleList([block()]))
        assert classify(model) == {f"{outer}.0.attn.c_proj.weight": "attn_o", f"{outer}.0.mlp.c_proj.weight": "mlp_out"}


def test_torch_muon_takes_hyper_extra_and_refuses_a_compute_dtype_it_cannot_honour():
    # torch.optim.Muon orthogonalises in bf16 whatever it is asked; Hyper.extra, "passed to every
    # matrix optimizer", had not reached it (ns_steps stayed 5)
    with pytest.raises(ValueError, match=r"Hyper.compute_dtype=torch.float32 cannot apply to torch_muon"):
        assign(_two_roles(), "torch_muon", Hyper(compute_dtype=torch.float32))
    built = assign(_two_roles(), "torch_muon", Hyper(compute_dtype=torch.bfloat16, extra={"ns_steps": 3}))
    assert {g["ns_steps"] for g in built.optimizers["torch_muon"].param_groups} == {3}
    with pytest.raises(ValueError, match="refuse these settings.*msign_method"):  # an option of ours only
        assign(_two_roles(), "torch_muon", Hyper(extra={"msign_method": "polar_express"}))


def test_a_roles_declaration_that_reaches_no_weight_is_refused():
    # it had been dropped, and its weights then said to come from a module that "declares no ROLES"
    class Experts(nn.Module):
        ROLES = {"experts": "mlp_in"}

        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 8, bias=False) for _ in range(2))

    with pytest.raises(ValueError, match=r"Experts.ROLES\['experts'\] names a ModuleList of the model, which has no "
                                         r"weight: declare the role in the module that holds the weight"):
        classify(Experts())


def test_a_parameter_that_is_not_a_matrix_gets_advice_assign_can_follow():
    # the optimizers' refusal had said "put it in a param group with update='adamw'"
    model = _two_roles()
    model.attn.q_proj.bias = nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match=r"'attn.q_proj.bias' has shape \(8,\) and role 'attn_q', which strategy "
                                         r"'all_stiefel' gives manifold_muon\[stiefel\].*roles=\{'attn.q_proj.bias': "
                                         r"'vector'\} \(AdamW\)$"):
        assign(model, "all_stiefel", roles={"attn.q_proj.bias": "attn_q"})


def test_a_strategy_that_reaches_no_parameter_is_refused():
    # attention roles of separate q/k/v on a fused c_attn (attn_qkv) had trained everything with AdamW
    stiefel_q = {"attn_q": Rule("manifold_muon", "stiefel")}
    with pytest.raises(ValueError, match=r"names roles \['attn_q'\], none of which a trainable parameter of GPT has "
                                         r"\(its roles: \['attn_o', 'attn_qkv',"):
        assign(GPT(get_config("cpu-tiny")), stiefel_q)
    # control: the layout with separate q/k/v
    rows = assign(GPT(get_config("cpu-lipschitz")), stiefel_q).rows
    assert {row.name for row in rows if row.rule.manifold} == {"h.0.attn.q.weight", "h.1.attn.q.weight"}


def test_roles_for_a_frozen_parameter_are_refused():
    model = _two_roles()
    model.attn.q_proj.requires_grad_(False)
    with pytest.raises(ValueError, match=r"roles names 'attn.q_proj.weight', which is frozen \(requires_grad=False\)"):
        classify(model, roles={"attn.q_proj.weight": "mlp_in"})


def test_a_weight_decay_in_hyper_extra_that_muon_would_override_is_refused():
    # Muon's groups set Hyper.weight_decay themselves: extra's value had reached the polar maps
    # of the same strategy but not Muon, silently
    with pytest.raises(ValueError, match=r"Hyper.extra\['weight_decay'\] cannot reach Muon.*set Hyper.weight_decay"):
        assign(GPT(get_config("cpu-tiny")), "symmetry", Hyper(extra={"weight_decay": 0.5}))
    # control: where no Muon group is built, the polar maps take it
    built = assign(GPT(get_config("cpu-tiny")), {"mlp_in": Rule("hybrid")}, Hyper(extra={"weight_decay": 0.5}))
    assert {g["weight_decay"] for g in built.optimizers["hybrid"].param_groups} == {0.5}


def test_a_checkpoint_of_a_geometry_whose_tensors_differ_beyond_their_printed_digits_is_refused():
    # the manifolds were compared as printed, and a tensor prints 4 decimals: weights [.., 3.0] had
    # loaded into an optimizer on [.., 3.00001], whose group torch then gave the saved geometry
    saved_geometry = WeightedSphere(1.0, torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64))
    here = WeightedSphere(1.0, torch.tensor([1.0, 2.0, 0.5, 3.00001], dtype=torch.float64))
    w = torch.nn.Parameter(saved_geometry.projx(torch.randn(6, 4, dtype=torch.float64)))
    saved = ManifoldMuon([dict(params=[w], param_names=["w"], manifold=saved_geometry)], lr=0.01, compute_dtype=None)
    w.grad = torch.randn(6, 4, dtype=torch.float64)
    saved.step()
    state = Assignment("saved", [], {"m": saved}).state_dict()

    def load_into(manifold):
        current = ManifoldMuon([dict(params=[w], param_names=["w"], manifold=manifold)], lr=0.01, compute_dtype=None)
        Assignment("here", [], {"m": current}).load_state_dict(state)
        return current

    with pytest.raises(ValueError, match=r"gives 'w' .*manifold=.* but strategy 'here' gives it manifold=.*its tensor "
                                         r"arguments differ from the saved ones beyond their printed digits"):
        load_into(here)
    # control: the same geometry built anew loads
    assert load_into(WeightedSphere(1.0, torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64))).state


def test_a_state_one_optimizer_refuses_leaves_every_optimizer_as_it_was():
    # Muon's state had loaded (its lr and momentum) before ManifoldMuon's load refused its own part
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    b = torch.nn.Parameter(torch.linalg.qr(torch.randn(6, 4, generator=gen, dtype=torch.float64))[0])

    def build():
        muon = Muon([dict(params=[a], param_names=["a"])], lr=0.02)
        manifold_muon = ManifoldMuon([dict(params=[b], param_names=["b"], warm_start=False)], lr=0.02,
                                     manifold="stiefel", compute_dtype=None)
        return Assignment("s", [], {"muon": muon, "manifold_muon": manifold_muon})

    written = build()
    a.grad, b.grad = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen,
                                                                                      dtype=torch.float64)
    written.step()
    state = written.state_dict()
    state["muon"]["param_groups"][0]["lr"] = 0.5
    state["manifold_muon"]["param_groups"][0]["cold_dual_steps"] = 2  # refused with warm_start=False
    fresh = build()
    with pytest.raises(ValueError, match="cold_dual_steps=2 with warm_start=False"):
        fresh.load_state_dict(state)
    assert fresh.optimizers["muon"].param_groups[0]["lr"] == 0.02 and not fresh.optimizers["muon"].state
    del state["manifold_muon"]["param_groups"][0]["cold_dual_steps"]  # control: the state as written loads
    fresh.load_state_dict(state)
    assert fresh.optimizers["muon"].param_groups[0]["lr"] == 0.5 and fresh.optimizers["muon"].state


class _OptionedSphere(WeightedSphere):
    """WeightedSphere with a dict argument (equal whatever the order of its keys)."""

    def __init__(self, options: dict):
        super().__init__(1.0, torch.ones(4, dtype=torch.float64))
        self.options = options


def test_a_checkpoint_of_the_same_geometry_printed_otherwise_loads():
    # the manifolds had been compared as printed first: the same one with its dict argument's keys
    # in another order was refused
    w = torch.nn.Parameter(torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64))[0] / 2)
    saved_manifold, here = _OptionedSphere({"a": 1, "b": 2}), _OptionedSphere({"b": 2, "a": 1})
    assert saved_manifold == here and str(saved_manifold.spec()) != str(here.spec())

    def optimizer(manifold):
        return Assignment("s", [], {"m": ManifoldMuon([dict(params=[w], param_names=["w"], manifold=manifold)],
                                                      lr=0.01, compute_dtype=None)})

    optimizer(here).load_state_dict(optimizer(saved_manifold).state_dict())
