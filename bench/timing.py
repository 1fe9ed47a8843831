r"""What the benchmark scripts share: the timing loop, its command-line options, and the
Markdown file that records a table together with how it was produced.

Timing: every script times its candidates **interleaved** — one call of each candidate per
round, rounds repeated — and reports medians, so a change in machine load during the run
hits every candidate alike and cancels in the ratios. ``--clock process`` counts the CPU
time of this process only (robust to other processes on a shared machine with
``--threads 1``; with more threads it also counts OpenMP spin-waits).
A timing run under ``OMP_WAIT_POLICY=PASSIVE`` (the test suite's setting), ``GOMP_SPINCOUNT=0`` or
``KMP_BLOCKTIME=0`` (libgomp's and Intel OpenMP's ways to the same sleep) is refused unless it is
``--quick``: sleeping OpenMP threads slow steps made of many small kernels. A run that times
nothing refuses ``--clock``.

Provenance: ``--markdown PATH`` writes the script's table under a header stating the
command line, the commit (and whether the checkout had uncommitted changes), the torch
version, threads, the clock (of a timed run), the machine (and accelerator), its bf16 / fp32
matmul rate ratio, every OMP_*/GOMP_*/KMP_*/MKL_* variable it was launched with, the machine's
load average at the start and at the end of the run, and the date and duration; a ``--quick``
run is marked as a smoke test, not a result. The path is checked before anything is measured
(a probe file is written in its folder, which is created then), and an existing file (a
published table) is replaced only with ``--overwrite``; without it the file is created
exclusively at the end, and one that appeared during the run is kept (this run's table then
goes to ``<stem>-2.md``, with a note). The docs include these files from ``docs/results/benchmarks/``
(see ``docs/results/index.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from geomuon.pretrain.provenance import file_above, git_commit, machine, markdown_row, markdown_table, require_writable

__all__ = ["add_arguments", "at_least", "positive_seconds", "device_option", "Distinct", "refuse_repeated",
           "check_output_file", "check_output_folder", "add_device_argument", "refuse_passive_wait", "synchronizer",
           "interleaved_medians", "Provenance", "CLOCKS", "RESULTS_DIR", "git_commit", "machine", "markdown_row",
           "markdown_table"]

REPO = Path(__file__).resolve().parents[1]
#: Where the docs site looks for the benchmark tables (``docs/results/index.md``).
RESULTS_DIR = REPO / "docs" / "results" / "benchmarks"
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def at_least(lowest: int) -> Callable[[str], int]:
    """An argparse ``type``: an int ``>= lowest`` (a bad count is a usage error before any work,
    not a traceback after it)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value

    parse.__name__ = f"int >= {lowest}"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds ``> 0`` (a time limit of 0 or less had
    timed out every run at once, after the work of setting it up)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def device_option(text: str) -> str:
    """An argparse ``type`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, a device this torch
    build reaches. Only these are timed right (a CUDA call ends with a synchronize,
    :func:`synchronizer`; another accelerator's kernels would be timed unfinished), and an
    unusable one had been a traceback from the first tensor moved, after the set-up."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda (cuda:N) are supported")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch ({torch.__version__}) sees no CUDA device; "
                                         "use --device cpu, or run on a machine with a GPU")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return text


def refuse_repeated(parser: argparse.ArgumentParser, option: str, values) -> None:
    """Refuse, as a usage error, a list option whose ``values`` repeat one: its rows (or runs)
    had been measured twice (``--manifold stiefel stiefel``, ``--worlds 1,2,2``)."""
    twice = [value for index, value in enumerate(values) if value in values[:index]]
    if twice:
        parser.error(f"{option} lists {', '.join(map(str, dict.fromkeys(twice)))} more than once; give each once")


class Distinct(argparse.Action):
    """``action=`` of a list option (``nargs="+"``) that takes each value once
    (:func:`refuse_repeated`, on the values after their ``type``: ``--alpha 1.5 1.50`` repeats),
    given once (a second ``--manifold`` had replaced the first one's list)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not self.default:
            parser.error(f"{option_string} is given twice; list all its values after one {option_string}")
        refuse_repeated(parser, option_string, values)
        setattr(namespace, self.dest, values)


def refuse_dual_row_options(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """Refuse, as a usage error, the options ``names`` (their ``dest``; ``None`` when not given) that
    set only the dual solver's rows, given while ``--solver`` has no ``dual`` (they had been
    ignored, and printed in a table's caption as if they had been used)."""
    if "dual" in args.solver:
        return
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)} set the dual solver's rows, and --solver {' '.join(args.solver)} has "
                     "none; add --solver dual (or drop them)")


def refuse_passive_wait(parser: argparse.ArgumentParser) -> None:
    """Refuse, as a usage error before any work, a timing run under ``OMP_WAIT_POLICY=PASSIVE``
    (what the test suite sets), ``GOMP_SPINCOUNT=0`` or ``KMP_BLOCKTIME=0`` (the same sleep in
    libgomp's and Intel OpenMP's own variables): idle OpenMP threads then sleep between parallel regions, and a
    step made of many small kernels pays the wake-up each time (ManifoldMuon measured 7.0x our
    Muon on 2 threads that way instead of 5.1x), so its table would not be the library's cost."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        parser.error("OMP_WAIT_POLICY=PASSIVE is set: it slows steps made of many small parallel kernels, so the "
                     "times would not be the library's; rerun without it (env -u OMP_WAIT_POLICY python ...), "
                     "or with --quick for a smoke run")
    for name in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME"):  # libgomp's and Intel OpenMP's ways to the same sleep
        if os.environ.get(name, "").strip() == "0":
            parser.error(f"{name}=0 is set: idle OpenMP threads then sleep at once, as under "
                         "OMP_WAIT_POLICY=PASSIVE, so the times would not be the library's; rerun without it "
                         f"(env -u {name} python ...), or with --quick for a smoke run")


def add_arguments(parser: argparse.ArgumentParser, *, repeats: int, threads: int = 2,
                  repeats_help: str = "timed rounds", min_repeats: int = 1) -> None:
    """The options every benchmark script takes: ``--repeats`` (at least ``min_repeats``),
    ``--clock``, ``--threads``, ``--quick``, ``--markdown`` and ``--overwrite``."""
    parser.add_argument("--repeats", type=at_least(min_repeats), default=repeats,
                        help=f"{repeats_help} (default {repeats})")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="process: CPU time of this process, robust to other load on a shared "
                             "machine when --threads 1 (with more threads it counts spin-waits)")
    parser.add_argument("--threads", type=at_least(1), default=threads, help=f"torch threads (default {threads})")
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke sizes (what the tests run): checks the script, not a result")
    parser.add_argument("--markdown", metavar="PATH", default=None,
                        help=f"also write the table with its provenance to PATH (the docs include "
                             f"{RESULTS_DIR.relative_to(REPO)}/<script>.md)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let --markdown replace an existing file (a published table is kept otherwise)")


def check_output_file(parser: argparse.ArgumentParser, option: str, path: str | os.PathLike | None,
                      overwrite: bool) -> None:
    """Refuse, as a usage error before any work, an output ``path`` that cannot be written
    (a folder, under a file, or in a folder that cannot be created or written: a probe file is
    written there now, the folder created) or that exists without ``overwrite``: the table of a
    run of minutes to hours had been lost at its end, or had replaced a published one."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        parser.error(f"{option} {path} is a folder; give a file path such as {path / 'table.md'}")
    blocking = file_above(path)
    if blocking is not None:
        parser.error(f"{option} {path}: {blocking} is a file, not a folder")
    if path.exists() and not overwrite:
        parser.error(f"{option} {path} exists (a published table?); pass --overwrite to replace it, or give "
                     "another path")
    _require_writable(parser, option, path.parent)


def check_output_folder(parser: argparse.ArgumentParser, option: str, folder: str | os.PathLike | None) -> None:
    """Refuse, as a usage error before any work, an output ``folder`` that cannot be written (a
    file, under a file, or one that cannot be created or written: a probe file is written in
    it now, the folder created): it had been refused only at the first write, after the work before it."""
    if folder is None:
        return
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        parser.error(f"{option} {folder} is a file, not a folder; give a folder")
    blocking = file_above(folder)
    if blocking is not None:
        parser.error(f"{option} {folder}: {blocking} is a file, not a folder")
    _require_writable(parser, option, folder)


def _require_writable(parser: argparse.ArgumentParser, option: str, folder: Path) -> None:
    # the folders the probe creates are removed again, deepest first: the write creates them (a run
    # refused by a later check, or interrupted, had left them empty)
    created = [path for path in (folder, *folder.parents) if not path.exists()]
    try:
        require_writable(option, folder)
    except ValueError as err:
        parser.error(str(err))
    finally:
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` for the scripts that can run on an accelerator (``cpu``, ``cuda``, ``cuda:1``)."""
    parser.add_argument("--device", type=device_option, default="cpu",
                        help="where the tensors live (default cpu); on cuda every timed call ends by "
                             "synchronizing that device and --clock must be wall")


def synchronizer(device: str) -> Callable[[], object]:
    """What a timed call on ``device`` ends with so the clock sees its kernels finish:
    ``torch.cuda.synchronize(device)`` on CUDA (that device's: without it, the current one's, and
    ``cuda:1``'s kernels had been timed unfinished), nothing on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def interleaved_medians(runs: dict[str, Callable[[], object]], repeats: int, clock=time.perf_counter,
                        warmup: int = 1, before_round: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of each call in ``runs``, timed in rounds of one call each.

    ``warmup`` untimed rounds come first (first-call allocations, lazy initialization);
    ``before_round`` (untimed) runs at the start of every round, e.g. to set fresh
    gradients for every optimizer under test.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + repeats):
        if before_round is not None:
            before_round()
        for name, run in runs.items():
            start = clock()
            run()
            elapsed = clock() - start
            if round_ >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


class Provenance:
    """How one benchmark run was produced. Create it before measuring (it reads the load
    average then); :meth:`write` reads it again at the end."""

    def __init__(self, script: str, args: argparse.Namespace, argv: list[str] | None,
                 parser: argparse.ArgumentParser, *, timed: bool = True) -> None:
        """``parser`` (the script's) reports a run that ``timed`` something under
        ``OMP_WAIT_POLICY=PASSIVE`` as a usage error now, before measuring, unless it is a
        ``--quick`` smoke run (:func:`refuse_passive_wait`), a run that times nothing given a
        ``--clock``, and so an unusable ``--markdown``
        path (:func:`check_output_file`; last: it creates the path's folder). The thread settings
        are read now, as launched (a script may set one for what it runs, after this)."""
        if timed and not args.quick:
            refuse_passive_wait(parser)
        if not timed and args.clock != "wall":  # (taken, ignored, and printed in the header as if used)
            parser.error(f"--clock {args.clock}: this run times nothing; drop --clock")
        check_output_file(parser, "--markdown", args.markdown, args.overwrite)
        self.environment = {name: value for name, value in sorted(os.environ.items())
                            if name.startswith(_ENVIRONMENT_PREFIXES)}
        self.timed = timed
        self.args = args
        argv = sys.argv[1:] if argv is None else argv
        self.command = " ".join(["python", f"bench/{Path(script).name}", *map(shlex.quote, argv)])
        self.commit = git_commit()  # the code that is about to be measured
        self.load_start = os.getloadavg()
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def header(self) -> str:
        import torch

        load_end = os.getloadavg()
        args = self.args
        rows = [
            ("command", f"`{self.command}`"),
            ("commit", f"`{self.commit}`"),
            ("torch", f"{torch.__version__}, {args.threads} thread(s)" + (f", {args.clock} clock" if self.timed else "")),
            ("machine", machine() + _accelerator(getattr(args, "device", "cpu"))),
            # The step ratios depend on it: the fp32 products a step keeps cost this many bf16 ones.
            ("bf16 / fp32 matmul rate", matmul_rate_ratio(device=getattr(args, "device", "cpu"))),
            # OMP_WAIT_POLICY=PASSIVE (the tests set it) slows steps made of many small
            # parallel ops: ManifoldMuon/Muon on 2 threads measured 7.0 instead of 5.1.
            ("environment", ", ".join(f"{k}={v}" for k, v in self.environment.items())
             or "no OMP_*/GOMP_*/KMP_*/MKL_* settings (library defaults)"),
            ("load average (1, 5, 15 min)", f"{_load(self.load_start)} at the start, {_load(load_end)} at the end"),
            ("date (UTC), duration", f"{self.started:%Y-%m-%d %H:%M}, {time.time() - self.started.timestamp():.1f} s"),
        ]
        text = markdown_table(["run", ""], [list(row) for row in rows])
        if args.quick:
            text = ('!!! warning "Quick run: not a result"\n    Written by a `--quick` run (smoke sizes, few '
                    "repeats): it shows the table's form and that the script runs; its numbers are not "
                    "results. Rerun without `--quick` on a quiet machine.\n\n" + text)
        return text

    def write(self, path: str | os.PathLike, table: str) -> Path:
        """Write the provenance header and ``table`` (Markdown) to ``path``; returns the path
        written. Without ``--overwrite`` the file is created exclusively: one that appeared during
        the run (another run into the same path) is kept, and this run's table goes to the first
        free ``<stem>-2.md``, ``-3``, ... with a note (it had replaced the other's, both runs
        printing "written")."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self.header() + "\n\n" + table.strip() + "\n"
        if self.args.overwrite:
            path.write_text(text)
            return path
        for n in itertools.count(1):
            target = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
            try:
                with open(target, "x") as file:
                    file.write(text)
            except FileExistsError:
                continue
            if target != path:
                print(f"note: {path} appeared during this run (another run wrote it) and is kept; this run's "
                      f"table is {target}", file=sys.stderr)
            return target

    def finish(self, table: str, *, printed: bool = False) -> int:
        """End of a script: print ``table`` (unless it was ``printed`` row by row), write it
        to ``--markdown`` when given, and return the exit status 0."""
        if not printed:
            print(table)
        if self.args.markdown:
            print(f"written: {self.write(self.args.markdown, table)}")
        return 0


#: Prefixes of the environment variables that change how kernels use threads (OpenMP, libgomp,
#: Intel's runtime, MKL), recorded with every run (four names had been: GOMP_SPINCOUNT=0 went unrecorded).
_ENVIRONMENT_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_")


def _load(averages: tuple[float, float, float]) -> str:
    return ", ".join(f"{a:.2f}" for a in averages)


def _accelerator(device: str) -> str:
    import torch

    if torch.device(device).type != "cuda":
        return ""
    return f", {torch.cuda.get_device_name(torch.device(device))}"


def matmul_rate_ratio(size: int = 1024, repeats: int = 5, device: str = "cpu") -> str:
    """The bf16 and fp32 matmul rates of ``device`` (GFLOP/s, ``size``-square products, best
    of ``repeats``; on the CPU the current torch thread count and the process clock, on CUDA
    8192-square products, the wall clock and a synchronize) and their ratio."""
    import torch

    cuda = torch.device(device).type == "cuda"
    size = 8192 if cuda else size
    timed = _timed_on(device) if cuda else _timed
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, device=device).to(dtype)
        timed(lambda: a @ a)  # first-call setup
        best = min(timed(lambda: a @ a) for _ in range(repeats))
        rates[dtype] = 2 * size**3 / best / 1e9
    ratio = rates[torch.bfloat16] / rates[torch.float32]
    # two significant digits: a CPU without bf16 units emulates it (measured 0.019x, which
    # one decimal printed as 0.0x)
    return f"{ratio:.2g}x ({rates[torch.bfloat16]:.3g} vs {rates[torch.float32]:.3g} GFLOP/s, {size}^3 products)"


def _timed_on(device: str) -> Callable[[Callable[[], object]], float]:
    """Wall seconds of ``run()`` on ``device``, its kernels finished (:func:`synchronizer`)."""
    sync = synchronizer(device)

    def timed(run) -> float:
        sync()
        start = time.perf_counter()
        run()
        sync()
        return max(time.perf_counter() - start, 1e-9)

    return timed


def _timed(run) -> float:
    start = time.process_time()
    run()
    return max(time.process_time() - start, 1e-9)
