"""Symmetry groups: sampling distributions, actions, inverses, and that each action really
is a symmetry of the block it belongs to (the function computed is unchanged)."""

import math

import pytest
import torch

from geomuon.theory.groups import (
    GROUPS,
    BiOrthogonal,
    LeftPermRightOrth,
    NeuronPermutation,
    RouterShift,
    SignedColumnPermutation,
    get_group,
    haar_orthogonal,
    random_permutation,
    random_signed_permutation,
    sample_shapes,
)

TWO_SIDED = [g for g in GROUPS.values() if not g.joint]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_haar_orthogonal_is_orthogonal_and_unbiased():
    gen = _gen()
    samples = haar_orthogonal(3, gen, batch=(3000,))
    eye = torch.eye(3, dtype=torch.float64)
    # Orthogonality in float64: QR is backward stable, so Q^T Q = I to a few ulps.
    assert (samples.mT @ samples - eye).abs().max() < 1e-13
    # Haar: every entry has mean 0 and variance 1/3. Without the sign fix, Householder QR
    # makes Q[0, 0] = -|z_00|/||z_0|| always negative (mean about -0.46). With 3000
    # samples the standard error of the mean is sqrt(1/3/3000) = 0.011: allow 5 of them.
    assert samples.mean(0).abs().max() < 0.055
    assert (samples.pow(2).mean(0) - 1 / 3).abs().max() < 0.05
    dets = torch.linalg.det(samples)
    assert ((dets - 1).abs() < 1e-12).any() and ((dets + 1).abs() < 1e-12).any()


def test_permutations_are_uniform():
    gen = _gen(1)
    counts = {}
    for _ in range(3000):
        P = random_permutation(3, gen)
        assert torch.equal(P.sum(0), torch.ones(3, dtype=torch.float64))
        assert torch.equal(P.sum(1), torch.ones(3, dtype=torch.float64))
        key = tuple(P.argmax(1).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 6
    # Each of the 6 permutations has probability 1/6: 500 expected, binomial sd 20.4.
    assert all(abs(c - 500) < 5 * 20.4 for c in counts.values())


def test_signed_permutations_have_both_signs():
    gen = _gen(2)
    S = torch.stack([random_signed_permutation(4, gen) for _ in range(200)])
    assert torch.equal(S.abs().sum(-1), torch.ones(200, 4, dtype=torch.float64))
    assert (S == -1).any() and (S == 1).any()
    assert (S.mT @ S - torch.eye(4, dtype=torch.float64)).abs().max() == 0


@pytest.mark.parametrize("group", TWO_SIDED, ids=lambda g: g.name)
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4)])
def test_inverse_undoes_the_action(group, shape):
    gen = _gen(3)
    element = group.sample(shape, gen)
    D = torch.randn(2, *shape, generator=gen, dtype=torch.float64)  # a batch of two
    for act in ("act", "act_point", "act_output"):
        moved = getattr(element, act)(D)
        assert moved.shape == D.shape
        back = getattr(element.inverse(), act)(moved)
        assert torch.allclose(back, D, atol=1e-13), act
    # The action is not the identity (each factor is sampled nontrivially).
    assert not torch.allclose(element.act(D), D)


@pytest.mark.parametrize("group", TWO_SIDED, ids=lambda g: g.name)
def test_same_seed_same_element_and_dtype_follows_operand(group):
    a, b = group.sample((4, 3), _gen(7)), group.sample((4, 3), _gen(7))
    D = torch.randn(4, 3, dtype=torch.float32)
    assert torch.equal(a.act(D), b.act(D))
    assert a.act(D).dtype == torch.float32


def test_bad_shapes_are_refused():
    element = BiOrthogonal().sample((4, 3), _gen())
    with pytest.raises(ValueError, match="shape"):
        element.act(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="pair"):
        BiOrthogonal().sample((4,), _gen())
    with pytest.raises(ValueError, match="output projection"):
        NeuronPermutation().sample(((4, 3), (4, 3), (4, 3)), _gen())
    with pytest.raises(ValueError, match="unknown group"):
        get_group("orthogonal-ish")


def test_group_names_resolve():
    for name, group in GROUPS.items():
        assert get_group(name) is group
        assert get_group(type(group).__name__) is group
    assert len(GROUPS) == 8


def test_bi_orthogonal_is_a_symmetry_of_a_linear_layer():
    # y = W x: replacing W by L W R^T and the input by R x gives L y.
    gen = _gen(4)
    W, x = torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(3, generator=gen, dtype=torch.float64)
    element = BiOrthogonal().sample((5, 3), gen)
    R, L = element.right, element.left
    assert torch.allclose(element.act_point(W) @ (R @ x), L @ (W @ x), atol=1e-13)


def test_signed_column_permutation_preserves_dgram_and_bi_orthogonal_does_not():
    gen = _gen(5)
    Q = haar_orthogonal(5, gen)[:, :3]
    W = Q * torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64)  # DGram: orthogonal columns

    def off_diagonal(X):
        gram = X.mT @ X
        return (gram - torch.diag(torch.diagonal(gram))).abs().max()

    assert off_diagonal(SignedColumnPermutation().sample((5, 3), gen).act_point(W)) < 1e-12
    assert off_diagonal(BiOrthogonal().sample((5, 3), gen).act_point(W)) > 1e-2


def test_left_perm_right_orth_relabels_embedding_rows():
    gen = _gen(6)
    E = torch.randn(7, 4, generator=gen, dtype=torch.float64)  # vocabulary x features
    element = LeftPermRightOrth().sample((7, 4), gen)
    tokens = torch.tensor([0, 3, 6])
    relabel = element.left.argmax(dim=1)  # row i of P E is row relabel[i] of E
    new_tokens = torch.stack([(relabel == t).nonzero()[0, 0] for t in tokens])
    moved = element.act_point(E)
    assert torch.allclose(moved[new_tokens], E[tokens] @ element.right.mT, atol=1e-13)


def test_neuron_permutation_leaves_a_swiglu_block_unchanged():
    gen = _gen(8)
    h, d = 6, 4
    shapes = sample_shapes(NeuronPermutation(), (h, d))
    block = tuple(torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes)
    x = torch.randn(d, generator=gen, dtype=torch.float64)

    def swiglu(gate, up, down):
        return down @ (torch.nn.functional.silu(gate @ x) * (up @ x))

    element = NeuronPermutation().sample(shapes, gen)
    moved = element.act_point(block)
    assert torch.allclose(swiglu(*moved), swiglu(*block), atol=1e-12)
    assert not torch.allclose(moved[0], block[0])
    back = element.inverse().act(moved)
    assert all(torch.allclose(a, b) for a, b in zip(back, block))
    with pytest.raises(ValueError, match="tuple of 3"):
        element.act(block[:2])


def test_router_shift_leaves_routing_probabilities_unchanged_up_to_expert_relabeling():
    gen = _gen(9)
    experts, d = 5, 3
    W = torch.randn(experts, d, generator=gen, dtype=torch.float64)
    x = torch.randn(d, generator=gen, dtype=torch.float64)
    element = RouterShift().sample((experts, d), gen)
    probs = torch.softmax(W @ x, dim=0)
    moved = torch.softmax(element.act_point(W) @ (element.right @ x), dim=0)
    assert torch.allclose(moved, element.left @ probs, atol=1e-13)
    # The shift is really there on inputs and absent on outputs.
    shift = element.act(W) - element.act_output(W)
    assert torch.allclose(shift, element.shift.expand(experts, d))
    assert shift.abs().max() > 1e-3
    assert math.isclose(float(element.inverse().act(element.act(W)).sub(W).abs().max()), 0.0, abs_tol=1e-13)
