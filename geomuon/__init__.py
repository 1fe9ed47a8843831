r"""geomuon: optimization on matrix manifolds for transformer optimizer design.

One import name with four subpackages (the repository's top-level folders):

* :mod:`geomuon.manifolds` — matrix manifolds (Stiefel, DGram, Oblique, ...), geoopt-style;
* :mod:`geomuon.optimizers` — the Muon family that consumes them, and weight regulation;
* :mod:`geomuon.theory` — symmetry groups, the equivariance checker, certificates, Lipschitz bounds;
* :mod:`geomuon.pretrain` — GPT pretraining with a per-module geometry.

The subpackages are imported on first use, so ``import geomuon`` stays cheap.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("geomuon")
except PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"

__all__ = ["manifolds", "optimizers", "theory", "pretrain", "__version__"]


def __getattr__(name: str):
    # PEP 562: ``geomuon.manifolds`` works after a bare ``import geomuon``.
    if name in ("manifolds", "optimizers", "theory", "pretrain"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
