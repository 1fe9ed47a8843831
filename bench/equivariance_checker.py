r"""The equivariance checker checked: a catalogue of known-correct and known-broken update
maps and optimizers, run through the CLI (``geomuon check-equivariance``) and the API
(:func:`geomuon.theory.equivariance.check_equivariance`).

Every catalogue entry is a map (or optimizer) of :mod:`bench.equivariance_catalogue`, a group,
the dtypes it runs in and the verdict it must get — ``holds`` (the map is equivariant),
``violated`` (a bug the checker must catch) or ``error`` (the map raises or returns NaN on
some valid input). The broken ones cover each failure class the checker was blind to before:
a row-normalized msign and a biased msign under $O_m\times O_n$, ``sign``, a 3-step power
iteration at condition $10^6$ and a 200-step one (broken when $\sigma_2/\sigma_1 \ge 0.99$),
maps zeroing entries below $10^{-6}$ (broken only at tiny scales), maps flipping their sign on
half the draws, an Adam-like $\epsilon$ under positive row scalings, maps broken only under a
left or only a right rotation, a NaN-producing and a crashing map, maps broken only at ties,
exact zeros or $D = 0$ (an argmax one-hot, a guard filling a dead column with $e_0$, the
identity at $D = 0$, $\operatorname{sign}(0) = +1$; checked with ``--structured``, which
declares the map single-valued there, beside correct maps under the same declaration), a map
mixing the members of a stack (checked at a batched shape ``3xMxN``, beside Newton–Schulz msign
per member); and optimizers: heavy-ball momentum (holds), sign-SGD (violated), geomuon's Muon
as shipped (bf16 Newton–Schulz, float32 weights) with ``--compute-dtype bfloat16`` (holds:
equivariant up to bf16). Without ``--structured`` the checker cannot call the maps broken only
at ties or zeros: it leaves those inputs unresolved, as it must for a map that may be set-valued
there (an SVD polar factor of a rank-deficient matrix). In bfloat16 the discontinuous maps
(``sign``, the thresholds, the corner flips) and the 0.12 violation of a row-normalized
Newton–Schulz msign under a bf16 floor of 0.02 are the cases the float64 witness of
:mod:`geomuon.theory.equivariance` decides; ``bf16_spectral``, which rounds to bf16 inside
whatever its input, must still hold up to bf16. Without ``--compute-dtype`` Muon at float32 has
no expected verdict worth stating (its residual is bf16 round-off, a violation of float32
equivariance), so it is not in the catalogue.

Each (entry, shape, dtype) is one check per route, with the seed ``--seed`` (fixed, so a
rerun reproduces the table). Printed: per route the false positives (a correct map not
reported *holds* but *violated*), false negatives (a broken map reported *holds*),
inconclusives, errors where none was expected, and the median time per check (on --clock); one row
per entry with both routes' verdicts. The CLI route runs in-process (``geomuon.cli.main``)
with the maps imported from this module by the CLI's own import path; the time of a full
CLI process (import included) on a 64x32 map is measured once, separately.

Usage::

    python bench/equivariance_checker.py --threads 1     # float64 6x4, 12x12; float32, bfloat16 64x32, 256x128
    python bench/equivariance_checker.py --quick                     # seconds: a smoke test
    python bench/equivariance_checker.py --threads 1 --markdown docs/results/benchmarks/equivariance_checker.md --overwrite
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/equivariance_checker.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import CLOCKS, Provenance, add_arguments, markdown_table  # noqa: E402
from geomuon import cli as geomuon_cli  # noqa: E402
from geomuon.theory.equivariance import OptimizerUpdate, check_equivariance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODULE = "bench.equivariance_catalogue"


@dataclass(frozen=True)
class Entry:
    """One catalogue check: ``target`` (``module:attribute``) under ``group`` must get
    ``expected``; ``options`` are extra CLI options with a value each (optimizer arguments, dtype,
    condition); ``structured`` checks with ``--structured``; ``batch`` sizes go before every
    shape of a run (``(3,)``: a stack of 3 matrices, one group element each)."""

    target: str
    group: str
    expected: str
    why: str
    options: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float64", "float32")
    structured: bool = False
    batch: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        name = self.target.rpartition(":")[2]
        extra = " ".join(o for o in self.cli_options if not o.startswith("--arg"))
        return f"{name} {extra}".strip()

    @property
    def cli_options(self) -> tuple[str, ...]:
        return self.options + (("--structured",) if self.structured else ())

    def shape(self, shape: str) -> str:
        """A run's ``MxN`` with the entry's batch sizes before it."""
        return "x".join([*map(str, self.batch), shape])


M = f"{MODULE}:"
F64, F32, BF16 = ("float64",), ("float64", "float32"), ("float64", "float32", "bfloat16")
CATALOGUE = [
    Entry(M + "svd_msign", "bi-orthogonal", "holds", "exact polar factor"),
    Entry("geomuon.optimizers.maps:spectral", "bi-orthogonal", "holds", "Polar Express msign", dtypes=BF16),
    Entry("geomuon.optimizers.maps:spectral", "signed-permutation", "holds", "a subgroup of O_m x O_n",
          dtypes=BF16),
    Entry(M + "cubic", "bi-orthogonal", "holds", "matrix polynomial", dtypes=BF16),
    Entry(M + "frobenius_normalized", "left-orthogonal", "holds", "orthogonally invariant norm", dtypes=BF16),
    Entry(M + "row_unit", "left-perm-right-orth", "holds", "row norms permute", dtypes=BF16),
    Entry(M + "row_unit", "row-scaling", "holds", "scale-free rows", dtypes=BF16),
    Entry(M + "col_unit", "right-perm-left-orth", "holds", "column norms permute", dtypes=BF16),
    Entry(M + "sign", "signed-permutation", "holds", "coordinate-wise, discontinuous", dtypes=BF16),
    Entry(M + "sign", "column-scaling", "holds", "scale-free entries, discontinuous", dtypes=BF16),
    Entry(M + "centered_msign", "router-shift", "holds", "centered both sides"),
    Entry(M + "centered_spectral", "router-shift", "holds", "centered Newton-Schulz msign", dtypes=BF16),
    Entry(M + "gram_left", "right-orthogonal", "holds", "right Gram only", dtypes=BF16),
    Entry(M + "frobenius_normalized", "bi-orthogonal", "holds", "single-valued: 0 stays 0", dtypes=BF16,
          structured=True),
    Entry(M + "sign", "signed-permutation", "holds", "single-valued: sign(0) = 0 is odd", dtypes=BF16,
          structured=True),
    Entry("geomuon.optimizers.maps:spectral", "bi-orthogonal", "holds", "msign of each member of a stack",
          dtypes=BF16, batch=(3,)),
    Entry(M + "bf16_spectral", "bi-orthogonal", "holds", "rounds to bf16 inside: holds up to bf16",
          dtypes=("bfloat16",)),
    Entry(M + "rownorm_msign", "bi-orthogonal", "violated", "row normalization breaks O_m"),
    Entry(M + "rownorm_spectral", "bi-orthogonal", "violated", "0.12 under a bf16 floor of 0.02", dtypes=BF16),
    Entry(M + "biased_msign", "bi-orthogonal", "violated", "fixed bias"),
    Entry(M + "sign", "bi-orthogonal", "violated", "coordinate-wise, discontinuous", dtypes=BF16),
    Entry(M + "col_unit", "left-perm-right-orth", "violated", "right rotations mix columns", dtypes=BF16),
    Entry(M + "power3", "bi-orthogonal", "violated", "unconverged at condition 1e6 (1e-7 effect)",
          ("--condition", "1e6"), F64),
    Entry(M + "power200", "bi-orthogonal", "violated", "clustered spectra (σ2/σ1 ≥ 0.99)", dtypes=BF16),
    Entry(M + "thresholded_msign", "bi-orthogonal", "violated", "zeroes entries below 1e-6"),
    Entry(M + "thresholded_spectral", "bi-orthogonal", "violated", "zeroes entries below 1e-6, discontinuous",
          dtypes=BF16),
    Entry(M + "flushed_sign", "row-scaling", "violated", "flushes entries below 1e-6: tiny scales only",
          dtypes=BF16),
    Entry(M + "half_flip", "permutation", "violated", "sign flips on half the draws"),
    Entry(M + "corner_flip", "permutation", "violated", "sign flips on half the draws, discontinuous",
          dtypes=BF16),
    Entry(M + "adam_like", "row-scaling", "violated", "ε breaks scale invariance", dtypes=BF16),
    Entry(M + "gram_left", "left-orthogonal", "violated", "fixed row weights", dtypes=BF16),
    Entry(M + "frobenius_normalized", "row-scaling", "violated", "scalings change the norm", dtypes=BF16),
    Entry(M + "argmax_one_hot", "permutation", "violated", "a tie goes to the lowest index: ties only",
          dtypes=BF16, structured=True),
    Entry(M + "dead_column_guard", "bi-orthogonal", "violated", "a zero column becomes e_0: exact zeros only",
          dtypes=BF16, structured=True),
    Entry(M + "identity_at_zero", "bi-orthogonal", "violated", "I at D = 0: rank 0 only", dtypes=BF16,
          structured=True),
    Entry(M + "sign_with_positive_zero", "signed-permutation", "violated", "sign(0) = +1: exact zeros only",
          dtypes=BF16, structured=True),
    Entry(M + "entrywise_batch_max", "signed-permutation", "violated", "normalized over the stack (dim 0)",
          dtypes=BF16, batch=(3,)),
    Entry(M + "stack_normalized", "bi-orthogonal", "violated", "one norm for the whole stack: equivariant, coupled",
          dtypes=BF16, batch=(3,)),
    Entry(M + "unguarded_row_unit", "left-perm-right-orth", "error", "NaN on zero rows", dtypes=BF16),
    Entry(M + "cholesky_polar", "bi-orthogonal", "error", "raises on singular Gram"),
    Entry(M + "HeavyBall", "bi-orthogonal", "holds", "linear optimizer", ("--arg", "lr=0.1"), BF16),
    Entry(M + "SignSGD", "bi-orthogonal", "violated", "sign of the momentum", ("--arg", "lr=0.1"), BF16),
    Entry("geomuon.optimizers:Muon", "bi-orthogonal", "holds", "bf16 Newton–Schulz, up to bf16",
          ("--arg", "lr=0.02", "--compute-dtype", "bfloat16"), ("float32",)),
]

#: (shape, dtype) per size; ``--quick`` runs each entry once, at its first dtype.
SHAPES = {
    "quick": [("6x4", "float64"), ("12x6", "float32"), ("16x8", "bfloat16")],
    "full": [("6x4", "float64"), ("12x12", "float64"), ("64x32", "float32"), ("256x128", "float32"),
             ("64x32", "bfloat16"), ("256x128", "bfloat16")],
}


def _options(entry: Entry) -> dict:
    """The entry's options as check_equivariance keywords (for the API route)."""
    pairs = dict(zip(entry.options[::2], entry.options[1::2]))
    kwargs = {}
    if "--condition" in pairs:
        kwargs["condition"] = float(pairs["--condition"])
    if "--compute-dtype" in pairs:
        kwargs["compute_dtype"] = getattr(torch, pairs["--compute-dtype"])
    if entry.structured:
        kwargs["structured"] = True
    return kwargs


def _subject(entry: Entry):
    module_name, _, attr = entry.target.partition(":")
    obj = getattr(__import__(module_name, fromlist=[attr]), attr)
    pairs = dict(zip(entry.options[::2], entry.options[1::2]))
    if isinstance(obj, type):
        lr = float(pairs["--arg"].partition("=")[2])
        return OptimizerUpdate(lambda params: obj(params, lr=lr), name=attr)
    return obj


def run_api(entry: Entry, shape: str, dtype: str, seed: int, clock=time.perf_counter) -> tuple[str, float]:
    """The API's verdict on one check at ``shape`` (``MxN``, or batched ``BxMxN``), and its seconds
    on ``clock``."""
    sizes = tuple(int(k) for k in shape.split("x"))
    start = clock()
    report = check_equivariance(_subject(entry), entry.group, sizes, dtype=getattr(torch, dtype), seed=seed,
                                **_options(entry))
    return report.verdict, clock() - start


_VERDICT_OF_EXIT = {0: "holds", 1: "violated", 3: "inconclusive", 4: "error", 2: "usage error"}


def run_cli(entry: Entry, shape: str, dtype: str, seed: int, clock=time.perf_counter) -> tuple[str, float]:
    """The in-process CLI's verdict on one check (from its exit status), and its seconds on ``clock``."""
    argv = ["check-equivariance", entry.target, "--group", entry.group, "--shape", shape, "--dtype", dtype,
            "--seed", str(seed), *entry.cli_options]
    start = clock()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = geomuon_cli.main(argv)
    return _VERDICT_OF_EXIT[code], clock() - start


def cli_process_time(repeats: int, shape: str = "64x32") -> tuple[float, float]:
    """Wall and CPU seconds of one ``geomuon check-equivariance`` process on a 64x32 map,
    import included (median of ``repeats``)."""
    command = [sys.executable, "-m", "geomuon", "check-equivariance", f"{MODULE}:svd_msign", "--group",
               "bi-orthogonal", "--shape", shape, "--dtype", "float32", "--seed", "0"]
    walls, cpus = [], []
    for _ in range(repeats):
        before = os.times()
        start = time.perf_counter()
        finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        walls.append(time.perf_counter() - start)
        if finished.returncode != 0:  # (a crashed process's seconds had been published as the check's)
            raise SystemExit(f"the timed CLI process exited {finished.returncode}, not 0 (svd_msign holds): "
                             f"{' '.join(command)}\n{finished.stderr[-2000:]}")
        after = os.times()
        cpus.append(after.children_user - before.children_user + after.children_system - before.children_system)
    return statistics.median(walls), statistics.median(cpus)


def classify(expected: str, verdict: str) -> str:
    """``ok``, ``false positive`` (a correct map reported violated), ``false negative`` (a
    broken map reported holds), ``inconclusive``, or ``unexpected error`` / ``missed error``."""
    if verdict == expected:
        return "ok"
    if verdict == "inconclusive":
        return "inconclusive"
    if expected == "error":
        return "missed error"
    if verdict in ("error", "usage error"):
        return "unexpected error"
    return "false positive" if expected == "holds" else "false negative"


def measure(size: str, seed: int, clock=time.perf_counter):
    rows, outcomes, times = [], {"cli": [], "api": []}, {"cli": [], "api": []}
    for entry in CATALOGUE:
        for shape, dtype in SHAPES[size]:
            if dtype not in entry.dtypes or (size == "quick" and dtype != entry.dtypes[0]):
                continue
            shape = entry.shape(shape)
            verdicts = {}
            for route, runner in (("api", run_api), ("cli", run_cli)):
                verdict, seconds = runner(entry, shape, dtype, seed, clock)
                verdicts[route] = verdict
                outcomes[route].append(classify(entry.expected, verdict))
                times[route].append(seconds)
            rows.append([entry.label, entry.group, shape, dtype, entry.expected, verdicts["api"], verdicts["cli"],
                         entry.why])
    return rows, outcomes, times


def summary(outcomes, times) -> str:
    header = ["route", "checks", "false positives", "false negatives", "inconclusive", "unexpected errors",
              "missed errors", "median time per check (s)"]
    body = []
    for route in ("cli", "api"):
        counts = {k: outcomes[route].count(k) for k in
                  ("false positive", "false negative", "inconclusive", "unexpected error", "missed error")}
        body.append([route, str(len(outcomes[route])), *(str(v) for v in counts.values()),
                     f"{statistics.median(times[route]):.3f}"])
    return markdown_table(header, body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=1, threads=1, repeats_help="unused (each check runs once)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every check (default 0)")
    args = parser.parse_args(argv)
    provenance = Provenance(__file__, args, argv, parser)
    torch.set_num_threads(args.threads)
    # the in-process CLI keeps these threads (it sets its own only where OMP_NUM_THREADS is unset), and
    # so does the timed CLI process; set after the Provenance, whose header records the environment as
    # launched (it had recorded this as the user's setting), so the caption says what each ran on
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    size = "quick" if args.quick else "full"
    rows, outcomes, times = measure(size, args.seed, CLOCKS[args.clock])
    repeats = 1 if args.quick else 3
    wall, cpu = cli_process_time(repeats)
    text = (
        f"The checker's own benchmark: {len(CATALOGUE)} catalogue entries (correct and broken maps and "
        f"optimizers, each with the verdict it must get) at shapes "
        f"{', '.join(f'{s} {d}' for s, d in SHAPES[size])}, seed {args.seed}, through the CLI (in-process) "
        f"and the API, on {args.threads} torch thread(s). A whole `geomuon check-equivariance` process on a 64x32 "
        f"float32 map under OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, import included: {wall:.2f} s wall, "
        f"{cpu:.2f} s CPU (median of {repeats}).\n\n"

        + summary(outcomes, times) + "\n\n"
        + markdown_table(["entry", "group", "shape", "dtype", "expected", "API", "CLI", "why"], rows)
    )
    return provenance.finish(text)


if __name__ == "__main__":
    raise SystemExit(main())
