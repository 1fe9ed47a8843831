r"""Symbolic certificates (sympy): exact identities behind the numerical code.

Every function returns a :class:`Certificate` whose ``witness`` is the exact object the
claim rests on (a simplified residual matrix that is identically zero, a factorization,
exact roots), so a test can assert the claim *and* inspect why it holds. Floating-point
coefficients are read as the exact decimals they are written as
(``Rational("3.4445") = 6889/2000``).

* Manifold geometry on **symbolic points**: rational orthogonal matrices from the Cayley
  transform $Q = (I - S)(I + S)^{-1}$ of a skew matrix $S$ of symbols give exact points of
  Stiefel, DGram, Oblique and LPRO; the tangent projection of each is certified idempotent,
  tangent ($L_W(P_W X) = 0$) and orthogonal ($\langle X - P_WX, P_WY\rangle = 0$) for a
  matrix $X$ of symbols.
* The DGram retraction $\operatorname{msign}(X)\operatorname{diag}(\|x_j\|)$ fixes DGram
  points; the sorted-$\sigma$ map of the seed paper's code does not.
* One Newton–Schulz step is $O_m\times O_n$-equivariant as a polynomial identity in
  non-commuting matrix variables.
* Fixed points and exact output range of each Newton–Schulz coefficient set.
* The spectral soft cap $f_\alpha$ and its coupling quartic; its monotonicity on $[0, k]$.
* The residual Lipschitz rule $\operatorname{Lip}((1-a)x + af(x)) \le (1 - a) + a\,
  \operatorname{Lip}(f)$.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy as sp

__all__ = [
    "Certificate",
    "exact",
    "cayley",
    "skew",
    "SymbolicManifold",
    "symbolic_manifolds",
    "certify_tangent_projection",
    "certify_dgram_retraction",
    "certify_sorted_sigma_map_fails",
    "certify_newton_schulz_equivariance",
    "ns_fixed_points",
    "ns_output_range",
    "soft_cap_polynomial",
    "certify_soft_cap_coupling",
    "soft_cap_coupling_roots",
    "certify_soft_cap_monotone",
    "certify_residual_lipschitz",
]


@dataclass(frozen=True)
class Certificate:
    """An exactly checked claim: ``holds`` and the ``witness`` it was read off."""

    claim: str
    holds: bool
    witness: Any

    def __bool__(self) -> bool:
        return self.holds


def exact(x) -> sp.Rational:
    """The exact rational a float is written as (``repr``), e.g. ``0.1 -> 1/10``."""
    if isinstance(x, sp.Basic):
        return x
    return sp.Rational(x if isinstance(x, str) else repr(x))


def _reduce(e: sp.Expr) -> sp.Expr:
    """Exact normal form of a rational function: expanded numerator over denominator
    (zero iff the expression is identically zero; cheaper than ``cancel``'s gcds)."""
    num, den = sp.fraction(sp.together(e))
    num = sp.expand(num)
    return sp.Integer(0) if num == 0 else num / den


def _zero(M: sp.Matrix) -> tuple[bool, sp.Matrix]:
    reduced = M.applyfunc(_reduce)
    return reduced.is_zero_matrix is True, reduced


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
    $S$ has rational (or symbolic) entries."""
    eye = sp.eye(S.rows)
    return ((eye - S) * (eye + S).inv()).applyfunc(sp.cancel)


def _sym(A: sp.Matrix) -> sp.Matrix:
    return (A + A.T) / 2


def _inner(X: sp.Matrix, Y: sp.Matrix) -> sp.Expr:
    return sum(x * y for x, y in zip(X, Y))


def _unit_vector(m: int, prefix: str) -> sp.Matrix:
    r"""Rational unit vector of $\mathbb R^m$ by inverse stereographic projection:
    $(1 - \|u\|^2, 2u)/(1 + \|u\|^2)$ for symbols $u \in \mathbb R^{m-1}$."""
    u = sp.Matrix(sp.symbols(f"{prefix}0:{m - 1}", real=True))
    q = (u.T * u)[0]
    return sp.Matrix([1 - q, *(2 * u)]) / (1 + q)


def _unit_2d(t: sp.Symbol) -> sp.Matrix:
    """Rational unit vector of the plane (stereographic / 2-D Cayley)."""
    return sp.Matrix([[(1 - t**2) / (1 + t**2), 2 * t / (1 + t**2)]])


@dataclass(frozen=True)
class SymbolicManifold:
    r"""A manifold's closed forms, stated in sympy on an exact point.

    ``on_manifold(W)``: the defining map $F(W)$ (zero on the manifold);
    ``constraint(W, A)``: $L_W(A)$; ``project(W, X)``: $P_W(X)$ (DESIGN §2 table)."""

    name: str
    point: sp.Matrix
    on_manifold: Callable[[sp.Matrix], sp.Matrix]
    constraint: Callable[[sp.Matrix, sp.Matrix], sp.Matrix]
    project: Callable[[sp.Matrix, sp.Matrix], sp.Matrix]


def _off(A: sp.Matrix) -> sp.Matrix:
    return A - sp.diag(*A.diagonal())


def _dgram_project(W: sp.Matrix, X: sp.Matrix) -> sp.Matrix:
    gram = W.T * W
    S = W.T * X + X.T * W
    n = W.cols
    Sigma = sp.Matrix(n, n, lambda i, j: 0 if i == j else S[i, j] / (gram[i, i] + gram[j, j]))
    return X - W * Sigma


def symbolic_manifolds(m: int = 3, n: int = 2) -> dict[str, SymbolicManifold]:
    r"""Exact symbolic points ($m \times n$, $m > n$) of every constrained manifold.

    * Stiefel: the first $n$ columns of $Q = \operatorname{cayley}(S)$, $S$ a skew matrix
      of symbols.
    * DGram: $Q_{:, :n}\operatorname{diag}(d)$ with positive symbols $d_j$.
    * Oblique: each column its own rational unit vector (inverse stereographic projection).
    * LPRO (row radius $r$): rows $r\,(\tfrac{1-t_i^2}{1+t_i^2}, \tfrac{2t_i}{1+t_i^2}, 0,
      \dots)$.
    * CenteredRouterSpace: $Y - \tfrac1m\mathbf 1\mathbf 1^\top Y$, $Y$ of symbols.
    """
    if not m > n >= 2:
        raise ValueError(f"symbolic_manifolds: need m > n >= 2, got m={m}, n={n}")
    Q = cayley(skew(m))
    d = sp.symbols(f"d0:{n}", positive=True)
    r = sp.Symbol("r", positive=True)
    ones = sp.ones(m, 1)
    stiefel = Q[:, :n]
    oblique = sp.Matrix.hstack(*[_unit_vector(m, f"o{j}_") for j in range(n)])
    lpro = sp.Matrix.vstack(
        *[r * _unit_2d(sp.Symbol(f"t{i}", real=True)).row_join(sp.zeros(1, n - 2)) for i in range(m)]
    )
    Y = sp.Matrix(m, n, lambda i, j: sp.Symbol(f"y{i}{j}", real=True))
    router = Y - ones * (ones.T * Y) / m
    return {
        "Stiefel": SymbolicManifold(
            "Stiefel",
            stiefel,
            lambda W: W.T * W - sp.eye(W.cols),
            lambda W, A: W.T * A + A.T * W,
            lambda W, X: X - W * _sym(W.T * X),
        ),
        "DGram": SymbolicManifold(
            "DGram",
            stiefel * sp.diag(*d),
            lambda W: _off(W.T * W),
            lambda W, A: _off(W.T * A + A.T * W),
            _dgram_project,
        ),
        "Oblique": SymbolicManifold(
            "Oblique",
            oblique,
            lambda W: sp.Matrix([(W.T * W).diagonal()]) - sp.ones(1, W.cols),
            lambda W, A: sp.Matrix([(W.T * A).diagonal()]),
            lambda W, X: X - W * sp.diag(*(W.T * X).diagonal()),
        ),
        "LPRO": SymbolicManifold(
            "LPRO",
            lpro,
            lambda W: sp.Matrix([[(W[i, :] * W[i, :].T)[0] - r**2 for i in range(W.rows)]]),
            lambda W, A: sp.Matrix([[(W[i, :] * A[i, :].T)[0] for i in range(W.rows)]]),
            lambda W, X: X - sp.diag(*[(W[i, :] * X[i, :].T)[0] for i in range(W.rows)]) * W / r**2,
        ),
        "CenteredRouterSpace": SymbolicManifold(
            "CenteredRouterSpace",
            router,
            lambda W: ones.T * W,
            lambda W, A: ones.T * A,
            lambda W, X: X - ones * (ones.T * X) / W.rows,
        ),
    }


def certify_tangent_projection(manifold: SymbolicManifold) -> Certificate:
    r"""On the exact symbolic point $W$ and matrices $X, Y$ of symbols, certify:
    $F(W) = 0$; $P(P(X)) = P(X)$; $L_W(P(X)) = 0$; $\langle X - P(X), P(Y)\rangle = 0$.

    ``witness`` maps each identity to its simplified residual (all identically zero)."""
    W = manifold.point
    m, n = W.shape
    X = sp.Matrix(m, n, lambda i, j: sp.Symbol(f"x{i}{j}", real=True))
    Y = sp.Matrix(m, n, lambda i, j: sp.Symbol(f"z{i}{j}", real=True))
    PX = manifold.project(W, X)
    residuals = {
        "on manifold F(W)": manifold.on_manifold(W),
        "idempotent P(P(X)) - P(X)": manifold.project(W, PX) - PX,
        "tangent L_W(P(X))": manifold.constraint(W, PX),
        "orthogonal <X - P(X), P(Y)>": sp.Matrix([[_inner(X - PX, manifold.project(W, Y))]]),
    }
    checked = {name: _zero(R) for name, R in residuals.items()}
    return Certificate(
        f"{manifold.name}: tangent projection is idempotent, tangent and orthogonal",
        all(ok for ok, _ in checked.values()),
        {name: R for name, (_, R) in checked.items()},
    )


def _msign_full_column_rank(X: sp.Matrix) -> sp.Matrix:
    r"""$X(X^\top X)^{-1/2}$ for an $X$ whose Gram matrix simplifies to a positive diagonal
    (the case of DGram points); raises otherwise."""
    gram = (X.T * X).applyfunc(sp.simplify)
    if not gram.is_diagonal():
        raise ValueError("_msign_full_column_rank: Gram matrix is not diagonal")
    return X * sp.diag(*[1 / sp.sqrt(g) for g in gram.diagonal()])


def _column_norms(X: sp.Matrix) -> list[sp.Expr]:
    return [sp.sqrt(sp.simplify((X[:, j].T * X[:, j])[0])) for j in range(X.cols)]


def certify_dgram_retraction(m: int = 3, n: int = 2) -> Certificate:
    r"""$R(W) = \operatorname{msign}(W)\operatorname{diag}(\|w_j\|)$ fixes every DGram
    point $W = Q_{:, :n}\operatorname{diag}(d)$ (symbolic $Q$, symbolic $d > 0$, in any
    order): ``witness`` is $R(W) - W$, identically zero."""
    W = symbolic_manifolds(m, n)["DGram"].point
    R = _msign_full_column_rank(W) * sp.diag(*_column_norms(W))
    ok, residual = _zero(R - W)
    return Certificate("DGram retraction msign(W) diag(||w_j||) fixes DGram points", ok, residual)


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
    _, residual = _zero(moved)
    return Certificate(
        f"sorted-sigma map moves the DGram point with column norms {tuple(d)}",
        not residual.is_zero_matrix,
        residual,
    )


def _reduce_word(word: tuple, rules: dict[tuple, tuple]) -> tuple:
    changed = True
    while changed:
        changed = False
        for pattern, replacement in rules.items():
            k = len(pattern)
            for i in range(len(word) - k + 1):
                if word[i : i + k] == pattern:
                    word = word[:i] + replacement + word[i + k :]
                    changed = True
                    break
    return word


def _free_algebra_terms(expr: sp.Expr, rules: dict[tuple, tuple]) -> dict[tuple, sp.Expr]:
    """Expand a non-commutative polynomial into {reduced word: commutative coefficient}."""
    terms: dict[tuple, sp.Expr] = {}
    for term in sp.Add.make_args(sp.expand(expr)):
        coefficient, word = term.args_cnc()
        flat: list = []
        for factor in word:
            base, power = factor.as_base_exp()
            flat.extend([base] * int(power))
        key = _reduce_word(tuple(flat), rules)
        terms[key] = terms.get(key, 0) + sp.Mul(*coefficient)
    return {k: v for k, v in terms.items() if sp.simplify(v) != 0}


def certify_newton_schulz_equivariance() -> Certificate:
    r"""One Newton–Schulz step $p(X) = aX + b\,XX^\top X + c\,(XX^\top)^2X$ satisfies
    $p(LXR^\top) = L\,p(X)\,R^\top$ for all orthogonal $L, R$ — as an identity of
    polynomials in non-commuting matrix variables $L, X, R$ and their transposes, reduced
    by $L^\top L = I$, $R^\top R = I$, with symbolic $a, b, c$ (so every coefficient table,
    every step, every shape). ``witness`` is the reduced difference: an empty dict."""
    L, Lt, X, Xt, R, Rt = sp.symbols("L L^T X X^T R R^T", commutative=False)
    a, b, c = sp.symbols("a b c")

    def step(Y, Yt):
        return a * Y + b * Y * Yt * Y + c * Y * Yt * Y * Yt * Y

    rules = {(Rt, R): (), (Lt, L): ()}
    difference = step(L * X * Rt, R * Xt * Lt) - L * step(X, Xt) * Rt
    residual = _free_algebra_terms(difference, rules)
    return Certificate("one Newton-Schulz step is bi-orthogonally equivariant", not residual, residual)


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
    """A rational within $10^{-50}$ of ``x`` on the requested side (outward rounding)."""
    scaled = sp.N(x, _DIGITS + 20) * sp.Integer(10) ** _DIGITS
    integer = sp.ceiling(scaled) if up else sp.floor(scaled)
    return sp.Rational(integer, sp.Integer(10) ** _DIGITS)


def _interval_image(a, b, c, lo, hi):
    """Rational enclosure of the image of [lo, hi] under the quintic: its values at the
    endpoints and at the interior critical points (exact radicals), rounded outward."""
    sigma = sp.Symbol("sigma", positive=True)
    p = lambda x: a * x + b * x**3 + c * x**5  # noqa: E731 - one-line scalar polynomial
    candidates = [p(lo), p(hi)]
    for s in sp.solve(a + 3 * b * sigma**2 + 5 * c * sigma**4, sigma):
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


def soft_cap_polynomial(alpha, sigma=None) -> sp.Expr:
    r"""The spectral soft cap on one singular value: $h(\sigma) = \sigma - \alpha\sigma^3$,
    then $f_\alpha(\sigma) = h + \alpha h^3$ (seed 003: two odd polynomial steps)."""
    sigma = sp.Symbol("sigma") if sigma is None else sigma
    h = sigma - alpha * sigma**3
    return h + alpha * h**3


def _coupling(w_max, wd, eta):
    w_max, wd, eta = exact(w_max), exact(wd), exact(eta)
    return w_max, w_max * (1 - wd) + eta


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
    w, k = _coupling(w_max, wd, eta)
    if k <= 0 or w <= 0:
        raise ValueError(f"soft_cap_coupling_roots: need w_max > 0 and k = w_max(1-wd)+eta > 0, got w_max={w_max}, k={float(k)}")
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
    w, k = _coupling(w_max, wd, eta)
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
    return Certificate(
        "Lip((1-a)x + a f(x)) <= (1-a) + a Lip(f) for a in [0, 1], tight at t = L",
        holds,
        {"gap": factored, "factors": factors},
    )
