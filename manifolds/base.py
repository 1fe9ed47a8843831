r"""The base class of every matrix manifold, and the geometry it derives from a constraint.

A matrix manifold $M \subset \mathbb{R}^{m\times n}$ is described to the rest of the
library by its **tangent constraint**: a linear map $L_x$ with
$T_xM = \ker L_x$, and its adjoint $L_x^*$ (for the Frobenius inner products). From these
two maps alone :class:`MatrixManifold` derives

* the orthogonal tangent projection $P_x(u) = u - L_x^*\Lambda$ with
  $L_xL_x^*\Lambda = L_xu$, solved by Jacobi-preconditioned conjugate gradients
  (:meth:`MatrixManifold.gram_solve`);
* given a defining map $F$ with $M = \{F = 0\}$ and $dF_x = L_x$, a retraction (and
  ``projx``) by Gauss–Newton projection along normal spaces,
  $y \leftarrow y - L_y^*\big((L_yL_y^*)^{-1}F(y)\big)$ from $y = x + u$;
* the membership checks geoopt asks for.

Built-in manifolds override these with closed forms; a user's manifold can stop at
``constraint``, ``constraint_adjoint`` and ``defining_map`` (without the defining map, or its
own ``projx`` and ``retr``, it has tangent projections but no points or steps).

The Riemannian metric is the Euclidean (Frobenius) one inherited from
$\mathbb{R}^{m\times n}$, so ``egrad2rgrad`` is the tangent projection.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

with warnings.catch_warnings():
    # geoopt 0.5.1 decorates helpers with torch.jit.script, deprecated by current torch;
    # silence exactly that message at import time (see the README's compatibility notes).
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning
    )
    import geoopt
from geoopt.utils import size2shape

from .linalg import check_matrix, check_shape_of, fixed_start, fp32_or_fp64, largest_entry, power_of_two_at_most

__all__ = [
    "MatrixManifold",
    "ManifoldSpec",
    "matrix_method",
    "conjugate_gradients",
    "broadcast_pair",
]


def matrix_method(*matrix_args: str, result: str = "matrix", finite: bool = False):
    """Decorate a manifold method taking a point ``x`` first.

    The wrapper validates ``x`` (:meth:`MatrixManifold.validate_point`) and the named
    matrix arguments (same trailing shape as ``x``); with ``finite=True`` (``projx``: it maps
    any finite matrix to the manifold) a NaN or infinite entry of ``x`` raises ``ValueError``
    (a host read: such methods are not called inside an optimizer step; the undecorated
    path stays as ``method.without_finite_check``). On a manifold with
    ``transposes_wide = True`` a wide point ($m < n$) is handled by the transposed
    geometry: ``x`` and the named matrix arguments are transposed on the way in, and the
    result is transposed back when ``result="matrix"`` (``"multiplier"`` and ``"check"``
    results pass through).
    """
    if result not in ("matrix", "multiplier", "check"):
        raise ValueError(f"matrix_method: unknown result kind {result!r}")

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, x, *args, **kwargs):
            self.validate_point(x, "x")
            if finite and isinstance(x, torch.Tensor) and not bool(torch.isfinite(x).all()):  # (symbolic arrays: exact)
                # (NaN had come back silently on Oblique, LPRO and the router; Stiefel raised
                # LAPACK's error, naming nothing)
                raise ValueError(f"{self.name}: x given to {method.__name__} has a NaN or infinite entry; "
                                 f"{method.__name__} maps finite matrices onto the manifold")
            return unchecked(self, x, *args, **kwargs)

        def unchecked(self, x, *args, **kwargs):  # the method without the finite check (no host read)
            flip = self.transposes_wide and x.size(-2) < x.size(-1)
            args = list(args)
            for position, name in enumerate(matrix_args):
                in_args = position < len(args)
                value = args[position] if in_args else kwargs.get(name)
                if value is None:
                    continue
                self.validate_vector(x, value, name)
                if flip and in_args:
                    args[position] = value.mT
                elif flip:
                    kwargs[name] = value.mT
            if not flip:
                return method(self, x, *args, **kwargs)
            out = method(self, x.mT, *args, **kwargs)
            return out.mT if result == "matrix" else out

        wrapper.without_finite_check = unchecked
        return wrapper

    return decorate


#: A manifold as plain data: ``{"name": registry name, "args": {constructor argument: value}}``
#: (values are ``None``, bools, numbers, strings, tensors, ``torch.dtype`` and lists/dicts of
#: these), what ``torch.load(..., weights_only=True)`` can read back.
ManifoldSpec = dict


class _ManifoldType(type(geoopt.Manifold)):
    """The metaclass of :class:`MatrixManifold`: a constructor call hands the manifold a
    private copy of each tensor argument and fixes the arguments once ``__init__`` returns
    (see :attr:`MatrixManifold.identity`)."""

    def __call__(cls, *args, **kwargs):
        # the caller's own tensor stays the caller's: an in-place change of it (B.mul_(2)) had
        # changed the manifold's geometry and spec() while its cached identity kept the old value.
        # Defaults included: a tensor default is one object, shared by every instance built with it
        try:
            bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
        except TypeError:  # refused by __init__ itself, with its own message
            return super().__call__(*args, **kwargs)
        bound.apply_defaults()
        for key, value in bound.arguments.items():
            bound.arguments[key] = _private_copy(value)
        manifold = super().__call__(*bound.args[1:], **bound.kwargs)
        object.__setattr__(manifold, "_arguments_fixed", True)
        return manifold


#: Probes of :meth:`MatrixManifold._terms_scale`.
TERM_PROBES = 4


class MatrixManifold(geoopt.Manifold, metaclass=_ManifoldType):
    r"""A manifold of matrices $M \subset \mathbb{R}^{m\times n}$, batched over ``[..., m, n]``.

    Subclasses provide the tangent constraint:

    * ``constraint(x, u)``: $L_x(u)$, zero iff $u \in T_xM$; the output is the
      *multiplier* shape (e.g. ``[..., n, n]``, ``[..., n]``, ``[..., 0]``).
    * ``constraint_adjoint(x, lam)``: $L_x^*(\Lambda)$, ``[..., m, n]``; it must be the
      true adjoint, $\langle L_xu, \Lambda\rangle = \langle u, L_x^*\Lambda\rangle$ for
      every $\Lambda$ of the multiplier shape.
    * ``constraint_gram_diag(x)`` (optional): the diagonal of $L_xL_x^*$ on the range of
      $L_x$ when that operator is diagonal there (Jacobi preconditioner of
      :meth:`gram_solve`); entries where the multiplier is identically zero may hold any
      positive number. ``None`` when not diagonal.
    * ``defining_map(x)`` (optional): $F(x)$ with $M = \{F = 0\}$ and $dF_x = L_x$; gives
      ``projx``, ``retr`` and the point check for free.

    Everything else has a generic implementation here, overridden by closed forms where
    they exist. Metric: Euclidean (Frobenius), $\langle u, v\rangle = \operatorname{tr}(u^\top v)$.
    ``expmap`` is the retraction (no geodesics are used); ``transp`` projects the vector
    onto the new tangent space.

    **Registry, spec and identity.** Defining a subclass registers it under its
    :attr:`name` (the class attribute when the class body sets one, else the class name),
    wherever it is defined, a user's module included; a second class claiming a registered
    name is a ``TypeError`` (re-running the same class definition, e.g. a reloaded module,
    replaces it). Every instance remembers its constructor arguments, so

    * :meth:`spec` is the instance as plain data, ``{"name": ..., "args": {...}}`` (defaults
      filled in; tensors allowed), which ``torch.save`` writes and
      ``torch.load(weights_only=True)`` reads;
    * :meth:`from_spec` rebuilds an equal instance from it, :meth:`by_name` returns a
      registered class, and :meth:`resolve` accepts an instance, a name or a spec (what a
      param group's ``manifold`` key may hold);
    * :attr:`identity` is hashable and equal for two instances exactly when they are
      interchangeable: same class and same constructor arguments (tensors compared by
      dtype, shape and value). Optimizers batch matrices by it.

    A manifold is a value, as its ``==`` and hash say: an attribute named like a constructor
    argument (``LPRO(1.0).radius``) cannot be set or deleted once the constructor has
    returned (``AttributeError``: build a new manifold), and a tensor argument is the
    manifold's private copy (the caller may change theirs in place). An in-place change of
    that copy itself (``manifold.weights.mul_(2)``) moves its version counter and
    :attr:`identity` follows it.

    A subclass whose constructor takes arguments stores whatever it likes; the spec is
    read from the arguments as passed, not from attributes, so nothing else is needed.
    Loading a spec whose class lives in a user's module needs that module imported first
    (a checkpoint never imports code).

    Attributes:
        name: the registry name (and the prefix of error messages).
        aliases: further names :meth:`by_name` accepts (lowercase, e.g. ``"stiefel"``
            works for every class by its lowercased name anyway).
        reversible: geoopt's flag: whether a step can be walked back, i.e. with
            ``y, v = retr_transp(x, u, u)``, ``retr_transp(y, -v, v)`` returns ``(x, u)``
            (geoopt's samplers refuse a manifold without it). ``False`` by default; a flat
            manifold (Euclidean, the router's subspace) sets ``True``.
        transposes_wide: when ``True`` a wide point ($m < n$) uses the transposed
            geometry (the manifold's docstring says which side is then constrained).
        newton_steps: most Gauss–Newton iterations of the generic projection (60: from afar a
            step of a quadratic constraint about halves the distance, so a point at $10^{\pm 8}$
            times the manifold's scale needs about 30 before the quadratic phase; 30 had
            stopped a generalized Stiefel ``projx`` from $10^4$ half way, 0.35 off $M$).
    """

    ndim = 2
    name = "MatrixManifold"
    aliases: tuple[str, ...] = ()
    reversible = False
    transposes_wide = False
    newton_steps = 60

    #: name → class of every subclass defined so far (see :meth:`by_name`).
    _registry: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__
        for key in (cls.name, *cls.__dict__.get("aliases", ())):
            key = key.lower()
            known = MatrixManifold._registry.get(key)
            if known is not None and _class_path(known) != _class_path(cls):
                raise TypeError(
                    f"manifold name {key!r} of {_class_path(cls)} is already registered by "
                    f"{_class_path(known)}; give the new class its own `name = \"...\"` class attribute"
                )
            MatrixManifold._registry[key] = cls

    def __init__(self) -> None:
        # geoopt.Manifold.__init__ swallows any keyword; a misspelt argument is an error here.
        super().__init__()

    def __new__(cls, *args, **kwargs):
        # Remember the constructor arguments (bound by name, defaults filled in) for spec().
        self = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(self, *args, **kwargs)
        except TypeError:
            # Unpickling and copy.deepcopy call __new__ without arguments and then restore
            # __dict__ (the arguments recorded at construction included); a real call with
            # bad arguments is refused by __init__ itself.
            return self
        bound.apply_defaults()
        arguments = {}
        for parameter, (key, value) in zip(bound.signature.parameters.values(), bound.arguments.items()):
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)  # **kwargs are stored by their own names
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL or value:
                arguments[key] = value
        arguments.pop(next(iter(bound.arguments)))  # self
        object.__setattr__(self, "_spec_args", arguments)
        return self

    # ---------------------------------------------------------------- spec and identity
    @classmethod
    def by_name(cls, name: str) -> type:
        """The registered manifold class called ``name`` (case-insensitive, or an alias).

        Raises:
            ValueError: naming the known manifolds when ``name`` is not registered.
        """
        if not isinstance(name, str):
            raise TypeError(f"manifold name must be a string, got {type(name).__name__}")
        found = MatrixManifold._registry.get(name.lower())
        if found is None:
            raise ValueError(
                f"unknown manifold {name!r}; registered: {sorted(MatrixManifold.registered())}. "
                "A manifold defined in your own module registers itself when that module is imported"
            )
        return found

    @classmethod
    def registered(cls) -> dict[str, type]:
        """``{name: class}`` of every registered manifold (aliases left out)."""
        return {c.name: c for c in MatrixManifold._registry.values()}

    def spec(self) -> ManifoldSpec:
        """This manifold as plain data: ``{"name": self.name, "args": {argument: value}}``.

        ``args`` holds every constructor argument (defaults included), tensors detached.
        """
        args = getattr(self, "_spec_args", {})
        return {"name": self.name, "args": {key: _plain(value, f"{self.name}({key}=...)")
                                            for key, value in args.items()}}

    @classmethod
    def from_spec(cls, spec: Mapping) -> MatrixManifold:
        """The manifold a :meth:`spec` describes (a new instance, equal in :attr:`identity`).

        Raises:
            ValueError: the spec is not ``{"name": str, "args": dict}``, names an
                unregistered manifold, or gives arguments its constructor does not take or
                lacks one it requires.
        """
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise ValueError(f"a manifold spec is {{'name': str, 'args': dict}}, got {spec!r}")
        unknown = set(spec) - {"name", "args"}
        if unknown:
            raise ValueError(f"manifold spec {spec['name']!r}: unknown keys {sorted(unknown)}")
        manifold_cls = MatrixManifold.by_name(spec["name"])
        args = spec.get("args")
        if args is not None and not isinstance(args, Mapping):
            # (dict() of a list had raised "cannot convert dictionary update sequence", naming nothing)
            raise ValueError(f"manifold spec {spec['name']!r}: 'args' must be a dict of constructor arguments "
                             f"by name, got {type(args).__name__} {args!r}")
        args = dict(args or {})
        positional, keywords = [], {}
        signature = inspect.signature(manifold_cls.__init__)
        parameters = list(signature.parameters.values())[1:]
        for parameter in parameters:
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                keywords.update(args)  # the remaining names go to **kwargs
                args = {}
            if parameter.name not in args:
                continue
            value = args.pop(parameter.name)
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            else:
                keywords[parameter.name] = value
        if args:
            raise ValueError(
                f"manifold spec {spec['name']!r}: {manifold_cls.__name__}() takes no argument(s) "
                f"{sorted(args)}"
            )
        try:  # a required argument the spec lacks (the constructor had raised a bare TypeError)
            signature.bind(None, *positional, **keywords)
        except TypeError as err:
            raise ValueError(f"manifold spec {spec['name']!r}: {manifold_cls.__name__}(): {err}; give it in "
                             "'args'") from None
        return manifold_cls(*positional, **keywords)

    @classmethod
    def resolve(cls, manifold: Any, where: str = "manifold") -> MatrixManifold:
        """A manifold instance from an instance, a registered name or a spec dict.

        Raises:
            ValueError: naming ``where`` and what was given.
        """
        if isinstance(manifold, MatrixManifold):
            return manifold
        try:
            if isinstance(manifold, str):
                return MatrixManifold.by_name(manifold)()
            if isinstance(manifold, Mapping):
                return MatrixManifold.from_spec(manifold)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None
        raise ValueError(
            f"{where}: expected a MatrixManifold, a registered name or a spec dict, got "
            f"{type(manifold).__name__}"
        )

    @property
    def identity(self) -> tuple:
        """Hashable; equal exactly when two manifolds are interchangeable (same class, same
        constructor arguments, tensors compared by value). Computed once, and again only
        after a tensor argument changed in place (its ``_version`` counter moved): a stale
        identity had let two geometries share an optimizer's batch."""
        versions = tuple(_tensor_versions(getattr(self, "_spec_args", {})))
        cached = self.__dict__.get("_identity")
        if cached is None or cached[0] != versions:
            cached = (versions, (type(self), _frozen(self.spec()["args"])))
            object.__setattr__(self, "_identity", cached)
        return cached[1]

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse_fixed_argument(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_fixed_argument(name)
        super().__delattr__(name)

    def _refuse_fixed_argument(self, name: str) -> None:
        """``AttributeError`` when ``name`` is a constructor argument and construction is over
        (``m.radius = 2.0`` had left ``m == LPRO(1.0)`` and ``spec()`` saying 1.0)."""
        arguments = self.__dict__.get("_spec_args", {})
        if not self.__dict__.get("_arguments_fixed") or name not in arguments:
            return
        call = ", ".join(f"{key}={'...' if isinstance(value, torch.Tensor) else repr(value)}"
                         for key, value in arguments.items())
        raise AttributeError(
            f"{type(self).__name__}.{name} is fixed after construction: the constructor arguments define "
            f"the manifold (its spec(), == and hash, by which optimizers batch parameters of one "
            f"geometry); build a new manifold with the {name} you want (this one is "
            f"{type(self).__name__}({call}))"
        )

    # Equality is interchangeability: geoopt.ManifoldParameter(point, manifold=m) compares
    # the point's manifold with ``m`` by ``!=``, and Stiefel() == Stiefel() there.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatrixManifold):
            return NotImplemented
        return self.identity == other.identity

    def __hash__(self) -> int:
        return hash(self.identity)

    # ---------------------------------------------------------------- validation
    def shape_problem(self, m: int, n: int) -> str | None:
        """Why an ``m``×``n`` matrix cannot be a point of this manifold, or ``None``."""
        if m == 0 or n == 0:
            return f"the matrix is empty ({m}x{n})"
        return None

    def validate_point(self, x: torch.Tensor, name: str = "x") -> None:
        """Raise ``TypeError``/``ValueError`` naming what is wrong with a point ``x``."""
        check_matrix(x, f"{self.name}: {name}", vector_hint=(
            "vectors (biases, gains) belong to an unconstrained (AdamW) group, not to a "
            "matrix manifold"))
        problem = self.shape_problem(x.size(-2), x.size(-1))
        if problem is not None:
            raise ValueError(f"{self.name}: {name} of shape {tuple(x.shape)} is invalid: {problem}")

    def validate_vector(self, x: torch.Tensor, u: torch.Tensor, name: str = "u") -> None:
        """Raise if ``u`` is not a matrix of ``x``'s shape ``[..., m, n]`` (batches broadcast)."""
        if not torch.overrides.is_tensor_like(u):
            raise TypeError(f"{self.name}: {name} must be a torch.Tensor, got {type(u).__name__}")
        if u.dim() < 2 or u.shape[-2:] != x.shape[-2:]:
            raise ValueError(
                f"{self.name}: {name} of shape {tuple(u.shape)} does not match the point's "
                f"matrix shape {tuple(x.shape[-2:])}; tangent vectors are [..., m, n] like x"
            )
        try:
            torch.broadcast_shapes(x.shape[:-2], u.shape[:-2])
        except RuntimeError:
            raise ValueError(
                f"{self.name}: batch dimensions of {name} {tuple(u.shape[:-2])} and x "
                f"{tuple(x.shape[:-2])} do not broadcast"
            ) from None

    def _check_shape(self, shape, name):
        if len(shape) < 2:
            return False, f"{self.name}: {name} needs shape [..., m, n], got {tuple(shape)}"
        if any(side < 0 for side in shape):
            return False, f"{self.name}: {name} {tuple(shape)} has a negative dimension; sizes are counts"
        problem = self.shape_problem(shape[-2], shape[-1])
        if problem is not None:
            return False, f"{self.name}: {name} of shape {tuple(shape)}: {problem}"
        return True, None

    # ---------------------------------------------------------------- the constraint
    def constraint(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """$L_x(u)$: zero iff ``u`` is tangent at ``x`` (subclasses define it)."""
        raise NotImplementedError(
            f"{type(self).__name__} must define constraint(x, u) and constraint_adjoint(x, lam)"
        )

    def constraint_adjoint(self, x: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        r"""$L_x^*(\Lambda)$, ``[..., m, n]`` (subclasses define it)."""
        raise NotImplementedError(
            f"{type(self).__name__} must define constraint(x, u) and constraint_adjoint(x, lam)"
        )

    def constraint_gram_diag(self, x: torch.Tensor) -> torch.Tensor | None:
        """Diagonal of $L_xL_x^*$ where it is diagonal, else ``None`` (the default)."""
        return None

    # ---------------------------------------------------------------- capabilities (optional)
    #: The $n\times n$ (Gram-space) form of the tangent constraint and of a retraction, a
    #: :class:`~geomuon.manifolds.capabilities.GramForm`, or ``None`` (the default: the
    #: steepest-descent engine then takes its general path). Declared by Stiefel, DGram and
    #: Oblique; see :mod:`geomuon.manifolds.capabilities`.
    gram_form: ClassVar[Any] = None

    def dualizer_keeps_tangent(self, x: torch.Tensor, norm: str) -> bool:
        """Whether the dualizer of ``norm`` (a name of :data:`geomuon.optimizers.NORMS`) maps
        tangent vectors at ``x`` to tangent vectors, so that $\\Phi(P_xG)$ is the steepest
        direction with no dual step (a closed form; default ``False``)."""
        return False

    def defining_map(self, x: torch.Tensor) -> torch.Tensor:
        """$F(x)$ with $M = \\{F = 0\\}$ and $dF_x = L_x$ (optional)."""
        raise NotImplementedError(f"{type(self).__name__} defines no defining_map(x)")

    @property
    def has_defining_map(self) -> bool:
        """Whether the subclass defines :meth:`defining_map`."""
        return type(self).defining_map is not MatrixManifold.defining_map

    def _check_defining_map(self, x: torch.Tensor) -> None:
        r"""Refuse (``ValueError`` naming it) a :meth:`defining_map` whose $F(x)$ does not have the
        multiplier shape of ``constraint`` ($dF_x = L_x$: one shape), on ``meta`` tensors (shapes
        only; a map that cannot run there is not checked). A sum over the wrong axis had crashed
        the Gauss–Newton solve with a bare broadcasting error, and made ``points_on_manifold``
        call a point off its manifold."""
        try:
            given = self.defining_map(torch.empty_like(x, device="meta"))
        except (RuntimeError, NotImplementedError, TypeError):
            return
        check_shape_of(type(self).__name__, "defining_map(x)", given, lambda y: self.constraint(y, y), x,
                       what_to_do="return F(x) in the shape constraint(x, u) returns (its derivative)")

    @matrix_method(result="multiplier")
    def gram_solve(self, x: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        r"""Solve $L_xL_x^*\Lambda = \text{rhs}$ for the multiplier $\Lambda$.

        Jacobi-preconditioned conjugate gradients (the preconditioner is
        ``constraint_gram_diag`` when given, so a diagonal $L_xL_x^*$ is solved in one
        iteration), batched over the leading dimensions of ``x``; see
        :func:`conjugate_gradients` for the stopping rule. $L_xL_x^*$ may be singular (a
        symmetric multiplier stored as a full matrix): the right-hand side lies in its
        range, where CG started from zero stays up to round-off. Each iteration reads its
        stopping flag back to the host (a device synchronization per iteration, in an optimizer
        step too); a ``constraint_gram_diag`` that makes $L_xL_x^*$ diagonal stops it after one.

        Args:
            x: ``[..., m, n]`` point; its batch dimensions are those of ``rhs``.
            rhs: multiplier-shaped ``[..., *multiplier]``, usually $L_x(u)$.

        Returns:
            $\Lambda$ of ``rhs``'s shape, computed in ``rhs.dtype``.
        """
        batch = rhs.shape[: x.dim() - 2]
        if rhs.numel() == 0:  # an empty multiplier or an empty batch: nothing to solve (b.reshape(0, -1) is ambiguous)
            return rhs.clone()
        x = x.expand(*batch, *x.shape[-2:])
        b = rhs.reshape(*batch, -1)
        diag = self.constraint_gram_diag(x)
        diag = torch.ones_like(b) if diag is None else diag.expand_as(rhs).reshape(b.shape)
        # Entries where the multiplier is structurally zero may carry a zero diagonal.
        diag = torch.where(diag > 0, diag, torch.ones_like(diag))

        def gram(v):
            lam = v.reshape(rhs.shape)
            return self.constraint(x, self._normal_of(x, lam)).reshape(b.shape)

        return conjugate_gradients(gram, b, diag).reshape(rhs.shape)

    # ---------------------------------------------------------------- geoopt surface
    @matrix_method("u")
    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Orthogonal projection onto $T_xM$: $P_x(u) = u - L_x^*\Lambda$ with
        $L_xL_x^*\Lambda = L_xu$.

        Generic (conjugate gradients, :meth:`gram_solve`); built-in manifolds override it
        with their closed form. Computed in ``u``'s dtype (``x`` is cast to it), as every
        built-in ``proju`` is.
        """
        x, u = broadcast_pair(x.to(u.dtype), u)
        return u - self._normal_component(x, u)

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Riemannian gradient of the Euclidean metric: the tangent projection of ``u``."""
        return self.proju(x, u)

    @matrix_method(finite=True)
    def projx(self, x: torch.Tensor) -> torch.Tensor:
        """A point of $M$ near ``x``: generic Gauss–Newton projection (needs ``defining_map``).

        Computed in float32 (float64 for float64 input), returned in ``x.dtype``.
        """
        return self._newton_projection(x).to(x.dtype)

    @matrix_method("u")
    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Retraction $R_x(u)$: Gauss–Newton projection of $x + u$ onto $M$ along normal spaces.

        $y_0 = x + u$, $y_{k+1} = y_k - L_{y_k}^*\big((L_{y_k}L_{y_k}^*)^{-1}F(y_k)\big)$
        until the step is negligible (quadratic convergence; at most ``newton_steps``).
        Because the correction is normal up to $O(\|u\|)$ and of size $O(\|u\|^2)$, this is
        a second-order retraction. Needs ``defining_map``; computed in float32 (float64
        for float64 input), returned in ``x.dtype``. Each iteration reads its stopping test
        back to the host (a device synchronization per iteration, in an optimizer step too):
        override ``retr`` with a closed form where one exists.
        """
        x, u = broadcast_pair(x, u)
        return self._newton_projection(x + u).to(x.dtype)

    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Falls back to :meth:`retr` (no closed-form geodesics are used)."""
        return self.retr(x, u)

    def dist(self, x: torch.Tensor, y: torch.Tensor, *, keepdim=False) -> torch.Tensor:
        r"""The geodesic distance $d(x, y) = \|\log_x(y)\|_F$ per matrix (``[...]``,
        ``[..., 1, 1]`` with ``keepdim``; ``logmap``'s dtype): the length of the geodesic
        $t \mapsto \exp_x(t\log_x y)$ in the Frobenius metric.

        A manifold with a ``logmap`` (a flat one: Euclidean, the router's subspace, LPRO
        without a radius) has it from there; one without (its expmap is the retraction) raises
        ``NotImplementedError`` naming it and the chordal distance to use instead (geoopt's
        base raised a bare one).
        """
        try:
            log = self.logmap(x, y)
        except NotImplementedError as no_logmap:
            raise NotImplementedError(
                f"{self.name} has no geodesic distance (its expmap is the retraction, not a geodesic); "
                "use the chordal distance (x - y).norm(dim=(-2, -1)) of the ambient space"
            ) from no_logmap
        return log.norm(dim=(-2, -1), keepdim=keepdim)

    def logmap(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The inverse of the exponential map: not offered by a manifold without geodesics
        (``NotImplementedError`` naming it and what to use instead). A flat manifold overrides it."""
        raise NotImplementedError(
            f"{self.name} has no logmap (its expmap is the retraction, whose inverse is not computed); "
            "proju(x, y - x) is a tangent vector at x pointing to y to first order"
        )

    @matrix_method("u", "v", result="check")
    def inner(self, x, u, v=None, *, keepdim=False):
        r"""Euclidean metric $\langle u, v\rangle = \sum_{ij} u_{ij}v_{ij}$ (last two dims)."""
        product = u * u if v is None else u * v
        product = product.expand(*torch.broadcast_shapes(x.shape, product.shape))
        return product.sum(dim=(-2, -1), keepdim=keepdim)

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport by projection: $P_y(v)$."""
        self.validate_vector(x, y, "y")
        self.validate_vector(y, v, "v")  # before proju, whose message would call it u
        return self.proju(y, v)

    def random(self, *size, dtype=None, device=None, generator=None) -> geoopt.ManifoldTensor:
        """A random point: ``projx`` of a standard Gaussian matrix of shape ``size``.

        Args:
            size: ``(..., m, n)``.
            dtype: of the result (default ``torch.get_default_dtype()``).
            device: of the result (default: the default device).
            generator: a ``torch.Generator`` on ``device`` for reproducible draws.

        Returns:
            A ``geoopt.ManifoldTensor`` on this manifold (geoopt's convention: its
            ``.manifold`` is ``self``), so ``geoopt.ManifoldParameter(manifold.random(...))``
            carries the manifold. ``torch.nn.Parameter`` refuses a ``ManifoldTensor``
            (its ``detach()`` returns a plain tensor); give it ``point.data``.

        Raises:
            ValueError: ``size`` is not ``(..., m, n)`` with a valid matrix shape.
        """
        shape = size2shape(*size)
        ok, reason = self._check_shape(shape, "size")
        if not ok:
            raise ValueError(reason)
        gaussian = torch.randn(shape, dtype=dtype, device=device, generator=generator)
        return geoopt.ManifoldTensor(self.projx(gaussian), manifold=self)

    #: geoopt's name for its cheap sampler; the same draw as :meth:`random`.
    random_naive = random

    def origin(self, *size, dtype=None, device=None, seed: int = 42) -> geoopt.ManifoldTensor:
        """A deterministic point (a ``geoopt.ManifoldTensor``): :meth:`random` with a
        generator seeded by ``seed``. The global RNG is left untouched."""
        generator = torch.Generator(device=device or "cpu").manual_seed(seed)
        return self.random(*size, dtype=dtype, device=device, generator=generator)

    @matrix_method(result="check")
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """geoopt's ``(ok, reason)``: :meth:`points_on_manifold` of every matrix, read back; the
        reason names a non-finite entry, else the constraint (:meth:`_off_manifold_reason`)."""
        if bool(self.points_on_manifold(x, atol=atol, rtol=rtol).all()):
            return True, None
        if not bool(torch.isfinite(x).all()):
            return False, "x has a NaN or infinite entry"
        return False, self._off_manifold_reason(x, atol=atol, rtol=rtol)

    def _off_manifold_reason(self, x: torch.Tensor, *, atol: float, rtol: float) -> str:
        """The reason ``check_point_on_manifold`` gives for a finite ``x`` that
        :meth:`points_on_manifold` refuses: the constraint broken, with its tolerances. ``x`` is
        in the manifold's own orientation (the transpose of a wide point when
        ``transposes_wide``). A subclass with its own ``points_on_manifold`` states its own
        constraint here; the default names the generic rule's."""
        if self.has_defining_map:
            return (f"defining map F(x) != 0 with atol={atol} (times |F(0)|, the scale of the "
                    "constraint's constant, where it has one; else times the size of each entry's terms at x)")
        return f"projx(x) != x with atol={atol}, rtol={rtol}"

    @matrix_method(result="multiplier")
    def points_on_manifold(self, x: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> torch.Tensor | None:
        r"""Per matrix of ``x`` ``[..., m, n]``: whether it is a point, as a bool tensor ``[...]``
        on ``x``'s device, with no host read (what an optimizer's step may compute; the
        ``check_point_on_manifold`` of geoopt is its ``.all()`` read back, with a reason).

        Generic rule, with a defining map: ``isclose(F(x), 0)`` in every entry with the absolute
        tolerance scaled by $\|F(0)\|_{\max}$, or where $F(0) = 0$ by the size of $F$'s terms at $x$
        (:meth:`_terms_scale`: a linear constraint's fp32 row sums of 1024 unit entries round to
        $10^{-5}$, and an absolute tolerance had refused its points fresh from ``projx``), else ``isclose(projx(x), x)``
        (``torch.isclose``, so ``.all()`` is ``torch.allclose``); a matrix with a non-finite entry
        is never a point. A constraint $q(x) = c$ with
        $q$ homogeneous has $F(0) = -c$, and at a point of $M$ the round-off of $F(x)$ is that
        of $c$: an unscaled ``atol`` had refused fp32 points of ``LPRO(radius=10)`` fresh from
        ``projx`` ($\tfrac12(\|x\|^2 - r^2)$ rounds to $r^2$ times fp32's round-off), and one clamped
        at 1 accepted rows of ``LPRO(radius=0.001)`` 4 times too long. A test
        on the Gauss–Newton step instead would pass $x = 0$, where the step vanishes with the
        normal space. ``None`` for a subclass that overrides ``_check_point_on_manifold``
        without overriding this method: its check is host-side only.
        """
        if type(self)._check_point_on_manifold is not MatrixManifold._check_point_on_manifold:
            return None
        if self.has_defining_map:
            self._check_defining_map(x)
            residual = self.defining_map(x)
            constant = self.defining_map(torch.zeros_like(x)).abs().flatten(x.dim() - 2)
            scale = constant.amax(-1) if constant.size(-1) else constant.new_zeros(constant.shape[:-1])
            scale = scale.reshape(*scale.shape, *(1,) * (residual.dim() - scale.dim()))
            if type(self).constraint is not MatrixManifold.constraint:
                # a homogeneous constraint (F(0) = 0): each entry at the size of its own terms
                scale = torch.where(scale > 0, scale, self._terms_scale(x).abs())
            else:  # (a manifold with its own projx may define no constraint: an absolute tolerance)
                scale = torch.where(scale > 0, scale, 1.0)
            close = residual.abs() <= atol * scale  # (rtol has no reference value here: |0| = 0)
        else:  # projx without its finite check (a host read, and a raise where this says False),
            # of a finite stand-in (an SVD fails on NaN); the finite mask below decides those
            projx = getattr(type(self).projx, "without_finite_check", type(self).projx)
            stand_in = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
            close = torch.isclose(projx(self, stand_in), x, atol=atol, rtol=rtol)
        # A matrix with a NaN or an infinite entry is no point of a real manifold; an empty
        # residual (Euclidean, LPRO without a radius) had accepted one.
        finite = torch.isfinite(x).flatten(x.dim() - 2).all(-1)
        return close.flatten(x.dim() - 2).all(-1) & finite

    @matrix_method("u", result="check")
    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        r"""geoopt's ``(ok, reason)``: whether the normal component of ``u`` is small beside
        ``u``, matrix by matrix,

        $$\|N_xu\|_F \le \text{atol}\,\|u\|_F,\qquad N_xu = L_x^*(L_xL_x^*)^{-1}L_xu,$$

        measured in float32 (float64 for float64 input). Scale-free in ``x`` and ``u``, as
        tangency is: the test $|L_x(u)| \le \text{atol}$ had refused float32 tangent vectors
        fresh from ``proju`` once $\|x\|\|u\|$ reached $10^2$ (round-off of $L_x(u)$ grows with
        it) and accepted a unit normal at a point of ``LPRO(radius=1e-6)``. ``rtol`` is unused
        (the reference value of the normal component is 0)."""
        compute = fp32_or_fp64(u.dtype)
        x, u = broadcast_pair(x.to(compute), u.to(compute))
        normal = self._normal_component(x, u)
        relative = normal.norm(dim=(-2, -1)) / u.norm(dim=(-2, -1)).clamp_min(torch.finfo(compute).tiny)
        worst = float(relative.max()) if relative.numel() else 0.0
        ok = worst <= atol
        return ok, None if ok else (f"the normal component of u is {worst:.1e} of |u| (atol={atol}): "
                                    "u is not tangent, L_x(u) != 0")

    # ---------------------------------------------------------------- internals
    def _normal_component(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$N_xu = L_x^*(L_xL_x^*)^{-1}L_xu$, the component of ``u`` normal to $T_xM$ (what the
        generic :meth:`proju` removes)."""
        return self._normal_of(x, self.gram_solve(x, self.constraint(x, u)))

    def _normal_of(self, x: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        r"""$L_x^*(\Lambda)$ by ``constraint_adjoint``, refused (``ValueError`` naming it) unless a
        matrix of ``x``'s shape: a user's adjoint returning the multiplier's shape had failed in
        the next ``constraint`` call, whose message blamed a tangent vector ``u`` the caller never
        passed."""
        out = self.constraint_adjoint(x, lam)
        if isinstance(out, torch.Tensor) and (out.dim() < 2 or out.shape[-2:] != x.shape[-2:]):
            raise ValueError(
                f"{self.name}: constraint_adjoint(x, lam) returned shape {tuple(out.shape)} for x of shape "
                f"{tuple(x.shape)} and lam of shape {tuple(lam.shape)}; L_x^*(lam) is a matrix [..., m, n] like x"
            )
        return out

    def _newton_projection(self, y: torch.Tensor) -> torch.Tensor:
        if not self.has_defining_map:
            raise NotImplementedError(
                f"{type(self).__name__}: the generic projx/retr need defining_map(x) "
                "(F with M = {F = 0}); define it, or override projx and retr"
            )
        y = y.to(fp32_or_fp64(y.dtype))
        # Stop once a step is below sqrt(eps)/100 relative: quadratic convergence then puts
        # the next error under the dtype's round-off.
        small = 1e-2 * torch.finfo(y.dtype).eps ** 0.5
        tiny = torch.finfo(y.dtype).tiny
        self._check_defining_map(y)  # (once: the shape does not change between steps)
        for _ in range(self.newton_steps):
            step = self._normal_of(y, self.gram_solve(y, self.defining_map(y)))
            y = y - step
            relative_step = step.norm(dim=(-2, -1)) / y.norm(dim=(-2, -1)).clamp_min(tiny)
            if bool((relative_step <= small).all()):
                break
        else:
            warnings.warn(
                f"{self.name}: the Gauss-Newton projection did not converge in "
                f"{self.newton_steps} steps (last relative step {float(relative_step.max()):.1e}); "
                "the result may be off the manifold (is the step too long?)",
                RuntimeWarning,
                stacklevel=3,
            )
            return y
        # A small step is also what a stall looks like: where the normal space degenerates (a
        # zero or rank-deficient input) F(y) leaves the range of L_y, whose solve then moves y
        # by nothing. Converged, F(y) is round-off of its terms, about eps (|L_y(y)| + |F(0)|)
        # (L_y(y) = k q(y) for a q homogeneous of degree k, F = q - F(0)), or of a linear
        # constraint's terms (L_y(y) = F(y) cancels there: _terms_scale); sqrt(eps) of that
        # scale parts the two by orders of magnitude (the generic projx had returned the zero
        # matrix for a Frobenius sphere, and a generalized Stiefel frame 0.58 off M, unwarned;
        # and warned at every converged projection onto a linear constraint).
        residual = self._flat_multiplier(self.defining_map(y), y).norm(dim=-1)
        scale = (self._flat_multiplier(self.constraint(y, y), y).norm(dim=-1)
                 + self._flat_multiplier(self.defining_map(torch.zeros_like(y)), y).norm(dim=-1)
                 + self._flat_multiplier(self._terms_scale(y), y).norm(dim=-1))
        stalled = residual > torch.finfo(y.dtype).eps ** 0.5 * scale
        if bool(stalled.any()):
            worst = float((residual / scale.clamp_min(tiny)).max())
            warnings.warn(
                f"{self.name}: the Gauss-Newton projection stalled off the manifold (|F(y)| = {worst:.1e} of the "
                "scale of its terms) where the normal space of the constraint degenerates, as at a zero or "
                "rank-deficient matrix: start from a generic (full-rank) matrix, or override projx and retr "
                "with a closed form",
                RuntimeWarning,
                stacklevel=3,
            )
        return y

    def _terms_scale(self, x: torch.Tensor) -> torch.Tensor:
        r"""Per entry of the multiplier, the size of $F$'s terms at $x$: the RMS of $L_x(P_k\odot x)$
        over :data:`TERM_PROBES` fixed pseudo-random Gaussian $P_k$
        (:func:`~geomuon.manifolds.linalg.fixed_start`). An entry of $L_x(P\odot x)$ is a centred
        Gaussian whose variance $\sigma^2 = \sum_j w_jt_j^2$ weighs that entry's terms $t_j$ ($w_j = 1$
        for a linear constraint; 2 or 4 for the entries of a quadratic one such as $W^\top W$), so the
        RMS of four is $\sigma\sqrt{\chi^2_4/4}$: below $\sigma/10$ with probability
        $2\cdot10^{-4}$ (one probe's: 8 %). $L_x(x) = F(x)$ cannot serve: at a point of a
        linear constraint its terms cancel. Entrywise in $x$, so each row of a row-wise constraint
        is measured by its own entries. On ``x``'s device, no host read."""
        probes = fixed_start((TERM_PROBES, *x.shape[-2:]), x.dtype, x.device)
        return torch.stack([self.constraint(x, probe * x) for probe in probes]).square().mean(0).sqrt()

    @staticmethod
    def _flat_multiplier(multiplier: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A multiplier-shaped tensor of the points ``x`` ``[..., m, n]`` as ``[..., p]`` (``p``
        named, not ``-1``: an empty batch leaves ``-1`` ambiguous)."""
        return multiplier.reshape(*x.shape[:-2], math.prod(multiplier.shape[x.dim() - 2:]))


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _private_copy(value: Any) -> Any:
    """A constructor argument as the manifold keeps it: every tensor in it (plain lists, tuples
    and dicts of them included) detached and copied, as a normal tensor even under
    ``torch.inference_mode`` (an inference tensor has no version counter for :attr:`identity`
    to follow); anything else as given."""
    if isinstance(value, torch.Tensor):
        with torch.inference_mode(False):
            return value.detach().clone()
    if type(value) in (list, tuple):  # (a namedtuple or another container is kept as given)
        return type(value)(_private_copy(item) for item in value)
    if type(value) is dict:
        return {key: _private_copy(item) for key, item in value.items()}
    return value


def _tensor_versions(value: Any):
    """The version counters of the tensors in a constructor argument, in order, nested in the
    containers :func:`_private_copy` copies (plain lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value._version
    elif type(value) in (list, tuple):
        for item in value:
            yield from _tensor_versions(item)
    elif type(value) is dict:
        for item in value.values():
            yield from _tensor_versions(item)


def _plain(value: Any, where: str) -> Any:
    """``value`` as plain data for a spec (tensors detached and copied), or ``TypeError``."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_plain(item, where) for item in value]
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return {key: _plain(item, where) for key, item in value.items()}
    raise TypeError(
        f"{where}: a constructor argument of type {type(value).__name__} cannot go into a "
        "manifold spec (plain data: None, bool, int, float, str, torch.dtype, tensors, "
        "lists and str-keyed dicts of these)"
    )


def _frozen(value: Any) -> Any:
    """A hashable image of plain spec data; tensors by dtype, shape and the sha256 of their
    bytes (a tuple of their values had cost 16-37 ms to hash for a 1024 x 1024 tensor, once
    per parameter per step in the batch keys)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.sha256(data).hexdigest())
    if isinstance(value, list):
        return ("list", tuple(_frozen(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((key, _frozen(item)) for key, item in value.items())))
    return value  # Python equality: 2 == 2.0, as a constructor taking a float sees them


def conjugate_gradients(apply, b: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
    r"""Batched Jacobi-preconditioned conjugate gradients for $G\lambda = b$ over the last dim.

    ``apply(v)`` computes $Gv$ for ``[..., p]`` tensors ($G$ symmetric positive
    semi-definite, $b$ in its range); ``diag`` ``[..., p]`` is the positive preconditioner.
    Each batch entry stops on a normwise backward error at round-off,
    $\|r\| \le 16\varepsilon(\|b\| + \|G\|\|\lambda\|)$ with $\|G\|$ estimated from the
    products seen, or once its residual grows 1000-fold over its best (the right-hand side
    carries round-off outside the range of a singular $G$, and CG iterating on that noise
    diverges); at most $p$ iterations, the exact-arithmetic bound. Returns the iterate
    with the smallest residual, in ``b.dtype``.
    """

    def dot(u, v):
        return (u * v).sum(-1, keepdim=True)

    eps, tiny = torch.finfo(b.dtype).eps, torch.finfo(b.dtype).tiny
    # b divided by a power of two near its largest entry (exact: the iterates are the unscaled
    # ones bit for bit wherever those neither over- nor underflow): in float32 the sums r.z and
    # p.Gp of a right-hand side of 7e12 (Gauss-Newton from a point at scale 1e6) had overflowed,
    # alpha became 0 and the solve returned 0, so projx stopped at once, 0.5 off M, unwarned
    scale = power_of_two_at_most(largest_entry(b, -1))
    b = b / scale
    b_norm = b.norm(dim=-1, keepdim=True)
    gram_norm = torch.zeros_like(b_norm)
    lam = torch.zeros_like(b)
    best_lam, best_r = lam, b_norm
    done = torch.zeros_like(b_norm, dtype=torch.bool)
    r = b.clone()
    z = r / diag
    p = z
    rz = dot(r, z)
    for iteration in range(b.size(-1) + 1):
        r_norm = r.norm(dim=-1, keepdim=True)
        improved = r_norm < best_r
        best_lam = torch.where(improved, lam, best_lam)
        best_r = torch.where(improved, r_norm, best_r)
        target = 16 * eps * (b_norm + gram_norm * lam.norm(dim=-1, keepdim=True))
        done = done | (r_norm <= target) | (r_norm > 1e3 * best_r)
        if bool(done.all()) or iteration == b.size(-1):
            break
        gp = apply(p)
        p_norm = p.norm(dim=-1, keepdim=True).clamp_min(tiny)
        gram_norm = torch.maximum(gram_norm, gp.norm(dim=-1, keepdim=True) / p_norm)
        pgp = dot(p, gp)
        alpha = torch.where(pgp > 0, rz / pgp, torch.zeros_like(pgp))
        lam = lam + alpha * p
        r = r - alpha * gp
        z = r / diag
        rz_next = dot(r, z)
        beta = torch.where(rz > 0, rz_next / rz, torch.zeros_like(rz))
        p = z + beta * p
        rz = rz_next
    return best_lam * scale


def broadcast_pair(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand ``x`` and ``u`` to their common batch shape."""
    batch = torch.broadcast_shapes(x.shape[:-2], u.shape[:-2])
    return x.expand(*batch, *x.shape[-2:]), u.expand(*batch, *u.shape[-2:])
