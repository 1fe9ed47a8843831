"""Every optimizer's checkpoint is plain data and resumes bit for bit.

For each optimizer (Muon, ManifoldMuon on every manifold, including a manifold with
constructor arguments defined here as a user would, the PolarGrad family, RowNormM), with
regulators and warm starts: N steps, ``state_dict()`` through ``torch.save`` and
``torch.load(weights_only=True)`` into a fresh optimizer on fresh parameters, M more
steps; the weights and the whole optimizer state must equal those of N + M uninterrupted
steps exactly (same kernels, same inputs, one CPU process: no tolerance is needed).
"""

from __future__ import annotations

import inspect
import io

import geoopt
import numpy as np
import pytest
import torch

from geomuon.manifolds import LPRO, CenteredRouterSpace, DGram, Euclidean, MatrixManifold, Oblique, Stiefel
from geomuon.optimizers import (HybridPolarGradM, LeftPolarGradM, ManifoldMuon, Muon, OffManifoldError, RightPolarGradM,
                                RowNormM)
from geomuon.optimizers.regulate import SoftCap, SpectralNormalize

N_STEPS, M_STEPS = 3, 2


class ScaledColumns(MatrixManifold):
    r"""A user's manifold with constructor arguments: column $j$ has norm
    ``radius * scales[j]``, $\{W : \|w_j\| = r s_j\}$. Only the constraint, its adjoint,
    the Gram diagonal and the defining map: projection and retraction are the base class's
    generic ones."""

    def __init__(self, radius: float, scales: torch.Tensor):
        super().__init__()
        self.radius = float(radius)
        self.register_buffer("scales", scales)

    def shape_problem(self, m, n):
        if n != self.scales.numel():
            return f"needs {self.scales.numel()} columns, got {n}"
        return super().shape_problem(m, n)

    def constraint(self, x, u):
        return (x * u).sum(-2)

    def constraint_adjoint(self, x, lam):
        return x * lam.unsqueeze(-2)

    def constraint_gram_diag(self, x):
        return x.square().sum(-2)

    def defining_map(self, x):
        target = (self.radius * self.scales.to(x.dtype)) ** 2
        return 0.5 * (x.square().sum(-2) - target)


SCALES = torch.tensor([1.0, 0.5, 2.0, 1.5])

# (label, manifold factory, shapes): two same-shape matrices per manifold exercise batching.
MANIFOLDS = [
    ("stiefel", Stiefel, [(8, 4), (8, 4), (4, 8)]),
    ("dgram", DGram, [(8, 4), (8, 4)]),
    ("oblique", Oblique, [(8, 4), (8, 4)]),
    ("euclidean", Euclidean, [(8, 4), (6, 4)]),
    ("centered_router", CenteredRouterSpace, [(4, 6), (4, 6)]),
    ("lpro_radius", lambda: LPRO(radius=1.5), [(10, 4), (10, 4)]),
    ("user_scaled_columns", lambda: ScaledColumns(1.0, SCALES), [(8, 4), (8, 4)]),
]


def _params(manifold, shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        point = torch.randn(shape, generator=generator)
        if manifold is not None:
            point = manifold.projx(point)
        params.append(torch.nn.Parameter(point))
    return params


def _vector(seed):
    return torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(seed)))


def _gradients(params, step):
    # Deterministic gradients that depend on the weights and on the step.
    for index, p in enumerate(params):
        noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + index))
        p.grad = 0.3 * p.detach() + noise.to(p.dtype)


def _clone(params):
    return [geoopt.ManifoldParameter(p.detach().clone(), manifold=p.manifold)
            if isinstance(p, geoopt.ManifoldParameter) else torch.nn.Parameter(p.detach().clone())
            for p in params]


def _run(make, params, steps, start=0, state=None):
    optimizer = make(params)
    if state is not None:
        optimizer.load_state_dict(state)
    for step in range(start, start + steps):
        _gradients(params, step)
        optimizer.step()
    return optimizer


def _through_disk(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _check_resume(make, params):
    """N + M uninterrupted steps == N steps, save, weights-only load into a fresh
    optimizer on a copy of the weights, M more steps."""
    straight = _clone(params)
    straight_optimizer = _run(make, straight, N_STEPS + M_STEPS)

    first = _clone(params)
    first_optimizer = _run(make, first, N_STEPS)
    loaded = _through_disk(first_optimizer.state_dict())
    resumed = _clone(first)
    resumed_optimizer = _run(make, resumed, M_STEPS, start=N_STEPS, state=loaded)

    for p, q in zip(straight, resumed):
        assert torch.equal(p, q)
    straight_state = straight_optimizer.state_dict()["state"]
    resumed_state = resumed_optimizer.state_dict()["state"]
    assert straight_state.keys() == resumed_state.keys()
    for key in straight_state:
        _assert_same_state(straight_state[key], resumed_state[key])
    return straight_optimizer


@pytest.mark.parametrize("label, factory, shapes", MANIFOLDS, ids=[m[0] for m in MANIFOLDS])
def test_manifold_muon_resumes_bit_for_bit(label, factory, shapes):
    manifold = factory()
    params = _params(manifold, shapes, seed=1)
    vector = _vector(2)
    regulate = SpectralNormalize(w_max=3.0) if label in ("euclidean", "lpro_radius") else None

    def make(ps):
        *matrices, v = ps
        return ManifoldMuon(
            [{"params": matrices, "manifold": factory(), "regulate": regulate},
             {"params": [v], "update": "adamw"}],
            lr=0.05, warm_start=True, dual_steps=2,
        )

    optimizer = _check_resume(make, [*params, vector])
    states = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    if label in ("stiefel", "user_scaled_columns"):  # no closed form: the dual warm start is resumed
        assert all("dual_correction" in s for s in states)
    if regulate is not None:  # the power-iteration regulator keeps its warm-start block
        assert all(len(s) > 2 for s in states)


@pytest.mark.parametrize("factory", [Stiefel, DGram], ids=["stiefel", "dgram"])
def test_bf16_weights_resume_bit_for_bit_with_their_fp32_warm_start(factory):
    # The warm start lives in fp32 for bf16 weights; torch's load_state_dict casts state to
    # the parameter's dtype, which had rounded it to bf16 (the resumed run's next step then
    # differed by 5e-4). The check also asserts the loaded entry's dtype.
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(factory(), [(8, 4), (8, 4)], seed=3)]

    def make(ps):
        return ManifoldMuon(ps, manifold=factory(), lr=0.05, warm_start=True, dual_steps=1)

    optimizer = _check_resume(make, params)
    assert all(optimizer.state[p]["dual_correction"].dtype == torch.float32 for p in optimizer.param_groups[0]["params"])


def test_two_instances_of_a_user_manifold_in_one_optimizer_resume():
    # Two instances with different constructor arguments: two groups, and also one group of
    # ManifoldParameters carrying them (batched apart by identity).
    narrow, wide = ScaledColumns(1.0, SCALES), ScaledColumns(2.0, SCALES)
    a = _params(narrow, [(8, 4), (8, 4)], seed=3)
    b = _params(wide, [(8, 4)], seed=4)

    def make(ps):
        return ManifoldMuon([{"params": ps[:2], "manifold": ScaledColumns(1.0, SCALES)},
                             {"params": ps[2:], "manifold": ScaledColumns(2.0, SCALES)}], lr=0.05)

    optimizer = _check_resume(make, a + b)
    specs = [g["manifold"] for g in optimizer.state_dict()["param_groups"]]
    assert [s["args"]["radius"] for s in specs] == [1.0, 2.0]
    for p, radius in zip(optimizer.param_groups[1]["params"], [2.0]):
        assert torch.allclose(p.norm(dim=0), radius * SCALES, rtol=1e-5)

    # The same instances as ManifoldParameters in one group: the state dict carries no
    # manifold at all (each weight brings its own), and same-identity matrices share a batch.
    mixed = [geoopt.ManifoldParameter(p.detach().clone(), manifold=m)
             for p, m in zip(a + b, [narrow, ScaledColumns(1.0, SCALES.clone()), wide])]
    optimizer = _check_resume(lambda ps: ManifoldMuon(ps, lr=0.05), mixed)
    group = optimizer.param_groups[0]
    assert sorted(len(batch) for batch in optimizer._batches(group, group["params"])) == [1, 2]


@pytest.mark.parametrize("regulate", [SoftCap(w_max=2.0), "soft_cap", None], ids=["instance", "name", "none"])
def test_muon_resumes_bit_for_bit(regulate):
    params = _params(None, [(8, 4), (8, 4), (4, 8)], seed=5)

    def make(ps):
        return Muon([{"params": ps, "regulate": regulate, "weight_decay": 0.0 if regulate else 0.1}], lr=0.02)

    _check_resume(make, params)


@pytest.mark.parametrize("cls", [RowNormM, RightPolarGradM, LeftPolarGradM, HybridPolarGradM])
def test_polar_family_resumes_bit_for_bit(cls):
    params = _params(None, [(8, 4), (8, 4), (4, 6)], seed=6)
    vector = _vector(7)

    def make(ps):
        *matrices, v = ps
        return cls([{"params": matrices, "regulate": [{"name": "weight_decay", "weight_decay": 0.1},
                                                      {"name": "spectral_hammer", "w_max": 2.0}]},
                    {"params": [v], "update": "adamw"}], lr=0.02, centered=cls is LeftPolarGradM)

    _check_resume(make, [*params, vector])


def test_param_groups_hold_specs_not_live_objects():
    manifold = LPRO(radius=2.0)
    optimizer = ManifoldMuon([{"params": _params(manifold, [(6, 3)], 8), "manifold": manifold},
                              {"params": _params(DGram(), [(6, 3)], 9), "manifold": DGram(),
                               "regulate": SoftCap(w_max=2.0, eta=0.05)}])  # (a spectral cap keeps DGram's points)
    group, regulated = optimizer.state_dict()["param_groups"]
    assert group["manifold"] == {"name": "LPRO", "args": {"radius": 2.0}}
    group = regulated
    assert group["regulate"]["name"] == "soft_cap" and group["regulate"]["w_max"] == 2.0
    assert optimizer._manifold_of(optimizer.param_groups[0], None).identity == manifold.identity


def _identity_regulator(W, *, lr):
    return W


def test_a_bare_callable_regulator_is_the_one_thing_that_needs_weights_only_false():
    # Negative control of the weights-only round trip: a live object in a group is refused.
    optimizer = Muon([{"params": _params(None, [(4, 4)], 9), "regulate": _identity_regulator}])
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="weights_only"):
        torch.load(buffer, weights_only=True)


def test_a_regulator_spec_given_numpy_numbers_is_stored_as_plain_data():
    # {"w_max": np.float64(2.0)} had been stored as given: the regulator worked, and the saved
    # state dict then failed to load with weights_only=True (numpy's scalar type is refused)
    spec = {"name": "hard_cap", "w_max": np.float64(2.0), "levels": np.int64(1), "method": np.str_("svd")}
    optimizer = Muon([{"params": _params(None, [(8, 4)], 9), "regulate": spec}], weight_decay=0.0)
    loaded = _through_disk(optimizer.state_dict())["param_groups"][0]["regulate"]
    assert loaded == {"name": "hard_cap", "w_max": 2.0, "levels": 1, "method": "svd"}
    assert [type(loaded[key]) for key in ("w_max", "levels", "method")] == [float, int, str]


def test_a_regulator_with_a_callable_field_refuses_a_spec_naming_the_field():
    with pytest.raises(TypeError, match=r"SoftCap\.eta = .* is not plain data"):
        SoftCap(eta=lambda lr, shape: 0.1).spec()


def test_groups_with_alike_parameter_lists_are_told_apart_by_identity():
    # Two groups holding one same-shape matrix each: locating the second group with
    # list.index compares it to the first group's dict, and with it their weight tensors
    # (a RuntimeError on the first step); the optimizer must find a group by identity.
    a, b = _params(Stiefel(), [(8, 4), (8, 4)], seed=6)
    optimizer = ManifoldMuon([{"params": [a], "manifold": Stiefel()},
                              {"params": [b], "manifold": DGram()}], lr=0.05, certify_every=1)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert [optimizer._group_index(g) for g in optimizer.param_groups] == [0, 1]


def test_points_from_random_as_manifold_parameters_resume_bit_for_bit():
    # random() returns a geoopt.ManifoldTensor; as a ManifoldParameter it carries the
    # manifold, the group names none, and the checkpoint still loads with weights_only.
    generator = torch.Generator().manual_seed(3)
    params = [geoopt.ManifoldParameter(Stiefel().random(8, 4, generator=generator)),
              geoopt.ManifoldParameter(LPRO(radius=1.5).random(10, 4, generator=generator))]

    def make(ps):
        return ManifoldMuon(ps, lr=0.05, warm_start=True, dual_steps=2)

    _check_resume(make, params)


# ---------------------------------------------------------------- as a user would, across processes
# The user's module: the ScaledColumns class above, on its own.
_USER_MODULE = "import torch\nfrom geomuon.manifolds import MatrixManifold\n\n\n" + inspect.getsource(ScaledColumns)

# Training helpers of the user's scripts, apart from the module defining the manifold.
_HELPERS = '''
import torch

def gradients(params, step):
    for i, p in enumerate(params):
        noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        p.grad = 0.3 * p.detach() + noise


def make(params, manifolds):
    from geomuon.optimizers import ManifoldMuon
    return ManifoldMuon([{"params": [p], "manifold": m} for p, m in zip(params, manifolds)],
                        lr=0.05, warm_start=True, dual_steps=2)
'''

_SAVE = '''
import torch
from user_manifolds import ScaledColumns
from user_training import gradients, make
manifolds = [ScaledColumns(1.0, torch.tensor([1.0, 0.5, 2.0])), ScaledColumns(2.0, torch.tensor([1.0, 1.0, 3.0]))]
def start():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(m.projx(torch.randn(6, 3, generator=g))) for m in manifolds]
first, straight = start(), start()
first_opt, straight_opt = make(first, manifolds), make(straight, manifolds)
for step in range(5):
    gradients(straight, step); straight_opt.step()
    if step < 3:
        gradients(first, step); first_opt.step()
torch.save({"optimizer": first_opt.state_dict(), "weights": [p.detach() for p in first]}, "ckpt.pt")
torch.save({"weights": [p.detach() for p in straight], "state": straight_opt.state_dict()["state"]}, "straight.pt")
'''

_RESUME = '''
import sys
import torch
if sys.argv[1] == "import":
    import user_manifolds  # registers ScaledColumns: a checkpoint never imports code
checkpoint = torch.load("ckpt.pt", weights_only=True)
from user_training import gradients, make
params = [torch.nn.Parameter(w.clone()) for w in checkpoint["weights"]]
optimizer = make(params, [g["manifold"] for g in checkpoint["optimizer"]["param_groups"]])
optimizer.load_state_dict(checkpoint["optimizer"])
for step in (3, 4):
    gradients(params, step); optimizer.step()
straight = torch.load("straight.pt", weights_only=True)
state = optimizer.state_dict()["state"]
assert all(torch.equal(p, q) for p, q in zip(params, straight["weights"])), "weights differ"
assert all(torch.equal(state[k][f], straight["state"][k][f]) for k in state for f in state[k]
           if isinstance(state[k][f], torch.Tensor)), "state differs"
print("resumed bit for bit")
'''


def _run_user_script(tmp_path, code, *args):
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, "-W", "ignore", str(script), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_a_users_manifold_module_checkpoint_resumes_in_a_new_process(tmp_path):
    # Two instances of a user's class (constructor arguments, one a tensor) in one
    # optimizer; the checkpoint is saved by one process and resumed by another, which
    # builds its groups from the checkpoint's specs after importing the user's module.
    (tmp_path / "user_manifolds.py").write_text(_USER_MODULE)
    (tmp_path / "user_training.py").write_text(_HELPERS)
    saved = _run_user_script(tmp_path, _SAVE)
    assert saved.returncode == 0, saved.stderr
    resumed = _run_user_script(tmp_path, _RESUME, "import")
    assert resumed.returncode == 0 and "resumed bit for bit" in resumed.stdout, resumed.stderr
    # Without the import the spec names an unregistered class: a clear error, no guess.
    unregistered = _run_user_script(tmp_path, _RESUME, "no-import")
    assert unregistered.returncode != 0
    assert "unknown manifold 'ScaledColumns'" in unregistered.stderr
    assert "registers itself when that module is imported" in unregistered.stderr


def _bf16_hammer_run(resume_at: int | None) -> torch.Tensor:
    """8 Muon steps of a bf16 weight under the spectral hammer, reloaded from a saved state at
    ``resume_at`` (into a fresh optimizer, through torch.save/torch.load)."""
    import io

    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
    spec = {"name": "spectral_hammer", "w_max": 1.0}
    opt = Muon([W], lr=0.02, regulate=spec)
    for s in range(8):
        if s == resume_at:
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
            saved.seek(0)
            W = torch.nn.Parameter(W.detach().clone())
            opt = Muon([W], lr=0.02, regulate=spec)
            opt.load_state_dict(torch.load(saved, weights_only=True))
            assert opt.state[W]["regulate_v"].dtype == torch.float32
        W.grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(s)).bfloat16()
        opt.step()
    return W.detach()


def test_a_resumed_bf16_run_keeps_the_regulators_fp32_warm_start():
    # torch's load_state_dict had cast the warm start to bf16: the resumed weights moved by 0.027
    assert torch.equal(_bf16_hammer_run(None), _bf16_hammer_run(2))


def test_a_torch_muon_state_loads_into_the_drop_in_and_bad_states_are_refused():
    # torch.optim.Muon's groups lack this package's keys: KeyError 'update' at the next step
    W = torch.nn.Parameter(torch.randn(8, 4))
    theirs = torch.optim.Muon([W], lr=0.02)
    W.grad = torch.randn(8, 4)
    theirs.step()
    ours = Muon([W], lr=0.02)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["update"] == "muon" and ours.param_groups[0]["nonfinite"] == "skip"
    W.grad = torch.randn(8, 4)
    ours.step()
    assert torch.isfinite(W).all()
    # a misspelled option in the saved groups, and state of another shape: refused, naming it,
    # with nothing loaded (the state had loaded and the next step moved other parameters first)
    state = ours.state_dict()
    state["param_groups"][0]["nonfinite"] = "Raise"
    with pytest.raises(ValueError, match="load_state_dict: the saved group 0: nonfinite must be one of"):
        ours.load_state_dict(state)
    A, B = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6, 6))
    square = Muon([A, B], lr=0.02)
    A.grad, B.grad = torch.randn(6, 6), torch.randn(6, 6)
    square.step()
    C, D = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6, 5))
    other = Muon([C, D], lr=0.02)
    with pytest.raises(ValueError, match=r"state 'momentum_buffer' of parameter #1 of param group 0 has shape "
                                         r"\(6, 6\), the parameter \(6, 5\)"):
        other.load_state_dict(square.state_dict())
    assert not other.state  # nothing loaded


def test_a_regulator_set_between_steps_is_used_from_the_next_step():
    # the live regulator had been built once: a spec assigned later was saved but not applied
    from geomuon.optimizers.regulate import rms_spectral_norm

    torch.manual_seed(0)
    W = torch.nn.Parameter(3 * torch.randn(16, 8))
    opt = Muon([W], lr=0.02)
    opt.param_groups[0]["regulate"] = {"name": "hard_cap", "w_max": 1.0}
    W.grad = torch.randn(16, 8)
    opt.step()
    assert rms_spectral_norm(W.detach()).item() <= 1.0 + 1e-5
    # and a bad one is refused before the step moves anything
    opt.param_groups[0]["regulate"] = {"name": "no_such_regulator"}
    before = W.detach().clone()
    W.grad = torch.randn(16, 8)
    with pytest.raises(ValueError):
        opt.step()
    assert torch.equal(W.detach(), before)


def test_a_spec_edited_in_place_is_an_edit_of_its_group():
    # A spec's value edited in place (the same dict object) had been missed: the step kept the old
    # regulator or manifold, and state_dict saved the new value, which then failed to resume. Now it
    # re-checks the group like an assigned spec: the new regulator acts, the new manifold refuses
    # weights that are not on it (their step skipped, unchanged).
    from geomuon.optimizers.regulate import rms_spectral_norm

    torch.manual_seed(0)
    W = torch.nn.Parameter(3 * torch.randn(16, 8))
    opt = Muon([W], lr=0.02, regulate={"name": "hard_cap", "w_max": 4.0})
    W.grad = torch.randn(16, 8)
    opt.step()
    assert rms_spectral_norm(W.detach()).item() > 1.5  # control: a cap of 4 leaves it above 1.5
    opt.param_groups[0]["regulate"]["w_max"] = 1.0
    W.grad = torch.randn(16, 8)
    opt.step()
    assert rms_spectral_norm(W.detach()).item() <= 1.0 + 1e-5
    assert opt.state_dict()["param_groups"][0]["regulate"]["w_max"] == 1.0

    V = torch.nn.Parameter(LPRO(radius=1.0).projx(torch.randn(8, 4)))
    manifold_opt = ManifoldMuon([V], manifold=LPRO(radius=1.0), lr=0.05, norm="row")
    V.grad = torch.randn(8, 4)
    manifold_opt.step()
    manifold_opt.param_groups[0]["manifold"]["args"]["radius"] = 3.0
    before = V.detach().clone()
    V.grad = torch.randn(8, 4)
    with pytest.raises(OffManifoldError, match="#0 of param group 0"):
        manifold_opt.step()
    assert torch.equal(V.detach(), before)
    manifold_opt.project_to_manifolds()  # onto the edited manifold, which the next step keeps
    V.grad = torch.randn(8, 4)
    manifold_opt.step()
    assert torch.allclose(V.detach().norm(dim=-1), torch.full((8,), 3.0), rtol=1e-5, atol=0)


def test_a_skipped_step_leaves_fp16_adamw_weights_and_the_regulators_state():
    import warnings

    # fp16 AdamW entries: eps = 1e-8 is 0 in fp16, and the masked update 0/0 wrote NaN
    W = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(torch.ones(2**17, dtype=torch.float16))
    opt = Muon([{"params": [W]}, {"params": [b], "update": "adamw"}], lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        W.grad, b.grad = torch.randn(8, 8), torch.full_like(b, float("nan"))
        opt.step()
        assert opt.check_finite() == {"#0 of param group 1": 1}
    assert torch.equal(b.detach(), torch.ones(2**17, dtype=torch.float16))
    # a finite fp16 gradient whose fp16 norm overflows (200 sqrt(2^17) > 65504) is an AdamW
    # step, as torch takes it (it had been skipped)
    b.grad = torch.full_like(b, 200.0)
    opt.step()
    assert opt.check_finite() == {} and (b.detach() < 1).all()
    # the regulator's warm start does not move on a skipped matrix step (it had, by 0.66)
    torch.manual_seed(0)
    M = torch.nn.Parameter(torch.randn(64, 32))
    reg = Muon([M], lr=0.05, regulate={"name": "spectral_normalize", "w_max": 0.5, "steps": 2})
    M.grad = torch.randn(64, 32)
    reg.step()
    weights, start = M.detach().clone(), reg.state[M]["regulate_v"].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        M.grad = torch.full_like(M, float("nan"))
        reg.step()
    assert torch.equal(M.detach(), weights) and torch.equal(reg.state[M]["regulate_v"], start)
    # control: a kept step does move it (and reports the skip before it)
    M.grad = torch.randn(64, 32)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        reg.step()
    assert not torch.equal(reg.state[M]["regulate_v"], start)


def test_loading_a_state_reports_the_skips_of_the_run_so_far():
    # the loaded state had reset the skip counters: a pending nonfinite='raise' vanished
    W = torch.nn.Parameter(torch.randn(8, 4))
    opt = Muon([W], lr=0.02, nonfinite="raise")
    W.grad = torch.full_like(W, float("nan"))
    opt.step()
    with pytest.raises(ValueError, match="non-finite gradient"):
        opt.load_state_dict(opt.state_dict())


def _named_pair(gen, names, step=False):
    """Two same-shape Stiefel weights passed to ManifoldMuon by name in the order ``names``
    (``step``: one step taken)."""
    params = {name: torch.nn.Parameter(Stiefel().random(8, 3, generator=gen).data) for name in ("q", "k")}
    opt = ManifoldMuon([{"params": [(n, params[n]) for n in names], "manifold": "stiefel"}], lr=0.05)
    if step:
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_a_state_saved_under_other_names_is_refused_and_a_remapping_pre_hook_loads_it():
    # torch maps optimizer state by position: a model that listed its same-shaped weights in
    # another order had loaded q's momentum into k without a word
    gen = torch.Generator().manual_seed(3)
    params, opt = _named_pair(gen, ("q", "k"), step=True)
    saved = opt.state_dict()
    reordered, fresh = _named_pair(gen, ("k", "q"))
    with pytest.raises(ValueError, match="param group 0 was saved with 'q' where this optimizer has 'k'"):
        fresh.load_state_dict(saved)
    assert not fresh.state  # nothing loaded

    def remap(optimizer, state_dict):  # the state of each saved name to its position here
        group, here = state_dict["param_groups"][0], optimizer.param_groups[0]["param_names"]
        by_name = dict(zip(group["param_names"], group["params"]))
        state = {here.index(name): state_dict["state"][i] for name, i in by_name.items()}
        return {"state": state, "param_groups": [{**group, "param_names": list(here),
                                                  "params": list(range(len(here)))}]}

    fresh.register_load_state_dict_pre_hook(remap)
    fresh.load_state_dict(saved)
    for name in ("q", "k"):
        assert torch.equal(fresh.state[reordered[name]]["momentum_buffer"], opt.state[params[name]]["momentum_buffer"])


def test_the_checks_see_the_state_a_pre_hook_returns():
    # the checks had run before torch's load pre-hooks: a hook's wrongly shaped state loaded
    gen = torch.Generator().manual_seed(4)
    _, opt = _named_pair(gen, ("q", "k"), step=True)
    saved = opt.state_dict()
    _, fresh = _named_pair(gen, ("q", "k"))

    def transpose_momentum(optimizer, state_dict):
        state_dict["state"] = {i: {**s, "momentum_buffer": s["momentum_buffer"].mT} for i, s in state_dict["state"].items()}
        return state_dict

    handle = fresh.register_load_state_dict_pre_hook(transpose_momentum)
    with pytest.raises(ValueError, match="state 'momentum_buffer' of parameter 'q' has shape \\(3, 8\\)"):
        fresh.load_state_dict(saved)
    assert not fresh.state
    handle.remove()  # control: without the hook the same state loads, the hooks ran once per load
    calls = []
    fresh.register_load_state_dict_pre_hook(lambda optimizer, state_dict: calls.append(1))
    fresh.load_state_dict(saved)
    assert calls == [1] and len(fresh.state) == 2


def test_user_load_hooks_run_once_each_and_see_what_torchs_load_gives_them():
    # the override had run torch's pre-hook loop itself (and hidden the hooks from torch's);
    # a twin loaded by torch's own Optimizer.load_state_dict is the reference of what each
    # hook sees, and in what order
    gen = torch.Generator().manual_seed(5)
    params, opt = _named_pair(gen, ("q", "k"), step=True)
    saved = opt.state_dict()

    def hooked():
        calls = []
        _, fresh = _named_pair(gen, ("q", "k"))

        def pre(name):
            def hook(optimizer, state_dict):  # a shallow copy of the caller's dict, before any state loads
                calls.append((name, optimizer is fresh, state_dict is saved, state_dict["state"] is saved["state"],
                              len(optimizer.state)))
            return hook

        def post(optimizer):  # after the state has loaded
            momenta = [optimizer.state[p]["momentum_buffer"] for p in optimizer.param_groups[0]["params"]]
            calls.append(("post", optimizer is fresh, [torch.equal(m, opt.state[params[n]]["momentum_buffer"])
                                                       for m, n in zip(momenta, ("q", "k"))]))

        fresh.register_load_state_dict_pre_hook(pre("pre"))
        fresh.register_load_state_dict_pre_hook(pre("first"), prepend=True)
        fresh.register_load_state_dict_post_hook(post)
        return fresh, calls

    twin, expected = hooked()
    torch.optim.Optimizer.load_state_dict(twin, saved)
    fresh, calls = hooked()
    fresh.load_state_dict(saved)
    assert calls == expected == [("first", True, False, True, 0), ("pre", True, False, True, 0),
                                 ("post", True, [True, True])]
    # a refused load ran the pre-hooks once, no post-hook, and leaves only the user's hooks registered
    calls.clear()
    bad = {**saved, "param_groups": [{**saved["param_groups"][0], "momentum": 1.5}]}
    with pytest.raises(ValueError, match="the saved group 0: momentum"):
        fresh.load_state_dict(bad)
    assert [call[0] for call in calls] == ["first", "pre"]
    assert len(fresh._optimizer_load_state_dict_pre_hooks) == 2
