r"""Optimizer step time and state memory on a GPT-2-shaped parameter set.

The hidden matrices of a GPT-2-style model scaled to a CPU (default 6 layers × width
384: fused QKV ``[3d, d]``, attention output ``[d, d]``, MLP in ``[4d, d]`` and out
``[d, 4d]``, PyTorch ``[out, in]`` layout) get fixed random gradients, and each
optimizer's ``step()`` is timed. Repeats are **interleaved** (one step of every
optimizer per round, so a change in machine load hits all of them alike) and the table
reports medians as ratios to a baseline, plus the optimizer state in MiB and the median
minor page faults of a timed step (:func:`minor_page_faults`: on a CPU they say how much of a
step was its allocator's; :func:`bench.timing.interleaved_medians`; ``--markdown PATH`` writes
the table with its provenance, see :mod:`bench.timing`).

Rows: ``torch.optim.Muon`` and our :class:`geomuon.optimizers.Muon` (same settings, bf16
Newton–Schulz); :class:`geomuon.optimizers.ManifoldMuon` on Stiefel and on DGram with its
default solver and with ``solver="projected"`` (``--solver``); ``geoopt.optim.RiemannianAdam`` on Stiefel (our ``geomuon.manifolds.Stiefel``
through geoopt's ``ManifoldParameter``).

Run it with OpenMP's default thread settings (the header records any ``OMP_*``): with
``OMP_WAIT_POLICY=PASSIVE``, which the test suite sets so that LAPACK survives a busy
machine, idle threads sleep between parallel regions, and a step made of many small
kernels pays the wake-up each time — ManifoldMuon measured 7.0× our Muon on 2 threads
that way instead of 5.1×.

Usage::

    python bench/optimizer_step.py                 # 6 x 384, 7 rounds
    python bench/optimizer_step.py --repeats 3 --layers 2 --width 256 --threads 1
    python bench/optimizer_step.py --quick         # 1 x 64, seconds: a smoke test
    python bench/optimizer_step.py --threads 1 --clock process --profile   # + where the time goes
    python bench/optimizer_step.py --dualizer default polar_express   # + ManifoldMuon under Polar Express

``--profile`` adds, for each ManifoldMuon row, one profiled step (``torch.profiler``, after
the timed rounds) split into the work the engine's cost model counts: $m\times n$
products (an operand has the long side), $n\times n$ products, the symmetric
eigendecompositions, and everything else (elementwise passes, copies, reductions). The
profiled steps run on one thread: with more, ManifoldMuon's batches run in worker threads,
whose ops the profiler of the calling thread does not record.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import resource  # page-fault counts (POSIX)
except ImportError:
    resource = None

if __package__ in (None, ""):  # run as `python bench/optimizer_step.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import (CLOCKS, Distinct, Provenance, add_arguments, add_device_argument, at_least,  # noqa: E402
                          interleaved_medians, markdown_table, synchronizer)

#: The gpt set's default size (6 blocks of width 384).
GPT_SIZE = {"layers": 6, "width": 384}
#: ``--quick``: one block of width 64 (seconds; checks the script, not a result).
QUICK = {"layers": 1, "width": 64, "repeats": 3}


#: ``--set``: the default CPU-scaled stack (``--layers`` x ``--width``), or one GPT-2-small
#: block (d = 768: q, k, v and out 768 x 768, the MLP's 3072 x 768 and 768 x 3072).
SETS = ("gpt", "gpt2-small")


def gpt2_small_shapes() -> list[tuple[int, int]]:
    """One GPT-2-small block's hidden matrices, ``[out, in]``: 768x768 (x4: q, k, v, out),
    3072x768, 768x3072."""
    return [(768, 768)] * 4 + [(3072, 768), (768, 3072)]


def gpt_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """Hidden matrices of a GPT-2 block stack, ``[out, in]``."""
    block = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return block * layers


def state_mib(optimizer: torch.optim.Optimizer) -> float:
    total = 0
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total / 2**20


def build(shapes, seed: int, device: str = "cpu", dualizers=(None,), solvers=("dual",)):
    """Every optimizer under test, each on its own copy of the parameters (on ``device``);
    ManifoldMuon once per entry of ``dualizers`` (``None``: its default, by device) and of
    ``solvers`` (its ``solver``)."""
    import geoopt

    from geomuon.manifolds import DGram, Stiefel
    from geomuon.optimizers import ManifoldMuon, Muon

    gen = torch.Generator().manual_seed(seed)
    base = [(torch.randn(s, generator=gen) / s[1] ** 0.5).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(device) for s in shapes]

    def params(manifold=None):
        ps = []
        for w in base:
            data = manifold.projx(w) if manifold is not None else w.clone()
            p = geoopt.ManifoldParameter(data, manifold=manifold) if manifold else torch.nn.Parameter(data)
            ps.append(p)
        return ps

    stiefel, dgram = Stiefel(), DGram()
    optimizers = {
        "torch.optim.Muon": torch.optim.Muon(params(), lr=0.02),
        "Muon (ours)": Muon(params(), lr=0.02),
    }
    for solver in solvers:
        for dualizer in dualizers:
            for name, manifold in (("Stiefel", stiefel), ("DGram", dgram)):
                label = f"ManifoldMuon {name}" + "".join(f", {o}" for o in (dualizer, solver) if o not in (None, "dual"))
                optimizers[label] = ManifoldMuon(params(manifold), lr=0.02, gram_dualizer=dualizer, solver=solver)
    optimizers["RiemannianAdam Stiefel"] = geoopt.optim.RiemannianAdam(params(stiefel), lr=1e-3)
    return optimizers, grads


def minor_page_faults() -> int:
    """This process's minor page faults so far, every thread's (``getrusage``; 0 where the
    platform has no ``resource`` module)."""
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(optimizers: dict, grads: list[torch.Tensor], repeats: int, clock=time.perf_counter,
            warmup: int = 1, device: str = "cpu") -> tuple[dict, dict]:
    """Median ``step()`` seconds of each optimizer, interleaved, every step on the same gradients
    (on CUDA each step ends with a synchronize, so the clock sees its kernels), and the median
    minor page faults of its timed steps: on a CPU, freshly allocated memory is faulted in page
    by page, and how often depends on what the process allocated before (glibc hands large
    freed blocks back to the system), so the count tells a step's own cost from its
    allocator's."""
    faults: dict[str, list[int]] = {name: [] for name in optimizers}

    def set_grads():
        for opt in optimizers.values():
            params = [p for g in opt.param_groups for p in g["params"]]
            for p, g in zip(params, grads):
                p.grad = g.clone()

    sync = synchronizer(device)

    def stepper(name, opt):
        def step():
            before = minor_page_faults()
            opt.step()
            sync()
            faults[name].append(minor_page_faults() - before)
        return step

    steps = {name: stepper(name, opt) for name, opt in optimizers.items()}
    medians = interleaved_medians(steps, repeats, clock, warmup, before_round=set_grads)
    return medians, {name: statistics.median(counts[warmup:]) for name, counts in faults.items()}


#: ``--profile``: op name -> cost-model category (products are split by their operands' shapes).
_PRODUCTS = ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::matmul")
#: ``--profile``: profiled steps per optimizer, of which the table shows the least perturbed
PROFILED_STEPS = 3
_EIGEN = ("aten::_linalg_eigh", "aten::linalg_eigh", "aten::linalg_cholesky_ex", "aten::linalg_solve_triangular")


def _category(name: str, shapes, short_side: int) -> str | None:
    if name in _PRODUCTS:
        if name == "aten::matmul":
            return None  # dispatches to bmm/mm, counted there
        dims = [d for shape in shapes for d in (shape[-2:] if len(shape) >= 2 else ())]
        return "m x n products" if dims and max(dims) > short_side else "n x n products"
    if name in _EIGEN:
        return "eigh / Cholesky / triangular solve"
    return "elementwise, copies, reductions"


def profile_step(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor],
                 short_side: int) -> tuple[list[list[str]], float]:
    """The least perturbed of :data:`PROFILED_STEPS` profiled ``step()`` calls, split by
    :func:`_category`: rows ``[category, ms, share]`` and the profiled ops' total in ms
    (self CPU time of the leaf ops; the profiler's own overhead inflates small ops).

    With ``record_shapes`` (the split needs the products' shapes) the profilers of this
    torch 2.13 CPU build slow elementwise ops in their first sessions of a process: Kineto
    5-10x in every session (a DGram step timed at 2.4 s took 13-26 s: the profile read
    84 % elementwise), the autograd profiler without Kineto used here 10x in the first
    session and 2x in the second (26.1 s, then 4.2 s for a 2.0 s Stiefel step), none after.
    Hence the smallest total of several; the caption prints it next to the timed median,
    so an inflated profile shows. The steps run on one thread (restored after): at more,
    ManifoldMuon's batches run in worker threads the profiler of this thread does not see.
    """
    from torch.autograd.profiler import profile

    params = [p for g in optimizer.param_groups for p in g["params"]]
    profiles = []
    threads = torch.get_num_threads()
    for _ in range(PROFILED_STEPS):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch.set_num_threads(1)
        try:
            with profile(record_shapes=True, use_kineto=False) as prof:
                optimizer.step()
        finally:
            torch.set_num_threads(threads)
        totals: dict[str, float] = {}
        for event in prof.key_averages(group_by_input_shape=True):
            if event.key.startswith("Optimizer.") or not event.key.startswith("aten::"):
                continue
            category = _category(event.key, event.input_shapes or [], short_side)
            if category is not None:
                totals[category] = totals.get(category, 0.0) + event.self_cpu_time_total / 1e3
        profiles.append(totals)
    totals = min(profiles, key=lambda t: sum(t.values()))
    whole = sum(totals.values()) or 1.0
    order = ["m x n products", "n x n products", "eigh / Cholesky / triangular solve",
             "elementwise, copies, reductions"]
    rows = [[c, f"{totals.get(c, 0.0):.1f}", f"{100 * totals.get(c, 0.0) / whole:.0f} %"] for c in order]
    return rows, whole


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=at_least(1), default=None,
                        help=f"GPT-2 blocks of the gpt set (default {GPT_SIZE['layers']})")
    parser.add_argument("--width", type=at_least(1), default=None,
                        help=f"model width of the gpt set (default {GPT_SIZE['width']})")
    parser.add_argument("--set", choices=SETS, default="gpt",
                        help="gpt: --layers x --width GPT-2 blocks; gpt2-small: one d=768 block (fixed size: "
                             "takes neither --layers, --width nor --quick)")
    add_arguments(parser, repeats=7, threads=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each ManifoldMuon row: where the time goes (CPU only)")
    parser.add_argument("--dualizer", nargs="+", action=Distinct, default=["default"],
                        choices=["default", "eigh", "polar_express"],
                        help="ManifoldMuon rows, one pair per dualizer (gram_dualizer; default: ManifoldMuon's, "
                             "eigh on the CPU): on a CPU whose bf16 products are fast, compare polar_express")
    parser.add_argument("--solver", nargs="+", action=Distinct, default=["dual", "projected"],
                        choices=["dual", "projected"],
                        help="ManifoldMuon rows, one set per solver (its solver key; the rows' labels name it "
                             "unless it is the default, dual)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if torch.device(args.device).type != "cpu" and (args.clock != "wall" or args.profile):
        parser.error(f"--device {args.device} times with --clock wall and has no --profile (a CPU op profile)")
    if args.set == "gpt2-small":
        # its shapes are fixed: these options had been ignored (and --quick had run the full block)
        given = [option for option, value in (("--layers", args.layers), ("--width", args.width)) if value is not None]
        given += ["--quick"] if args.quick else []
        if given:
            parser.error(f"--set gpt2-small is one d = 768 block of fixed size; it takes no {', '.join(given)} "
                         "(they size the gpt set)")
    parser.set_defaults(**(QUICK if args.quick else GPT_SIZE))
    args = parser.parse_args(argv)
    provenance = Provenance(__file__, args, argv, parser)
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes(args.layers, args.width) if args.set == "gpt" else gpt2_small_shapes()
    dualizers = [None if d == "default" else d for d in args.dualizer]
    optimizers, grads = build(shapes, args.seed, args.device, dualizers, args.solver)
    medians, faults = measure(optimizers, grads, args.repeats, CLOCKS[args.clock], device=args.device)
    params_mib = sum(s[0] * s[1] for s in shapes) * 4 / 2**20
    # the Muons against torch's, everything else against ours
    baselines = {name: "torch.optim.Muon" if name in ("torch.optim.Muon", "Muon (ours)") else "Muon (ours)"
                 for name in optimizers}
    rows = [[name, f"{1e3 * median:.1f}", f"{median / medians[baselines[name]]:.2f}", baselines[name],
             f"{state_mib(optimizers[name]):.1f}", f"{faults[name]:.0f}"] for name, median in medians.items()]
    described = f"{args.layers} layers x {args.width}" if args.set == "gpt" else "one GPT-2-small block, d = 768"
    text = (
        f"{len(shapes)} matrices ({described}), {params_mib:.1f} MiB of fp32 "
        f"weights on {args.device}, {args.threads} threads, {args.clock} clock, median of {args.repeats} "
        f"interleaved rounds\n\n"
        + markdown_table(["optimizer", "step (ms)", "ratio", "vs", "state (MiB)", "page faults / step"], rows)
    )
    if args.profile:
        short = min(min(s) for s in shapes)
        for name in (n for n in optimizers if n.startswith("ManifoldMuon")):
            rows, total = profile_step(optimizers[name], grads, short)
            defaults = optimizers[name].defaults
            solver = f"{defaults['solver']} solver, " + (f"{defaults['gram_dualizer']} dualizer" if
                                                         defaults["gram_dualizer"] else "default dualizer")
            text += (f"\n\nWhere the time goes: one profiled step of {name} ({solver}) on one thread, "
                     f"self CPU time of its ops ({total:.0f} ms in all; timed median at {args.threads} "
                     f"threads {1e3 * medians[name]:.0f} ms)\n\n"
                     + markdown_table(["work", "ms", "share"], rows))
    return provenance.finish(text)


if __name__ == "__main__":
    raise SystemExit(main())
