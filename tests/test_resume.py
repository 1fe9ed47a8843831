"""Checkpoints: a killed run resumes to the uninterrupted losses; damage is reported."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from geomuon.pretrain.train import TrainConfig, load_checkpoint, previous_checkpoint, save_checkpoint, train

STEPS = 400  # the schedule; the runs below stop long before its end


def config(out_dir, **overrides):
    base = dict(model="cpu-tiny", strategy="hetero", steps=STEPS, batch_size=4, block_size=32,
                eval_every=1000, eval_batches=1, ckpt_every=3, warmup_steps=5, dual_steps=3,
                out_dir=str(out_dir), progress=False, print_table=False)
    return TrainConfig(**{**base, **overrides})


def test_killed_run_resumes_with_identical_losses(tmp_path):
    cfg = config(tmp_path / "killed")
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    # same thread count as this process: CPU reductions are bit-reproducible only then
    script = ("import sys, torch; torch.set_num_threads(int(sys.argv[2])); from geomuon.pretrain.train import *; "
              "train(TrainConfig(**eval(sys.argv[1])))")
    proc = subprocess.Popen([sys.executable, "-c", script, repr(fields), str(torch.get_num_threads())],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ckpt = tmp_path / "killed" / "ckpt.pt"
    deadline = time.time() + 120
    while not os.path.exists(previous_checkpoint(str(ckpt))) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-run, possibly mid-write: the atomic write must cope
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    killed_at = load_checkpoint(str(ckpt))["step"]
    assert 0 < killed_at < STEPS
    stop = killed_at + 4
    resumed = train(config(tmp_path / "killed", resume=True, stop_after=stop))
    uninterrupted = train(config(tmp_path / "whole", stop_after=stop))
    remaining = range(killed_at, stop)
    assert [resumed.losses[s] for s in remaining] == [uninterrupted.losses[s] for s in remaining]
    for name, value in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_truncated_checkpoint_is_reported_and_previous_kept(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": {"w": torch.arange(1000.0)}, "step": 1})
    save_checkpoint(path, {"model": {"w": torch.arange(1000.0) * 2}, "step": 2})
    prev = previous_checkpoint(path)
    assert load_checkpoint(prev)["step"] == 1 and load_checkpoint(path)["step"] == 2
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=rf"checkpoint '{path}' is truncated or corrupt.*'{prev}' \(step 1\) loads"):
        load_checkpoint(path)
    assert load_checkpoint(prev)["step"] == 1
    with open(prev, "r+b") as f:  # both damaged: the hint must not call the previous one intact
        f.truncate(os.path.getsize(prev) // 2)
    with pytest.raises(ValueError, match=rf"'{prev}' is corrupt too .*no checkpoint of this run can be resumed"):
        load_checkpoint(path)
    os.remove(prev)
    with pytest.raises(ValueError, match="no previous checkpoint exists: start again with --overwrite"):
        load_checkpoint(path)
    train(config(tmp_path / "a", steps=8, stop_after=3))  # writes a checkpoint at step 3
    with pytest.raises(ValueError, match=r"--resume with a different run configuration \(strategy"):
        train(config(tmp_path / "a", steps=8, strategy="all_stiefel", resume=True))
