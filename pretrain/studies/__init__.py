r"""The seed studies; the ``geomuon study NAME`` verb that runs them is
:mod:`geomuon.pretrain.studies.command`.

Each study reruns one published experiment at CPU scale, with several seeds, and writes
a results page (Markdown, figures, a JSON record of every run):

| study | question | module |
|---|---|---|
| ``manifolds`` | different layers, different manifolds (Stiefel vs DGram attention and MLP) | :mod:`geomuon.pretrain.studies.manifolds` |
| ``manifolds-sweep`` | every arm of ``manifolds`` at its own learning rate (log grid, extended at the edge) | :mod:`geomuon.pretrain.studies.sweep` |
| ``manifolds-width-sweep`` | ``unconstrained`` and ``hetero`` swept at twice the width: does the best rate move? | :mod:`geomuon.pretrain.studies.manifolds` |
| ``manifolds-long`` | the longer standard configuration: the library's Muon beside ``torch.optim.Muon`` and AdamW | :mod:`geomuon.pretrain.studies.manifolds_long` |
| ``manifolds-long-arms`` | unconstrained, all-Stiefel and hetero at that configuration | :mod:`geomuon.pretrain.studies.manifolds_long_arms` |
| ``lipschitz`` | enforced Lipschitz bounds: the spectral soft cap with Muon | :mod:`geomuon.pretrain.studies.lipschitz` |
| ``symmetry`` | symmetry-compatible updates per module | :mod:`geomuon.pretrain.studies.symmetry` |
| ``symmetry-sweep`` | every arm of ``symmetry`` at its own learning rate | :mod:`geomuon.pretrain.studies.sweep` |

``geomuon study NAME --data PATH`` works from an installed wheel: ``--data`` is the tiny
Shakespeare text (required), the page goes to a new run folder
``runs/studies/NAME-<UTC time>/`` under the current directory (or ``--out DIR``), and
only ``--publish`` writes ``docs/results/`` of a source checkout, for a ``--size full``
run. ``--size tiny`` is the seconds-long smoke size the tests use. The shared machinery
(variants, runner, cache, statistics, page) is :mod:`geomuon.pretrain.studies.common`.
"""

from __future__ import annotations

from . import common, lipschitz, manifolds, manifolds_long, manifolds_long_arms, symmetry

#: study name → study (a module, or a :class:`~geomuon.pretrain.studies.sweep.LearningRateSweep`).
STUDIES = {study.NAME: study for study in (
    manifolds, manifolds.SWEEP, manifolds.WIDTH_SWEEP, manifolds_long, manifolds_long_arms,
    lipschitz,
    symmetry, symmetry.SWEEP,
)}
STUDY_NAMES = tuple(STUDIES)

__all__ = ["STUDIES", "STUDY_NAMES"]
