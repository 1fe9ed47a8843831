r"""Symmetry groups of parameter blocks, and their actions on directions, weights,
gradients and update outputs.

A symmetry of a parameter block is a transformation $g$ of the weights that leaves the
network's function unchanged (after the matching change of the neighbouring blocks). The
*symmetry-compatible principle* asks an update map $U$ to commute with it:

$$U(g\cdot D) = g\cdot U(D).$$

Every group here is a product of a *left factor* acting on rows and a *right factor*
acting on columns, $g\cdot D = L\,D\,R^\top$, optionally with a shift part
$D \mapsto D + \mathbf 1 v^\top$ (router logits are invariant under a shared shift). The
factors (:data:`FACTORS`) are

* ``orthogonal``: Haar-distributed $O_k$ (QR of a Gaussian matrix with the signs of
  $\operatorname{diag}(R)$ folded into $Q$, without which QR is not Haar);
* ``permutation``: uniform $S_k$ as a permutation matrix;
* ``signed_permutation``: uniform permutation times independent signs;
* ``positive_diagonal``: $\operatorname{diag}(s)$ with $\log_{10} s_i$ uniform in $[-2, 2]$
  (positive scalings);
* ``identity``.

Groups and their elements follow one interface: ``group.sample(shapes, generator)``
returns an element with

* ``act(D)``: on the input of an update map (a momentum, a direction),
  $LDR^\top + \mathbf 1v^\top$;
* ``act_point(W)``: on weights, the same;
* ``act_gradient(G)``: on the gradient of a loss that has the symmetry. From
  $\mathcal L(g\cdot W) = \mathcal L(W)$ the chain rule gives
  $\nabla\mathcal L(g\cdot W) = L^{-\top}\,\nabla\mathcal L(W)\,R^{-1}$: a shift-invariant
  loss's gradient is *not* shifted, a scaled weight's gradient is scaled inversely, and
  $L^{-\top} = L$ for orthogonal factors;
* ``act_output(U)``: on an update's output, $LUR^\top$ — or $U$ itself for the
  *invariance* part: the shift of router shifts, and positive scalings, whose declared
  relation is $U(\operatorname{diag}(s)D) = U(D)$;
* ``inverse()``.

``group.sample_exact(shapes, generator)`` draws from the group's *exact* subgroup: elements whose
action rounds nothing in floating point (every factor a signed permutation with power-of-two
entries: a rotation factor becomes a signed permutation, a positive scaling a power-of-two one,
:data:`EXACT_FACTORS`), so $g\cdot D$ keeps every exact structure of $D$ — ties, zero rows and
columns, exactly repeated singular values, exact rank — and $g^{-1}\cdot(g\cdot D) = D$ bitwise
(the checker's structured trials, :mod:`geomuon.theory.equivariance`). A shift
($+\mathbf 1v^\top$) is exact only on inputs on its grid: elsewhere its sums round, and an
exact zero of $D$ becomes $v_j$.

Map checks move the map's input with ``act``; optimizer-step and steepest-direction checks
move the weights with ``act_point`` and the gradients with ``act_gradient``.

| CLI name | group | act (input, weights) | act_output |
|---|---|---|---|
| ``bi-orthogonal`` | $O_m\times O_n$ | $LDR^\top$ | $LUR^\top$ |
| ``left-orthogonal`` | $O_m\times I$ | $LD$ | $LU$ |
| ``right-orthogonal`` | $I\times O_n$ | $DR^\top$ | $UR^\top$ |
| ``permutation`` | $S_m\times S_n$ | $PDQ^\top$ | $PUQ^\top$ |
| ``left-perm-right-orth`` | $S_m\times O_n$ | $PDR^\top$ | $PUR^\top$ |
| ``right-perm-left-orth`` | $O_m\times S_n$ | $LDQ^\top$ | $LUQ^\top$ |
| ``signed-column-permutation`` | $O_m\times S_n^\pm$ | $LDQ^\top$ | $LUQ^\top$ |
| ``signed-row-permutation`` | $S_m^\pm\times O_n$ | $PDR^\top$ | $PUR^\top$ |
| ``signed-permutation`` | $S_m^\pm\times S_n^\pm$ | $PDQ^\top$ | $PUQ^\top$ |
| ``row-scaling`` | positive $\operatorname{diag}(s)$ on rows | $\operatorname{diag}(s)D$ | $U$ |
| ``column-scaling`` | positive $\operatorname{diag}(s)$ on columns | $D\operatorname{diag}(s)$ | $U$ |
| ``router-shift`` | $S_m\ltimes$ shifts $\times O_n$ | $PDR^\top + \mathbf 1v^\top$ | $PUR^\top$ |
| ``neuron-permutation`` | one $P$ on a SwiGLU block | $(PW_g, PW_u, W_dP^\top)$ | the same |

A new group is a subclass of :class:`TwoSidedGroup` naming its factors (or any
:class:`Group` with a ``sample``), registered with :func:`register_group` to get a CLI
name; the CLI also takes ``--group module:Class``.

Elements are sampled in float64 and cast to the acted-on tensor's dtype and device; they
act on batches ``[..., m, n]`` by broadcasting. A *joint* group (``NeuronPermutation``)
takes a tuple of shapes and its elements act on tuples of tensors.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from geomuon.manifolds.linalg import check_real

__all__ = [
    "Group",
    "GroupElement",
    "TwoSidedGroup",
    "TwoSidedElement",
    "JointElement",
    "BiOrthogonal",
    "LeftOrthogonal",
    "RightOrthogonal",
    "Permutation",
    "LeftPermRightOrth",
    "RightPermLeftOrth",
    "SignedColumnPermutation",
    "SignedRowPermutation",
    "SignedPermutation",
    "RowScaling",
    "ColumnScaling",
    "NeuronPermutation",
    "RouterShift",
    "FACTORS",
    "GROUPS",
    "register_group",
    "get_group",
    "sample_shapes",
    "haar_orthogonal",
    "random_permutation",
    "random_signed_permutation",
    "random_positive_diagonal",
    "random_power_of_two_diagonal",
    "EXACT_FACTORS",
    "stack_elements",
]

Shape = tuple[int, int]


def _generator(generator: torch.Generator | None) -> torch.Generator:
    """``generator``, or without one a fresh draw from the global RNG (a fixed seed had made
    every call without a generator return the same "Haar" element)."""
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), dtype=torch.int64)))


def haar_orthogonal(
    k: int, generator: torch.Generator | None = None, batch: tuple[int, ...] = ()
) -> torch.Tensor:
    r"""Haar-distributed $Q \in O_k$ (float64, ``[*batch, k, k]``): $Z = QR$ with
    $Z_{ij} \sim \mathcal N(0,1)$, then $Q \leftarrow Q\,\operatorname{diag}(\operatorname{sign}
    R_{ii})$ (Mezzadri's fix: without it the distribution of $Q$ depends on the QR
    implementation)."""
    Z = torch.randn(*batch, k, k, generator=_generator(generator), dtype=torch.float64)
    # Small k: numpy's QR (torch's orgqr step cost ~17 ms on a 3x3 matrix with 2 OpenMP
    # threads on a busy machine, ~250x numpy's, and the suites sample thousands of these).
    # Large k: torch's (numpy's OpenBLAS threads thrash on a shared machine: 0.6 s of CPU
    # for one 256x256 QR against 6 ms in torch, measured on 2 busy cores).
    if k <= 32:
        Q, R = (torch.from_numpy(t) for t in np.linalg.qr(Z.numpy()))
    else:
        Q, R = torch.linalg.qr(Z)

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


def random_positive_diagonal(k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""$\operatorname{diag}(s)$ with $\log_{10} s_i$ uniform in $[-2, 2]$ (float64): scalings
    over four decades, wide enough that an $\epsilon$ added to a scale-invariant ratio shows."""
    exponents = 4.0 * torch.rand(k, generator=_generator(generator), dtype=torch.float64) - 2.0
    return torch.diag(10.0**exponents)


def random_power_of_two_diagonal(k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""$\operatorname{diag}(2^{e_i})$, $e_i$ uniform in $\{-6, \dots, 6\}$ (float64): positive
    scalings over the four decades of :func:`random_positive_diagonal` ($2^6 = 64$), exact in
    floating point (a scaling by a power of two rounds nothing, barring under/overflow)."""
    exponents = torch.randint(-6, 7, (k,), generator=_generator(generator)).to(torch.float64)
    return torch.diag(2.0**exponents)


#: Factor samplers by name: ``k, generator -> [k, k]`` float64 matrix.
FACTORS: dict[str, Callable[[int, torch.Generator | None], torch.Tensor]] = {
    "orthogonal": haar_orthogonal,
    "permutation": random_permutation,
    "signed_permutation": random_signed_permutation,
    "positive_diagonal": random_positive_diagonal,
    "identity": _identity,
}

#: The exact subgroup's sampler of each factor whose own sampler rounds (:meth:`Group.sample_exact`):
#: signed permutations for rotations (they are rotations), power-of-two scalings for positive ones.
#: A factor of :data:`FACTORS` without an entry here (the permutations, the identity: already
#: exact) is sampled by its own sampler.
EXACT_FACTORS: dict[str, Callable[[int, torch.Generator | None], torch.Tensor]] = {
    "orthogonal": random_signed_permutation,
    "positive_diagonal": random_power_of_two_diagonal,
}


def _inverse(M: torch.Tensor) -> torch.Tensor:
    """Inverse of a factor: $1/d$ on the diagonal of a diagonal one, $M^\\top$ for an
    orthogonal one (every built-in factor is one of the two), ``torch.linalg.inv`` for any
    other invertible factor a user adds to :data:`FACTORS` (a scaled permutation)."""
    diagonal = torch.diagonal(M, dim1=-2, dim2=-1)  # (a stack [..., k, k]: one factor per member)
    if torch.count_nonzero(M - torch.diag_embed(diagonal)) == 0:
        return torch.diag_embed(1.0 / diagonal)
    identity = torch.eye(M.size(-1), dtype=M.dtype, device=M.device)
    # a sampled orthogonal factor is orthogonal to its dtype's round-off (k eps); a factor
    # that is not is off by O(1)
    if float((M.mT @ M - identity).abs().max()) <= M.size(-1) * 64 * torch.finfo(M.dtype).eps:
        return M.mT
    return torch.linalg.inv(M)


def _cast(M: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return M.to(dtype=like.dtype, device=like.device)


def _format_matrix(M: torch.Tensor) -> str:
    if M.dim() > 2:  # a stack: one matrix per batch member
        return "\n".join(f"[{i}] " + _format_matrix(member) for i, member in enumerate(M.flatten(0, -3)))
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

    def act_gradient(self, G):
        """Action on the gradient of a loss with this symmetry. Equals :meth:`act` unless
        overridden."""
        return self.act(G)

    def act_output(self, U):
        """Action on an update's output. Equals :meth:`act` unless overridden."""
        return self.act(U)

    def inverse(self) -> "GroupElement":
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class TwoSidedElement(GroupElement):
    r"""$g\cdot D = L\,D\,R^\top + \mathbf 1 v^\top$ (the shift $v$ only on inputs and points).

    ``left`` is ``[m, m]``, ``right`` ``[n, n]`` (orthogonal or diagonal), ``shift`` ``[n]``
    or ``None``; all float64, cast to the operand's dtype. A *batched* element
    (:func:`stack_elements`) holds one element per member of a stack ``[*batch, m, n]``:
    ``left`` ``[*batch, m, m]``, ``right`` ``[*batch, n, n]``, ``shift`` ``[*batch, n]``, and acts
    only on a stack of that batch shape. On outputs the shift acts
    trivially, ``act_output(U)`` $= LUR^\top$, and the whole element does when
    ``output_acts`` is false (invariance). Gradients move by $L^{-\top}GR^{-1}$, unshifted.
    """

    left: torch.Tensor
    right: torch.Tensor
    shift: torch.Tensor | None = None
    output_acts: bool = True

    def _check(self, D: torch.Tensor) -> None:
        if not isinstance(D, torch.Tensor):
            raise TypeError(f"group element: expected a tensor, got {type(D).__name__}")
        if not D.is_floating_point():  # an integer tensor had rounded the factors to zeros
            raise TypeError(f"group element: expected a floating-point tensor, got {D.dtype}")
        expected = (self.left.size(-1), self.right.size(-1))
        if D.dim() < 2 or tuple(D.shape[-2:]) != expected:
            raise ValueError(
                f"group element sampled for shape {expected} cannot act on a tensor of shape "
                f"{tuple(D.shape)}; sample it with group.sample({expected}, generator)"
            )
        batch = tuple(self.left.shape[:-2])
        if batch and tuple(D.shape[:-2]) != batch:
            # broadcasting had let a stack of elements act on one matrix (a stack of copies) or on
            # another batch shape, silently
            raise ValueError(f"a batched group element (one per member of a batch {batch}) cannot act on a tensor "
                             f"of shape {tuple(D.shape)}; stack one element per member of its batch "
                             f"(stack_elements) or act with an unbatched element")

    def _linear(self, D: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        self._check(D)
        return _cast(left, D) @ D @ _cast(right, D).mT

    def act_output(self, U: torch.Tensor) -> torch.Tensor:
        if not self.output_acts:
            self._check(U)
            return U
        return self._linear(U, self.left, self.right)

    def act(self, D: torch.Tensor) -> torch.Tensor:
        out = self._linear(D, self.left, self.right)
        return out if self.shift is None else out + _cast(self.shift, D).unsqueeze(-2)

    def act_gradient(self, G: torch.Tensor) -> torch.Tensor:
        return self._linear(G, _inverse(self.left).mT, _inverse(self.right).mT)

    def inverse(self) -> "TwoSidedElement":
        # y = L x R^T + 1 v^T  =>  x = L^-1 y R^-T - 1 (R^-1 v)^T, since shift groups have a
        # permutation (L^-1 1 = 1) on the left.
        left, right = _inverse(self.left), _inverse(self.right)
        shift = None if self.shift is None else -(right @ self.shift.unsqueeze(-1)).squeeze(-1)
        return TwoSidedElement(left, right, shift, self.output_acts)

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

    def act_gradient(self, G):
        return self._zip(G, "act_gradient")

    def act_output(self, U):
        return self._zip(U, "act_output")

    def inverse(self) -> "JointElement":
        return JointElement(tuple(part.inverse() for part in self.parts))

    def __repr__(self) -> str:
        return "\n".join(f"member {i}:\n{part!r}" for i, part in enumerate(self.parts))


def stack_elements(elements: Sequence[GroupElement], batch: tuple[int, ...]) -> GroupElement:
    r"""One element per member of a stack ``[*batch, m, n]``: ``elements`` (``prod(batch)`` of
    them, in row-major order of the batch) stacked into a batched :class:`TwoSidedElement` (or a
    :class:`JointElement` of batched parts), which moves member $b$ by its own $g_b$ — the
    symmetry group of a stack of independent parameters is the product of theirs. ``ValueError``
    for elements of another type (a group of your own: check it with one element shared by the
    batch) or that mix shifted and unshifted ones."""
    if len(elements) != math.prod(batch) or not elements:
        raise ValueError(f"stack_elements: a batch {tuple(batch)} needs {math.prod(batch)} elements, got "
                         f"{len(elements)}")
    first = elements[0]
    if all(isinstance(e, JointElement) and len(e.parts) == len(first.parts) for e in elements):
        return JointElement(tuple(stack_elements([e.parts[i] for e in elements], batch)
                                  for i in range(len(first.parts))))
    if not all(isinstance(e, TwoSidedElement) and (e.shift is None) == (first.shift is None)
               and e.output_acts == first.output_acts for e in elements):
        raise ValueError(f"stack_elements: can stack TwoSidedElement (or JointElement) samples of one group, got "
                         f"{type(first).__name__}; check a batch under a group of your own with one element shared "
                         "by its members")

    def stacked(tensors):
        return torch.stack(tensors).reshape(*batch, *tensors[0].shape)

    shift = None if first.shift is None else stacked([e.shift for e in elements])
    return TwoSidedElement(stacked([e.left for e in elements]), stacked([e.right for e in elements]), shift,
                           first.output_acts)


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

    def sample_exact(self, shapes, generator: torch.Generator | None = None) -> GroupElement:
        """An element of the group's exact subgroup (its action rounds nothing: module
        docstring). This default is :meth:`sample`, exact only where the group's elements
        already are (permutations); a group with rotations or scalings overrides it."""
        return self.sample(shapes, generator)

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class TwoSidedGroup(Group):
    r"""The group $\{D \mapsto L D R^\top\}$ with $L$ from ``left`` and $R$ from ``right``
    (names in :data:`FACTORS`), and shifts $D \mapsto D + \mathbf 1 v^\top$,
    $v \sim \mathcal N(0, \text{shift\_scale}^2 I)$ when ``shift`` is set (which requires a
    left factor that fixes $\mathbf 1$, a permutation or the identity: :meth:`sample` refuses
    another)."""

    left: str = "orthogonal"
    right: str = "orthogonal"
    shift: bool = False
    #: The declared relation is invariance, $U(g\cdot D) = U(D)$ (``act_output`` is the identity).
    invariant: bool = False

    def __init__(self, shift_scale: float = 1.0):
        check_real(type(self).__name__, "shift_scale", shift_scale, lambda s: s > 0, "a finite number > 0")
        self.shift_scale = float(shift_scale)

    def _factor(self, side: str, exact: bool = False) -> Callable[[int, torch.Generator | None], torch.Tensor]:
        name = getattr(self, side)
        if name not in FACTORS:
            raise ValueError(f"{type(self).__name__}.{side} = {name!r} is no factor; choose one of "
                             f"{', '.join(FACTORS)} (or add a sampler to geomuon.theory.groups.FACTORS)")
        return EXACT_FACTORS.get(name, FACTORS[name]) if exact else FACTORS[name]

    def sample_exact(self, shapes, generator: torch.Generator | None = None) -> TwoSidedElement:
        r"""An element of the exact subgroup: each factor from :data:`EXACT_FACTORS`, and a shift
        (if any) of whole multiples of ``shift_scale`` in $\{-3, \dots, 3\}$ (a shift keeps ties
        within a column, and adds exactly to entries on the same grid)."""
        return self._sample(shapes, generator, exact=True)

    def sample(self, shapes, generator: torch.Generator | None = None) -> TwoSidedElement:
        r"""An element for ``shapes = (m, n)``. With ``shift`` set, the left factor must fix
        $\mathbf 1$ ($L\mathbf 1 = \mathbf 1$, checked on the sample to the float64 round-off
        of a row sum, $m\,\varepsilon$): only then is $D \mapsto LDR^\top + \mathbf 1v^\top$ a
        group action whose inverse is $L^{-1}DR^{-\top} - \mathbf 1(R^{-1}v)^\top$. A rotation or
        a signed permutation on the left had got that wrong inverse: the round trip was off by
        $O(1)$, every trial of a check "unresolved" and the update blamed for its round-off."""
        return self._sample(shapes, generator)

    def _sample(self, shapes, generator: torch.Generator | None, exact: bool = False) -> TwoSidedElement:
        where = f"{type(self).__name__}.sample" + ("_exact" if exact else "")
        m, n = _check_shape(shapes, where)
        gen = _generator(generator)
        left = self._factor("left", exact)(m, gen)
        right = self._factor("right", exact)(n, gen)
        shift = None
        if self.shift:
            row_sums = left.sum(dim=-1)
            if not bool(((row_sums - 1).abs() <= m * torch.finfo(torch.float64).eps).all()):
                raise ValueError(f"{where}: shift = True needs a left factor that fixes the all-ones vector "
                                 f"(L 1 = 1), but left = {self.left!r} does not: set left = 'permutation' or "
                                 "'identity', or shift = False")
            shift = self.shift_scale * (torch.randint(-3, 4, (n,), generator=gen).to(torch.float64) if exact
                                        else torch.randn(n, generator=gen, dtype=torch.float64))
        return TwoSidedElement(left, right, shift, not self.invariant)


class BiOrthogonal(TwoSidedGroup):
    r"""$O_m \times O_n$: $D \mapsto LDR^\top$ — the symmetry of hidden linear maps
    (attention, MLP), under which spectral updates (Muon) are equivariant."""

    name = "bi-orthogonal"
    left, right = "orthogonal", "orthogonal"


class LeftOrthogonal(TwoSidedGroup):
    r"""$O_m \times I$: $D \mapsto LD$ — rotations of the output space only (a block whose
    outputs feed a rotation-invariant consumer)."""

    name = "left-orthogonal"
    left, right = "orthogonal", "identity"


class RightOrthogonal(TwoSidedGroup):
    r"""$I \times O_n$: $D \mapsto DR^\top$ — rotations of the input space only."""

    name = "right-orthogonal"
    left, right = "identity", "orthogonal"


class Permutation(TwoSidedGroup):
    r"""$S_m \times S_n$: $D \mapsto PDQ^\top$, unsigned permutations of rows and columns —
    the symmetry of any map that treats rows and columns as unordered sets."""

    name = "permutation"
    left, right = "permutation", "permutation"


class RowScaling(TwoSidedGroup):
    r"""Positive row scalings, declared as **invariance**: $U(\operatorname{diag}(s)D) = U(D)$
    ($\log_{10}s_i$ uniform in $[-2, 2]$) — row-normalized and sign updates are invariant,
    an $\epsilon$ added to a row norm or a second moment breaks it."""

    name = "row-scaling"
    left, right, invariant = "positive_diagonal", "identity", True


class ColumnScaling(TwoSidedGroup):
    r"""Positive column scalings, declared as **invariance**: $U(D\operatorname{diag}(s)) = U(D)$."""

    name = "column-scaling"
    left, right, invariant = "identity", "positive_diagonal", True


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
GROUPS: dict[str, Group] = {}


def register_group(group: Group) -> Group:
    """Give ``group`` its CLI name (``group.name``, which must be new); returns it."""
    if not isinstance(group, Group):
        raise TypeError(f"register_group: expected a Group instance, got {group!r}")
    if not group.name or group.name in GROUPS:
        raise ValueError(f"register_group: a group needs a new, non-empty name; got {group.name!r}")
    GROUPS[group.name] = group
    return group


for _group in (
    BiOrthogonal(), LeftOrthogonal(), RightOrthogonal(), Permutation(), LeftPermRightOrth(),
    RightPermLeftOrth(), SignedColumnPermutation(), SignedRowPermutation(), SignedPermutation(),
    RowScaling(), ColumnScaling(), NeuronPermutation(), RouterShift(),
):
    register_group(_group)


def get_group(name: str, importer=None) -> Group:
    """A group by CLI name (``bi-orthogonal``), class name (``BiOrthogonal``), any case, or
    ``module:Class`` / ``module:instance`` for a group defined outside geomuon (a
    :class:`Group` subclass is instantiated without arguments), the module imported by
    ``importer`` (default ``importlib.import_module``; the CLI's looks in the working folder
    first). Anything that goes wrong raises ``ValueError`` naming the group."""
    if not isinstance(name, str):
        raise TypeError(f"get_group: expected a group's name (a str such as 'bi-orthogonal'), got {name!r}")
    if ":" in name:
        import importlib

        module_name, _, attr = name.partition(":")
        try:
            module = (importer or importlib.import_module)(module_name)
        except Exception as err:  # a module that fails to import is a usage error, not a crash
            raise ValueError(f"unknown group {name!r}: importing {module_name!r} raised "
                             f"{type(err).__name__}: {err}") from None
        if not hasattr(module, attr):
            raise ValueError(f"unknown group {name!r}: module {module_name!r} has no attribute {attr!r}")
        found = getattr(module, attr)
        try:
            group = found() if isinstance(found, type) and issubclass(found, Group) else found
        except TypeError as err:
            raise ValueError(f"group {name!r} cannot be built without arguments ({err}): name an instance, "
                             f"module:instance") from None
        if not isinstance(group, Group):
            raise ValueError(f"unknown group {name!r}: {attr} is not a geomuon.theory.groups.Group")
        return group
    key = name.strip().lower().replace("_", "-")
    for group in GROUPS.values():
        if key in (group.name, type(group).__name__.lower()):
            return group
    raise ValueError(f"unknown group {name!r}; choose one of {', '.join(GROUPS)} (or module:Class)")



def sample_shapes(group: Group, shape: Shape) -> Shape | Sequence[Shape]:
    """The shapes argument ``group.sample`` expects for a block built around ``(m, n)``:
    ``(m, n)`` itself, or for a neuron permutation a SwiGLU triple with ``h = m, d = n``."""
    m, n = _check_shape(shape, "sample_shapes")
    return ((m, n), (m, n), (n, m)) if group.joint else (m, n)
