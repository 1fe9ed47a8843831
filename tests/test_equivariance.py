"""The generic equivariance machinery, on small maps and optimizers written here, plus the
checker's own negative controls: a wrong declaration must be reported."""

import pytest
import torch

from geomuon import cli as geomuon_cli
from geomuon.optimizers import maps
from geomuon.theory.equivariance import (
    MUST_FAIL_RESIDUAL,
    MapUpdate,
    OptimizerUpdate,
    assert_equivariant,
    check_equivariance,
    condition_number,
    map_residual,
    random_matrix,
    roundoff_tolerance,
    step_residual,
    verify_declaration,
)
from geomuon.theory.groups import BiOrthogonal, RouterShift, SignedPermutation


def cubic(D):
    """D D^T D: a matrix polynomial, O_m x O_n-equivariant."""
    return D @ D.mT @ D


def masked(D):
    """Multiplies by a fixed pattern: equivariant under nothing but the identity."""
    mask = torch.arange(D.numel(), dtype=D.dtype).reshape(D.shape) % 3
    return D * mask


def centered_cubic(D):
    centered = D - D.mean(dim=-2, keepdim=True)
    out = cubic(centered)
    return out - out.mean(dim=-2, keepdim=True)


def test_random_matrix_has_the_requested_condition_number():
    for shape in [(5, 3), (3, 5), (4, 4)]:
        X = random_matrix(shape, torch.Generator().manual_seed(0), condition=50.0)
        assert abs(condition_number(X) - 50.0) < 1e-9
    assert condition_number(torch.zeros(3, 3, dtype=torch.float64)) == float("inf")


def test_roundoff_tolerance_scales_with_dtype_condition_and_depth():
    base = roundoff_tolerance(torch.float64, condition=1.0, size=4, depth=1)
    assert base == pytest.approx(4 * 8 * torch.finfo(torch.float64).eps)
    assert roundoff_tolerance(torch.float64, condition=10.0, size=4, depth=1) == pytest.approx(10 * base)
    assert roundoff_tolerance(torch.float64, condition=1.0, size=4, depth=3) == pytest.approx(3 * base)
    assert roundoff_tolerance(torch.float32, condition=1.0, size=4, depth=1) > 1e8 * base


def test_polynomial_map_holds_and_masked_map_fails():
    report = assert_equivariant(cubic, "bi-orthogonal", (5, 3), trials=4)
    assert max(report.residuals) < 1e-13
    bad = check_equivariance(masked, BiOrthogonal(), (5, 3), trials=4)
    assert not bad.passed
    assert min(bad.residuals) > MUST_FAIL_RESIDUAL
    with pytest.raises(AssertionError, match="FAIL"):
        assert_equivariant(masked, "bi-orthogonal", (5, 3), trials=2)


def test_expect_fails_reports_a_map_that_actually_holds():
    with pytest.raises(AssertionError, match="holds here"):
        assert_equivariant(cubic, "bi-orthogonal", (4, 3), trials=2, expect="fails")
    assert_equivariant(masked, "bi-orthogonal", (4, 3), trials=2, expect="fails")


def test_invariance_to_shifts_uses_the_trivial_output_action():
    gen = torch.Generator().manual_seed(1)
    element = RouterShift().sample((5, 3), gen)
    D = random_matrix((5, 3), gen)
    assert map_residual(centered_cubic, element, D) < 1e-13
    assert map_residual(cubic, element, D) > MUST_FAIL_RESIDUAL


def test_residual_is_exactly_zero_for_an_exactly_equivariant_map():
    gen = torch.Generator().manual_seed(2)
    element = SignedPermutation().sample((4, 4), gen)
    assert map_residual(torch.sign, element, random_matrix((4, 4), gen)) == 0.0


class MomentumWithExtraState(torch.optim.Optimizer):
    """Heavy-ball SGD with an attribute set in __init__ (which copy.deepcopy would drop
    through Optimizer.__getstate__) and a per-parameter buffer."""

    def __init__(self, params, lr=0.1, momentum=0.9, coordinatewise=False):
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.coordinatewise = coordinatewise

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = buf.sign() if self.coordinatewise else buf
                p.sub_(group["lr"] * update)


def test_step_residual_tracks_momentum_and_leaves_the_optimizer_untouched():
    gen = torch.Generator().manual_seed(3)
    W = torch.nn.Parameter(random_matrix((5, 3), gen))
    before = W.detach().clone()
    optimizer = MomentumWithExtraState([W])
    element = BiOrthogonal().sample((5, 3), gen)
    gradients = [random_matrix((5, 3), gen) for _ in range(3)]
    assert step_residual(optimizer, element, gradients) < 1e-13
    assert torch.equal(W.detach(), before) and not optimizer.state
    sign_optimizer = MomentumWithExtraState([W], coordinatewise=True)
    assert step_residual(sign_optimizer, element, gradients) > MUST_FAIL_RESIDUAL


def test_optimizer_update_subject_builds_fresh_parameters():
    holds = OptimizerUpdate(lambda p: MomentumWithExtraState(p), name="heavy ball")
    report = check_equivariance(holds, BiOrthogonal(), (4, 3), trials=3)
    assert report.passed and max(report.residuals) < 1e-12
    fails = OptimizerUpdate(lambda p: MomentumWithExtraState(p, coordinatewise=True), name="sign")
    assert not check_equivariance(fails, BiOrthogonal(), (4, 3), trials=3).passed


def test_a_wrong_declaration_is_reported():
    """row_norm declared bi-orthogonal: the checker must fail, shrink, and print matrices."""
    with pytest.raises(AssertionError) as caught:
        verify_declaration(MapUpdate(maps.row_norm, name="row_norm"), "bi-orthogonal", "holds")
    message = str(caught.value)
    assert "row_norm under bi-orthogonal" in message and "declared: holds" in message


def test_a_wrong_must_fail_declaration_is_reported():
    with pytest.raises(AssertionError, match="declared to fail"):
        verify_declaration(MapUpdate(maps.spectral, name="spectral"), "bi-orthogonal", "fails", max_examples=5)


def test_shrunk_counterexample_is_small_and_printed_as_matrices(capsys):
    case = verify_declaration(MapUpdate(maps.row_norm, name="row_norm"), "bi-orthogonal", "fails")
    assert case.shape == (2, 2)
    text = repr(case)
    assert "tensor([[" in text and "L =" in text


def test_cli_exit_codes_and_table(capsys):
    assert geomuon_cli.main(["check-equivariance", "geomuon.optimizers.maps:spectral", "--group", "bi-orthogonal",
                             "--shape", "5x3", "--trials", "2"]) == 0
    out = capsys.readouterr().out
    assert "spectral under bi-orthogonal" in out and "PASS" in out
    assert geomuon_cli.main(["check-equivariance", "geomuon.optimizers.maps:row_norm", "--group", "BiOrthogonal",
                             "--shape", "5x3", "--trials", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "NOT equivariant" in out
    assert geomuon_cli.main(["check-equivariance", "geomuon.optimizers.maps:row_norm", "--group", "bi-orthogonal",
                             "--expect", "fails", "--trials", "2"]) == 0
    assert geomuon_cli.main(["check-equivariance", "geomuon.optimizers.maps:nope", "--group", "bi-orthogonal"]) == 2
    assert geomuon_cli.main(["check-equivariance", "geomuon.optimizers.maps:sign", "--group", "bi-orthogonal",
                             "--shape", "5by3"]) == 2
    assert "--shape must look like" in capsys.readouterr().err


def test_step_residual_is_relative_to_the_path_not_the_distance_from_the_start():
    # SGD with gradients G then -G comes back to W_0 up to round-off: measured against the
    # distance from the start (~1e-17) that round-off looked like an O(1) residual.
    gen = torch.Generator().manual_seed(3)
    W = torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=torch.float64))
    G = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    optimizer = torch.optim.SGD([W], lr=0.1)
    element = BiOrthogonal().sample((5, 3), gen)
    assert step_residual(optimizer, element, [G, -G]) < 1e-13
