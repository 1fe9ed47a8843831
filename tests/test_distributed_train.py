"""``pretrain --parallel fsdp`` on two gloo processes: one process's weights, a bit-identical resume,
and a checkpoint written by two processes resumed on one."""

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from geomuon.pretrain.train import TrainConfig, load_checkpoint, train

STEPS, HALF = 12, 6
STRATEGY = "unconstrained"  # Muon on every hidden matrix: the sharded matrix step is real


def config(out_dir, **options):
    # fp32 directions: the tolerance below is the fp32 one
    return TrainConfig(**{**dict(model="cpu-tiny", strategy=STRATEGY, steps=STEPS, batch_size=4, block_size=32,
                                 eval_every=HALF, eval_batches=1, warmup_steps=2, direction_dtype="fp32",
                                 out_dir=str(out_dir), progress=False, print_table=False), **options})


WORKER = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from geomuon.pretrain.train import TrainConfig, train
    train(TrainConfig(**eval(sys.argv[1])))
""")


def weights(out_dir) -> dict:
    """The model of the run's last checkpoint (whole tensors: FSDP gathers them to save)."""
    return load_checkpoint(os.path.join(out_dir, "ckpt.pt"))["model"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(cfg) -> dict:
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, repr(fields)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return weights(cfg.out_dir)


def relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


# fp32 kernels throughout; the two-process gradient is the mean of two half-batch means,
# a few ulps (c u, c ~ 4, u = 2^-24) from the full-batch mean, carried through 12 Muon
# steps whose polar factors amplify a relative error by at most the momentum's condition
# number (~1e2 for these small matrices); AdamW's 1/sqrt(v) is smooth away from v = 0.
# Errors add over the steps: 12 * 4 * 1e2 * u ~ 3e-4 of each tensor's largest entry.
# (Measured: 9e-6.) The resume is compared bit for bit.
TOLERANCE = 3e-4


def test_fsdp_pretrain_matches_one_process(tmp_path):
    train(config(tmp_path / "single"))
    fsdp = two_processes(config(tmp_path / "fsdp", parallel="fsdp"))
    assert relative_difference(fsdp, weights(tmp_path / "single")) < TOLERANCE
    # negative control: the same comparison tells a run with another seed apart
    train(config(tmp_path / "other", seed=1))
    assert relative_difference(weights(tmp_path / "other"), weights(tmp_path / "single")) > 100 * TOLERANCE


@pytest.mark.slow
def test_fsdp_resume_is_bitwise_and_loads_on_one_process(tmp_path):
    uninterrupted = two_processes(config(tmp_path / "fsdp", parallel="fsdp"))
    # stop halfway, keep a copy of that checkpoint, resume on two processes
    two_processes(config(tmp_path / "split", parallel="fsdp", stop_after=HALF))
    shutil.copytree(tmp_path / "split", tmp_path / "split_on_one")
    resumed = two_processes(config(tmp_path / "split", parallel="fsdp", resume=True))
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), f"{name}: resume is not bit-identical"
    # the two-process checkpoint resumed on one process, against one process throughout
    train(config(tmp_path / "split_on_one", resume=True))
    train(config(tmp_path / "single"))
    assert relative_difference(weights(tmp_path / "split_on_one"), weights(tmp_path / "single")) < TOLERANCE
