"""FSDP2 (DTensor) parameters: two gloo processes against one, for every matrix optimizer.

One spawn of two CPU processes runs every optimizer configuration below for ``STEPS``
steps on a small model whose matrices are ``fully_shard``-ed (uneven row splits, a
same-shape batch of 3 over 2 ranks, AdamW biases), plus a negative control whose rank 0
drops rank 1's rows on the way to the owner. The test process runs the same
configurations on one process and compares.

Run as a script (``python tests/test_distributed.py OUT``) it is the worker.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import torch

from geomuon.optimizers import HybridPolarGradM, LeftPolarGradM, ManifoldMuon, Muon, RightPolarGradM, RowNormM

STEPS = 20
WORLD = 2
IN, HIDDEN, OUT = 8, 5, 12  # 5 and 3 hidden rows do not split evenly over 2 ranks


class Net(torch.nn.Module):
    """Three same-shape [5, 8] matrices (one batch), a [12, 5] and a [3, 12] one."""

    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(IN, HIDDEN) for _ in range(3))
        self.up = torch.nn.Linear(HIDDEN, OUT, bias=False)
        self.head = torch.nn.Linear(OUT, 3, bias=False)

    def forward(self, x):
        h = sum(torch.tanh(b(x)) for b in self.branches)
        return self.head(torch.tanh(self.up(h)))


def _groups(model, **matrix):
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=matrices, **matrix), dict(params=vectors, update="adamw", lr=1e-2)]


# fp32 kernels everywhere (compute_dtype=None): the tolerance below is the fp32 one
CONFIGS = {
    "muon": lambda m: Muon(_groups(m), lr=0.02, compute_dtype=None),
    "muon+spectral_normalize": lambda m: Muon(_groups(m, regulate={"name": "spectral_normalize", "w_max": 1.0}),
                                              lr=0.02, compute_dtype=None),
    "row_norm": lambda m: RowNormM(_groups(m), lr=0.02),
    "centered_row_norm": lambda m: RowNormM(_groups(m), lr=0.02, centered=True),
    "right_polar": lambda m: RightPolarGradM(_groups(m), lr=0.002),
    "left_polar": lambda m: LeftPolarGradM(_groups(m), lr=0.002),
    "hybrid": lambda m: HybridPolarGradM(_groups(m, weight_decay=0.1), lr=0.002),
    **{
        f"manifold_muon[{name}]": (lambda name: lambda m: ManifoldMuon(
            _groups(m), lr=0.02, manifold=name, compute_dtype=None))(name)
        for name in ("stiefel", "dgram", "oblique", "euclidean", "centered_router", "lpro")
    },
}
NEGATIVE = "muon"  # the configuration the negative control reruns with a dropped shard


def batches(rank: int = 0, world: int = 1):
    """The global batch of every step (seeded), and this rank's slice of it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(8, IN, generator=g, dtype=torch.float64)
        y = torch.randn(8, 3, generator=g, dtype=torch.float64)
        size = len(x) // world
        yield x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]


def fresh_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def run(name: str, model, rank: int = 0, world: int = 1):
    opt = CONFIGS[name](model)
    if name.startswith("manifold_muon"):
        opt.project_to_manifolds()
    for x, y in batches(rank, world):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def full_state(model) -> dict[str, torch.Tensor]:
    from geomuon.optimizers.distributed import whole

    return {k: whole(v.detach()).clone() for k, v in model.named_parameters()}


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from geomuon.optimizers import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def sharded_model():
        model = fresh_model()
        for module in [*model.branches, model.up, model.head]:
            fully_shard(module)
        return fully_shard(model)

    results = {}
    for name in CONFIGS:
        model = sharded_model()
        stats = distributed.sharding_stats(run(name, model, rank, world))
        results[name] = {"params": full_state(model), "stats": vars(stats).copy()}

    # negative control: rank 0 drops rank 1's rows of every matrix it owns
    real = distributed._all_to_all

    def dropping(outgoing, incoming, *args):
        received = real(outgoing, incoming, *args)
        if rank == 0:
            received[1] = [torch.zeros_like(t) for t in received[1]]
        return received

    distributed._all_to_all = dropping
    model = sharded_model()
    run(NEGATIVE, model, rank, world)
    results["dropped_shard"] = {"params": full_state(model)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in b)


# Tolerance. Float64 throughout (math test). Each rank's gradient is the mean over its half
# of the batch and FSDP2 averages the halves, so the gradient differs from the
# one-process full-batch mean by reduction-order round-off, |dg| <= c u |g| with
# u = 2^-53 and c ~ 4 (a sum of 8 rows in another order, plus the halving). The maps
# amplify a relative input error by at most their condition number: msign and the
# polar maps by ~ sigma_max/sigma_min of the momentum (~1e2 for these 5x8 random
# matrices), the manifold directions and retractions by the same order. Twenty steps
# add (do not compound beyond) such errors, and the 8 random-data rows keep the
# trajectory well-conditioned: 20 * 4 * 1e2 * u ~ 1e-12 of the weights' scale. 1e-10
# leaves two orders of margin for the iteration counts (polishing, Newton-Schulz stops)
# that read batch-wide maxima; the negative control moves weights by O(lr) = 1e-2.
TOLERANCE = 1e-10


def test_fsdp2_matches_one_process_for_every_optimizer(tmp_path):
    env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, str(tmp_path)],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in range(WORLD)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    matrix_batches = [3, 1, 1]  # same-shape batches of Net's matrices
    for name in CONFIGS:
        model = fresh_model()
        run(name, model)
        reference = full_state(model)
        difference = _relative_difference(ranks[0][name]["params"], reference)
        assert difference < TOLERANCE, f"{name}: FSDP2 differs from one process by {difference:.3g}"
        for r in range(1, WORLD):
            assert _relative_difference(ranks[r][name]["params"], ranks[0][name]["params"]) == 0, name
        mapped = [ranks[r][name]["stats"]["matrices_mapped"] for r in range(WORLD)]
        # no matrix mapped twice, none skipped (a row-wise map counts its fraction of rows)
        assert math.isclose(sum(mapped), STEPS * sum(matrix_batches)), (name, mapped)
        # and each rank maps at most ceil(B / w) of every batch of B
        assert max(mapped) <= STEPS * sum(math.ceil(b / WORLD) for b in matrix_batches), (name, mapped)

    # the negative control is caught by the same comparison
    model = fresh_model()
    run(NEGATIVE, model)
    dropped = _relative_difference(ranks[0]["dropped_shard"]["params"], full_state(model))
    assert dropped > 1e3 * TOLERANCE, dropped


if __name__ == "__main__":
    worker(sys.argv[1])
