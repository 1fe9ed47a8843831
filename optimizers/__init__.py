"""Update maps, the steepest-descent engine and the matrix optimizers (docs: concepts/steepest-descent).

``msign`` is re-exported from :mod:`geomuon.manifolds.linalg`, where the kernel lives.
"""

from geomuon.manifolds.linalg import msign

from . import maps
from .base import MatrixOptimizer, OffManifoldError
from .manifold_muon import ManifoldMuon
from .muon import Muon
from .polar import HybridPolarGradM, LeftPolarGradM, RightPolarGradM, RowNormM
from .steepest import NORMS, SolverSettings, SteepestResult, steepest_direction

__all__ = [
    "msign",
    "maps",
    "MatrixOptimizer",
    "OffManifoldError",
    "Muon",
    "ManifoldMuon",
    "RowNormM",
    "RightPolarGradM",
    "LeftPolarGradM",
    "HybridPolarGradM",
    "steepest_direction",
    "SteepestResult",
    "SolverSettings",
    "NORMS",
]
