"""RowNormM and the PolarGrad optimizers: the seed-004 skeleton with each update map."""

import re
import warnings

import pytest
import torch

from geomuon.optimizers import HybridPolarGradM, LeftPolarGradM, RightPolarGradM, RowNormM, maps

CASES = [
    (RowNormM, "row_norm", {}),
    (RightPolarGradM, "right_polar", {"alpha": 1.0}),
    (LeftPolarGradM, "left_polar", {"alpha": 0.0}),
    (HybridPolarGradM, "hybrid", {"alpha": 1.0}),
]


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("cls,map_name,map_kwargs", CASES, ids=[c[0].__name__ for c in CASES])
def test_step_is_the_skeleton_with_the_map(cls, map_name, map_kwargs, centered):
    gen = torch.Generator().manual_seed(0)
    W0 = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    grads = [torch.randn(10, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
    lr, wd, beta = 1e-2, 0.1, 0.9
    W = torch.nn.Parameter(W0.clone())
    opt = cls([W], lr=lr, weight_decay=wd, momentum=beta, centered=centered, **map_kwargs)
    update = maps.MAPS[("centered_" if centered else "") + map_name]
    expected, M = W0.clone(), torch.zeros_like(W0)
    for g in grads:
        W.grad = g.clone()
        opt.step()
        M = beta * M + (1 - beta) * g  # the reference skeleton: EMA, no Nesterov
        expected = expected * (1 - lr * wd) - lr * update(M, **map_kwargs)
    # same float64 formula, same kernels: agreement to fp64 round-off
    assert torch.allclose(W.detach(), expected, atol=1e-12)


@pytest.mark.parametrize("cls", [RowNormM, LeftPolarGradM, HybridPolarGradM])
def test_centered_updates_keep_a_router_centered(cls):
    gen = torch.Generator().manual_seed(1)
    W = torch.nn.Parameter(torch.randn(8, 16, generator=gen))
    with torch.no_grad():
        W.sub_(W.mean(0))
    opt = cls([W], lr=1e-2, centered=True)
    steps = 5
    for _ in range(steps):
        W.grad = torch.randn(8, 16, generator=gen) + 3.0  # a shared shift in the gradient
        opt.step()
    # the shift never enters and re-centering removes drift: column sums stay at round-off.
    # The centering and every step round each of a column's m entries once (u |W| each, U's
    # own column sums, m u |U| times lr, are smaller), and summing them adds as much again:
    # |sum_i W_ij| <= 2 (steps + 1) m u max|W| in fp32
    m, u = W.shape[0], torch.finfo(torch.float32).eps / 2
    assert W.detach().sum(0).abs().max() <= 2 * (steps + 1) * m * u * W.detach().abs().max()
    uncentered = torch.nn.Parameter(torch.zeros(8, 16))
    plain = cls([uncentered], lr=1e-2)
    uncentered.grad = torch.randn(8, 16, generator=gen) + 3.0
    plain.step()
    assert uncentered.detach().sum(0).abs().max().item() > 1e-3  # negative control


def test_bad_momentum():
    with pytest.raises(ValueError, match="momentum"):
        RowNormM([torch.nn.Parameter(torch.randn(3, 3))], momentum=1.0)


BAD_OPTIONS = [
    ("alpha", float("nan")), ("alpha", "1"), ("eps", -1.0), ("eps", float("inf")),
    ("centered", "no"), ("nesterov", "yes"),
]


@pytest.mark.parametrize("cls", [c[0] for c in CASES], ids=[c[0].__name__ for c in CASES])
@pytest.mark.parametrize("key,value", BAD_OPTIONS, ids=[f"{k}={v!r}" for k, v in BAD_OPTIONS])
def test_options_are_refused_before_any_step(cls, key, value):
    # They had been accepted: NaN alpha and a negative eps were refused by the map inside the
    # first step, after the momentum had moved (a retried step counted the gradient twice);
    # a truthy string switched centering or Nesterov on.
    W = torch.nn.Parameter(torch.randn(5, 3))
    with pytest.raises(ValueError, match=f"group 0: {key} must be"):
        cls([W], **{key: value})
    # a saved group with the option is refused by load_state_dict, naming it
    opt = cls([W])
    saved = opt.state_dict()
    saved["param_groups"][0][key] = value
    with pytest.raises(ValueError, match=f"load_state_dict: the saved group 0: {key} must be"):
        opt.load_state_dict(saved)


def test_float16_weights_take_the_polar_step_their_range_holds():
    # ||G||_* msign(G) of a 64 x 64 gradient of entries up to 1800 reaches ~1e5, beyond fp16's
    # 65504: the map's fp16 copy was inf and so were the weights, though the step lr U is ~100.
    gen = torch.Generator().manual_seed(2)
    G = (torch.randn(64, 64, generator=gen).clamp(-3, 3) * 600).half()  # ||G||_F ~ 4e4: finite in fp16
    W = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float16))
    lr = 1e-3
    opt = RightPolarGradM([W], lr=lr, momentum=0.0)
    W.grad = G.clone()
    opt.step()
    update = maps.right_polar(G.float())  # the map on the same (momentum = G) input, in fp32
    assert update.abs().max() > torch.finfo(torch.float16).max  # the case: U itself leaves fp16
    expected = (-lr * update).double()
    # W = 0 - lr U: one fp32 product (u_32) and one rounding to fp16 (u_16 = 2^-11) per entry
    bound = torch.finfo(torch.float16).eps / 2 + torch.finfo(torch.float32).eps
    assert ((W.detach().double() - expected).abs() <= bound * expected.abs()).all()


def test_skipped_step_with_negative_alpha_leaves_the_weights():
    # a non-finite gradient's matrix arrives at the map as exactly 0; hybrid had sent it to NaN
    # at alpha < 0 (0 * 0^alpha), and the NaN update was written into the weights
    W = torch.nn.Parameter(torch.randn(6, 4))
    before = W.detach().clone()
    opt = HybridPolarGradM([W], lr=1e-2, alpha=-0.5)
    W.grad = torch.full((6, 4), float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
        opt.check_finite()
    assert torch.equal(W.detach(), before)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("cls", [RightPolarGradM, LeftPolarGradM, HybridPolarGradM], ids=lambda c: c.__name__)
def test_a_finite_gradient_whose_update_overflows_takes_a_zero_update(cls, centered, no_host_reads):
    # alpha < 0 and a tiny gradient: ||M||_*^alpha leaves float32 (entries 1e-43, 1e42 at alpha = -1;
    # hybrid's row-normalized momentum: entries 1e-30, about 1e44 at alpha = -2, see test_maps), and
    # the step had written inf into the weights with no report. The map gives 0 for that matrix (documented): the weights move by their
    # weight decay only, the momentum as usual, no value is read back in the step, and nothing is
    # reported (the gradient was finite).
    W = torch.nn.Parameter(torch.randn(16, 8))
    before = W.detach().clone()
    lr, wd = 1e-3, 0.5
    opt = cls([W], lr=lr, weight_decay=wd, alpha=-2.0 if cls is HybridPolarGradM else -1.0, centered=centered)
    W.grad = torch.randn(16, 8) * (1e-30 if cls is HybridPolarGradM else 1e-43)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no report
        with no_host_reads():
            opt.step()
        opt.check_finite()
    # the decay: one float32 product per entry
    torch.testing.assert_close(W.detach(), before * (1 - lr * wd), rtol=torch.finfo(torch.float32).eps, atol=0)
    assert opt.state[W]["momentum_buffer"].abs().max() > 0

@pytest.mark.parametrize("cls", [c[0] for c in CASES], ids=[c[0].__name__ for c in CASES])
def test_docstring_math_has_no_latex_line_breaks(cls):
    # "$\\eta$" in the raw docstring is a LaTeX line break followed by the letters e, t, a:
    # the API reference showed "eta", "beta", "lambda" where it meant the symbols
    spans = re.findall(r"\$([^$]+)\$", cls.__doc__)
    assert spans and not [span for span in spans if "\\\\" in span]
