r"""The seed studies: each reruns one seed document's experiment at CPU scale, with
several seeds, and writes a results page under ``docs/results/``.

| study | seed | module |
|---|---|---|
| ``manifolds`` | 000, different layers, different manifolds | :mod:`bench.studies.manifolds` |
| ``lipschitz`` | 003, enforced Lipschitz bounds | :mod:`bench.studies.lipschitz` |
| ``symmetry`` | 004, symmetry-compatible updates | :mod:`bench.studies.symmetry` |

Run one with ``geomuon study NAME`` (from a source checkout) or
``python -m bench.studies.NAME`` from the repository root; ``--size tiny`` is the
seconds-long smoke size the tests use, the default ``--size full`` the published one.
"""

STUDIES = {
    "manifolds": "bench.studies.manifolds",
    "lipschitz": "bench.studies.lipschitz",
    "symmetry": "bench.studies.symmetry",
}
