"""What a researcher's CI relies on in the manifold contract and the ``check-equivariance``
command: every method's inputs are checked, the contract's own options are refused by name
before any method of the manifold runs, the printed replay line reruns the same check, a
constructor value the optimizer refuses is a usage error (exit 2), not "the update raised", and
``--structured`` and a batched ``--shape`` reach the check (each catches a broken map the check
without it passes).

The contract's bounds are its own (:func:`~geomuon.theory.contracts.default_tolerance`); the
breaks here are exact (a write into an argument, seen by ``torch.equal``), so no assertion
depends on a tolerance or a seed's luck.
"""

import math
import shlex
import textwrap

import pytest
import torch

from geomuon import cli as geomuon_cli
from geomuon.manifolds import MatrixManifold
from geomuon.theory.contracts import check_manifold_contract
from test_contract_adversarial import FrobeniusSphere  # the sphere from its maps, out of place


def _radial(x, u):
    """The component of ``u`` along ``x``: $\\langle x, u\\rangle x / \\|x\\|^2$."""
    return (x * u).sum(dim=(-2, -1), keepdim=True) / x.square().sum(dim=(-2, -1), keepdim=True) * x


class ProjectionNormalisesItsPoint(FrobeniusSphere):
    """``proju`` right in value, but it rescales its point onto the sphere in place: harmless on $M$,
    it moves the weights ManifoldMuon hands it after weight decay ($0.7x$)."""

    name = "ProjectionNormalisesItsPointForContractCliAudit"

    def proju(self, x, u):
        x.div_(x.norm(dim=(-2, -1), keepdim=True))
        return u - _radial(x, u)


class GradientWrittenInPlace(FrobeniusSphere):
    """``egrad2rgrad`` that projects its argument in place (geoopt hands it ``p.grad``)."""

    name = "GradientWrittenInPlaceForContractCliAudit"

    def egrad2rgrad(self, x, u):
        return u.sub_(_radial(x, u))


def _failures(manifold, dtype):
    report = check_manifold_contract(manifold, (6, 4), dtype=dtype, seed=0, raise_on_failure=False)
    return {check.name: check.note for check in report.failures}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_method_writing_into_its_point_or_its_argument_is_named(dtype):
    # The check had given each method a tangent vector (whose normal part, round-off, an in-place
    # projection leaves bit for bit as it was in fp32 at this seed) and never looked at the point.
    assert _failures(FrobeniusSphere(), dtype) == {}  # control: the same maps out of place pass
    failures = _failures(ProjectionNormalisesItsPoint(), dtype)
    assert list(failures) == ["methods_leave_their_inputs"]
    # (egrad2rgrad and transp are proju for the embedded metric: the base class's call the broken
    # proju; transp's point y is on M, which it changes only where fp32 left |y| != 1 bit for bit)
    assert {"proju (x)", "egrad2rgrad (x)"} <= set(failures["methods_leave_their_inputs"].split(", "))
    assert _failures(GradientWrittenInPlace(), dtype) == {"methods_leave_their_inputs": "egrad2rgrad (u)"}


class RefusesToRun(FrobeniusSphere):
    """Any use of the manifold is a test failure: bad options must be refused before it runs."""

    name = "RefusesToRunForContractCliAudit"

    def random(self, *size, **kwargs):
        raise AssertionError("the contract ran the manifold before refusing its options")


@pytest.mark.parametrize("options, error, message", [
    # NaN had failed every check against a bound printed "nan"; a negative tol raised "math domain
    # error" after the whole run; a string a TypeError at the first comparison; inf passes anything
    (dict(tol=math.nan), ValueError, "tol must be a finite number > 0, got nan"),
    (dict(tol=-1.0), ValueError, "tol must be a finite number > 0, got -1.0"),
    (dict(tol=math.inf), ValueError, "tol must be a finite number > 0, got inf"),
    (dict(tol="1e-5"), TypeError, "tol must be a real number, got '1e-5'"),
    # manual_seed had raised "expected a long, but got float" / "Overflow when unpacking long long"
    (dict(seed=1.5), ValueError, "seed must be a whole number in [-2**63, 2**64), got 1.5"),
    (dict(seed=2**70), ValueError, f"seed must be a whole number in [-2**63, 2**64), got {2**70}"),
    (dict(seed=True), ValueError, "seed must be a whole number in [-2**63, 2**64), got True"),
    (dict(dtype=torch.bfloat16), ValueError, "dtype must be torch.float32 or torch.float64, got torch.bfloat16"),
    (dict(dtype="float64"), ValueError, "dtype must be torch.float32 or torch.float64, got 'float64'"),
    # an empty batch had crashed in gram_solve: "cannot reshape tensor of 0 elements"
    (dict(shape=(0, 6, 4)), ValueError, "shape[0] must be a whole number >= 1, got 0"),
    (dict(shape=(2, 0, 6, 4)), ValueError, "shape[1] must be a whole number >= 1, got 0"),
], ids=["tol_nan", "tol_negative", "tol_inf", "tol_string", "seed_float", "seed_huge", "seed_bool", "dtype_bf16",
        "dtype_string", "empty_batch", "empty_inner_batch"])
def test_bad_contract_options_are_refused_by_name_before_the_manifold_runs(options, error, message):
    shape = options.pop("shape", (6, 4))
    with pytest.raises(error) as caught:
        check_manifold_contract(RefusesToRun(), shape, raise_on_failure=False, **options)
    assert str(caught.value) == f"check_manifold_contract: {message}"


def _cli(*argv):
    return geomuon_cli.main(["check-equivariance", *argv])


@pytest.mark.parametrize("target, options", [
    # {:g} had printed 1234567 as 1.23457e+06: the replay drew other conditioned inputs
    ("scaled_polar", ("--condition", "1234567")),
    # printed bare, "--arg factors=(2.0, 3.0)" is a bash syntax error and splits into two words
    ("scaled_polar", ("--arg", "factors=(2.0, 3.0)", "--arg", "label=two words")),
    # each draws other trials (structured kinds and exact elements; one element for the stack),
    # so a replay line without them had rerun another check (scaled_unit: single-valued at 0 too)
    ("scaled_unit", ("--structured",)),
    ("scaled_polar", ("--shape", "2x5x3", "--batch-elements", "shared")),
], ids=["condition", "arg_with_spaces", "structured", "batch_elements"])
def test_the_replay_line_reruns_the_same_check(target, options, tmp_path, monkeypatch, capsys):
    (tmp_path / "audit_maps.py").write_text(textwrap.dedent("""
        import torch

        def scaled_polar(D, factors=(1.0,), label=""):
            U, _, Vh = torch.linalg.svd(D, full_matrices=False)
            return factors[0] * U @ Vh

        def scaled_unit(D, factors=(1.0,)):
            norm = torch.linalg.matrix_norm(D, keepdim=True)
            return factors[0] * D / torch.where(norm > 0, norm, 1.0)
    """))
    monkeypatch.chdir(tmp_path)
    argv = [f"audit_maps:{target}", "--group", "bi-orthogonal", "--shape", "5x3", "--trials", "20", "--seed", "5",
            *options]
    assert _cli(*argv) == 0
    first = capsys.readouterr().out
    replay = [line for line in first.splitlines() if line.startswith("replay: ")]
    words = shlex.split(replay[0].removeprefix("replay: "))  # as a shell reads the printed line
    assert words[:2] == ["geomuon", "check-equivariance"]
    assert geomuon_cli.main(words[1:]) == 0
    # the same trials (every residual and floor of the table) and the same replay line
    assert capsys.readouterr().out == first


def test_a_constructor_value_the_optimizer_refuses_is_a_usage_error(capsys):
    # it had been exit 4, "the update raised" at trial 0, which a CI job reads as a broken optimizer
    assert _cli("torch.optim:SGD", "--arg", "lr=-1", "--group", "signed-permutation", "--seed", "1") == 2
    err = capsys.readouterr().err
    assert "--arg: torch.optim:SGD refused lr=-1: ValueError" in err and "learning rate" in err.lower()
    # control: a value it takes runs the check (SGD is coordinate-wise: signed permutations hold)
    assert _cli("torch.optim:SGD", "--arg", "lr=0.1", "--group", "signed-permutation", "--seed", "1",
                "--trials", "20") == 0


def test_an_optimizer_checked_at_a_shape_too_large_for_the_machine_is_a_usage_error_naming_shape(capsys):
    # its constructor's values had been checked on a parameter of that shape, allocated: a raw
    # RuntimeError and exit 1 (a CI job's "violated") before the check's own refusal of --shape.
    # 10^6 x 10^6 float64 is 8 TB, beyond any machine the suite runs on.
    assert _cli("torch.optim:SGD", "--arg", "lr=0.1", "--group", "bi-orthogonal", "--shape", "1000000x1000000") == 2
    assert "too large to check on this machine" in capsys.readouterr().err


CATALOGUE = "bench.equivariance_catalogue:"  # the checker benchmark's maps, one definition


@pytest.mark.parametrize("target, group", [
    ("argmax_one_hot", "permutation"),  # a tie goes to the lowest row index
    ("sign_with_positive_zero", "signed-permutation"),  # sign(0) = +1
])
def test_structured_judges_the_ties_and_zeros_a_map_is_broken_at(target, group, capsys):
    argv = [CATALOGUE + target, "--group", group, "--seed", "0", "--trials", "20"]
    # without the declaration the probes break the tie (fill the zero) the map jumps at: those
    # trials stay unresolved, the check holds and names what it could not see
    assert _cli(*argv) == 0
    assert "check with structured=True" in capsys.readouterr().out
    assert _cli(*argv, "--structured") == 1
    out = capsys.readouterr().out
    # (a trial judged by the exact element: the declaration reached the check, and the replay line keeps it)
    assert "VIOLATED" in out and "violated (exact element)" in out and "--structured --seed 0" in out
    # control: a map single-valued there (sign(0) = 0) holds under the same declaration
    assert _cli(CATALOGUE + "sign", "--group", "signed-permutation", "--seed", "0", "--trials", "20",
                "--structured") == 0


def test_a_batched_shape_catches_a_map_that_mixes_the_members_of_its_stack(capsys):
    argv = [CATALOGUE + "entrywise_batch_max", "--group", "signed-permutation", "--seed", "0", "--trials", "20"]
    assert _cli(*argv) == 0  # on one matrix the map is a sign: signed permutations hold
    for shape in ("3x6x4", "2x2x6x4"):
        assert _cli(*argv, "--shape", shape) == 1, shape
        out = capsys.readouterr().out
        assert f"shape {shape}," in out and f"--shape {shape}" in out, out
    # one element for the whole stack moves every member alike, so the mixing commutes with it
    assert _cli(*argv, "--shape", "3x6x4", "--batch-elements", "shared") == 0


def test_an_optimizer_that_cannot_step_a_batched_shape_is_a_usage_error(capsys):
    # an optimizer class is checked on one parameter of the shape: Muon's default view refuses a 3-D
    # one at its step, which had been exit 4 ("the update raised") on trial 0. Control: the view that
    # steps a stack runs the check.
    argv = ["geomuon.optimizers:Muon", "--group", "bi-orthogonal", "--shape", "3x6x4", "--trials", "4", "--seed", "0"]
    assert _cli(*argv) == 2
    err = capsys.readouterr().err
    assert "--shape 3x6x4: geomuon.optimizers:Muon is checked on one parameter of that shape" in err, err
    assert "--arg matrix_view=batch" in err, err
    assert _cli(*argv, "--arg", "matrix_view=batch") not in (2, 4)  # a verdict, not a usage error or a raise


@pytest.mark.parametrize("options, message", [
    (("--shape", "3x0x4"), "--shape must look like 8x5 (positive M and N), or 3x8x5 for a stack of 3, got '3x0x4'"),
    (("--shape", "3x6x"), "got '3x6x'"),
    (("--shape", "6"), "got '6'"),
    # it would be ignored on one matrix, yet echoed in the replay line
    (("--batch-elements", "shared"), "--batch-elements applies to a batched --shape (BxMxN: 3x6x4), not to 6x4"),
], ids=["zero_size", "trailing_x", "one_size", "batch_elements_without_batch"])
def test_bad_batch_options_are_usage_errors_before_the_target_is_imported(options, message, tmp_path, monkeypatch,
                                                                          capsys):
    (tmp_path / "audit_never.py").write_text("raise AssertionError('the target was imported')\n")
    monkeypatch.chdir(tmp_path)
    assert _cli("audit_never:update", "--group", "bi-orthogonal", *options) == 2
    err = capsys.readouterr().err
    assert message in err and "imported" not in err, err


def test_an_unknown_batch_elements_choice_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli("audit_never:update", "--group", "bi-orthogonal", "--shape", "3x6x4", "--batch-elements", "each")
    assert exit_.value.code == 2 and "argument --batch-elements: invalid choice: 'each'" in capsys.readouterr().err


class MetricStiefel(MatrixManifold):
    r"""$\{x : x^\top Bx = I_n\}$ for a symmetric positive definite $B$ ``[m, m]``, from its maps only:
    $F(x) = x^\top Bx - I$, $L_x(u) = x^\top Bu + u^\top Bx$, $L_x^*(\Lambda) = Bx(\Lambda + \Lambda^\top)$."""

    name = "MetricStiefelForContractCliAudit"

    def __init__(self, metric: torch.Tensor):
        super().__init__()
        self.metric = metric

    def constraint(self, x, u):
        S = x.mT @ self.metric.to(x.dtype) @ u
        return S + S.mT

    def constraint_adjoint(self, x, lam):
        return self.metric.to(x.dtype) @ x @ (lam + lam.mT)

    def defining_map(self, x):
        return x.mT @ self.metric.to(x.dtype) @ x - torch.eye(x.size(-1), dtype=x.dtype)


def test_points_off_the_manifold_where_its_normal_space_degenerates_are_caught():
    # On a wide 4x6 shape x^T B x has rank <= 4, so x^T B x = I_6 has no solution: every "point"
    # has |F(x)|_F >= sqrt(2) (two eigenvalues 0 where I_6 has 1), an order-one miss. The
    # Gauss-Newton step that measured the distance vanishes there (F(x) leaves the range of L_x):
    # random, projx and retr had passed at 1e-17, and only the manifold's own check complained.
    gaussian = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    manifold = MetricStiefel(gaussian @ gaussian.mT + 4 * torch.eye(4, dtype=torch.float64))
    assert check_manifold_contract(manifold, (4, 3), seed=0).passed  # control: a tall shape is a manifold
    with pytest.warns(RuntimeWarning, match="stalled off the manifold"):  # (the generic projx says so too)
        report = check_manifold_contract(manifold, (4, 6), seed=0, raise_on_failure=False)
    failed = {check.name for check in report.failures}
    assert {"random_on_manifold", "projx_on_manifold", "retr_on_manifold", "retr_from_scaled_point"} <= failed
