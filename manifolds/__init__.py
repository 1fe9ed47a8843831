r"""Matrix manifolds (geoopt-compatible) and the linear-algebra kernels under them.

Every manifold subclasses :class:`MatrixManifold` (a ``geoopt.Manifold`` acting on
``[..., m, n]``) and exposes its tangent constraint (``constraint``,
``constraint_adjoint``, ``constraint_gram_diag``) for the steepest-descent engine.
Every subclass registers itself by name (``MatrixManifold.by_name("stiefel")``,
``MatrixManifold.registered()``) and round-trips through plain data
(``manifold.spec()``, ``MatrixManifold.from_spec(spec)``).
The kernels stay importable as ``geomuon.manifolds.linalg``.
"""

from . import linalg
from .base import MatrixManifold, matrix_method
from .dgram import DGram
from .euclidean import Euclidean
from .linalg import (
    KELLER_QUINTIC,
    MSIGN_METHODS,
    POLAR_EXPRESS,
    POLAR_EXPRESS_5,
    NSSchedule,
    inv_sqrt_psd,
    msign,
    nuclear_norm,
    off_diagonal,
    power_iteration,
    spectral_norm,
    sym,
)
from .lpro import LPRO
from .oblique import Oblique
from .router import CenteredRouterSpace
from .stiefel import Stiefel

__all__ = [
    "MatrixManifold",
    "matrix_method",
    "Euclidean",
    "Stiefel",
    "DGram",
    "Oblique",
    "CenteredRouterSpace",
    "LPRO",
    "linalg",
    "NSSchedule",
    "KELLER_QUINTIC",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_5",
    "MSIGN_METHODS",
    "msign",
    "inv_sqrt_psd",
    "power_iteration",
    "nuclear_norm",
    "spectral_norm",
    "off_diagonal",
    "sym",
]
