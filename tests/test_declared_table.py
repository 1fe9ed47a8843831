"""The declared symmetry table, run whole with hypothesis.

Every ``holds`` row: the relative residual stays within the round-off bound
:func:`geomuon.theory.equivariance.roundoff_tolerance` (float64; inputs with condition number up
to 100, or 10 for maps computed through a Gram matrix, whose conditioning is kappa^2), and
for pure maps that bound itself is at most 1e-9. Every ``fails`` row: hypothesis finds a
counterexample with residual >= 1e-2, shrinks it and the test re-measures it.
"""

import math

import pytest
from hypothesis import settings

from geomuon.theory.declared import declarations, table_rows
from geomuon.theory.equivariance import MUST_FAIL_RESIDUAL, verify_declaration

DECLARATIONS = declarations()
HOLDS = [d for d in DECLARATIONS if d.expected == "holds"]
FAILS = [d for d in DECLARATIONS if d.expected == "fails"]

# float64 maps must be equivariant to 1e-9 relative (the bound); the derived
# round-off tolerance is checked against it so a too-loose derivation cannot pass.
MAP_TOLERANCE_CAP = 1e-9


def _budget(declaration) -> int:
    # Directions run 20 dual steps and steps run 3 optimizer steps per example: a third of
    # the profile's examples keeps the suite inside its CI budget (the thorough profile
    # still gets hundreds).
    examples = settings.default.max_examples
    return examples if declaration.kind == "map" else max(5, examples // 3)


def _max_condition(subject) -> float:
    # Keep kappa^condition_power <= 100 so the round-off bound stays below the cap.
    return 100.0 ** (1.0 / subject.condition_power)


def test_table_size_and_shape():
    assert len(DECLARATIONS) >= 30
    assert len(FAILS) >= 8
    assert len({d.id for d in DECLARATIONS}) == len(DECLARATIONS), "duplicate rows"
    rows = table_rows()
    assert len(rows) == len(DECLARATIONS)
    assert all(len(row) == 4 and row[2] in ("holds", "fails") and row[3] for row in rows)
    kinds = {d.kind for d in DECLARATIONS}
    assert kinds == {"map", "direction", "step"}


@pytest.mark.parametrize("declaration", HOLDS, ids=[d.id for d in HOLDS])
def test_must_hold(declaration):
    subject = declaration.build()
    verify_declaration(
        subject,
        declaration.group,
        "holds",
        orientation=declaration.orientation,
        max_condition=_max_condition(subject),
        max_examples=_budget(declaration),
        tolerance_cap=MAP_TOLERANCE_CAP if declaration.kind == "map" else None,
    )


@pytest.mark.parametrize("declaration", FAILS, ids=[d.id for d in FAILS])
def test_must_fail(declaration):
    subject = declaration.build()
    case = verify_declaration(
        subject,
        declaration.group,
        "fails",
        orientation=declaration.orientation,
        max_examples=_budget(declaration),
    )
    residual = subject.residual(case.element, case.example)
    print(f"{declaration.id}: residual {residual:.3f} on the shrunk counterexample\n{case!r}")
    assert math.isfinite(residual) and residual >= MUST_FAIL_RESIDUAL


def test_msign_slope_bound_is_attained_at_zero():
    # PE_MAX_SLOPE bounds msign's round-off amplification in the tolerances above; it is
    # the composed Polar Express polynomial's slope at 0 (closed form). Here a fine grid
    # (chain rule in float64) checks that no point of [0, 1] is steeper.
    import numpy as np

    from geomuon.manifolds import POLAR_EXPRESS
    from geomuon.theory.declared import PE_MAX_SLOPE

    x = np.linspace(0.0, 1.0, 200001) / POLAR_EXPRESS.input_scale
    slope = np.full_like(x, 1.0 / POLAR_EXPRESS.input_scale)
    for a, b, c in POLAR_EXPRESS.step_coefficients(POLAR_EXPRESS.default_steps):
        slope = slope * (a + 3 * b * x**2 + 5 * c * x**4)
        x = a * x + b * x**3 + c * x**5
    assert float(np.abs(slope).max()) == pytest.approx(PE_MAX_SLOPE, rel=1e-12)
    assert 1e4 < PE_MAX_SLOPE < 1e5
