r"""The harness's negative control (ours, not geoopt's): a Stiefel whose tangent projection
drops the symmetrization, $u - WW^\top u$ instead of $u - W\operatorname{sym}(W^\top u)$.
The result is still tangent (it satisfies $W^\top V = 0$, a stricter condition) but it is
not the orthogonal projection, so geoopt's projection tests must fail with it substituted
(``GEOMUON_GEOOPT_STIEFEL=negative_control:StiefelWithoutSym``)."""

from geomuon.manifolds import Stiefel, matrix_method


class StiefelWithoutSym(Stiefel):
    name = "StiefelWithoutSym"

    @matrix_method("u")
    def proju(self, x, u):
        return u - x @ (x.mT @ u)
