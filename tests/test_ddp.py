"""Two CPU processes (gloo) against one: identical ranks, and the single-process result."""

import os
import socket
import subprocess
import sys
import textwrap

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
    import sys, torch
    torch.set_num_threads(1)
    from geomuon.pretrain.train import TrainConfig, train
    cfg = TrainConfig(**eval(sys.argv[1]))
    result = train(cfg)
    torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, sys.argv[2])
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_each_other_bitwise_and_one_process(tmp_path):
    # Muon on every hidden matrix, AdamW elsewhere: the owner-sharded work is real. (Not
    # hetero: its fp32 trajectory moves a weight by 2e-2 in 20 steps when only the order of
    # the batch's sum changes, measured in one process with grad_accum=2, so no round-off
    # tolerance holds for it; its sharded step is checked in float64 by test_distributed.)
    strategy = "unconstrained"
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

    single = train(config(tmp_path / "single", strategy)).model.state_dict()
    for name, reference in single.items():
        # fp32 kernels throughout; the DDP gradient is the mean of two half-batch means, a
        # few ulps (c u, c ~ 4, u = 2^-24) from the full-batch mean; Muon's polar factor
        # amplifies a relative error by at most the momentum's condition number (~1e2 for
        # these small matrices) and 20 steps add the errors: 20 * 4 * 1e2 * u ~ 5e-4 of the
        # tensor's largest entry.
        scale = reference.abs().max().clamp_min(1e-12)
        assert ((rank0[name] - reference).abs().max() / scale) < 5e-4, name
