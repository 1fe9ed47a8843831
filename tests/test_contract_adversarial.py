"""Deliberately broken manifolds against :func:`check_manifold_contract`, each beside its
unbroken parent (same shape, seed and dtype) as the negative control.

Every break here had passed the contract. The bounds are the contract's own
(:func:`default_tolerance`, ``CENTRAL_DIFFERENCE_BOUND``, ``MIN_RETRACTION_SLOPE``, whose
comments derive them); each break is sized orders of magnitude past them and each unbroken
parent sits orders below, so no test depends on a seed's luck.
"""

import pytest
import torch

from geomuon.manifolds import LPRO, DGram, MatrixManifold, Oblique, Stiefel
from geomuon.theory.contracts import check_manifold_contract

DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
SHAPE = (6, 4)


def failed_checks(manifold, dtype, shape=SHAPE):
    """Names of the failed checks (the unbroken parent must give ``[]``)."""
    report = check_manifold_contract(manifold, shape, dtype=dtype, seed=0, raise_on_failure=False)
    return [check.name for check in report.failures]


def fixed_gaussian(x, seed):
    """A Gaussian matrix of ``x``'s shape and dtype, the same for every call."""
    return torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(seed))


class SlightlyStretchedRetraction(Stiefel):
    r"""$R_x(u) = \operatorname{msign}(x + (1 + 10^{-5})u)$: on $M$, but $dR_x(0) = (1 + 10^{-5})\,\mathrm{id}$.
    Over the slope check's steps ($10^{-4}..10^{-2}$) the error $10^{-5}t$ hides under $t^2$."""

    def retr(self, x, u):
        return super().retr(x, (1 + 1e-5) * u)


class KinkedRetraction(Stiefel):
    r"""$R_x(u) = \operatorname{msign}(x + u + 10^{-3}\|u\|G)$: not differentiable at 0 (an error
    $10^{-3}t$, even in $t$, so a central difference cancels it); float32's slope steps
    ($10^{-2}..10^{-1}$) let $t^2$ hide it."""

    def retr(self, x, u):
        kink = 1e-3 * u.norm(dim=(-2, -1), keepdim=True) * fixed_gaussian(x, 1)
        return super().retr(x, u + kink)


@DTYPES
def test_a_slightly_wrong_retraction_derivative_is_caught(dtype):
    assert failed_checks(Stiefel(), dtype) == []
    assert "retr_derivative" in failed_checks(SlightlyStretchedRetraction(), dtype)


def test_a_kinked_retraction_is_caught_in_float32():
    assert failed_checks(Stiefel(), torch.float32) == []
    assert "retr_slope" in failed_checks(KinkedRetraction(), torch.float32)


class _NormNotSquared:
    r"""``inner(x, u)`` returns $\|u\|$ instead of $\|u\|^2$ (what geoopt's RiemannianAdam reads
    as the squared gradient norm); ``inner(x, u, v)`` is right. Mixed into a manifold."""

    def inner(self, x, u, v=None, *, keepdim=False):
        if v is None:
            return u.norm(dim=(-2, -1), keepdim=keepdim)
        return super().inner(x, u, v, keepdim=keepdim)


class NormNotSquared(_NormNotSquared, Stiefel):
    """Stiefel with the squared norm wrong."""


class AsymmetricMetric(Stiefel):
    r"""$g(u, w) = \langle u, w\rangle + c(\langle u, a\rangle\langle w, b\rangle
    - \langle u, b\rangle\langle w, a\rangle)$ for orthonormal tangent $a, b$ at $x$: not symmetric,
    yet ``egrad2rgrad`` is its exact gradient ($g(r, w) = \langle u, w\rangle$ for tangent $w$),
    so the gradient check alone passes it.
    For one unbatched point (``[m, n]``)."""

    skew = 0.5

    def _frame(self, x):
        a = self.proju(x, fixed_gaussian(x, 2))
        a = a / a.norm()
        b = self.proju(x, fixed_gaussian(x, 3))
        b = b - (a * b).sum() * a
        return a, b / b.norm()

    def inner(self, x, u, v=None, *, keepdim=False):
        v = u if v is None else v
        a, b = self._frame(x)
        return (u * v).sum() + self.skew * ((u * a).sum() * (v * b).sum() - (u * b).sum() * (v * a).sum())

    def egrad2rgrad(self, x, u):
        # r + c(<r, a> b - <r, b> a) = P u, solved on span(a, b): alpha - c beta = <Pu, a>, beta + c alpha = <Pu, b>
        p = self.proju(x, u)
        a, b = self._frame(x)
        pa, pb, c = (p * a).sum(), (p * b).sum(), self.skew
        alpha, beta = (pa + c * pb) / (1 + c * c), (pb - c * pa) / (1 + c * c)
        return p - c * (alpha * b - beta * a)


@DTYPES
@pytest.mark.parametrize("broken, check", [(NormNotSquared, "inner_norm_matches"),
                                           (AsymmetricMetric, "inner_symmetric")])
def test_a_wrong_metric_is_caught(broken, check, dtype):
    assert failed_checks(Stiefel(), dtype) == []
    failures = failed_checks(broken(), dtype)
    assert check in failures
    if broken is AsymmetricMetric:
        assert "egrad2rgrad_is_gradient" not in failures  # its gradient is consistent: only symmetry sees it


class RetypingProjection(Stiefel):
    """``proju`` returns float64 whatever it is given (the other methods are right)."""

    def proju(self, x, u):
        return super().proju(x, u).double()


def test_the_dtype_report_names_only_the_methods_that_retype():
    assert failed_checks(Stiefel(), torch.float32) == []
    report = check_manifold_contract(RetypingProjection(), SHAPE, dtype=torch.float32, raise_on_failure=False)
    note = report["methods_keep_the_dtype"].note
    # egrad2rgrad and transp call proju, so they retype too; projx and retr do not
    assert "proju" in note and "projx" not in note and "retr" not in note


@DTYPES
@pytest.mark.parametrize("manifold, shape", [(DGram(), (8, 1)), (DGram(), (1, 8)), (DGram(), (3, 1, 1)),
                                             (Oblique(), (1, 8)), (Oblique(), (3, 1, 1)), (Stiefel(), (3, 1, 1)),
                                             (LPRO(radius=2.0), (8, 1))],
                         ids=["dgram_column", "dgram_row", "dgram_1x1", "oblique_row", "oblique_1x1",
                              "stiefel_1x1", "lpro_column"])
def test_correct_manifolds_with_one_row_or_column_pass(manifold, shape, dtype):
    # a multiplier that vanishes (L_x = 0), a tangent space {0} and a 1x1 step onto the origin
    # had given NaN residuals, 0/0 comparisons and exceptions; several seeds, none may flake
    for seed in range(3):
        check_manifold_contract(manifold, shape, dtype=dtype, seed=seed)


class NormNotSquaredDGram(_NormNotSquared, DGram):
    """DGram with the squared norm wrong."""


@pytest.mark.parametrize("shape", [(8, 1), (3, 1, 1)], ids=["column", "1x1"])
def test_one_row_or_column_shapes_still_catch_a_broken_metric(shape):
    # control for the test above: the comparisons made relative where the tangent space shrinks
    # must not have gone quiet there
    assert failed_checks(DGram(), torch.float64, shape) == []
    assert "inner_norm_matches" in failed_checks(NormNotSquaredDGram(), torch.float64, shape)


@pytest.mark.parametrize("shape", [5, (5,), (-3, 4), (2.5, 3), "ab", (True, 3)])
def test_bad_shapes_are_refused_with_a_clear_message(shape):
    with pytest.raises(ValueError, match="check_manifold_contract: shape"):
        check_manifold_contract(Stiefel(), shape)


BAD_FORM_SETTINGS = {"dual_steps": 2.5, "cold_dual_steps": -1, "polish_rounds": True, "newton_cg_steps": -5,
                     "newton_alpha": float("nan"), "polish_method": "admm_typo", "retraction_order": 0}


@pytest.mark.parametrize("setting", BAD_FORM_SETTINGS)
def test_a_gram_form_with_an_invalid_optimizer_default_is_caught(setting):
    # ManifoldMuon had read these at a matrix's first step (dual_steps = 2.5 ran as 2 steps, the
    # others raised there naming GramSettings, not the manifold); the contract had passed them all
    value = BAD_FORM_SETTINGS[setting]
    form = type("BadSettingForm", (type(Oblique.gram_form),), {setting: value})()
    broken = type("BadSettingOblique", (Oblique,), {"name": "BadSettingOblique", "gram_form": form})()
    report = check_manifold_contract(broken, SHAPE, dtype=torch.float64, seed=0, raise_on_failure=False)
    assert [check.name for check in report.failures] == ["gram_form_settings"]
    note = report["gram_form_settings"].note
    assert f"{setting} must be" in note and f"got {value!r}" in note
    assert failed_checks(Oblique(), torch.float64) == []  # control: the declared defaults are valid


class FrobeniusSphere(MatrixManifold):
    r"""$\{x : \|x\|_F = 1\}$ from its constraint $L_x(u) = \langle x, u\rangle$ (multiplier ``[..., 1]``),
    ``projx`` $x/\|x\|$ and the retraction $\operatorname{projx}(x + u)$: right from any point."""

    name = "FrobeniusSphereForContractTest"

    def constraint(self, x, u):
        return (x * u).sum(dim=(-2, -1)).unsqueeze(-1)

    def constraint_adjoint(self, x, lam):
        return lam.unsqueeze(-1) * x

    def constraint_gram_diag(self, x):
        return x.square().sum(dim=(-2, -1)).unsqueeze(-1)

    def defining_map(self, x):
        return 0.5 * (x.square().sum(dim=(-2, -1)) - 1).unsqueeze(-1)

    def projx(self, x):
        return x / x.norm(dim=(-2, -1), keepdim=True)

    def retr(self, x, u):
        return self.projx(x + u)


class RetractsOnlyFromTheSphere(FrobeniusSphere):
    r"""$R_x(u) = (x + u)/\sqrt{1 + \|u\|^2}$: on the sphere for $x$ on it and tangent $u$
    ($\|x + u\|^2 = 1 + \|u\|^2$), off it from ManifoldMuon's decayed point $cx$ (norm
    $\sqrt{c^2 + \|u\|^2}/\sqrt{1 + \|u\|^2} \approx c$: at weight_decay 0.5, lr 0.05, $\|W\| = 0.64$
    after 20 steps)."""

    name = "RetractsOnlyFromTheSphereForContractTest"

    def retr(self, x, u):
        return (x + u) / (1 + u.square().sum(dim=(-2, -1), keepdim=True)).sqrt()


@DTYPES
def test_a_retraction_right_only_on_the_manifold_is_caught(dtype):
    # from 0.7x with a tangent step of 0.1|x| it lands at norm sqrt(0.49 + 0.01) / sqrt(1.01) = 0.71:
    # a residual of order 0.3, against the bound 1e-10 (fp64) or 1e-5 (fp32)
    assert failed_checks(FrobeniusSphere(), dtype) == []
    # the two others see the same retraction: geoopt's RiemannianSGD starts its momentum at the raw
    # (not tangent) gradient, and the point retracted from 0.7x is among those the own check refuses
    assert failed_checks(RetractsOnlyFromTheSphere(), dtype) == ["retr_from_scaled_point", "geoopt_sgd_on_manifold",
                                                                 "points_pass_own_check"]
    with pytest.raises(AssertionError, match=r"retr_from_scaled_point: .*weight decay.*projx\(x \+ u\)"):
        check_manifold_contract(RetractsOnlyFromTheSphere(), SHAPE, dtype=dtype)
