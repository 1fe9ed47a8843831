r"""Quality/cost frontier of ManifoldMuon's dual solver inside a training run.

Each configuration (dual steps 0…8, warm-started or cold) trains the same problem:
matrices $W$ on a manifold fitting noisy linear regressions $\min_W \tfrac12\|XW - Y\|^2$
with fresh minibatches $X$ every step, so the momentum $G$ drifts as in training. Every
step computes the **exact** duality certificate of each direction (SVD-based:
primal $\langle G, \hat A\rangle/\max(1,\|\hat A\|_2)$ over dual $\|G + L^*\Lambda\|_*$),
and the table reports its mean over steps and matrices, with the step time (without
the certificate) as a ratio to our Muon on the same matrices, timed interleaved.

``--solver projected`` adds rows of ManifoldMuon's projected solver (no dual; one row per
``--polish`` rounds). Its own dual iterate is the projection start, whose nuclear norm lies
several percent above the optimum inside training, so compare solvers with ``--reference K``
(every certificate then divides by the smaller of that and a K-step reference solve's dual value).

Sets: ``384x128`` (one 384×128 matrix) and ``gpt`` (2 layers × width 384 of the
GPT-2 block shapes of ``bench/optimizer_step.py``).

The measured table, with how it was produced, is on the docs' Results page
(``--markdown docs/results/benchmarks/manifold_frontier.md --overwrite`` writes it); the row of
ManifoldMuon's default (:func:`geomuon.optimizers.manifold_muon.default_dual_steps`, warm) is
marked there. A warm row's first step has no warm start and takes
:func:`~geomuon.optimizers.manifold_muon.default_cold_dual_steps` (the column says where that
is more than the row's dual steps).

Usage::

    python bench/manifold_frontier.py --set 384x128 --manifold stiefel --steps 40
    python bench/manifold_frontier.py --set 384x128 gpt --manifold stiefel dgram --dual 0 1 2 4
    python bench/manifold_frontier.py --set gpt --solver dual projected --reference 32
    python bench/manifold_frontier.py --quick      # seconds: a smoke test

Timing uses :func:`bench.timing.interleaved_medians`; ``--markdown PATH`` writes the
table with its provenance (see :mod:`bench.timing`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/manifold_frontier.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import (  # noqa: E402
    CLOCKS, Distinct, Provenance, add_arguments, at_least, interleaved_medians, markdown_row, markdown_table,
    refuse_dual_row_options,
)

#: ``--quick``: 3 steps, dual steps 0 and 1, 2 timed rounds (seconds; not a result).
QUICK = {"steps": 3, "dual": [0, 1], "repeats": 2}
#: The options that set only the dual solver's rows, with their defaults (``None`` on the
#: command line until parsed: an option given with ``--solver projected`` alone is refused).
DUAL_ROW_DEFAULTS = {"dual": list(range(9)), "starts": ["warm", "cold"], "retraction": ["fused"],
                     "update": ["newton", "jacobi"]}
#: ``--polish``'s default: the projected solver's rows by polish rounds.
PROJECTED_POLISH = [0, 1, 2]


def problem_shapes(name: str) -> list[tuple[int, int]]:
    if name == "384x128":
        return [(384, 128)]
    if name == "gpt":
        from bench.optimizer_step import gpt_shapes

        return gpt_shapes(2, 384)
    raise ValueError(f"unknown set {name!r}: choose 384x128 or gpt")


class Regression:
    """Noisy least squares per matrix; ``grads(params)`` fills ``p.grad`` from a fresh batch.

    The batch is twice the larger side of each matrix, so a gradient has full rank, as
    a transformer layer's does (tokens per batch far exceed the width). With fewer
    samples than columns the gradient is rank-deficient, the dual function is
    nonsmooth there and constant-step dual iterations stop helping.
    """

    def __init__(self, shapes, manifold, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.targets = [manifold.projx(torch.randn(s, generator=self.gen)) for s in shapes]
        self.start = [manifold.projx(torch.randn(s, generator=self.gen)) for s in shapes]

    def grads(self, params) -> None:
        for p, target in zip(params, self.targets):
            batch = 2 * max(p.shape)
            X = torch.randn(batch, p.shape[0], generator=self.gen)
            Y = X @ target + 0.1 * torch.randn(batch, p.shape[1], generator=self.gen)
            p.grad = X.mT @ (X @ p.detach() - Y) / batch


def run_config(shapes, manifold, dual_steps: int, warm: bool, steps: int, seed: int, alpha: float | None,
               reference: int = 0, **solver):
    from geomuon.optimizers import ManifoldMuon

    task = Regression(shapes, manifold, seed=seed)
    params = [torch.nn.Parameter(w.clone()) for w in task.start]
    opt = ManifoldMuon([{"params": params, "manifold": manifold}], lr=0.02, dual_steps=dual_steps,
                       warm_start=warm, dual_alpha=alpha, certify_every=1, certify_reference=reference, **solver)
    ratios = []
    for _ in range(steps):
        task.grads(params)
        opt.step()
        ratios.extend(opt.certificates.values())
    return statistics.mean(ratios), min(ratios)


def time_config(shapes, manifold, dual_steps: int, warm: bool, repeats: int, seed: int, alpha: float | None,
                clock=time.perf_counter, **solver):
    """Median step time of ManifoldMuon (no certificate) and of our Muon, interleaved."""
    from geomuon.optimizers import ManifoldMuon, Muon

    task = Regression(shapes, manifold, seed=seed)
    mm_params = [torch.nn.Parameter(w.clone()) for w in task.start]
    mu_params = [torch.nn.Parameter(w.clone()) for w in task.start]
    mm = ManifoldMuon([{"params": mm_params, "manifold": manifold}], lr=0.02, dual_steps=dual_steps,
                      warm_start=warm, dual_alpha=alpha, **solver)
    mu = Muon(mu_params, lr=0.02)

    def fresh_grads():
        task.grads(mm_params)
        for p, q in zip(mu_params, mm_params):
            p.grad = q.grad.clone()

    medians = interleaved_medians({"Muon": mu.step, "ManifoldMuon": mm.step}, repeats, clock,
                                  before_round=fresh_grads)
    return medians["ManifoldMuon"] / medians["Muon"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", nargs="+", action=Distinct, default=["384x128"], choices=["384x128", "gpt"])
    parser.add_argument("--manifold", nargs="+", action=Distinct, default=["stiefel"], choices=["stiefel", "dgram"])
    parser.add_argument("--steps", type=at_least(1), default=40, help="training steps per configuration")
    parser.add_argument("--dual", type=at_least(0), nargs="+", action=Distinct, default=None,
                        help="dual steps per optimizer step of the dual rows (default 0 to 8)")
    parser.add_argument("--starts", nargs="+", action=Distinct, choices=["warm", "cold"], default=None,
                        help="dual start of the dual rows (default warm and cold)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="dual step size (ManifoldMuon's dual_alpha; default: ManifoldMuon's, by manifold and update)")
    parser.add_argument("--msign", default=None, help="dualizer method (default: ManifoldMuon's)")
    parser.add_argument("--msign-steps", type=at_least(1), default=None)
    parser.add_argument("--retraction", nargs="+", action=Distinct, default=None, choices=["fused", "manifold"],
                        help="ManifoldMuon's retraction option (default fused): fused (the Gram-space path where the "
                             "manifold has a Gram form) and/or manifold (the general engine)")
    parser.add_argument("--update", nargs="+", action=Distinct, default=None, choices=["newton", "jacobi"],
                        help="the Gram path's dual update (ManifoldMuon's dual_update; default both); the general path "
                             "always takes Jacobi steps")
    parser.add_argument("--dualizer", default=None, choices=["eigh", "polar_express"],
                        help="the Gram path's dualizer (ManifoldMuon's gram_dualizer; default: its default)")
    parser.add_argument("--solver", nargs="+", action=Distinct, default=["dual"], choices=["dual", "projected"],
                        help="ManifoldMuon's solver: dual (the rows above, per dual steps, update and start) "
                             "and/or projected (no dual: one row per --polish)")
    parser.add_argument("--polish", type=at_least(0), nargs="+", action=Distinct, default=None,
                        help=f"polish rounds of the projected solver's rows (default {' '.join(map(str, PROJECTED_POLISH))}; needs --solver "
                             "projected: the dual rows take each manifold's default)")
    parser.add_argument("--reference", type=at_least(0), default=0,
                        help="dual steps of a reference solve at every certified step (ManifoldMuon's "
                             "certify_reference; default 0: each row's own last dual iterate, which for the "
                             "projected solver is the projection start)")
    add_arguments(parser, repeats=3, threads=2, repeats_help="timed rounds per configuration (0: no timing)",
                  min_repeats=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    refuse_dual_row_options(parser, args, (*DUAL_ROW_DEFAULTS, "alpha"))
    parser.set_defaults(**{**DUAL_ROW_DEFAULTS, **(QUICK if args.quick else {})})  # --quick's dual steps win
    args = parser.parse_args(argv)
    if args.polish is not None and "projected" not in args.solver:
        # (it had been ignored: the dual rows take the manifold's default polish rounds)
        parser.error(f"--polish sets the projected solver's rows, and --solver {' '.join(args.solver)} has none; "
                     "add --solver projected (or drop --polish)")
    polish_rounds = PROJECTED_POLISH if args.polish is None else args.polish
    from geomuon.optimizers import ManifoldMuon
    from geomuon.optimizers.manifold_muon import (default_cold_dual_steps, default_dual_steps, default_dual_update,
                                                  resolve_manifold)

    solver = {}
    if args.msign:
        solver["msign_method"] = args.msign
    if args.msign_steps is not None:
        solver["msign_steps"] = args.msign_steps
    if args.dualizer:
        solver["gram_dualizer"] = args.dualizer

    def dual_row_options(retraction: str, update: str) -> dict:
        """ManifoldMuon's options of a dual row: the general path (``retraction="manifold"``)
        always takes Jacobi steps, and ManifoldMuon refuses a ``dual_update`` there."""
        return dict(solver, retraction=retraction, **({"dual_update": update} if retraction == "fused" else {}))

    rows_options = [solver] + ([dual_row_options(r, u) for r in args.retraction for u in args.update]
                               if "dual" in args.solver else [])
    try:  # ManifoldMuon's own checks, before any run (an unknown --msign, or --retraction manifold, had
        # failed with a traceback after the rows before it)
        for name in args.manifold:
            point = torch.nn.Parameter(resolve_manifold(name, "--manifold").projx(torch.randn(4, 2)))
            for options in rows_options:
                ManifoldMuon([point], manifold=name, dual_alpha=args.alpha, **options)
    except ValueError as err:
        parser.error(f"--alpha/--msign/--msign-steps/--dualizer/--retraction: ManifoldMuon refuses them: {err}")
    provenance = Provenance(__file__, args, argv, parser, timed=args.repeats > 0)
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    header = ["set", "manifold", "path", "dual update", "dual steps", "start", "mean certified ratio", "min", "step cost / Muon"]
    alpha = "ManifoldMuon's" if args.alpha is None else args.alpha
    timing = (f"{args.clock} clock, step cost: median of {args.repeats} interleaved rounds" if args.repeats
              else "no timing (--repeats 0)")
    lines = [
        f"{args.steps} steps per configuration, alpha={alpha}, lr=0.02, bf16 dual iterations, dualizer "
        f"{solver or 'default'}, {args.threads} thread(s), {timing}; start \"(default)\": ManifoldMuon's default solver",
        "",
        markdown_table(header, []),
    ]
    print("\n".join(lines))
    def measure(shapes, manifold, dual_steps, warm, alpha, options):
        """A row's certified ratios (mean, min) and its step cost against Muon ("-" untimed)."""
        mean, low = run_config(shapes, manifold, dual_steps, warm, args.steps, args.seed, alpha, args.reference,
                               **options)
        if not args.repeats:
            return mean, low, "-"
        ratio = time_config(shapes, manifold, dual_steps, warm, args.repeats, args.seed, alpha, clock, **options)
        return mean, low, f"{ratio:.2f}"

    starts = [start == "warm" for start in args.starts]
    # (0 dual steps warm and cold differ: a warm start carries one dual step from the last step)
    combinations = itertools.product(args.set, args.manifold, args.retraction, args.update, args.dual,
                                     starts) if "dual" in args.solver else ()
    for set_name, manifold_name, retraction, update, dual_steps, warm in combinations:
        if retraction == "manifold" and update != args.update[0]:
            continue  # the general path has one dual update
        shapes = problem_shapes(set_name)
        manifold = resolve_manifold(manifold_name, "--manifold")
        if retraction == "fused" and update == "newton" and default_dual_update(manifold) != "newton":
            continue  # the form declares no Newton step (it would take Jacobi steps: the Jacobi rows)
        options = dual_row_options(retraction, update)
        mean, low, cost = measure(shapes, manifold, dual_steps, warm, args.alpha, options)
        start = "warm" if warm else "cold"
        if (dual_steps == default_dual_steps(manifold) and warm and not solver and retraction == "fused"
                and update == default_dual_update(manifold) and args.alpha is None):
            start += " (default)"
        where = f"{set_name} ({len(shapes)} matrices)"
        path = "Gram space" if retraction == "fused" else "general"
        update = update if retraction == "fused" else "jacobi"
        cold = default_cold_dual_steps(manifold, dual_steps)
        steps = f"{dual_steps} (first: {cold})" if warm and cold != dual_steps else str(dual_steps)
        lines.append(markdown_row([where, manifold_name, path, update, steps, start, f"{mean:.4f}", f"{low:.4f}", cost]))
        print(lines[-1], flush=True)
    projected = itertools.product(args.set, args.manifold, polish_rounds) if "projected" in args.solver else ()
    for set_name, manifold_name, polish in projected:
        shapes = problem_shapes(set_name)
        manifold = resolve_manifold(manifold_name, "--manifold")
        options = dict(solver, solver="projected", polish_rounds=polish)
        mean, low, cost = measure(shapes, manifold, None, False, None, options)  # (no dual options)
        lines.append(markdown_row([f"{set_name} ({len(shapes)} matrices)", manifold_name, "Gram space, projected",
                                   "-", f"0 (polish {polish})", "projection", f"{mean:.4f}", f"{low:.4f}", cost]))
        print(lines[-1], flush=True)
    return provenance.finish("\n".join(lines), printed=True)


if __name__ == "__main__":
    raise SystemExit(main())
