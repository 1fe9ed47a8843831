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

import datetime
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from geomuon.optimizers import HybridPolarGradM, LeftPolarGradM, ManifoldMuon, Muon, RightPolarGradM, RowNormM

STEPS = 20
#: seconds a worker's collective may wait for the other ranks (torch's gloo default is 30 min): the
#: slowest rank of the 4-process run on 2 shared cores is seconds behind, a rank that died never comes
PG_TIMEOUT = 120
#: seconds every rank together may take before the test kills them
RUN_TIMEOUT = 300
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
#: whole-matrix applies (a retraction, a regulator) whose weights are written outside the
#: optimizer after step WRITE_AFTER: rank 1's rows of WRITTEN negated (they stay on Stiefel)
WRITTEN_CONFIGS = ("manifold_muon[stiefel]", "muon+spectral_normalize")
WRITTEN = ("branches.0.weight", "up.weight")
WRITE_AFTER = 10


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


def train(model, module, opts: dict, rank: int = 0, world: int = 1, before=None, after=None, between=None) -> None:
    """``STEPS`` steps; each tower's loss is the mean squared error of its outputs (the
    towers' gradients do not mix: the sum's derivative is exact). ``between(step)`` runs
    after the optimizers' step ``step`` (1-based) and ``after``."""
    for step, (x, y) in enumerate(batches(rank, world), 1):
        out = module(x)
        torch.nn.functional.mse_loss(out, y.expand_as(out), reduction="sum").div(y.numel()).backward()
        if before:
            before()
        for opt in opts.values():
            opt.step()
        if after:
            after()
        if between:
            between(step)
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

    real_bits = distributed._bits
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}

    model = _fsdp(CONFIGS)
    opts = optimizers(model, CONFIGS)
    first = {}

    def after_first(step):
        if step == 1:
            first.update({n: vars(distributed.sharding_stats(o)).copy() for n, o in opts.items()})

    train(model, model, opts, rank, world, between=after_first)
    results["fsdp"] = {"params": full_state(model), "first_step_stats": first,
                       "stats": {n: vars(distributed.sharding_stats(o)).copy() for n, o in opts.items()}}

    # weights written outside the optimizer, behind autograd's back (``.data``, rank 1's rows
    # only): the next step must not use the owner's replica of them
    for control in (False, True):
        if control:  # negative control: the bit comparison of the written rows disabled
            distributed._bits = lambda t: torch.zeros(t.shape, dtype=torch.uint8)
        model = _fsdp(WRITTEN_CONFIGS)
        opts = optimizers(model, WRITTEN_CONFIGS)
        written = {}

        def write(step):
            if step == WRITE_AFTER:
                for name in WRITTEN_CONFIGS:
                    for key in WRITTEN:
                        p = model.get_parameter(f"towers.{_key(name)}.{key}")
                        if rank == 1:
                            p.to_local().data.mul_(-1)
                written["written"] = full_state(model)
            if step == WRITE_AFTER + 1:
                written["stepped"] = full_state(model)

        train(model, model, opts, rank, world, between=write)
        results[f"fsdp:written{':control' if control else ''}"] = {
            **written, "params": full_state(model),
            "refreshed": {n: int(distributed.sharding_stats(o).refreshed) for n, o in opts.items()}}
        distributed._bits = real_bits

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


def outputs_of(procs: list[subprocess.Popen], timeout: float = RUN_TIMEOUT) -> list[str]:
    """Each process's output once all have exited; past ``timeout`` seconds every one is killed
    and the test fails with their outputs (``communicate`` leaves them running: a rank waiting
    in a collective had outlived the test by the process group's timeout)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        raise AssertionError(f"the ranks did not finish in {timeout} s (killed):\n" + "\n".join(outputs)) from None


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
    outputs = outputs_of(procs)
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
    for name in CONFIGS:
        first, steady = expected_bytes(name, world)
        sent = [ranks[r]["fsdp"]["stats"][name]["bytes_sent"] for r in range(world)]
        sent_first = [ranks[r]["fsdp"]["first_step_stats"][name]["bytes_sent"] for r in range(world)]
        assert sum(sent_first) == first, (name, sum(sent_first), first)
        assert sum(sent) - sum(sent_first) == (STEPS - 1) * steady, (name, sum(sent) - sum(sent_first), steady)
        # the target: at most an all-to-all out and back of the updated parameters' bytes
        assert steady <= 2 * MATRIX_BYTES, (name, steady / MATRIX_BYTES)

    # negative control: the same comparison catches a dropped shard
    dropped = _relative_difference(ranks[0]["fsdp:dropped_shard"], one_process(["muon"]))
    assert dropped > 1e3 * TOLERANCE, dropped


#: float64 entries of a tower's matrices, in optimizer order, and their bytes
TOWER_SHAPES = [(HIDDEN, IN)] * 3 + [(OUT, HIDDEN), (3, OUT)]
MATRIX_BYTES = 8 * sum(m * n for m, n in TOWER_SHAPES)


def expected_bytes(name: str, world: int) -> tuple[int, int]:
    """Bytes all ranks send for a tower's matrices, first step and each later one, from the
    module's rule: the owner of the matrix at position k of the optimizer is k mod w (each
    batch starts at its first matrix's position); all but the owner's rows of each field
    travel. Elementwise apply: momentum out and update back, in the stack dtype; whole-matrix
    apply: momentum and weights out and weights back, then the momentum in the wider of the
    two dtypes (+ a flag byte per rank) out and the weights back; both: the owner's failure
    flag byte back to every other rank; row-wise maps: nothing."""
    from geomuon.optimizers.base import MatrixOptimizer
    from geomuon.optimizers.distributed import shard_rows

    opt = CONFIGS[name](Tower().double())
    group, p = opt.param_groups[0], opt.param_groups[0]["params"][0]
    stack = opt._stack_dtype(group, p).itemsize
    whole_matrix = type(opt)._apply is not MatrixOptimizer._apply or opt._group_regulator(group, 0) is not None
    if opt._rowwise_direction(group) and not whole_matrix:
        return 0, 0
    first = steady = 0
    for position, (m, n) in enumerate(TOWER_SHAPES):
        moved = (m - shard_rows(m, world)[position % world]) * n  # entries of the others' rows
        failure_flags = world - 1
        if whole_matrix:
            first += moved * (stack + 8 + 8) + failure_flags
            steady += moved * (max(stack, 8) + 8) + (world - 1) + failure_flags
        else:
            first += 2 * moved * stack + failure_flags
            steady += 2 * moved * stack + failure_flags
    return first, steady


def one_process_written(names, world: int) -> tuple[dict, dict]:
    """One process with the write of the worker's ``fsdp:written`` run (rank 1's rows of
    ``WRITTEN`` negated after step ``WRITE_AFTER``) and the step after it skipped for those
    matrices as the sharded step skips it: weights and whole-matrix state restored, the
    momentum kept. Returns the weights after the skipped step and at the end."""
    from geomuon.optimizers.distributed import shard_rows

    model = fresh_model(names)
    opts = optimizers(model, names)
    params = {(name, key): model.get_parameter(f"towers.{_key(name)}.{key}") for name in names for key in WRITTEN}
    saved, after_write = {}, {}

    def between(step):
        if step == WRITE_AFTER:
            for (name, key), p in params.items():
                rows = shard_rows(p.shape[0], world)
                p.data[rows[0]:rows[0] + rows[1]].mul_(-1)
                state = opts[name].state[p]
                saved[(name, key)] = (p.detach().clone(), {k: v.clone() for k, v in state.items()
                                                           if k != "momentum_buffer"})
        if step == WRITE_AFTER + 1:
            for (name, key), p in params.items():
                weights, state = saved[(name, key)]
                p.data.copy_(weights)
                opts[name].state[p].update(state)
            after_write.update(full_state(model))

    train(model, model, opts, between=between)
    return after_write, full_state(model)


def test_fsdp2_replica_is_refreshed_after_an_outside_write(distributed_runs):
    """The owner keeps whole weights (its replica) so only momentum travels; weights written
    behind the optimizer's back on one rank are detected, the stale replica never used."""
    ranks = distributed_runs
    world = len(ranks)
    skipped, final = one_process_written(WRITTEN_CONFIGS, world)
    run = ranks[0]["fsdp:written"]
    for name in WRITTEN_CONFIGS:
        tower = f"towers.{_key(name)}."
        for key in WRITTEN:  # the written matrices' step was skipped: the written weights, bit for bit
            assert torch.equal(run["stepped"][tower + key], run["written"][tower + key]), (name, key)
        for key in run["stepped"]:  # the rest stepped as one process does
            if key.startswith(tower):
                assert (run["stepped"][key] - skipped[key]).abs().max() < TOLERANCE, (name, key)
        difference = _relative_difference(run["params"], final, tower)
        assert difference < TOLERANCE, f"{name}: differs from one process by {difference:.3g}"
        assert sum(r["fsdp:written"]["refreshed"][name] for r in ranks) == len(WRITTEN)
    # negative control: without the comparison the owner steps its stale replica (the written
    # rows are overwritten by a step from the unwritten ones)
    control = ranks[0]["fsdp:written:control"]
    for name in WRITTEN_CONFIGS:
        tower = f"towers.{_key(name)}."
        assert sum(r["fsdp:written:control"]["refreshed"][name] for r in ranks) == 0
        for key in WRITTEN:
            moved = (control["stepped"][tower + key] - control["written"][tower + key]).abs().max()
            assert moved > 0.1, (name, key, float(moved))  # rank 1's rows flipped back: O(1)
        moved = _relative_difference(control["params"], final, tower)
        assert moved > 1e3 * TOLERANCE, (name, moved)


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
    # Manifold Muon: fp32 momentum rows out and weight rows back (the owners' replicas held;
    # one flag byte per matrix is below the printed precision), the weights too in the first step
    assert float(rows[("manifold_muon[stiefel]", "2", "fsdp")][sent]) == (1 / 2) * 2
    assert float(rows[("manifold_muon[stiefel]", "2", "fsdp")]["first step: bytes sent, all ranks / parameter "
                                                                 "bytes"]) == (1 / 2) * 3
    assert float(rows[("row_norm", "2", "fsdp")][sent]) == 0  # row-wise: mapped where the rows live
    # the Gram all-reduce model, recomputed: ring all-reduce of n + 3n^2 fp32 entries per tall
    # or square matrix, 2(w-1) times; the wide ones keep the all-to-alls
    gram = sum(2 * (n + 3 * n * n) * 4 if m >= n else (1 / 2) * m * n * 2 * 4 for m, n in shapes)
    printed = rows[("manifold_muon[stiefel]", "2", "fsdp")]["Gram all-reduce alternative: bytes sent, all ranks / "
                                                             "parameter bytes (model)"]
    assert abs(float(printed) - gram / (4 * sum(m * n for m, n in shapes))) <= 0.005


if __name__ == "__main__":
    worker(sys.argv[1])
    # Leave without the interpreter's teardown: after the group is destroyed, a gloo thread can
    # still abort a rank at exit ("terminate called without an active exception"; seen under CI
    # load even after a barrier), which is not what these tests are about. The results are
    # saved by then; an exception in worker() still exits non-zero before this line.
    sys.stdout.flush()
    os._exit(0)


_SKIP_WORKER = """
import datetime, os, sys, warnings
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from geomuon.optimizers import ManifoldMuon
from geomuon.optimizers.distributed import matrix_owner
sys.path.insert(0, sys.argv[2])
from skip_case import GRADIENTS, POINTS
warnings.simplefilter("ignore")
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in POINTS]
opt = ManifoldMuon(params, lr=0.05, manifold="stiefel", compute_dtype=None)
owners = []
for gradients in GRADIENTS:
    for p, g in zip(params, gradients):
        p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
    opt.step()
    owners.append([matrix_owner(opt, p) for p in params])
weights = [p.detach().full_tensor() for p in params]
if dist.get_rank() == 0:
    torch.save({"weights": weights, "owners": owners}, sys.argv[1])
dist.barrier()  # every rank past its last collective before any tears the group down (gloo aborts a peer)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: see the note at the end of this file's own worker
"""

_SKIP_CASE = """
import torch
from geomuon.manifolds import Stiefel
gen = torch.Generator().manual_seed(1)
POINTS = [Stiefel().projx(torch.randn(8, 4, generator=gen, dtype=torch.float64)) for _ in range(3)]
GRADIENTS = [[torch.randn(8, 4, generator=gen, dtype=torch.float64) for _ in range(3)] for _ in range(4)]
GRADIENTS[1][1][0, 0] = float("inf")  # step 2: the middle matrix of the batch is skipped
"""


def test_a_skipped_matrix_leaves_its_batch_mates_on_their_owners(tmp_path):
    # A matrix dropped for a non-finite gradient had shifted the owners of the matrices after
    # it (owners [0, 1, 0] -> [0, 1, 1]), stranding their warm starts and step counts on the
    # old owner: matrix 2 ended 2.8e-3 from the one-process weights. Owners now follow the
    # whole batch. Float64 and the same whole gradients on both sides: bitwise.
    (tmp_path / "skip_case.py").write_text(_SKIP_CASE)
    (tmp_path / "worker.py").write_text(_SKIP_WORKER.replace("PG_TIMEOUT", str(PG_TIMEOUT)))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    out = str(tmp_path / "sharded.pt")
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), out, str(tmp_path)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = outputs_of(procs)
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    sharded = torch.load(out)
    assert all(owners == sharded["owners"][0] for owners in sharded["owners"]), sharded["owners"]
    sys.path.insert(0, str(tmp_path))
    try:
        from skip_case import GRADIENTS, POINTS
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("skip_case", None)
    params = [torch.nn.Parameter(w.clone()) for w in POINTS]
    opt = ManifoldMuon(params, lr=0.05, manifold="stiefel", compute_dtype=None)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        for gradients in GRADIENTS:
            for p, g in zip(params, gradients):
                p.grad = g.clone()
            opt.step()
    for p, w in zip(params, sharded["weights"]):
        assert torch.equal(p.detach(), w)


def test_ranks_that_do_not_finish_are_killed_and_reported():
    # communicate(timeout=...) had raised and left the ranks running: one waiting in a collective
    # outlived the test by the process group's timeout (30 min by default) on CI's 2 cores
    procs = [subprocess.Popen([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    with pytest.raises(AssertionError, match="did not finish in 1 s") as failed:
        outputs_of(procs, timeout=1)
    assert all(p.poll() is not None for p in procs)  # killed, not left sleeping
    assert "started" in str(failed.value)
