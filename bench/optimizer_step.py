r"""Optimizer step time and state memory on a GPT-2-shaped parameter set.

The hidden matrices of a GPT-2-style model scaled to a CPU (default 6 layers × width
384: fused QKV ``[3d, d]``, attention output ``[d, d]``, MLP in ``[4d, d]`` and out
``[d, 4d]``, PyTorch ``[out, in]`` layout) get fixed random gradients, and each
optimizer's ``step()`` is timed. Repeats are **interleaved** (one step of every
optimizer per round, so a change in machine load hits all of them alike) and the table
reports medians as ratios to a baseline, plus the optimizer state in MiB.

Rows: ``torch.optim.Muon`` and our :class:`optimizers.Muon` (same settings, bf16
Newton–Schulz); :class:`optimizers.ManifoldMuon` on Stiefel and on DGram with its
default solver; ``geoopt.optim.RiemannianAdam`` on Stiefel (our ``manifolds.Stiefel``
through geoopt's ``ManifoldParameter``).

Usage::

    python bench/optimizer_step.py                 # 6 x 384, 7 rounds
    python bench/optimizer_step.py --repeats 3 --layers 2 --width 256 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def gpt_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """Hidden matrices of a GPT-2 block stack, ``[out, in]``."""
    block = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return block * layers


def state_mib(optimizer: torch.optim.Optimizer) -> float:
    total = 0
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total / 2**20


def build(shapes, seed: int):
    """Every optimizer under test, each on its own copy of the parameters."""
    import geoopt

    from manifolds import DGram, Stiefel
    from optimizers import ManifoldMuon, Muon

    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) / s[1] ** 0.5 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]

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
        "ManifoldMuon Stiefel": ManifoldMuon(params(stiefel), lr=0.02),
        "ManifoldMuon DGram": ManifoldMuon(params(dgram), lr=0.02),
        "RiemannianAdam Stiefel": geoopt.optim.RiemannianAdam(params(stiefel), lr=1e-3),
    }
    return optimizers, grads


def measure(optimizers: dict, grads: list[torch.Tensor], repeats: int, clock=time.perf_counter,
            warmup: int = 1) -> dict:
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for round_ in range(warmup + repeats):
        for name, opt in optimizers.items():
            params = [p for g in opt.param_groups for p in g["params"]]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            start = clock()
            opt.step()
            elapsed = clock() - start
            if round_ >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="process: CPU time of this process, robust to other load on a shared "
                             "machine when --threads 1 (with more threads it counts spin-waits)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes(args.layers, args.width)
    optimizers, grads = build(shapes, args.seed)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    medians = measure(optimizers, grads, args.repeats, clock)
    params_mib = sum(s[0] * s[1] for s in shapes) * 4 / 2**20
    baselines = {
        "torch.optim.Muon": "torch.optim.Muon",
        "Muon (ours)": "torch.optim.Muon",
        "ManifoldMuon Stiefel": "Muon (ours)",
        "ManifoldMuon DGram": "Muon (ours)",
        "RiemannianAdam Stiefel": "Muon (ours)",
    }
    print(f"{len(shapes)} matrices ({args.layers} layers x {args.width}), {params_mib:.1f} MiB of fp32 "
          f"weights, {args.threads} threads, {args.clock} clock, median of {args.repeats} interleaved rounds")
    print(f"| optimizer | step (ms) | ratio | vs | state (MiB) |")
    print("|---|---|---|---|---|")
    for name, median in medians.items():
        base = baselines[name]
        print(f"| {name} | {1e3 * median:.1f} | {median / medians[base]:.2f} | {base} | "
              f"{state_mib(optimizers[name]):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
