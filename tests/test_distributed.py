"""FSDP2 (DTensor) and DDP owner-gather steps: 2 and 4 gloo processes against one, every matrix optimizer.

The model has one tower per optimizer configuration (each tower: a same-shape batch of
three [5, 8] matrices, which 2 and 4 ranks split unevenly both by matrix and by row — 4
ranks hold 2, 2, 1 and 0 of the 5 rows —, a [12, 5] and a [3, 12] matrix, AdamW
biases); each configuration steps its own tower, so one training run covers every
optimizer. One spawn of the CPU processes runs it ``fully_shard``-ed (FSDP2) and
DDP-wrapped, plus negative controls; the test process runs the same model on one
process and compares. The 4-process spawn is ``slow`` (2.7 min on the 2 shared cores;
``pytest -m slow tests/test_distributed.py``).

Run as a script (``python tests/test_distributed.py OUT``) it is the worker.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from geomuon.optimizers import HybridPolarGradM, LeftPolarGradM, ManifoldMuon, Muon, RightPolarGradM, RowNormM

STEPS = 20
WORLDS = (2, pytest.param(4, marks=pytest.mark.slow))
IN, HIDDEN, OUT = 8, 5, 12  # 5 and 3 rows do not split evenly over 2 ranks
MATRIX_BATCHES = (3, 1, 1)  # same-shape batches of a tower's matrices


class Tower(torch.nn.Module):
    """Three same-shape [5, 8] matrices (one batch), a [12, 5] and a [3, 12] one."""

    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(IN, HIDDEN) for _ in range(3))
        self.up = torch.nn.Linear(HIDDEN, OUT, bias=False)
        self.head = torch.nn.Linear(OUT, 3, bias=False)

    def forward(self, x):
        h = sum(torch.tanh(b(x)) for b in self.branches)
        return self.head(torch.tanh(self.up(h)))


def _groups(tower, **matrix):
    matrices = [p for p in tower.parameters() if p.dim() == 2]
    vectors = [p for p in tower.parameters() if p.dim() < 2]
    return [dict(params=matrices, **matrix), dict(params=vectors, update="adamw", lr=1e-2)]


# float64 and compute_dtype=None everywhere: a test of the math (the tolerance is float64's)
CONFIGS = {
    "muon": lambda t: Muon(_groups(t), lr=0.02, compute_dtype=None),
    "muon+spectral_normalize": lambda t: Muon(_groups(t, regulate={"name": "spectral_normalize", "w_max": 1.0}),
                                              lr=0.02, compute_dtype=None),
    "row_norm": lambda t: RowNormM(_groups(t), lr=0.02),
    "centered_row_norm": lambda t: RowNormM(_groups(t), lr=0.02, centered=True),
    "right_polar": lambda t: RightPolarGradM(_groups(t), lr=0.002),
    "left_polar": lambda t: LeftPolarGradM(_groups(t), lr=0.002),
    "hybrid+decay": lambda t: HybridPolarGradM(_groups(t, weight_decay=0.1), lr=0.002),
    **{
        f"manifold_muon[{name}]": (lambda name: lambda t: ManifoldMuon(
            _groups(t), lr=0.02, manifold=name, compute_dtype=None))(name)
        for name in ("stiefel", "dgram", "oblique", "euclidean", "centered_router", "lpro")
    },
    # the exact duality certificate every 5 steps (its bookkeeping names the parameter)
    "manifold_muon[stiefel]+certify": lambda t: ManifoldMuon(_groups(t), lr=0.02, manifold="stiefel",
                                                             compute_dtype=None, certify_every=5),
}
#: one configuration with an elementwise apply, one with a whole-matrix retraction
DDP_CONFIGS = ("muon", "manifold_muon[stiefel]")


class Towers(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        self.towers = torch.nn.ModuleDict({_key(n): Tower() for n in names})

    def forward(self, x):
        return torch.stack([t(x) for t in self.towers.values()])


def _key(name: str) -> str:
    return name.replace("[", "_").replace("]", "").replace("+", "_")


def fresh_model(names=tuple(CONFIGS)) -> Towers:
    torch.manual_seed(0)
    return Towers(names).double()


def optimizers(model: Towers, names) -> dict:
    opts = {name: CONFIGS[name](model.towers[_key(name)]) for name in names}
    for name, opt in opts.items():
        if name.startswith("manifold_muon"):
            opt.project_to_manifolds()
    return opts


def batches(rank: int = 0, world: int = 1):
    """The global batch of every step (seeded), and this rank's slice of it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(8, IN, generator=g, dtype=torch.float64)
        y = torch.randn(8, 3, generator=g, dtype=torch.float64)
        size = len(x) // world
        yield x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]


def train(model, module, opts: dict, rank: int = 0, world: int = 1, before=None, after=None) -> None:
    """``STEPS`` steps; each tower's loss is the mean squared error of its outputs (the
    towers' gradients do not mix: the sum's derivative is exact)."""
    for x, y in batches(rank, world):
        out = module(x)
        torch.nn.functional.mse_loss(out, y.expand_as(out), reduction="sum").div(y.numel()).backward()
        if before:
            before()
        for opt in opts.values():
            opt.step()
        if after:
            after()
        model.zero_grad(set_to_none=True)


def full_state(model) -> dict[str, torch.Tensor]:
    from geomuon.optimizers.distributed import whole

    return {k: whole(v.detach()).clone() for k, v in model.named_parameters()}


def _fsdp(names):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(fresh_model(names))  # one FSDP unit: one all-gather per pass


def _ddp(names, rank, world, drop_from=None):
    """A DDP run of ``names``; ``drop_from``: rank 0 ignores what that rank hands out."""
    from torch.nn.parallel import DistributedDataParallel

    from geomuon.pretrain.parallel import OwnerGather
    from geomuon.pretrain.train import owners

    model = fresh_model(names)
    opts = optimizers(model, names)
    params = [p for opt in opts.values() for g in opt.param_groups for p in g["params"]]
    owner = owners(params, world)
    handout = OwnerGather(params, owner, rank, world)
    others = handout.others()
    stale = [p for p, r in zip(params, owner) if r == drop_from] if rank == 0 else []
    kept = []

    def before():
        for p in others:
            p.grad = None

    def after():
        kept[:] = [p.detach().clone() for p in stale]
        handout.gather()
        for p, old in zip(stale, kept):
            p.detach().copy_(old)

    train(model, DistributedDataParallel(model), opts, rank, world, before, after)
    return {"params": full_state(model), "bytes_received": handout.bytes_received,
            "collectives": handout.collectives}


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from geomuon.optimizers import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}

    model = _fsdp(CONFIGS)
    opts = optimizers(model, CONFIGS)
    train(model, model, opts, rank, world)
    results["fsdp"] = {"params": full_state(model),
                       "stats": {n: vars(distributed.sharding_stats(o)).copy() for n, o in opts.items()}}

    # negative control: rank 0 drops rank 1's rows of every matrix it owns
    real = distributed._all_to_all

    def dropping(outgoing, incoming, *args):
        received = real(outgoing, incoming, *args)
        if rank == 0:
            received[1] = [torch.zeros_like(t) for t in received[1]]
        return received

    distributed._all_to_all = dropping
    model = _fsdp(["muon"])
    train(model, model, optimizers(model, ["muon"]), rank, world)
    results["fsdp:dropped_shard"] = full_state(model)
    distributed._all_to_all = real

    results["ddp"] = _ddp(DDP_CONFIGS, rank, world)
    results["ddp:dropped_copy"] = _ddp(["muon"], rank, world, drop_from=1)["params"]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}proc")
def distributed_runs(request, tmp_path_factory):
    """The workers' results: one spawn of each world size's processes for every test here."""
    world = request.param
    tmp_path = tmp_path_factory.mktemp(f"distributed{world}")
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, str(tmp_path)],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def one_process(names) -> dict[str, torch.Tensor]:
    model = fresh_model(names)
    train(model, model, optimizers(model, names))
    return full_state(model)


def _relative_difference(a: dict, b: dict, prefix: str = "") -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300))
               for k in b if k.startswith(prefix))


# Tolerance. Float64 throughout (a test of the math). Each rank's gradient is the mean over
# its 1/w of the batch and FSDP2 (DDP) averages the w means, so the gradient differs from
# the one-process full-batch mean by reduction-order round-off, |dg| <= c u |g| with
# u = 2^-53 and c ~ 4 (8 rows summed in another order, plus the division by w). The maps
# amplify a relative input error by at most their condition number: msign and the polar
# maps by ~ sigma_max/sigma_min of the momentum (~1e2 for these random 5x8 matrices), the
# manifold directions and retractions by the same order. Twenty steps add such errors
# (the random data keep the trajectory well-conditioned, nothing compounds
# exponentially): 20 * 4 * 1e2 * u ~ 1e-12 of each weight's scale. 1e-10 leaves two
# orders for iteration counts that read batch-wide maxima (the retraction's polishing
# stop). The negative controls move weights by O(lr) = 1e-2 of their scale.
TOLERANCE = 1e-10


def test_fsdp2_matches_one_process_for_every_optimizer(distributed_runs):
    ranks = distributed_runs
    world = len(ranks)
    reference = one_process(CONFIGS)
    for name in CONFIGS:
        tower = f"towers.{_key(name)}."
        difference = _relative_difference(ranks[0]["fsdp"]["params"], reference, tower)
        assert difference < TOLERANCE, f"{name}: FSDP2 differs from one process by {difference:.3g}"
        mapped = [ranks[r]["fsdp"]["stats"][name]["matrices_mapped"] for r in range(world)]
        # no matrix mapped twice, none skipped (a row-wise map counts its fraction of rows)
        assert math.isclose(sum(mapped), STEPS * sum(MATRIX_BATCHES)), (name, mapped)
        # and each rank maps at most ceil(B / w) of every batch of B
        assert max(mapped) <= STEPS * sum(math.ceil(b / world) for b in MATRIX_BATCHES), (name, mapped)
    for r in range(1, world):
        assert _relative_difference(ranks[r]["fsdp"]["params"], ranks[0]["fsdp"]["params"]) == 0

    # the row-wise map moves no bytes; Muon's moves its momentum out and the update back
    stats = ranks[0]["fsdp"]["stats"]
    assert stats["row_norm"]["bytes_sent"] == 0 and stats["row_norm"]["collectives"] == 0
    assert stats["muon"]["collectives"] == STEPS * 2 * len(MATRIX_BATCHES)

    # negative control: the same comparison catches a dropped shard
    dropped = _relative_difference(ranks[0]["fsdp:dropped_shard"], one_process(["muon"]))
    assert dropped > 1e3 * TOLERANCE, dropped


def test_ddp_owner_gather_matches_one_process(distributed_runs):
    ranks = distributed_runs
    world = len(ranks)
    reference = one_process(DDP_CONFIGS)
    parameter_bytes = sum(v.numel() * v.element_size() for v in reference.values())
    for r in range(world):
        record = ranks[r]["ddp"]
        difference = _relative_difference(record["params"], reference)
        assert difference < TOLERANCE, f"DDP rank {r}: differs from one process by {difference:.3g}"
        assert record["collectives"] == STEPS  # one float64 bucket: one gather per step
        # one gather: at most the parameter bytes reach a rank per step
        assert record["bytes_received"] <= STEPS * parameter_bytes, record["bytes_received"]
    dropped = _relative_difference(ranks[0]["ddp:dropped_copy"], one_process(["muon"]))
    assert dropped > 1e3 * TOLERANCE, dropped


@pytest.mark.slow
def test_benchmark_reports_per_rank_work_and_bytes(tmp_path):
    """``bench/distributed_step.py --quick`` on 1 and 2 processes: the counts it publishes."""
    markdown = tmp_path / "distributed_step.md"
    result = subprocess.run([sys.executable, "bench/distributed_step.py", "--quick", "--worlds", "1,2",
                             "--markdown", str(markdown)], cwd=os.path.dirname(os.path.dirname(__file__)),
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = markdown.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| optimizer |"))
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[start:] if line.startswith("|")]
    header, _, *body = cells
    rows = {(r["optimizer"], r["processes"], r["mode"]): r for r in (dict(zip(header, c)) for c in body)}
    signs = "matrix-sign / dualizer matrices per step, busiest rank"
    sent = "bytes sent, all ranks / parameter bytes"
    # the quick set: C = 32, 2 layers of [96, 32], [32, 32], [128, 32], [32, 128] (fp32)
    shapes = [(96, 32), (32, 32), (128, 32), (32, 128)] * 2
    for name in ("muon", "manifold_muon[stiefel]", "row_norm"):
        for mode in ("fsdp", "ddp"):
            # each same-shape batch of 2 matrices: one per rank
            assert rows[(name, "2", mode)]["matrices mapped per step by busiest rank (row-wise: its rows' share)"] \
                == "4/8", (name, mode)
    assert rows[("muon", "1", "single")][signs] == "8"
    assert rows[("muon", "2", "fsdp")][signs] == rows[("muon", "2", "ddp")][signs] == "4"
    # Muon: bf16 momentum rows out and bf16 update rows back, (w-1)/w of them each way
    assert float(rows[("muon", "2", "fsdp")][sent]) == 2 * (1 / 2) * 2 / 4
    # Manifold Muon: fp32 momentum and weight rows out, weight rows back
    assert float(rows[("manifold_muon[stiefel]", "2", "fsdp")][sent]) == (1 / 2) * 3
    assert float(rows[("row_norm", "2", "fsdp")][sent]) == 0  # row-wise: mapped where the rows live
    # the Gram all-reduce model, recomputed: ring all-reduce of n + 3n^2 fp32 entries per tall
    # or square matrix, 2(w-1) times; the wide ones keep the all-to-alls
    gram = sum(2 * (n + 3 * n * n) * 4 if m >= n else (1 / 2) * m * n * 3 * 4 for m, n in shapes)
    printed = rows[("manifold_muon[stiefel]", "2", "fsdp")]["Gram all-reduce alternative: bytes sent, all ranks / "
                                                             "parameter bytes (model)"]
    assert abs(float(printed) - gram / (4 * sum(m * n for m, n in shapes))) <= 0.005


if __name__ == "__main__":
    worker(sys.argv[1])
