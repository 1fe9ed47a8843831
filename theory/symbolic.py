r"""Symbolic certificates (sympy) of the library's own algebra.

Every certificate evaluates **the library's code**, never a re-typed copy of a formula:
the manifolds' methods, the update maps, the iteration steps and coefficient tables run
unchanged on sympy-valued stand-ins for ``torch.Tensor``, *tensor-like* in torch's sense
(``__torch_function__``), so the library's input checks accept them:

* :class:`FreeMatrix` — an element of the free algebra of non-commuting matrix letters
  of **symbolic size** ($W$, $W^\top$, $X$, …; sizes are sympy expressions, so the
  library's ``m < n`` tests are decided from the symbols' assumptions) with commutative
  sympy coefficients, reduced by rewriting rules: a generic point's and tangent vector's
  defining equations ($W^\top W \to I$, $W^\top W \to D$ diagonal,
  $\operatorname{Diag}(W^\top W) \to I$, $\mathbf 1^\top W \to 0$), and the rules of the
  diagonal-part operator, the Sylvester solve $E \oslash (d_i + d_j)$ and a ones letter
  (:class:`FreeAlgebra`), which carry the entrywise formulas of DGram, Oblique, LPRO and
  the router; signed-permutation letters and opaque entrywise functions (row and column
  norms, their reciprocals, signs) carry the elementwise update maps. An identity reduced
  to zero here holds **at every size** of the orientation (tall, square, wide with at
  least two rows, a single row; one column included), every batch.
* :class:`ExactTensor` — a concrete-size array of sympy expressions with the slice of the
  torch API the manifolds and maps use. Entries are symbols, so an identity checked here
  holds for every point of a family (symbolic Cayley frames, symbolic column norms) at
  that size; the sizes are stated with each certificate.
* Series mode (:meth:`FreeAlgebra.series`): truncated Taylor series in $t$ with 60-digit
  float coefficients, for the twelve Polar Express steps of a retraction, whose exact
  coefficients have degree $5^{12}$; the words are exact, the scalars are floats checked
  against a rigorous enclosure.

Every function returns a :class:`Certificate` whose ``witness`` is the exact object the
claim rests on (a reduced residual that is identically zero, a factorization, an exact
counterexample). Floating-point constants are read as the exact decimals they are
written as (``Rational("3.4445") = 6889/2000``). The full list, with statements, sizes and
methods, and what is *not* proved, is the docs page *Concepts → Exact certificates*.

* **Manifolds** (:func:`certify_every_size` at every size; :func:`certify_manifold` at
  $2\times2$, $3\times2$, $2\times3$ on symbolic point families): $F(W) = 0$ and
  $dF_W = L_W$; the adjoint identity
  $\langle L_W(A), \Lambda\rangle = \langle A, L_W^*(\Lambda)\rangle$;
  ``constraint_gram_diag`` is the diagonal of $L_WL_W^*$ on the range of $L_W$;
  $P_W = I - L_W^*(L_WL_W^*)^{-1}L_W$, idempotent, tangent, fixing every tangent vector:
  $\operatorname{range}(P_W) = T_W$; ``projx`` lands on the manifold with
  $X - \operatorname{projx}(X)$ normal there (:func:`certify_projx`, exactly), Stiefel's
  and DGram's SVD-based ``projx`` are their documented maps (:func:`certify_projx_float64`);
  DGram's ``proju`` and ``retr`` commute with its symmetry group at every size
  (:func:`certify_dgram_symmetry`).
* **Retractions**: $R_W(0) = W$ and $\tfrac{d}{dt}R_W(tV)|_{0} = V$ from Taylor
  coefficients (:func:`certify_retraction` exactly at fixed sizes;
  :func:`certify_stiefel_retraction` on ``Stiefel.retr`` at symbolic $m$ in series mode,
  :func:`certify_stiefel_retraction_every_size` at symbolic $m$ and $n$;
  :func:`certify_gram_form` (its projection also at the decayed point $cW$ the engine
  projects at), :func:`certify_gram_retract`, :func:`certify_inverse_sqrt_series` and
  Stiefel's a-priori series bound :func:`certify_series_covers` for the fast engine's
  Gram-form retractions;
  ``DGram.retr`` at every size to first order, :func:`certify_dgram_retraction` on the
  step's certified action :func:`certify_dgram_step_expansion`, and in float64,
  :func:`certify_newton_schulz_retraction`).
* **Update maps** (:func:`certify_map_row`): every ``map`` row of
  :mod:`geomuon.theory.declared` — a proof at every size for ``holds`` rows
  (:func:`certify_equivariance_every_size`, one free letter for every group element;
  the Newton–Schulz steps by their own every-size proofs, the polar maps' composition
  around them by :func:`certify_polar_map_equivariance`), an
  exact counterexample for ``fails`` rows (a proof for a fixed group certifies only rows
  whose group lies within it); the elementwise maps are the dualizers of
  their norms (:func:`certify_dualizer`), and the spectral, hybrid and polar maps' values
  match exact polar factors in float64 (:func:`hybrid_map_reference`,
  :func:`polar_map_reference`).
* **Coefficient tables and constants**: every row of both Polar Express tables is the
  recentred minimax quintic of its cushioned design interval
  (:func:`certify_polar_express_table`, interval arithmetic), the coupled
  inverse-square-root step converges to $\lambda^{-1/2}$ with a rigorous error bound
  (:func:`certify_inverse_sqrt_iteration`, :func:`inverse_sqrt_error_bound`), the GELU
  Lipschitz constant, the soft-cap root's uniqueness and the $62/81$ threshold (and the
  regulator's matrix steps are that scalar cap, :func:`certify_soft_cap_regulator`), rigorous
  Newton–Schulz output ranges (the $\eta$ of
  :func:`geomuon.optimizers.regulate.muon_update_norm`, with its RMS→RMS scale
  :func:`certify_rms_scale`), the Gram-form series' radius and Newton increment, and the
  engine's dual Gram identity (:func:`certify_gram_space_identity` on ``gram.dual_gram``).
* **The fast engine's polish and dual steps**, in float64 on the library's functions at
  $7\times4$, $4\times4$, $4\times7$ (Stiefel, DGram; wide pairs transposed as the engine
  runs them), tolerances derived from $\varepsilon$ and the conditioning $\|P\|_F$:
  ``gram.polish``'s rounds are the definition's (ADMM between $P_W$ and
  $\Pi_{\|\cdot\|_2\le1}$ from the dual iterate, or alternating projections), end tangent,
  and close the duality gap (ADMM) or tend to the ball and fix the intersection (alternating)
  (:func:`certify_gram_polish`); the Newton increment
  solves the frozen tangency $L_W((Z + L_W^*\delta)P) = 0$, the forms' ``newton_operator``
  is $\mathcal C(DS(\cdot)P)$, symmetric positive semi-definite with ``newton_diagonal`` its
  diagonal, and CG's $\mathcal A$-norm error does not increase
  (:func:`certify_gram_newton_step`); ``jacobi_update`` is
  $-\alpha\sigma L_W(ZP)\oslash\operatorname{diag}(L_WL_W^*)$ (:func:`certify_gram_jacobi_step`);
  under weight decay the step starts at $P_WG$ and retracts from $cW$
  (:func:`certify_gram_weight_decay`, Oblique too); the eigendecomposition-free dualizer's
  kernels meet their certified ranges (:func:`certify_polynomial_dualizers`).

``bench/symbolic_mutations.py`` breaks these formulas one at a time in a copy of the
repository and checks that ``tests/test_symbolic.py`` fails on each.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import sympy as sp
import torch
from sympy.polys.fields import FracElement

from geomuon.manifolds.linalg import check_count

__all__ = [
    "Certificate",
    "exact",
    "cayley",
    "skew",
    "ExactTensor",
    "FreeAlgebra",
    "FreeMatrix",
    "manifold_points",
    "certify_manifold",
    "certify_projection",
    "certify_every_size",
    "FreeVector",
    "ORIENTATIONS",
    "DUALIZER_NORMS",
    "certify_retraction",
    "certify_stiefel_retraction",
    "certify_dgram_step_expansion",
    "certify_dgram_retraction",
    "certify_stiefel_retraction_every_size",
    "certify_gram_retract",
    "certify_inverse_sqrt_series",
    "certify_newton_schulz_step_expansion",
    "certify_newton_schulz_retraction",
    "certify_newton_schulz_equivariance",
    "certify_polar_map_equivariance",
    "certify_dgram_symmetry",
    "certify_sorted_sigma_map_fails",
    "certify_equivariance_every_size",
    "certify_dualizer",
    "certify_rms_scale",
    "certify_projx",
    "certify_projx_float64",
    "hybrid_map_reference",
    "certify_map_row",
    "certify_gram_space_identity",
    "certify_gram_form",
    "certify_gelu_lipschitz",
    "ns_scalar_map",
    "newton_schulz_error",
    "symbols_matrix",
    "ns_fixed_points",
    "ns_output_range",
    "certify_polar_express_table",
    "PolarExpressDesign",
    "POLAR_EXPRESS_DESIGNS",
    "certify_inverse_sqrt_iteration",
    "inverse_sqrt_error_bound",
    "polar_map_reference",
    "soft_cap_polynomial",
    "certify_soft_cap_coupling",
    "certify_soft_cap_root_unique",
    "soft_cap_beta",
    "soft_cap_coupling_roots",
    "certify_soft_cap_monotone",
    "certify_soft_cap_regulator",
    "certify_residual_lipschitz",
    "certify_gram_polish",
    "certify_gram_newton_step",
    "certify_gram_jacobi_step",
    "certify_gram_weight_decay",
    "certify_series_covers",
    "certify_polynomial_dualizers",
]


@dataclass(frozen=True)
class Certificate:
    """An exactly checked claim: ``holds`` and the ``witness`` it was read off."""

    claim: str
    holds: bool
    witness: Any

    def __bool__(self) -> bool:
        return self.holds


def _float_value(x: float) -> sp.Rational:
    """The rational a float *is* (its binary value; :func:`exact` reads its shortest decimal)."""
    return sp.Rational(*float(x).as_integer_ratio())


def exact(x) -> sp.Expr:
    """The exact rational a float is written as (``repr``), e.g. ``0.1 -> 1/10``;
    sympy values pass through."""
    if isinstance(x, (sp.Basic, FracElement)):
        return x
    if isinstance(x, SymbolicSize):
        return x.expr
    if isinstance(x, (bool, np.bool_)):
        return sp.Integer(int(x))
    if isinstance(x, (int, np.integer)):
        return sp.Integer(int(x))
    return sp.Rational(x if isinstance(x, str) else repr(float(x)))


def _reduce(e) -> sp.Expr:
    """Exact normal form of a rational function: expanded numerator over denominator
    (zero iff the expression is identically zero; cheaper than ``cancel``'s gcds).
    Square roots are normalized by expanding their arguments."""
    e = sp.sympify(e)
    if e.is_Number:
        return e
    # Fast path: the field of rational functions over QQ in the expression's symbols
    # (sparse polynomial arithmetic, no expression trees); anything else (square roots,
    # erf, ...) falls back to together/expand.
    try:
        field, *_ = sp.field(sorted(e.free_symbols, key=str), sp.QQ)
        value = field.from_expr(e)
        return sp.Integer(0) if not value else value.as_expr()
    except (ValueError, TypeError, NotImplementedError, sp.polys.polyerrors.PolynomialError):
        pass
    num, den = sp.fraction(sp.together(e))
    num = sp.expand(num)
    return sp.Integer(0) if num == 0 else num / den


def _is_zero(e) -> bool:
    return _reduce(e) == 0


def skew(k: int, prefix: str = "s") -> sp.Matrix:
    """A ``k x k`` skew-symmetric matrix of real symbols ``s_ij`` (``i < j``)."""
    S = sp.zeros(k, k)
    for i, j in itertools.combinations(range(k), 2):
        s = sp.Symbol(f"{prefix}{i}{j}", real=True)
        S[i, j], S[j, i] = s, -s
    return S


def cayley(S: sp.Matrix) -> sp.Matrix:
    r"""Cayley transform $Q = (I - S)(I + S)^{-1}$: orthogonal for skew $S$ ($I + S$ is
    invertible because the eigenvalues of $S$ are imaginary), with rational entries when
    $S$ has rational (or symbolic) entries. It parametrizes a dense open subset of
    $SO(k)$."""
    eye = sp.eye(S.rows)
    return ((eye - S) * (eye + S).inv()).applyfunc(sp.cancel)


# ======================================================================================
# ExactTensor: concrete size, sympy entries, the library's torch code runs on it


def _lift(value):
    """An object array (or scalar) of exact entries for any operand."""
    if isinstance(value, ExactTensor):
        return value.a
    if isinstance(value, torch.Tensor):
        return np.vectorize(exact, otypes=[object])(value.detach().to(torch.float64).numpy())
    if isinstance(value, np.ndarray):
        return np.vectorize(exact, otypes=[object])(value) if value.dtype != object else value
    return exact(value)


def _axes(dim, ndim):
    if dim is None:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(d % ndim for d in dims)


_sqrt = np.vectorize(sp.sqrt, otypes=[object])
_sign = np.vectorize(sp.sign, otypes=[object])


class ExactTensor:
    r"""A ``[..., m, n]`` array of sympy expressions that the library's torch code accepts.

    It implements the part of the ``torch.Tensor`` API the manifolds and update maps use
    (arithmetic with exact promotion of floats, ``mT``, ``@``, ``sum``, ``mean``,
    ``norm``, ``square``, ``unsqueeze``, ``expand``, ``new_full``, ``to``) and, through
    ``__torch_function__``, the torch functions they call (``torch.diagonal``,
    ``torch.diag_embed``, ``torch.sign``, ``torch.baddbmm``, ``torch.where``, …). It
    reports ``dtype = torch.float64`` so dtype logic takes its float64 branch; numbers a
    method creates with ``torch.full``/``torch.eye`` come back as exact rationals when they
    meet an ``ExactTensor``.
    """

    dtype = torch.float64
    device = torch.device("cpu")

    def __init__(self, data):
        if isinstance(data, sp.MatrixBase):
            data = data.tolist()
        self.a = np.array(_lift(data) if isinstance(data, (torch.Tensor, ExactTensor)) else data, dtype=object)

    # -- structure
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.a.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.a.shape[dim]

    def dim(self) -> int:
        return self.a.ndim

    ndim = property(dim)

    def is_floating_point(self) -> bool:
        return True

    def numel(self) -> int:
        return int(self.a.size)

    @property
    def mT(self) -> "ExactTensor":
        return ExactTensor(np.swapaxes(self.a, -1, -2))

    def to(self, *args, **kwargs) -> "ExactTensor":
        return self

    def double(self) -> "ExactTensor":
        return self

    float = double

    def clone(self) -> "ExactTensor":
        return ExactTensor(self.a.copy())

    def detach(self) -> "ExactTensor":
        return self

    def __getitem__(self, index):
        out = self.a[index]
        return ExactTensor(out) if isinstance(out, np.ndarray) else out

    def unsqueeze(self, dim: int) -> "ExactTensor":
        return ExactTensor(np.expand_dims(self.a, dim if dim >= 0 else self.a.ndim + 1 + dim))

    def expand(self, *shape) -> "ExactTensor":
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        shape = tuple(s if s != -1 else self.a.shape[i - len(shape) + self.a.ndim] for i, s in enumerate(shape))
        return ExactTensor(np.broadcast_to(self.a, shape).copy())

    def expand_as(self, other) -> "ExactTensor":
        return self.expand(*other.shape)

    def reshape(self, *shape) -> "ExactTensor":
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return ExactTensor(self.a.reshape(shape))

    def new_full(self, shape, value, **kwargs) -> "ExactTensor":
        return ExactTensor(np.full(tuple(shape), exact(value), dtype=object))

    def new_zeros(self, shape, **kwargs) -> "ExactTensor":
        return self.new_full(shape, 0)

    # -- reductions and elementwise maps
    def sum(self, dim=None, keepdim: bool = False) -> "ExactTensor":
        axes = _axes(dim, self.a.ndim)
        out = np.sum(self.a, axis=axes, keepdims=keepdim)
        return ExactTensor(np.array(out, dtype=object))

    def mean(self, dim=None, keepdim: bool = False) -> "ExactTensor":
        axes = _axes(dim, self.a.ndim)
        count = int(np.prod([self.a.shape[d] for d in axes]))
        return self.sum(dim, keepdim) / count

    def square(self) -> "ExactTensor":
        return self * self

    def norm(self, p="fro", dim=None, keepdim: bool = False) -> "ExactTensor":
        return ExactTensor(_sqrt(self.square().sum(dim, keepdim).a))

    def sqrt(self) -> "ExactTensor":
        return ExactTensor(_sqrt(self.a))

    def clamp_min(self, floor) -> "ExactTensor":
        return ExactTensor(np.vectorize(lambda e: sp.Max(_as_expr(e), exact(floor)), otypes=[object])(self.a))

    def rsqrt(self) -> "ExactTensor":
        return 1 / self.sqrt()

    def any(self) -> bool:
        return bool(np.any(self.a))

    def all(self) -> bool:
        return bool(np.all(self.a))

    def __bool__(self) -> bool:
        if self.a.size != 1:
            raise ValueError("ExactTensor: truth value of a tensor with more than one entry")
        return bool(self.a.reshape(()).item())

    # -- arithmetic
    def _op(self, other, fn):
        return ExactTensor(fn(self.a, _lift(other)))

    def __add__(self, o):
        return self._op(o, lambda x, y: x + y)

    def __radd__(self, o):
        return self._op(o, lambda x, y: y + x)

    def __sub__(self, o):
        return self._op(o, lambda x, y: x - y)

    def __rsub__(self, o):
        return self._op(o, lambda x, y: y - x)

    def __mul__(self, o):
        return self._op(o, lambda x, y: x * y)

    def __rmul__(self, o):
        return self._op(o, lambda x, y: y * x)

    def __truediv__(self, o):
        return self._op(o, lambda x, y: x / y)

    def __rtruediv__(self, o):
        return self._op(o, lambda x, y: y / x)

    def __pow__(self, k):
        return ExactTensor(self.a ** exact(k))

    def __neg__(self):
        return ExactTensor(-self.a)

    def __matmul__(self, o):
        return ExactTensor(np.matmul(self.a, _lift(o)))

    def __rmatmul__(self, o):
        return ExactTensor(np.matmul(_lift(o), self.a))

    def __eq__(self, o):  # elementwise, like torch (structural equality of sympy entries)
        return self._op(o, lambda x, y: np.equal(x, y))

    __hash__ = None

    # -- the torch functions the library calls
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _EXACT_TORCH.get(func) or _EXACT_ARITHMETIC.get(getattr(func, "__name__", None))
        if handler is None:
            raise NotImplementedError(f"ExactTensor: torch function {getattr(func, '__name__', func)} is not supported")
        return handler(*args, **kwargs)

    # -- exact results
    def simplify(self) -> "ExactTensor":
        """Each entry in the normal form of :func:`_reduce` (zero iff identically zero)."""
        return ExactTensor(np.vectorize(_reduce, otypes=[object])(self.a))

    def is_zero(self) -> bool:
        return all(_is_zero(e) for e in self.a.flat)

    def matrix(self) -> sp.Matrix:
        """The last two dimensions as a sympy Matrix (no batch dimensions)."""
        return sp.Matrix(self.a.tolist())

    def subs(self, values: Mapping) -> "ExactTensor":
        return ExactTensor(np.vectorize(lambda e: sp.sympify(e).subs(values), otypes=[object])(self.a))

    def __repr__(self) -> str:
        return f"ExactTensor({self.a.tolist()!r})"


def _diag_embed(v, offset=0, dim1=-2, dim2=-1):
    a = _lift(v)
    out = np.zeros((*a.shape, a.shape[-1]), dtype=object)
    for i in range(a.shape[-1]):
        out[..., i, i] = a[..., i]
    return ExactTensor(out)


def _where(cond, x, y):
    return ExactTensor(np.where(np.asarray(_lift(cond), dtype=bool), _lift(x), _lift(y)))


def _baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    return ExactTensor(exact(beta) * _lift(input) + exact(alpha) * np.matmul(_lift(batch1), _lift(batch2)))


def _binary(op):
    return lambda x, y, *args, **kwargs: ExactTensor(op(_lift(x), _lift(y)))


_EXACT_TORCH: dict[Callable, Callable] = {
    torch.diagonal: lambda S, offset=0, dim1=-2, dim2=-1: ExactTensor(np.diagonal(_lift(S), offset, dim1, dim2).copy()),
    torch.diag_embed: _diag_embed,
    torch.sign: lambda x: ExactTensor(_sign(_lift(x))),
    torch.sqrt: lambda x: ExactTensor(_sqrt(_lift(x))),
    torch.full_like: lambda x, v, **kw: ExactTensor(np.full(_lift(x).shape, exact(v), dtype=object)),
    torch.zeros_like: lambda x, **kw: ExactTensor(np.zeros(_lift(x).shape, dtype=object) * sp.Integer(0)),
    torch.ones_like: lambda x, **kw: ExactTensor(np.full(_lift(x).shape, sp.Integer(1), dtype=object)),
    torch.where: _where,
    torch.baddbmm: _baddbmm,
    torch.matmul: _binary(np.matmul),
    torch.Tensor.__add__: _binary(lambda x, y: x + y),
    torch.Tensor.__radd__: _binary(lambda x, y: y + x),
    torch.Tensor.__sub__: _binary(lambda x, y: x - y),
    torch.Tensor.__rsub__: _binary(lambda x, y: y - x),
    torch.Tensor.__mul__: _binary(lambda x, y: x * y),
    torch.Tensor.__rmul__: _binary(lambda x, y: y * x),
    torch.Tensor.__truediv__: _binary(lambda x, y: x / y),
    torch.Tensor.__matmul__: _binary(np.matmul),
}


#: Arithmetic reached through torch (a real tensor on the left of an ExactTensor).
_EXACT_ARITHMETIC: dict[str, Callable] = {
    **{k: _binary(lambda x, y: x + y) for k in ("add", "__add__", "__radd__")},
    **{k: _binary(lambda x, y: x - y) for k in ("sub", "__sub__")},
    **{k: _binary(lambda x, y: y - x) for k in ("rsub", "__rsub__")},
    **{k: _binary(lambda x, y: x * y) for k in ("mul", "__mul__", "__rmul__")},
    **{k: _binary(lambda x, y: x / y) for k in ("div", "true_divide", "__truediv__")},
    **{k: _binary(np.matmul) for k in ("matmul", "__matmul__")},
}


def symbols_matrix(prefix: str, m: int, n: int) -> ExactTensor:
    """An ``m x n`` :class:`ExactTensor` of real symbols ``{prefix}{i}_{j}``."""
    return ExactTensor([[sp.Symbol(f"{prefix}{i}_{j}", real=True) for j in range(n)] for i in range(m)])


def _inner(X: ExactTensor, Y: ExactTensor):
    return sum((x * y for x, y in zip(_lift(X).flat, _lift(Y).flat)), 0)


# ======================================================================================
# FreeMatrix: symbolic size, non-commuting letters, rewriting rules

Word = tuple


class FreeAlgebra:
    r"""Non-commuting matrix letters, their transposes, and rewriting rules.

    ``letters`` maps each letter to its transpose (``{"W": "W'"}`` adds both directions;
    a letter mapped to itself is symmetric). ``rules`` rewrite a word (a product of
    letters) to a linear combination of words, e.g. ``W'W -> I`` for a Stiefel point, or
    ``V'W -> -W'V`` for a tangent vector $V$ ($W^\top V$ skew). The rules must terminate;
    a product is reduced to normal form after every operation.

    Beyond products (the entrywise formulas of DGram, Oblique, LPRO and the router):

    * ``diagonal`` letters are diagonal matrices (symmetric, and they commute with each
      other: adjacent diagonal letters are sorted);
    * :meth:`diag` is the diagonal-part operator $\operatorname{Diag}(M) = I \odot M$,
      linear, with $\operatorname{Diag}(\Delta M\Delta') = \Delta\operatorname{Diag}(M)\Delta'$
      for diagonal $\Delta, \Delta'$, $\operatorname{Diag}(M^\top) = \operatorname{Diag}(M)$
      and $\operatorname{Diag}(\Delta) = \Delta$; $\operatorname{Diag}(u)$ of a word $u$ is a
      new diagonal letter ``<u>``;
    * :meth:`sylvester` is $\operatorname{Syl}_D(E)$, the solution $K$ of $DK + KD = E$
      for a positive diagonal $D$ (entrywise $K_{ij} = E_{ij}/(d_i + d_j)$), a new letter
      with the rule $D\,\operatorname{Syl}_D(E) \to E - \operatorname{Syl}_D(E)\,D$, and
      $\operatorname{Diag}(\operatorname{Syl}_D(E)) = 0$ when $\operatorname{Diag}(E) = 0$
      ($K_{ii} = E_{ii}/2d_i$);
    * ``ones`` names an $m\times1$ letter $\mathbf 1$ with $\mathbf 1^\top\mathbf 1 \to m$
      (column sums are $\mathbf 1^\top M$);
    * ``monomial`` letters are signed permutation matrices $P$: $P^\top P \to I$,
      $PP^\top \to I$, and $\operatorname{Diag}(PMP^\top) = P\operatorname{Diag}(M)P^\top$
      (conjugating a diagonal by $P$ permutes its entries);
    * :meth:`entrywise` applies a scalar function entry by entry: to a diagonal matrix
      (``sqrt``, ``inv``: a new diagonal letter, with $f(P\Delta P^\top) = Pf(\Delta)P^\top$
      for monomial $P$) or, for ``sign``, to any matrix (odd and invariant under positive
      scaling: $\operatorname{sign}(PMQ^\top) = P\operatorname{sign}(M)Q^\top$ for monomial
      $P, Q$ and $\operatorname{sign}(\Lambda M\Lambda') = \operatorname{sign}(M)$ for
      ``positive`` diagonal letters $\Lambda, \Lambda'$);
    * ``shapes`` gives letters symbolic sizes (sympy expressions), which a
      :class:`FreeMatrix` reports as its ``shape`` (the library's validation and its
      wide/tall decisions read them; sympy decides $m < n$ from the symbols'
      assumptions).

    Every rule is an identity valid at every size, so an expression that reduces to zero
    vanishes identically at every size (soundness); the converse is not claimed.
    """

    def __init__(self, letters: Mapping[str, str], *, diagonal: Iterable[str] = (),
                 shapes: Mapping[str, tuple] | None = None, ones: tuple[str, Any] | None = None,
                 monomial: Iterable[str] = (), positive: Iterable[str] = ()):
        self.transpose_of: dict[str, str] = {}
        for a, b in letters.items():
            self.transpose_of[a], self.transpose_of[b] = b, a
        self.diagonal: set[str] = set(diagonal) | set(positive)
        for d in self.diagonal:
            self.transpose_of[d] = d
        self.shapes: dict[str, tuple] = {}
        for a, (rows, cols) in (shapes or {}).items():
            self.shapes[a], self.shapes[self.transpose_of[a]] = (rows, cols), (cols, rows)
        self.rules: dict[Word, dict[Word, sp.Expr]] = {}
        self.atoms: dict[str, tuple[str, Any]] = {}
        self.ones = None
        #: ``(t, order, digits)``: coefficients are truncated Taylor series in ``t``
        #: (terms of degree >= order dropped after every operation) with floating-point
        #: coefficients of ``digits`` digits (see :meth:`series`); ``None``: exact.
        self.series_mode: tuple[sp.Symbol, int, int | None] | None = None
        #: declared square roots of diagonal words (:meth:`square_root`)
        self.square_roots: dict[Word, tuple[str, str]] = {}
        #: a hypothesis: every positive norm exceeds the floors of ``clamp_min`` (which
        #: then keeps the value; e.g. msign's $\sqrt{\text{tiny}}$ for a point of norm
        #: $\operatorname{tr}(S^2)^{1/2}$ that sympy cannot compare with a number)
        self.norms_above_floors = False
        #: Diag(word) named by a plain diagonal letter (:meth:`name_diagonal`)
        self.named_diagonals: dict[Word, str] = {}
        #: signed permutation letters (and their transposes) and positive diagonal letters
        self.monomial: set[str] = set()
        for P in monomial:
            self.monomial |= {P, self.transpose_of[P]}
            self.rules[(self.transpose_of[P], P)] = {(): sp.Integer(1)}
            self.rules[(P, self.transpose_of[P])] = {(): sp.Integer(1)}
        self.positive: set[str] = set(positive)
        if ones is not None:
            name, size = ones
            self.transpose_of[name], self.transpose_of[name + "'"] = name + "'", name
            self.shapes[name], self.shapes[name + "'"] = (size, 1), (1, size)
            self.rules[(name + "'", name)] = {(): sp.sympify(size)}
            self.ones = name

    def __call__(self, letter: str) -> "FreeMatrix":
        if letter not in self.transpose_of:
            raise KeyError(f"FreeAlgebra: unknown letter {letter!r}")
        return FreeMatrix({(letter,): sp.Integer(1)}, self)

    def identity(self) -> "FreeMatrix":
        return FreeMatrix({(): sp.Integer(1)}, self)

    def rule(self, pattern: "FreeMatrix", replacement: "FreeMatrix | int") -> None:
        """Add the rewriting rule ``pattern -> replacement`` (``pattern`` one word)."""
        ((word, coefficient),) = pattern.terms.items()
        if coefficient != 1 or not word:
            raise ValueError("FreeAlgebra.rule: the pattern must be a single word with coefficient 1")
        replacement = replacement if isinstance(replacement, FreeMatrix) else replacement * self.identity()
        self.rules[word] = dict(replacement.terms)

    def _apply_rule(self, word: Word):
        for pattern, replacement in self.rules.items():
            k = len(pattern)
            for i in range(len(word) - k + 1):
                if word[i : i + k] == pattern:
                    return [(word[:i] + w + word[i + k :], c) for w, c in replacement.items()]
        return None

    def _rewrite_once(self, word: Word):
        rewritten = self._apply_rule(word)
        if rewritten is not None:
            return rewritten
        for i in range(len(word) - 1):
            a, b = word[i], word[i + 1]
            if a in self.diagonal and b in self.diagonal and b < a:
                return [(word[:i] + (b, a) + word[i + 2 :], sp.Integer(1))]
        return None

    def _sorted_diagonals(self, word: Word) -> Word:
        """``word`` with every run of adjacent diagonal letters sorted (they commute)."""
        out, run = [], []
        for x in word:
            if x in self.diagonal:
                run.append(x)
                continue
            out += sorted(run) + [x]
            run = []
        return tuple(out + sorted(run))

    def normal_form(self, terms: Iterable[tuple[Word, sp.Expr]]) -> dict[Word, sp.Expr]:
        out: dict[Word, sp.Expr] = {}
        stack = list(terms)
        while stack:
            word, coefficient = stack.pop()
            rewritten = self._rewrite_once(word)
            if rewritten is None:
                out[word] = out.get(word, 0) + coefficient
            else:
                stack.extend((w, coefficient * c) for w, c in rewritten)
        reduced = {w: self._coefficient(c) for w, c in out.items()}
        return {w: c for w, c in reduced.items() if c != 0}

    def series(self, t: sp.Symbol, order: int, digits: int | None) -> None:
        r"""Switch to truncated series: every coefficient becomes its Taylor polynomial in
        ``t`` below ``order``, with ``digits``-digit floating-point coefficients (a
        coefficient below $10^{-(\text{digits} - 10)}$ is dropped as round-off), or exact
        ones for ``digits=None``. For iterations whose exact coefficients grow without
        bound (twelve Polar Express steps compose a polynomial of degree $5^{12}$):
        products of truncated series are exact to that order, the float coefficients are
        not."""
        self.series_mode = (t, order, digits)

    def _coefficient(self, c) -> sp.Expr:
        if self.series_mode is None:
            return _reduce(c)
        t, order, digits = self.series_mode
        c = sp.expand(c)
        if digits is None:
            return sum(_reduce(c.coeff(t, k) if k else c.subs(t, 0)) * t**k for k in range(order))
        floor = sp.Rational(1, 10 ** (digits - 10))
        kept = 0
        for k in range(order):
            part = sp.N(c.coeff(t, k), digits) if k else sp.N(c.subs(t, 0), digits)
            if part.is_Number and abs(part) < floor:
                continue
            kept += part * t**k
        return kept

    def name_diagonal(self, M: "FreeMatrix", letter: str) -> "FreeMatrix":
        r"""Make $\operatorname{Diag}(u)$ of the word $u$ (and of $u^\top$) the plain diagonal
        letter ``letter``: unlike an atom ``<u>``, a trace never expands it back into $u$
        (which a rule rewriting $u$ in terms of $\operatorname{Diag}(u)$ would loop on)."""
        ((word, _),) = M.terms.items()
        self.diagonal.add(letter)
        self.transpose_of[letter] = letter
        self.shapes.setdefault(letter, (self.shapes.get(word[0], (None, None))[0],) * 2)
        self.named_diagonals[min(word, self.transpose_word(word), key=repr)] = letter
        return self(letter)

    def square_root(self, square: "FreeMatrix", root: str, inverse: str) -> None:
        r"""Declare diagonal letters ``root`` $= \sqrt{Q}$ and ``inverse`` $= Q^{-1/2}$ of
        the positive diagonal word ``square`` $Q$ (e.g. $Q = SS$ for a letter $S$; rules
        ``root inverse -> I``), for :meth:`FreeVector.sqrt`."""
        ((word, coefficient),) = square.terms.items()
        if coefficient != 1 or any(x not in self.diagonal for x in word):
            raise ValueError("FreeAlgebra.square_root: the square must be one word of diagonal letters")
        for name in (root, inverse):
            self.diagonal.add(name)
            self.transpose_of[name] = name
            self.shapes.setdefault(name, self.shapes.get(word[0], (None, None)))
        self.rules[(root, inverse)] = {(): sp.Integer(1)}
        self.rules[(inverse, root)] = {(): sp.Integer(1)}
        self.square_roots[word] = (root, inverse)

    def transpose_word(self, word: Word) -> Word:
        return tuple(self.transpose_of[x] for x in reversed(word))

    # -- the diagonal-part and Sylvester operators
    def diag(self, M: "FreeMatrix") -> "FreeMatrix":
        r"""$\operatorname{Diag}(M) = I \odot M$ (see the class docstring for its rules)."""
        out: list[tuple[Word, sp.Expr]] = []
        for word, coefficient in M.terms.items():
            diagonal = self._diag_word(word)
            if diagonal is not None:
                out.append((diagonal, coefficient))
        return FreeMatrix(out, self)

    def _diag_word(self, word: Word) -> Word | None:
        r"""$\operatorname{Diag}$ of one word (``None``: zero): diagonal letters at the ends
        come out, a conjugation by a monomial letter comes out, the rest is an atom."""
        i, j = 0, len(word)
        while i < j and word[i] in self.diagonal:
            i += 1
        while j > i and word[j - 1] in self.diagonal:
            j -= 1
        core = word[i:j]
        if not core:
            return word
        for P in sorted(self.monomial):
            inner = self._unconjugate(core, P)
            if inner is not None:
                inner = self._diag_word(inner)
                return None if inner is None else word[:i] + (P,) + inner + (self.transpose_of[P],) + word[j:]
        atom = self._diag_atom(core)
        return None if atom is None else word[:i] + (atom,) + word[j:]

    def _unconjugate(self, word: Word, P: str) -> Word | None:
        r"""The word $u$ with $P u P^\top = $ ``word`` for the monomial letter $P$, or ``None``:
        ``word`` starts with $P$ (or with $\mathbf 1$ when $P^\top\mathbf 1 = \mathbf 1$) and
        ends with $P^\top$ (or $\mathbf 1^\top$ when $\mathbf 1^\top P = \mathbf 1^\top$),
        at least one end being the letter itself."""
        if len(word) < 2:
            return None
        Pt, one = self.transpose_of[P], self.ones
        left = word[0] == P
        right = word[-1] == Pt
        if one is not None:
            left = left or (word[0] == one and self.rules.get((Pt, one)) == {(one,): 1})
            right = right or (word[-1] == one + "'" and self.rules.get((one + "'", P)) == {(one + "'",): 1})
        if not (left and right) or (word[0] != P and word[-1] != Pt):
            return None
        inner = word[1:] if word[0] == P else word
        return inner[:-1] if word[-1] == Pt else inner

    def _invariant_atom(self, word: Word) -> bool:
        r"""Whether ``word`` is one diagonal atom $\operatorname{Diag}(\mathbf 1 u\mathbf 1^\top)$
        (unchanged by a permutation that fixes $\mathbf 1$)."""
        if len(word) != 1 or self.atoms.get(word[0], ("",))[0] != "diag" or self.ones is None:
            return False
        inner = self.atoms[word[0]][1]
        return {inner[0], inner[-1]} == {self.ones, self.ones + "'"} and all(
            self.rules.get((P, self.ones)) == {(self.ones,): 1} for P in self.monomial)

    def _diag_atom(self, core: Word) -> str | None:
        if len(core) == 1 and self.atoms.get(core[0], ("",))[0] == "sylvester":
            _, (inner, _) = self.atoms[core[0]]
            if self.diag(inner).is_zero():
                return None
        canonical = min(core, self.transpose_word(core), key=repr)
        if canonical in self.named_diagonals:
            return self.named_diagonals[canonical]
        name = "<" + "".join(canonical) + ">"
        if name not in self.atoms:
            self.atoms[name] = ("diag", canonical)
            self.diagonal.add(name)
            self.transpose_of[name] = name
            rows = self.shapes.get(canonical[0], (None, None))[0]
            self.shapes[name] = (rows, rows)
        return name

    def sylvester(self, E: "FreeMatrix", D: str) -> "FreeMatrix":
        r"""$\operatorname{Syl}_D(E)$: the $K$ with $DK + KD = E$, $D$ a positive diagonal letter."""
        if D not in self.diagonal:
            raise ValueError(f"FreeAlgebra.sylvester: {D!r} is not a diagonal letter")
        if E.is_zero():
            return FreeMatrix({}, self)
        names = []
        for terms in (E.terms, E.mT.terms):
            key = repr(sorted(terms.items(), key=repr))
            name = f"Syl[{D}]({key})"
            names.append(name)
            if name not in self.atoms:
                self.atoms[name] = ("sylvester", (FreeMatrix(terms, self), D))
                self.shapes[name] = self.shapes.get(D, (None, None))
                # D K -> E - K D: moves D to the right of K, so the rule terminates.
                self.rules[(D, name)] = {**terms, (name, D): sp.Integer(-1)}
        self.transpose_of[names[0]], self.transpose_of[names[1]] = names[1], names[0]
        return FreeMatrix({(names[0],): sp.Integer(1)}, self)

    def entrywise(self, name: str, M: "FreeMatrix") -> "FreeMatrix":
        r"""The entrywise function ``name`` of $M$ (see the class docstring): ``"sqrt"`` and
        ``"inv"`` of a diagonal $M$ (a combination of words of diagonal letters, or such a
        combination conjugated by one monomial letter; the identity is $PP^\top$), whose
        value is a new diagonal letter ``name[M]``; ``"sign"`` of any $M$, a new letter
        ``sign[M]`` after the monomial and positive diagonal letters at both ends of every
        word are taken out. The new letters are opaque (no rule relates them to $M$), so
        every identity reduced with them holds for every value of the function."""
        terms = M.terms
        if name == "sign":
            for end in (0, -1):
                heads = {w[end] if w else None for w in terms}
                if len(heads) != 1 or None in heads:
                    continue
                (head,) = heads
                if head in self.positive or head in self.monomial:
                    stripped = FreeMatrix({(w[1:] if end == 0 else w[:-1]): c for w, c in terms.items()}, self)
                    inner = self.entrywise(name, stripped)
                    if head in self.positive:
                        return inner
                    return self(head) @ inner if end == 0 else inner @ self(head)
            return self._entrywise_atom(name, M, diagonal=False)
        for P in sorted(self.monomial):
            inner = {w: self._unconjugate(w, P) for w in terms}
            if any(inner.values()) and all(u is not None or not w or self._invariant_atom(w) for w, u in inner.items()):
                unconjugated = FreeMatrix({(u if u is not None else w): c for (w, u), c in zip(inner.items(), terms.values())}, self)
                return self(P) @ self.entrywise(name, unconjugated) @ self(self.transpose_of[P])
        if not all(x in self.diagonal for w in terms for x in w):
            raise NotImplementedError(f"FreeAlgebra.entrywise: {name} of the non-diagonal {M!r}")
        return self._entrywise_atom(name, M, diagonal=True)

    def _entrywise_atom(self, name: str, M: "FreeMatrix", diagonal: bool) -> "FreeMatrix":
        key = f"{name}[{sorted(M.terms.items(), key=repr)!r}]"
        if key not in self.atoms:
            self.atoms[key] = ("entrywise", (name, M))
            shape = M._shape
            if diagonal:
                self.diagonal.add(key)
                self.transpose_of[key] = key
            else:
                transposed = f"{name}[{sorted(M.mT.terms.items(), key=repr)!r}]"
                self.atoms[transposed] = ("entrywise", (name, M.mT))
                self.transpose_of[key], self.transpose_of[transposed] = transposed, key
                if shape is not None:
                    self.shapes[transposed] = shape[::-1]
            if shape is not None:
                self.shapes[key] = shape
        return FreeMatrix({(key,): sp.Integer(1)}, self, M._shape)

    def trace(self, M: "FreeMatrix") -> dict[Word, sp.Expr]:
        r"""Normal form of $\operatorname{tr}(M)$: words up to cyclic rotation and
        transposition ($\operatorname{tr}(AB) = \operatorname{tr}(BA)$,
        $\operatorname{tr}(A^\top) = \operatorname{tr}(A)$), with the rules applied
        cyclically, and $\operatorname{tr}(\operatorname{Diag}(u)\,v) =
        \operatorname{tr}(u\operatorname{Diag}(v))$ used to shorten the diagonal part's
        argument ($=\operatorname{tr}(u\,v)$ when $v$ is diagonal). Zero iff the trace
        vanishes identically (for the given rules)."""
        out: dict[Word, sp.Expr] = {}
        stack = list(M.terms.items())
        while stack:
            word, coefficient = stack.pop()
            rotations = [word[i:] + word[:i] for i in range(max(len(word), 1))]
            rewritten = self._trace_step(rotations)
            if rewritten is not None:
                stack.extend((w, coefficient * c) for w, c in rewritten)
                continue
            candidates = rotations + [self.transpose_word(r) for r in rotations]
            key = min(self._sorted_diagonals(c) for c in candidates)
            out[key] = out.get(key, 0) + coefficient
        reduced = {w: self._coefficient(c) for w, c in out.items()}
        return {w: c for w, c in reduced.items() if c != 0}

    def _trace_step(self, rotations: list[Word]):
        # Rules apply cyclically; the commutation of diagonal letters does not (it would
        # undo a rotation forever), it enters the canonical key instead.
        for r in rotations:
            rewritten = self._apply_rule(r)
            if rewritten is not None:
                return rewritten
        for r in rotations:
            head, rest = (r[0], r[1:]) if r else (None, ())
            if self.atoms.get(head, ("",))[0] != "diag":
                continue
            inner = self.atoms[head][1]
            if all(x in self.diagonal for x in rest):
                return [(inner + rest, sp.Integer(1))]
            if (len(rest), repr(rest)) < (len(inner), repr(inner)):
                moved = FreeMatrix({inner: sp.Integer(1)}, self) @ self.diag(FreeMatrix({rest: sp.Integer(1)}, self))
                return list(moved.terms.items())
        return None


class SymbolicSize(int):
    r"""A matrix dimension that is a sympy expression (e.g. $a + b + 2$), as the library's
    code sees it: comparisons are decided by sympy from the symbols' assumptions (an
    undecidable one raises), arithmetic gives sympy expressions, and ``float()`` raises
    ``TypeError`` (code that needs a number, such as the router's
    ``float(x.size(-2))``, cannot run at symbolic size). Its ``int`` value is a
    placeholder 0 that nothing reads: torch hands the object itself to
    :class:`_FreeFactories`."""

    def __new__(cls, expr):
        size = int.__new__(cls, 0)
        size.expr = sp.sympify(expr)
        return size

    def _decide(self, relation) -> bool:
        if relation not in (sp.true, sp.false):
            raise TypeError(f"SymbolicSize: cannot decide {relation}")
        return bool(relation)

    def __eq__(self, other):
        return self._decide(sp.Eq(self.expr, _size_expr(other)))

    def __ne__(self, other):
        return not self == other

    def __lt__(self, other):
        return self._decide(self.expr < _size_expr(other))

    def __le__(self, other):
        return self._decide(self.expr <= _size_expr(other))

    def __gt__(self, other):
        return self._decide(self.expr > _size_expr(other))

    def __ge__(self, other):
        return self._decide(self.expr >= _size_expr(other))

    def __hash__(self):
        return hash(self.expr)

    def __float__(self):
        raise TypeError(f"SymbolicSize: the dimension {self.expr} has no numeric value")

    def __add__(self, other):
        return self.expr + _size_expr(other)

    __radd__ = __add__

    def __sub__(self, other):
        return self.expr - _size_expr(other)

    def __rsub__(self, other):
        return _size_expr(other) - self.expr

    def __mul__(self, other):
        return self.expr * _size_expr(other)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self.expr / _size_expr(other)

    def __rtruediv__(self, other):
        return _size_expr(other) / self.expr

    def __pow__(self, other):
        return self.expr ** exact(other)

    def __repr__(self) -> str:
        return str(self.expr)

    __str__ = __repr__


def _size_expr(value):
    return value.expr if isinstance(value, SymbolicSize) else sp.sympify(value)


class FreeMatrix:
    r"""A linear combination of words of a :class:`FreeAlgebra` (a matrix of symbolic
    size): ``terms`` maps words to commutative sympy coefficients.

    Supports ``+ - *`` (scalars; floats become exact), ``/`` by a scalar, ``@``, ``mT``,
    ``torch.baddbmm``, ``torch.diagonal`` (the diagonal part, as a :class:`FreeVector`)
    and the entrywise operations the manifolds use: ``X * U`` and ``X.square()`` followed
    by a sum over rows or columns (:class:`FreeHadamard`), products and quotients by
    broadcast vectors, column sums and means (with the algebra's ``ones`` letter). That is
    all :func:`geomuon.manifolds.linalg.sym`, the manifolds' method bodies and
    :func:`geomuon.manifolds.linalg.newton_schulz_step` use.
    """

    dtype = torch.float64
    device = torch.device("cpu")

    def __init__(self, terms: Mapping[Word, sp.Expr] | Iterable, algebra: FreeAlgebra, shape: tuple | None = None):
        self.algebra = algebra
        items = terms.items() if isinstance(terms, Mapping) else terms
        self.terms = algebra.normal_form(items)
        # The shape of an expression whose words may all cancel (a zero matrix keeps it).
        self._shape = shape if shape is not None else self._word_shape()

    # -- structure (what the library's validation reads)
    def _word_shape(self) -> tuple | None:
        shapes = self.algebra.shapes
        for word in self.terms:
            if word and shapes.get(word[0], (None,))[0] is not None and shapes.get(word[-1], (None, None))[1] is not None:
                return (shapes[word[0]][0], shapes[word[-1]][1])
        return None

    @property
    def shape(self) -> tuple:
        """``(1, m, n)``: a batch of one matrix, as ``reshape(-1, m, n)`` leaves it (so
        ``msign``'s question whether it holds a single matrix gets torch's answer)."""
        if self._shape is None:
            raise ValueError("FreeMatrix: no letter of this expression has a declared shape")
        return tuple(SymbolicSize(s) for s in (1, *self._shape))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 3

    def __getitem__(self, index):
        if index != 0:
            raise NotImplementedError("FreeMatrix: only the batch's one matrix, [0]")
        return self

    def is_floating_point(self) -> bool:
        return True

    def to(self, *args, **kwargs) -> "FreeMatrix":
        return self

    def double(self) -> "FreeMatrix":
        return self

    def expand(self, *shape) -> "FreeMatrix":
        return self

    def reshape(self, *shape) -> "FreeMatrix":
        return self

    def norm(self, p="fro", dim=None, keepdim: bool = False) -> "FreeScalar":
        r"""$\|M\|_F = \sqrt{\operatorname{tr}(M^\top M)}$ as a :class:`FreeScalar`: the trace
        normal form, with $\operatorname{tr}(I) = n$ (the column count) and every other
        closed word a positive symbol ``tr(w)``."""
        if dim in (-1, -2):
            # row (dim=-1) or column norms: the entrywise root of Diag(M M') or Diag(M'M)
            gram = self @ self.mT if dim == -1 else self.mT @ self
            side = ("left" if dim == -1 else "right") if keepdim else None
            return FreeVector(self.algebra.entrywise("sqrt", self.algebra.diag(gram)), side)
        if dim not in (None, (-2, -1)):
            raise NotImplementedError("FreeMatrix.norm: the Frobenius norm of the whole matrix, or of rows or columns")
        return _trace_scalar(self.mT @ self, positive=True) ** sp.Rational(1, 2)

    def new_full(self, shape, value, **kwargs):
        """A constant array: acts entrywise as the scalar ``value``."""
        return exact(value)

    def _scalar_or(self, other):
        if isinstance(other, FreeMatrix):
            return other
        if isinstance(other, FreeRow):
            return other.broadcast()
        return FreeMatrix({(): exact(other)}, self.algebra)

    def __add__(self, other):
        other = self._scalar_or(other)
        return FreeMatrix(list(self.terms.items()) + list(other.terms.items()), self.algebra, self._shape or other._shape)

    __radd__ = __add__

    def __neg__(self):
        return FreeMatrix({w: -c for w, c in self.terms.items()}, self.algebra, self._shape)

    def __sub__(self, other):
        return self + (-self._scalar_or(other))

    def __rsub__(self, other):
        return self._scalar_or(other) - self

    def __mul__(self, scalar):
        if isinstance(scalar, FreeMatrix):
            return FreeHadamard(self, scalar)
        if isinstance(scalar, (FreeVector, FreeBroadcastSum)):
            return scalar * self
        s = scalar.value if isinstance(scalar, FreeScalar) else exact(scalar)
        return FreeMatrix({w: s * c for w, c in self.terms.items()}, self.algebra, self._shape)

    __rmul__ = __mul__

    def __truediv__(self, scalar):
        if isinstance(scalar, (FreeVector, FreeBroadcastSum)):
            return scalar.divide(self)
        if isinstance(scalar, FreeScalar):
            return self * (scalar ** -1).value
        return self * (1 / exact(scalar))

    def __matmul__(self, other):
        other = self._scalar_or(other)
        if self._shape is not None and other._shape is not None and sp.sympify(self._shape[1] - other._shape[0]) != 0:
            raise ValueError(f"FreeMatrix: product of shapes {self._shape} and {other._shape}")
        products = [(u + v, a * b) for u, a in self.terms.items() for v, b in other.terms.items()]
        shape = (self._shape[0], other._shape[1]) if self._shape is not None and other._shape is not None else None
        return FreeMatrix(products, self.algebra, shape)

    @property
    def mT(self) -> "FreeMatrix":
        shape = self._shape[::-1] if self._shape is not None else None
        return FreeMatrix({self.algebra.transpose_word(w): c for w, c in self.terms.items()}, self.algebra, shape)

    def square(self) -> "FreeHadamard":
        return FreeHadamard(self, self)

    def sum(self, dim=None, keepdim: bool = False) -> "FreeRow":
        r"""Column sums $\mathbf 1^\top M$ (``dim=-2``), with the algebra's ``ones`` letter."""
        if dim not in (-2,) or self.algebra.ones is None:
            raise NotImplementedError("FreeMatrix.sum: only column sums (dim=-2) with a ones letter")
        ones = self.algebra(self.algebra.ones)
        return FreeRow(ones.mT @ self, broadcast=keepdim)

    def mean(self, dim=None, keepdim: bool = False) -> "FreeRow":
        return self.sum(dim, keepdim) / self.algebra.shapes[self.algebra.ones][0]

    def map_coefficients(self, fn: Callable) -> "FreeMatrix":
        return FreeMatrix({w: fn(c) for w, c in self.terms.items()}, self.algebra, self._shape)

    def truncate(self, t: sp.Symbol, order: int) -> "FreeMatrix":
        """Drop every term of degree ``>= order`` in the scalar ``t`` (a Taylor truncation)."""
        kept = {}
        for w, c in self.terms.items():
            parts = [p for p in sp.Add.make_args(sp.expand(c)) if sp.degree(p, t) < order]
            kept[w] = sp.Add(*parts)
        return FreeMatrix(kept, self.algebra)

    def is_zero(self) -> bool:
        return not self.terms

    def __eq__(self, other):
        return (self - other).is_zero()

    __hash__ = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.baddbmm:
            input, batch1, batch2 = args
            return exact(kwargs.get("beta", 1)) * input + exact(kwargs.get("alpha", 1)) * (batch1 @ batch2)
        if func is torch.add:
            input, other = args
            return input + exact(kwargs.get("alpha", 1)) * other
        if func is torch.diagonal:
            return FreeVector(args[0].algebra.diag(args[0]))
        if func is torch.diag_embed:
            return args[0].matrix
        if func is torch.sign:
            return args[0].algebra.entrywise("sign", args[0])
        if func is torch.zeros_like:
            return FreeMatrix({}, args[0].algebra, args[0]._shape)
        raise NotImplementedError(f"FreeMatrix: torch function {getattr(func, '__name__', func)} is not supported")

    def __repr__(self) -> str:
        if not self.terms:
            return "0"
        return " + ".join(f"({c})*{'·'.join(w) or 'I'}" for w, c in sorted(self.terms.items()))


def _trace_scalar(M: "FreeMatrix", positive: bool = False) -> "FreeScalar":
    r"""$\operatorname{tr}(M)$ of a square free matrix as a :class:`FreeScalar`: the trace
    normal form, $\operatorname{tr}(I)$ = the size, every other closed word a symbol
    ``tr(w)`` (positive for the words of a Gram matrix $M^\top M$, ``positive=True``)."""
    value = 0
    for word, c in M.algebra.trace(M).items():
        name = f"tr({''.join(word)})"
        value += c * (_size_expr(M.shape[-1]) if not word else sp.Symbol(name, positive=True) if positive else sp.Symbol(name, real=True))
    return FreeScalar(value, M.algebra)


class FreeScalar:
    r"""A scalar of a :class:`FreeAlgebra` computation (a norm): a sympy expression, kept
    as a truncated series when the algebra is in series mode (powers are expanded
    around the value at $t = 0$, which must be positive)."""

    def __init__(self, value, algebra: FreeAlgebra):
        self.value, self.algebra = sp.sympify(value), algebra

    def __pow__(self, k) -> "FreeScalar":
        k = exact(k)
        mode = self.algebra.series_mode
        if mode is None:
            return FreeScalar(self.value**k, self.algebra)
        t, order, digits = mode
        base = self.value.subs(t, 0)
        rest = sp.expand(self.value - base)
        # (b + r)^k = b^k sum_j binom(k, j) (r/b)^j, r = O(t): order terms suffice.
        total = sum(sp.binomial(k, j) * base ** (k - j) * rest**j for j in range(order))
        return FreeScalar(self.algebra._coefficient(total), self.algebra)

    def __mul__(self, other) -> "FreeScalar":
        other = other.value if isinstance(other, FreeScalar) else exact(other)
        return FreeScalar(self.algebra._coefficient(self.value * other), self.algebra)

    __rmul__ = __mul__

    def clamp_min(self, floor) -> "FreeScalar":
        """The value itself when its value at $t = 0$ is provably above ``floor``."""
        mode = self.algebra.series_mode
        at_zero = self.value.subs(mode[0], 0) if mode else self.value
        provable = bool(sp.sympify(at_zero - exact(floor)).is_positive)
        # a hypothesis of the certificate (stated there): the norm is above the floor
        assumed = self.algebra.norms_above_floors
        if not (provable or assumed):
            raise NotImplementedError(f"FreeScalar.clamp_min: cannot show {at_zero} > {floor}")
        return self

    pow = __pow__

    def __gt__(self, other) -> "_FreeTruth":
        """``norm > 0``: true when provable, or under the hypothesis that norms exceed the
        floors (:attr:`FreeAlgebra.norms_above_floors`, floors are nonnegative)."""
        return _FreeTruth(bool(sp.sympify(self.value - exact(other)).is_positive) or self.algebra.norms_above_floors)

    def __repr__(self) -> str:
        return f"FreeScalar({self.value})"


class _Wrapped:
    """A free matrix (``matrix``) seen as a vector or row with a broadcast tag: the
    coefficient-wise operations act on the matrix and keep the tag (``_rewrap``)."""

    matrix: FreeMatrix

    def _rewrap(self, matrix: FreeMatrix):
        raise NotImplementedError

    def is_zero(self) -> bool:
        return self.matrix.is_zero()

    def map_coefficients(self, fn: Callable):
        return self._rewrap(self.matrix.map_coefficients(fn))

    @property
    def terms(self):
        return self.matrix.terms


class FreeVector(_Wrapped):
    r"""A vector of symbolic length held as the diagonal matrix $\operatorname{Diag}(v)$
    (a :class:`FreeMatrix` of diagonal letters): what ``(X * U).sum(dim)``,
    ``torch.diagonal`` and ``X.square().sum(dim)`` return on free letters.

    ``side`` records a broadcast shape: ``"right"`` for ``[..., 1, n]`` (``unsqueeze(-2)``
    or ``sum(-2, keepdim=True)``: it scales columns, $M \odot \mathbf 1v^\top = M\,\Delta$),
    ``"left"`` for ``[..., m, 1]`` (scales rows, $\Delta M$), ``None`` for a plain vector.
    Two broadcasts of opposite sides add to a :class:`FreeBroadcastSum`.
    """

    __hash__ = None

    def __init__(self, matrix: FreeMatrix, side: str | None = None):
        self.matrix, self.side, self.algebra = matrix, side, matrix.algebra

    def _other(self, other) -> FreeMatrix:
        if isinstance(other, FreeVector):
            return other.matrix
        return exact(other) * self.algebra.identity()

    def __add__(self, other):
        if isinstance(other, FreeVector) and {self.side, other.side} == {"left", "right"}:
            left, right = (self, other) if self.side == "left" else (other, self)
            return FreeBroadcastSum(left.matrix, right.matrix)
        return FreeVector(self.matrix + self._other(other), self.side)

    __radd__ = __add__

    def __neg__(self):
        return FreeVector(-self.matrix, self.side)

    def __sub__(self, other):
        if isinstance(other, FreeVector):
            return self + (-other)
        return FreeVector(self.matrix - self._other(other), self.side)

    def __rsub__(self, other):
        return (-self) + other

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.diag_embed:
            return args[0].matrix
        raise NotImplementedError(f"FreeVector: torch function {getattr(func, '__name__', func)} is not supported")

    def __mul__(self, other):
        if isinstance(other, FreeMatrix):
            if self.side == "right":
                return other @ self.matrix
            if self.side == "left":
                return self.matrix @ other
            raise ValueError("FreeVector: a plain vector times a matrix has no broadcast side")
        return FreeVector(self.matrix @ self._other(other), self.side)

    __rmul__ = __mul__

    def _inverse(self) -> FreeMatrix:
        terms = self.matrix.terms
        if set(terms) == {()}:
            return (1 / terms[()]) * self.algebra.identity()
        if any(self.algebra.atoms.get(x, ("",))[0] == "entrywise" for w in terms for x in w):
            # 1/(|d_i| + eps) of an entrywise root: an entrywise function itself
            return self.algebra.entrywise("inv", self.matrix)
        mode = self.algebra.series_mode
        split = self._one_word_plus_rest() if mode is not None and mode[1] == 2 else None
        inverses = {(root,): inverse for root, inverse in self.algebra.square_roots.values()}
        if split is not None and split[0] in inverses:
            # (Q + R)^{-1} = Q^{-1} - Q^{-1} R Q^{-1} + O(t^2) for a declared root Q and R = O(t)
            word, c, rest = split
            inverse = self.algebra(inverses[word]) / c
            return inverse - inverse @ rest @ inverse
        raise NotImplementedError(f"FreeVector: no inverse of {self.matrix!r}")

    def _one_word_plus_rest(self) -> tuple | None:
        r"""``(word, c, R)`` with this vector $= c\,\text{word} + R$, $R$ vanishing at $t = 0$ in
        series mode (every term outside it), where exactly one word survives at $t = 0$; else
        ``None``."""
        mode = self.algebra.series_mode
        at_zero = {w: c.subs(mode[0], 0) if mode else c for w, c in self.matrix.terms.items()}
        at_zero = {w: c for w, c in at_zero.items() if c != 0}
        if len(at_zero) != 1:
            return None
        ((word, c),) = at_zero.items()
        return word, c, self.matrix - c * FreeMatrix({word: sp.Integer(1)}, self.algebra)

    def __truediv__(self, other):
        if isinstance(other, FreeVector):
            return FreeVector(self.matrix @ other._inverse(), self.side or other.side)
        return FreeVector(self.matrix / other, self.side)

    def divide(self, M: FreeMatrix) -> FreeMatrix:
        """``M / self`` (broadcast)."""
        return FreeVector(self._inverse(), self.side) * M

    def __rtruediv__(self, other):
        return FreeVector(self._other(other) @ self._inverse(), self.side)

    def unsqueeze(self, dim: int) -> "FreeVector":
        return FreeVector(self.matrix, "right" if dim == -2 else "left")

    def sqrt(self) -> "FreeVector":
        r"""$\sqrt{Q + R} = \sqrt Q + \tfrac12 RQ^{-1/2} + O(t^2)$ for a declared square
        $Q$ (:meth:`FreeAlgebra.square_root`) and $R = O(t)$: exact in series mode of
        order 2 (first-order Taylor coefficients). Outside series mode, any other diagonal
        is rooted by the opaque entrywise square root (:meth:`FreeAlgebra.entrywise`)."""
        algebra = self.algebra
        mode = algebra.series_mode
        split = self._one_word_plus_rest()
        roots = algebra.square_roots
        if split is None or split[0] not in roots or not split[1].is_positive:
            if mode is None:
                return FreeVector(algebra.entrywise("sqrt", self.matrix), self.side)
            raise NotImplementedError(f"FreeVector.sqrt: {self.matrix!r} is not a declared square + O(t)")
        word, c, rest = split
        root, inverse = (algebra(x) for x in roots[word])
        if not rest.is_zero() and (mode is None or mode[1] != 2):
            raise NotImplementedError("FreeVector.sqrt: a perturbed square needs series mode of order 2")
        return FreeVector(sp.sqrt(c) * root + rest @ inverse / (2 * sp.sqrt(c)), self.side)

    def __eq__(self, other):
        return _FreeTruth(bool((self.matrix - self._other(other)).is_zero()))

    def _rewrap(self, matrix: FreeMatrix) -> "FreeVector":
        return FreeVector(matrix, self.side)

    def __repr__(self) -> str:
        return f"FreeVector({self.matrix!r}, side={self.side})"


@dataclass(frozen=True)
class _FreeTruth:
    """The elementwise comparison ``v == c`` of a :class:`FreeVector`: whether it holds
    identically (``any()``/``all()``), e.g. the library's check for zero columns."""

    value: bool

    def any(self) -> bool:
        return self.value

    all = any

    def __bool__(self) -> bool:
        return self.value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.where:  # torch.where(truth, x, y): the branch the truth selects
            condition, x, y = args
            return x if condition.value else y
        raise NotImplementedError(f"_FreeTruth: torch function {getattr(func, '__name__', func)} is not supported")


class FreeBroadcastSum:
    r"""$a\mathbf 1^\top + \mathbf 1b^\top$ for diagonal $a = \operatorname{Diag}(\alpha)$
    (rows) and $b$ (columns): ``u.unsqueeze(-1) + v.unsqueeze(-2)``. A product
    $M \odot (\alpha_i + \beta_j) = aM + Mb$; a quotient $M \oslash (d_i + d_j)$, with
    $a = b = cD$ for one diagonal letter $D$, is $\operatorname{Syl}_D(M)/c$."""

    __hash__ = None

    def __init__(self, left: FreeMatrix, right: FreeMatrix):
        self.left, self.right, self.algebra = left, right, left.algebra

    def __mul__(self, other):
        if isinstance(other, FreeMatrix):
            return self.left @ other + other @ self.right
        return FreeBroadcastSum(self.left * other, self.right * other)

    __rmul__ = __mul__

    def divide(self, M: FreeMatrix) -> FreeMatrix:
        """``M / self``: the Sylvester solve (see the class docstring)."""
        ((word, c),) = self.left.terms.items() if len(self.left.terms) == 1 else ((None, None),)
        algebra = self.algebra
        if word is not None and len(word) == 3 and word[0] in algebra.monomial and word[2] == algebra.transpose_of[word[0]] \
                and self.right.terms == self.left.terms:
            # a diagonal conjugated by a signed permutation: Syl_{PDP'}(M) = P Syl_D(P'MP) P'
            P = algebra(word[0])
            return P @ algebra.sylvester(P.mT @ M @ P, word[1]) @ P.mT / c
        if word is None or len(word) != 1 or self.right.terms != self.left.terms:
            raise NotImplementedError(f"FreeBroadcastSum: no quotient by {self.left!r} (+) {self.right!r}")
        return algebra.sylvester(M, word[0]) / c

    def positive(self) -> bool:
        """Whether both parts are a positive multiple of one positive diagonal letter."""
        return all(len(part.terms) == 1 and next(iter(part.terms.values())) > 0 and
                   len(next(iter(part.terms))) == 1 for part in (self.left, self.right))


class FreeHadamard:
    r"""The entrywise product $X \odot U$ of two free matrices, kept unevaluated until it is
    summed: over rows (``sum(-2)``) it is the vector $\operatorname{Diag}(X^\top U)$, over
    columns (``sum(-1)``) $\operatorname{Diag}(XU^\top)$."""

    def __init__(self, left: FreeMatrix, right: FreeMatrix):
        self.left, self.right = left, right

    def sum(self, dim, keepdim: bool = False) -> FreeVector:
        algebra = self.left.algebra
        if dim == -2:
            return FreeVector(algebra.diag(self.left.mT @ self.right), "right" if keepdim else None)
        if dim == -1:
            return FreeVector(algebra.diag(self.left @ self.right.mT), "left" if keepdim else None)
        if dim == (-2, -1):
            return _trace_scalar(self.left.mT @ self.right)
        raise NotImplementedError(f"FreeHadamard.sum: dim must be -2, -1 or (-2, -1), got {dim}")


class FreeRow(_Wrapped):
    r"""A row vector $r$ ($1\times n$, a :class:`FreeMatrix` such as $\mathbf 1^\top M$):
    the column sums of the router. ``broadcast`` ($[..., 1, n]$) subtracts from an
    $m\times n$ matrix as $\mathbf 1r$; ``expand`` materializes $\mathbf 1r$."""

    __hash__ = None

    def __init__(self, row: FreeMatrix, broadcast: bool = False):
        self.row, self.is_broadcast, self.algebra = row, broadcast, row.algebra

    def broadcast(self) -> FreeMatrix:
        return self.algebra(self.algebra.ones) @ self.row

    def __add__(self, other):
        return FreeRow(self.row + (other.row if isinstance(other, FreeRow) else other), self.is_broadcast)

    def __neg__(self):
        return FreeRow(-self.row, self.is_broadcast)

    def __sub__(self, other):
        return self + (-other)

    def __mul__(self, scalar):
        return FreeRow(self.row * scalar, self.is_broadcast)

    __rmul__ = __mul__

    def __truediv__(self, scalar):
        return FreeRow(self.row / scalar, self.is_broadcast)

    def unsqueeze(self, dim: int) -> "FreeRow":
        if dim != -2:
            raise NotImplementedError("FreeRow.unsqueeze: only dim=-2 (a row of a matrix)")
        return FreeRow(self.row, True)

    def expand(self, *shape) -> FreeMatrix:
        return self.broadcast()

    @property
    def shape(self) -> tuple:
        return (self.row.shape[-1],)

    def dim(self) -> int:
        return 1

    @property
    def matrix(self) -> FreeMatrix:
        return self.row

    def _rewrap(self, matrix: FreeMatrix) -> "FreeRow":
        return FreeRow(matrix, self.is_broadcast)


def _free_inner(a, b) -> dict[Word, sp.Expr]:
    r"""Trace normal form of the Frobenius inner product $\langle a, b\rangle$ of two free
    matrices, vectors (diagonal form: $\operatorname{tr}(\Delta_a\Delta_b)$) or rows."""
    if isinstance(a, FreeVector):
        return a.algebra.trace(a.matrix @ b.matrix)
    if isinstance(a, FreeRow):
        return a.algebra.trace(a.row.mT @ b.row)
    return a.algebra.trace(a.mT @ b)


def _half_powers_reduced(e):
    """Normalize the bases of square roots (and their odd powers) to :func:`_reduce`
    form, so that e.g. $\\sqrt{x^2 + (1 - x^2)}$ becomes $1$."""
    e = sp.sympify(e)
    return e.replace(
        lambda x: x.is_Pow and x.exp.is_Rational and x.exp.q == 2,
        lambda x: sp.Pow(sp.cancel(x.base), x.exp),
    )


def _as_expr(e) -> sp.Expr:
    return e.as_expr() if isinstance(e, FracElement) else sp.sympify(e)


def _in_field(W: ExactTensor, shapes: Sequence[tuple[str, tuple]]):
    r"""``W`` converted into the field $\mathbb Q(\text{parameters of } W, \text{new
    symbols})$, and an :class:`ExactTensor` of fresh generators of each requested shape
    (``()`` gives one generator, returned as a field element)."""
    params = sorted(set().union(*[_as_expr(e).free_symbols for e in W.a.flat]), key=str)
    fresh = []
    for prefix, shape in shapes:
        count = int(np.prod(shape)) if shape else 1
        fresh.append([sp.Symbol(f"{prefix}{k}", real=True) for k in range(count)])
    field, *gens = sp.field([*params, *itertools.chain(*fresh)], sp.QQ)
    converted = ExactTensor(np.vectorize(lambda e: field.from_expr(_as_expr(e)), otypes=[object])(W.a))
    out, k = [], len(params)
    for (prefix, shape), symbols in zip(shapes, fresh):
        block = gens[k : k + len(symbols)]
        k += len(symbols)
        out.append(ExactTensor(np.array(block, dtype=object).reshape(shape)) if shape else block[0])
    return converted, out


def _nonzero_somewhere(e) -> bool:
    """Whether ``e`` is provably nonzero at one rational point of its symbols (positive
    values $k/7 + 1/3$; 40-digit evaluation, nonzero beyond $10^{-25}$)."""
    e = sp.sympify(e)
    if e == 0:
        return False
    symbols = sorted(e.free_symbols, key=str)
    point = {x: sp.Rational(k % 5 + 1, 7) + sp.Rational(1, 3) for k, x in enumerate(symbols)}
    try:
        value = sp.N(e.subs(point), 40)
    except (TypeError, ValueError, ZeroDivisionError):
        return False
    return bool(value.is_number and value.is_finite and abs(value) > sp.Rational(1, 10**25))


def _zero_tensor(T) -> tuple[bool, Any]:
    """Whether an ExactTensor / sympy expression vanishes identically, and the reduced form."""
    if isinstance(T, ExactTensor) and T.numel() and all(isinstance(e, FracElement) for e in T.a.flat):
        return not any(T.a.flat), ExactTensor(np.vectorize(_as_expr, otypes=[object])(T.a)).matrix() if T.a.ndim == 2 else T.a
    if isinstance(T, FracElement):
        return not T, T.as_expr()
    if isinstance(T, ExactTensor):
        # A nonzero value at one rational point proves an entry is not identically zero
        # (cheap; the normal form of a nonzero expression with roots can take minutes).
        if any(_nonzero_somewhere(e) for e in T.a.flat):
            return False, T.a
        reduced = np.vectorize(lambda e: _reduce(_half_powers_reduced(e)), otypes=[object])(T.a)
        return all(r == 0 for r in reduced.flat), reduced
    if _nonzero_somewhere(T):
        return False, T
    r = _reduce(_half_powers_reduced(T))
    return r == 0, r


# ======================================================================================
# Exact points of every manifold, at any concrete size


def _unit_vector(m: int, prefix: str) -> list:
    r"""Rational unit vector of $\mathbb R^m$ by inverse stereographic projection:
    $(1 - \|u\|^2, 2u)/(1 + \|u\|^2)$ for symbols $u \in \mathbb R^{m-1}$ ($m = 1$: $1$)."""
    if m == 1:
        return [sp.Integer(1)]
    u = sp.symbols(f"{prefix}0:{m - 1}", real=True)
    q = sum(x**2 for x in u)
    return [(1 - q) / (1 + q), *[2 * x / (1 + q) for x in u]]


def _frame(m: int, n: int, prefix: str = "s") -> sp.Matrix:
    """The first ``n`` columns of a symbolic Cayley rotation of size ``m`` (``m >= n``)."""
    return cayley(skew(m, prefix))[:, :n] if m > 1 else sp.ones(1, 1)


def _rational_frame(m: int, n: int) -> sp.Matrix:
    """The first ``n`` columns of the Cayley rotation of size ``m`` whose skew entries are the
    rationals $(k + 1)/(3 + k)$ (an exact orthonormal frame with no free symbols)."""
    S = skew(m)
    S = S.subs({x: sp.Rational(k + 1, 3 + k) for k, x in enumerate(sorted(S.free_symbols, key=str))})
    return cayley(S)[:, :n]


def manifold_points(m: int, n: int, generic: bool = True) -> dict[str, tuple[Any, ExactTensor]]:
    r"""``name -> (manifold, exact symbolic m x n point)`` for every built-in manifold.

    ``generic=False`` fixes the rotation and unit-vector parameters to rationals (a
    cheaper exact point; DGram's column norms and the router's entries stay symbols).

    * Stiefel: the first columns of a symbolic Cayley rotation (transposed when wide);
    * DGram: that frame times $\operatorname{diag}(d)$ with positive symbols $d_j$;
    * Oblique: every column its own symbolic unit vector (inverse stereographic);
    * LPRO (radius $3/2$): every row $\tfrac32\times$ a symbolic unit vector;
    * CenteredRouterSpace: $Y - \tfrac1m\mathbf 1\mathbf 1^\top Y$, $Y$ of symbols;
    * Euclidean: a matrix of symbols.
    """
    from geomuon.manifolds import LPRO, CenteredRouterSpace, DGram, Euclidean, Oblique, Stiefel

    tall, short = max(m, n), min(m, n)
    Q = _frame(tall, short) if generic else _rational_frame(tall, short)
    d = sp.diag(*sp.symbols(f"d0:{short}", positive=True))
    orient = (lambda M: M) if m >= n else (lambda M: M.T)
    oblique = sp.Matrix([_unit_vector(m, f"o{j}_") for j in range(n)]).T
    radius = sp.Rational(3, 2)
    lpro = sp.Matrix([[radius * x for x in _unit_vector(n, f"r{i}_")] for i in range(m)])
    Y = sp.Matrix(m, n, lambda i, j: sp.Symbol(f"y{i}_{j}", real=True))
    router = Y - sp.ones(m, m) * Y / m
    if not generic:
        fixed = lambda M: M.subs({s: sp.Rational(k + 2, 5 + k) for k, s in enumerate(sorted(M.free_symbols, key=str))})  # noqa: E731
        oblique, lpro = fixed(oblique), fixed(lpro)
    points = {
        "Stiefel": (Stiefel(), orient(Q)),
        "DGram": (DGram(), orient(Q * d)),
        "Oblique": (Oblique(), oblique),
        "LPRO": (LPRO(radius=1.5), lpro),
        "CenteredRouterSpace": (CenteredRouterSpace(), router),
        "Euclidean": (Euclidean(), Y),
    }
    if m < 2:
        points.pop("CenteredRouterSpace")
    return {name: (manifold, ExactTensor(point)) for name, (manifold, point) in points.items()}


def certify_manifold(manifold, W: ExactTensor, name: str = "") -> Certificate:
    r"""Exact identities of a manifold's **own methods** at the exact point ``W``
    (symbolic entries), with matrices $A, X$ and a multiplier $\Lambda$ of symbols:

    * ``defining_map``: $F(W) = 0$ and $\tfrac{d}{dt}F(W + tA)|_{t=0} = L_W(A)$;
    * adjoint: $\langle L_W(A), \Lambda\rangle = \langle A, L_W^*(\Lambda)\rangle$;
    * ``constraint_gram_diag`` $g$: $L_WL_W^*(L_W(A)) = g \odot L_W(A)$ (so $L_WL_W^* =
      \operatorname{diag}(g)$ on $\operatorname{range}(L_W)$) with $g > 0$;
    * projection: $P_W(X) = X - L_W^*(L_W(X) \oslash g) = (I - L_W^*(L_WL_W^*)^{-1}L_W)X$,
      hence $P_W$ is the orthogonal projection onto $\ker L_W = T_W$: it is idempotent,
      tangent, and fixes every tangent vector ($\operatorname{range}(P_W) = T_W$);
      tangency $L_W(P_W X) = 0$ and idempotence are also checked directly.

    Methods are called through the library's public API (validation and the wide-point
    transposition included). ``witness``: each identity's reduced residual.

    Raises:
        ValueError: the manifold declares no diagonal $L_WL_W^*$ (``constraint_gram_diag``
            returns ``None``), which the projection identity above divides by; check such a
            manifold numerically with :func:`geomuon.theory.contracts.check_manifold_contract`.
    """
    label = name or type(manifold).__name__
    m, n = W.shape[-2:]
    # Entries live in the field QQ(point parameters, A, X, Lambda, t): sparse rational-
    # function arithmetic, exact, and zero-testing is free.
    W, (A, X, lam_all, t) = _in_field(W, [("a", (m, n)), ("x", (m, n)), ("lam", (max(m, n) ** 2,)), ("t", ())])
    gram = ExactTensor(_gram_diag(manifold, W, "certify_manifold", label))
    LA = manifold.constraint(W, A)
    lam = ExactTensor(lam_all.a[: LA.numel()].reshape(LA.a.shape))
    residuals: dict[str, Any] = {}
    if manifold.has_defining_map:
        residuals["F(W) = 0"] = manifold.defining_map(W)
        moved = manifold.defining_map(W + A * t)
        derivative = ExactTensor(np.vectorize(lambda e: e.diff(t).subs(t, 0), otypes=[object])(_lift(moved)))
        residuals["dF_W(A) = L_W(A)"] = derivative - LA
    residuals["<L(A), lam> = <A, L*(lam)>"] = _inner(LA, lam) - _inner(A, manifold.constraint_adjoint(W, lam))
    positive = True  # (no constraint, nothing to divide by)
    if LA.numel():
        residuals["L L*(L(A)) = g * L(A)"] = manifold.constraint(W, manifold.constraint_adjoint(W, LA)) - gram * LA
        positive = all(_as_expr(g).is_positive for g in gram.a.flat)
    PX = manifold.proju(W, X)
    LX = manifold.constraint(W, X)
    solved = LX / gram if LX.numel() else LX
    residuals["P(X) = X - L*((L L*)^-1 L(X))"] = PX - (X - manifold.constraint_adjoint(W, solved))
    residuals["L(P(X)) = 0"] = manifold.constraint(W, PX)
    residuals["P(P(X)) = P(X)"] = manifold.proju(W, PX) - PX
    checked = {k: _zero_tensor(v) for k, v in residuals.items()}
    holds = positive and all(ok for ok, _ in checked.values())
    return Certificate(
        f"{label} {m}x{n}: F(W)=0, dF=L, L* adjoint, LL* = diag(g) on range(L), P = I - L*(LL*)^-1 L",
        holds,
        {"gram_diag_positive": positive, **{k: r for k, (_, r) in checked.items()}},
    )


def _gram_diag(manifold, W, certificate: str, label: str):
    """``manifold.constraint_gram_diag(W)``, which the certificates' projection identity
    $P = I - L^*(LL^*)^{-1}L$ divides by; a ``ValueError`` naming ``certificate`` and the
    manifold (``label``) where it declares none (``None``): a generic projection had failed
    inside, and a closed-form one had been reported as not holding with every residual zero."""
    gram = manifold.constraint_gram_diag(W)
    if gram is None:
        raise ValueError(f"{certificate}: {label} declares no diagonal L L* (its constraint_gram_diag returns None), "
                         "which this certificate's projection identity needs; check it numerically with "
                         "geomuon.theory.contracts.check_manifold_contract")
    return gram


def certify_projection(project: Callable, manifold, W: ExactTensor, name: str = "P") -> Certificate:
    r"""Whether ``project`` is the orthogonal projection onto $T_W = \ker L_W$ of
    ``manifold`` at ``W``: $P(X) = X - L_W^*(L_W(X)\oslash g)$ identically (the negative
    controls of the suite feed wrong projections, e.g. $P \equiv 0$)."""
    m, n = W.shape[-2:]
    X = symbols_matrix("x", m, n)
    gram = ExactTensor(_gram_diag(manifold, W, "certify_projection", type(manifold).__name__))
    reference = X - manifold.constraint_adjoint(W, manifold.constraint(W, X) / gram)
    ok, residual = _zero_tensor(project(W, X) - reference)
    return Certificate(f"{name} is the orthogonal tangent projection at the {m}x{n} point", ok, residual)


def certify_projx(manifold, W: ExactTensor, name: str = "") -> Certificate:
    r"""``projx`` lands on the manifold at a critical point of the distance, exactly, at
    the size of the exact point ``W``: for a matrix $X$ of symbols, $Y = \operatorname{projx}(X)$ has
    $F(Y) = 0$ (it lies on the manifold; skipped for a manifold without a defining map)
    and $P_Y(X - Y) = 0$ ($X - Y$ is normal at $Y$: $Y$ is a critical point of
    $\|X - \cdot\|_F$ on the manifold), and $\operatorname{projx}(W) = W$. For the
    manifolds whose ``projx`` is entrywise (Oblique, LPRO, the router, Euclidean);
    Stiefel's and DGram's take an SVD: :func:`certify_projx_float64`. ``witness``: the
    reduced residuals."""
    m, n = W.shape[-2:]
    X = symbols_matrix("x", m, n)
    Y = manifold.projx(X)
    residuals = {"P_Y(X - Y) = 0": manifold.proju(Y, X - Y), "projx(W) = W": manifold.projx(W) - W}
    if manifold.has_defining_map:
        residuals["F(projx(X)) = 0"] = manifold.defining_map(Y)
    checked = {k: _zero_tensor(v) for k, v in residuals.items()}
    return Certificate(
        f"{name or type(manifold).__name__} {m}x{n}: projx lands on the manifold, X - projx(X) is normal, points are fixed",
        all(ok for ok, _ in checked.values()),
        {k: r for k, (_, r) in checked.items()},
    )


def certify_projx_float64(manifold, shape: tuple[int, int], keeps_column_norms: bool,
                          tolerance: float = 1e-13) -> Certificate:
    r"""Stiefel's and DGram's ``projx`` (a float64 SVD) against the characterization of
    their documented maps, in **float64**, at $D = Q\operatorname{diag}(3/2, 1)R^\top$
    (:func:`polar_map_reference`, condition number $3/2$), in the tall orientation (a wide
    point's formulas are the transposed ones):

    * Stiefel, $Y = \operatorname{projx}(D)$ is the polar factor: $Y^\top Y = I$ and
      $Y^\top D$ symmetric positive definite (the metric projection onto the frames);
    * DGram, $Y = \operatorname{msign}(D)\operatorname{diag}(\|d_j\|)$: $Y$ keeps every column
      norm of $D$ and its normalized columns $Q_Y$ are the polar factor of $D$
      ($Q_Y^\top Q_Y = I$, $Q_Y^\top D$ symmetric positive definite);
    * both: $\operatorname{projx}(Y) = Y$ (points are fixed).

    ``keeps_column_norms`` names the documented map the caller certifies (``False``: Stiefel's
    polar factor, ``True``: DGram's column-norm-keeping one), so a manifold is held to the map it
    claims, never to the one its output happens to fit.

    Tolerance: the SVD is backward stable, so at condition $3/2$ each residual is a few
    $\varepsilon \approx 2\cdot10^{-16}$ times small constants; $10^{-13}$ leaves a margin
    of over 100. ``witness``: the largest residual of each condition."""
    D = polar_map_reference(shape, 0)[0]
    tall = shape[0] >= shape[1]
    orient = (lambda M: M) if tall else (lambda M: M.mT)  # noqa: E731
    Y = manifold.projx(D)
    Dt, Yt = orient(D), orient(Y)
    residuals = {}
    if keeps_column_norms:
        norms = Dt.norm(dim=-2)
        residuals["column norms of projx(D) = those of D"] = float((Yt.norm(dim=-2) - norms).abs().max())
        Yt = Yt / norms
    eye = torch.eye(Yt.size(-1), dtype=Yt.dtype)
    cross = Yt.mT @ Dt
    residuals["Q'Q = I"] = float((Yt.mT @ Yt - eye).abs().max())
    residuals["Q'D symmetric"] = float((cross - cross.mT).abs().max())
    positive = bool(torch.linalg.eigvalsh(0.5 * (cross + cross.mT)).min() > 0)
    residuals["projx(Y) = Y"] = float((manifold.projx(Y) - Y).abs().max())
    return Certificate(
        f"{type(manifold).__name__} {shape[0]}x{shape[1]}: projx is its documented map (float64)",
        positive and all(r <= tolerance for r in residuals.values()),
        {"Q'D positive definite": positive, **residuals},
    )


# ======================================================================================
# Every manifold at symbolic size: the public methods on free letters

#: Sizes of the orientations, with symbols $a, b \ge 0$: tall $m = a + b + 2 > n = a + 1$,
#: square $m = n = a + 2$, wide $m = a + 2 < n = a + b + 3$ (every size with at least two
#: rows, which the router needs), and a single row $1 \times (a + 2)$ (every $1\times n$,
#: $n \ge 2$); sympy decides the library's ``m < n`` and ``m < 2`` tests from these
#: assumptions.
_a, _b = sp.symbols("a b", integer=True, nonnegative=True)
ORIENTATIONS = {"tall": (_a + _b + 2, _a + 1), "square": (_a + 2, _a + 2), "wide": (_a + 2, _a + _b + 3),
                "row": (sp.Integer(1), _a + 2)}


def _orientation_shape(orientation: str):
    """The symbolic ``(m, n)`` of ``orientation``, refused by name (a bare ``KeyError`` had named
    nothing) unless it is one of :data:`ORIENTATIONS`."""
    if orientation not in ORIENTATIONS:
        raise ValueError(f"orientation must be one of {list(ORIENTATIONS)}, got {orientation!r}")
    return ORIENTATIONS[orientation]


def _is_wide(orientation: str) -> bool:
    m, n = _orientation_shape(orientation)
    return bool(sp.sympify(m < n))


class _FreeFactories(torch.overrides.TorchFunctionMode):
    r"""Tensor factories at symbolic size, while the free letters are evaluated:
    ``torch.eye(s)`` of a :class:`SymbolicSize` is the identity word, ``torch.full(shape,
    v)`` the scalar $v$ (a constant array acts entrywise as that scalar). Every other
    torch function goes to its operands' ``__torch_function__``."""

    def __init__(self, algebra: FreeAlgebra):
        super().__init__()
        self.algebra = algebra

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.eye and isinstance(args[0], SymbolicSize):
            return self.algebra.identity()
        if func is torch.full and any(isinstance(s, SymbolicSize) for s in args[0]):
            return exact(args[1])
        return func(*args, **kwargs)


@dataclass
class _FreePoint:
    """A generic point of a manifold and a generic tangent vector, as rewriting rules on
    free letters ``W, A, X, V`` (``m x n``) and a free multiplier ``lam``."""

    algebra: FreeAlgebra
    lam: Any
    rules: str


def _free_point(manifold, orientation: str) -> _FreePoint:
    r"""The defining equations of a point $W$ and of a tangent vector $V$ of ``manifold``
    at symbolic size, as rules (not formulas of the library: the manifold's *definition*):

    * Stiefel: $W^\top W = I$, $V^\top W = -W^\top V$ (wide: $WW^\top = I$, $VW^\top = -WV^\top$);
    * DGram: $W^\top W = D$ positive diagonal, $V^\top W = -W^\top V + 2\operatorname{Diag}(W^\top V)$
      ($\operatorname{Off}(W^\top V + V^\top W) = 0$; wide: rows);
    * Oblique: $\operatorname{Diag}(W^\top W) = I$, $\operatorname{Diag}(W^\top V) = 0$;
    * LPRO (radius $r$): $\operatorname{Diag}(WW^\top) = r^2I$, $\operatorname{Diag}(WV^\top) = 0$;
    * CenteredRouterSpace: $\mathbf 1^\top W = 0$, $\mathbf 1^\top V = 0$ ($\mathbf 1^\top\mathbf 1 = m$).
    """
    m, n = _orientation_shape(orientation)
    short = m if _is_wide(orientation) else n
    # The model of the nearest built-in class (a subclass overriding a formula, such as the
    # suite's negative controls, keeps its parent's definition of a point).
    known = ("Stiefel", "DGram", "Oblique", "LPRO", "CenteredRouterSpace")
    name = next((c.__dict__["name"] for c in type(manifold).__mro__ if c.__dict__.get("name") in known), manifold.name)
    shapes = {x: (m, n) for x in "WAXV"}
    letters = {x: x + "'" for x in "WAXV"}
    diagonal: tuple[str, ...] = ()
    ones = None
    if name in ("Stiefel", "DGram"):
        letters["Λ"], shapes["Λ"] = "Λ'", (short, short)
        if name == "DGram":
            diagonal, shapes["D"] = ("D",), (short, short)
    elif name in ("Oblique", "LPRO"):
        diagonal = ("λ",)
        shapes["λ"] = (n, n) if name == "Oblique" else (m, m)
    elif name == "CenteredRouterSpace":
        letters["l"], shapes["l"] = "l'", (1, n)
        ones = ("1", m)
    else:
        raise ValueError(f"_free_point: no symbolic point model of {name}")
    algebra = FreeAlgebra(letters, diagonal=diagonal, shapes=shapes, ones=ones)
    W, V = algebra("W"), algebra("V")
    # The definition, not the code's flag: a wide Stiefel or DGram point has orthogonal
    # rows (the class docstrings), so its defining equations are on W W^T.
    wide = bool(m < n) and name in ("Stiefel", "DGram")
    # The side the constraint acts on: W^T W (columns) or W W^T (rows of a wide point).
    gram, cross = (W @ W.mT, V @ W.mT) if wide else (W.mT @ W, V.mT @ W)
    if name == "Stiefel":
        algebra.rule(gram, algebra.identity())
        algebra.rule(cross, -cross.mT)
        rules = "W'W = I, V'W = -W'V" if not wide else "WW' = I, VW' = -WV'"
        lam = algebra("Λ")
    elif name == "DGram":
        algebra.rule(gram, algebra("D"))
        diagonal_part = algebra.diag(cross)
        algebra.rule(cross, -cross.mT + 2 * diagonal_part)
        rules = "W'W = D, Off(W'V + V'W) = 0" if not wide else "WW' = D, Off(WV' + VW') = 0"
        lam = algebra("Λ")
    elif name == "Oblique":
        algebra.rule(algebra.diag(W.mT @ W), algebra.identity())
        algebra.rule(algebra.diag(W.mT @ V), 0)
        rules, lam = "Diag(W'W) = I, Diag(W'V) = 0", FreeVector(algebra("λ"))
    elif name == "LPRO":
        r2 = exact(manifold.radius) ** 2
        algebra.rule(algebra.diag(W @ W.mT), r2 * algebra.identity())
        algebra.rule(algebra.diag(W @ V.mT), 0)
        rules, lam = f"Diag(WW') = {r2} I, Diag(WV') = 0", FreeVector(algebra("λ"))
    else:
        ones = algebra("1")
        algebra.rule(ones.mT @ W, 0)
        algebra.rule(ones.mT @ V, 0)
        rules, lam = "1'W = 0, 1'V = 0, 1'1 = m", FreeRow(algebra("l"))
    return _FreePoint(algebra, lam, rules)


def _free_zero(value) -> tuple[bool, Any]:
    terms = value if isinstance(value, dict) else value.terms
    return not terms, terms


def _positive_gram(g) -> bool:
    if isinstance(g, FreeBroadcastSum):
        return g.positive()
    if isinstance(g, FreeVector):
        terms = g.matrix.terms
        return set(terms) == {()} and terms[()] > 0
    return bool(sp.sympify(g).is_positive)


def certify_every_size(manifold, orientation: str = "tall") -> Certificate:
    r"""A manifold's closed forms at **symbolic size**: its public methods (validation and
    the wide transposition of the ``matrix_method`` decorator included) run on free
    letters $W, A, X, V$ of size $m\times n$ (tall, square or wide, with
    symbolic dimensions: see :data:`ORIENTATIONS`) and a free multiplier $\Lambda$, reduced by the defining
    equations of a generic point and tangent vector (:func:`_free_point`) and the rules
    of the diagonal-part and Sylvester operators (:class:`FreeAlgebra`). Certified, as
    identities of the free algebra (hence at every size of the orientation):

    * $F(W) = 0$ and $\tfrac{d}{dt}F(W + tA)|_{t=0} = L_W(A)$;
    * $\operatorname{tr}(L_W(A)^\top\Lambda) = \operatorname{tr}(A^\top L_W^*(\Lambda))$ (trace
      normal form);
    * $L_WL_W^*(L_WA) = g\odot L_WA$ with $g$ the library's ``constraint_gram_diag``, and
      $g > 0$;
    * $P_W(X) = X - L_W^*(L_WX\oslash g) = (I - L_W^*(L_WL_W^*)^{-1}L_W)X$;
    * $L_W(P_WX) = 0$, $P_W(P_WX) = P_WX$, $L_W(V) = 0$ and $P_W(V) = V$ for the tangent
      $V$: $\operatorname{range}(P_W) = T_W$.

    ``constraint_gram_diag`` runs on the letters too (Stiefel's ``torch.full`` is the scalar
    4, the router's ``new_full`` the symbolic row count $m$). ``witness``: the rules, $g$,
    and every reduced residual (empty dicts).
    """
    point = _free_point(manifold, orientation)
    try:
        with _FreeFactories(point.algebra):
            return _certify_every_size(manifold, orientation, point)
    except (ValueError, TypeError, NotImplementedError) as error:
        # A shape mismatch, a number asked of a symbolic size (float(m)), or an operation
        # outside the free algebra: nothing is proved.
        return Certificate(f"{manifold.name}, every {orientation} size: not certified", False,
                           {"rules": point.rules, "error": f"{type(error).__name__}: {error}"})


def _certify_every_size(manifold, orientation: str, point: _FreePoint) -> Certificate:
    algebra, lam = point.algebra, point.lam
    W, A, X, V = (algebra(x) for x in "WAXV")
    t = sp.Symbol("t", real=True)
    residuals: dict[str, Any] = {}
    if manifold.has_defining_map:
        residuals["F(W) = 0"] = manifold.defining_map(W)
        moved = manifold.defining_map(W + A * t)
        derivative = moved.map_coefficients(lambda c: sp.diff(c, t).subs(t, 0))
        residuals["dF_W(A) = L_W(A)"] = derivative - manifold.constraint(W, A)
    LA = manifold.constraint(W, A)
    inner = _free_inner(LA, lam)
    other = _free_inner(A, manifold.constraint_adjoint(W, lam))
    residuals["<L(A), lam> = <A, L*(lam)>"] = {w: c for w, c in ((w, _reduce(inner.get(w, 0) - other.get(w, 0)))
                                                               for w in {*inner, *other}) if c != 0}
    gram = _gram_diag(manifold, W, "certify_every_size", manifold.name)
    residuals["L L*(L(A)) = g * L(A)"] = manifold.constraint(W, manifold.constraint_adjoint(W, LA)) - gram * LA
    LX = manifold.constraint(W, X)
    residuals["P(X) = X - L*((L L*)^-1 L(X))"] = manifold.proju(W, X) - (X - manifold.constraint_adjoint(W, LX / gram))
    PX = manifold.proju(W, X)
    residuals["L(P(X)) = 0"] = manifold.constraint(W, PX)
    residuals["P(P(X)) = P(X)"] = manifold.proju(W, PX) - PX
    residuals["L(V) = 0 for tangent V"] = manifold.constraint(W, V)
    residuals["P(V) = V for tangent V"] = manifold.proju(W, V) - V
    checked = {k: _free_zero(v) for k, v in residuals.items()}
    positive = _positive_gram(gram)
    m, n = _orientation_shape(orientation)
    return Certificate(
        f"{manifold.name}, every {orientation} size ({m} x {n}): F(W)=0, dF=L, L* adjoint, LL* = g on range(L), "
        "P = I - L*(LL*)^-1 L, range(P) = T_W",
        positive and all(ok for ok, _ in checked.values()),
        {"rules": point.rules, "gram_diag": gram,
         "gram_diag_positive": positive, **{k: r for k, (_, r) in checked.items()}},
    )


# ======================================================================================
# Retractions


def _taylor(T: ExactTensor, t: sp.Symbol, order: int) -> list[ExactTensor]:
    coefficients = []
    current = T.a
    for k in range(order):
        coefficients.append(ExactTensor(np.vectorize(lambda e: sp.sympify(e).subs(t, 0) / math.factorial(k), otypes=[object])(current)))
        current = np.vectorize(lambda e: sp.diff(e, t), otypes=[object])(current)
    return coefficients


def certify_retraction(manifold, W: ExactTensor, name: str = "", retraction: Callable | None = None) -> Certificate:
    r"""The retraction's Taylor series at $t = 0$: $R_W(tV) = W + tV + O(t^2)$ for the
    tangent $V = P_W(X)$ of a matrix $X$ of symbols — i.e. $R_W(0) = W$ and
    $dR_W(0) = \mathrm{id}$ on $T_W$ — from the exact coefficients of the library's
    ``retr`` (or ``retraction(W, U)``) evaluated on $W + tV$ with a symbol $t$.
    ``witness``: the reduced residuals of the order-0 and order-1 coefficients."""
    m, n = W.shape[-2:]
    t = sp.Symbol("t", real=True)
    V = manifold.proju(W, symbols_matrix("x", m, n))
    retract = retraction or manifold.retr
    c0, c1 = _taylor(retract(W, t * V), t, 2)
    checked = {"R(W, 0) = W": _zero_tensor(c0 - W), "dR_W(0)[V] = V": _zero_tensor(c1 - V)}
    return Certificate(
        f"{name or type(manifold).__name__} {m}x{n}: R_W(tV) = W + tV + O(t^2)",
        all(ok for ok, _ in checked.values()),
        {k: r for k, (_, r) in checked.items()},
    )


def certify_stiefel_retraction(orientation: str = "tall", n: int = 3, stiefel=None, digits: int = 60) -> Certificate:
    r"""The library's ``Stiefel.retr`` (its public method: validation, the wide
    transposition, ``msign``'s normalization and orientation, the twelve Polar Express
    steps) on free letters $W + tV$ of symbolic size — $m$ symbolic, the constrained side
    $n$ a given number — with $W^\top W = I$ and $V^\top W = -W^\top V$ (wide: the rows):

    $$R_W(tV) = e_n\,(W + tV) + O(t^2),\qquad e_n = P_{12}\big(1/(1.01\sqrt n)\big),$$

    i.e. $R_W(0) = e_nW$ and $dR_W(0) = e_n\,\mathrm{id}$, and no other word survives. The
    coefficients are truncated series in $t$ with ``digits``-digit floats
    (:meth:`FreeAlgebra.series`: the exact ones have degree $5^{12}$); $e_n$ is then checked
    against the rigorous enclosure of $P_{12}$ at that point (:func:`ns_output_range`), so
    $|e_n - 1|$ is certified. ``witness``: $e_n$, the enclosure and the surviving terms."""
    from geomuon.manifolds import POLAR_EXPRESS, Stiefel

    if orientation not in ("tall", "wide"):  # (any other name had run as "wide", certified as "sideways")
        raise ValueError(f"certify_stiefel_retraction: orientation must be 'tall' or 'wide', got {orientation!r}")
    stiefel = stiefel or Stiefel()
    a = sp.Symbol("a", integer=True, nonnegative=True)
    long = a + n + 1
    shape = (long, n) if orientation == "tall" else (n, long)
    algebra = FreeAlgebra({"W": "W'", "V": "V'"}, shapes={"W": shape, "V": shape})
    W, V = algebra("W"), algebra("V")
    gram, cross = (W.mT @ W, V.mT @ W) if orientation == "tall" else (W @ W.mT, V @ W.mT)
    algebra.rule(gram, algebra.identity())
    algebra.rule(cross, -cross.mT)
    t = sp.Symbol("t", real=True)
    algebra.series(t, 2, digits)
    with _FreeFactories(algebra):
        R = stiefel.retr(W, V * t)
    e = R.terms.get(("W",), sp.Integer(0))
    rest = {w: c for w, c in (R - e * (W + t * V)).terms.items()}
    low, high = ns_output_range(POLAR_EXPRESS.coefficients, POLAR_EXPRESS.default_steps, lo=1 / sp.sqrt(n),
                                hi=1 / sp.sqrt(n), input_scale=POLAR_EXPRESS.input_scale)
    slack = sp.Rational(1, 10 ** (digits - 20))  # the series' float round-off, with margin
    inside = bool(e.is_Number) and bool(low - slack <= e) and bool(e <= high + slack)
    return Certificate(
        f"Stiefel.retr, every {orientation} size with n = {n}: R_W(tV) = e (W + tV) + O(t^2), e = P_12(1/(1.01 sqrt n))",
        inside and not rest,
        {"e": e, "enclosure": (low, high), "other terms": rest},
    )


def _dgram_algebra(orientation: str, t: sp.Symbol) -> tuple[FreeAlgebra, FreeMatrix, FreeMatrix]:
    r"""A generic DGram point and tangent vector at symbolic size, in the frame the
    methods' bodies see (a wide point is transposed by ``matrix_method``): letters
    $W, V$ with $W^\top W = S^2$ ($S$ a positive diagonal letter, the column norms) and
    $V^\top W = -W^\top V + 2E$, $E = \operatorname{Diag}(W^\top V)$; $S$ and $S^{-1}$ are
    declared roots of $S^2$; exact series mode of order 2 in ``t``. Returns the algebra
    and the body's letters $(W_b, V_b)$ ($W, V$, or their transposes when wide)."""
    m, n = _orientation_shape(orientation)
    algebra = FreeAlgebra({"W": "W'", "V": "V'"}, diagonal=("S",), shapes={"W": (m, n), "V": (m, n)})
    W, V = algebra("W"), algebra("V")
    wide = _is_wide(orientation)
    Wb, Vb = (W.mT, V.mT) if wide else (W, V)
    short = m if wide else n
    algebra.shapes["S"] = (short, short)
    S = algebra("S")
    algebra.square_root(S @ S, "S", "S~")
    algebra.rule(Wb.mT @ Wb, S @ S)
    cross = Vb.mT @ Wb
    algebra.rule(cross, -cross.mT + 2 * algebra.name_diagonal(cross, "E"))
    algebra.series(t, 2, None)
    algebra.norms_above_floors = True  # ||W||_F > sqrt(tiny) ~ 1e-19 (fp32), 1.5e-154 (fp64)
    return algebra, Wb, Vb


def _family(Wb, Vb, F, G, t, side: str):
    r"""$F W_b^\top + t(F V_b^\top + G W_b^\top)$ (``"rows"``) or $W_bF + t(V_bF + W_bG)$
    (``"columns"``): the first-order form of every Polar Express iterate of $W + tV$."""
    if side == "rows":
        return F @ Wb.mT + t * (F @ Vb.mT + G @ Wb.mT)
    return Wb @ F + t * (Vb @ F + Wb @ G)


def _family_parts(X, Wb, Vb, t):
    r"""$(F, G, \text{side})$ with $X = $ :func:`_family` of them, or ``None``: every word is
    a run of diagonal letters and one point/tangent letter, the tangent part has no
    $t^0$ term and its $t^1$ part equals the point part's $t^0$ part."""
    algebra = X.algebra
    letters = {"rows": (Wb.mT, Vb.mT), "columns": (Wb, Vb)}
    for side, (w, v) in letters.items():
        ((w_word, _),), ((v_word, _),) = w.terms.items(), v.terms.items()
        parts = {w_word[0]: [], v_word[0]: []}
        ok = True
        for word, c in X.terms.items():
            end = word[-1] if side == "rows" else word[0]
            rest = word[:-1] if side == "rows" else word[1:]
            if end not in parts or any(x not in algebra.diagonal for x in rest):
                ok = False
                break
            parts[end].append((rest, c))
        if not ok:
            continue
        P = FreeMatrix(parts[w_word[0]], algebra)
        Q = FreeMatrix(parts[v_word[0]], algebra)
        F = P.map_coefficients(lambda c: c.subs(t, 0))
        G = P.map_coefficients(lambda c: sp.diff(c, t))
        if Q.map_coefficients(lambda c: c.subs(t, 0)).is_zero() and (Q.map_coefficients(lambda c: sp.diff(c, t)) - F).is_zero():
            return F, G, side
    return None


def certify_dgram_step_expansion() -> Certificate:
    r"""One step of the library's :func:`~geomuon.manifolds.linalg.newton_schulz_step`,
    every row of ``POLAR_EXPRESS`` (the retraction's table), on the first-order family of a
    DGram point $W$ ($W^\top W = S^2$, $S$ positive diagonal) and tangent $V$
    ($\operatorname{Off}(W^\top V + V^\top W) = 0$, $E = \operatorname{Diag}(W^\top V)$),
    for arbitrary diagonal $F, G$ (free diagonal letters), **every size** (tall, one
    column included, and square; wide is tall with the letters transposed), both forms of
    the family ($X = FW^\top + t(FV^\top + GW^\top)$, the transposed tall matrix, and
    $X = WF + t(VF + WG)$) and both forms of the step (``tall`` false and true):

    $$\text{step}(X) = X' \text{ of the same form with } F'S = p(FS),\quad
      G'S + F'ES^{-1} = p'(FS)\,(GS + FES^{-1}),$$

    $p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5$. Read per column: the iterate's column
    scale $\sigma = FS$ (the normalized singular value $\lVert W_i\rVert/c$) goes to
    $p(\sigma)$ and its $t$-derivative $\dot\sigma = GS + FES^{-1}$ to $p'(\sigma)\dot\sigma$
    — the chain rule of the composed scalar map; all cross terms cancel because
    $X^\top X$ (or $XX^\top$ against $W$) is diagonal to first order on tangents.
    ``witness``: per tuple and form the residuals (empty)."""
    from geomuon.manifolds.linalg import POLAR_EXPRESS, newton_schulz_step

    t = sp.Symbol("t", real=True)
    witness, holds = {}, True
    # (a wide point's body is the tall algebra with W, V renamed W', V')
    for orientation in ("tall", "square"):
        algebra, Wb, Vb = _dgram_algebra(orientation, t)
        for name in ("F", "G"):
            algebra.diagonal.add(name)
            algebra.transpose_of[name] = name
        F, G, S, Si, E = algebra("F"), algebra("G"), algebra("S"), algebra("S~"), algebra.diag(Vb.mT @ Wb)
        for side in ("rows", "columns"):
            X = _family(Wb, Vb, F, G, t, side)
            for a, b, c in sorted(set(POLAR_EXPRESS.coefficients)):
                A, B, C = (exact(v) for v in (a, b, c))
                for tall in (False, True):
                    with _FreeFactories(algebra):
                        out = newton_schulz_step(X, a, b, c, tall=tall)
                    parts = _family_parts(out, Wb, Vb, t)
                    if parts is None or parts[2] != side:
                        witness[(orientation, side, a, tall)] = "not of the family's form"
                        holds = False
                        continue
                    F1, G1, _ = parts
                    sigma, dot = F @ S, G @ S + F @ E @ Si
                    p = A * sigma + B * sigma @ sigma @ sigma + C * sigma @ sigma @ sigma @ sigma @ sigma
                    dp = A * algebra.identity() + 3 * B * sigma @ sigma + 5 * C * sigma @ sigma @ sigma @ sigma
                    residual = {"F'S - p(FS)": (F1 @ S - p).terms,
                                "G'S + F'ES^-1 - p'(FS)(GS + FES^-1)": (G1 @ S + F1 @ E @ Si - dp @ dot).terms}
                    if any(residual.values()):
                        witness[(orientation, side, a, tall)] = residual
                        holds = False
    return Certificate("one Newton-Schulz step on a DGram point's first-order family: sigma -> p(sigma), "
                       "sigma' -> p'(sigma) sigma', every size", holds, witness)


def _probed_retraction(manifold, orientation: str, normalized_columns: bool = False) -> dict:
    r"""``manifold.retr(W, tV)`` on :func:`_dgram_algebra`'s generic point, with every
    :func:`~geomuon.manifolds.linalg.newton_schulz_step` replaced by a probe that checks
    its input is :func:`_family` of some $(F, G)$ and returns the family of fresh diagonal
    letters $(F_{k+1}, G_{k+1})$ — the step's certified action
    (:func:`certify_dgram_step_expansion`). Returns the result in the body's frame, the
    step records, the problems found (rows other than ``POLAR_EXPRESS``'s twelve, a step
    not fed the previous output, the first input's scale not the expected $x$:
    $\lVert W_i\rVert/(1.01\lVert W\rVert_F)$, or with ``normalized_columns``, a retraction that
    runs on the columns divided by their norms, $1/(1.01\sqrt n)$ for every column), $x = F_0S$,
    $\dot x = G_0S + F_0ES^{-1}$ and the last letters."""
    import geomuon.manifolds.linalg as linalg
    from geomuon.manifolds import POLAR_EXPRESS

    t = sp.Symbol("t", real=True)
    algebra, Wb, Vb = _dgram_algebra(orientation, t)
    S, Si, E = algebra("S"), algebra("S~"), algebra("E")
    steps: list[dict] = []
    problems: list[str] = []

    def probe(X, a, b, c, *, tall=False):
        parts = _family_parts(X, Wb, Vb, t)
        if parts is None:
            problems.append(f"step {len(steps)}: input not of the family's form")
            parts = (algebra.identity(), algebra.identity(), "rows")
        F, G, side = parts
        k = len(steps) + 1
        for name in (f"F{k:02d}", f"G{k:02d}"):
            algebra.diagonal.add(name)
            algebra.transpose_of[name] = name
        steps.append({"coefficients": (a, b, c), "F": F, "G": G, "side": side, "tall": tall})
        return _family(Wb, Vb, algebra(f"F{k:02d}"), algebra(f"G{k:02d}"), t, side)

    original = linalg.newton_schulz_step
    linalg.newton_schulz_step = probe
    try:
        W, V = (Wb.mT, Vb.mT) if _is_wide(orientation) else (Wb, Vb)
        with _FreeFactories(algebra):
            R = manifold.retr(W, t * V)
    except (ValueError, TypeError, NotImplementedError) as error:
        return {"error": repr(error)}
    finally:
        linalg.newton_schulz_step = original
    if [s["coefficients"] for s in steps] != POLAR_EXPRESS.step_coefficients(POLAR_EXPRESS.default_steps):
        problems.append("the loop's rows are not POLAR_EXPRESS.step_coefficients(12)")
    for k, s in enumerate(steps[1:], start=1):
        if not ((s["F"] - algebra(f"F{k:02d}")).is_zero() and (s["G"] - algebra(f"G{k:02d}")).is_zero()):
            problems.append(f"step {k}: its input is not step {k - 1}'s output")
    if not steps:
        return {"error": "no Newton-Schulz step"}
    F0, G0 = steps[0]["F"], steps[0]["G"]
    x, xdot = F0 @ S, G0 @ S + F0 @ E @ Si
    if normalized_columns:
        short = _orientation_shape(orientation)[0 if _is_wide(orientation) else 1]
        expected, text = algebra.identity() / (exact(POLAR_EXPRESS.input_scale) * sp.sqrt(short)), "1 / (1.01 sqrt n)"
    else:
        expected = S / (exact(POLAR_EXPRESS.input_scale) * sp.sqrt(sp.Symbol("tr(SS)", positive=True)))
        text = "||W_i|| / (1.01 ||W||_F)"
    if not (x - expected).is_zero():
        problems.append(f"the normalized column norms are {x!r}, not {text}")
    K = len(steps)
    return {"t": t, "algebra": algebra, "Wb": Wb, "Vb": Vb, "steps": steps, "problems": problems, "x": x,
            "x'": xdot, "R": R.mT if _is_wide(orientation) else R, "F": algebra(f"F{K:02d}"), "G": algebra(f"G{K:02d}")}


def _unit_columns_scale_range(n_max: int) -> tuple:
    r"""An enclosure of $e_n = P_{12}(1/(1.01\sqrt n))$ for every $n \le$ ``n_max``: the scale a
    retraction by Polar Express gives $n$ orthonormal columns (:func:`ns_output_range` on
    $[1/\sqrt{n_{\max}}, 1]$ before ``msign``'s division by 1.01)."""
    from geomuon.manifolds import POLAR_EXPRESS

    return ns_output_range(POLAR_EXPRESS.coefficients, POLAR_EXPRESS.default_steps, lo=1 / sp.sqrt(n_max), hi=1,
                           input_scale=POLAR_EXPRESS.input_scale)


def certify_dgram_retraction(orientation: str = "tall", dgram=None, n_max: int = 10**6) -> Certificate:
    r"""The library's ``DGram.retr`` (its public method: validation, the wide transposition,
    the column norms and the division by them, ``msign``'s normalization, orientation and
    loop) on a generic point $W$ ($W^\top W = S^2$, any column norms) and tangent $V$ of
    **symbolic size** (:func:`_dgram_algebra`), to first order in $t$, with every Polar
    Express step replaced by its certified first-order action (:func:`_probed_retraction`:
    a step sends the family's $(F, G)$ to fresh diagonal letters with
    $\sigma_{k+1} = p_k(\sigma_k)$, $\dot\sigma_{k+1} = p_k'(\sigma_k)\dot\sigma_k$,
    $\sigma_k = F_kS$). The retraction runs Polar Express on the normalized columns
    $(W + tV)\Delta^{-1/2}$, $\Delta = \operatorname{Diag}((W + tV)^\top(W + tV))$, and scales
    back by $\Delta^{1/2}$. Certified:

    $$R_W(tV) = (W + tV)\,\operatorname{diag}(e) + t\,W\operatorname{diag}(\dot e) + O(t^2),
      \qquad e_i = P_K(x_i),\ \dot e_i = P_K'(x_i)\,\dot x_i,$$

    with every column's normalized norm $x_i = 1/(1.01\sqrt n)$ (unit columns, whatever the
    point's column norms) and $\dot x = 0$ identically (checked on the witness), $P_K$ the
    composed scalar map of the twelve library rows (checked: ``POLAR_EXPRESS.step_coefficients(12)``,
    each step fed the previous output). Hence

    $$R_W(tV) = e_n\,(W + tV) + O(t^2),\qquad e_n = P_{12}\big(1/(1.01\sqrt n)\big),$$

    at every point: $R_W(0) = e_nW$ and $dR_W(0) = e_n\,\mathrm{id}$, with $\lvert e_n - 1\rvert$
    enclosed rigorously for every $n \le$ ``n_max`` (:func:`ns_output_range` on
    $[1/(1.01\sqrt{n_{\max}}), 1/1.01]$), as :func:`certify_stiefel_retraction_every_size`
    for Stiefel. (The map ``msign(W + tV)`` scaled by the column norms, which this retraction
    was until its columns at $10^{-3}$ of the others were shortened at $n = 1024$, has
    $x_i = \lVert W_i\rVert/(1.01\lVert W\rVert_F)$ and fails here.) Hypothesis: every column of
    $W + tV$ nonzero, with a norm the compute dtype represents (the retraction takes it from the
    column over its largest entry, ``largest_entry``, the identity on these exact letters).
    ``witness``: the step count, the enclosure, $x$, $\dot x$, the problems and the residual
    (empty)."""
    from geomuon.manifolds import DGram

    run = _probed_retraction(dgram or DGram(), orientation, normalized_columns=True)
    claim = f"DGram.retr, every {orientation} size: R_W(tV) = e_n (W + tV) + O(t^2), e_n = P_12(1/(1.01 sqrt n))"
    if "error" in run:
        return Certificate(claim, False, run)
    S, Si, E, t = run["algebra"]("S"), run["algebra"]("S~"), run["algebra"]("E"), run["t"]
    e, edot = run["F"] @ S, run["G"] @ S + run["F"] @ E @ Si
    residual = (run["R"] - ((run["Wb"] + t * run["Vb"]) @ e + t * run["Wb"] @ edot)).terms
    moving = {w: c for w, c in run["x'"].terms.items() if _reduce(c) != 0}
    low, high = _unit_columns_scale_range(n_max)
    return Certificate(claim, not run["problems"] and not residual and not moving,
                       {"steps": len(run["steps"]), "e_n for n <= n_max in": (low, high), "x": run["x"],
                        "x'": run["x'"], "problems": run["problems"], "residual": residual})


def certify_stiefel_retraction_every_size(orientation: str = "tall", stiefel=None, n_max: int = 10**6) -> Certificate:
    r"""The library's ``Stiefel.retr`` at **every size** ($m$ and $n$ symbolic), to first
    order, each Polar Express step replaced by its certified action
    (:func:`_probed_retraction`). The run uses DGram's generic point ($W^\top W = S^2$):
    a Stiefel point and tangent are its special case $S = I$, $E = 0$, so certified is

    $$R_W(tV) = (W + tV)F_K + t\,WG_K + O(t^2)\ \text{(every } S\text{)},\qquad
      \text{hence at } S = I:\ R_W(tV) = e_n\,(W + tV) + O(t^2),\ e_n = P_{12}\big(1/(1.01\sqrt n)\big),$$

    because $F_KS = P_K(x)$, $G_KS + F_KES^{-1} = P_K'(x)\dot x$ and at $S = I$, $E = 0$:
    $x = 1/(1.01\sqrt n)$, $\dot x = 0$ (checked on the witness: $\dot x$ vanishes at
    $E = 0$). So $R_W(0) = e_nW$, $dR_W(0) = e_n\mathrm{id}$ for every $m \ge n$ (wide: the
    rows), and $\lvert e_n - 1\rvert$ is enclosed rigorously for every $n \le$ ``n_max``
    (:func:`ns_output_range` on $[1/(1.01\sqrt{n_{\max}}), 1/1.01]$). ``witness``: the
    enclosure, $\dot x$, the problems and the residual."""
    from geomuon.manifolds import Stiefel

    run = _probed_retraction(stiefel or Stiefel(), orientation)
    claim = f"Stiefel.retr, every {orientation} size: R_W(tV) = e_n (W + tV) + O(t^2), e_n = P_12(1/(1.01 sqrt n))"
    if "error" in run:
        return Certificate(claim, False, run)
    t = run["t"]
    residual = (run["R"] - ((run["Wb"] + t * run["Vb"]) @ run["F"] + t * run["Wb"] @ run["G"])).terms
    # S = I, E = 0: words with E vanish, and so does tr(E)
    at_stiefel = {w: c.subs(sp.Symbol("tr(E)", positive=True), 0) for w, c in run["x'"].terms.items() if "E" not in w}
    still_moving = {w: c for w, c in at_stiefel.items() if _reduce(c) != 0}
    low, high = _unit_columns_scale_range(n_max)
    return Certificate(claim, not run["problems"] and not residual and not still_moving,
                       {"e_n for n <= n_max in": (low, high), "x'": run["x'"], "x' at E = 0": still_moving,
                        "problems": run["problems"], "residual": residual})


def certify_gram_retract() -> Certificate:
    r"""The fast engine's retraction assembly, :func:`geomuon.optimizers.gram.retract`, on
    free letters of symbolic size ($W, Z_0$: $m\times n$; $T_1, T_2$: $n\times n$; scalars
    $\eta$, $c$): with a probe form whose ``retraction_factor`` records its argument and
    returns a letter $\rho$,

    $$\text{retract} = Y\rho,\qquad \rho = \rho(Y^\top Y),\qquad Y = cW - \eta\,(cW\,T_1 + Z_0T_2),$$

    exactly: the engine's new point is the form's retraction $R_{cW}(-\eta\hat A)$ of the
    direction $\hat A = cWT_1 + Z_0T_2$ (which :func:`certify_gram_form` proves a
    retraction, :func:`certify_inverse_sqrt_series` pins its series). ``witness``: the
    residuals."""
    from geomuon.manifolds.capabilities import GramForm
    from geomuon.optimizers.gram import retract

    m, n = ORIENTATIONS["tall"]
    algebra = FreeAlgebra({"W": "W'", "Z": "Z'", "T": "T'", "U": "U'", "rho": "rho'"},
                          shapes={"W": (m, n), "Z": (m, n), "T": (n, n), "U": (n, n), "rho": (n, n)})
    W, Z0, T1, T2, rho = (algebra(x) for x in ("W", "Z", "T", "U", "rho"))
    shrink = sp.Symbol("c", positive=True)
    seen: list = []

    class Probe(GramForm):
        def retraction_factor(self, YtY, terms=6, far=None):
            seen.append(YtY)
            return rho

    residuals = {}
    # torch's argument parser wants a number for baddbmm's alpha = -lr: three values of
    # lr prove identities of degree <= 2 in lr (Y is affine in lr, Y'Y quadratic).
    for lr in (0.375, 0.8125, 1.5):
        seen.clear()
        with _FreeFactories(algebra):
            point = retract(Probe(), W, Z0, T1, T2, lr, shrink)
        Y = shrink * W - exact(lr) * (shrink * W @ T1 + Z0 @ T2)
        residuals[f"lr={lr}: retract - Y rho"] = (point - Y @ rho).terms
        residuals[f"lr={lr}: factor argument - Y'Y"] = (seen[0] - Y.mT @ Y).terms if len(seen) == 1 else {"calls": len(seen)}
    return Certificate("gram.retract = Y rho(Y'Y), Y = cW - eta (cW T1 + Z0 T2), every size",
                       all(not r for r in residuals.values()), residuals)


def certify_inverse_sqrt_series() -> Certificate:
    r"""The coefficients of :func:`geomuon.manifolds.capabilities.inv_sqrt_near_identity`
    (the Gram-form retractions' $(I + E)^{-1/2}$) are the binomial series: the library's
    function on the $1\times1$ matrix $[e]$, for every ``terms`` $K \ge 1$ it accepts, is
    the Taylor polynomial $\sum_{k \le K}\binom{-1/2}{k}e^k$ exactly (the matrix case is
    the same polynomial in $E$). Since $|\binom{-1/2}{k}|$ decreases, the truncation error
    is at most $|\binom{-1/2}{K+1}|\,\|E\|^{K+1}/(1 - \|E\|)$, the docstring's bound.

    And :func:`~geomuon.manifolds.capabilities.series_radius` (where DGram's Gram-form
    retraction switches from the series to ``eigh``) is the radius $r$ at which that bound
    equals the dtype's unit round-off: $|\binom{-1/2}{K+1}|\,r^{K+1} = \varepsilon(1 - r)$,
    checked for every $K$ and float32/float64 to a relative residual $10^{-12}$ (the
    library's fixed-point iteration contracts by about $1/(K+1)$ per step and runs 50
    steps: it ends at float64 round-off, $10^{-16}$).
    ``witness``: per $K$ the difference of the coefficient lists, per $(K, \text{dtype})$
    the radius' relative residual."""
    from geomuon.manifolds.capabilities import _INV_SQRT_SERIES, inv_sqrt_near_identity, series_radius

    e = sp.Symbol("e")
    witness: dict[Any, Any] = {}
    holds = True
    for terms in range(1, len(_INV_SQRT_SERIES)):
        value = sp.expand(inv_sqrt_near_identity(ExactTensor([[e]]), terms).a[0, 0])
        taylor = sp.expand(sp.series((1 + e) ** sp.Rational(-1, 2), e, 0, terms + 1).removeO())
        witness[terms] = sp.expand(value - taylor)
        holds &= witness[terms] == 0
        for dtype in (torch.float32, torch.float64):
            r = exact(series_radius(terms, dtype))
            eps = exact(torch.finfo(dtype).eps)
            bound = abs(sp.binomial(sp.Rational(-1, 2), terms + 1)) * r ** (terms + 1)
            residual = abs(bound / (eps * (1 - r)) - 1)
            witness[(terms, str(dtype))] = float(residual)
            holds &= residual <= sp.Rational(1, 10**12)
    return Certificate("inv_sqrt_near_identity is the binomial series of (1 + E)^(-1/2); series_radius its round-off radius",
                       holds, witness)


def certify_series_covers(dtype: torch.dtype = torch.float32, terms: int = 6) -> Certificate:
    r"""Stiefel's a-priori bound :meth:`~geomuon.manifolds.capabilities.OrthonormalGram.series_covers`
    (where it holds, the engine drops the retraction's exact branch and takes the series alone):

    * the identity it rests on, for a point $W$ ($W^\top W = I$), a step $V$ and weight decay's
      $c$, at **every size** (free algebra, the form's own ``constraint`` $\mathcal C$):
      $(cW + V)^\top(cW + V) - I = (c^2 - 1)I + c\,\mathcal C(W^\top V) + V^\top V$, so by the
      triangle inequality $\|E\|_2 \le b = |c^2 - 1| + c\,\nu + s^2$ for $\|V\|_2 \le s$ and
      $\|\mathcal C(W^\top V)\|_2 \le \nu$;
    * the library's decision is that bound against half the radius (the other half is the
      point's own feasibility error), $b \le r/2$ with $r$ = ``series_radius`` (certified by
      :func:`certify_inverse_sqrt_series`): for $c \in \{1, 0.999, 0.99\}$ and
      $\nu/r \in \{0, 0.01, 0.1\}$, the step $s^* = \sqrt{r/2 - |c^2 - 1| - c\nu}$ where $b = r/2$
      is accepted at $s^*(1 - 10^{-6})$ and refused at $s^*(1 + 10^{-6})$ (both margins far
      above the float64 rounding of $b$, $10^{-16}r$), and a point decayed beyond the
      radius, $|c^2 - 1| + c\nu > r/2$, is refused already at step length 0.

    ``witness``: the reduced identity and every decision."""
    from geomuon.manifolds.capabilities import OrthonormalGram, series_radius

    form = OrthonormalGram()
    m, n = ORIENTATIONS["tall"]
    algebra = FreeAlgebra({"W": "W'", "V": "V'"}, shapes={"W": (m, n), "V": (m, n)})
    W, V = algebra("W"), algebra("V")
    algebra.rule(W.mT @ W, algebra.identity())
    c = sp.Symbol("c", positive=True)
    eye = algebra.identity()
    with _FreeFactories(algebra):
        constraint = form.constraint(W.mT @ V)
    Y = c * W + V
    identity = (Y.mT @ Y - eye - ((c**2 - 1) * eye + c * constraint + V.mT @ V)).terms
    r = series_radius(terms, dtype)
    decisions, holds = {}, not identity
    for shrink in (1.0, 0.999, 0.99):
        for normal in (0.0, 0.01 * r, 0.1 * r):
            room = r / 2 - abs(shrink * shrink - 1) - shrink * normal
            if room <= 0:
                verdicts = (form.series_covers(0.0, normal, shrink, terms, dtype),)
                holds &= not any(verdicts)
            else:
                edge = math.sqrt(room)
                verdicts = tuple(form.series_covers(edge * f, normal, shrink, terms, dtype) for f in (1 - 1e-6, 1 + 1e-6))
                holds &= verdicts == (True, False)
            decisions[(shrink, normal)] = verdicts
    return Certificate(f"Stiefel's series_covers is |c^2 - 1| + c normal + step^2 <= series_radius/2 ({dtype}, {terms} terms)",
                       holds, {"identity": identity, "decisions (accepted below, refused above the edge)": decisions})


def certify_newton_schulz_step_expansion() -> Certificate:
    r"""One step of the library's :func:`~geomuon.manifolds.linalg.newton_schulz_step`,
    for every coefficient tuple of every library schedule, on $Y^\top$ with $Y = \sigma W + t\tau V$ for a
    frame $W$ ($W^\top W = I$) and a tangent $V$ ($V^\top W = -W^\top V$), of **every**
    size $m \ge n$, in both of its forms (the wide step on $Y^\top$, the ``tall`` step on $Y$):

    $$\text{step}(Y^\top)^\top = \text{step}_{\text{tall}}(Y) = p(\sigma)\,W + t\,\frac{p(\sigma)}{\sigma}\tau\,V + O(t^2),
      \qquad p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5,$$

    so the ratio $\tau/\sigma$ is preserved and $K$ steps of any schedule give
    $\operatorname{msign}_K(W + tV) = e\,(W + tV) + O(t^2)$ with the scalar error
    $e = P_K(s)$, $s = 1/(\text{input\_scale}\,\sqrt n)$ (the normalization
    $\|W + tV\|_F = \sqrt n + O(t^2)$ since $\operatorname{tr}(W^\top V) = 0$, also
    certified). ``witness``: reduced residuals (empty)."""
    from geomuon.manifolds.linalg import newton_schulz_step

    algebra = FreeAlgebra({"W": "W'", "V": "V'"})
    W, V = algebra("W"), algebra("V")
    algebra.rule(W.mT @ W, algebra.identity())
    algebra.rule(V.mT @ W, -(W.mT @ V))
    sigma, tau, t = sp.symbols("sigma tau t")
    Y = sigma * W + t * tau * V
    residual = {}
    for a, b, c in _library_coefficients():
        p = exact(a) * sigma + exact(b) * sigma**3 + exact(c) * sigma**5
        for form, out in (("wide", newton_schulz_step(Y.mT, a, b, c).mT), ("tall", newton_schulz_step(Y, a, b, c, tall=True))):
            gap = (out.truncate(t, 2) - (p * W + t * (p / sigma) * tau * V)).terms
            if gap:
                residual[(a, b, c, form)] = gap
    norm_residual = algebra.trace((W + t * V).mT @ (W + t * V))
    # tr(W'W) = n: the empty word; the O(t) term must vanish.
    first_order = {w: sp.expand(cf).coeff(t, 1) for w, cf in norm_residual.items()}
    first_order = {w: cf for w, cf in first_order.items() if cf != 0}
    return Certificate(
        "one Newton-Schulz step maps sigma W + t tau V to p(sigma) W + t p(sigma)/sigma tau V + O(t^2), every size",
        not residual and not first_order,
        {"step": residual, "d/dt ||W + tV||^2 at 0": first_order},
    )


def _library_coefficients() -> list[tuple[float, float, float]]:
    """Every distinct coefficient tuple of the library's Newton–Schulz schedules."""
    from geomuon.manifolds.linalg import _SCHEDULES

    return sorted({row for schedule in _SCHEDULES.values() for row in schedule.coefficients})


def ns_scalar_map(a, b, c, sigma=None) -> sp.Expr:
    r"""The scalar polynomial one library Newton–Schulz step applies to each singular
    value, read off :func:`~geomuon.manifolds.linalg.newton_schulz_step` run on the
    $1\times1$ matrix $[\sigma]$: $p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5$."""
    from geomuon.manifolds.linalg import newton_schulz_step

    sigma = sp.Symbol("sigma") if sigma is None else sigma
    # torch parses the coefficients as Python numbers; they become exact again (the
    # decimals they are written as) inside ExactTensor's baddbmm.
    out = newton_schulz_step(ExactTensor([[[sigma]]]), *(float(exact(v)) for v in (a, b, c)))
    return sp.expand(out.a[0, 0, 0])


def newton_schulz_error(schedule, steps: int | None, s) -> sp.Expr:
    r"""$e = P_K(s)$: the composed scalar map of the schedule (its library step) at $s$."""
    x = exact(s)
    for a, b, c in schedule.step_coefficients(schedule.default_steps if steps is None else steps):
        x = ns_scalar_map(a, b, c, x)
    return x


def certify_newton_schulz_retraction(retraction, W: torch.Tensor, V: torch.Tensor, scale, h: float = 1e-4) -> Certificate:
    r"""The library's Newton–Schulz retraction against its certified expansion
    (:func:`certify_newton_schulz_step_expansion`): ``scale(W, V)`` returns the expected
    $R_W(0)$ and $dR_W(0)[V]$ (for Stiefel $eW$ and $eV$ with the exact scalar
    $e = P_K(1/(1.01\sqrt n))$), checked in float64 by a central difference
    $(R_W(hV) - R_W(-hV))/2h$. Error budget (relative to $\|V\|$): the difference
    quotient's truncation $h^2\|R'''\|/6 \lesssim 10^{-7}$ for $h = 10^{-4}$ and
    $\|V\| \le 1$, plus round-off $\varepsilon_{64}\|R\|/h \approx 10^{-12}$ amplified by
    the iteration's slope (below $10^3$ near $\sigma = 1$): tolerance $10^{-6}$. A
    retraction stepping along $-V$ is off by $2$."""
    R0 = retraction(W, torch.zeros_like(W))
    derivative = (retraction(W, h * V) - retraction(W, -h * V)) / (2 * h)
    expected_point, expected_derivative = scale(W, V)
    point_error = float((R0 - expected_point).norm() / W.norm())
    derivative_error = float((derivative - expected_derivative).norm() / V.norm())
    # R(W, 0) is a float64 evaluation of the certified expression: round-off only.
    holds = point_error <= 1e-12 and derivative_error <= 1e-6
    return Certificate(
        "Newton-Schulz retraction: R(W, 0) and dR_W(0) match the certified expansion",
        holds,
        {"point_error": point_error, "derivative_error": derivative_error},
    )


# ======================================================================================
# Equivariance of the update maps


def certify_equivariance_every_size(update: Callable, group, orientation: str = "tall") -> Certificate:
    r"""$U(g\cdot D) = g\cdot U(D)$ (or $U(g\cdot D) = U(D)$ for an invariance group) at
    **every size** of the orientation (:data:`ORIENTATIONS`): the library's map runs on a
    free letter $D$ of symbolic size $m\times n$, and each side of ``group`` is one free
    letter standing for **every** element of it — an orthogonal $L$ ($L^\top L = LL^\top
    = I$), a signed permutation $P$ (a ``monomial`` letter, which also covers the
    permutations), a positive diagonal $\Lambda$ — acting on $D$ alone ($(g, h)\cdot D =
    g\cdot(h\cdot D)$, so the two sides compose). A group with shifts adds a free row $v$
    and the ones letter ($\mathbf 1^\top\mathbf 1 = m$; a left permutation fixes it,
    $P\mathbf 1 = P^\top\mathbf 1 = \mathbf 1$), and $U(D + \mathbf 1v) = U(D)$ is checked
    too. Row and column norms are the entrywise
    roots of $\operatorname{Diag}(DD^\top)$, $\operatorname{Diag}(D^\top D)$, and the maps'
    quotients and signs are opaque entrywise functions (:meth:`FreeAlgebra.entrywise`):
    the identity is proved for every value of them. Hypothesis (for maps that call
    ``msign``): the matrix it normalizes has Frobenius norm above msign's floor, so the
    floor is never taken. ``witness``: per side the reduced residual (empty)."""
    m, n = _orientation_shape(orientation)
    letters, monomial, positive, shapes = {"D": "D'"}, [], [], {"D": (m, n)}
    shift = getattr(group, "shift", False)
    if shift:
        if group.left != "permutation":
            raise ValueError("certify_equivariance_every_size: shifts need a left side that fixes 1 (permutations)")
        letters["v"], shapes["v"] = "v'", (1, n)
    sides = {}
    for side, kind, size, letter in (("left", group.left, m, "G"), ("right", group.right, n, "H")):
        if kind == "identity":
            continue
        if kind not in ("orthogonal", "permutation", "signed_permutation", "positive_diagonal"):
            raise ValueError(f"certify_equivariance_every_size: unknown side group {kind!r}")
        shapes[letter] = (size, size)
        if kind == "positive_diagonal":
            positive.append(letter)
        else:
            letters[letter] = letter + "'"
            if kind != "orthogonal":
                monomial.append(letter)
        sides[side] = (kind, letter)
    algebra = FreeAlgebra(letters, shapes=shapes, monomial=monomial, positive=positive,
                          ones=("1", m) if shift else None)
    for kind, letter in sides.values():
        if kind == "orthogonal":
            G = algebra(letter)
            algebra.rule(G.mT @ G, algebra.identity())
            algebra.rule(G @ G.mT, algebra.identity())
    if shift:
        G, one = algebra(sides["left"][1]), algebra("1")
        for g in (G, G.mT):
            algebra.rule(g @ one, one)
            algebra.rule(one.mT @ g, one.mT)
    # msign's normalization (hybrid with 0 steps) compares ||D||_F with its floor
    algebra.norms_above_floors = True
    D = algebra("D")
    invariant = getattr(group, "invariant", False)
    residuals = {}
    with _FreeFactories(algebra):
        image = update(D)
        for side, (kind, letter) in sides.items():
            G = algebra(letter)
            acted = update(G @ D) if side == "left" else update(D @ G.mT)
            expected = image if invariant else (G @ image if side == "left" else image @ G.mT)
            residuals[f"{side} {kind}"] = (acted - expected).terms
        if shift:
            residuals["shift 1 v"] = (update(D + algebra("1") @ algebra("v")) - image).terms
    return Certificate(
        f"{getattr(update, '__name__', update)} is {group.name}-{'invariant' if invariant else 'equivariant'}, every {orientation} size",
        all(not r for r in residuals.values()),
        residuals,
    )


def _counterexample(update: Callable, group, D: sp.Matrix, element: tuple) -> Certificate:
    r"""An exact counterexample: $U(gD) - gU(D) \ne 0$ for a rational $D$ and an exact
    group element ``element = (P, Q, v)`` ($v$ ``None`` without shift); the witness is the
    exact residual and its largest entry to 30 digits (certified nonzero)."""
    P, Q, v = element
    Dx = ExactTensor(D)
    acted = ExactTensor(P) @ Dx @ ExactTensor(Q.T)
    if v is not None:
        acted = acted + ExactTensor(sp.ones(D.rows, 1) * sp.Matrix([v]))
        expected = update(Dx) if getattr(group, "shift", False) else None
    else:
        expected = ExactTensor(P) @ update(Dx) @ ExactTensor(Q.T)
    if expected is None or getattr(group, "invariant", False):
        expected = update(Dx)
    residual = (update(acted) - expected).simplify()
    size = max(abs(sp.N(_half_powers_reduced(e), 30)) for e in residual.a.flat)
    return Certificate(
        f"{getattr(update, '__name__', update)} is not {group.name}-equivariant: exact counterexample",
        bool(size > sp.Rational(1, 10**20)),
        {"D": D, "element": element, "residual": residual.matrix(), "max |residual|": size},
    )


def certify_newton_schulz_equivariance() -> Certificate:
    r"""The library's :func:`~geomuon.manifolds.linalg.newton_schulz_step`, for every
    coefficient tuple of every library schedule and both forms of the step (``tall`` false and
    true), satisfies $\text{step}(LXR^\top) = L\,\text{step}(X)\,R^\top$ in the free
    algebra reduced by $L^\top L = I$, $R^\top R = I$ (every shape, every coefficient
    table, every number of steps), and the normalization is invariant:
    $\operatorname{tr}((LXR^\top)^\top LXR^\top) = \operatorname{tr}(X^\top X)$. Hence
    ``msign`` (any schedule) and the spectral map are $O_m\times O_n$-equivariant, and so
    are all their subgroups. ``witness``: the reduced differences (empty)."""
    from geomuon.manifolds.linalg import newton_schulz_step

    algebra = FreeAlgebra({"L": "L'", "X": "X'", "R": "R'"})
    L, X, R = algebra("L"), algebra("X"), algebra("R")
    algebra.rule(L.mT @ L, algebra.identity())
    algebra.rule(R.mT @ R, algebra.identity())
    Y = L @ X @ R.mT
    step = {}
    for a, b, c in _library_coefficients():
        for tall in (False, True):
            gap = (newton_schulz_step(Y, a, b, c, tall=tall) - L @ newton_schulz_step(X, a, b, c, tall=tall) @ R.mT).terms
            if gap:
                step[(a, b, c, tall)] = gap
    norm = algebra.trace(Y.mT @ Y - X.mT @ X)
    return Certificate(
        "the library's Newton-Schulz step is bi-orthogonally equivariant (every size) and the normalization invariant",
        not step and not norm,
        {"step": step, "normalization": norm},
    )


def certify_polar_map_equivariance(update: Callable | None = None, orientation: str = "tall") -> Certificate:
    r"""The library's one-sided polar maps (``right_polar``, ``left_polar``: the scaling by
    the largest entry, the polar factor, the nuclear norm read off it, the scale
    $\|D\|_*^\alpha$ and the zero guard) are $O_m\times O_n$-equivariant at **every size** of
    the orientation, for $\alpha \in \{0, \tfrac12, 1\}$: the map runs on $LDR^\top$ (free
    letters, $L^\top L = LL^\top = I$, $R^\top R = RR^\top = I$) and on $D$, with
    :func:`~geomuon.manifolds.linalg.msign` replaced by a probe that accepts only $Q_1 D Q_2^\top$
    ($Q_1$ one of $L$ or none, $Q_2$ one of $R$ or none) and returns $Q_1 P Q_2^\top$ for a
    letter $P = \operatorname{msign}(D)$ — the action :func:`certify_newton_schulz_equivariance`
    proves of the real iteration (every step equivariant, the normalization invariant). The
    nuclear norm $\langle D, P\rangle = \operatorname{tr}(D^\top P)$ is a trace, compared in
    normal form; hypothesis: $D \ne 0$ (the guard keeps the map, and the nuclear norm is
    $\ge 0$, so ``clamp_min(0)`` keeps it). ``update`` defaults to both library maps (a
    negative control passes another). ``witness``: per map, $\alpha$ and side the residual."""
    from geomuon.optimizers import maps

    m, n = _orientation_shape(orientation)
    algebra = FreeAlgebra({"D": "D'", "L": "L'", "R": "R'", "P": "P'"},
                          shapes={"D": (m, n), "L": (m, m), "R": (n, n), "P": (m, n)})
    D, L, R, P = algebra("D"), algebra("L"), algebra("R"), algebra("P")
    for Q in (L, R):
        algebra.rule(Q.mT @ Q, algebra.identity())
        algebra.rule(Q @ Q.mT, algebra.identity())
    algebra.norms_above_floors = True
    sides = [(left, right) for left in (None, L) for right in (None, R)]

    def probe(X, method="polar_express", eps=None, **unused):
        for left, right in sides:
            acted = D if left is None else left @ D
            acted = acted if right is None else acted @ right.mT
            if not (X - acted).terms:
                image = P if left is None else left @ P
                return image if right is None else image @ right.mT
        raise NotImplementedError(f"msign probe: {X!r} is not D acted on by L and R")

    residuals = {}
    library = maps.msign
    maps.msign = probe
    try:
        with _FreeFactories(algebra):
            for polar_map in ([update] if update else [maps.right_polar, maps.left_polar]):
                for alpha in (0, 0.5, 1):
                    image = polar_map(D, alpha=alpha)
                    for side, acted, expected in (("left", L @ D, L @ image), ("right", D @ R.mT, image @ R.mT),
                                                  ("both", L @ D @ R.mT, L @ image @ R.mT)):
                        residuals[(polar_map.__name__, alpha, side)] = (polar_map(acted, alpha=alpha) - expected).terms
    except (NotImplementedError, ValueError) as error:
        return Certificate(f"polar maps, every {orientation} size: not certified", False, {"error": str(error)})
    finally:
        maps.msign = library
    return Certificate(f"the one-sided polar maps are O_m x O_n-equivariant, every {orientation} size",
                       all(not r for r in residuals.values()), residuals)


def certify_dgram_symmetry(orientation: str = "tall", dgram=None) -> Certificate:
    r"""DGram's projection and retraction commute with its symmetry group at **every
    size**: $O_m \times$ signed column permutations for tall and square points
    ($g\cdot W = LWP^\top$), signed row permutations $\times\,O_n$ for wide ones
    ($g\cdot W = PWL^\top$), one free letter for every element of each side ($L$
    orthogonal, $P$ a monomial letter):

    * ``proju``: $P_{gW}(gX) = g\,P_W(X)$, at a generic point ($W^\top W = D$ diagonal,
      or $WW^\top = D$ wide) and any $X$; the Hadamard quotient by $d_i^2 + d_j^2$ of the
      acted point is the Sylvester solve for the conjugated diagonal $PDP^\top$,
      $\operatorname{Syl}_{PDP^\top}(M) = P\operatorname{Syl}_D(P^\top MP)P^\top$;
    * ``retr``: $R_{gW}(gV) = g\,R_W(V)$ for any $W, V$ (hypothesis: the norm of $W + V$ is
      above msign's floor), the library's method with each Newton–Schulz step replaced by a
      probe that accepts $AZB$ with $A, B$ group letters (or none) and returns
      $A\,N(Z)\,B$ for a fresh letter $N(Z)$ — the action :func:`certify_newton_schulz_equivariance` proves of the real
      step for orthogonal factors, which signed permutations are; the column norms of the
      acted target are $P\operatorname{Diag}(Y^\top Y)P^\top$ and their root
      $P\sqrt{\cdot}P^\top$ (entrywise).

    ``dgram`` defaults to the library's ``DGram()`` (a negative control passes another).
    ``witness``: the residuals."""
    import geomuon.manifolds.linalg as linalg
    from geomuon.manifolds import DGram

    dgram = dgram if dgram is not None else DGram()
    m, n = _orientation_shape(orientation)
    wide = _is_wide(orientation)
    short = m if wide else n
    orthogonal, monomial = (n, m) if wide else (m, n)
    algebra = FreeAlgebra({"W": "W'", "X": "X'", "L": "L'", "P": "P'"}, diagonal=("D",), monomial=("P",),
                          shapes={"W": (m, n), "X": (m, n), "L": (orthogonal, orthogonal),
                                  "P": (monomial, monomial), "D": (short, short)})
    W, X, L, P, D = (algebra(x) for x in "WXLPD")
    algebra.rule(L.mT @ L, algebra.identity())
    algebra.rule(L @ L.mT, algebra.identity())
    algebra.rule(W @ W.mT if wide else W.mT @ W, D)
    algebra.norms_above_floors = True
    group = {"L", "L'", "P", "P'"}

    def act(M):
        return P @ M @ L.mT if wide else L @ M @ P.mT

    def probe(Y, a, b, c, *, tall=False):
        heads = {w[0] for w in Y.terms}
        tails = {w[-1] for w in Y.terms}
        A = next(iter(heads)) if len(heads) == 1 and heads <= group else None
        B = next(iter(tails)) if len(tails) == 1 and tails <= group else None
        inner = FreeMatrix({w[(A is not None):len(w) - (B is not None)]: cf for w, cf in Y.terms.items()}, algebra)
        name = f"N[{a},{b},{c}]({sorted(inner.terms.items(), key=repr)!r})"
        if name not in algebra.transpose_of:
            algebra.transpose_of[name], algebra.transpose_of[name + "'"] = name + "'", name
            algebra.shapes[name], algebra.shapes[name + "'"] = inner._shape, inner._shape[::-1]
        return (algebra(A) if A else algebra.identity()) @ algebra(name) @ (algebra(B) if B else algebra.identity())

    residuals = {}
    step = linalg.newton_schulz_step
    linalg.newton_schulz_step = probe
    try:
        with _FreeFactories(algebra):
            residuals["P_gW(gX) = g P_W(X)"] = (dgram.proju(act(W), act(X)) - act(dgram.proju(W, X))).terms
            residuals["R_gW(gV) = g R_W(V)"] = (dgram.retr(act(W), act(X)) - act(dgram.retr(W, X))).terms
    except (NotImplementedError, ValueError, TypeError) as error:
        return Certificate(f"DGram's symmetry, every {orientation} size: not certified", False, {"error": str(error)})
    finally:
        linalg.newton_schulz_step = step
    return Certificate(f"DGram's proju and retr commute with O x signed permutations, every {orientation} size",
                       all(not r for r in residuals.values()), residuals)


def _shift_probe_certificate(orientation: str = "tall") -> Certificate:
    r"""The library's :func:`~geomuon.optimizers.maps.centered` wrapper, at every size of
    the orientation: run on an identity probe it is $S_m \times O_n$-equivariant and
    shift-invariant (:func:`certify_equivariance_every_size`; so the inner map sees
    $\Pi^\perp(PDQ^\top + \mathbf 1v^\top) = P\,\Pi^\perp D\,Q^\top$ and the output
    re-centering commutes with $(P, Q)$), and its output is centered,
    $\mathbf 1^\top U_c = 0$, whatever the inner map returns (a free letter $U$). With the
    inner map $S_m\times O_n$-equivariant this gives
    $U_c(PDQ^\top + \mathbf 1v^\top) = P\,U_c(D)\,Q^\top$."""
    from geomuon.optimizers import maps
    from geomuon.theory.groups import RouterShift

    def probe(D):
        return D

    centered_probe = maps.centered(probe)
    centered_probe.__name__ = "centered(identity probe)"
    certificate = certify_equivariance_every_size(centered_probe, RouterShift(), orientation)
    m, n = _orientation_shape(orientation)
    algebra = FreeAlgebra({"D": "D'", "U": "U'"}, shapes={"D": (m, n), "U": (m, n)}, ones=("1", m))
    column_sums = (algebra("1").mT @ maps.centered(lambda D: algebra("U"))(algebra("D"))).terms
    return Certificate(
        f"centered(.) feeds the inner map Pi(g D) = g Pi(D) and kills shifts; re-centering commutes with g; "
        f"1'U_c = 0; every {orientation} size",
        certificate.holds and not column_sums,
        {**certificate.witness, "1'U_c(D) for any inner output": column_sums},
    )


def _hybrid_stages(D):
    """The library's ``hybrid`` with no Newton–Schulz step and no nuclear scale: its row
    normalization and msign's normalization, exactly."""
    from geomuon.optimizers import maps

    return maps.hybrid(D, steps=0, alpha=0)


def _centered_stages(inner: Callable, **kwargs) -> Callable:
    """``centered(inner)`` of the library, its inner map run with no Newton–Schulz step
    (``spectral``, and ``hybrid`` without its nuclear scale: the centering, the row
    normalization and msign's normalization, exactly)."""
    from geomuon.optimizers import maps

    def stages(D):
        return maps.centered(inner)(D, steps=0, **kwargs)

    stages.__name__ = f"centered({inner.__name__}) with 0 Newton-Schulz steps"
    return stages


def _orientations(declaration) -> list[str]:
    if declaration.orientation == "any":
        return list(ORIENTATIONS)
    return ["tall", "square"] if declaration.orientation == "tall" else ["wide", "row"]


#: The side groups of :mod:`geomuon.theory.groups` by inclusion: identity in permutations in
#: signed permutations in orthogonal matrices (positive diagonals are in none of them).
_SIDE_INCLUSION = {"identity": 0, "permutation": 1, "signed_permutation": 2, "orthogonal": 3}


def _within(group, proved) -> bool:
    r"""Whether the declared ``group`` is a subgroup of ``proved`` acting the same way, so that
    a proof for ``proved`` proves the row: every side's kind included in ``proved``'s
    (:data:`_SIDE_INCLUSION`), the same kind of statement (equivariance or invariance, with or
    without shifts); a joint group (:class:`~geomuon.theory.groups.NeuronPermutation`) only
    within itself."""
    if getattr(group, "joint", False) or getattr(proved, "joint", False):
        return type(group) is type(proved)
    if any(getattr(group, flag, False) != getattr(proved, flag, False) for flag in ("invariant", "shift")):
        return False
    return all(kind == of or (kind in _SIDE_INCLUSION and of in _SIDE_INCLUSION and _SIDE_INCLUSION[kind] <= _SIDE_INCLUSION[of])
               for kind, of in ((group.left, proved.left), (group.right, proved.right)))


def certify_map_row(declaration) -> Certificate:
    r"""The exact certificate of one ``map`` row of :mod:`geomuon.theory.declared`.

    ``holds`` rows: a proof at every size (:func:`certify_equivariance_every_size` on the
    library's map for the elementwise maps, on its stages with no Newton–Schulz step for
    ``hybrid`` and the centered maps, on an identity probe for ``centered``; the polar
    maps' composition with ``msign``'s certified action
    (:func:`certify_polar_map_equivariance`); the free-algebra certificate of the
    Newton–Schulz step, which every row that calls ``msign`` rests on; compositions combine
    them). ``fails``
    rows: an exact counterexample for the library's map where it is exactly computable
    (``row_norm``, ``col_norm``, ``sign``, ``hybrid`` with no step), otherwise for the
    exact map the iteration approximates (the polar factor, closed form at $2\times2$).
    The certificate's ``holds`` says whether the *declared* relation was certified
    (proof found for ``holds``, counterexample found for ``fails``): a ``holds`` row whose
    proof is for a fixed group (the spectral, polar, hybrid and centered maps: $O_m\times
    O_n$, $S_m^\pm\times O_n$, expert permutations with shifts; the neuron permutation for the
    stacks) is certified only when its group lies within that one (:func:`_within`); the
    elementwise maps are proved for the declared group itself."""
    from geomuon.optimizers import maps
    from geomuon.theory.groups import BiOrthogonal, NeuronPermutation, RouterShift, SignedRowPermutation

    name, group, expected = declaration.update, declaration.group, declaration.expected
    shapes = [(3, 2), (2, 3)]
    if declaration.orientation == "tall":
        shapes = [(3, 2)]
    elif declaration.orientation == "wide":
        shapes = [(2, 3)]
    elementwise = {"row_norm": maps.row_norm, "col_norm": maps.col_norm, "sign": maps.sign}
    witness: dict[str, Any] = {}
    if expected == "holds":
        proved = {"spectral": (BiOrthogonal(),), "spectral per matrix": (BiOrthogonal(), NeuronPermutation()),
                  "right_polar": (BiOrthogonal(),), "left_polar": (BiOrthogonal(),), "hybrid": (SignedRowPermutation(),),
                  "swiglu hybrid stack": (NeuronPermutation(),)}.get(name)
        if name.startswith("centered("):
            proved = (RouterShift(),)
        if proved is not None and not any(_within(group, p) for p in proved):
            return Certificate(f"{declaration.id}: the proof of {name} covers {[p.name for p in proved]}, "
                               f"not {group.name}", False, None)
        orientations = _orientations(declaration)
        parts: list[Certificate] = []
        if name in elementwise:
            parts += [certify_equivariance_every_size(elementwise[name], group, o) for o in orientations]
        elif name in ("spectral", "spectral per matrix"):
            parts.append(certify_newton_schulz_equivariance())
        elif name in ("right_polar", "left_polar"):
            parts += [certify_polar_map_equivariance(getattr(maps, name), o) for o in orientations]
            parts.append(certify_newton_schulz_equivariance())
        elif name in ("hybrid", "swiglu hybrid stack"):
            # The library's hybrid with 0 Newton-Schulz steps (its row normalization and
            # msign's normalization) is S_m^± x O_n-equivariant (the monomial letter stands
            # for every signed permutation, unsigned ones included); every Newton-Schulz step is
            # O_m x O_n-equivariant; the SwiGLU stack applies hybrid to W_gate, W_up (rows
            # permuted) and to W_down^T.
            parts += [certify_equivariance_every_size(_hybrid_stages, SignedRowPermutation(), o) for o in orientations]
            parts.append(certify_newton_schulz_equivariance())
        elif name.startswith("centered("):
            inner = name[len("centered(") : -1]
            parts += [_shift_probe_certificate(o) for o in orientations]
            if inner in elementwise:
                parts += [certify_equivariance_every_size(maps.centered(elementwise[inner]), RouterShift(), o) for o in orientations]
            elif inner in ("spectral", "hybrid"):
                stages = _centered_stages(maps.spectral) if inner == "spectral" else _centered_stages(maps.hybrid, alpha=0)
                parts += [certify_equivariance_every_size(stages, RouterShift(), o) for o in orientations]
                parts.append(certify_newton_schulz_equivariance())
            elif inner in ("left_polar", "right_polar"):
                # the polar map's msign is a probe there: the step proof is what it rests on
                parts += [certify_polar_map_equivariance(getattr(maps, inner), o) for o in orientations]
                parts.append(certify_newton_schulz_equivariance())
            else:
                return Certificate(f"no certificate for the map row {declaration.id}", False, None)
        else:
            return Certificate(f"no certificate for the map row {declaration.id}", False, None)
        witness = {p.claim: p.witness for p in parts}
        return Certificate(f"proof of {declaration.id}", all(p.holds for p in parts), witness)
    # ---- fails rows: an exact counterexample
    if name in elementwise:
        m, n = shapes[0]
        D = sp.Matrix(m, n, lambda i, j: sp.Rational((3 * i + 5 * j) % 7 + 1, 4))
        update = elementwise[name]
        how = "the library's map"
    elif name == "spectral":
        # The exact map the Newton-Schulz iteration approximates, at 2x2 in closed form.
        D = sp.Matrix([[2, 1], [-1, 3]]) / 2
        update, how = _exact_spectral, "the exact polar factor"
    elif name == "hybrid":
        # The library's hybrid with no Newton-Schulz step (its row normalization and
        # msign's normalization): the row stage alone breaks the group.
        m, n = shapes[0]
        D = sp.Matrix(m, n, lambda i, j: sp.Rational((3 * i + 5 * j) % 7 + 1, 4))
        update, how = _hybrid_stages, "the library's hybrid, 0 Newton-Schulz steps"
    else:
        return Certificate(f"no counterexample for {declaration.id}", False, None)
    tried = []
    for element in _rational_elements(group, D.shape):
        certificate = _counterexample(update, group, D, element)
        tried.append(certificate)
        if certificate.holds:
            return Certificate(f"exact counterexample to {declaration.id} ({how})", True, certificate.witness)
    return Certificate(f"no counterexample found for {declaration.id}", False, [c.witness for c in tried])


def _rational_side(kind: str, k: int) -> sp.Matrix | None:
    """One exact rational element of a side group of size ``k`` (``None``: trivial)."""
    if kind == "identity" or k < 2 and kind != "positive_diagonal":
        return None
    if kind == "orthogonal":
        S = sp.zeros(k, k)
        for i, j in itertools.combinations(range(k), 2):
            S[i, j], S[j, i] = sp.Rational(i + 2 * j + 1, 2), -sp.Rational(i + 2 * j + 1, 2)
        return cayley(S)
    if kind in ("permutation", "signed_permutation"):
        P = sp.eye(k)
        P[0, 0] = P[1, 1] = 0
        P[0, 1] = P[1, 0] = 1
        return P if kind == "permutation" else sp.diag(-1, *([1] * (k - 1))) * P
    if kind == "positive_diagonal":
        return sp.diag(*[sp.Integer(2 + i) for i in range(k)])
    raise ValueError(f"_rational_side: unknown side group {kind!r}")


def _rational_elements(group, shape):
    """Candidate exact elements $(P, Q, v)$ of ``group``: each side alone, then a shift."""
    m, n = shape
    left, right = _rational_side(group.left, m), _rational_side(group.right, n)
    if left is not None:
        yield left, sp.eye(n), None
    if right is not None:
        yield sp.eye(m), right, None
    if getattr(group, "shift", False):
        yield sp.eye(m), sp.eye(n), [sp.Integer(j + 1) for j in range(n)]


def _polar_exact(A: sp.Matrix) -> sp.Matrix:
    r"""Exact polar factor $A(A^\top A)^{-1/2}$ of an invertible $2\times2$ matrix, with
    $(M)^{1/2} = (M + \sqrt{\det M}\,I)/\sqrt{\operatorname{tr}M + 2\sqrt{\det M}}$ for
    $2\times2$ symmetric positive definite $M$."""
    M = A.T * A
    root = sp.sqrt(M.det())
    H = (M + root * sp.eye(2)) / sp.sqrt(M.trace() + 2 * root)
    return A * H.inv()


def _exact_spectral(D):
    return ExactTensor(_polar_exact(D.matrix().applyfunc(_half_powers_reduced)))


# ======================================================================================
# The fast engine's Gram-space identity


def certify_gram_space_identity() -> Certificate:
    r"""The fast engine's dual Gram matrix, :func:`geomuon.optimizers.gram.dual_gram` run on
    free letters: for $Z = Z_0 + WS$ with symmetric $S$, $K = Z_0^\top Z_0$,
    $B_0 = W^\top Z_0$ and $DS$ with $D = W^\top W$ (symmetric),

    $$\text{dual\_gram}(K, B_0, S, DS) = Z^\top Z \;(= K + B_0^\top S + S B_0 + S DS),$$

    an identity of the free algebra (every size, no constraint on $W$): the engine updates
    the small Gram matrix of $Z_0 + L^*(\Lambda)$ without forming $Z$. ``witness``: the
    reduced difference (empty)."""
    from geomuon.optimizers.gram import dual_gram

    m, n = ORIENTATIONS["tall"]
    algebra = FreeAlgebra({"Z": "Z'", "W": "W'", "S": "S"}, shapes={"Z": (m, n), "W": (m, n), "S": (n, n)})
    Z0, W, S = algebra("Z"), algebra("W"), algebra("S")
    Z = Z0 + W @ S
    with _FreeFactories(algebra):
        Q = dual_gram(Z0.mT @ Z0, W.mT @ Z0, S, (W.mT @ W) @ S)
    residual = (Q - Z.mT @ Z).terms
    return Certificate("gram.dual_gram(K, B0, S, DS) = (Z0 + W S)'(Z0 + W S), every size", not residual, residual)


# ======================================================================================
# The GELU Lipschitz constant


def certify_gelu_lipschitz() -> Certificate:
    r"""$\max_x|\text{GELU}'(x)| = \text{GELU}'(\sqrt2) = \tfrac12(1 + \operatorname{erf}1)
    + e^{-1}/\sqrt\pi$ for the exact GELU $x\Phi(x)$.

    Proof: $\text{GELU}' = \Phi + x\varphi$ and $\text{GELU}'' = \varphi(x)(2 - x^2)$
    (both certified by differentiation), so $\text{GELU}'$ increases on
    $[-\sqrt2, \sqrt2]$ and decreases outside, with limits $0$ ($-\infty$) and $1$
    ($+\infty$); its extremes are $\text{GELU}'(\sqrt2)$ and
    $\text{GELU}'(-\sqrt2) = 1 - \text{GELU}'(\sqrt2)$ (certified), and
    $\text{GELU}'(\sqrt2) > 1 > |1 - \text{GELU}'(\sqrt2)|$. The library's
    :data:`~geomuon.theory.lipschitz.GELU_LIPSCHITZ` must be that value rounded up: at or above it,
    within one ulp (its binary value, not its decimal). ``witness``: the exact value, the
    constant's excess over it and the residuals."""
    x = sp.Symbol("x", real=True)
    Phi = (1 + sp.erf(x / sp.sqrt(2))) / 2
    phi = sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi)
    gelu = x * Phi
    first, second = sp.diff(gelu, x), sp.diff(gelu, x, 2)
    residuals = {
        "GELU' - (Phi + x phi)": sp.simplify(first - (Phi + x * phi)),
        "GELU'' - phi (2 - x^2)": sp.simplify(second - phi * (2 - x**2)),
    }
    closed = (1 + sp.erf(1)) / 2 + sp.exp(-1) / sp.sqrt(sp.pi)
    residuals["GELU'(sqrt 2) - closed form"] = sp.simplify(first.subs(x, sp.sqrt(2)) - closed)
    residuals["GELU'(-sqrt 2) - (1 - GELU'(sqrt 2))"] = sp.simplify(first.subs(x, -sp.sqrt(2)) - (1 - closed))
    ordered = bool(sp.N(closed, 30) > 1) and bool(sp.N(closed - 1, 30) < 1)
    # the library's float: at or above the value (a bound), within one ulp of it
    from geomuon.theory.lipschitz import GELU_LIPSCHITZ

    above = _float_value(GELU_LIPSCHITZ) - closed
    pinned = bool(sp.N(above, 40) >= 0) and bool(sp.N(above, 40) <= _float_value(math.ulp(GELU_LIPSCHITZ)))
    holds = ordered and pinned and all(r == 0 for r in residuals.values())
    return Certificate("max |GELU'| = GELU'(sqrt 2) = (1 + erf 1)/2 + 1/(e sqrt(pi)), and GELU_LIPSCHITZ is it "
                       "rounded up", holds, {"value": closed, "GELU_LIPSCHITZ - value": sp.N(above, 20), **residuals})


def _msign_full_column_rank(X: sp.Matrix) -> sp.Matrix:
    r"""$X(X^\top X)^{-1/2}$ for an $X$ whose Gram matrix simplifies to a positive diagonal
    (the case of DGram points); raises otherwise."""
    gram = (X.T * X).applyfunc(sp.simplify)
    if not gram.is_diagonal():
        raise ValueError("_msign_full_column_rank: Gram matrix is not diagonal")
    return X * sp.diag(*[1 / sp.sqrt(g) for g in gram.diagonal()])


def _column_norms(X: sp.Matrix) -> list[sp.Expr]:
    return [sp.sqrt(sp.simplify((X[:, j].T * X[:, j])[0])) for j in range(X.cols)]


def certify_sorted_sigma_map_fails(column_norms: Sequence = (1, 2)) -> Certificate:
    r"""The seed code's map $\operatorname{polar}(X)\operatorname{diag}(\sigma(X))$ with
    $\sigma$ sorted descending (as an SVD returns it) does **not** fix the DGram point
    $W = Q_{:, :n}\operatorname{diag}(d)$ when $d$ is not sorted descending: the singular
    values of $W$ are the $d_j$, assigned to the wrong columns. ``holds`` is true when the
    map moves $W$; ``witness`` is the exact nonzero displacement $\text{map}(W) - W$
    $= Q_{:, :n}\operatorname{diag}(\operatorname{sorted}(d) - d)$."""
    d = [sp.nsimplify(x) for x in column_norms]
    n = len(d)
    Q = cayley(skew(n + 1))
    W = Q[:, :n] * sp.diag(*d)
    sigma = sorted(_column_norms(W), key=lambda v: -v)  # = singular values, descending
    moved = _msign_full_column_rank(W) * sp.diag(*sigma) - W
    residual = moved.applyfunc(_reduce)
    return Certificate(
        f"sorted-sigma map moves the DGram point with column norms {tuple(d)}",
        # a proof that it moves: an entry nonzero at a rational point (is_zero_matrix is undecided
        # here, and `not None` would have claimed it for any residual)
        any(_nonzero_somewhere(e) for e in residual),
        residual,
    )


def ns_fixed_points(coefficients: Sequence) -> list[sp.Expr]:
    r"""Nonnegative real fixed points of $p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5$:
    $\sigma = 0$ and $\sigma = \sqrt{\tau}$ for the real roots $\tau \ge 0$ of
    $c\tau^2 + b\tau + (a - 1) = 0$ (exact radicals), ascending."""
    a, b, c = (exact(v) for v in coefficients)
    tau = sp.Symbol("tau")
    roots = [t for t in sp.solve(c * tau**2 + b * tau + (a - 1), tau) if t.is_real and t >= 0]
    return sorted({sp.Integer(0), *[sp.sqrt(t) for t in roots]}, key=lambda v: float(v))


_DIGITS = 50


def _round_out(x, up: bool) -> sp.Rational:
    r"""A rational within $2\cdot10^{-50}$ of ``x`` on the requested side (outward rounding).
    One extra unit of $10^{-50}$ covers the error of the 70-digit evaluation (without it a
    value within $10^{-70}$ of a grid point, such as twelve Polar Express steps' $1 -
    10^{-100}$, would round to the grid point on the wrong side)."""
    scaled = sp.N(x, _DIGITS + 20) * sp.Integer(10) ** _DIGITS
    integer = sp.ceiling(scaled) + 1 if up else sp.floor(scaled) - 1
    return sp.Rational(integer, sp.Integer(10) ** _DIGITS)


def _interval_image(a, b, c, lo, hi):
    """Rational enclosure of the image of [lo, hi] under the quintic: its values at the
    endpoints and at the interior critical points (exact radicals), rounded outward."""
    sigma = sp.Symbol("sigma", positive=True)
    polynomial = ns_scalar_map(a, b, c, sigma)

    def p(x):
        return polynomial.subs(sigma, x)

    candidates = [p(lo), p(hi)]
    for s in sp.solve(sp.diff(polynomial, sigma), sigma):
        if s.is_real and lo <= s <= hi:
            candidates.append(p(s))
    return (
        _round_out(min(candidates, key=lambda v: sp.N(v, _DIGITS)), up=False),
        _round_out(max(candidates, key=lambda v: sp.N(v, _DIGITS)), up=True),
    )


def ns_output_range(
    coefficients: Sequence[Sequence], steps: int, lo="0.003", hi=1, input_scale=1
) -> tuple[sp.Rational, sp.Rational]:
    r"""Rigorous range of the composed Newton–Schulz map on $\sigma \in [lo, hi]$.

    The input is divided by ``input_scale`` (the schedule's safety factor), then step $k$
    applies ``coefficients[min(k, len - 1)]``. A continuous map sends an interval onto the
    interval between its smallest and largest value, attained at an endpoint or at a
    critical point; the critical points of a quintic solve a biquadratic, so each step's
    extreme values are exact radicals. Carrying them exactly through several steps nests
    radicals without bound, so each step's interval is rounded *outward* to 50 decimals:
    the result is a rational enclosure $[\ell, u] \supseteq p([lo, hi])$ wider than the true
    range by less than $10^{-45}$ — exact for every practical purpose, and never optimistic.
    """
    lo, hi = exact(lo) / exact(input_scale), exact(hi) / exact(input_scale)
    table = [tuple(exact(v) for v in row) for row in coefficients]
    for k in range(steps):
        lo, hi = _interval_image(*table[min(k, len(table) - 1)], lo, hi)
    return lo, hi


# ======================================================================================
# The coefficient tables: what pins them


@dataclass(frozen=True)
class PolarExpressDesign:
    r"""The generator's parameters of a Polar Express table (Amsel et al., arXiv
    2505.16932, ``optimal_composition``): first design interval $[\ell_0, 1]$, cushion
    ratio $\gamma$ (a row is optimized on $[\max(\ell_k, \gamma u_k), u_k]$), and whether
    the design chain $\ell_{k+1}$ is the image of $\ell_k$ under the stored step
    $\tilde p_k$ (safety factor applied inside the generator's loop) or under the raw
    polynomial $p_k$ (safety applied to the finished table)."""

    lo: str
    cushion: str
    chain_through_stored: bool


#: The two tables' generator parameters (every row's residuals are at round-off,
#: :func:`certify_polar_express_table`). ``POLAR_EXPRESS``: the paper's 8-step table, the
#: published generator's defaults ($\ell_0 = 10^{-3}$, cushion $0.02407327424182761$),
#: safety $1.01$ applied to the finished table; ``POLAR_EXPRESS_5``: modded-nanogpt's
#: 5-step table ("safety_factor=2e-2, cushion=2"), read off the table: cushion $0.02$ and
#: the $1.02$ safety applied inside the loop (the chain runs through the stored rows).
POLAR_EXPRESS_DESIGNS = {
    "polar_express": PolarExpressDesign("0.001", "0.02407327424182761", False),
    "polar_express_5": PolarExpressDesign("0.001", "0.02", True),
}

_NS_TAIL = (sp.Rational(15, 8), sp.Rational(-5, 4), sp.Rational(3, 8))


def _step_polynomial(a, b, c, scale=1) -> tuple[sp.Rational, sp.Rational, sp.Rational]:
    r"""Exact coefficients $(A, B, C)$ of $y \mapsto \tilde p(\text{scale}\cdot y)$ for the
    library's step polynomial $\tilde p$ (:func:`ns_scalar_map`)."""
    y = sp.Symbol("y")
    polynomial = sp.Poly(ns_scalar_map(a, b, c, exact(scale) * y), y)
    return tuple(polynomial.coeff_monomial(y**j) for j in (1, 3, 5))


def certify_polar_express_table(schedule=None, tolerance="1e-12") -> Certificate:
    r"""The defining property of a Polar Express table: every row is the **recentred
    minimax odd quintic of its cushioned design interval**, the chain of intervals
    starting at $[\ell_0, 1]$ (:data:`POLAR_EXPRESS_DESIGNS`: ``POLAR_EXPRESS`` and
    ``POLAR_EXPRESS_5``).

    Row $k$'s raw polynomial $p_k(y) = \tilde p_k(s\,y)$ is the library's step
    polynomial (:func:`ns_scalar_map`) with the safety factor $s$ undone ($s = 1$ on the
    last row). With $q_k < r_k$ its positive critical points, $\ell'_k = \max(\ell_k,
    \gamma u_k)$ and $u_0 = 1$, $u_{k+1} = 2 - \ell_{k+1}$, $\ell_{k+1} = p_k(\ell_k)$ (or
    $\tilde p_k(\ell_k)$), certified per row, rigorously (interval arithmetic at 200 bits
    from the exact decimals, critical points as enclosed radicals):

    $$\lvert p_k(\ell_k) + p_k(u_k) - 2\rvert,\ \lvert p_k(q_k) - p_k(u_k)\rvert,\
    \lvert p_k(\ell'_k) - p_k(r_k)\rvert \le \text{tolerance},\qquad
    \ell'_k < q_k < r_k < u_k,\ p_k(\ell'_k) < p_k(q_k).$$

    Why it defines the row: $p_k$ equioscillates about its midlevel
    $m = \tfrac12(p(\ell') + p(q))$ at the four points $\ell', q, r, u$, so $p_k/m$ is
    *the* minimax approximation of $1$ on $[\ell'_k, u_k]$ from $\{y, y^3, y^5\}$ (a
    Chebyshev system on $(0, \infty)$; Chebyshev's alternation theorem: three coefficients,
    four points), and the first equation fixes $m$ (the generator's recentring
    $p(\ell) + p(u) = 2$). Three equations for three coefficients. For rows with
    $\gamma u_k > \ell_k$ (the cushioned early rows) this is the minimax on the cushioned
    interval, not on $[\ell_k, u_k]$. A repeated Newton–Schulz tail $(15/8, -5/4, 3/8)$ is
    certified by $p(1) = 1$, $p'(1) = p''(1) = 0$ exactly.

    What it pins: a change $\delta$ in one coefficient of row $k$ moves the first residual
    by $\delta(\ell_k^j + u_k^j) \ge \delta$ ($u_k \ge 1$, $j \in \{1, 3, 5\}$; the critical
    points do not move the values to first order), so any single-coefficient change above
    ``tolerance`` plus the table's own residual fails. The published digits have residuals
    below $10^{-14}$ (their float64 solve); ``tolerance`` $10^{-12}$ leaves a margin of 100.
    ``witness``: per row the interval, $\ell'_k$, the critical points, the three residuals
    (floats of the enclosures' midpoints) and the largest enclosure radius.
    """
    from mpmath import iv

    from geomuon.manifolds.linalg import POLAR_EXPRESS

    schedule = schedule or POLAR_EXPRESS
    design = POLAR_EXPRESS_DESIGNS[schedule.name]
    tol, safety = exact(tolerance), exact(schedule.input_scale)
    rows = [tuple(exact(v) for v in row) for row in schedule.coefficients]
    tail = rows[-1] == _NS_TAIL
    witness, holds = [], True
    prec = iv.prec
    iv.prec = 200
    try:
        enclose = lambda r: iv.mpf(int(sp.numer(r))) / iv.mpf(int(sp.denom(r)))  # noqa: E731
        low, cushion = enclose(exact(design.lo)), enclose(exact(design.cushion))
        high = iv.mpf(1)
        for k, row in enumerate(rows[:-1] if tail else rows):
            raw = [enclose(v) for v in _step_polynomial(*row, safety if k < len(rows) - 1 else 1)]
            A, B, C = raw

            def p(x, A=A, B=B, C=C):
                return x * (A + x * x * (B + x * x * C))

            root = iv.sqrt(9 * B * B - 20 * A * C)
            q, r = iv.sqrt((-3 * B - root) / (10 * C)), iv.sqrt((-3 * B + root) / (10 * C))
            cushioned = cushion * high
            left = cushioned if cushioned.a > low.b else low
            if not (cushioned.a > low.b or cushioned.b < low.a):
                holds = False  # the enclosures cannot tell which end the generator used
            residuals = [p(low) + p(high) - 2, p(q) - p(high), p(left) - p(r)]
            ordered = left.b < q.a and q.b < r.a and r.b < high.a and p(left).b < p(q).a
            ok = ordered and all(-tol <= e.a and e.b <= tol for e in residuals)
            holds = holds and ok
            witness.append({
                "interval": (float(low.mid), float(high.mid)),
                "cushioned": cushioned.a > low.b,
                "l'": float(left.mid),
                "critical points": (float(q.mid), float(r.mid)),
                "residuals": [float(e.mid) for e in residuals],
                "radius": float(max(e.delta for e in residuals)) / 2,
                "holds": ok,
            })
            if design.chain_through_stored:
                A, B, C = (enclose(v) for v in _step_polynomial(*row))
            low = p(low, A, B, C)
            high = 2 - low
    finally:
        iv.prec = prec
    if tail:
        y = sp.Symbol("y")
        last = ns_scalar_map(*rows[-1], y)
        taylor = [sp.expand(sp.diff(last, y, j).subs(y, 1)) for j in range(3)]
        witness.append({"last row p(1), p'(1), p''(1)": taylor})
        holds = holds and taylor == [1, 0, 0]
    return Certificate(
        f"{schedule.name}: every row is the recentred minimax quintic of its cushioned design interval", holds, witness
    )


def _inverse_sqrt_scalar_map():
    r"""The library's :func:`~geomuon.manifolds.linalg.coupled_newton_schulz_step` on the
    $1\times1$ state $(Y, Z) = (\lambda z, z)$ (one eigenvalue of the commuting iterates):
    the new state and the error map $u \mapsto z'\sqrt\lambda$ of $u = z\sqrt\lambda$."""
    from geomuon.manifolds.linalg import coupled_newton_schulz_step

    lam, z, u = sp.symbols("lambda z u", positive=True)
    Y, Z = coupled_newton_schulz_step(ExactTensor([[lam * z]]), ExactTensor([[z]]), ExactTensor([[1]]))
    y_new, z_new = sp.expand(Y.a[0, 0]), sp.expand(Z.a[0, 0])
    error_map = sp.expand(z_new.subs(z, u / sp.sqrt(lam)) * sp.sqrt(lam))
    return lam, z, u, y_new, z_new, error_map


def certify_inverse_sqrt_iteration() -> Certificate:
    r"""The coupled Newton–Schulz iteration of :func:`~geomuon.manifolds.linalg.inv_sqrt_psd`
    converges to $\lambda^{-1/2}$, read off the library's step on one eigenvalue (the
    iterates are polynomials in $A$, so they share its eigenvectors):

    * the invariant $Y = \lambda Z$ is preserved (it holds at the start $Y_0 = A/\|A\|$,
      $Z_0 = I$);
    * $z^\star = \lambda^{-1/2}$ is a fixed point and the step's derivative vanishes there
      (quadratic convergence);
    * in $u = z\sqrt\lambda$ the step is a map $f$ free of $\lambda$ with $f(0) = 0$,
      $f(1) = 1$ and $f' > 0$ on $(0, 1)$ (no root of $f'$ there), so it maps $[u, 1]$
      onto $[f(u), 1]$ and the worst relative error over eigenvalues in
      $[\lambda_{\min}, 1]$ after $K$ steps is $1 - f^K(\sqrt{\lambda_{\min}})$
      (:func:`inverse_sqrt_error_bound`).

    Pins the step's constants ($\tfrac12$, $3$) and its form ($YT$, $TZ$). ``witness``:
    the residuals and $f$."""
    lam, z, u, y_new, z_new, f = _inverse_sqrt_scalar_map()
    star = 1 / sp.sqrt(lam)
    derivative = sp.diff(f, u)
    roots_inside = [r for r in sp.real_roots(sp.Poly(derivative, u)) if 0 < r < 1] if f.is_polynomial(u) else None
    witness = {
        "Y' - lambda Z'": sp.simplify(y_new - lam * z_new),
        "z'(z*) - z*": sp.simplify(z_new.subs(z, star) - star),
        "dz'/dz at z*": sp.simplify(sp.diff(z_new, z).subs(z, star)),
        "d f / d lambda": sp.simplify(sp.diff(f, lam)),
        "f": f,
        "f(0), f(1)": (f.subs(u, 0), sp.simplify(f.subs(u, 1))),
        "roots of f' in (0, 1)": roots_inside,
    }
    holds = (
        witness["Y' - lambda Z'"] == 0 and witness["z'(z*) - z*"] == 0 and witness["dz'/dz at z*"] == 0
        and witness["d f / d lambda"] == 0 and witness["f(0), f(1)"] == (0, 1)
        and roots_inside == [] and derivative.subs(u, sp.Rational(1, 2)) > 0
    )
    return Certificate("coupled Newton-Schulz converges to lambda^(-1/2), quadratically, monotone on [0, 1]", holds, witness)


def inverse_sqrt_error_bound(steps: int, lam_min) -> sp.Rational:
    r"""Rigorous upper bound on $\max_{\lambda \in [\lambda_{\min}, 1]} |1 - z_K\sqrt\lambda|$,
    the relative error of $K$ library coupled Newton–Schulz steps on a normalized
    eigenvalue: $1 - f^K(\sqrt{\lambda_{\min}})$ with $f$ the certified monotone error map
    (:func:`certify_inverse_sqrt_iteration`), each iterate rounded *down* to 50 decimals
    (a lower bound on $f^K$, so an upper bound on the error)."""
    check_count("inverse_sqrt_error_bound", "steps", steps)
    lam = _exact_real("inverse_sqrt_error_bound", "lam_min", lam_min)
    if not 0 < lam <= 1:  # (-1 steps, or lam_min = 2, had been bounded)
        raise ValueError(f"inverse_sqrt_error_bound: lam_min must be a number in (0, 1], got {lam_min!r}")
    *_, u, _, _, f = _inverse_sqrt_scalar_map()
    value = _round_out(sp.sqrt(lam), up=False)
    for _ in range(steps):
        value = _round_out(f.subs(u, value), up=False)
    return 1 - value


def polar_map_reference(shape: tuple[int, int], alpha) -> tuple[torch.Tensor, sp.Matrix]:
    r"""An exact test case of the one-sided polar maps: $D = Q\operatorname{diag}(\sigma)R^\top$
    with rational Cayley frames $Q, R$ and $\sigma = (3/2, 1)$, so
    $U(D) = \|D\|_*^\alpha D(D^\top D)^{-1/2} = (\textstyle\sum\sigma)^\alpha QR^\top$
    exactly. Returns ``(D in float64, exact U(D))``; $\alpha$ a rational (or a float, read
    exactly)."""
    m, n = shape
    k = min(m, n)
    sigma = [sp.Rational(3, 2), sp.Integer(1)][:k] + []
    Q = cayley(sp.Matrix(m, m, lambda i, j: sp.Rational(i - j, 3 + i + j)))[:, :k]
    R = cayley(sp.Matrix(n, n, lambda i, j: sp.Rational(j - i, 2 + i + j)))[:, :k]
    D = Q * sp.diag(*sigma) * R.T
    exact_update = sum(sigma) ** exact(alpha) * Q * R.T
    return torch.tensor(np.array(D.evalf(30).tolist(), dtype=float)), exact_update


def _polar_and_nuclear(A: sp.Matrix) -> tuple[sp.Matrix, sp.Expr]:
    r"""Exact polar factor and nuclear norm of a full-rank $A$ with a short side of 2:
    $\operatorname{msign}(A) = AH^{-1}$ and $\|A\|_* = \operatorname{tr}H$ for the
    $2\times2$ root $H = (A^\top A)^{1/2}$ (closed form, :func:`_polar_exact`;
    $\operatorname{tr}H = (\operatorname{tr}M + 2\sqrt{\det M})^{1/2}$, $M = A^\top A$), and
    the transpose for a wide $A$."""
    if A.cols != 2:
        polar, nuclear = _polar_and_nuclear(A.T)
        return polar.T, nuclear
    M = A.T * A
    return _polar_exact(A), sp.sqrt(M.trace() + 2 * sp.sqrt(M.det()))


#: Unit rows (Pythagorean triples) for :func:`hybrid_map_reference`, by row length.
_UNIT_ROWS = {
    2: [(sp.Rational(3, 5), sp.Rational(4, 5)), (sp.Rational(-5, 13), sp.Rational(12, 13)),
        (sp.Rational(8, 17), sp.Rational(-15, 17))],
    3: [(sp.Rational(1, 3), sp.Rational(2, 3), sp.Rational(2, 3)),
        (sp.Rational(2, 7), sp.Rational(-3, 7), sp.Rational(6, 7))],
}


def hybrid_map_reference(shape: tuple[int, int], alpha) -> dict[str, Any]:
    r"""An exact test case of the row-then-spectral maps: $D = \operatorname{diag}(c)R$ with
    positive $c = (2, \tfrac12, 3)$ and a rational $R$ of **unit rows**, so the row
    normalization of $D$ is $R$ (for $\epsilon = 0$) and
    $\text{hybrid}(D) = \|R\|_*^\alpha\operatorname{msign}(R)$, with the exact polar factor
    and nuclear norm of $R$ (:func:`_polar_and_nuclear`). Returns ``D`` (float64), ``R``
    (float64), and the exact ``polar``, ``nuclear``, ``update`` and the smallest normalized
    singular value ``x_min`` $= \sigma_{\min}(R)/(1.01\|R\|_F)$ (Polar Express is
    certified for $x \ge 10^{-3}$)."""
    m, n = shape
    R = sp.Matrix(_UNIT_ROWS[n][:m])
    c = [sp.Integer(2), sp.Rational(1, 2), sp.Integer(3)][:m]
    D = sp.diag(*c) * R
    polar, nuclear = _polar_and_nuclear(R)
    gram = R.T * R if m >= n else R * R.T
    smallest = (gram.trace() - sp.sqrt(gram.trace() ** 2 - 4 * gram.det())) / 2
    to_float = lambda M: torch.tensor(np.array(M.evalf(30).tolist(), dtype=float))  # noqa: E731
    return {"D": to_float(D), "R": to_float(R), "polar": polar, "nuclear": nuclear,
            "update": nuclear ** exact(alpha) * polar,
            "x_min": sp.sqrt(smallest) / (sp.Rational(101, 100) * sp.sqrt(gram.trace()))}


# ======================================================================================
# The update maps as dualizers, and the RMS scale


#: The norms :func:`certify_dualizer` states a dualizer of.
DUALIZER_NORMS = ("row", "column", "max")


def certify_dualizer(update: Callable, norm: str, shape: tuple[int, int]) -> Certificate:
    r"""The library's map is the **dualizer** of its norm, $U(D) = \arg\max_{\|A\|\le1}
    \langle D, A\rangle$, on a matrix $D$ of symbols of the given ``shape``, run with
    $\epsilon = 0$ where the map has a floor:

    * ``norm="row"`` (``row_norm``, $\|A\| = \max_i\|a_i\|$): every row of $U(D)$ has norm
      1 and $\langle D, U(D)\rangle = \sum_i\|d_i\|$, the dual norm (Cauchy–Schwarz row by
      row: no $A$ in the ball does better, and equality forces $a_i = d_i/\|d_i\|$);
    * ``norm="column"`` (``col_norm``): the same for columns;
    * ``norm="max"`` (``sign``, $\|A\| = \max_{ij}|a_{ij}|$): every $|U_{ij}| = 1$ and
      $\langle D, U(D)\rangle = \sum_{ij}|d_{ij}|$, on $D_{ij} = s_{ij}p_{ij}$ with positive
      symbols $p$ and a fixed sign pattern $s$ with both signs in every row and column
      (every $D$ without zero entries of that pattern).

    Norms, dual norms and $|\cdot|$ come from their definitions; the map is the library's.
    This pins the map's scale and normalizing axis, which an equivariance certificate
    does not (a map of the row norms, $D/\|d_i\|^2$, is just as equivariant).
    ``witness``: the reduced residuals."""
    if norm not in DUALIZER_NORMS:
        # (any other name had been certified as "column": col_norm "is the dualizer of the spectral norm")
        raise ValueError(f"certify_dualizer: norm must be one of {DUALIZER_NORMS}, got {norm!r}")
    m, n = shape
    if norm == "max":
        pattern = lambda i, j: 1 if (i + j) % 2 == 0 else -1  # noqa: E731
        p = [[sp.Symbol(f"p{i}_{j}", positive=True) for j in range(n)] for i in range(m)]
        D = ExactTensor([[pattern(i, j) * p[i][j] for j in range(n)] for i in range(m)])
        U = update(D)
        unit = ExactTensor(np.vectorize(lambda e: sp.Abs(_as_expr(e)) - 1, otypes=[object])(U.a))
        dual = sum(sp.Abs(_as_expr(e)) for e in D.a.flat)
    else:
        D = symbols_matrix("d", m, n)
        U = update(D, eps=0)
        axis = -1 if norm == "row" else -2
        unit = (U * U).sum(axis) - 1
        dual = sum(_as_expr(e) for e in D.norm(dim=axis).a.flat)
    residuals = {"||U(D)|| = 1 (every row / column / entry)": _zero_tensor(unit),
                 "<D, U(D)> = dual norm of D": _zero_tensor(_as_expr((D * U).sum()) - dual)}
    return Certificate(
        f"{getattr(update, '__name__', update)} is the dualizer of the {norm} norm at {m}x{n}",
        all(ok for ok, _ in residuals.values()),
        {k: r for k, (_, r) in residuals.items()},
    )


def certify_rms_scale(shapes: Sequence[tuple[int, int]] = ((3, 5), (5, 3), (4, 4), (1, 7))) -> Certificate:
    r""":func:`geomuon.manifolds.linalg.rms_scale` is the RMS→RMS operator norm of an
    ``[fan_out, fan_in]`` matrix of unit spectral norm: from the definition
    $\|x\|_{\mathrm{RMS}} = \|x\|_2/\sqrt{\dim x}$,
    $\sup_x\|Wx\|_{\mathrm{RMS}}/\|x\|_{\mathrm{RMS}} = \sqrt{n/m}\,\sigma_{\max}(W)$, attained
    at the top right singular vector; here $W = e_1e_1^\top$ and $x = e_1$ (and
    $\|We_1\|_2 \le \|x\|_2$ bounds every other $x$). ``witness``: per shape the exact
    norm and the library's float; ``holds`` when they agree to one unit in the last place."""
    from geomuon.manifolds.linalg import rms_scale

    def rms(v: sp.Matrix) -> sp.Expr:
        return sp.sqrt(sum(x**2 for x in v) / len(v))

    witness, holds = {}, True
    for m, n in shapes:
        check_count("certify_rms_scale", f"shape {(m, n)}'s fan_out", m, least=1)
        check_count("certify_rms_scale", f"shape {(m, n)}'s fan_in", n, least=1)
        W = sp.zeros(m, n)
        W[0, 0] = 1
        x = sp.Matrix([1] + [0] * (n - 1))
        value = rms(W * x) / rms(x)
        library = rms_scale((m, n))
        witness[(m, n)] = (value, library)
        holds &= abs(library - float(sp.N(value, 30))) <= math.ulp(float(sp.N(value, 30)))
    return Certificate("rms_scale(m, n) is the RMS->RMS norm of a unit-spectral-norm m x n matrix", holds, witness)


def soft_cap_polynomial(alpha, sigma=None) -> sp.Expr:
    r"""The spectral soft cap on one singular value, $f_\alpha(\sigma) = g + \alpha g^3$
    with $g = \sigma - \alpha\sigma^3$: the library's
    :func:`geomuon.optimizers.regulate.soft_cap_polynomial` evaluated on sympy values."""
    from geomuon.optimizers.regulate import soft_cap_polynomial as library

    sigma = sp.Symbol("sigma") if sigma is None else sigma
    return sp.expand(library(sigma, alpha))


def _coupling(w_max, wd, eta, where: str):
    r"""$(w_{\max}, k)$ exact, with $k = w_{\max}(1 - \text{wd}) + \eta$, once the three are checked
    (a negative ``eta`` or weight decay had been certified; NaN had raised sympy's own error)."""
    w_max, wd, eta = (_exact_real(where, name, value) for name, value in (("w_max", w_max), ("wd", wd), ("eta", eta)))
    for name, value, admissible, what in (("w_max", w_max, w_max > 0, "> 0"), ("wd", wd, 0 <= wd < 1, "in [0, 1)"),
                                          ("eta", eta, eta >= 0, ">= 0")):
        if not admissible:
            raise ValueError(f"{where}: {name} must be a number {what}, got {value}")
    return w_max, w_max * (1 - wd) + eta


def _exact_real(where: str, name: str, value) -> sp.Expr:
    """:func:`exact` of ``value`` (a number or its decimal string), refused by name unless it is a
    finite real number (NaN had raised sympy's own TypeError, naming nothing)."""
    try:
        number = exact(value)
    except (TypeError, ValueError):
        number = sp.nan
    if not (number.is_real and number.is_finite and number.is_number):
        raise ValueError(f"{where}: {name} must be a finite real number (or its decimal string), got {value!r}")
    return number


def certify_soft_cap_coupling() -> Certificate:
    r"""$f_\alpha(k) - w_{\max} = -k^9\alpha^4 + 3k^7\alpha^3 - 3k^5\alpha^2 + (k - w_{\max})$
    identically in $\alpha, k, w_{\max}$ (DESIGN §3.5). ``witness``: the expanded difference
    of the two sides (zero)."""
    alpha, k, w = sp.symbols("alpha k w_max")
    quartic = -(k**9) * alpha**4 + 3 * k**7 * alpha**3 - 3 * k**5 * alpha**2 + (k - w)
    residual = sp.expand(soft_cap_polynomial(alpha, k) - w - quartic)
    return Certificate("f_alpha(k) = w_max is the coupling quartic", residual == 0, residual)


def soft_cap_coupling_roots(w_max: float, wd: float, eta: float) -> tuple[float, ...]:
    r"""Real roots $\alpha \ge 0$ of the coupling quartic
    $-k^9\alpha^4 + 3k^7\alpha^3 - 3k^5\alpha^2 + (k - w_{\max}) = 0$,
    $k = w_{\max}(1 - \text{wd}) + \eta$, ascending. The soft cap's $\alpha$ is the first.

    Computed exactly (sympy real root isolation on the rational coefficients) and rounded
    to float at the end, so it serves as an oracle to $10^{-15}$ relative for a numeric
    solver. Empty when no root $\ge 0$ exists ($k < w_{\max}$: no cap is needed).
    """
    w, k = _coupling(w_max, wd, eta, "soft_cap_coupling_roots")
    alpha = sp.Symbol("alpha")
    quartic = sp.Poly(-(k**9) * alpha**4 + 3 * k**7 * alpha**3 - 3 * k**5 * alpha**2 + (k - w), alpha)
    return tuple(float(sp.N(r, 30)) for r in sorted(set(sp.real_roots(quartic))) if r >= 0)


def certify_soft_cap_monotone(w_max: float, wd: float, eta: float) -> Certificate:
    r"""Whether $f_\alpha$ (with $\alpha$ the smallest coupling root) is monotone on
    $[0, k]$, and its peak there.

    $f_\alpha'(\sigma) = (1 - 3\alpha\sigma^2)(1 + 3\alpha h(\sigma)^2)$ (certified in the
    witness), and the second factor is positive, so $f_\alpha$ is monotone on $[0, k]$ iff
    $3\alpha k^2 \le 1$. ``witness``: ``{"alpha", "k", "derivative_residual", "peak"}``
    with the exact peak $\max_{[0,k]} f_\alpha$ (at $\sigma = 1/\sqrt{3\alpha}$ when that
    lies inside)."""
    w, k = _coupling(w_max, wd, eta, "certify_soft_cap_monotone")
    roots = soft_cap_coupling_roots(w_max, wd, eta)
    alpha = exact(roots[0]) if roots else sp.Integer(0)
    sigma = sp.Symbol("sigma")
    f = soft_cap_polynomial(alpha, sigma)
    h = sigma - alpha * sigma**3
    derivative_residual = sp.expand(sp.diff(f, sigma) - (1 - 3 * alpha * sigma**2) * (1 + 3 * alpha * h**2))
    monotone = 3 * alpha * k**2 <= 1
    peak = f.subs(sigma, k) if monotone else f.subs(sigma, 1 / sp.sqrt(3 * alpha))
    return Certificate(
        f"soft cap monotone on [0, k] for w_max={w_max}, wd={wd}, eta={eta}",
        bool(monotone) and derivative_residual == 0,
        {"alpha": alpha, "k": k, "derivative_residual": derivative_residual, "peak": sp.nsimplify(peak)},
    )


def certify_residual_lipschitz() -> Certificate:
    r"""$\operatorname{Lip}((1-a)x + af(x)) \le (1-a) + a\operatorname{Lip}(f)$ for
    $a \in [0, 1]$.

    The Jacobian of the residual map is $(1-a)I + aJ$; along any direction its gain is
    $(1-a) + at$ with $|t| \le L = \operatorname{Lip}(f)$ (for symmetric $J$, $t$ runs
    over its eigenvalues; in general the triangle inequality gives the same bound). So it
    suffices that $((1-a) + aL)^2 - ((1-a) + at)^2 \ge 0$. Exactly:

    $$((1-a) + aL)^2 - ((1-a) + at)^2 = a\,(L - t)\,\big(2(1 - a) + a(L + t)\big),$$

    and with $a = 1/(1+s)$, $L - t = \delta$, $L + t = \epsilon$ ($s, \delta, \epsilon \ge 0$)
    every factor is a ratio of sign-definite polynomials in nonnegative variables, with an
    even number of negative ones. Equality at $t = L$ makes the rule tight. ``witness``: the factorization
    and the substituted factors.
    """
    a, L, t = sp.symbols("a L t", real=True)
    s, delta, eps = sp.symbols("s delta epsilon", nonnegative=True)
    gap = ((1 - a) + a * L) ** 2 - ((1 - a) + a * t) ** 2
    factored = sp.factor(gap)
    substitution = {a: 1 / (1 + s), L: (delta + eps) / 2, t: (eps - delta) / 2}
    factors = [sp.together(f.subs(substitution)) for f in sp.Mul.make_args(factored)]

    def sign_definite(poly_expr) -> int:
        """+1 (-1) if every coefficient in (s, delta, epsilon) is >= 0 (<= 0), else 0."""
        coeffs = sp.Poly(poly_expr, s, delta, eps).coeffs()
        if all(c >= 0 for c in coeffs):
            return 1
        return -1 if all(c <= 0 for c in coeffs) else 0

    signs = [sign_definite(part) for f in factors for part in sp.fraction(f)]
    nonnegative = 0 not in signs and sp.prod(signs) == 1
    holds = nonnegative and sp.expand(gap.subs(t, L)) == 0
    # the library's function is the proved expression: it takes floats (its range check
    # compares a), so it is read on a 3 x 3 grid of exact rationals, to float64 round-off; a
    # function of degree <= 2 in each argument that differs from (1 - a) + aL differs there
    from geomuon.theory.lipschitz import residual_lipschitz

    grid = [(x, y) for x in (sp.Integer(0), sp.Rational(1, 3), sp.Integer(1))
            for y in (sp.Integer(0), sp.Rational(2, 5), sp.Integer(3))]
    library = max(abs(residual_lipschitz(float(x), float(y)) - float((1 - x) + x * y)) for x, y in grid)
    return Certificate(
        "Lip((1-a)x + a f(x)) <= (1-a) + a Lip(f) for a in [0, 1], tight at t = L; residual_lipschitz is it",
        holds and library <= 4 * np.finfo(np.float64).eps,
        {"gap": factored, "factors": factors, "library_gap": library},
    )


def certify_soft_cap_root_unique() -> Certificate:
    r"""The coupling root is unique and the monotonicity threshold is $62/81$.

    With $\beta = \alpha k^2$, the library's soft cap gives
    $f_{\beta/k^2}(k)/k = h(\beta) = 1 - 3\beta^2 + 3\beta^3 - \beta^4$, free of $k$
    (certified by expansion); $h'(\beta) = -\beta(6 - 9\beta + 4\beta^2)$ and the quadratic
    has discriminant $81 - 96 < 0$ with positive leading coefficient, so $h$ is strictly
    decreasing on $\beta > 0$ and $h(\beta) = w_{\max}/k$ has at most one root $\beta \ge 0$
    (exactly one when $w_{\max}/k \le 1$). $f_\alpha' = (1 - 3\alpha\sigma^2)(1 +
    3\alpha g^2)$ (certified), so $f_\alpha$ is monotone on $[0, k]$ iff $\beta \le 1/3$,
    and the smallest ratio a monotone cap reaches is $h(1/3) = 62/81$, which the library's
    :data:`~geomuon.optimizers.regulate.SOFT_CAP_MIN_RATIO` must be to half an ulp (its binary
    value). ``witness``: the residuals, the discriminant, $h(1/3)$ and the constant's error."""
    beta, k, sigma, alpha = sp.symbols("beta k sigma alpha", positive=True)
    h = sp.expand(soft_cap_polynomial(beta / k**2, k) / k)
    quartic = 1 - 3 * beta**2 + 3 * beta**3 - beta**4
    quadratic = sp.Poly(sp.expand(-sp.diff(quartic, beta) / beta), beta)
    discriminant = quadratic.discriminant()
    f = soft_cap_polynomial(alpha, sigma)
    g = sigma - alpha * sigma**3
    witness = {
        "h(beta) - quartic": sp.expand(h - quartic),
        "h'(beta) + beta (6 - 9 beta + 4 beta^2)": sp.expand(sp.diff(quartic, beta) + beta * (6 - 9 * beta + 4 * beta**2)),
        "f' - (1 - 3 alpha s^2)(1 + 3 alpha g^2)": sp.expand(sp.diff(f, sigma) - (1 - 3 * alpha * sigma**2) * (1 + 3 * alpha * g**2)),
        "discriminant": discriminant,
        "leading coefficient": quadratic.LC(),
        "h(1/3)": quartic.subs(beta, sp.Rational(1, 3)),
    }
    from geomuon.optimizers.regulate import SOFT_CAP_MIN_RATIO

    # the library's threshold: 62/81 to the nearest float (half an ulp)
    witness["SOFT_CAP_MIN_RATIO - 62/81"] = _float_value(SOFT_CAP_MIN_RATIO) - sp.Rational(62, 81)
    holds = bool(
        abs(witness["SOFT_CAP_MIN_RATIO - 62/81"]) <= _float_value(math.ulp(SOFT_CAP_MIN_RATIO)) / 2
        and witness["h(beta) - quartic"] == 0
        and witness["h'(beta) + beta (6 - 9 beta + 4 beta^2)"] == 0
        and witness["f' - (1 - 3 alpha s^2)(1 + 3 alpha g^2)"] == 0
        and discriminant < 0
        and quadratic.LC() > 0
        and witness["h(1/3)"] == sp.Rational(62, 81)
    )
    return Certificate("the soft-cap coupling root is unique; monotone caps reach w_max/k >= 62/81 "
                       "(SOFT_CAP_MIN_RATIO)", holds, witness)


def certify_soft_cap_regulator(shape: tuple[int, int] = (3, 2), w_max: float = 1.0, weight_decay: float = 0.01,
                               eta: float = 0.05, lr: float = 1.0) -> Certificate:
    r"""The library's :class:`geomuon.optimizers.regulate.SoftCap` maps every RMS→RMS singular
    value by the certified scalar cap: on $W = Q\operatorname{diag}(\sigma)R^\top$ ($Q$, $R$
    rational orthonormal frames of the ``shape``'s sides, $\sigma$ positive symbols), its
    ``unchecked`` (the RMS scaling $s$ = ``rms_scale``, the transposition of a wide matrix, the
    two odd cubic steps of ``regulate``; ``guard_steps=0``) returns exactly

    $$Q\operatorname{diag}\big(f_\alpha(s\sigma_i)/s\big)R^\top,\qquad
    \alpha = \text{soft\_cap\_alpha}(w_{\max}, \text{lr}\cdot\text{weight\_decay}, \eta),$$

    with $f_\alpha$ = :func:`soft_cap_polynomial` (the library's scalar map, which
    :func:`certify_soft_cap_coupling` and :func:`certify_soft_cap_root_unique` certify): the
    matrix steps the regulator runs are the polynomial the coupling proofs are about (the
    floats $s$ and $\alpha$ read as the rationals they are). ``witness``: the residual."""
    from geomuon.manifolds.linalg import rms_scale
    from geomuon.optimizers.regulate import SoftCap, soft_cap_alpha

    m, n = shape
    k = min(m, n)

    Q, R = _rational_frame(m, k), _rational_frame(n, k)
    sigma = sp.symbols(f"sigma0:{k}", positive=True)
    W = Q * sp.diag(*sigma) * R.T
    regulator = SoftCap(w_max=w_max, eta=eta, weight_decay=weight_decay, guard_steps=0)
    capped = regulator.unchecked(ExactTensor(W), lr=lr).matrix()
    s = exact(rms_scale((m, n)))
    alpha = exact(soft_cap_alpha(w_max, lr * weight_decay, eta))  # the float the regulator takes
    expected = Q * sp.diag(*[soft_cap_polynomial(alpha, s * x) / s for x in sigma]) * R.T
    residual = (capped - expected).applyfunc(_reduce)
    # (is_zero_matrix is None, not False, for a nonzero polynomial sympy does not decide the sign of)
    return Certificate(f"SoftCap {m}x{n} maps every RMS singular value by the certified f_alpha",
                       residual.is_zero_matrix is True, residual)


def soft_cap_beta(ratio) -> sp.Expr:
    r"""The exact root $\beta \in [0, 1/3]$ of $h(\beta) = r$ for ``ratio`` $r$ with
    $62/81 \le r \le 1$, as a sympy algebraic number."""
    beta = sp.Symbol("beta")
    quartic = sp.Poly(1 - 3 * beta**2 + 3 * beta**3 - beta**4 - exact(ratio), beta)
    roots = [r for r in sp.real_roots(quartic) if 0 <= r <= sp.Rational(1, 3)]
    if len(roots) != 1:
        raise ValueError(f"soft_cap_beta: ratio {ratio} has {len(roots)} roots in [0, 1/3]")
    return roots[0]


# ======================================================================================
# The Gram-space capability (the fast engine's n x n form of a manifold)


def certify_gram_form(manifold, W: ExactTensor, name: str = "") -> Certificate:
    r"""A manifold's declared ``gram_form`` (:mod:`geomuon.manifolds.capabilities`) against
    the manifold's own methods at the exact tall point $W$ ($D = W^\top W$), with matrices
    $A, X, V = P_W(X)$ and a multiplier $\Lambda$ of symbols:

    * ``constraint``: $\mathcal C(W^\top A) = L_W(A)$; ``adjoint``: $W S(\Lambda) = L_W^*(\Lambda)$;
    * ``project``: $X - W\Sigma(D, W^\top X) = P_W(X)$; ``gram_diag``: $g(D) =$
      ``constraint_gram_diag``$(W)$;
    * ``project`` at the point $cW$ that :func:`geomuon.optimizers.gram.gram_step` projects
      at under weight decay ($c$ a symbol; $D = c^2W^\top W$, $M = cW^\top X$):
      $X - cW\Sigma(c^2D, cW^\top X) = P_W(X)$, the same tangent space (at $c = 1$ alone a
      form may divide by 1 where it should divide by $D$'s diagonal);
    * the retraction $R_W(tV) = Y\rho(Y^\top Y)$, $Y = W + tV$: $R_W(0) = W$ and
      $dR_W(0) = \mathrm{id}$ on $T_W$ (exact Taylor coefficients, the truncated series
      of $\rho$ included), and for *every* direction $X$ the velocity of
      $R(W + tX)$ at $t = 0$ is tangent (the curve stays on the manifold to first order;
      this sees $\rho$'s first-order term, which a tangent direction does not);
    * for a form with a Newton step (``has_newton``): $S(\text{newton\_increment}(D, E)) = E$
      for every symmetric $E$ (the multiplier increment reproduces the step's $S$-space
      increment).
    """
    form = manifold.gram_form
    m, n = W.shape[-2:]
    W, (A, X, lam_all, t, c) = _in_field(W, [("a", (m, n)), ("x", (m, n)), ("lam", (n * n,)), ("t", ()), ("c", ())])
    LA = manifold.constraint(W, A)
    lam = ExactTensor(lam_all.a[: LA.numel()].reshape(LA.a.shape))
    D = W.mT @ W
    cW = W * c
    residuals = {
        "C(W'A) = L(A)": form.constraint(W.mT @ A) - LA,
        "W S(lam) = L*(lam)": W @ form.adjoint(lam) - manifold.constraint_adjoint(W, lam),
        "X - W Sigma = P(X)": X - W @ form.project(D, W.mT @ X) - manifold.proju(W, X),
        "X - cW Sigma(c^2 D, cW'X) = P(X) at the scaled point cW": X - cW @ form.project(cW.mT @ cW, cW.mT @ X)
        - manifold.proju(W, X),
        "g(D) = constraint_gram_diag": ExactTensor(form.gram_diag(D)) - ExactTensor(manifold.constraint_gram_diag(W)),
    }
    if form.has_newton:
        # The Newton step's S-space increment E (symmetric) maps to the multiplier
        # increment newton_increment(D, E), whose S(.) must give E back.
        L = ExactTensor(lam_all.a[: n * n].reshape(n, n))
        E = L + L.mT
        residuals["S(newton_increment(D, E)) = E for symmetric E"] = form.adjoint(form.newton_increment(D, E)) - E
    checked = {k: _zero_tensor(v) for k, v in residuals.items()}
    # The retraction may take square roots: expressions, not field elements.
    Wx = ExactTensor(np.vectorize(_as_expr, otypes=[object])(W.a))
    Vx = ExactTensor(np.vectorize(_as_expr, otypes=[object])(manifold.proju(W, X).a))
    tx = t.as_expr()
    Y = Wx + Vx * tx
    # Two terms of a series factor suffice: its k-th term is O(t^k) at least, so only the
    # constant and linear terms reach R_W(0) and dR_W(0) (and six terms of symbolic
    # powers cost minutes).
    c0, c1 = _taylor(Y @ form.retraction_factor(Y.mT @ Y, terms=2), tx, 2)
    checked["R(W, 0) = W"] = _zero_tensor(c0 - Wx)
    checked["dR_W(0)[V] = V"] = _zero_tensor(c1 - Vx)
    # From any direction X the curve R(W + tX) stays on the manifold, so its velocity is
    # tangent (this sees the factor's first-order term, which a tangent V does not).
    Y = Wx + ExactTensor(np.vectorize(_as_expr, otypes=[object])(X.a)) * tx
    _, c1 = _taylor(Y @ form.retraction_factor(Y.mT @ Y, terms=2), tx, 2)
    checked["L_W(d/dt R(W + tX)) = 0 for every X"] = _zero_tensor(manifold.constraint(Wx, c1))
    return Certificate(
        f"{name or type(manifold).__name__} {m}x{n}: the Gram-space form agrees with the manifold, and its retraction is one",
        all(ok for ok, _ in checked.values()),
        {k: r for k, (_, r) in checked.items()},
    )


# ======================================================================================
# The fast engine's dual steps and polish, in float64 on the library's own functions


class _PointGramOf:
    r"""$X \mapsto DX$ for a given $D$: the multiplication the engine's ``polish`` takes
    (:class:`geomuon.optimizers.gram._PointGram`'s interface, ``D`` and a call)."""

    def __init__(self, D: torch.Tensor) -> None:
        self.D = D

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        return self.D @ X


@dataclass
class _EngineFrame:
    """The engine's tall frame of a float64 point $W$ and momentum $G$ (a wide pair is
    transposed, as ``ManifoldMuon`` hands it to :func:`~geomuon.optimizers.gram.gram_step`)."""

    manifold: Any
    W: torch.Tensor  # the point in its own orientation, [m, n]
    flip: bool
    Wt: torch.Tensor  # [1, M, N], M >= N
    Z0: torch.Tensor
    S: torch.Tensor
    T1: torch.Tensor
    T2: torch.Tensor
    D: torch.Tensor
    B0: torch.Tensor
    K: torch.Tensor
    point: torch.Tensor  # the step's new point, tall [1, M, N]

    @property
    def Z(self) -> torch.Tensor:
        """The last dual iterate $Z = Z_0 + W'S$, tall ``[1, M, N]``."""
        return self.Z0 + self.Wt @ self.S

    def direction(self, T1: torch.Tensor | None = None, T2: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\hat A = W'T_1 + Z_0T_2$, tall ``[1, M, N]`` (default: the step's own factors)."""
        return self.Wt @ (self.T1 if T1 is None else T1) + self.Z0 @ (self.T2 if T2 is None else T2)

    def point_layout(self, X: torch.Tensor) -> torch.Tensor:
        """A tall ``[1, M, N]`` matrix back in the point's orientation, ``[m, n]``."""
        return X[0].mT if self.flip else X[0]

    def tall_layout(self, X: torch.Tensor) -> torch.Tensor:
        return (X.mT if self.flip else X).unsqueeze(0)


def _engine_frame(manifold, W: torch.Tensor, G: torch.Tensor, dual_steps: int = 1, shrink: float = 1.0,
                  lr: float = 0.1, polish_rounds: int = 0, polish_method: str = "admm") -> _EngineFrame:
    r"""Run the library's :func:`~geomuon.optimizers.gram.gram_step` (float64 products,
    ``dual_steps`` Newton dual steps, no carry, ``polish_rounds`` of ``polish_method`` (default
    none), step length ``lr``, weight decay's
    ``shrink`` $c$) on $W, G$ and return its factors $T_1, T_2, Z_0, S$ and new point with the
    Gram data of the point it steps from, $W' = cW$ (``Wt``): $D = \operatorname{Diag}(W'^\top W')$
    (the engine's diagonal $D$ of a ``diagonal_gram`` form), $B_0 = W'^\top Z_0$, $K = Z_0^\top Z_0$."""
    from geomuon.optimizers.gram import GramSettings, gram_step

    flip = manifold.transposes_wide and W.size(-2) < W.size(-1)
    Wt = (W.mT if flip else W).unsqueeze(0).contiguous()
    Gt = (G.mT if flip else G).unsqueeze(0).contiguous()
    form = manifold.gram_form
    settings = GramSettings(dual_steps=dual_steps, carry=False, update="newton", dualizer="eigh",
                            compute_dtype=torch.float64, polish_rounds=polish_rounds, polish_method=polish_method,
                            smoothing=0.0)
    step = gram_step(form, Wt, Gt, lr, None, settings, shrink=shrink)
    T1, T2, Z0, S = step.direction_factors
    Wt = shrink * Wt
    D = torch.diag_embed(Wt.square().sum(-2)) if form.diagonal_gram else Wt.mT @ Wt
    return _EngineFrame(manifold, W, flip, Wt, Z0, S, T1, T2, D, Wt.mT @ Z0, Z0.mT @ Z0, step.point)


def _spectral(X: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(X, 2).max())


def certify_gram_polish(manifold, W: torch.Tensor, G: torch.Tensor, form=None, rounds: int = 3,
                        converge: int | None = None, method: str | None = None) -> Certificate:
    r"""The engine's :func:`geomuon.optimizers.gram.polish` does what its docstring says, in
    **float64** on the engine's own direction $\hat A_0 = WT_1 + Z_0T_2$ and dual iterate
    $Z = Z_0 + WS$ of ``gram_step`` (one Newton dual step) at the float64 point $W$ with
    momentum $G$ (a wide pair runs transposed, as ``ManifoldMuon`` runs it; every residual is
    read in the point's own orientation through the manifold's public methods), with
    ``method`` (default: the form's ``polish_method``). With $\hat A_k$ the direction after
    $k$ rounds, assembled from the returned $(T_1, T_2)$:

    * **the rounds are the definition's**: for each of the first ``rounds`` rounds, $\hat A_k$
      is the same number of rounds written out in the point's layout with
      ``torch.linalg.svd`` and the manifold's ``proju`` $P_W$ (not the engine's Gram
      coordinates): $\Pi(A) = U\min(\Sigma, 1)V^\top$ (the unit ball's nearest point) and, for
      ``"admm"``, $x = P_W(z - u) + P_W(G)/\rho$, $z \leftarrow \Pi(x + u)$,
      $u \leftarrow x + u - z$ from $z = \hat A_0$, $u = Z/\rho$, $\rho = \|Z\|_F$, returning
      $P_W(z)$; for ``"alternating"`` the same with $u = 0$ and no $G$ term,
      $\hat A_{k+1} = P_W(\Pi(\hat A_k))$;
    * **tangent**: $\|L_W(\hat A_k)\|_F \le \tau$ (the manifold's ``constraint``) after
      each of those rounds and after ``converge`` rounds;
    * ``"alternating"``, **toward the unit ball**: the excess $e_k = \max(\|\hat A_k\|_2 - 1, 0)$
      does not increase over those rounds (from $k = 0$) and is at most $10^{-6}$ after
      ``converge`` (default 32) rounds (alternating projections onto a subspace and a ball that
      meet in the ball's interior converge linearly, Bauschke–Borwein);
      $\|\hat A_{k+1}\|_F \le \|\hat A_k\|_F$ (both maps are projections onto convex sets
      holding $0$, so nonexpansive toward it); a tangent direction of spectral norm $< 1$
      (the direction after ``converge`` rounds, scaled to norm $0.9$) is returned unchanged;
    * **wired into the step**: ``gram_step`` with those rounds (its own dual iterate $S$ and
      $\rho = \sqrt{\operatorname{tr} Q}$, the manifold's own form) returns the same direction,
      within the same bound;
    * ``"admm"``, **to the optimum**: after ``converge`` (default 400) rounds the duality gap
      closes, $\langle G, \hat A\rangle/\max(1, \|\hat A\|_2) \ge (1 - 10^{-6})\,
      \|P_W(G) + \rho\,(u - P_W(u))\|_*$, the right side the dual value of the reference's own
      last multiplier ($\rho u$'s normal part added to $P_W(G)$: a point of $G + N_W$, so an
      upper bound on the optimum whatever $u$ is).

    Tolerance (float64, $\varepsilon = 2^{-52}$): a product of inner dimension $k$ errs by
    at most $k\varepsilon$ times the product of the factors' magnitudes (Higham's
    $\gamma_k$). $\hat A = WT_1 + Z_0T_2$ is read through $W^\top\hat A = DT_1 + B_0T_2$,
    whose factors' magnitudes are $\|W\|_F\|T_1\|_F$ and $\|Z_0\|_F\|T_2\|_F$: the
    conditioning enters as $\|T_2\|_F = \|P\|_F \approx \sigma_{\min}(Z)^{-1}$ (241 on the
    square DGram test point, where $Z_0$ is tangent only to $\varepsilon\|G\|$, so the
    engine's own unpolished direction is off the tangent space by $4\cdot10^{-13}$). With the
    inner dimensions $m$ ($W^\top\cdot$) and $n$ (the round's products; ``eigh`` and ``svd``
    are backward stable with constants $\lesssim n$) and $W$'s own feasibility error
    ($\varepsilon\|W\|_F^2$),

    $$\tau = 8(m + n)\,\varepsilon\,\|W\|_F\,\big(\|W\|_F\|T_1\|_F + \|Z_0\|_F\|T_2\|_F\big),$$

    a margin of 8 over the first-order bound (measured residuals $10^{-16}$–$4\cdot10^{-13}$,
    at least 30 times below $\tau$); after $k$ rounds the deviation from the reference may
    reach $(k + 1)\tau$ (each round's maps are nonexpansive, so a round's rounding is carried,
    not amplified). The gap's $10^{-6}$ is ADMM's convergence, not rounding: measured after
    400 rounds below $10^{-12}$ on every test point, so a slower but converging ADMM (a
    penalty far off scale) still passes and a stalled one does not. ``witness``: every residual
    with its tolerance.
    """
    from geomuon.optimizers.gram import POLISH_METHODS, polish

    frame = _engine_frame(manifold, W, G)
    form = manifold.gram_form if form is None else form
    method = form.polish_method if method is None else method
    if method not in POLISH_METHODS:
        raise ValueError(f"certify_gram_polish: method must be one of {POLISH_METHODS}, got {method!r}")
    admm = method == "admm"
    converge = (400 if admm else 32) if converge is None else converge
    if converge < rounds:
        raise ValueError(f"certify_gram_polish: converge ({converge}) must be at least rounds ({rounds})")
    mulD = _PointGramOf(frame.D)
    m, n = W.shape[-2:]
    eps = torch.finfo(torch.float64).eps
    Z = frame.Z
    rho = Z.norm()
    dual = (frame.S, rho.reshape(1)) if admm else None

    def run(T1, T2, k):
        U1, U2 = polish(form, mulD, frame.B0, frame.K, T1, T2, k, dual=dual)
        tall = frame.direction(U1, U2)
        scale = float(frame.Wt.norm() * (frame.Wt.norm() * U1.norm() + frame.Z0.norm() * U2.norm()))
        return frame.point_layout(tall), 8 * (m + n) * eps * scale

    def ball(A):
        U, s, Vh = torch.linalg.svd(A, full_matrices=False)
        return (U * s.clamp_max(1.0)) @ Vh

    start = frame.point_layout(frame.direction())
    tangent_G = manifold.proju(W, G)

    def references():  # (the direction after k rounds, the multiplier u), k = 1, 2, ..., from the definitions
        z, u = start, (frame.point_layout(Z) / rho if admm else torch.zeros_like(start))
        while True:
            x = manifold.proju(W, z - u) + (tangent_G / rho if admm else 0.0)
            z = ball(x + u)
            u = x + u - z if admm else u
            yield manifold.proju(W, z), u

    witness: dict[str, Any] = {}
    holds = True
    reference = references()
    previous, _ = run(frame.T1, frame.T2, 0)
    excess = [max(_spectral(previous) - 1, 0.0)]
    for k in range(1, rounds + 1):
        A, tol = run(frame.T1, frame.T2, k)
        tangency = float(manifold.constraint(W, A).norm())
        expected, u = next(reference)
        deviation = float((A - expected).norm())
        frobenius = float(A.norm() - previous.norm())
        witness[f"round {k}: |L_W(A)|, |A - reference|, |A|_F - |A_prev|_F, tol"] = (tangency, deviation, frobenius, tol)
        holds &= tangency <= tol and deviation <= (k + 1) * tol and (admm or frobenius <= tol)
        if form is manifold.gram_form:  # gram_step's own wiring: its S, its rho, its masks
            stepped = _engine_frame(manifold, W, G, polish_rounds=k, polish_method=method)
            wired = float((frame.point_layout(stepped.direction()) - A).norm())
            witness[f"round {k}: |gram_step's direction - polish's|, tol"] = (wired, (k + 1) * tol)
            holds &= wired <= (k + 1) * tol
        excess.append(max(_spectral(A) - 1, 0.0))
        previous = A
    witness["excess over the unit ball, rounds 0.."] = excess
    A, tol = run(frame.T1, frame.T2, converge)
    tangency = float(manifold.constraint(W, A).norm())
    if admm:
        for _ in range(converge - rounds):  # the reference's multiplier after converge rounds
            _, u = next(reference)
        y = rho * u
        upper = float(torch.linalg.svdvals(tangent_G + y - manifold.proju(W, y)).sum())
        primal = float((G * A).sum()) / max(1.0, _spectral(A))
        witness[f"{converge} rounds: |L_W(A)|, tol, primal, dual bound"] = (tangency, tol, primal, upper)
        holds &= tangency <= tol and primal >= (1 - 1e-6) * upper
        claim = "runs ADMM from the dual iterate, ends tangent, closes the duality gap"
    else:
        holds &= all(b <= a + 1e-15 for a, b in zip(excess, excess[1:]))
        limit = max(_spectral(A) - 1, 0.0)
        witness[f"{converge} rounds: |L_W(A)|, excess, tol"] = (tangency, limit, tol)
        holds &= tangency <= tol and limit <= 1e-6
        U1, U2 = polish(form, mulD, frame.B0, frame.K, frame.T1, frame.T2, converge)
        c = 0.9 / _spectral(frame.tall_layout(A))
        fixed, tol = run(c * U1, c * U2, 1)
        moved = float((fixed - c * A).norm())
        witness["a tangent direction of norm 0.9: |polish(A) - A|, tol"] = (moved, tol)
        holds &= moved <= tol
        claim = "alternates the unit-ball and tangent projections, ends tangent, tends to the ball, fixes the intersection"
    return Certificate(f"{type(manifold).__name__} {m}x{n}: gram.polish ({method}) {claim} (float64)", holds, witness)


def certify_gram_weight_decay(manifold, W: torch.Tensor, G: torch.Tensor, shrink: float = 0.9,
                              lr: float = 0.1) -> Certificate:
    r"""The engine's step under decoupled weight decay, :func:`~geomuon.optimizers.gram.gram_step`
    with ``shrink`` $c \ne 1$ (the other engine certificates take $c = 1$), in **float64** from
    the float64 point $W$ with momentum $G$ (one Newton dual step, ``"eigh"``, no polish; a wide
    pair transposed, as ``ManifoldMuon`` runs it), is a step from the decayed point $W' = cW$:

    * its start is the tangent part of the momentum, $Z_0 = P_W(G)$ ($cW$ has $W$'s tangent
      space; read through the manifold's ``proju``);
    * its direction $\hat A = W'T_1 + Z_0T_2$ is tangent, $L_W(\hat A) = 0$;
    * its new point is the form's retraction at $W'$ along $-\eta\hat A$,
      :func:`~geomuon.manifolds.capabilities.gram_retraction` $(W', -\eta\hat A)$ (the formula
      :func:`certify_gram_form` and :func:`certify_gram_retract` certify), so the decay is
      neither dropped nor applied twice.

    Tolerances (float64, Higham's $\gamma_k \le k\varepsilon$ per product of inner dimension
    $k$, margin 8, as in :func:`certify_gram_polish`): $Z_0 = G - W'\Sigma_0$ is two products of
    magnitude $\|W\|_F^2\|G\|_F$, $\tau_0 = 8(m + n)\varepsilon\|W\|_F^2\|G\|_F$; the direction
    is read through $W^\top\hat A$, $\tau = 8(m + n)\varepsilon\|W\|_F(\|W'\|_F\|T_1\|_F +
    \|Z_0\|_F\|T_2\|_F)$; the two assemblies of $Y = W' - \eta\hat A$ differ by
    $\delta_Y = 8(m + n)\varepsilon(\|W'\|_F(1 + \eta\|T_1\|_F) + \eta\|Z_0\|_F\|T_2\|_F)$, which the
    retraction (a polar factor times $Y$'s column scale: Fréchet derivative at most
    $2\kappa(Y)$) and its own rounding ($\varepsilon\|Y\|_F$ per product) carry to
    $\tau_R = 2\kappa(Y)(\delta_Y + 8(m + n)\varepsilon\|Y\|_F)$. ``witness``: each residual with
    its tolerance."""
    from geomuon.manifolds.capabilities import gram_retraction

    frame = _engine_frame(manifold, W, G, shrink=shrink, lr=lr)
    m, n = W.shape[-2:]
    eps = torch.finfo(torch.float64).eps

    def norm(X: torch.Tensor) -> float:  # Frobenius, of a matrix or a multiplier of any shape
        return float(X.norm())

    A = frame.direction()
    Y = frame.Wt - lr * A
    tau0 = 8 * (m + n) * eps * norm(W) ** 2 * norm(G)
    tau = 8 * (m + n) * eps * norm(W) * (norm(frame.Wt) * norm(frame.T1) + norm(frame.Z0) * norm(frame.T2))
    delta_Y = 8 * (m + n) * eps * (norm(frame.Wt) * (1 + lr * norm(frame.T1)) + lr * norm(frame.Z0) * norm(frame.T2))
    tau_R = 2 * float(torch.linalg.cond(Y[0])) * (delta_Y + 8 * (m + n) * eps * norm(Y))
    witness = {
        "|Z0 - P_W(G)|, tol": (norm(frame.point_layout(frame.Z0) - manifold.proju(W, G)), tau0),
        "|L_W(A)|, tol": (norm(manifold.constraint(W, frame.point_layout(A))), tau),
        "|point - R_cW(-lr A)|, tol": (norm(frame.point - gram_retraction(manifold.gram_form, frame.Wt, -lr * A)), tau_R),
    }
    return Certificate(f"{type(manifold).__name__} {m}x{n}: gram_step with shrink {shrink} steps from cW: starts at P_W(G), "
                       "tangent direction, the form's retraction at cW (float64)",
                       all(r <= t for r, t in witness.values()), witness)


def certify_polynomial_dualizers(n: int = 6, seed: int = 0) -> Certificate:
    r"""The engine's eigendecomposition-free kernels (``GramSettings(dualizer="polar_express")``,
    ManifoldMuon's default off the CPU), in **float64** on the library's functions:

    * :func:`~geomuon.optimizers.gram.gram_msign` ($P = C^{-1}\operatorname{msign}(C)$,
      ``msign_steps`` $= 6$) on $Q = Z^\top Z$, $Z = U\operatorname{diag}(s)V^\top$ ($2n\times n$,
      $s$ log-spaced on $[10^{-2}, 1]$): every singular value of $ZP$ lies in the rigorous
      enclosure :func:`ns_output_range` of six ``POLAR_EXPRESS`` steps on the normalized
      spectrum $[s_{\min}, s_{\max}]/\|s\|_2$ (the step divides by its own safety factor), and
      ``value`` $= \operatorname{tr}(QP)$, ``frobenius2`` $= \|ZP\|_F^2$;
    * :func:`~geomuon.optimizers.gram.polynomial_unit_ball` on $\Gamma$ with eigenvalues
      $\lambda \in \{0, 0.3, 0.999, 1.001, 1.3\}$ and more: the singular values of
      $\hat A\phi(\Gamma)$, $\sqrt{\operatorname{eig}(\phi\Gamma\phi)}$, are $\min(1, \sqrt\lambda)$ to
      $3\cdot10^{-4}$ and at most $1 + 10^{-5}$ (its documented accuracy at
      :data:`~geomuon.optimizers.gram.UNIT_BALL_STEPS`);
    * :func:`~geomuon.optimizers.gram.polynomial_inverse_sqrt` on $N$ with eigenvalues in
      $[0.2, 3]$: $R^\top NR = I$ and $R = R^\top$ (the symmetric $N^{-1/2}$).

    Tolerances (float64, $\varepsilon = 2^{-52}$, margin 8 on Higham's $\gamma_n$): $ZP = ZC^{-1}X$
    with $ZC^{-1}$ orthonormal to $n\varepsilon\kappa(Z)$, so
    $\tau = 8n\varepsilon\kappa(Z)$ on the singular values and $\tau\|Q\|_F\|P\|_F$ on the
    traces; $\tau_N = 8n\varepsilon\kappa(N)\|N\|_2\|R\|_2^2$ on $R^\top NR - I$ (the series'
    truncation, $0.21\|X^\top X - I\|^7$, is far below). ``witness``: each residual with its
    tolerance."""
    from geomuon.manifolds.linalg import POLAR_EXPRESS
    from geomuon.optimizers.gram import gram_msign, polynomial_inverse_sqrt, polynomial_unit_ball

    generator = torch.Generator().manual_seed(seed)
    eps = torch.finfo(torch.float64).eps

    def frame(rows: int, cols: int) -> torch.Tensor:
        return torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=torch.float64))[0][:, :cols]

    witness: dict[str, Any] = {}
    s = torch.logspace(-2, 0, n, dtype=torch.float64)
    Z = (frame(2 * n, n) * s) @ frame(n, n).mT
    Q = (Z.mT @ Z).unsqueeze(0)
    steps = 6
    dual = gram_msign(Q, steps, torch.float64)
    P = dual.P[0]
    lo, hi = ns_output_range(POLAR_EXPRESS.coefficients, steps, lo=s.min().item() / s.norm().item(),
                             hi=s.max().item() / s.norm().item(), input_scale=POLAR_EXPRESS.input_scale)
    singular = torch.linalg.svdvals(Z @ P)
    tau = 8 * n * eps * float(torch.linalg.cond(Z))
    witness["gram_msign: singular values of ZP, enclosure, tol"] = (singular.tolist(), (float(lo), float(hi)), tau)
    outside = max(float(lo) - singular.min().item(), singular.max().item() - float(hi), 0.0)
    traces = (abs(float(dual.value[0] - torch.trace(Q[0] @ P))), abs(float(dual.frobenius2[0] - (Z @ P).square().sum())))
    tau_traces = tau * float(Q.norm() * P.norm())
    witness["gram_msign: |value - tr(QP)|, |frobenius2 - |ZP|^2|, tol"] = (*traces, tau_traces)
    holds = outside <= tau and max(traces) <= tau_traces

    lam = torch.tensor([0.0, 0.3, 0.7, 0.999, 1.001, 1.1, 1.3], dtype=torch.float64)
    V = frame(lam.numel(), lam.numel())
    gram = ((V * lam) @ V.mT).unsqueeze(0)
    phi = polynomial_unit_ball(gram)[0]
    clipped = torch.linalg.eigvalsh(phi @ gram[0] @ phi).clamp_min(0).sqrt()  # ascending, as lam
    deviation = float((clipped - lam.clamp_max(1.0).sqrt()).abs().max())
    witness["polynomial_unit_ball: max |sigma - min(1, sqrt(lam))|, max sigma"] = (deviation, clipped.max().item())
    holds &= deviation <= 3e-4 and clipped.max().item() <= 1 + 1e-5

    mu = torch.linspace(0.2, 3.0, n, dtype=torch.float64)
    V = frame(n, n)
    N = (V * mu) @ V.mT
    R = polynomial_inverse_sqrt(N.unsqueeze(0))[0]
    tau_N = 8 * n * eps * float(mu.max() / mu.min()) * mu.max().item() * float(torch.linalg.matrix_norm(R, 2)) ** 2
    residuals = (float((R.mT @ N @ R - torch.eye(n, dtype=torch.float64)).norm()), float((R - R.mT).norm()))
    witness["polynomial_inverse_sqrt: |R'NR - I|, |R - R'|, tol"] = (*residuals, tau_N)
    holds &= max(residuals) <= tau_N
    return Certificate("the Polar Express dualizer's kernels: gram_msign within its certified range, the unit-ball "
                       "factor clips, polynomial_inverse_sqrt is N^(-1/2) (float64)", holds, witness)


def _symmetric_basis(n: int, off_diagonal: bool) -> list[tuple[int, int, torch.Tensor]]:
    """$E_{ij} + E_{ji}$ ($i < j$) and, unless ``off_diagonal``, $E_{ii}$: the multipliers the
    Newton iteration visits, ``[n, n]`` float64."""
    out = []
    for i in range(n):
        for j in range(i + (1 if off_diagonal else 0), n):
            B = torch.zeros(n, n, dtype=torch.float64)
            B[i, j] = B[j, i] = 1.0
            out.append((i, j, B))
    return out


def certify_gram_newton_step(manifold, W: torch.Tensor, G: torch.Tensor, form=None) -> Certificate:
    r"""The engine's Newton dual step solves the frozen tangency equation, in **float64** on
    the library's functions, at the dual iterate $Z = Z_0 + WS$ of ``gram_step`` (one Newton
    dual step) from the float64 point $W$ and momentum $G$ (wide pairs transposed, as the
    engine runs them), with $P$ = ``eigen_dualizer``$(Z^\top Z)$ and $M = W^\top ZP$:

    * **the operator** (:meth:`~geomuon.manifolds.capabilities.GramForm.newton_operator`) is
      the change of the residual with $P$ frozen, $\mathcal A(\Lambda) = \mathcal C(DS(\Lambda)P)$
      with the form's ``constraint`` $\mathcal C$ and ``adjoint`` $S$, on every basis
      multiplier; it is symmetric, $\langle B_k, \mathcal A(B_l)\rangle = \langle B_l,
      \mathcal A(B_k)\rangle$, and positive semi-definite; ``newton_diagonal`` is its
      diagonal $\langle B_k, \mathcal A(B_k)\rangle/\langle B_k, B_k\rangle$ on the basis
      $B_k \in \{E_{ij} + E_{ji}, E_{ii}\}$ of the multipliers the iteration visits
      (symmetric; off-diagonal for DGram);
    * **frozen tangency** read through the manifold's public methods in the point's
      orientation: the increment $\delta$ satisfies
      $L_W\big((Z + L_W^*(\delta))\,P\big) = 0$, i.e. $\mathcal A(\delta) = -\mathcal C(M)$ (Su's fixed point, J. Su, kexue.fm/archives/11221):
      for ``newton_update`` itself where it takes the closed form (Stiefel, $D = I$:
      $EP + PE = -\mathcal C(M)$ for $E = S(\delta)$, solved in $Q$'s eigenbasis), and for
      ``newton_cg`` run for $N$ steps, $N$ the dimension of the multiplier space
      ($n(n+1)/2$ Stiefel, $n(n-1)/2$ DGram): conjugate gradients on a symmetric positive
      semi-definite operator with $H$ in its range terminate there in exact arithmetic;
    * **the documented accuracy of the default**: ``newton_update`` under a dualizer without
      eigenvectors (Stiefel) or with $D \ne I$ (DGram) is $-$``newton_cg`` with the form's
      ``newton_cg_steps``, and the $\mathcal A$-norm of the CG error
      $\|x_k - x_N\|_{\mathcal A}$ does not increase with $k$ (each iteration lowers it).

    Tolerance (float64, $\varepsilon = 2^{-52}$; Higham's $\gamma_k \le k\varepsilon$ per product of
    inner dimension $k$): the residual $L_W((Z + L_W^*\delta)P)$ is a product of inner
    dimensions $m$ and $n$ of factors of magnitudes $\|W\|_F$, $\|Z\|_F + \|L_W^*\delta\|_F$
    and $\|P\|_F$ (the conditioning: $\|P\|_F \approx \sigma_{\min}(Z)^{-1}$), and the
    eigendecomposition (closed form) or the $N$ CG steps (each a backward-stable
    $n\times n$ product; their loss of conjugacy is of the order of $\varepsilon\kappa(\mathcal A)$ relative
    to $\|\mathcal C(M)\|$, and $\kappa(\mathcal A) \le \kappa(P)\kappa(D)$) add at most the same
    order:

    $$\tau = 8(m + n)\,\varepsilon\,\|W\|_F\,\big(\|Z\|_F + \|L_W^*\delta\|_F\big)\,\|P\|_F\,\kappa,\qquad
    \kappa = \kappa(P)\,\kappa(D)$$

    ($\kappa = 1$ for the closed form); the operator identities take
    $\tau_{\mathcal A} = 8n\varepsilon\|D\|_F\|P\|_F$ per basis element, the $\mathcal A$-norm's
    monotonicity $\tau_{\mathcal A}\|x\|_F^2$. ``witness``: each residual with its tolerance.
    """
    from geomuon.optimizers.gram import eigen_dualizer, gram_msign, newton_cg, newton_update

    frame = _engine_frame(manifold, W, G)
    form = manifold.gram_form if form is None else form
    m, n = W.shape[-2:]
    N = frame.Wt.size(-1)
    eps = torch.finfo(torch.float64).eps
    Z = frame.Z
    Q = Z.mT @ Z
    dual = eigen_dualizer(Q, torch.diagonal(Q, dim1=-2, dim2=-1).sum(-1))
    P, D = dual.P, frame.D
    M = frame.Wt.mT @ Z @ P
    H = form.constraint(M)
    witness: dict[str, Any] = {}
    holds = True

    # The operator, its symmetry and its diagonal on the basis of visited multipliers.
    off = not form.constraint(torch.eye(N, dtype=torch.float64).unsqueeze(0)).abs().sum() > 0  # Off(2I) = 0: DGram
    basis = _symmetric_basis(N, off)
    tol_op = 8 * N * eps * float(D.norm() * P.norm())
    images = [form.newton_operator(D, B.unsqueeze(0), P)[0] for _, _, B in basis]
    defining = max(float((A - form.constraint(D @ form.adjoint(B.unsqueeze(0)) @ P)[0]).norm()) for (_, _, B), A in zip(basis, images))
    gram = torch.tensor([[float((Bk * A).sum()) for A in images] for _, _, Bk in basis], dtype=torch.float64)
    asymmetry = float((gram - gram.mT).abs().max())
    lowest = float(torch.linalg.eigvalsh(0.5 * (gram + gram.mT)).min())
    diagonal = form.newton_diagonal(D, P)[0]
    diag_gap = max(abs(float(diagonal[i, j]) - float((B * A).sum() / B.square().sum()))
                   for (i, j, B), A in zip(basis, images))
    witness["A(lam) - C(D S(lam) P), asymmetry, min eigenvalue, diagonal gap, tol"] = (defining, asymmetry, lowest, diag_gap, tol_op)
    holds &= defining <= tol_op and asymmetry <= tol_op and lowest >= -tol_op and diag_gap <= tol_op

    def frozen_residual(delta, kappa):
        shift = frame.tall_layout(manifold.constraint_adjoint(W, delta[0]))
        residual = manifold.constraint(W, frame.point_layout((Z + shift) @ P))
        scale = float(frame.Wt.norm() * (Z.norm() + shift.norm()) * P.norm()) * kappa
        return float(residual.norm()), 8 * (m + n) * eps * scale

    kappa = float(torch.linalg.cond(P[0]) * torch.linalg.cond(D[0]))
    steps = len(basis)
    if form.has_newton:
        witness["closed form: |L_W((Z + L*d) P)|, tol"] = closed = frozen_residual(newton_update(form, D, dual, M, 1.0, torch.float64), 1.0)
        holds &= closed[0] <= closed[1]
    if form.newton_cg_steps:
        full = newton_cg(form, D, P, H, steps)
        witness[f"CG, {steps} steps: |L_W((Z + L*d) P)|, tol"] = exact_solve = frozen_residual(-full, kappa)
        holds &= exact_solve[0] <= exact_solve[1]
        without_eigenvectors = gram_msign(Q, 6, torch.float64) if form.has_newton else dual
        dispatched = newton_update(form, D, without_eigenvectors, M, 1.0, torch.float64)
        expected = -newton_cg(form, D, without_eigenvectors.P, H, form.newton_cg_steps)
        witness["newton_update = -newton_cg(newton_cg_steps)"] = gap = float((dispatched - expected).norm())
        holds &= gap <= 8 * N * eps * float(expected.norm())
        energies = []
        for k in range(steps + 1):
            error = newton_cg(form, D, P, H, k) - full
            energies.append(float((error * form.newton_operator(D, error, P)).sum()))
        witness["A-norm^2 of the CG error, steps 0.."] = energies
        holds &= all(b <= a + tol_op * float(full.square().sum()) for a, b in zip(energies, energies[1:]))
        holds &= energies[form.newton_cg_steps] <= energies[0]
    return Certificate(f"{type(manifold).__name__} {m}x{n}: the Newton dual step solves the frozen tangency equation "
                       "L_W((Z + L*d) P) = 0 (float64)", holds, witness)


def certify_gram_jacobi_step(manifold, W: torch.Tensor, G: torch.Tensor, form=None, alpha: float = 0.5) -> Certificate:
    r"""The engine's :func:`~geomuon.optimizers.gram.jacobi_update` is its documented step
    $\delta = -\alpha\,\sigma\,L_W(A)\oslash\operatorname{diag}(L_WL_W^*)$, $A = ZP$,
    $\sigma = \langle Z, A\rangle/\langle A, A\rangle$, in **float64** at the dual iterate
    of ``gram_step`` (as :func:`certify_gram_newton_step`), every ingredient read through
    the manifold's public methods in the point's orientation: $L_W$ = ``constraint``,
    $\operatorname{diag}(L_WL_W^*)$ = ``constraint_gram_diag`` (entries where it is
    positive), $\sigma$ from the assembled $m\times n$ matrices $Z$ and $A$ (not from the
    dualizer's $\operatorname{tr}(QP)$ and $\operatorname{tr}(PQP)$ the engine reads). And it is
    homogeneous of degree one in the momentum: $G \to 2G$ doubles $\delta$ (the multiplier
    scales with $G$, the reason for $\sigma$).

    Tolerance: $\tau = 8(m + n)\,\varepsilon\,|\sigma|\,\|W\|_F\|Z\|_F\|P\|_F\,\kappa(P)$ on
    $\|\delta\odot g + \alpha\sigma L_W(A)\|_F$ (the products of inner dimensions $m$, $n$ and the
    eigendecomposition of $Q$, conditioned by $P$), and $8(m + n)\varepsilon\kappa(P)\|\delta\|_F$ on the
    homogeneity. ``witness``: the residuals and tolerances."""
    from geomuon.optimizers.gram import eigen_dualizer, jacobi_update

    form = manifold.gram_form if form is None else form
    m, n = W.shape[-2:]
    eps = torch.finfo(torch.float64).eps

    def step(G):
        frame = _engine_frame(manifold, W, G)
        Z = frame.Z
        Q = Z.mT @ Z
        dual = eigen_dualizer(Q, torch.diagonal(Q, dim1=-2, dim2=-1).sum(-1))
        M = frame.Wt.mT @ Z @ dual.P
        return frame, Z, dual.P, jacobi_update(form, frame.D, dual, M, alpha)

    frame, Z, P, delta = step(G)
    A = frame.point_layout(Z @ P)
    Zp = frame.point_layout(Z)
    sigma = float((Zp * A).sum() / A.square().sum())
    g = manifold.constraint_gram_diag(W)
    L = manifold.constraint(W, A)
    positive = g > 0
    residual = float(torch.where(positive, delta[0] * g + alpha * sigma * L, torch.zeros_like(L)).norm())
    kappa = float(torch.linalg.cond(P[0]))
    tol = 8 * (m + n) * eps * abs(sigma) * float(frame.Wt.norm() * Z.norm() * P.norm()) * kappa
    doubled = step(2 * G)[3]
    homogeneity = float((doubled - 2 * delta).norm())
    tol_h = 8 * (m + n) * eps * kappa * float(delta.norm())
    return Certificate(f"{type(manifold).__name__} {m}x{n}: jacobi_update = -alpha sigma L_W(ZP) / diag(L L*), "
                       "sigma = <Z, ZP>/<ZP, ZP> (float64)",
                       residual <= tol and homogeneity <= tol_h and sigma > 0,
                       {"|d * g + alpha sigma L_W(A)|, tol": (residual, tol), "sigma": sigma,
                        "|d(2G) - 2 d(G)|, tol": (homogeneity, tol_h)})
