r"""Symmetry groups of parameter blocks, and their actions on directions and points.

A symmetry of a parameter block is a transformation $g$ of the weights that leaves the
network's function unchanged (after the matching change of the neighbouring blocks). The
*symmetry-compatible principle* asks an update map $U$ to commute with it:

$$U(g\cdot D) = g\cdot U(D).$$

Every group here is a product of a *left factor* acting on rows and a *right factor*
acting on columns, $g\cdot D = L\,D\,R^\top$, optionally with a shift part
$D \mapsto D + \mathbf 1 v^\top$ (router logits are invariant under a shared shift). The
factors are

* ``orthogonal``: Haar-distributed $O_k$ (QR of a Gaussian matrix with the signs of
  $\operatorname{diag}(R)$ folded into $Q$, without which QR is not Haar);
* ``permutation``: uniform $S_k$ as a permutation matrix;
* ``signed_permutation``: uniform permutation times independent signs;
* ``identity``.

Groups and their elements follow one interface (CONTRIBUTING.md): ``group.sample(shapes,
generator)`` returns an element with ``act(D)`` (on directions: gradients, momenta, update
inputs), ``act_point(W)`` (on weights), ``act_output(U)`` (on an update's output; equal to
``act`` except for shift groups, whose shift part acts trivially on outputs — that is how
*invariance* is checked with the same machinery) and ``inverse()``.

Elements are sampled in float64 and cast to the acted-on tensor's dtype and device; they
act on batches ``[..., m, n]`` by broadcasting. A *joint* group (``NeuronPermutation``)
takes a tuple of shapes and its elements act on tuples of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "Group",
    "GroupElement",
    "TwoSidedGroup",
    "TwoSidedElement",
    "JointElement",
    "BiOrthogonal",
    "LeftPermRightOrth",
    "RightPermLeftOrth",
    "SignedColumnPermutation",
    "SignedRowPermutation",
    "SignedPermutation",
    "NeuronPermutation",
    "RouterShift",
    "GROUPS",
    "get_group",
    "sample_shapes",
    "haar_orthogonal",
    "random_permutation",
    "random_signed_permutation",
]

Shape = tuple[int, int]


def _generator(generator: torch.Generator | None) -> torch.Generator:
    return generator if generator is not None else torch.Generator().manual_seed(0)


def haar_orthogonal(
    k: int, generator: torch.Generator | None = None, batch: tuple[int, ...] = ()
) -> torch.Tensor:
    r"""Haar-distributed $Q \in O_k$ (float64, ``[*batch, k, k]``): $Z = QR$ with
    $Z_{ij} \sim \mathcal N(0,1)$, then $Q \leftarrow Q\,\operatorname{diag}(\operatorname{sign}
    R_{ii})$ (Mezzadri's fix: without it the distribution of $Q$ depends on the QR
    implementation)."""
    Z = torch.randn(*batch, k, k, generator=_generator(generator), dtype=torch.float64)
    # numpy's QR: torch's (its orgqr step) costs ~17 ms on a 3x3 matrix with 2 OpenMP
    # threads on a busy machine, ~250x numpy's, and the suites sample thousands of these.
    Q, R = (torch.from_numpy(t) for t in np.linalg.qr(Z.numpy()))
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    signs[signs == 0] = 1.0
    return Q * signs.unsqueeze(-2)


def random_permutation(k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform permutation matrix $P \\in S_k$ (float64), $(PD)_i = D_{\\pi(i)}$."""
    perm = torch.randperm(k, generator=_generator(generator))
    return torch.eye(k, dtype=torch.float64)[perm]


def random_signed_permutation(k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Uniform signed permutation $\operatorname{diag}(s)P$, $s \in \{\pm1\}^k$ (float64)."""
    gen = _generator(generator)
    signs = torch.randint(0, 2, (k,), generator=gen).to(torch.float64) * 2 - 1
    return signs.unsqueeze(-1) * random_permutation(k, gen)


def _identity(k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.eye(k, dtype=torch.float64)


#: Factor samplers by name: ``k, generator -> [k, k]`` float64 matrix.
FACTORS: dict[str, Callable[[int, torch.Generator | None], torch.Tensor]] = {
    "orthogonal": haar_orthogonal,
    "permutation": random_permutation,
    "signed_permutation": random_signed_permutation,
    "identity": _identity,
}


def _cast(M: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return M.to(dtype=like.dtype, device=like.device)


def _format_matrix(M: torch.Tensor) -> str:
    rows = ["[" + ", ".join(f"{v: .4g}" for v in row) + "]" for row in M.tolist()]
    return "[" + ",\n ".join(rows) + "]"


class GroupElement:
    """One group element. Subclasses define :meth:`act` and :meth:`inverse`."""

    def act(self, D):
        """Action on directions (update inputs: gradients, momenta)."""
        raise NotImplementedError

    def act_point(self, W):
        """Action on points (weights). Equals :meth:`act` unless overridden."""
        return self.act(W)

    def act_output(self, U):
        """Action on an update's output. Equals :meth:`act` unless overridden."""
        return self.act(U)

    def inverse(self) -> "GroupElement":
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class TwoSidedElement(GroupElement):
    r"""$g\cdot D = L\,D\,R^\top + \mathbf 1 v^\top$ (the shift $v$ only on inputs and points).

    ``left`` is ``[m, m]``, ``right`` ``[n, n]``, ``shift`` ``[n]`` or ``None``; all float64,
    cast to the operand's dtype. On outputs the shift acts trivially:
    ``act_output(U)`` $= LUR^\top$.
    """

    left: torch.Tensor
    right: torch.Tensor
    shift: torch.Tensor | None = None

    def _check(self, D: torch.Tensor) -> None:
        if not isinstance(D, torch.Tensor):
            raise TypeError(f"group element: expected a tensor, got {type(D).__name__}")
        expected = (self.left.size(0), self.right.size(0))
        if D.dim() < 2 or tuple(D.shape[-2:]) != expected:
            raise ValueError(
                f"group element sampled for shape {expected} cannot act on a tensor of shape "
                f"{tuple(D.shape)}; sample it with group.sample({expected}, generator)"
            )

    def act_output(self, U: torch.Tensor) -> torch.Tensor:
        self._check(U)
        return _cast(self.left, U) @ U @ _cast(self.right, U).mT

    def act(self, D: torch.Tensor) -> torch.Tensor:
        out = self.act_output(D)
        return out if self.shift is None else out + _cast(self.shift, D)

    def inverse(self) -> "TwoSidedElement":
        # y = L x R^T + 1 v^T  =>  x = L^T y R - L^T 1 v^T R = L^T y R - 1 (R^T v)^T, since
        # shift groups have a permutation (L^T 1 = 1) on the left.
        shift = None if self.shift is None else -(self.right.mT @ self.shift)
        return TwoSidedElement(self.left.mT, self.right.mT, shift)

    def __repr__(self) -> str:
        text = f"L =\n{_format_matrix(self.left)}\nR =\n{_format_matrix(self.right)}"
        if self.shift is not None:
            text += f"\nshift v = {_format_matrix(self.shift.unsqueeze(0))}"
        return text


@dataclass(frozen=True, repr=False)
class JointElement(GroupElement):
    """An element acting on a tuple of tensors, one :class:`TwoSidedElement` per member."""

    parts: tuple[TwoSidedElement, ...]

    def _zip(self, tensors, method: str):
        if not isinstance(tensors, (tuple, list)) or len(tensors) != len(self.parts):
            raise ValueError(
                f"joint group element acts on a tuple of {len(self.parts)} tensors, got "
                f"{type(tensors).__name__} of length {len(tensors) if hasattr(tensors, '__len__') else '?'}"
            )
        return tuple(getattr(part, method)(t) for part, t in zip(self.parts, tensors))

    def act(self, D):
        return self._zip(D, "act")

    def act_point(self, W):
        return self._zip(W, "act_point")

    def act_output(self, U):
        return self._zip(U, "act_output")

    def inverse(self) -> "JointElement":
        return JointElement(tuple(part.inverse() for part in self.parts))

    def __repr__(self) -> str:
        return "\n".join(f"member {i}:\n{part!r}" for i, part in enumerate(self.parts))


def _check_shape(shape, who: str) -> Shape:
    if (
        not isinstance(shape, (tuple, list, torch.Size))
        or len(shape) != 2
        or not all(isinstance(k, int) and k >= 1 for k in shape)
    ):
        raise ValueError(f"{who}: shapes must be a pair (m, n) of positive ints, got {shape!r}")
    return int(shape[0]), int(shape[1])


class Group:
    """A symmetry group of a parameter block. Subclasses define :meth:`sample`."""

    #: Short name used by the CLI and the declared table.
    name: str = ""
    #: Whether elements act on a tuple of tensors (shapes is a tuple of shapes).
    joint: bool = False

    def sample(self, shapes, generator: torch.Generator | None = None) -> GroupElement:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class TwoSidedGroup(Group):
    r"""The group $\{D \mapsto L D R^\top\}$ with $L$ from ``left`` and $R$ from ``right``
    (names in :data:`FACTORS`), and shifts $D \mapsto D + \mathbf 1 v^\top$,
    $v \sim \mathcal N(0, \text{shift\_scale}^2 I)$ when ``shift`` is set (which requires a
    permutation on the left so that $\mathbf 1$ is fixed)."""

    left: str = "orthogonal"
    right: str = "orthogonal"
    shift: bool = False

    def __init__(self, shift_scale: float = 1.0):
        self.shift_scale = float(shift_scale)

    def sample(self, shapes, generator: torch.Generator | None = None) -> TwoSidedElement:
        m, n = _check_shape(shapes, f"{type(self).__name__}.sample")
        gen = _generator(generator)
        left = FACTORS[self.left](m, gen)
        right = FACTORS[self.right](n, gen)
        shift = None
        if self.shift:
            shift = self.shift_scale * torch.randn(n, generator=gen, dtype=torch.float64)
        return TwoSidedElement(left, right, shift)


class BiOrthogonal(TwoSidedGroup):
    r"""$O_m \times O_n$: $D \mapsto LDR^\top$ — the symmetry of hidden linear maps
    (attention, MLP), under which spectral updates (Muon) are equivariant."""

    name = "bi-orthogonal"
    left, right = "orthogonal", "orthogonal"


class LeftPermRightOrth(TwoSidedGroup):
    r"""$S_m \times O_n$ (LPRO): vocabulary permutations × feature rotations — the symmetry
    of embeddings and LM heads (row-norm, hybrid)."""

    name = "left-perm-right-orth"
    left, right = "permutation", "orthogonal"


class RightPermLeftOrth(TwoSidedGroup):
    r"""$O_m \times S_n$: the transpose of LPRO (column-norm updates)."""

    name = "right-perm-left-orth"
    left, right = "orthogonal", "permutation"


class SignedColumnPermutation(TwoSidedGroup):
    r"""$O_m \times (\{\pm1\}^n \rtimes S_n)$: rotations on the left, signed permutations of
    columns — the symmetry of DGram $\{Q\operatorname{diag}(d)\}$ (not $O_m\times O_n$)."""

    name = "signed-column-permutation"
    left, right = "orthogonal", "signed_permutation"


class SignedRowPermutation(TwoSidedGroup):
    r"""$(\{\pm1\}^m \rtimes S_m) \times O_n$: the transpose of
    :class:`SignedColumnPermutation` — the symmetry of DGram's transposed geometry on wide
    matrices (orthogonal rows)."""

    name = "signed-row-permutation"
    left, right = "signed_permutation", "orthogonal"


class SignedPermutation(TwoSidedGroup):
    r"""Signed permutations on both sides: the symmetry of coordinate-wise maps
    (``sign``, Adam), the group under which they do hold."""

    name = "signed-permutation"
    left, right = "signed_permutation", "signed_permutation"


class RouterShift(TwoSidedGroup):
    r"""Expert permutations $\ltimes$ shared logit shifts, with $O_d$ on the right:

    $$W \mapsto P W R^\top + \mathbf 1 v^\top$$

    on a router ``[experts, d]`` (experts on rows). Softmax is invariant under the shift,
    so an update must be *invariant* to it: the shift acts trivially on outputs
    (``act_output(U)`` $= PUR^\top$), which centered maps $\Pi^\perp U(\Pi^\perp D)$
    satisfy and uncentered ones do not."""

    name = "router-shift"
    left, right, shift = "permutation", "orthogonal", True


class NeuronPermutation(Group):
    r"""One permutation $P$ of the hidden neurons acting jointly on an MLP block.

    ``shapes`` lists the input-side matrices ``(h, d)`` (SwiGLU: $W_\text{gate}, W_\text{up}$;
    GELU: $W_\text{in}$) then the output projection ``(d, h)``:

    $$W_\text{gate} \mapsto PW_\text{gate},\quad W_\text{up} \mapsto PW_\text{up},\quad
    W_\text{down} \mapsto W_\text{down}P^\top.$$

    Elements act on tuples of tensors in the same order.
    """

    name = "neuron-permutation"
    joint = True

    def sample(self, shapes, generator: torch.Generator | None = None) -> JointElement:
        if not isinstance(shapes, (tuple, list)) or len(shapes) < 2:
            raise ValueError(
                "NeuronPermutation.sample: shapes must be a tuple of (h, d) shapes of the "
                f"input-side matrices followed by the (d, h) output projection, got {shapes!r}"
            )
        inputs = [_check_shape(s, "NeuronPermutation.sample") for s in shapes[:-1]]
        d_out, h_out = _check_shape(shapes[-1], "NeuronPermutation.sample")
        if any(s != (h_out, d_out) for s in inputs):
            raise ValueError(
                "NeuronPermutation.sample: every input-side matrix must be (h, d) and the "
                f"output projection (d, h); got {list(shapes)!r}"
            )
        P = random_permutation(h_out, _generator(generator))
        eye = torch.eye(d_out, dtype=torch.float64)
        parts = [TwoSidedElement(P, eye) for _ in inputs] + [TwoSidedElement(eye, P)]
        return JointElement(tuple(parts))


#: Every group by its CLI name.
GROUPS: dict[str, Group] = {
    g.name: g
    for g in (
        BiOrthogonal(),
        LeftPermRightOrth(),
        RightPermLeftOrth(),
        SignedColumnPermutation(),
        SignedRowPermutation(),
        SignedPermutation(),
        NeuronPermutation(),
        RouterShift(),
    )
}


def get_group(name: str) -> Group:
    """A group by CLI name (``bi-orthogonal``) or class name (``BiOrthogonal``), any case."""
    key = name.strip().lower().replace("_", "-")
    for group in GROUPS.values():
        if key in (group.name, type(group).__name__.lower()):
            return group
    raise ValueError(f"unknown group {name!r}; choose one of {sorted(GROUPS)}")


def sample_shapes(group: Group, shape: Shape) -> Shape | Sequence[Shape]:
    """The shapes argument ``group.sample`` expects for a block built around ``(m, n)``:
    ``(m, n)`` itself, or for a neuron permutation a SwiGLU triple with ``h = m, d = n``."""
    m, n = _check_shape(shape, "sample_shapes")
    return ((m, n), (m, n), (n, m)) if group.joint else (m, n)
