r"""The equivariance checker's catalogue: update maps and optimizers with a known verdict,
correct ones and ones with the subtle bugs the checker must catch.

One definition serves the checker's benchmark (``bench/equivariance_checker.py``, which
names them ``bench.equivariance_catalogue:NAME`` on the CLI) and its tests
(``tests/test_equivariance.py``). Every map takes ``[..., m, n]`` and returns the same shape
and dtype; those built on :func:`geomuon.optimizers.maps.spectral` (Newton–Schulz matmuls)
run in bfloat16 too, the SVD-based ones do not (``linalg.svd`` has no bfloat16 kernel).
"""

from __future__ import annotations

import torch


def _spectral(D):
    """geomuon's Newton–Schulz msign (:func:`geomuon.optimizers.maps.spectral`), imported on
    first use: a CLI check of a plain-torch map here (the benchmark times one, import
    included) then imports what a user's own module would, not ``geomuon.optimizers``."""
    from geomuon.optimizers.maps import spectral

    return spectral(D)


def svd_msign(D):
    """Exact polar factor $UV^\\top$ (SVD): $O_m\\times O_n$-equivariant."""
    U, _, Vh = torch.linalg.svd(D, full_matrices=False)
    return U @ Vh


def cubic(D):
    """$DD^\\top D$: a matrix polynomial, $O_m\\times O_n$-equivariant."""
    return D @ D.mT @ D


def frobenius_normalized(D):
    """$D/\\|D\\|_F$ (zero stays zero): equivariant under every orthogonal group."""
    norm = torch.linalg.matrix_norm(D, keepdim=True)  # (one norm per matrix of a stack)
    return D / torch.where(norm > 0, norm, 1.0)


def _row_unit(D):
    norm = D.norm(dim=-1, keepdim=True)
    return D / torch.where(norm > 0, norm, 1.0)


def row_unit(D):
    """Rows scaled to unit norm, zero rows kept: $S_m\\times O_n$-equivariant and invariant
    under positive row scalings."""
    return _row_unit(D)


def col_unit(D):
    """Columns scaled to unit norm, zero columns kept: $O_m\\times S_n$-equivariant."""
    return _row_unit(D.mT).mT


def sign(D):
    """Entrywise sign: signed permutations and positive scalings hold, rotations break it."""
    return torch.sign(D)


def _centered(msign, D):
    centered = D - D.mean(dim=-2, keepdim=True)
    out = msign(centered)
    return out - out.mean(dim=-2, keepdim=True)


def centered_msign(D):
    r"""$\Pi^\perp\operatorname{msign}(\Pi^\perp D)$ (SVD): invariant to router shifts."""
    return _centered(svd_msign, D)


def rownorm_msign(D):
    """msign of the row-normalized input: equivariant under $S_m\\times O_n$, not $O_m$."""
    return svd_msign(_row_unit(D))


def biased_msign(D):
    """msign of $D$ plus a fixed all-ones bias of $D$'s RMS size: breaks every rotation."""
    rms = D.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt()
    return svd_msign(D + rms)


def power_iteration(D, steps: int):
    """Rank-one approximation $(Dv)v^\\top$ after ``steps`` power steps from a fixed start
    vector $v_0 = \\mathbf 1/\\sqrt n$, which is not rotated with $D$."""
    v = torch.ones(D.shape[-1], 1, dtype=D.dtype) / D.shape[-1] ** 0.5
    for _ in range(steps):
        v = D.mT @ (D @ v)
        v = v / v.norm().clamp_min(torch.finfo(D.dtype).tiny)
    return (D @ v) @ v.mT


def power3(D):
    """Top singular pair by 3 power steps from a fixed start: broken by the unconverged start."""
    return power_iteration(D, 3)


def power200(D):
    """200 power steps: converged unless $\\sigma_2/\\sigma_1 \\ge 0.99$ (clustered spectra)."""
    return power_iteration(D, 200)


def thresholded_msign(D):
    """msign after zeroing entries below $10^{-6}$: broken for inputs of that scale."""
    return svd_msign(torch.where(D.abs() < 1e-6, torch.zeros_like(D), D))


def half_flip(D):
    """msign, negated when $D_{00} < 0$: breaks on about half the draws of any group that
    moves the corner entry."""
    return svd_msign(D) * torch.where(D[..., :1, :1] < 0, -1.0, 1.0).to(D.dtype)


def adam_like(D):
    r"""$D / (|D| + \epsilon)$, $\epsilon = 10^{-8}$: Adam's step; the $\epsilon$ breaks the
    invariance under positive row scalings for entries near $\epsilon$."""
    return D / (D.abs() + 1e-8)


def argmax_one_hot(D):
    """One-hot of each column's argmax: a tie goes to the lowest row index, so a row permutation
    of a tied column moves the one to another row than the permutation does (broken only at
    ties: a ``structured`` check)."""
    return torch.zeros_like(D).scatter_(-2, D.argmax(dim=-2, keepdim=True), 1.0)


def dead_column_guard(D):
    """$D/\\|D\\|_F$, with a column that is exactly zero in $D$ set to $e_0$ (a "revive dead
    columns" guard): a fixed unit vector is no equivariant choice under $O_m \\times O_n$ (broken
    only at exact zeros: a ``structured`` check)."""
    e0 = torch.zeros_like(D)
    e0[..., 0, :] = 1.0
    return torch.where((D == 0).all(dim=-2, keepdim=True), e0, frobenius_normalized(D))


def identity_at_zero(D):
    """$D/\\|D\\|_F$, and the identity pattern at $D = 0$ (a "no gradient yet" default): broken
    at the rank-0 input alone, where $g\\cdot 0 = 0$ but $g\\cdot I \\ne I$ (a ``structured``
    check)."""
    norm = torch.linalg.matrix_norm(D, keepdim=True)
    eye = torch.eye(D.shape[-2], D.shape[-1], dtype=D.dtype).expand_as(D)
    return torch.where(norm > 0, frobenius_normalized(D), eye)


def sign_with_positive_zero(D):
    """``D.ge(0) * 2 - 1``: an entrywise sign with sign(0) = +1. Not odd, so a signed
    permutation breaks it at exact zeros, the very inputs where it also jumps under round-off
    (a ``structured`` check)."""
    return torch.where(D >= 0, 1.0, -1.0).to(D.dtype)


def entrywise_batch_max(D):
    """Each entry over the largest magnitude at its position *across the stack* (reduced over
    dim 0 instead of a matrix's own dims): one member's update depends on the others. On one
    matrix it is a sign (signed permutations hold); only a batched check sees the mixing."""
    return D / D.abs().amax(dim=0, keepdim=True).clamp_min(torch.finfo(D.dtype).tiny)


def stack_normalized(D):
    r"""$D_b/\|D\|_F$ with the norm of the *whole stack*: a member's output depends on its
    batch-mates, yet through a quantity every member's orthogonal element leaves unchanged, so
    the map commutes with the product group; only the members-alone test sees it."""
    norm = D.square().sum().sqrt()
    return D / torch.where(norm > 0, norm, 1.0)


def gram_left(D):
    r"""$\operatorname{diag}(1, 2, \dots, m)\,D\,(D^\top D) / \|D\|_F^2$: fixed row weights, so
    $O_n$ on the right holds and $O_m$ on the left breaks."""
    weights = torch.arange(1, D.shape[-2] + 1, dtype=D.dtype).unsqueeze(-1)
    norm2 = D.pow(2).sum(dim=(-2, -1), keepdim=True)
    return (weights * D) @ (D.mT @ D) / torch.where(norm2 > 0, norm2, 1.0)



def unguarded_row_unit(D):
    """Rows divided by their norm without a guard: NaN on a zero row."""
    return D / D.norm(dim=-1, keepdim=True)


def cholesky_polar(D):
    r"""$D R^{-1}$ with $R$ the Cholesky factor of $D^\top D$: raises on a singular Gram matrix."""
    R = torch.linalg.cholesky(D.mT @ D, upper=True)
    return torch.linalg.solve_triangular(R, D, upper=True, left=False)


class HeavyBall(torch.optim.Optimizer):
    """$M \\leftarrow 0.9M + G$, $W \\leftarrow W - \\eta M$: linear, equivariant under every orthogonal group."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @staticmethod
    def update(momentum: torch.Tensor) -> torch.Tensor:
        """The step direction from the momentum."""
        return momentum

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.sub_(group["lr"] * self.update(buf))


class SignSGD(HeavyBall):
    """$W \\leftarrow W - \\eta\\operatorname{sign}(M)$: rotations break it."""

    update = staticmethod(torch.sign)


def rownorm_spectral(D):
    """Newton–Schulz msign of the row-normalized input (bf16-capable): breaks $O_m$ by
    0.1-0.5, under a bf16 floor of about 0.02 at 64x32."""
    return _spectral(_row_unit(D))


def thresholded_spectral(D):
    """Newton–Schulz msign after zeroing entries below $10^{-6}$ (bf16-capable): broken only
    for inputs of that scale, and discontinuous there."""
    return _spectral(torch.where(D.abs() < 1e-6, torch.zeros_like(D), D))


def flushed_sign(D):
    """Entrywise sign with entries below $10^{-6}$ flushed to zero: invariant under positive
    scalings except where a scaling moves an entry across $10^{-6}$ (tiny scales only)."""
    return torch.where(D.abs() < 1e-6, torch.zeros_like(D), torch.sign(D))


def corner_flip(D):
    r"""$D/\|D\|_F$, negated when $D_{00} < 0$ (bf16-capable): broken on about half the draws of
    any group that moves the corner entry, and discontinuous."""
    return frobenius_normalized(D) * torch.where(D[..., :1, :1] < 0, -1.0, 1.0).to(D.dtype)


def bf16_spectral(D):
    r"""Newton–Schulz msign computed in bfloat16 whatever the input's dtype, returned in it:
    $O_m\times O_n$-equivariant up to bfloat16 (a correct map that rounds inside)."""
    return _spectral(D.bfloat16()).to(D.dtype)


def centered_spectral(D):
    r"""$\Pi^\perp\operatorname{msign}(\Pi^\perp D)$ by Newton–Schulz (bf16-capable): invariant
    to router shifts."""
    return _centered(_spectral, D)
