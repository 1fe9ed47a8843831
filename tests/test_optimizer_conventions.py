"""Conventions every matrix optimizer shares (optimizers/base.py), checked on each class."""

import copy
import inspect
import io
import warnings

import pytest
import torch

from geomuon.manifolds import DGram, MatrixManifold, Stiefel
from geomuon.optimizers import HybridPolarGradM, LeftPolarGradM, ManifoldMuon, Muon, RightPolarGradM, RowNormM
from geomuon.optimizers import OffManifoldError
from geomuon.optimizers.base import ADAMW_DEFAULTS

FACTORIES = {
    "Muon": lambda groups, **kw: Muon(groups, lr=0.02, **kw),
    "ManifoldMuon-stiefel": lambda groups, **kw: ManifoldMuon(groups, lr=0.02, manifold="stiefel", **kw),
    "ManifoldMuon-dgram": lambda groups, **kw: ManifoldMuon(groups, lr=0.02, manifold="dgram", **kw),
    "RowNormM": lambda groups, **kw: RowNormM(groups, lr=0.01, weight_decay=0.01, **kw),
    "RightPolarGradM": lambda groups, **kw: RightPolarGradM(groups, lr=1e-3, **kw),
    "LeftPolarGradM": lambda groups, **kw: LeftPolarGradM(groups, lr=1e-3, centered=True, **kw),
    "HybridPolarGradM": lambda groups, **kw: HybridPolarGradM(groups, lr=1e-3, **kw),
}


class Tiny(torch.nn.Module):
    """Two same-shape matrices, one other matrix, a bias: batching, AdamW path, names."""

    def __init__(self, manifold=None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(12, 6, generator=gen))
        self.b = torch.nn.Parameter(torch.randn(12, 6, generator=gen))
        self.c = torch.nn.Parameter(torch.randn(6, 10, generator=gen))
        self.bias = torch.nn.Parameter(torch.randn(6, generator=gen))
        if manifold is not None:
            with torch.no_grad():
                for p in (self.a, self.b, self.c):
                    p.copy_(manifold.projx(p))

    def matrices(self):
        return [self.a, self.b, self.c]

    def loss(self, x):
        h = torch.tanh(x @ self.a.T @ self.b) @ self.c.T[:6]  # [batch, 6]
        return (h.sum(-1) + self.bias.sum()).pow(2).mean()


def _model(name):
    manifold = {"ManifoldMuon-stiefel": Stiefel(), "ManifoldMuon-dgram": DGram()}.get(name)
    return Tiny(manifold)


def _groups(model):
    return [{"params": model.matrices()}, {"params": [model.bias], "update": "adamw", "lr": 1e-2}]


def _step(model, opt, seed):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    loss = model.loss(x)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("name", FACTORIES)
def test_resume_from_state_dict_is_bit_identical(name):
    # through torch.save / torch.load(weights_only=True), as a checkpoint read by another
    # process is: the groups must be plain data (manifold and regulator specs, dtypes)
    model = _model(name)
    opt = FACTORIES[name](_groups(model))
    for k in range(3):
        _step(model, opt, k)
    checkpoint = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint)
    checkpoint.seek(0)
    saved = torch.load(checkpoint, weights_only=True)
    saved_model, saved_opt = saved["model"], saved["opt"]
    for k in range(3, 6):
        _step(model, opt, k)
    resumed = _model(name)
    resumed.load_state_dict(saved_model)
    opt2 = FACTORIES[name](_groups(resumed))
    opt2.load_state_dict(saved_opt)
    for k in range(3, 6):
        _step(resumed, opt2, k)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", FACTORIES)
def test_closure_scheduler_and_none_grads(name):
    model = _model(name)
    opt = FACTORIES[name](_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    x = torch.randn(16, 6)

    returned = []

    def closure():
        opt.zero_grad()
        loss = model.loss(x)
        loss.backward()
        model.c.grad = None  # a parameter without gradient is skipped
        returned.append(loss)
        return loss

    c_before = model.c.detach().clone()
    a_before = model.a.detach().clone()
    loss = opt.step(closure)
    assert len(returned) == 1 and loss is returned[0]
    assert torch.equal(model.c.detach(), c_before) and model.c not in opt.state
    assert not torch.equal(model.a.detach(), a_before)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * opt.defaults["lr"])


@pytest.mark.parametrize("name", FACTORIES)
def test_vector_in_matrix_group_is_refused_with_its_name(name):
    model = _model(name)
    with pytest.raises(ValueError, match=r"'bias'.*update='adamw'"):
        FACTORIES[name]([{"params": [("a", model.a), ("bias", model.bias)]}])


@pytest.mark.parametrize("name", FACTORIES)
def test_nonfinite_gradient_skips_that_parameter_on_the_device_and_the_next_step_names_it(name):
    # The step reads nothing back: the skipped matrix's update is a no-op on the device,
    # and the report (naming it) comes at the start of the next step or at check_finite().
    model = _model(name)
    groups = [{"params": [("a", model.a), ("b", model.b), ("c", model.c)]},
              {"params": [("bias", model.bias)], "update": "adamw"}]
    opt = FACTORIES[name](groups)
    _step(model, opt, 0)
    before = {key: copy.deepcopy(opt.state[p]) for key, p in (("a", model.a), ("bias", model.bias))}
    a_before, b_before, bias_before = (p.detach().clone() for p in (model.a, model.b, model.bias))
    opt.zero_grad()
    model.loss(torch.randn(16, 6)).backward()
    model.a.grad[0, 0] = float("nan")
    model.bias.grad[0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # no report inside the step that saw it
    assert torch.equal(model.a.detach(), a_before) and torch.equal(model.bias.detach(), bias_before)
    for key, p in (("a", model.a), ("bias", model.bias)):
        assert opt.state[p].keys() == before[key].keys()
        for field, value in before[key].items():
            assert torch.equal(opt.state[p][field], value), (key, field)
    assert not torch.equal(model.b.detach(), b_before)  # the others still step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with pytest.warns(RuntimeWarning, match=r"'a' \(1 step\)") as caught:
        opt.step()
    assert any("'bias'" in str(w.message) for w in caught)
    assert opt.check_finite() == {}  # reported once
    strict = FACTORIES[name]([{"params": [("a", model.a)], "nonfinite": "raise"}])
    model.a.grad[0, 0] = float("inf")
    a_before = model.a.detach().clone()
    strict.step()
    with pytest.raises(ValueError, match="'a'.*nonfinite='raise'"):
        strict.check_finite()
    assert torch.equal(model.a.detach(), a_before)
    strict.step()
    with pytest.raises(ValueError, match="'a'"):
        strict.step()  # the start of the next step raises, before touching anything
    assert torch.equal(model.a.detach(), a_before)


def test_gradient_whose_norm_overflows_is_skipped_not_turned_into_a_silent_zero_step():
    # Finite entries of 1e30: the Frobenius norm that normalizes every update overflows
    # fp32, so the direction would be G / inf = 0. The step must be refused by name.
    p = torch.nn.Parameter(torch.eye(4, 3))
    p.grad = torch.full((4, 3), 1e30)
    assert torch.isfinite(p.grad).all()
    opt = Muon([{"params": [("w", p)]}], lr=0.1, compute_dtype=torch.float32)
    opt.step()
    with pytest.warns(RuntimeWarning, match="overflows.*'w'"):
        assert opt.check_finite() == {"'w'": 1}
    assert torch.equal(p.detach(), torch.eye(4, 3))
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(4, 3))


@pytest.mark.parametrize("name", FACTORIES)
def test_zero_gradient_gives_no_nan(name):
    model = _model(name)
    opt = FACTORIES[name](_groups(model))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", FACTORIES)
def test_a_zero_gradient_is_a_step_and_weight_decay_applies(name):
    # A finite zero gradient is not a skipped step: W <- (1 - lr wd) W, then (ManifoldMuon)
    # the retraction of a zero direction, which is the projection onto the manifold (Stiefel
    # undoes the scaling, so its case only checks the retraction; DGram, a cone, keeps it: on
    # DGram the old code, which took a zero momentum for a skipped step, kept W undecayed).
    # Tolerance: the retraction rounds the point a few times in fp32 (Polar Express steps on
    # unit columns, each |error| <~ 10 eps): 1e-5 relative, below the decay's >= 1e-3.
    model = _model(name)
    manifold = {"ManifoldMuon-stiefel": Stiefel(), "ManifoldMuon-dgram": DGram()}.get(name)
    opt = FACTORIES[name]([{"params": model.matrices(), "weight_decay": 0.5}])
    before = [p.detach().clone() for p in model.matrices()]
    for _ in range(2):
        for p in model.matrices():
            p.grad = torch.zeros_like(p)
        opt.step()
    shrink = (1 - opt.param_groups[0]["lr"] * 0.5) ** 2
    for p, w in zip(model.matrices(), before):
        expected = shrink * w if manifold is None else manifold.projx(shrink * w)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
        if manifold is None or isinstance(manifold, DGram):
            assert (p.detach() - w).abs().max() > 0.5 * (1 - shrink) * w.abs().max()


@pytest.mark.parametrize("name", FACTORIES)
def test_regulator_runs_after_the_step(name):
    model = _model(name)
    seen = []

    def halve(W, *, lr):
        seen.append(lr)
        return W * 0.5

    if name == "ManifoldMuon-stiefel":  # halving takes Stiefel's points off it: refused when built
        with pytest.raises(ValueError, match="takes points of Stiefel off it"):
            FACTORIES[name]([{"params": [model.c], "regulate": halve}])
        return
    opt = FACTORIES[name]([{"params": [model.c], "regulate": halve}])
    seen.clear()  # (ManifoldMuon probes its regulators on its manifold when built)
    unregulated_model = _model(name)
    plain = FACTORIES[name]([{"params": [unregulated_model.c]}])
    g = torch.randn(6, 10)
    model.c.grad, unregulated_model.c.grad = g.clone(), g.clone()
    opt.step()
    plain.step()
    assert seen == [opt.param_groups[0]["lr"]]
    # both runs compute the same stepped weight; halving it is exact in binary floating point,
    # so the regulated weight is bitwise half the unregulated one
    assert torch.equal(model.c.detach(), 0.5 * unregulated_model.c.detach())


def test_regulate_spec_goes_through_make_regulator():
    from geomuon.optimizers.regulate import make_regulator

    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 8, generator=gen) * 10)
    assert torch.linalg.matrix_norm(p.detach(), ord=2) > 10  # control: the cap has work to do
    opt = Muon([{"params": [p], "regulate": {"name": "spectral_normalize", "w_max": 1.0}}], lr=0.0)
    p.grad = torch.randn(8, 8, generator=gen)
    opt.step()
    expected_type = type(make_regulator({"name": "spectral_normalize", "w_max": 1.0}))
    assert isinstance(opt._group_regulator(opt.param_groups[0], 0), expected_type)
    # RMS->RMS norm of a square matrix is sigma_max. The power iteration's block (8 vectors)
    # spans all of R^8, so its estimate is sigma_max up to fp32 rounding: Gram entries of 8
    # products each (<= 8 eps relative), a thin QR and a Rayleigh quotient per step, halved by
    # the square root; 8 * 8 eps (7.6e-6) bounds that with margin (measured <= 3.5e-8)
    sigma = torch.linalg.matrix_norm(p.detach().double(), ord=2).item()
    assert sigma <= 1 + 8 * 8 * torch.finfo(torch.float32).eps


def test_adamw_path_matches_torch_adamw():
    gen = torch.Generator().manual_seed(5)
    v1 = torch.nn.Parameter(torch.randn(7, generator=gen))
    v2 = torch.nn.Parameter(v1.detach().clone())
    m = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    ours = Muon([{"params": [m]}, {"params": [v1], "update": "adamw", "lr": 0.01, "weight_decay": 0.1}])
    ref = torch.optim.AdamW([v2], lr=0.01, weight_decay=0.1)
    for k in range(5):
        g = torch.randn(7, generator=gen)
        v1.grad, v2.grad = g.clone(), g.clone()
        m.grad = torch.randn(8, 4, generator=gen)
        ours.step()
        ref.step()
    # Same formula, other operation order (bias corrections from the step tensor, foreach
    # grouping): per step the updates agree to a few (<= 4) fp32 ulps of an Adam update of size
    # <= lr * |m_hat / sqrt(v_hat)| <= 4 lr here, and the weight's rounding may then land an ulp
    # of |p| apart; over 5 steps: rtol 5 eps, atol 5 * 4 * 4 lr eps (measured: <= 6.3 eps |p| on
    # the smallest entries, all within the bound over 200 seeds)
    eps, steps, lr = torch.finfo(torch.float32).eps, 5, 0.01
    torch.testing.assert_close(v1.detach(), v2.detach(), rtol=steps * eps, atol=steps * 4 * 4 * lr * eps)
    assert ours.param_groups[1]["eps"] == 1e-8 and ours.param_groups[1]["betas"] == (0.9, 0.999)


def test_adamw_path_matches_torch_adamw_to_float64_round_off():
    # The bias corrections from the step count tensor: 1 - beta^t in fp32 had cancelled to 5
    # digits (the first update 0.9999933 where torch.optim.AdamW's is 1). In float64 the
    # two updates now agree to float64 round-off of a few dozen flops: 1e-13 relative.
    gen = torch.Generator().manual_seed(7)
    ours_p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    ref_p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    ours = Muon([{"params": [ours_p], "update": "adamw", "lr": 1.0, "weight_decay": 0.0, "eps": 0.0}])
    ref = torch.optim.AdamW([ref_p], lr=1.0, weight_decay=0.0, eps=0.0)
    for _ in range(5):
        g = torch.randn(5, generator=gen, dtype=torch.float64)
        ours_p.grad, ref_p.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.allclose(ours_p, ref_p, rtol=1e-13, atol=0), (ours_p - ref_p).abs().max()


def test_adamw_path_first_moment_of_bf16_parameters_is_torchs():
    # The first moment's lerp weight 1 - beta1 as a float, as torch.optim.AdamW takes it: a
    # tensor weight is rounded to bf16 (0.1 -> 0.10010). Bitwise over 10 steps; control: the
    # rounded weight differs.
    gen = torch.Generator().manual_seed(8)
    ours_p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    ref_p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    ours = Muon([{"params": [ours_p], "update": "adamw", "lr": 1e-3, "weight_decay": 0.0}])
    ref = torch.optim.AdamW([ref_p], lr=1e-3, weight_decay=0.0, foreach=False)
    rounded = torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(10):
        g = torch.randn(64, generator=gen).bfloat16()
        ours_p.grad, ref_p.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        rounded.lerp_(g, torch.tensor(0.1, dtype=torch.bfloat16))
    assert torch.equal(ours.state[ours_p]["exp_avg"], ref.state[ref_p]["exp_avg"])
    assert not torch.equal(rounded, ref.state[ref_p]["exp_avg"])


def test_manifold_check_detects_a_point_off_its_manifold(no_host_reads):
    model = _model("ManifoldMuon-stiefel")
    opt = ManifoldMuon([{"params": [("a", model.a), ("c", model.c)]}], manifold="stiefel")
    assert opt.check_on_manifold() == []
    with torch.no_grad():
        model.a.mul_(1.1)  # an edited checkpoint
    failures = opt.check_on_manifold(raise_error=False)
    assert [name for name, _ in failures] == ["'a'"]
    for p in (model.a, model.c):
        p.grad = torch.randn_like(p)
    a_before, c_before = model.a.detach().clone(), model.c.detach().clone()
    # the check runs on the device (no host read) and raises at the end of the step on CPU;
    # the weight off its manifold is not stepped (nor its momentum), the others are
    with no_host_reads(), pytest.raises(OffManifoldError, match="'a'.*projx"):
        opt.step()
    assert torch.equal(model.a.detach(), a_before) and not torch.equal(model.c.detach(), c_before)
    assert torch.count_nonzero(opt.state[model.a]["momentum_buffer"]) == 0
    with pytest.raises(OffManifoldError, match="'a'"):
        opt.step()  # checked again until it is back on its manifold
    opt.project_to_manifolds()
    assert opt.check_on_manifold() == []
    opt.step()


def test_a_weight_without_a_gradient_at_the_first_step_is_checked_at_its_first_step_with_one():
    # the first step had marked every weight checked, also one it did not step: an off-manifold
    # weight with no gradient then was stepped unchecked later (to a norm of 1.9e8). Control: a
    # weight on its manifold joining late steps.
    gen = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(Stiefel().random(16, 8, generator=gen).data)
    late = torch.nn.Parameter(Stiefel().random(16, 8, generator=gen).data)
    off = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
    opt = ManifoldMuon([("a", a), ("late", late), ("off", off)], manifold="stiefel", lr=0.05)
    a.grad = torch.randn(16, 8, generator=gen)
    opt.step()
    late.grad, a.grad = torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)
    before = late.detach().clone()
    opt.step()
    assert not torch.equal(late.detach(), before)
    off.grad, a.grad = torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)
    before = off.detach().clone()
    with pytest.raises(OffManifoldError, match="'off'"):
        opt.step()
    assert torch.equal(off.detach(), before)


def test_a_group_added_after_the_first_step_is_checked_on_its_manifold():
    # The first step checks every weight; a group added later was stepped unchecked (an
    # off-Stiefel weight went to norm 5e9 in one step). Control: one on its manifold steps.
    gen = torch.Generator().manual_seed(2)
    a = torch.nn.Parameter(Stiefel().random(16, 8, generator=gen).data)
    opt = ManifoldMuon([("a", a)], manifold="stiefel", lr=0.05)
    a.grad = torch.randn(16, 8, generator=gen)
    opt.step()
    on = torch.nn.Parameter(Stiefel().random(16, 8, generator=gen).data)
    opt.add_param_group({"params": [("on", on)], "manifold": "stiefel"})
    on.grad, a.grad = torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)
    opt.step()
    off = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
    opt.add_param_group({"params": [("off", off)], "manifold": "stiefel"})
    off.grad = torch.randn(16, 8, generator=gen)
    before = off.detach().clone()
    with pytest.raises(OffManifoldError, match="'off'"):
        opt.step()
    assert torch.equal(off.detach(), before)


def test_group_validation_messages():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="nonfinite"):
        Muon([{"params": [p], "nonfinite": "ignore"}])
    with pytest.raises(ValueError, match="update="):
        Muon([{"params": [p], "update": "row_norm"}])
    with pytest.raises(ValueError, match="no manifold"):
        ManifoldMuon([p])
    with pytest.raises(ValueError, match="unknown manifold"):
        ManifoldMuon([p], manifold="sphere")
    with pytest.raises(ValueError, match="object is not a geomuon.manifolds.MatrixManifold"):
        ManifoldMuon([p], manifold=object())
    with pytest.raises(ValueError, match="unknown norm"):
        ManifoldMuon([p], manifold="stiefel", norm="frobenius")


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, option", [
    (lambda p: Muon([{"params": [p], "momentum": _NAN}]), "momentum"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", momentum=1.5), "momentum"),
    (lambda p: Muon([p], eps=_NAN), "eps"),
    (lambda p: Muon([p], lr=_INF), "lr"),
    (lambda p: Muon([{"params": [p], "weight_decay": _INF}]), "weight_decay"),
    (lambda p: Muon([p], lr=True), "lr"),  # a bool had been taken as 1.0
    (lambda p: Muon([p], compute_dtype="bfloat16"), "compute_dtype"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", compute_dtype="bfloat16"), "compute_dtype"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", msign_method="polar"), "msign_method"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", msign_steps=0), "msign_steps"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", dual_smoothing=_NAN), "dual_smoothing"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", dual_smoothing=_INF), "dual_smoothing"),
    (lambda p: ManifoldMuon([p], manifold="stiefel", certify_every=-1), "certify_every"),
    (lambda p: Muon([{"params": [p], "update": "adamw", "betas": 0.9}]), "betas"),
    (lambda p: Muon([{"params": [p], "update": "adamw", "betas": (_NAN, 0.9)}]), r"betas\[0\]"),
    (lambda p: Muon([{"params": [p], "update": "adamw", "betas": (0.9, 1.5)}]), r"betas\[1\]"),
    (lambda p: Muon([{"params": [p], "update": "adamw", "eps": _NAN}]), "eps"),
    (lambda p: Muon([p], nesterov="no"), "nesterov"),  # a truthy string had switched Nesterov on
    (lambda p: ManifoldMuon([p], manifold="stiefel", nesterov=1), "nesterov"),
])
def test_bad_options_are_refused_at_construction_by_name(make, option):
    # each had been accepted: then NaN weights, a silent no-op step, or an error inside the
    # step after other groups had moved. Control: the same constructors with sound values.
    p = torch.nn.Parameter(Stiefel().random(8, 4).data)
    with pytest.raises(ValueError, match=rf"group 0: {option} must be"):
        make(p)


@pytest.mark.parametrize("make", [
    lambda p: ManifoldMuon([p], manifold="stiefel", compute_dtype=torch.float16),
    lambda p: RowNormM([p], compute_dtype=torch.float16),
    lambda p: RightPolarGradM([{"params": [p], "compute_dtype": torch.float16}]),
], ids=["ManifoldMuon", "RowNormM", "RightPolarGradM"])
def test_float16_compute_is_refused_where_the_update_computes_with_the_raw_momentum(make):
    # Their updates form products of the unnormalized momentum in compute_dtype: a gradient
    # of norm 1e5 gave NaN weights (or a LinAlgError), one of 1e-9 no step.
    p = torch.nn.Parameter(Stiefel().random(8, 4).data)
    with pytest.raises(ValueError, match=r"group 0: compute_dtype=torch.float16 cannot hold.*bfloat16"):
        make(p)


@pytest.mark.parametrize("scale", [1e6, 1e-6])
def test_muon_in_float16_takes_the_momentum_normalized(scale):
    # msign is scale-invariant, so G * scale must step as G does. fp16 holds neither 1e6 * G
    # (above 65504: NaN weights before) nor 1e-6 * G (subnormal: ~16 levels, a wrong
    # direction) unnormalized. Both runs round the same normalized matrix to fp16, up to the
    # fp32 rounding of the scaling (one ulp, 6e-8 relative, below fp16's half-ulp 4.9e-4): the
    # steps agree to a few fp16 ulps of the update (|U| <~ 1.2 after 5 Keller steps), times lr.
    torch.manual_seed(0)
    G = torch.randn(16, 8)
    steps = []
    for s in (1.0, scale):
        p = torch.nn.Parameter(torch.zeros(16, 8))
        p.grad = G * s
        Muon([p], lr=1.0, compute_dtype=torch.float16, weight_decay=0.0).step()
        steps.append(p.detach().clone())
    assert torch.isfinite(steps[1]).all()
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=4 * torch.finfo(torch.float16).eps)
    reference = Muon([p := torch.nn.Parameter(torch.zeros(16, 8))], lr=1.0, weight_decay=0.0,
                     compute_dtype=torch.float32)
    p.grad = G
    reference.step()
    assert (steps[0] - p.detach()).abs().max() < 0.02  # fp16 Newton-Schulz is Muon's step at all


def test_sound_options_are_accepted():
    p = torch.nn.Parameter(Stiefel().random(8, 4).data)
    Muon([{"params": [p], "momentum": 0.9, "eps": 1e-7, "weight_decay": 0.0}], compute_dtype=None)
    ManifoldMuon([p], manifold="stiefel", momentum=0.0, msign_method="svd", msign_steps=None,
                 certify_every=5, compute_dtype=torch.float32)
    ManifoldMuon([p], manifold="stiefel", dual_smoothing=0.1, polish_rounds=1, gram_dualizer="eigh")  # the Gram path's
    Muon([{"params": [p], "update": "adamw", "betas": [0.0, 0.99], "eps": 0.0}])


@pytest.mark.parametrize("name", FACTORIES)
def test_deepcopy_keeps_regulators_and_steps_identically(name):
    # Optimizer.__getstate__ drops subclass attributes; without MatrixOptimizer's
    # __setstate__ the copy has no regulators and its first step raises. The cap is far
    # above the weights' norms so that manifold points stay on their manifold.
    model = _model(name)
    groups = [{"params": model.matrices(), "regulate": {"name": "hard_cap", "w_max": 100.0}},
              {"params": [model.bias], "update": "adamw", "lr": 1e-2}]
    opt = FACTORIES[name](groups)
    _step(model, opt, seed=0)
    twin_model, twin_opt = copy.deepcopy((model, opt))
    for seed in (1, 2):
        _step(model, opt, seed)
        _step(twin_model, twin_opt, seed)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


def test_muon_takes_torch_optim_muons_arguments_positionally_with_its_defaults():
    # the drop-in claim: every argument of torch.optim.Muon, in its order, with its default;
    # the package's own options are keyword-only, so no positional call changes meaning.
    # torch.optim.Muon takes no maximize / foreach / differentiable: neither do we (a
    # TypeError naming the argument, not an option accepted and ignored)
    theirs = list(inspect.signature(torch.optim.Muon.__init__).parameters.values())
    ours = list(inspect.signature(Muon.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])
    p = torch.nn.Parameter(torch.randn(4, 3))
    for option in ("maximize", "foreach", "differentiable"):
        for cls in (torch.optim.Muon, Muon):
            with pytest.raises(TypeError, match=option):
                cls([p], **{option: False})


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("name", FACTORIES)
def test_a_scheduler_sets_lr_and_momentum_read_at_every_step(name, lr_kind):
    # OneCycleLR (cycle_momentum: it writes group["momentum"]) and then, chained, LambdaLR
    # zeroing lr at one step: the optimizer must use the group's values of that step, not
    # those it was built with. A tensor lr is filled in place by the schedulers.
    model = _model(name)
    opt = FACTORIES[name]([{"params": [model.a]}])
    if lr_kind == "tensor":
        opt.param_groups[0]["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8, base_momentum=0.6,
                                                    max_momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    momenta = []
    for _ in range(3):
        momentum, lr = opt.param_groups[0]["momentum"], opt.param_groups[0]["lr"]
        buffer = opt.state[model.a].get("momentum_buffer", torch.zeros_like(model.a)).clone()
        before = model.a.detach().clone()
        model.a.grad = torch.randn(model.a.shape, generator=gen)
        opt.step()
        # B <- lerp(B, G, 1 - mu) with this step's mu, computed as the optimizer does: bitwise
        assert torch.equal(opt.state[model.a]["momentum_buffer"], buffer.lerp(model.a.grad, 1 - momentum))
        assert not torch.equal(model.a.detach(), before) and float(lr) > 0
        momenta.append(momentum)
        one_cycle.step()
    assert len(set(momenta)) == 3  # control: the schedule did change the momentum
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) == (lr_kind == "tensor")
    zero_at_next = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 1 else 1.0)
    zero_at_next.step()
    assert float(opt.param_groups[0]["lr"]) == 0.0
    before = model.a.detach().clone()
    model.a.grad = torch.randn(model.a.shape, generator=gen)
    opt.step()
    # lr = 0: W <- (1 - 0 * wd) W - 0 * U is W bitwise; ManifoldMuon retracts W along a zero
    # direction, which rounds a point of its manifold: within the 16 eps that
    # check_on_manifold grants a point (measured: 0.125 eps)
    tolerance = 16 * torch.finfo(torch.float32).eps if name.startswith("ManifoldMuon") else 0.0
    torch.testing.assert_close(model.a.detach(), before, rtol=0, atol=tolerance)


@pytest.mark.parametrize("name", FACTORIES)
def test_a_group_added_after_steps_takes_the_defaults_and_steps_as_a_new_optimizer_would(name):
    model = _model(name)
    opt = FACTORIES[name]([{"params": [model.a, model.b]}])
    for seed in range(2):
        for p in (model.a, model.b):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        opt.step()
    opt.add_param_group({"params": [model.c]})
    opt.add_param_group({"params": [model.bias], "update": "adamw"})
    # an added group is checked as a constructor's is, and a refused one leaves the optimizer as it
    # was (the comparison with `fresh` below then also covers it)
    with pytest.raises(ValueError, match="group 3: momentum must be"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 3))], "momentum": 1.5})
    twin = _model(name)
    fresh = FACTORIES[name]([{"params": [twin.c]}, {"params": [twin.bias], "update": "adamw"}])
    # the options of the groups a constructor makes from the same defaults (manifolds as specs,
    # an AdamW group with torch.optim.AdamW's defaults for the keys it omits)
    for added, built in zip(opt.param_groups[1:], fresh.param_groups):
        assert {k: v for k, v in added.items() if k != "params"} == {k: v for k, v in built.items() if k != "params"}
    assert {key: opt.param_groups[2][key] for key in ADAMW_DEFAULTS} == ADAMW_DEFAULTS
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        for p, q in ((model.c, twin.c), (model.bias, twin.bias)):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        fresh.step()
    # the same update from the same state: bitwise (no update depends on its batch-mates)
    assert torch.equal(model.c.detach(), twin.c.detach()) and torch.equal(model.bias.detach(), twin.bias.detach())


@pytest.mark.parametrize("name", FACTORIES)
def test_step_hooks_closure_and_no_autograd_graph(name):
    # pre and post step hooks once each, around one evaluation of the closure with grad
    # enabled (step() runs under no_grad); the loss returned is the closure's; the step
    # builds no graph: parameters stay leaves, no state tensor has a grad_fn
    model = _model(name)
    opt = FACTORIES[name](_groups(model))
    events = []
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: events.append("pre"))
    opt.register_step_post_hook(lambda optimizer, args, kwargs: events.append("post"))
    opt.register_state_dict_pre_hook(lambda optimizer: events.append("state_dict"))
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))

    def closure():
        events.append(("closure", torch.is_grad_enabled()))
        opt.zero_grad()
        loss = model.loss(x)
        loss.backward()
        return loss

    with torch.no_grad():  # as in a loop that steps inside no_grad: the closure still needs grad
        loss = opt.step(closure)
    assert events == ["pre", ("closure", True), "post"] and loss.grad_fn is not None
    opt.state_dict()
    assert events[-1] == "state_dict"
    for p in model.parameters():
        assert p.is_leaf and p.grad_fn is None and p.requires_grad
        assert all(not (isinstance(v, torch.Tensor) and (v.requires_grad or v.grad_fn is not None))
                   for v in opt.state[p].values())


@pytest.mark.parametrize("name", FACTORIES)
def test_a_parameter_without_gradient_keeps_its_weight_and_state(name):
    # a frozen (or unused) parameter at one step: weight and every state entry bitwise as they
    # were (momentum, step counts, ManifoldMuon's warm start); the others step
    model = _model(name)
    opt = FACTORIES[name](_groups(model))
    _step(model, opt, seed=0)
    _step(model, opt, seed=1)
    frozen_state = copy.deepcopy(opt.state[model.c])
    c_before, a_before = model.c.detach().clone(), model.a.detach().clone()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(2))
    opt.zero_grad(set_to_none=True)
    model.loss(x).backward()
    model.c.grad = None
    opt.step()
    assert torch.equal(model.c.detach(), c_before) and not torch.equal(model.a.detach(), a_before)
    assert opt.state[model.c].keys() == frozen_state.keys()
    for key, value in frozen_state.items():
        assert torch.equal(opt.state[model.c][key], value), key


# ----------------------------------------------------------------------------- no host sync

def test_the_read_guard_catches_each_kind_of_read(no_host_reads):
    x = torch.ones(3)
    for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x.all()), lambda: float(x.sum()),
                 lambda: int(x.sum()), lambda: x.sum() > 0 and None):
        with no_host_reads(), pytest.raises(RuntimeError, match="host read"):
            read()


# the library's own manifolds: test modules collected before this one register theirs
# (with constructor arguments, or host reads of their own) into the same registry
_MANIFOLDS = sorted(name for name, cls in MatrixManifold.registered().items() if cls.__module__.startswith("geomuon."))
# every matrix optimizer, every manifold of the registry, with regulators (HardCap is left
# out: its number of capping passes is read from the weight, a documented host read)
SYNC_FREE = {  # name: (optimizer, the matrix group's regulator)
    "Muon": (lambda g: Muon(g, lr=0.02), {"name": "soft_cap", "w_max": 4.0}),
    "RowNormM": (lambda g: RowNormM(g, lr=0.01, weight_decay=0.01), "spectral_normalize"),
    "RightPolarGradM": (lambda g: RightPolarGradM(g, lr=1e-3), ["weight_decay", "spectral_hammer"]),
    "LeftPolarGradM": (lambda g: LeftPolarGradM(g, lr=1e-3, centered=True), "column_cap"),
    "HybridPolarGradM": (lambda g: HybridPolarGradM(g, lr=1e-3), "spectral_weight_decay"),
    **{f"ManifoldMuon-{name}": ((lambda name: lambda g: ManifoldMuon(g, lr=0.02, manifold=name, weight_decay=0.1))(name),
                                None) for name in _MANIFOLDS},
}


@pytest.mark.parametrize("name", SYNC_FREE)
def test_step_reads_nothing_back_from_the_device(name, no_host_reads):
    # Tall, wide, square and two same-shape matrices, an AdamW vector, warm-started steps,
    # and a non-finite gradient in one step: the whole step() runs under the read guard.
    gen = torch.Generator().manual_seed(7)
    manifold = MatrixManifold.by_name(name.split("-")[1])() if name.startswith("ManifoldMuon") else None
    shapes = [(12, 6), (12, 6), (6, 10), (8, 8)]
    matrices = [torch.nn.Parameter(manifold.random(*s, generator=gen).detach() if manifold else torch.randn(s, generator=gen))
                for s in shapes]
    vector = torch.nn.Parameter(torch.randn(5, generator=gen))
    factory, regulate = SYNC_FREE[name]
    opt = factory([{"params": matrices, "regulate": regulate}, {"params": [vector], "update": "adamw"}])
    # the first step too (ManifoldMuon's checks every weight is on its manifold, on the device)
    for k in range(4):
        for p in [*matrices, vector]:
            p.grad = torch.randn(p.shape, generator=gen)
        if k == 2:
            matrices[1].grad[0, 0] = float("nan")
        # the deferred non-finite report reads host memory through NumPy (see
        # optimizers.base._SkippedSteps): on CUDA a completed pinned copy, no sync
        with no_host_reads(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report of step 1 at the start of step 2
            opt.step()
    assert all(torch.isfinite(p).all() for p in [*matrices, vector])
    assert opt.check_finite() == {} and opt._skipped.report(opt, wait=True) == {}


def test_named_parameters_gives_the_names_the_reports_use():
    # the names a report keys by (here: skipped steps) are the ones named_parameters yields,
    # for named groups and unnamed ones (torch allows one kind per optimizer)
    gen = torch.Generator().manual_seed(0)
    for groups, expected in [(lambda ps: [{"params": ps[:2], "param_names": ["a", "b"]}], ["'a'", "'b'"]),
                             (lambda ps: [{"params": ps[:1]}, {"params": ps[1:2]}],
                              ["#0 of param group 0", "#0 of param group 1"])]:
        params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(2)]
        opt = Muon(groups(params), lr=0.02)
        names = dict(opt.named_parameters())
        assert list(names) == expected and all(p is q for p, q in zip(names.values(), params))
        params[0].grad = torch.randn(4, 3, generator=gen)
        params[1].grad = torch.full((4, 3), float("nan"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
            assert opt.check_finite() == {expected[1]: 1}


@pytest.mark.parametrize("make", [lambda p: Muon([p]), lambda p: ManifoldMuon([p], manifold="stiefel")],
                         ids=["Muon", "ManifoldMuon"])
def test_a_refused_param_group_leaves_the_optimizer_as_it_was(make):
    # torch appends the group before our checks run: a refused one had stayed in param_groups,
    # and the next step failed with an IndexError. Control: the optimizer steps as before.
    p = torch.nn.Parameter(Stiefel().random(8, 4).data)
    q = torch.nn.Parameter(Stiefel().random(8, 4).data)
    opt = make(p)
    with pytest.raises(ValueError, match="momentum must be"):
        opt.add_param_group({"params": [q], "momentum": 2.0})
    assert len(opt.param_groups) == 1
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p.detach(), before)
    opt.add_param_group({"params": [q]})  # and a sound group is still welcome
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("make", [lambda g: Muon(g), lambda g: ManifoldMuon(g, manifold="stiefel"),
                                  lambda g: RightPolarGradM(g)], ids=["Muon", "ManifoldMuon", "RightPolarGradM"])
def test_an_adamw_group_refuses_the_matrix_updates_options(make):
    # they had been kept and ignored: momentum=0.5 in an AdamW group did nothing. Control: AdamW's
    # own keys are taken.
    v = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"update='adamw' group takes .* not \['momentum'\]"):
        make([{"params": [v], "update": "adamw", "momentum": 0.5}])
    make([{"params": [v], "update": "adamw", "lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}])


@pytest.mark.parametrize("option", [dict(maximize=True), dict(amsgrad=True), dict(fused=True)])
def test_an_adamw_group_refuses_torch_adamw_options_it_does_not_implement(option):
    # a group moved over from torch.optim.AdamW had kept them and ignored them: maximize=True
    # minimized (0.054 from torch.optim.AdamW's weights after three steps). Control: torch's
    # default values, which it steps as, and foreach=False, which steps as they do, are taken.
    v = torch.nn.Parameter(torch.randn(5))
    (key,) = option
    with pytest.raises(ValueError, match=rf"update='adamw' group steps as torch.optim.AdamW with .* not \{{'{key}'"):
        Muon([{"params": [v], "update": "adamw", **option}])
    Muon([{"params": [v], "update": "adamw", "maximize": False, "amsgrad": False, "foreach": False, "fused": None}])


@pytest.mark.parametrize("make", [lambda g: Muon(g), lambda g: ManifoldMuon(g, manifold="stiefel"),
                                  lambda g: RightPolarGradM(g)], ids=["Muon", "ManifoldMuon", "RightPolarGradM"])
def test_a_matrix_group_refuses_adamws_betas(make):
    # the converse: betas=(0.8, 0.99) in a matrix group (a MuonWithAuxAdam group translated
    # halfway) had been kept and ignored, its momentum the default. Control: momentum is taken,
    # and so are betas once the group is an AdamW one.
    W = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"group reads momentum, not betas"):
        make([{"params": [W], "betas": (0.8, 0.99)}])
    make([{"params": [W], "momentum": 0.8}])
    make([{"params": [W], "update": "adamw", "betas": (0.8, 0.99)}])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("update", ["muon", "adamw"])
def test_low_precision_weight_decay_rounds_the_product_once(update, dtype):
    # W <- (1 - lr wd) W as torch.optim.AdamW / Muon form it, p.mul_(1 - lr * wd): the product in
    # fp32, rounded once to the weights' dtype. The masked (one-process) path had rounded the
    # factor to the weights' dtype first: bf16(1 - 0.02 * 0.1) = 0.99609375 (a 2x stronger
    # decay; the sharded path, without a mask, did not). A zero gradient makes the update 0
    # (msign(0) = 0; AdamW: 0 / (0 + eps)), so the weights are the decay alone: bitwise.
    lr, weight_decay = 0.02, 0.1
    start = torch.randn(256, 256, generator=torch.Generator().manual_seed(5)).to(dtype)
    p = torch.nn.Parameter(start.clone())
    group = {"params": [p], "lr": lr, "weight_decay": weight_decay}
    opt = Muon([dict(group, update="adamw") if update == "adamw" else group])
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), start.clone().mul_(1 - lr * weight_decay))
    rounded_factor = torch.tensor(1 - lr * weight_decay, dtype=dtype)
    assert not torch.equal(p.detach(), start * rounded_factor)  # control: the rounded factor differs


@pytest.mark.parametrize("edit, message", [
    ((0, "nesterov", "no"), "group 0: nesterov must be True or False"),  # a truthy string had switched it on
    ((0, "ns_steps", 200), "group 0: ns_steps must be in"),
    ((0, "nonfinite", "ignore"), "group 0: nonfinite must be one of"),
    ((0, "momentum", 1.5), r"group 0: momentum must be a number in \[0, 1\)"),  # a schedule's key, checked by value
    ((1, "betas", (0.9, 1.5)), r"group 1: betas\[1\] must be a number in \[0, 1\)"),
    ((0, "lr", -0.1), "group 0: lr must be a finite number >= 0"),
])
def test_a_param_group_edited_between_steps_is_checked_before_any_group_steps(edit, message):
    # param-group edits had skipped every check: momentum=1.5 or nesterov="no" stepped, and a
    # bad value in a later group raised after the earlier groups had moved
    gen = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = Muon([{"params": [W]}, {"params": [b], "update": "adamw"}], lr=0.02)
    for p in (W, b):
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    before = [W.detach().clone(), b.detach().clone()]
    index, key, value = edit
    opt.param_groups[index][key] = value
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert torch.equal(W, before[0]) and torch.equal(b, before[1])  # nothing was stepped


def _muon_after_one_step(gen: torch.Generator) -> tuple[torch.nn.Parameter, Muon]:
    """An 8x4 weight and a Muon (lr 0.02) that has stepped it once: a group checked, to edit."""
    W = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    opt = Muon([W], lr=0.02)
    W.grad = torch.randn(W.shape, generator=gen)
    opt.step()
    return W, opt


@pytest.mark.parametrize("appended", ["vector", "matrix"])
def test_a_tensor_put_into_a_groups_params_between_steps_is_checked_before_any_group_steps(appended):
    # the parameter list is part of the checked group: a 1-D tensor appended to a matrix group's
    # params after the first step had reached Muon's matrix update unrefused. Control: an
    # appended matrix steps (and the group is not refused again at the following step).
    gen = torch.Generator().manual_seed(0)
    W, opt = _muon_after_one_step(gen)
    late = torch.nn.Parameter(torch.randn((8,) if appended == "vector" else (8, 4), generator=gen))
    opt.param_groups[0]["params"].append(late)
    for p in (W, late):
        p.grad = torch.randn(p.shape, generator=gen)
    before = [W.detach().clone(), late.detach().clone()]
    if appended == "vector":
        with pytest.raises(ValueError, match=r"^Muon: parameter #1 of param group 0 has shape \(8,\); .*update='adamw'.*"
                                             r"\(an edited param group; nothing was stepped\)"):
            opt.step()
        assert torch.equal(W, before[0]) and torch.equal(late, before[1])
    else:
        for _ in range(2):
            opt.step()
        assert not torch.equal(W, before[0]) and not torch.equal(late, before[1])


def test_schedules_and_valid_edits_step_and_an_unedited_group_is_not_checked_again(monkeypatch):
    # OneCycleLR rewrites lr and momentum every step (checked by value, no group check), and an
    # equal tuple of coefficients put back is no edit (compared by identity, as the params are,
    # it had been checked again at every step); a valid edit is checked once and takes effect
    # (control for the test above)
    gen = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    opt = Muon([W], lr=0.02)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    checks = []
    validate = opt._validate_group
    monkeypatch.setattr(opt, "_validate_group", lambda *args: checks.append(args) or validate(*args))
    for _ in range(4):
        W.grad = torch.randn(W.shape, generator=gen)
        opt.param_groups[0]["ns_coefficients"] = tuple(float(str(c)) for c in opt.param_groups[0]["ns_coefficients"])
        opt.step()
        schedule.step()
    assert checks == []
    for edit in (dict(ns_steps=3), dict(ns_coefficients=(3.0, -3.2, 1.2))):
        opt.param_groups[0].update(edit)
        for _ in range(2):
            W.grad = torch.randn(W.shape, generator=gen)
            opt.step()
    assert len(checks) == 2


def test_a_learning_rate_tensor_that_requires_grad_is_checked_without_a_warning():
    # float() of a requires_grad tensor warns ("Converting a tensor with requires_grad=True to a
    # scalar"): the check reads the detached value
    lr = torch.tensor(0.02, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([torch.nn.Parameter(torch.randn(4, 3))], lr=lr)
    with pytest.raises(ValueError, match="group 0: lr must be a finite number >= 0"):  # still checked
        Muon([torch.nn.Parameter(torch.randn(4, 3))], lr=torch.tensor(float("nan"), requires_grad=True))


@pytest.mark.parametrize("path", [dict(norm="row"), dict(msign_method="svd"), dict(retraction="manifold")])
@pytest.mark.parametrize("option", [dict(polish_rounds=3), dict(polish_method="admm"), dict(dual_smoothing=0.1),
                                    dict(gram_dualizer="eigh"), dict(dual_update="newton")])
def test_the_gram_paths_options_are_refused_where_no_matrix_takes_it(path, option):
    # off the Gram path they had been accepted and ignored (norm="row", polish_rounds=3: no polish)
    p = torch.nn.Parameter(Stiefel().random(8, 4).data)
    name = next(iter(option))
    with pytest.raises(ValueError, match=rf"group 0: {name}=.* would be ignored: they are options of the Gram path"):
        ManifoldMuon([p], manifold="stiefel", **path, **option)
    ManifoldMuon([p], manifold="stiefel", **path)  # control: the path itself is accepted
    ManifoldMuon([p], manifold="stiefel", **option)  # and the option on the Gram path


def test_a_tensor_lr_swapped_in_is_checked_once_and_an_in_place_schedule_is_not(monkeypatch):
    # a float lr swapped for a tensor had skipped every check (NaN reached the weights); a
    # schedule that updates the tensor in place (fill_, as torch's schedulers do) is no edit
    gen = torch.Generator().manual_seed(0)
    W, opt = _muon_after_one_step(gen)
    before = W.detach().clone()
    opt.param_groups[0]["lr"] = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match="group 0: lr must be a finite number >= 0"):
        opt.step()
    assert torch.equal(W, before)
    opt.param_groups[0]["lr"] = lr = torch.tensor(0.02)  # control: a sound tensor steps
    opt.step()
    assert not torch.equal(W, before)
    checks = []
    validate = opt._validate_group
    monkeypatch.setattr(opt, "_validate_group", lambda *args: checks.append(args) or validate(*args))
    lr.fill_(0.01)  # in place: not an edit (a group check would read the tensor)
    opt.step()
    assert checks == []


def test_a_group_edited_to_another_manifold_checks_its_weights_on_it():
    # a DGram weight whose group was edited to Stiefel had stepped off the new manifold (norm 9e14)
    torch.manual_seed(0)
    p = torch.nn.Parameter(3 * DGram().projx(torch.randn(16, 8)))
    opt = ManifoldMuon([{"params": [p], "manifold": "dgram"}])
    p.grad = torch.randn(16, 8)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["manifold"] = "stiefel"
    p.grad = torch.randn(16, 8)
    with pytest.raises(OffManifoldError):
        opt.step()
    assert torch.equal(p, before)
