r"""The declared symmetry table: for every update of the library and every group, whether
equivariance **must hold** or **must fail**.

This is the one place that names concrete updates next to :mod:`geomuon.theory.groups` groups.
The equivariance suite (``tests/test_declared_table.py``) runs every row with hypothesis:
a ``holds`` row must stay within the round-off bound
:func:`geomuon.theory.equivariance.roundoff_tolerance` on every example (float64, inputs with
$\kappa_2 \le 100$, or $\le 10$ for maps computed through a Gram matrix), a ``fails``
row must show a relative residual $\ge 10^{-2}$ on a counterexample hypothesis finds.
The docs render :func:`table_rows`.

Three kinds of update appear:

* ``map``: a pure map of :mod:`geomuon.optimizers.maps`, $U(g\cdot D)$ vs $g\cdot U(D)$;
* ``direction``: the engine's steepest direction on a manifold,
  $A(gW, gG)$ vs $g\,A(W, G)$ (fixed 5 dual steps, exact feasibility rescaling);
* ``step``: three optimizer steps from $gW_0$ with gradients $gG_t$ vs $g\cdot$(the steps
  from $W_0$ with $G_t$), momentum and weight decay included, float64.

Adding an update to the library means adding its rows here; changing an update's
symmetry means changing its row (and its rationale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from geomuon.manifolds import LPRO, POLAR_EXPRESS, CenteredRouterSpace, DGram, Euclidean, Oblique, Stiefel
from geomuon.theory.equivariance import DirectionUpdate, MapUpdate, OptimizerUpdate
from geomuon.theory.groups import (
    BiOrthogonal,
    Group,
    LeftPermRightOrth,
    NeuronPermutation,
    RightPermLeftOrth,
    RouterShift,
    SignedColumnPermutation,
    SignedPermutation,
    SignedRowPermutation,
)

from geomuon.optimizers import maps
from geomuon.optimizers.manifold_muon import ManifoldMuon
from geomuon.optimizers.muon import Muon
from geomuon.optimizers.polar import HybridPolarGradM, LeftPolarGradM, RightPolarGradM, RowNormM
from geomuon.optimizers.steepest import steepest_direction

__all__ = ["Declaration", "declarations", "table_rows", "EXACT_SOLVER", "PE_MAX_SLOPE", "msign_slope_at_zero"]

#: Engine settings of the ``direction`` rows: a fixed number of dual steps (no tolerance
#: test, no best-iterate selection) so the computation is one fixed composition of
#: equivariant maps, and the final rescaling by the exact spectral norm. Depth for the
#: round-off bound: 16 stages per dual step. Five steps, because the fixed-step iteration
#: at alpha = 1 amplifies round-off about tenfold per step on Stiefel once it oscillates
#: (measured on 3x2, 30 draws: residual 2e-14 after 5 steps, 3e-10 after 10, 1e-4 after 20,
#: with the SVD msign as well) — a property of the dual iteration, not of the symmetry.
EXACT_SOLVER = dict(
    preset=None, steps=5, alpha=1.0, decay=True, tol=0.0, certify=None, track_best=False,
    exact_norm=True,
)

#: The same with the engine's cheap feasibility rescaling ($\sigma_{\max}$ from the
#: eigenvalues of the small Gram matrix), as ``ManifoldMuon`` calls it.
FAST_RESCALE_SOLVER = dict(EXACT_SOLVER, exact_norm=False)

#: Round-off growth of a centered Gram-based map. $\Pi^\perp D$ has the exact null vector
#: $\mathbf 1$, so its Gram matrix is singular: the coupled Newton–Schulz inverse square
#: root (:func:`geomuon.manifolds.linalg.inv_sqrt_psd`, 25 steps) grows the regularized null
#: eigenvalue's factor by 1.5 per step, and round-off leaking into that direction is
#: amplified by up to $1.5^{25} \approx 2.5\cdot10^4$ before the output is re-centered.
SINGULAR_GRAM_GROWTH = 1.5**25


def msign_slope_at_zero(schedule) -> float:
    r"""$p'(0)$ of a Newton–Schulz schedule's composed odd polynomial $p$ on normalized
    singular values: each step $x \mapsto ax + bx^3 + cx^5$ has slope $a$ at 0 and maps 0 to
    0, so by the chain rule $p'(0) = \prod_k a_k / \text{input\_scale}$ (exact, no grid)."""
    return math.prod(a for a, _, _ in schedule.step_coefficients(schedule.default_steps)) / schedule.input_scale


#: Largest slope of the default msign (Polar Express, 12 steps, input $\div 1.01$) on
#: $[0, 1]$: about $7.8\cdot10^4$, attained at 0 (``tests/test_declared_table.py`` checks
#: on a fine grid that no other point is steeper). The most an msign can amplify relative
#: round-off, whatever the input's conditioning — the bound used where an update applies
#: msign to matrices with (structurally or possibly) zero singular values.
PE_MAX_SLOPE = msign_slope_at_zero(POLAR_EXPRESS)

BO, LPRO_G, RPLO = BiOrthogonal(), LeftPermRightOrth(), RightPermLeftOrth()
SCP, SRP, SP = SignedColumnPermutation(), SignedRowPermutation(), SignedPermutation()
NP, SHIFT = NeuronPermutation(), RouterShift()


@dataclass(frozen=True)
class Declaration:
    """One row: ``update`` (display name) under ``group`` is ``expected`` (``"holds"`` or
    ``"fails"``), because ``rationale``. ``build()`` returns the
    :mod:`geomuon.theory.equivariance` subject; ``orientation`` (``"any"``, ``"tall"`` $m \\ge n$,
    ``"wide"`` $m < n$) restricts the shapes the row is declared on."""

    update: str
    kind: str
    group: Group
    expected: str
    rationale: str
    build: Callable[[], object]
    orientation: str = "any"

    @property
    def label(self) -> str:
        """The update's name, with the orientation when the row is restricted to one."""
        return self.update if self.orientation == "any" else f"{self.update} ({self.orientation})"

    @property
    def id(self) -> str:
        return f"{self.label} | {self.group.name} | {self.expected}"


def _map(fn, name: str, **kwargs) -> Callable[[], MapUpdate]:
    return lambda: MapUpdate(fn, name=name, **kwargs)


def _centered_conditioning(D):
    r"""Coordinates of $\Pi^\perp D$ in an orthonormal basis of $\mathbf 1^\perp$: the
    matrix a centered map effectively works on, without the structural zero singular
    value along $\mathbf 1$ (whose round-off the final re-centering removes)."""
    m = D.size(-2)
    # Helmert basis: row k-1 is (1, ..., 1, -k, 0, ..., 0) / sqrt(k(k+1)), k = 1..m-1.
    helmert = torch.zeros(m - 1, m, dtype=D.dtype)
    for k in range(1, m):
        helmert[k - 1, :k] = 1.0
        helmert[k - 1, k] = -float(k)
        helmert[k - 1] /= math.sqrt(k * (k + 1))
    return helmert @ D


def _swiglu_symmetry_update(block):
    """Seed 004's SwiGLU stack: row-aware hybrid for gate/up, column-aware for down."""
    gate, up, down = block
    return maps.hybrid(gate), maps.hybrid(up), maps.hybrid(down.mT).mT


def _spectral_each(block):
    return tuple(maps.spectral(W) for W in block)


def _direction(manifold, solver=EXACT_SOLVER, name: str = "") -> Callable[[], DirectionUpdate]:
    label = name or f"steepest[{type(manifold).__name__}]"
    # The dual iterates G + L*(Lambda_k) may be nearly singular: msign's largest slope
    # bounds the round-off amplification (measured: 3x2..4x3 Stiefel draws reach 1e-10).
    return lambda: DirectionUpdate(steepest_direction, manifold, dict(solver), name=label,
                                   amplification=PE_MAX_SLOPE)


def _step(factory, name: str, manifold=None, **kwargs) -> Callable[[], OptimizerUpdate]:
    return lambda: OptimizerUpdate(factory, name=name, manifold=manifold, steps=3, **kwargs)


def declarations() -> list[Declaration]:
    """Every declared (update, group) pair."""
    H, F = "holds", "fails"
    rows = [
        # --- pure maps -------------------------------------------------------------
        Declaration("spectral", "map", BO, H,
                    "msign(LDRᵀ) = L msign(D) Rᵀ; the Polar Express iteration is an odd matrix "
                    "polynomial p(DDᵀ)D, equivariant up to round-off.", _map(maps.spectral, "spectral")),
        Declaration("spectral", "map", LPRO_G, H, "S_m × O_n is a subgroup of O_m × O_n.",
                    _map(maps.spectral, "spectral")),
        Declaration("spectral", "map", SCP, H, "O_m × signed column permutations ⊂ O_m × O_n.",
                    _map(maps.spectral, "spectral")),
        Declaration("spectral", "map", SHIFT, F,
                    "Uncentered: a shared logit shift 1vᵀ changes msign(D), though softmax ignores it.",
                    _map(maps.spectral, "spectral")),
        Declaration("row_norm", "map", LPRO_G, H,
                    "Row norms are permuted by S_m and unchanged by right rotations.",
                    _map(maps.row_norm, "row_norm")),
        Declaration("row_norm", "map", BO, F,
                    "Left rotations mix rows and change their norms.", _map(maps.row_norm, "row_norm")),
        Declaration("row_norm", "map", RPLO, F, "O_m on the left mixes rows.",
                    _map(maps.row_norm, "row_norm")),
        Declaration("row_norm", "map", SHIFT, F, "Uncentered: the shift changes every row norm.",
                    _map(maps.row_norm, "row_norm")),
        Declaration("col_norm", "map", RPLO, H,
                    "Column norms are permuted by S_n and unchanged by left rotations.",
                    _map(maps.col_norm, "col_norm")),
        Declaration("col_norm", "map", SCP, H, "Signed column permutations permute column norms.",
                    _map(maps.col_norm, "col_norm")),
        Declaration("col_norm", "map", LPRO_G, F, "Right rotations mix columns.",
                    _map(maps.col_norm, "col_norm")),
        Declaration("right_polar", "map", BO, H,
                    "‖D‖_*^α D(DᵀD)^{-1/2}: DᵀD ↦ R DᵀD Rᵀ and the nuclear norm is invariant. Declared "
                    "on tall D (its Gram side); round-off through the Gram matrix scales with κ².",
                    _map(maps.right_polar, "right_polar", condition_power=2, depth=32), "tall"),
        Declaration("left_polar", "map", BO, H,
                    "(DDᵀ)^{-1/2}D ‖D‖_*^α: the mirror image of right_polar, declared on wide D.",
                    _map(maps.left_polar, "left_polar", condition_power=2, depth=32), "wide"),
        Declaration("hybrid", "map", LPRO_G, H,
                    "msign(row_norm(D)) scaled by its nuclear norm: both stages are S_m × O_n-equivariant.",
                    _map(maps.hybrid, "hybrid")),
        Declaration("hybrid", "map", BO, F, "The row normalization breaks left rotations.",
                    _map(maps.hybrid, "hybrid")),
        Declaration("sign", "map", SP, H, "Coordinate-wise: commutes with signed permutations.",
                    _map(maps.sign, "sign")),
        Declaration("sign", "map", BO, F, "Coordinate-wise maps are not rotation-equivariant (Adam's flaw).",
                    _map(maps.sign, "sign")),
        Declaration("sign", "map", LPRO_G, F, "Right rotations break the coordinate basis.",
                    _map(maps.sign, "sign")),
        Declaration("centered(spectral)", "map", SHIFT, H,
                    "Π^⊥ kills the shift and commutes with P; msign is O_d-equivariant on the right.",
                    _map(maps.centered(maps.spectral), "centered(spectral)", conditioning=_centered_conditioning)),
        Declaration("centered(row_norm)", "map", SHIFT, H,
                    "Centered input, row scaling, re-centered output: invariant to shifts.",
                    _map(maps.centered(maps.row_norm), "centered(row_norm)", conditioning=_centered_conditioning)),
        Declaration("centered(left_polar)", "map", SHIFT, H,
                    "LeftPolarGradM's router map: Π^⊥ (M_cM_cᵀ)^{-1/2} M_c ‖M_c‖_*^α.",
                    _map(maps.centered(maps.left_polar), "centered(left_polar)", condition_power=2, depth=32,
                         conditioning=_centered_conditioning, amplification=SINGULAR_GRAM_GROWTH), "wide"),
        Declaration("centered(hybrid)", "map", SHIFT, H,
                    "Centered row normalization then msign. Row scaling moves the structural null "
                    "vector of Π^⊥D off 1, so msign's slope at 0 amplifies round-off there.",
                    _map(maps.centered(maps.hybrid), "centered(hybrid)", conditioning=_centered_conditioning,
                         amplification=PE_MAX_SLOPE)),
        Declaration("swiglu hybrid stack", "map", NP, H,
                    "Row-aware hybrid on W_gate, W_up (P on rows) and column-aware on W_down (Pᵀ on columns).",
                    _map(_swiglu_symmetry_update, "swiglu hybrid stack")),
        Declaration("spectral per matrix", "map", NP, H, "Permutations are orthogonal.",
                    _map(_spectral_each, "spectral per matrix")),
        # --- steepest directions on manifolds ---------------------------------------
        Declaration("steepest[Stiefel]", "direction", BO, H,
                    "O_m × O_n maps Stiefel to itself, L_{gW}(gA) = R L_W(A) Rᵀ, and every dual step "
                    "composes equivariant maps (wide matrices: the transposed geometry, same group).",
                    _direction(Stiefel())),
        Declaration("steepest[DGram]", "direction", SCP, H,
                    "DGram = {Q diag(d)} is preserved by O_m × signed column permutations, which permute "
                    "the Jacobi weights 2(d_i² + d_j²) consistently.", _direction(DGram()), "tall"),
        Declaration("steepest[DGram]", "direction", SRP, H,
                    "Wide DGram uses the transposed geometry (orthogonal rows), whose symmetry is "
                    "signed row permutations × O_n.", _direction(DGram()), "wide"),
        Declaration("steepest[DGram]", "direction", SCP, F,
                    "On wide matrices the columns are not the constrained side: left rotations take "
                    "W off DGram.", _direction(DGram()), "wide"),
        Declaration("steepest[DGram]", "direction", BO, F,
                    "Right rotations take Q diag(d) off DGram: its symmetry is not O_m × O_n.",
                    _direction(DGram()), "tall"),
        Declaration("steepest[Oblique]", "direction", SCP, H,
                    "Unit columns are preserved by left rotations and signed column permutations.",
                    _direction(Oblique()), "tall"),
        Declaration("steepest[Oblique]", "direction", BO, F, "Right rotations change column norms.",
                    _direction(Oblique()), "tall"),
        Declaration("steepest[CenteredRouterSpace]", "direction", SHIFT, H,
                    "Closed form msign(Π^⊥G): invariant to shifts of W and G.", _direction(CenteredRouterSpace())),
        Declaration("steepest[Euclidean]", "direction", SHIFT, F,
                    "msign(G) sees the shift of G.", _direction(Euclidean())),
        Declaration("steepest[LPRO(radius=1)]", "direction", LPRO_G, H,
                    "Rows of fixed norm are permuted by S_m and rotated by O_n.", _direction(LPRO(radius=1.0)), "tall"),
        Declaration("steepest[LPRO(radius=1)]", "direction", BO, F,
                    "Left rotations change row norms.", _direction(LPRO(radius=1.0)), "tall"),
        Declaration("steepest[Stiefel], cheap rescale", "direction", BO, H,
                    "The cheap feasibility rescale divides by sigma_max from the small Gram matrix's "
                    "eigenvalues, an O_m × O_n invariant.", _direction(Stiefel(), FAST_RESCALE_SOLVER,
                                                 "steepest[Stiefel], cheap rescale"), "tall"),
        # --- optimizer steps --------------------------------------------------------
        Declaration("Muon", "step", BO, H,
                    "Nesterov momentum and decoupled weight decay are linear; Newton–Schulz is a matrix "
                    "polynomial (float64 compute; in bf16 the residual is bf16 round-off, ~3e-2).",
                    _step(lambda p: Muon(p, lr=0.1, weight_decay=0.1, compute_dtype=None), "Muon")),
        Declaration("Muon", "step", NP, H, "Per-matrix spectral steps commute with neuron permutations.",
                    _step(lambda p: Muon(p, lr=0.1, weight_decay=0.1, compute_dtype=None), "Muon")),
        Declaration("AdamW", "step", BO, F,
                    "Per-coordinate second moments are not rotation-equivariant.",
                    _step(lambda p: torch.optim.AdamW(p, lr=0.1), "AdamW")),
        Declaration("AdamW", "step", SP, H, "Per-coordinate updates commute with signed permutations.",
                    _step(lambda p: torch.optim.AdamW(p, lr=0.1), "AdamW")),
        Declaration("RowNormM", "step", LPRO_G, H, "Momentum is linear; row_norm is S_m × O_n-equivariant.",
                    _step(lambda p: RowNormM(p, lr=0.1, weight_decay=0.1), "RowNormM")),
        Declaration("RowNormM", "step", BO, F, "row_norm breaks left rotations.",
                    _step(lambda p: RowNormM(p, lr=0.1, weight_decay=0.1), "RowNormM")),
        Declaration("RightPolarGradM", "step", BO, H, "right_polar is O_m × O_n-equivariant (tall).",
                    _step(lambda p: RightPolarGradM(p, lr=0.1, weight_decay=0.1), "RightPolarGradM",
                          condition_power=2), "tall"),
        Declaration("HybridPolarGradM", "step", LPRO_G, H, "hybrid is S_m × O_n-equivariant.",
                    _step(lambda p: HybridPolarGradM(p, lr=0.1, weight_decay=0.1), "HybridPolarGradM")),
        Declaration("HybridPolarGradM", "step", BO, F, "hybrid breaks left rotations.",
                    _step(lambda p: HybridPolarGradM(p, lr=0.1, weight_decay=0.1), "HybridPolarGradM")),
        Declaration("LeftPolarGradM(centered)", "step", SHIFT, H,
                    "The centered map ignores shifts of the momentum, so W + 1vᵀ moves exactly like W.",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1, centered=True), "LeftPolarGradM(centered)",
                          condition_power=2),
                    "wide"),
        Declaration("LeftPolarGradM(centered, weight_decay)", "step", SHIFT, F,
                    "Decoupled weight decay shrinks the shift component 1vᵀ too: harmless for the "
                    "router's function, but the point trajectory is not shift-equivariant.",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1, centered=True, weight_decay=0.1),
                          "LeftPolarGradM(centered, weight_decay)"), "wide"),
        Declaration("LeftPolarGradM", "step", SHIFT, F, "Uncentered: gradient shifts leak into the update.",
                    _step(lambda p: LeftPolarGradM(p, lr=0.1), "LeftPolarGradM"), "wide"),
        Declaration("ManifoldMuon[Stiefel]", "step", BO, H,
                    "Momentum is linear, the engine's dual steps, safeguard and Gram-eigenvalue rescale "
                    "are O_m × O_n-equivariant, and the polar retraction commutes with both rotations.",
                    _step(lambda p: ManifoldMuon(p, lr=0.1, manifold=Stiefel(), compute_dtype=None),
                          "ManifoldMuon[Stiefel]", Stiefel()), "tall"),
    ]
    return rows


def table_rows() -> list[tuple[str, str, str, str]]:
    """``(update, group, expected, rationale)`` for every declaration, for the docs."""
    return [(d.label, type(d.group).__name__, d.expected, d.rationale) for d in declarations()]
