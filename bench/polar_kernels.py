r"""Accuracy and time of the polar-factor kernels of :func:`geomuon.manifolds.linalg.msign`.

Kernels: ``newton_schulz`` (Keller Jordan's quintic, 5 steps), ``polar_express_5``
(5 steps), ``polar_express`` (12 steps) in bf16 and fp32, and ``svd`` in fp32 (torch
has no bf16 SVD). Shapes (default): GPT-ish 384×384, 384×1152, 1536×384 and a batch
6 × 384×384.

Accuracy, on two inputs per shape:

* ``κ=1e3``: $X = U\operatorname{diag}(\sigma)V^\top$ with Haar-random $U, V$ and
  singular values log-spaced from 1 to $10^{-3}$ (condition number $10^3$);
* ``Gaussian``: i.i.d. normal entries, like a momentum buffer of noisy gradients (square
  ones are ill-conditioned, $\kappa \approx 2n$ typically; rectangular ones are not).

Each kernel gets the input rounded to its dtype, and its output is compared, in fp64,
with the exact polar factor $UV^\top$ *of that rounded input* (fp64 SVD), so the error is
the kernel's own: the spectral-norm error $\|\operatorname{msign}(X) - UV^\top\|_2$ and
the range $[\sigma_{\min}, \sigma_{\max}]$ of the output's singular values (1 for an
exact polar factor). For a batch, the worst matrix (largest error, extreme σ).

Time: every kernel of every shape, on the Gaussian input, timed **interleaved** (one call
of each per round; :func:`bench.timing.interleaved_medians`), median over rounds, and
as a ratio to ``newton_schulz`` in bf16 on the same shape.

Usage::

    python bench/polar_kernels.py --threads 1            # default sizes (~1 min on one thread)
    python bench/polar_kernels.py --quick                # seconds: a smoke test
    python bench/polar_kernels.py --threads 1 --markdown docs/results/benchmarks/polar_kernels.md --overwrite
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/polar_kernels.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import CLOCKS, Provenance, add_arguments, interleaved_medians, markdown_table  # noqa: E402
from geomuon.manifolds import Stiefel  # noqa: E402
from geomuon.manifolds.linalg import KELLER_QUINTIC, POLAR_EXPRESS, POLAR_EXPRESS_5, msign  # noqa: E402

#: (method, dtype name) of every kernel measured; svd only in fp32 (torch has no bf16 SVD).
KERNELS = [(method, dtype) for method in ("newton_schulz", "polar_express_5", "polar_express")
           for dtype in ("bf16", "fp32")] + [("svd", "fp32")]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BASELINE = ("newton_schulz", "bf16")
SHAPES = {
    "full": [(384, 384), (384, 1152), (1536, 384), (6, 384, 384)],
    "quick": [(48, 48), (48, 144), (192, 48), (3, 48, 48)],
}
#: Condition number of the controlled-spectrum input.
CONDITION = 1e3
INPUTS = ("κ=1e3", "Gaussian")


def log_spectrum(k: int, condition: float = CONDITION) -> torch.Tensor:
    """``k`` singular values log-spaced from 1 down to ``1/condition`` (fp64)."""
    return torch.logspace(0.0, -torch.log10(torch.tensor(condition)).item(), k, dtype=torch.float64)


def make_inputs(shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """The fp64 inputs of one shape: ``κ=1e3`` (log-spaced spectrum) and ``Gaussian``."""
    generator = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    k = min(m, n)
    # Haar-distributed frames: the polar factor of a Gaussian matrix (Stiefel.random).
    U = Stiefel().random(*batch, m, k, dtype=torch.float64, generator=generator)
    V = Stiefel().random(*batch, n, k, dtype=torch.float64, generator=generator)
    controlled = (U * log_spectrum(k)) @ V.mT
    gaussian = torch.randn(shape, dtype=torch.float64, generator=generator)
    return {"κ=1e3": controlled, "Gaussian": gaussian}


@dataclass(frozen=True)
class Accuracy:
    error: float  # largest ‖msign(X) − UVᵀ‖₂ over the batch
    sigma_min: float  # smallest singular value of the output over the batch
    sigma_max: float  # largest


def accuracy(method: str, dtype: torch.dtype, X: torch.Tensor) -> Accuracy:
    """The kernel's error against the exact polar factor of its (rounded) input."""
    rounded = X.to(dtype)
    U, _, Vh = torch.linalg.svd(rounded.double(), full_matrices=False)
    output = msign(rounded, method).double()
    sigma = torch.linalg.svdvals(output)
    error = torch.linalg.matrix_norm(output - U @ Vh, ord=2)
    return Accuracy(error.max().item(), sigma.min().item(), sigma.max().item())


def measure(shapes, repeats: int, clock, seed: int = 0):
    """``(accuracies, medians)``: ``accuracies[(shape, method, dtype, input)]`` and the
    median seconds ``medians[(shape, method, dtype)]``, all kernels timed interleaved."""
    accuracies, runs = {}, {}
    for index, shape in enumerate(shapes):
        inputs = make_inputs(shape, seed + index)
        for method, dtype in KERNELS:
            for name, X in inputs.items():
                accuracies[(shape, method, dtype, name)] = accuracy(method, DTYPES[dtype], X)
            timed = inputs["Gaussian"].to(DTYPES[dtype])
            runs[(shape, method, dtype)] = lambda X=timed, method=method: msign(X, method)
    return accuracies, interleaved_medians(runs, repeats, clock)


def shape_label(shape: tuple[int, ...]) -> str:
    *batch, m, n = shape
    return " × ".join([*map(str, batch), f"{m}×{n}"])


def table(shapes, accuracies, medians) -> str:
    header = ["shape", "kernel", "dtype", "time (ms)", "ratio"]
    for name in INPUTS:
        header += [f"error {name}", f"σ range {name}"]
    rows = []
    for shape in shapes:
        base = medians[(shape, *BASELINE)]
        for method, dtype in KERNELS:
            seconds = medians[(shape, method, dtype)]
            cells = [shape_label(shape), method, dtype, f"{1e3 * seconds:.3g}", f"{seconds / base:.2f}"]
            for name in INPUTS:
                acc = accuracies[(shape, method, dtype, name)]
                cells += [f"{acc.error:.2e}", f"[{acc.sigma_min:.5f}, {acc.sigma_max:.5f}]"]
            rows.append(cells)
    return markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=7, threads=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    provenance = Provenance(__file__, args, argv, parser)
    torch.set_num_threads(args.threads)
    shapes = SHAPES["quick" if args.quick else "full"]
    accuracies, medians = measure(shapes, args.repeats, CLOCKS[args.clock], args.seed)
    steps = ", ".join(f"{s.name} {s.default_steps}" for s in (KELLER_QUINTIC, POLAR_EXPRESS_5, POLAR_EXPRESS))
    text = (
        f"Polar-factor kernels of `geomuon.manifolds.linalg.msign`: spectral-norm error against the exact polar "
        f"factor of the kernel's (rounded) input and the range of the output's singular values, on a "
        f"log-spaced spectrum of condition {CONDITION:g} (κ=1e3) and on a Gaussian matrix; time on the "
        f"Gaussian input, median of {args.repeats} interleaved rounds ({args.threads} thread(s), {args.clock} "
        f"clock), and its ratio to {' '.join(BASELINE)} on the same shape. Steps: {steps}.\n\n"
        + table(shapes, accuracies, medians)
    )
    return provenance.finish(text)


if __name__ == "__main__":
    raise SystemExit(main())
