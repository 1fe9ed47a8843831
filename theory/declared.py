r"""The declared symmetry table: for every update of the library and every group, whether
equivariance **must hold** or **must fail**.

This is the one place that names concrete updates next to :mod:`geomuon.theory.groups` groups.
The equivariance suite (``tests/test_declared_table.py``) runs every row with hypothesis
through :func:`geomuon.theory.equivariance.verify_declaration`: on adversarial float64
inputs (every kind of :data:`geomuon.theory.equivariance.KINDS` at scales $10^{-8}..10^8$)
a ``holds`` row must stay within its measured round-off floor on every resolved example,
a ``fails`` row must show a confirmed violation on a counterexample hypothesis finds. A
``structured`` row (:class:`Declaration`) also declares the update single-valued at ties, exact
zeros, repeated singular values and rank 0, where its ``holds`` is judged too, with exact group
elements (``verify_declaration(structured=True)``).
The docs render :func:`declarations` (``docs/hooks/geomuon_pages.py``); :func:`table_rows`
gives the same rows as plain tuples.

Three kinds of update appear:

* ``map``: a pure map of :mod:`geomuon.optimizers.maps`, $U(g\cdot D)$ vs $g\cdot U(D)$;
* ``direction``: the engine's steepest direction on a manifold,
  $A(gW, gG)$ vs $g\,A(W, G)$ (fixed 5 dual steps, exact feasibility rescaling);
* ``step``: three optimizer steps from $g\cdot W_0$ with gradients $g\cdot G_t$ vs $g\cdot$(the
  steps from $W_0$ with $G_t$), momentum and weight decay included, float64; weights move by
  ``act_point``, gradients by ``act_gradient`` (the gradient of a loss with the symmetry:
  a router shift moves the weights, not the gradients).

``precision`` states the dtype a row holds up to when the update computes in a narrower
one than its input (Muon's bf16 Newton–Schulz).

Adding an update to the library means adding its rows here; changing an update's
symmetry means changing its row (and its rationale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from geomuon.manifolds import LPRO, CenteredRouterSpace, DGram, Euclidean, Oblique, Stiefel
from geomuon.optimizers import maps
from geomuon.optimizers.manifold_muon import ManifoldMuon
from geomuon.optimizers.muon import Muon
from geomuon.optimizers.polar import HybridPolarGradM, LeftPolarGradM, RightPolarGradM, RowNormM
from geomuon.optimizers.steepest import steepest_direction
from geomuon.theory.equivariance import DirectionUpdate, MapUpdate, OptimizerUpdate
from geomuon.theory.groups import (
    GROUPS,
    BiOrthogonal,
    ColumnScaling,
    Group,
    LeftOrthogonal,
    LeftPermRightOrth,
    NeuronPermutation,
    Permutation,
    RightOrthogonal,
    RightPermLeftOrth,
    RouterShift,
    RowScaling,
    SignedColumnPermutation,
    SignedPermutation,
    SignedRowPermutation,
)

__all__ = ["Declaration", "declarations", "table_rows", "EXACT_SOLVER"]

#: Engine settings of the ``direction`` rows: a fixed number of dual steps (no tolerance
#: test, no best-iterate selection) so the computation is one fixed composition of
#: equivariant maps, and the final rescaling by the exact spectral norm. Depth for the
#: round-off bound: 16 stages per dual step. Five steps, because the fixed-step iteration
#: at alpha = 1 amplifies round-off about tenfold per step on Stiefel once it oscillates
#: (measured on 3x2, 30 draws: residual 2e-14 after 5 steps, 3e-10 after 10, 1e-4 after 20,
#: with the SVD msign as well) — a property of the dual iteration, not of the symmetry.
EXACT_SOLVER = dict(
    steps=5, alpha=1.0, decay=True, tol=0.0, certify=None, track_best=False,
    exact_norm=True,
)

#: The same with the engine's cheap feasibility rescaling ($\sigma_{\max}$ from the
#: eigenvalues of the small Gram matrix), as ``ManifoldMuon`` calls it.
FAST_RESCALE_SOLVER = dict(EXACT_SOLVER, exact_norm=False)

BO, LPRO_G, RPLO = BiOrthogonal(), LeftPermRightOrth(), RightPermLeftOrth()
SCP, SRP, SP = SignedColumnPermutation(), SignedRowPermutation(), SignedPermutation()
NP, SHIFT = NeuronPermutation(), RouterShift()
LEFT, RIGHT, PERM = LeftOrthogonal(), RightOrthogonal(), Permutation()
ROWS, COLS = RowScaling(), ColumnScaling()

#: What a :class:`Declaration` may say: its ``kind``, ``expected`` and ``orientation``.
UPDATE_KINDS = ("map", "direction", "step")
EXPECTED = ("holds", "fails")
ORIENTATIONS = ("any", "tall", "wide")


@dataclass(frozen=True)
class Declaration:
    """One row: ``update`` (display name) under ``group`` is ``expected`` (``"holds"`` or
    ``"fails"``), because ``rationale`` (Markdown, formulas in ``$...$``, names of code in
    backticks: the docs' table renders it). ``build()`` returns the
    :mod:`geomuon.theory.equivariance` subject; ``orientation`` (``"any"``, ``"tall"`` $m \\ge n$,
    ``"wide"`` $m < n$) restricts the shapes the row is declared on; ``precision`` is the
    dtype the row holds up to (the checker's ``compute_dtype``; ``None``: the input's);
    ``structured`` declares the update single-valued and equivariant at every input, structured
    ones included (ties, exact zeros, repeated singular values, rank 0), so that its ``holds`` is
    verified there too (:func:`~geomuon.theory.equivariance.verify_declaration` with
    ``structured=True``). Every update of the library is single-valued (none takes an SVD polar
    factor, set-valued at a rank-deficient input), hence the default ``True``; ``False`` is for an
    update that may be set-valued there, or whose floor there the checker cannot measure (the
    hybrid rows of :func:`declarations`). A ``fails`` row is searched for without it (its
    violation is re-measured with the usual group element).

    Raises ``ValueError`` naming the field when ``kind``, ``expected`` or ``orientation`` is
    not one of :data:`UPDATE_KINDS`, :data:`EXPECTED`, :data:`ORIENTATIONS`, ``group`` is not a
    :class:`~geomuon.theory.groups.Group` instance, ``build`` is not callable, ``precision``
    is neither ``None`` nor a floating dtype or ``structured`` is not a bool."""

    update: str
    kind: str
    group: Group
    expected: str
    rationale: str
    build: Callable[[], object]
    orientation: str = "any"
    precision: torch.dtype | None = None
    structured: bool = True

    def __post_init__(self) -> None:
        # A misspelt field had built a row that no test ran: the suite selects "holds" and
        # "fails" rows, and the docs' orientation lookup raised KeyError on "Tall".
        where = f"Declaration {self.update!r}"
        for name, value, allowed in (("kind", self.kind, UPDATE_KINDS), ("expected", self.expected, EXPECTED),
                                     ("orientation", self.orientation, ORIENTATIONS)):
            if value not in allowed:
                raise ValueError(f"{where}: {name} must be one of {allowed}, got {value!r}")
        if not isinstance(self.group, Group):
            raise ValueError(f"{where}: group must be a geomuon.theory.groups.Group instance (one of {sorted(GROUPS)} "
                             f"via get_group(name)), got {self.group!r}")
        if not callable(self.build):
            raise ValueError(f"{where}: build must be a callable returning the checker's subject, got {self.build!r}")
        if self.precision is not None and not (isinstance(self.precision, torch.dtype)
                                               and self.precision.is_floating_point):
            raise ValueError(f"{where}: precision must be a floating torch.dtype or None, got {self.precision!r}")
        if not isinstance(self.structured, bool):
            raise ValueError(f"{where}: structured must be True or False, got {self.structured!r}")

    @property
    def label(self) -> str:
        """The update's name, with the orientation when the row is restricted to one."""
        return self.update if self.orientation == "any" else f"{self.update} ({self.orientation})"

    @property
    def id(self) -> str:
        return f"{self.label} | {self.group.name} | {self.expected}"


def _map_rows(fn, rows: list[tuple[Group, str, str]], name: str = "", structured: bool = True) -> list[Declaration]:
    """One map's rows, ``(group, expected, rationale)`` each; the update's name defaults to
    the function's (:class:`MapUpdate`); ``structured`` as in :class:`Declaration`."""
    label = name or fn.__name__
    return [Declaration(label, "map", group, expected, rationale, lambda: MapUpdate(fn, name=name),
                        structured=structured)
            for group, expected, rationale in rows]


def _swiglu_symmetry_update(block):
    """Seed 004's SwiGLU stack: row-aware hybrid for gate/up, column-aware for down."""
    gate, up, down = block
    return maps.hybrid(gate), maps.hybrid(up), maps.hybrid(down.mT).mT


def _spectral_each(block):
    return tuple(maps.spectral(W) for W in block)


def _direction(manifold, solver=EXACT_SOLVER, name: str = "") -> Callable[[], DirectionUpdate]:
    label = name or f"steepest[{type(manifold).__name__}]"
    return lambda: DirectionUpdate(steepest_direction, manifold, dict(solver), name=label)


def _step(factory, name: str, manifold=None, **kwargs) -> Callable[[], OptimizerUpdate]:
    return lambda: OptimizerUpdate(factory, name=name, manifold=manifold, steps=3, **kwargs)


def declarations() -> list[Declaration]:
    """Every declared (update, group) pair."""
    H, F = "holds", "fails"
    rows = [
        # --- pure maps -------------------------------------------------------------
        *_map_rows(maps.spectral, [
            (BO, H, r"$\operatorname{msign}(LDR^\top) = L\operatorname{msign}(D)R^\top$; the Polar Express iteration"
             r" is an odd matrix polynomial $p(DD^\top)D$, equivariant up to round-off."),
            (LPRO_G, H, r"$S_m \times O_n$ is a subgroup of $O_m \times O_n$."),
            (SCP, H, r"$O_m \times$ signed column permutations $\subset O_m \times O_n$."),
            (SHIFT, F, r"Uncentered: a shared logit shift $\mathbf 1v^\top$ changes $\operatorname{msign}(D)$, though "
             "softmax ignores it."),
            (RPLO, H, r"$O_m \times S_n$ is a subgroup of $O_m \times O_n$."),
            (SRP, H, r"Signed row permutations $\times\, O_n \subset O_m \times O_n$."),
            (SP, H, "Signed permutations on both sides are orthogonal."),
            (ROWS, F, r"$\operatorname{msign}$ is not scale-invariant per row: $\operatorname{diag}(s)D$ has other "
             "singular vectors."),
        ]),
        *_map_rows(maps.row_norm, [
            (LPRO_G, H, r"Row norms are permuted by $S_m$ and unchanged by right rotations."),
            (SRP, H, "Signed row permutations permute the row norms and flip rows' signs, which "
             "the per-row scaling keeps."),
            (BO, F, "Left rotations mix rows and change their norms."),
            (RPLO, F, r"$O_m$ on the left mixes rows."),
            (SHIFT, F, "Uncentered: the shift changes every row norm."),
            (RIGHT, H, "Row norms are unchanged by right rotations."),
            (PERM, H, "Row and column permutations permute the row norms' entries."),
            (ROWS, F, r"$\operatorname{diag}(1/(\lVert d_i\rVert + \epsilon))$: the $\epsilon$ floor ($10^{-8}$) "
             r"breaks the invariance for rows of norm near $\epsilon$."),
        ]),
        *_map_rows(maps.col_norm, [
            (RPLO, H, r"Column norms are permuted by $S_n$ and unchanged by left rotations."),
            (SCP, H, "Signed column permutations permute column norms."),
            (LPRO_G, F, "Right rotations mix columns."),
            (LEFT, H, "Column norms are unchanged by left rotations."),
            (RIGHT, F, "Right rotations mix columns."),
        ]),
        *_map_rows(maps.right_polar, [
            (BO, H, r"$\lVert D\rVert_*^\alpha D(D^\top D)^{-1/2} = \lVert D\rVert_*^\alpha\operatorname{msign}(D)$,"
             r" computed by Polar Express on $D$ itself: $\operatorname{msign}$ is $O_m \times O_n$-equivariant and"
             " the nuclear norm invariant — on every shape."),
        ]),
        *_map_rows(maps.left_polar, [
            (BO, H, r"$(DD^\top)^{-1/2}D\,\lVert D\rVert_*^\alpha$: the mirror image of `right_polar`, on every "
             "shape."),
        ]),
        *_map_rows(maps.sign, [
            (ROWS, H, r"$\operatorname{sign}(\operatorname{diag}(s)D) = \operatorname{sign}(D)$ for positive $s$."),
            (COLS, H, r"$\operatorname{sign}(D\operatorname{diag}(s)) = \operatorname{sign}(D)$ for positive $s$."),
            (LEFT, F, "Left rotations break the coordinate basis."),
            (SP, H, "Coordinate-wise: commutes with signed permutations."),
            (BO, F, "Coordinate-wise maps are not rotation-equivariant (Adam's flaw)."),
            (LPRO_G, F, "Right rotations break the coordinate basis."),
        ]),
        # Not structured, though hybrid is single-valued: on a sparse input whose rows each hold
        # one distinct magnitude, a structured trial's probes (one relative factor per distinct
        # magnitude) only rescale rows, which the row normalization undoes, so its floor misses
        # msign's own round-off, which the exact signed permutation reorders (measured: residual
        # 2e-15 at 8.6 floors of 2.2e-16, inconclusive). A limit of the structure-keeping probes,
        # not a break of the map; the same for centered(hybrid) and the SwiGLU hybrid stack.
        # (HybridPolarGradM's step is structured: its probes of the weights re-create round-off.)
        *_map_rows(maps.hybrid, [
            (LPRO_G, H, r"$\operatorname{msign}(\text{row\_norm}(D))$ scaled by its nuclear norm: both stages are "
             r"$S_m \times O_n$-equivariant."),
            (SRP, H, "Signed row permutations are orthogonal and keep row norms: both stages commute with them."),
            (BO, F, "The row normalization breaks left rotations."),
        ], structured=False),
        # the centered (router) maps: one shift-invariance row each
        *(row for inner, rationale in [
            ("spectral", r"$\Pi^\perp$ kills the shift and commutes with $P$; $\operatorname{msign}$ is "
             r"$O_d$-equivariant on the right."),
            ("row_norm", "Centered input, row scaling, re-centered output: invariant to shifts."),
            ("left_polar", r"LeftPolarGradM's router map: "
             r"$\Pi^\perp (M_cM_c^\top)^{-1/2} M_c\,\lVert M_c\rVert_*^\alpha$."),
            ("right_polar", r"RightPolarGradM's router map: "
             r"$\Pi^\perp M_c (M_c^\top M_c)^{-1/2}\,\lVert M_c\rVert_*^\alpha$."),
            ("hybrid", r"Centered row normalization then $\operatorname{msign}$: both stages ignore the shift."),
        ] for row in _map_rows(maps.centered(getattr(maps, inner)), [(SHIFT, H, rationale)], f"centered({inner})",
                               structured=inner != "hybrid")),  # (hybrid: see its rows)
        *_map_rows(_swiglu_symmetry_update, [
            (NP, H, r"Row-aware hybrid on $W_{\text{gate}}$, $W_{\text{up}}$ ($P$ on rows) and column-aware on "
             r"$W_{\text{down}}$ ($P^\top$ on columns)."),
        ], "swiglu hybrid stack", structured=False),  # (hybrid: see its rows)
        *_map_rows(_spectral_each, [
            (NP, H, "Permutations are orthogonal."),
        ], "spectral per matrix"),
        # --- steepest directions on manifolds ---------------------------------------
        Declaration("steepest[Stiefel]", "direction", BO, H,
                    r"$O_m \times O_n$ maps Stiefel to itself, $L_{gW}(gA) = R\,L_W(A)R^\top$, and every dual step "
                    "composes equivariant maps (wide matrices: the transposed geometry, same group).",
                    _direction(Stiefel())),
        Declaration("steepest[DGram]", "direction", SCP, H,
                    r"DGram $= \{Q\operatorname{diag}(d)\}$ is preserved by $O_m \times$ signed column permutations, "
                    r"which permute the Jacobi weights $2(d_i^2 + d_j^2)$ consistently.", _direction(DGram()), "tall"),
        Declaration("steepest[DGram]", "direction", SRP, H,
                    "Wide DGram uses the transposed geometry (orthogonal rows), whose symmetry is "
                    r"signed row permutations $\times\, O_n$.", _direction(DGram()), "wide"),
        Declaration("steepest[DGram]", "direction", SCP, F,
                    "On wide matrices the columns are not the constrained side: left rotations take "
                    r"$W$ off DGram.", _direction(DGram()), "wide"),
        Declaration("steepest[DGram]", "direction", BO, F,
                    r"Right rotations take $Q\operatorname{diag}(d)$ off DGram: its symmetry is not $O_m \times O_n$.",
                    _direction(DGram()), "tall"),
        Declaration("steepest[Oblique]", "direction", SCP, H,
                    "Unit columns are preserved by left rotations and signed column permutations.",
                    _direction(Oblique()), "tall"),
        Declaration("steepest[Oblique]", "direction", BO, F, "Right rotations change column norms.",
                    _direction(Oblique()), "tall"),
        Declaration("steepest[CenteredRouterSpace]", "direction", SHIFT, H,
                    r"Closed form $\operatorname{msign}(\Pi^\perp G)$: invariant to shifts of $W$ and $G$.",
                    _direction(CenteredRouterSpace())),
        Declaration("steepest[Euclidean]", "direction", SHIFT, H,
                    r"$\operatorname{msign}(G)$, and the gradient of a shift-invariant loss is not shifted: the shift "
                    r"of $W$ is invisible to a direction that never reads $W$.", _direction(Euclidean())),

        Declaration("steepest[LPRO(radius=1)]", "direction", LPRO_G, H,
                    r"Rows of fixed norm are permuted by $S_m$ and rotated by $O_n$.", _direction(LPRO(radius=1.0)),
                    "tall"),
        Declaration("steepest[LPRO(radius=1)]", "direction", BO, F,
                    "Left rotations change row norms.", _direction(LPRO(radius=1.0)), "tall"),
        Declaration("steepest[Stiefel], cheap rescale", "direction", BO, H,
                    r"The cheap feasibility rescale divides by $\sigma_{\max}$ from the small Gram matrix's "
                    r"eigenvalues, an $O_m \times O_n$ invariant.", _direction(Stiefel(), FAST_RESCALE_SOLVER,
                                                 "steepest[Stiefel], cheap rescale"), "tall"),
        # --- optimizer steps --------------------------------------------------------
        Declaration("Muon", "step", BO, H,
                    "Nesterov momentum and decoupled weight decay are linear; Newton–Schulz is a matrix "
                    r"polynomial (float64 compute; in bf16 the residual is bf16 round-off, $\approx 2\cdot10^{-2}$).",
                    _step(lambda p: Muon(p, lr=0.1, weight_decay=0.1, compute_dtype=None), "Muon")),
        Declaration("Muon (bf16 Newton–Schulz, as shipped)", "step", BO, H,
                    "Equivariant up to bfloat16: the Newton–Schulz iteration runs in bf16, so the residual "
                    r"is bf16 round-off ($\approx 2\cdot10^{-2}$: median of 20 draws at 2–6 sides, at most $0.12$), "
                    "which is what the row is checked against.",
                    _step(lambda p: Muon(p, lr=0.1, weight_decay=0.1), "Muon (bf16)"), precision=torch.bfloat16),
        Declaration("Muon", "step", NP, H, "Per-matrix spectral steps commute with neuron permutations.",

                    _step(lambda p: Muon(p, lr=0.1, weight_decay=0.1, compute_dtype=None), "Muon")),
        Declaration("AdamW", "step", BO, F,
                    "Per-coordinate second moments are not rotation-equivariant.",
                    _step(lambda p: torch.optim.AdamW(p, lr=0.1), "AdamW")),
        Declaration("AdamW", "step", SP, H, "Per-coordinate updates commute with signed permutations.",
                    _step(lambda p: torch.optim.AdamW(p, lr=0.1), "AdamW")),
        Declaration("RowNormM", "step", LPRO_G, H, r"Momentum is linear; `row_norm` is $S_m \times O_n$-equivariant.",
                    _step(lambda p: RowNormM(p, lr=0.1, weight_decay=0.1), "RowNormM")),
        Declaration("RowNormM", "step", BO, F, "`row_norm` breaks left rotations.",
                    _step(lambda p: RowNormM(p, lr=0.1, weight_decay=0.1), "RowNormM")),
        Declaration("RightPolarGradM", "step", BO, H, r"`right_polar` is $O_m \times O_n$-equivariant on every shape.",
                    _step(lambda p: RightPolarGradM(p, lr=0.1, weight_decay=0.1), "RightPolarGradM")),
        Declaration("HybridPolarGradM", "step", LPRO_G, H, r"`hybrid` is $S_m \times O_n$-equivariant.",
                    _step(lambda p: HybridPolarGradM(p, lr=0.1, weight_decay=0.1), "HybridPolarGradM")),
        Declaration("HybridPolarGradM", "step", BO, F, "`hybrid` breaks left rotations.",
                    _step(lambda p: HybridPolarGradM(p, lr=0.1, weight_decay=0.1), "HybridPolarGradM")),
        Declaration("LeftPolarGradM", "step", BO, H, r"`left_polar` is $O_m \times O_n$-equivariant on every shape.",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1, weight_decay=0.1), "LeftPolarGradM")),
        Declaration("LeftPolarGradM(centered)", "step", SHIFT, H,
                    "The shift moves the weights, not the gradient of a shift-invariant loss, and the "
                    r"update never reads the weights: $W + \mathbf 1v^\top$ moves exactly like $W$, on square inputs "
                    r"too (where $\Pi^\perp M$ has a singular Gram matrix; measured against the map's own floor).",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1, centered=True), "LeftPolarGradM(centered)")),
        Declaration("LeftPolarGradM(centered, weight_decay)", "step", SHIFT, F,
                    r"Decoupled weight decay shrinks the shift component $\mathbf 1v^\top$ too: harmless for the "
                    "router's function, but the point trajectory is not shift-equivariant.",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1, centered=True, weight_decay=0.1),
                          "LeftPolarGradM(centered, weight_decay)"), "wide"),
        Declaration("LeftPolarGradM", "step", SHIFT, H,
                    "Uncentered, yet the step holds: the gradient of a shift-invariant loss is not shifted "
                    "(it is centered already), so the shift only moves the weights, which the update never "
                    "reads. Centering guards against shifted momenta (the map rows), not this.",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1), "LeftPolarGradM"), "wide"),
        Declaration("ManifoldMuon[Stiefel]", "step", BO, H,
                    "Momentum is linear, the engine's dual steps, safeguard and Gram-eigenvalue rescale "
                    r"are $O_m \times O_n$-equivariant, and the polar retraction commutes with both rotations.",
                    _step(lambda p: ManifoldMuon(p, lr=0.1, manifold=Stiefel(), compute_dtype=None),
                          "ManifoldMuon[Stiefel]", Stiefel()), "tall"),
        Declaration("ManifoldMuon[DGram]", "step", SCP, H,
                    "Momentum is linear; the engine's dual steps, ADMM polish and column-norm-keeping "
                    r"retraction are spectral functions and products of $W^\top W$, $W^\top G$ and $G^\top G$, which "
                    r"$O_m$ leaves unchanged and signed column permutations conjugate; the penalty "
                    r"$\lVert Z\rVert_F$ is invariant.",
                    _step(lambda p: ManifoldMuon(p, lr=0.1, manifold=DGram(), compute_dtype=None),
                          "ManifoldMuon[DGram]", DGram()), "tall"),
        Declaration("ManifoldMuon[Stiefel, projected]", "step", BO, H,
                    "The projected solver: momentum, the tangent projection, Polar Express on the projected "
                    "momentum, unit-ball clips of the direction's Gram eigenvalues and the measured polar "
                    r"retraction, each $O_m \times O_n$-equivariant.",
                    _step(lambda p: ManifoldMuon(p, lr=0.1, manifold=Stiefel(), compute_dtype=None, solver="projected"),
                          "ManifoldMuon[Stiefel, projected]", Stiefel()), "tall"),
    ]
    return rows


def table_rows() -> list[tuple[str, str, str, str]]:
    """``(update, group, expected, rationale)`` for every declaration, for the docs."""
    return [(d.label, type(d.group).__name__, d.expected, d.rationale) for d in declarations()]
