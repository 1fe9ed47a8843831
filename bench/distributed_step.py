r"""The optimizer step on 1, 2 and 4 gloo processes (CPU): per-rank time, work, bytes, and the difference.

A GPT-shaped set of matrices (per layer: attention ``[3C, C]`` and ``[C, C]``, MLP
``[4C, C]`` and ``[C, 4C]``; $L$ layers, so same-shape batches of $L$ matrices) is
stepped by each optimizer with the same seeded gradients on every world size:

* ``fsdp``: the parameters are ``Shard(0)`` ``DTensor``\ s (FSDP2's layout) and the step is
  :mod:`geomuon.optimizers.distributed`'s (whole matrices mapped on owner ranks, two
  all-to-alls per same-shape batch; row-wise maps on their shards);
* ``ddp``: replicated parameters, each stepped by its owner rank
  (:func:`geomuon.pretrain.train.owners`), handed out by
  :class:`geomuon.pretrain.parallel.OwnerGather` (one all-gather per dtype);
* world 1: the plain single-process step, the reference.

Per world size and mode, the table reports the median step time of the slowest rank,
the ``_direction`` time (the orthogonalisations / dual solves, timed inside the step) of
the busiest rank as a fraction of the single-process one (target: $\le 1/w + 10\%$),
the whole matrices that rank mapped per step out of all, the matrices that went through
the matrix-sign kernels (``msign``; the Gram path's dualizers ``gram_msign``,
``eigen_dualizer``: counted at every call site) on that
rank per step, the bytes a rank receives per step relative to the parameter bytes it
holds (FSDP: its shards, target $\le 2$; DDP: the whole model, target $\le 1$), the bytes
all ranks send per step relative to the parameters updated (target $\le 2$ under FSDP2,
$\le 1$ under DDP; bytes per step are those of the steps after the first), the same for the
first step (under FSDP2 a whole-matrix apply, e.g. Manifold Muon's retraction, also sends
the weights then, to build the owners' replicas), for Manifold Muon under FSDP2
the same for the Gram all-reduce alternative (a byte model,
:func:`gram_allreduce_bytes`: it is not a code path; it sends fewer bytes than the
all-to-alls only for $m > 3wn$, which no GPT block matrix is), and the largest difference of the
final weights from the single-process ones (relative to each matrix's largest entry), the
single-process run repeated on rank 0 of each launch so both use the code that launch
loaded. Times depend on the machine's load; counts, bytes and differences do not.

Usage::

    python bench/distributed_step.py --threads 1 --clock process
    python bench/distributed_step.py --quick              # seconds: a smoke test
    python bench/distributed_step.py --threads 1 --clock process --markdown docs/results/benchmarks/distributed_step.md --overwrite
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/distributed_step.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import CLOCKS, Provenance, add_arguments, markdown_table, refuse_repeated  # noqa: E402

SIZES = {"full": (256, 4), "quick": (32, 2)}  # (C, layers)
#: ``--quick``: timed steps after the warm-up one
QUICK_REPEATS = 2
OPTIMIZERS = ("muon", "manifold_muon[stiefel]", "row_norm")


def shapes(width: int, layers: int) -> list[tuple[int, int]]:
    return [s for _ in range(layers) for s in ((3 * width, width), (width, width), (4 * width, width),
                                                (width, 4 * width))]


def make_optimizer(name: str, params):
    from geomuon.optimizers import ManifoldMuon, Muon, RowNormM

    if name == "muon":
        return Muon(params, lr=0.02)  # bf16 Newton–Schulz, torch.optim.Muon's default
    if name == "row_norm":
        return RowNormM(params, lr=0.02)
    return ManifoldMuon(params, lr=0.02, manifold="stiefel")


def initial(shape_list) -> list[torch.Tensor]:
    """Seeded Stiefel points (every optimizer starts on the manifold Manifold Muon needs)."""
    from geomuon.manifolds import Stiefel

    generator = torch.Generator().manual_seed(0)
    return [Stiefel().random(*s, generator=generator) for s in shape_list]


def gradient(step: int, shape_list) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(*s, generator=generator) for s in shape_list]


#: where the package's matrix-sign kernels (and the Gram path's dualizers, its matrix sign
#: in $n\times n$) are called from: (module, function name); a name a module lacks is skipped
MSIGN_SITES = (("geomuon.optimizers.muon", "msign"), ("geomuon.optimizers.maps", "msign"),
               ("geomuon.optimizers.steepest", "msign"), ("geomuon.optimizers.gram", "gram_msign"),
               ("geomuon.optimizers.gram", "eigen_dualizer"), ("geomuon.manifolds.stiefel", "msign"),
               ("geomuon.manifolds.dgram", "msign"))


_MSIGN_MATRICES = [0]  # matrices through the matrix-sign kernels in this process


def count_matrix_signs() -> list[int]:
    """Count the matrices every call of the matrix-sign kernels (``msign``, ``gram_msign``,
    ``eigen_dualizer``) maps (``prod(X.shape[:-2])`` of its batch) in ``_MSIGN_MATRICES``; installed once."""
    import importlib
    import math

    for module_name, name in MSIGN_SITES:
        module = importlib.import_module(module_name)
        inner = getattr(module, name, None)
        if inner is None or getattr(inner, "counted", False):
            continue

        def counted(X, *args, _inner=inner, **kwargs):
            _MSIGN_MATRICES[0] += math.prod(X.shape[:-2])
            return _inner(X, *args, **kwargs)

        counted.counted = True
        setattr(module, name, counted)
    return _MSIGN_MATRICES


def gram_allreduce_bytes(shape: tuple[int, int], world: int, diagonal_gram: bool, itemsize: int = 4) -> float | None:
    r"""Bytes all ranks send per step for one matrix under the Gram all-reduce alternative
    (model, not run): the row contractions $W^\top W$ ($n$ entries when the form's Gram
    is diagonal), $W^\top G$, $Z_0^\top Z_0$ and $Y^\top Y$ all-reduced in fp32, a ring
    all-reduce sending $2(w-1)/w$ of its payload per rank. ``None`` where it does not
    apply: the Gram side of a wide matrix is the sharded (row) side."""
    m, n = shape
    if m < n:
        return None
    payload = (n if diagonal_gram else n * n) + 3 * n * n
    return 2 * (world - 1) * payload * itemsize


def _timed_direction(optimizer, clock, spent: list[float]) -> None:
    inner = optimizer._direction

    def direction(group, M, params, keep=None):
        start = clock()
        out = inner(group, M, params, keep)
        spent[-1] += clock() - start
        return out

    optimizer._direction = direction


def measure(name: str, mode: str, steps: int, width: int, layers: int, clock_name: str) -> dict:
    """One optimizer and mode on this process (its rank of the world, or alone)."""
    import torch.distributed as dist

    from geomuon.optimizers.distributed import as_shard, local_rows, sharding_stats, whole

    clock = CLOCKS[clock_name]
    shape_list = shapes(width, layers)
    start_points = initial(shape_list)
    together = dist.is_initialized() and mode != "single"
    world = dist.get_world_size() if together else 1
    rank = dist.get_rank() if together else 0
    handout = None
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in start_points]
    else:
        params = [torch.nn.Parameter(w.clone()) for w in start_points]
    optimizer = make_optimizer(name, params)
    if mode == "ddp":
        from geomuon.pretrain.parallel import OwnerGather
        from geomuon.pretrain.train import owners

        handout = OwnerGather(params, owners(params, world), rank, world)
    owned = [r == rank for r in handout.owner] if handout else [True] * len(params)
    spent: list[float] = []
    _timed_direction(optimizer, clock, spent)
    signs = count_matrix_signs()
    signs_before = signs[0]
    step_times = []
    first = None  # (sent, received) after the first step: it also builds the owners' replicas
    for step in range(steps):
        for p, g, mine in zip(params, gradient(step, shape_list), owned):
            if mode == "fsdp":  # this rank's rows of the gradient, as FSDP2's reduce-scatter leaves them
                p.grad = as_shard(local_rows(g, p), p)
            else:
                p.grad = g if mine else None
        spent.append(0.0)
        if world > 1:
            dist.barrier()
        begin = clock()
        optimizer.step()
        if handout is not None:
            handout.gather()
        step_times.append(clock() - begin)
        if step == 0:
            first = _bytes(mode, sharding_stats(optimizer), handout)
    stats = sharding_stats(optimizer)
    final = [whole(p.detach()) for p in params]
    held = sum(p.to_local().numel() * p.element_size() if mode == "fsdp" else p.numel() * p.element_size()
               for p in params)
    matrices = stats.matrices_mapped if mode == "fsdp" else (
        steps * sum(owned) if mode == "ddp" else steps * len(params))
    sent, received = _bytes(mode, stats, handout)
    return {
        "step": statistics.median(step_times[1:] or step_times),
        "direction": statistics.median(spent[1:] or spent),
        "matrices_per_step": matrices / steps,
        "signs_per_step": (signs[0] - signs_before) / steps,
        "received_per_step": (received - first[1]) / (steps - 1),
        "sent_per_step": (sent - first[0]) / (steps - 1),
        "sent_first_step": first[0],
        "held_bytes": held,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "matrices": len(params),
        "final": final if rank == 0 else None,
    }


def _bytes(mode: str, stats, handout) -> tuple[int, int]:
    """(bytes sent, bytes received) by this rank so far."""
    if mode == "fsdp":
        return stats.bytes_sent, stats.bytes_received
    if mode == "ddp":  # a rank's (padded) block of each gather reaches the w - 1 others
        received = handout.bytes_received
        return received, received  # every block has the bucket's padded length: sent = received per rank
    return 0, 0


def worker(out: str, args_json: str) -> None:
    import torch.distributed as dist

    args = json.loads(args_json)
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo")
    results = {}
    for name in OPTIMIZERS:
        for mode in ("fsdp", "ddp"):
            results[f"{name}|{mode}"] = measure(name, mode, args["steps"], args["width"], args["layers"],
                                                args["clock"])
    if dist.get_rank() == 0:  # the reference from the code this process loaded (the tree may change meanwhile)
        for name in OPTIMIZERS:
            results[f"{name}|single"] = measure(name, "single", args["steps"], args["width"], args["layers"],
                                                args["clock"])
    torch.save(results, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, out: Path, worker_args: dict) -> list[dict]:
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS=str(worker_args["threads"]))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(out), json.dumps(worker_args)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"world {world}: a rank failed:\n" + "\n".join(outputs))
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _gram_alternative(name: str, mode: str, width: int, layers: int, world: int) -> str:
    r"""Manifold Muon under FSDP2 with the Gram all-reduce where it applies (tall and square
    matrices, :func:`gram_allreduce_bytes`) and the measured path's all-to-alls elsewhere
    (wide ones: $\tfrac{w-1}{w}\,mn$ fp32 entries of momentum out and weights back, the
    owners' replicas held), relative to the parameter bytes; ``–`` for the other rows."""
    if name != "manifold_muon[stiefel]" or mode != "fsdp":
        return "–"
    total = 0.0
    for shape in shapes(width, layers):
        gram = gram_allreduce_bytes(shape, world, diagonal_gram=True)
        total += gram if gram is not None else (world - 1) / world * shape[0] * shape[1] * 2 * 4
    return f"{total / (4 * sum(a * b for a, b in shapes(width, layers))):.2f}"


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, repeats=5, threads=1, repeats_help="timed steps after one warm-up step")
    parser.add_argument("--worlds", default="1,2,4", help="process counts (default 1,2,4; 1 is the reference)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.quick:  # two timed steps unless --repeats says otherwise (an explicit --repeats had been ignored)
        parser.set_defaults(repeats=QUICK_REPEATS)
        args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds must be comma-separated process counts such as 1,2,4, got {args.worlds!r}")
    if worlds[0] != 1 or min(worlds) < 1:
        parser.error(f"--worlds must be process counts >= 1 starting with 1 (the single-process reference), "
                     f"got {args.worlds!r}")
    refuse_repeated(parser, "--worlds", worlds)
    provenance = Provenance(__file__, args, argv, parser)
    torch.set_num_threads(args.threads)
    width, layers = SIZES["quick" if args.quick else "full"]
    steps = 1 + args.repeats
    reference = {}
    for name in OPTIMIZERS:
        reference[name] = measure(name, "single", steps, width, layers, args.clock)
    import tempfile

    rows = []
    for name in OPTIMIZERS:
        ref = reference[name]
        rows.append([name, "1", "single", f"{ref['step'] * 1e3:.1f}", "1.00", f"{ref['matrices']}/{ref['matrices']}",
                     f"{ref['signs_per_step']:g}", "0", "0", "0", "–", "0"])
    for world in worlds[1:]:
        with tempfile.TemporaryDirectory() as out:
            ranks = launch(world, Path(out), {"threads": args.threads, "steps": steps, "width": width,
                                              "layers": layers, "clock": args.clock})
        for name in OPTIMIZERS:
            ref = reference[name]
            for mode in ("fsdp", "ddp"):
                per = [r[f"{name}|{mode}"] for r in ranks]
                received = max(p["received_per_step"] / p["held_bytes"] for p in per)
                total_sent = sum(p["sent_per_step"] for p in per) / ref["parameter_bytes"]
                rows.append([
                    name, str(world), mode,
                    f"{max(p['step'] for p in per) * 1e3:.1f}",
                    f"{max(p['direction'] for p in per) / ref['direction']:.2f} (≤ {1 / world + 0.1:.2f})",
                    f"{max(p['matrices_per_step'] for p in per):g}/{ref['matrices']}",
                    f"{max(p['signs_per_step'] for p in per):g}",
                    f"{received:.2f}",
                    f"{total_sent:.2f}",
                    f"{sum(p['sent_first_step'] for p in per) / ref['parameter_bytes']:.2f}",
                    _gram_alternative(name, mode, width, layers, world),
                    f"{difference(per[0]['final'], ranks[0][f'{name}|single']['final']):.1e}",
                ])
    header = ["optimizer", "processes", "mode", "step ms (slowest rank)", "direction time, busiest rank / 1 process",
              "matrices mapped per step by busiest rank (row-wise: its rows' share)",
              "matrix-sign / dualizer matrices per step, busiest rank", "bytes received per rank / bytes it holds",
              "bytes sent, all ranks / parameter bytes",
              "first step: bytes sent, all ranks / parameter bytes",
              "Gram all-reduce alternative: bytes sent, all ranks / parameter bytes (model)",
              "max rel. difference from 1 process"]
    text = (f"GPT-shaped set: C = {width}, {layers} layers, {4 * layers} fp32 matrices "
            f"({sum(a * b for a, b in shapes(width, layers)) * 4 / 2**20:.1f} MiB); {steps} steps "
            f"(the first untimed and its bytes in their own column: it also sends the weights to the owners' "
            f"replicas), the same gradients on every world size.\n\n"
            + markdown_table(header, rows))
    return provenance.finish(text)


if __name__ == "__main__":
    sys.exit(main())
