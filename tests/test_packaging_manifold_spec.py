"""The manifold protocol's plain-data half: registry, spec, from_spec, identity.

A user's manifold is defined here, in a test module (not in geomuon), with constructor
arguments including a tensor, as a user's own module would.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from geomuon.manifolds import LPRO, DGram, Euclidean, MatrixManifold, Oblique, Stiefel
from geomuon.manifolds.oblique import sphere_normalize


class WeightedSphere(MatrixManifold):
    """Rows of norm ``radius`` after scaling column j by ``weights[j]`` (a user's manifold:
    only the constraint and its adjoint, so the base class derives the rest)."""

    def __init__(self, radius: float, weights: torch.Tensor, *, label: str = "w"):
        super().__init__()
        self.radius = float(radius)
        self.register_buffer("weights", weights)

    def constraint(self, x, u):
        return (x * u * self.weights.to(x.dtype) ** 2).sum(-1)

    def constraint_adjoint(self, x, lam):
        return lam.unsqueeze(-1) * x * self.weights.to(x.dtype) ** 2

    def defining_map(self, x):
        return 0.5 * ((x * self.weights.to(x.dtype)) ** 2).sum(-1) - 0.5 * self.radius**2


def test_builtin_and_user_classes_register_themselves():
    registered = MatrixManifold.registered()
    for cls in (Stiefel, DGram, Oblique, Euclidean, LPRO):
        assert registered[cls.name] is cls
        assert MatrixManifold.by_name(cls.name.lower()) is cls
    assert registered["WeightedSphere"] is WeightedSphere  # defined in this test module
    assert MatrixManifold.by_name("centered_router").name == "CenteredRouterSpace"  # alias


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown manifold 'sphere'.*registered: \[.*'Stiefel'"):
        MatrixManifold.by_name("sphere")


def test_name_collision_is_an_error_naming_both_classes():
    with pytest.raises(TypeError, match=r"'stiefel'.*already registered by geomuon\.manifolds\.stiefel\.Stiefel"):

        class Stiefel(MatrixManifold):  # noqa: F811 - the collision under test
            pass

    assert MatrixManifold.by_name("stiefel").__module__ == "geomuon.manifolds.stiefel"


def test_a_subclass_with_its_own_name_does_not_collide():
    class ScaledStiefel(Stiefel):
        name = "ScaledStiefelForTest"

    assert MatrixManifold.by_name("scaledstiefelfortest") is ScaledStiefel
    assert ScaledStiefel().spec() == {"name": "ScaledStiefelForTest", "args": {}}


def test_spec_is_plain_data_with_defaults_filled_in():
    assert Stiefel().spec() == {"name": "Stiefel", "args": {}}
    assert LPRO().spec() == {"name": "LPRO", "args": {"radius": None}}
    spec = WeightedSphere(2, torch.tensor([1.0, 2.0])).spec()
    assert spec["name"] == "WeightedSphere" and spec["args"]["radius"] == 2 and spec["args"]["label"] == "w"
    assert torch.equal(spec["args"]["weights"], torch.tensor([1.0, 2.0]))


def test_spec_survives_torch_save_and_weights_only_load():
    manifold = WeightedSphere(1.5, torch.tensor([1.0, 0.5, 2.0]), label="mine")
    buffer = io.BytesIO()
    torch.save({"manifold": manifold.spec()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["manifold"]
    rebuilt = MatrixManifold.from_spec(loaded)
    assert type(rebuilt) is WeightedSphere and rebuilt.identity == manifold.identity
    # the rebuilt manifold behaves the same: same projection of the same point
    x = torch.randn(4, 3, dtype=torch.float64)
    u = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(rebuilt.proju(x, u), manifold.proju(x, u))
    # negative control: the live object itself is refused by a weights-only load
    buffer = io.BytesIO()
    torch.save({"manifold": manifold}, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="weights_only"):
        torch.load(buffer, weights_only=True)


def test_identity_equal_exactly_when_interchangeable():
    w = torch.tensor([1.0, 2.0])
    assert Stiefel().identity == Stiefel().identity
    assert hash(LPRO(2.0).identity) == hash(LPRO(radius=2.0).identity)  # positional or keyword
    assert LPRO().identity == LPRO(None).identity  # default filled in
    assert WeightedSphere(1.0, w).identity == WeightedSphere(1.0, w.clone()).identity  # by value
    different = [
        Stiefel(), DGram(), LPRO(), LPRO(2.0), LPRO(3.0),
        WeightedSphere(1.0, w), WeightedSphere(2.0, w), WeightedSphere(1.0, torch.tensor([1.0, 3.0])),
        WeightedSphere(1.0, w.double()), WeightedSphere(1.0, w, label="other"),
    ]
    assert len({m.identity for m in different}) == len(different)
    # a tensor argument enters the identity as a digest of its bytes, not its values: the batch
    # keys hash identities once per parameter per step (a 1024 x 1024 tensor's tuple of floats
    # had cost 16-37 ms a hash)
    large = WeightedSphere(1.0, torch.randn(1024 * 1024))
    assert len(repr(large.identity)) < 500
    assert large.identity == WeightedSphere(1.0, large.weights.clone()).identity


def test_from_spec_refuses_bad_specs_by_name():
    with pytest.raises(ValueError, match=r"\{'name': str, 'args': dict\}"):
        MatrixManifold.from_spec({"args": {}})
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['bogus'\]"):
        MatrixManifold.from_spec({"name": "Stiefel", "args": {"bogus": 1}})
    with pytest.raises(ValueError, match="unknown keys"):
        MatrixManifold.from_spec({"name": "Stiefel", "args": {}, "extra": 1})
    # a required argument left out (a user's manifold): a bare TypeError from its constructor had named no spec
    with pytest.raises(ValueError, match=r"manifold spec 'WeightedSphere': WeightedSphere\(\): missing a required "
                                         r"argument: 'weights'; give it in 'args'"):
        MatrixManifold.from_spec({"name": "WeightedSphere", "args": {"radius": 1.0}})
    with pytest.raises(ValueError, match="param group 3: unknown manifold"):
        MatrixManifold.resolve("nope", "param group 3")


@pytest.mark.parametrize("args", [[2.0], "radius=2", 2.0], ids=["list", "string", "number"])
def test_from_spec_refuses_args_that_are_not_a_dict_by_name(args):
    # dict() of them had raised "cannot convert dictionary update sequence element #0 to a
    # sequence" (a list), "dictionary update sequence element #0 has length 1" (a string) or
    # "'float' object is not iterable", naming neither the spec nor its 'args'
    with pytest.raises(ValueError, match=r"manifold spec 'LPRO': 'args' must be a dict"):
        MatrixManifold.from_spec({"name": "LPRO", "args": args})
    with pytest.raises(ValueError, match=r"param group 0: manifold spec 'LPRO': 'args' must be a dict"):
        MatrixManifold.resolve({"name": "LPRO", "args": args}, "param group 0")


def test_unserialisable_constructor_argument_is_refused_by_spec():
    class WithCallable(Euclidean):
        name = "WithCallableForTest"

        def __init__(self, fn=None):
            super().__init__()

    assert WithCallable().spec()["args"] == {"fn": None}
    with pytest.raises(TypeError, match=r"WithCallableForTest\(fn=\.\.\.\).*function"):
        WithCallable(sphere_normalize).spec()


def test_copies_and_pickles_keep_the_constructor_arguments():
    # deepcopy and pickle call __new__ without the constructor's arguments
    manifold = WeightedSphere(1.5, torch.tensor([1.0, 2.0]), label="x")
    for clone in (copy.deepcopy(manifold), pickle.loads(pickle.dumps(manifold))):
        assert clone.identity == manifold.identity and clone.radius == 1.5
    with pytest.raises(TypeError, match="radius"):
        WeightedSphere()  # a real call with missing arguments is still refused


def test_a_constructor_argument_cannot_be_changed_after_construction():
    # identity is cached for the batch keys: setting the radius had left m == LPRO(1.0) (so
    # ManifoldMuon batched it with radius-1 matrices) while spec() still said 1.0
    manifold = LPRO(1.0)
    assert manifold.identity == LPRO(1.0).identity
    with pytest.raises(AttributeError, match=r"LPRO\.radius is fixed after construction.*build a new manifold"):
        manifold.radius = 2.0
    with pytest.raises(AttributeError, match=r"LPRO\.radius is fixed"):
        del manifold.radius
    assert manifold.radius == 1.0 and manifold == LPRO(1.0) and manifold != LPRO(2.0)
    sphere = WeightedSphere(1.0, torch.tensor([1.0, 2.0]))
    # (the message spells the manifold's arguments, a tensor as ...)
    fixed = r"WeightedSphere\.weights is fixed.*WeightedSphere\(radius=1\.0, weights=\.\.\., label='w'\)"
    with pytest.raises(AttributeError, match=fixed):
        sphere.weights = torch.tensor([3.0, 4.0])  # a buffer, set through nn.Module
    sphere.scratch = 1  # an attribute that is no constructor argument stays free
    for clone in (copy.deepcopy(manifold), pickle.loads(pickle.dumps(manifold))):
        with pytest.raises(AttributeError, match=r"LPRO\.radius is fixed"):
            clone.radius = 2.0


def test_a_tensor_argument_is_the_manifolds_private_copy():
    # the caller's in-place change had changed the manifold's geometry and spec() while its
    # cached identity kept the old value
    weights = torch.tensor([1.0, 2.0])
    manifold = WeightedSphere(1.0, weights)
    before = manifold.identity
    x, u = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    constraint = manifold.constraint(x, u)
    weights.mul_(2)
    assert manifold.identity == before == WeightedSphere(1.0, torch.tensor([1.0, 2.0])).identity
    assert manifold != WeightedSphere(1.0, weights)
    assert torch.equal(manifold.spec()["args"]["weights"], torch.tensor([1.0, 2.0]))
    assert torch.equal(manifold.constraint(x, u), constraint)


def test_identity_follows_an_in_place_change_of_the_manifolds_own_tensor():
    manifold = WeightedSphere(1.0, torch.tensor([1.0, 2.0]))
    copied = copy.deepcopy(manifold)
    assert manifold.identity == copied.identity
    manifold.weights.mul_(2)  # the geometry and spec() change with it, and so must ==, hash and identity
    doubled = WeightedSphere(1.0, torch.tensor([2.0, 4.0]))
    assert manifold == doubled and hash(manifold) == hash(doubled) and manifold != copied
    assert MatrixManifold.from_spec(manifold.spec()) == manifold


class ScaledColumnsSphere(WeightedSphere):
    """WeightedSphere with its column weights given as a list of 0-dim tensors (a nested argument)."""

    def __init__(self, radius: float, column_weights: list):
        super().__init__(radius, torch.stack(list(column_weights)))
        self.column_weights = column_weights


def test_tensors_nested_in_an_argument_are_private_and_followed_by_the_identity():
    # only top-level tensors had been copied and version-tracked: a list of them stayed the
    # caller's, and an in-place change left a stale identity (two geometries in one batch)
    first, second = torch.tensor(1.0), torch.tensor(2.0)
    manifold = ScaledColumnsSphere(1.0, [first, second])
    before = manifold.identity
    first.mul_(3)  # the caller's tensor: not the manifold's
    assert manifold.column_weights[0] is not first and manifold.identity == before
    manifold.column_weights[0].mul_(3)  # the manifold's own: identity and spec follow it
    assert manifold.identity != before
    assert manifold == ScaledColumnsSphere(1.0, [torch.tensor(3.0), torch.tensor(2.0)])


def test_a_manifold_built_under_inference_mode_compares_and_hashes():
    # its copied tensor had been an inference tensor, whose missing version counter made
    # identity, == and hash raise (an evaluation script loading a checkpoint's spec)
    with torch.inference_mode():
        built = WeightedSphere(1.0, torch.tensor([1.0, 2.0]))
        loaded = MatrixManifold.from_spec(built.spec())
    assert built == loaded == WeightedSphere(1.0, torch.tensor([1.0, 2.0])) and hash(built) == hash(loaded)


class DefaultWeightedSphere(WeightedSphere):
    """WeightedSphere with a tensor default (one object, made when the class is defined)."""

    def __init__(self, radius: float = 1.0, weights: torch.Tensor = torch.ones(3)):
        super().__init__(radius, weights)


def test_a_tensor_default_is_each_manifolds_own_copy():
    # only the arguments passed had been copied: every instance built with the default shared one
    # tensor, and an in-place change of one manifold's moved the others' (and their saved specs')
    first, second = DefaultWeightedSphere(), DefaultWeightedSphere()
    spec = second.spec()
    first.weights.mul_(2)
    assert torch.equal(second.weights, torch.ones(3)) and torch.equal(DefaultWeightedSphere().weights, torch.ones(3))
    assert second == MatrixManifold.from_spec(spec) and first != second


class BoxedSphere(WeightedSphere):
    """WeightedSphere with a namedtuple argument (kept as given: only plain containers are rebuilt)."""

    def __init__(self, bounds: tuple):
        super().__init__(1.0, torch.ones(2))
        self.bounds = bounds


def test_a_namedtuple_argument_is_accepted():
    # rebuilding every tuple had passed a generator to the namedtuple's constructor (TypeError)
    from collections import namedtuple

    Bounds = namedtuple("Bounds", "lo hi")
    assert BoxedSphere(Bounds(0.0, 2.0)).bounds == Bounds(0.0, 2.0)
