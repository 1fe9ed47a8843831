"""Two CPU processes (gloo) against one: identical ranks, and the single-process result."""

import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import replace

import torch

from geomuon.pretrain.train import TrainConfig, train

STEPS = 20


def config(out_dir, strategy, parallel="none"):
    # fp32 directions: the tolerance below is the fp32 one
    return TrainConfig(model="cpu-tiny", strategy=strategy, parallel=parallel, steps=STEPS, batch_size=4,
                       block_size=32,
                       eval_every=STEPS, eval_batches=1, warmup_steps=2, direction_dtype="fp32",
                       out_dir=str(out_dir), progress=False, print_table=False)


WORKER = textwrap.dedent("""
    import os, sys, torch
    torch.set_num_threads(1)
    from geomuon.pretrain.train import TrainConfig, train
    cfg = TrainConfig(**eval(sys.argv[1]))
    result = train(cfg)
    torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown, where a destroyed gloo group's thread can abort a rank
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_each_other_bitwise_and_one_process(tmp_path):
    # hetero: Manifold Muon (Gram path, whole-matrix retraction), Muon and AdamW, so the
    # owner-sharded work is real for every kind of update.
    strategy = "hetero"
    cfg = config(tmp_path / "ddp", strategy, parallel="ddp")
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, repr(fields), str(tmp_path / f"rank{r}.pt")],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs across ranks"

    # fp32 kernels throughout; the DDP gradient is the mean of two half-batch means, a few
    # ulps (c u, c ~ 4, u = 2^-24) from the full-batch mean. The maps amplify a relative
    # error of their input by at most: Muon's polar factor, the momentum's condition number
    # (~1e2 for these small matrices); Manifold Muon's Gram-path dualizer
    # Z (Z^T Z + delta)^(-1/2), its slope delta^(-1/2) times the input scale sigma_max, with
    # the shift delta = sqrt(n) eps t >= sqrt(n) eps sigma_max^2 (t >= tr Z^T Z), so at
    # most (sqrt(n) eps)^(-1/2) = 1.2e3 for n = 32 (the short side of every matrix here) and
    # eps = 2^-23. Twenty steps add the errors (the retraction keeps the points bounded):
    # 20 * 4 * 1.2e3 * u ~ 6e-3 of the tensor's largest entry. (Measured: 6.2e-4.)
    tolerance = 6e-3
    single = train(config(tmp_path / "single", strategy)).model.state_dict()
    for name, reference in single.items():
        assert relative(rank0[name], reference) < tolerance, name
    # negative control: the same comparison tells a run with another seed apart
    other = train(replace(config(tmp_path / "other", strategy), seed=1)).model.state_dict()
    assert max(relative(other[name], reference) for name, reference in single.items()) > 10 * tolerance


def relative(a: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference relative to the reference tensor's largest entry."""
    return float((a - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
