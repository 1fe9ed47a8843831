r"""Quality of ManifoldMuon's direction inside GPT training: the certificate in a real run.

:mod:`bench.manifold_frontier` measures the dual solver on noisy regressions whose
gradients have full rank. A transformer's momentum is far from that: its singular values
spread over many orders of magnitude (a DGram MLP matrix of the run below, step 240:
$2.8\cdot10^{-3}$ down to $10^{-10}$), where the dual function
$\Lambda \mapsto \|G + L_W^*\Lambda\|_*$ is nonsmooth and dual steps stall. This script
trains the manifolds study's GPT (:mod:`geomuon.pretrain.studies.manifolds`: 3 layers,
4 heads, width 128, context 64, batch 16, lr 0.02 with warmup 20 then cosine) with one
manifold on every attention and MLP matrix (``all_stiefel`` / ``all_dgram``) and reads
ManifoldMuon's exact certificate (``certify_every``: primal
$\langle G, \hat A\rangle/\max(1, \|\hat A\|_2)$ over the dual value $\|Z\|_*$ of the last
dual iterate, SVD-based) of the direction each matrix took at every evaluation step. The
certified ratio is a lower bound on the fraction of the optimal descent, below it by the
gap of the step's last dual iterate; ``--reference K`` (ManifoldMuon's ``certify_reference``)
divides by the smaller of that and a K-step reference solve's dual value instead, which on
these runs lowers the dual by 0.3–1.2 % (Stiefel) and 1–6 % (DGram): with K = 32 the
certificate is within about 1 % of the fraction itself (a 32-step solve certifies
0.99–0.999 on its own, measured by offline replay of the certified steps).

Rows: mean and minimum over the certified steps and matrices, by the matrices'
orientation (tall, square, wide as the parameter is stored), for each solver asked for.

Usage::

    python bench/manifold_inrun.py --data shakespeare:PATH                 # both manifolds, defaults
    python bench/manifold_inrun.py --manifold dgram --dual 1 2 4 --update newton jacobi --polish 0 1 2
    python bench/manifold_inrun.py --manifold dgram --polish 1 2 3 --polish-method admm alternating --reference 32
    python bench/manifold_inrun.py --manifold stiefel --starts warm cold    # with and without warm starts
    python bench/manifold_inrun.py --manifold stiefel --dual 4 --smoothing 0.03 --alpha 1.5 --steps 200
    python bench/manifold_inrun.py --dualizer polar_express --update newton jacobi  # CUDA's dualizer, on the CPU
    python bench/manifold_inrun.py --reference 32   # certificates against a 32-step reference solve's dual
    python bench/manifold_inrun.py --solver dual projected --polish 0 1 2 --reference 32   # both solvers
    python bench/manifold_inrun.py --quick                                  # seconds: a smoke test

``--markdown PATH`` writes the table with its provenance (see :mod:`bench.timing`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/manifold_inrun.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import (Distinct, Provenance, add_arguments, markdown_row, markdown_table,  # noqa: E402
                          refuse_dual_row_options)
from geomuon.pretrain.data import spec_problem  # noqa: E402

#: the manifolds study's full size (model, schedule, evaluation cadence)
RUN = dict(model="cpu-small", n_layer=3, n_head=4, n_embd=128, block_size=64, steps=400, batch_size=16, lr=0.02,
           adamw_lr=3e-3, warmup_steps=20, eval_every=40, eval_batches=1)
#: ``--quick``: a 1-layer width-16 model, 4 steps, a certificate every 2 (seconds; not a result)
QUICK_RUN = dict(model="cpu-tiny", n_layer=1, n_head=2, n_embd=16, block_size=16, steps=4, batch_size=2,
                 warmup_steps=1, eval_every=2, eval_batches=1)
STRATEGY = {"stiefel": "all_stiefel", "dgram": "all_dgram"}
#: The options that set only the dual solver's rows (the projected solver takes no dual option), by
#: their ``argparse`` names, with their defaults (``None`` on the command line until parsed: an option
#: given with ``--solver projected`` alone is refused; ``[None]``: ManifoldMuon's default).
DUAL_ROW_DEFAULTS = {"update": [None], "dual": [None], "polish_method": [None], "starts": ["warm"],
                     "smoothing": [None], "alpha": [None]}


def orientation(shape) -> str:
    m, n = shape[-2:]
    return "tall" if m > n else "wide" if m < n else "square"


#: ManifoldMuon's option behind each command-line flag (its refusals name the option)
FLAGS = {"dual_steps": "--dual", "polish_rounds": "--polish", "polish_method": "--polish-method", "dual_smoothing": "--smoothing", "dual_alpha": "--alpha",
         "gram_dualizer": "--dualizer", "certify_reference": "--reference", "dual_update": "--update",
         "solver": "--solver", "warm_start": "--starts"}


def optimizer_settings(update: str | None, dual_steps: int | None, polish: int | None, warm_start: bool,
                       smoothing: float | None, alpha: float | None, dualizer: str | None, reference: int,
                       solver: str, certify_every: int, polish_method: str | None = None) -> dict:
    """The ManifoldMuon options of one row (``None``: ManifoldMuon's default, left out; the
    projected solver's rows leave out the dual options, which it refuses)."""
    chosen = dict(polish_rounds=polish, gram_dualizer=dualizer)
    if solver != "projected":
        chosen.update(dual_steps=dual_steps, dual_smoothing=smoothing, dual_alpha=alpha, dual_update=update,
                      polish_method=polish_method)
    return dict(certify_every=certify_every, certify_reference=reference, solver=solver, warm_start=warm_start,
                **{k: v for k, v in chosen.items() if v is not None})


def refuse_bad_settings(parser: argparse.ArgumentParser, manifold: str, settings: dict) -> None:
    """ManifoldMuon's own checks of ``settings``, now, on a small point of ``manifold``: the runs
    set them on the param groups of built optimizers, which does not check them (a negative
    ``--alpha`` had published a normal-looking table, ``--reference -1`` failed mid-training)."""
    from geomuon.manifolds import MatrixManifold
    from geomuon.optimizers import ManifoldMuon

    point = torch.nn.Parameter(MatrixManifold.resolve(manifold, "--manifold").projx(torch.randn(4, 2)))
    try:
        ManifoldMuon([point], manifold=manifold, **settings)
    except ValueError as err:
        flag = next((flag for name, flag in FLAGS.items() if name in str(err)), "a setting")
        parser.error(f"{flag} (on {manifold}): ManifoldMuon refuses it: {err}")


def run_config(manifold: str, run: dict, data: str, seed: int):
    """The :class:`~geomuon.pretrain.config.TrainConfig` of one run of ``manifold`` on the data
    spec ``data``."""
    from geomuon.pretrain.config import TrainConfig

    fields = {k: v for k, v in run.items() if k not in ("model",)}
    # out_dir=None: the run stays in memory (the default template had left a run folder with two
    # checkpoints in ./runs for every configuration measured)
    return TrainConfig(model=run["model"], strategy=STRATEGY[manifold], data=data, seed=seed, progress=False,
                       print_table=False, out_dir=None, **fields)


def load_or_refuse(parser: argparse.ArgumentParser, run: dict, data: str, seed: int):
    """The data of every run (the spec ``data``, read once, as ``train`` reads it:
    :func:`~geomuon.pretrain.train.load_run_data`), refused as a usage error naming ``--data``:
    a missing or wrong file had been a traceback from the first run's ``train()``, after the
    table's header."""
    from geomuon.pretrain.train import load_run_data

    cfg = run_config(next(iter(STRATEGY)), run, data, seed)  # (any manifold: the same vocabulary in every run)
    try:
        return load_run_data(cfg)
    except ValueError as err:
        parser.error(f"--data {data}: {err}")


def certified_run(manifold: str, settings: dict, run: dict, data: str, seed: int, tokens):
    """Train one run with ManifoldMuon's ``settings`` (:func:`optimizer_settings`, checked by
    :func:`refuse_bad_settings`) on ``tokens``, the data spec ``data`` read by
    :func:`load_or_refuse`; ``{orientation: [certified ratios]}`` over its evaluation steps."""
    from geomuon.optimizers import ManifoldMuon
    from geomuon.optimizers.assign import assign
    from geomuon.pretrain.train import train

    optimizers: list[ManifoldMuon] = []

    def build(model, hyper):
        assignment = assign(model, STRATEGY[manifold], hyper)
        for opt in assignment.optimizers.values():
            if isinstance(opt, ManifoldMuon):
                for group in opt.param_groups:
                    group.update(settings)
                optimizers.append(opt)
        return assignment

    shapes = {}
    ratios: dict[str, list[float]] = {}

    def read_certificates(model, evaluation):
        # names -> shapes once; the certificates are the last certified step's (this one)
        if not shapes:
            shapes.update((name, tuple(p.shape)) for opt in optimizers for name, p in opt.named_parameters())
        for opt in optimizers:
            for name, ratio in opt.certificates.items():
                ratios.setdefault(orientation(shapes[name]), []).append(ratio)
        return {}

    train(run_config(manifold, run, data, seed), tokens, build_assignment=build, extra_metrics=read_certificates)
    return ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifold", nargs="+", action=Distinct, default=["stiefel", "dgram"],
                        choices=sorted(STRATEGY))
    parser.add_argument("--update", nargs="+", action=Distinct, default=None, choices=["newton", "jacobi"],
                        help="dual update (default: ManifoldMuon's for the manifold)")
    parser.add_argument("--dual", type=int, nargs="+", action=Distinct, default=None,
                        help="dual steps per optimizer step (default: ManifoldMuon's for the manifold)")
    parser.add_argument("--polish", type=int, nargs="+", action=Distinct, default=[None],
                        help="rounds of the direction's polish (ManifoldMuon's polish_rounds; default: ManifoldMuon's "
                             "for the manifold and dualizer)")
    parser.add_argument("--polish-method", nargs="+", action=Distinct, default=None,
                        choices=["admm", "alternating"],
                        help="method of the polish rounds (ManifoldMuon's polish_method; default: ManifoldMuon's for "
                             "the manifold; the dual solver's rows)")
    parser.add_argument("--starts", nargs="+", action=Distinct, default=None, choices=["warm", "cold"],
                        help="dual start of each step: the previous step's correction (warm, ManifoldMuon's "
                             "default) or none (cold: warm_start=False)")
    parser.add_argument("--smoothing", type=float, nargs="+", action=Distinct, default=None,
                        help="smoothing of the dual (ManifoldMuon's dual_smoothing; default: ManifoldMuon's)")
    parser.add_argument("--alpha", type=float, nargs="+", action=Distinct, default=None,
                        help="dual step size (ManifoldMuon's dual_alpha; default: ManifoldMuon's)")
    parser.add_argument("--dualizer", nargs="+", action=Distinct, default=[None],
                        choices=["eigh", "polar_express"],
                        help="the Gram path's dualizer (ManifoldMuon's gram_dualizer; default: by device, eigh on "
                             "the CPU, polar_express on CUDA; eigh with --smoothing > 0)")
    parser.add_argument("--solver", nargs="+", action=Distinct, default=["dual"],
                        choices=["dual", "projected"],
                        help="ManifoldMuon's solver (projected: no dual; the dual options do not apply, and its "
                             "own dual iterate is the projection start: certify it with --reference)")
    parser.add_argument("--reference", type=int, default=0,
                        help="dual steps of a reference solve at each certified step (ManifoldMuon's "
                             "certify_reference): the certificate divides by the smaller dual value, so it "
                             "approaches the fraction of the optimal descent (default 0: the step's own iterate)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: the study's 400; at least its certificate interval, 40)")
    parser.add_argument("--data", default="embedded", help="training data spec (geomuon pretrain --data)")
    parser.add_argument("--seed", type=int, default=1)
    add_arguments(parser, repeats=0, threads=2, repeats_help="unused (no timing here)", min_repeats=0)
    args = parser.parse_args(argv)
    refuse_dual_row_options(parser, args, DUAL_ROW_DEFAULTS)
    for name, default in DUAL_ROW_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if problem := spec_problem(args.data):  # (it had been a traceback from inside train())
        parser.error(f"--data: {problem}")
    run = dict(RUN, **(QUICK_RUN if args.quick else {}))
    if args.steps is not None:
        if args.steps < max(run["eval_every"], run["warmup_steps"] + 1):
            parser.error(f"--steps must be >= {max(run['eval_every'], run['warmup_steps'] + 1)} (a certificate is read "
                         f"every {run['eval_every']} steps, after {run['warmup_steps']} warm-up steps), got {args.steps}")
        run["steps"] = args.steps
    from geomuon.manifolds import MatrixManifold
    from geomuon.optimizers.manifold_muon import (default_dual_steps, default_dual_update, default_polish_method,
                                                  default_polish_rounds)

    combinations = list(itertools.product(args.solver, args.manifold, args.update, args.dual, args.polish,
                                          args.polish_method, args.starts, args.smoothing, args.alpha, args.dualizer))

    def settings_of(solver, update, dual, polish, method, start, smoothing, alpha, dualizer):
        return optimizer_settings(update, dual, polish, start == "warm", smoothing, alpha, dualizer, args.reference,
                                  solver, run["eval_every"], method)

    for solver, manifold, *row in combinations:  # before any run
        refuse_bad_settings(parser, manifold, settings_of(solver, *row))
    tokens = load_or_refuse(parser, run, args.data, args.seed)
    provenance = Provenance(__file__, args, argv, parser, timed=False)
    torch.set_num_threads(args.threads)

    header = ["manifold", "solver", "dualizer", "dual update", "dual steps", "smoothing", "alpha", "polish rounds",
              "polish method", "start",
              "reference dual steps", "matrices", "certified steps x matrices", "mean certified ratio", "min"]
    lines = [
        f"{run['n_layer']} layers x width {run['n_embd']}, {run['steps']} steps, a certificate every "
        f"{run['eval_every']} steps, lr {run['lr']}, data {args.data}, seed {args.seed}, {args.threads} thread(s); "
        "dual update / steps '(default)': ManifoldMuon's for the manifold",
        "",
        markdown_table(header, []),
    ]
    print("\n".join(lines))
    projected_runs = set()
    for solver, manifold, update, dual, polish, method, start, smoothing, alpha, dualizer in combinations:
        owner = MatrixManifold.resolve(manifold, "--manifold")
        if update == "newton" and default_dual_update(owner) != "newton":
            continue  # the form declares no Newton step: its rows are the Jacobi rows
        no_rounds = (default_polish_rounds(owner) if polish is None else polish) == 0
        if solver == "dual" and no_rounds and method != args.polish_method[0]:
            continue  # without rounds the method does not enter: the first method's row stands for all
        if solver == "projected":  # one run per manifold, polish rounds and dualizer: the dual options do not apply
            if (manifold, polish, dualizer) in projected_runs:
                continue
            projected_runs.add((manifold, polish, dualizer))
        ratios = certified_run(manifold, settings_of(solver, update, dual, polish, method, start, smoothing, alpha,
                                                     dualizer), run, args.data, args.seed, tokens)
        update, dual = update or default_dual_update(owner), default_dual_steps(owner) if dual is None else dual
        shown_update = update + (" (default)" if update == default_dual_update(owner) else "")
        shown_dual = str(dual) + (" (default)" if dual == default_dual_steps(owner) else "")
        default_polish = default_polish_rounds(owner)
        polish = default_polish if polish is None else polish
        shown_polish = str(polish) + (" (default)" if polish == default_polish else "")
        method = method or default_polish_method(owner)
        shown_method = method + (" (default)" if method == default_polish_method(owner) else "")
        groups = dict(sorted(ratios.items()))
        groups["all"] = [r for values in ratios.values() for r in values]
        shown = ["default" if v is None else f"{v:g}" for v in (smoothing, alpha)]
        shown_start = "warm (default)" if start == "warm" else "cold"
        if solver == "projected":  # no dual: its options do not apply (its rounds alternate)
            shown_update, shown_dual, shown, shown_start, shown_method = "-", "0", ["-", "-"], "projection", "alternating"
        for kind, values in groups.items():
            lines.append(markdown_row([manifold, solver, dualizer or "eigh (CPU default)", shown_update, shown_dual, *shown, shown_polish,
                                       shown_method, shown_start, str(args.reference),
                                       kind, str(len(values)),
                                       f"{statistics.mean(values):.4f}", f"{min(values):.4f}"]))
            print(lines[-1], flush=True)
    return provenance.finish("\n".join(lines), printed=True)


if __name__ == "__main__":
    raise SystemExit(main())
