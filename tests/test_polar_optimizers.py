"""RowNormM and the PolarGrad optimizers: the seed-004 skeleton with each update map."""

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
    for _ in range(5):
        W.grad = torch.randn(8, 16, generator=gen) + 3.0  # a shared shift in the gradient
        opt.step()
    # the shift never enters and re-centering removes drift: column sums stay at round-off
    assert W.detach().sum(0).abs().max().item() < 1e-5
    uncentered = torch.nn.Parameter(torch.zeros(8, 16))
    plain = cls([uncentered], lr=1e-2)
    uncentered.grad = torch.randn(8, 16, generator=gen) + 3.0
    plain.step()
    assert uncentered.detach().sum(0).abs().max().item() > 1e-3  # negative control


def test_bad_momentum():
    with pytest.raises(ValueError, match="momentum"):
        RowNormM([torch.nn.Parameter(torch.randn(3, 3))], momentum=1.0)
