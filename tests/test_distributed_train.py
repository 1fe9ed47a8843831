"""``pretrain --parallel {fsdp,ddp}`` under torchrun-like gloo processes: one process's weights, and
distributed checkpoints (``torch.distributed.checkpoint``) that resume bit for bit on the same world
size and load on another (1 and 4 processes).

The default suite runs the 2-process runs, the loads on 1 and 4 processes and the checks of
damaged folders; training on after a load on 4 processes is ``slow`` (``pytest -m slow
tests/test_distributed_train.py``).
"""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest
import torch

from geomuon.pretrain.data import load_data
from geomuon.pretrain.parallel import (DamagedCheckpoint, dcp_folders, load_checked, load_distributed,
                                      read_distributed, read_record)
from geomuon.pretrain.train import (TrainConfig, build, checkpoint_to_resume, load_checkpoint, resolve_out_dir,
                                    save_checkpoint, train)

STEPS, HALF = 12, 6  # checkpoints every HALF steps: a run's folder keeps the HALF and the STEPS one


def config(out_dir, **options):
    """A tiny run; ``hetero``: Manifold Muon (Gram path; warm starts and step counts are
    whole-matrix state, held by the rank that maps the matrix), Muon and AdamW."""
    # fp32 directions (the tolerance below is the fp32 one) where there are matrix updates
    # other than AdamW (an adamw run refuses the option it would ignore)
    strategy = options.get("strategy", "hetero")
    direction_dtype = "default" if TrainConfig(direction_dtype="fp32").unused_options([strategy]) else "fp32"
    return TrainConfig(**{**dict(model="cpu-tiny", strategy=strategy, steps=STEPS, batch_size=4, block_size=32,
                                 eval_every=HALF, eval_batches=1, warmup_steps=2, direction_dtype=direction_dtype,
                                 out_dir=str(out_dir), progress=False, print_table=False), **options})


def test_the_default_run_keeps_its_fp32_directions(tmp_path):
    # the tolerances below are fp32's: hetero's runs must not lose direction_dtype to unused_options
    assert config(tmp_path).direction_dtype == "fp32"


# Each rank: the run, then (when a path is given) the tensors of the model it holds at the
# end — its row shards (FSDP2) or the whole tensors (DDP); the process group is gone by then.
# Every worker leaves by os._exit once its result is out: at interpreter exit a gloo thread of a
# destroyed group can still abort a rank ("terminate called without an active exception"; rare,
# seen after train() returned on both ranks; open, see the issue notes), which is not what these
# tests are about; an exception inside train() still exits non-zero before that line.
WORKER = textwrap.dedent("""
    import os, sys, torch
    torch.set_num_threads(1)
    from geomuon.optimizers.distributed import is_sharded
    from geomuon.pretrain.train import TrainConfig, train
    result = train(TrainConfig(**eval(sys.argv[1])))
    if len(sys.argv) > 2:
        held = {k: (v.to_local() if is_sharded(v) else v, is_sharded(v)) for k, v in result.model.state_dict().items()}
        torch.save(held, f"{sys.argv[2]}.{os.environ['RANK']}")
    os._exit(0)
""")


def _assembled(dump, world: int) -> dict:
    """The whole tensors of the ranks' dumps: ``Shard(0)`` rows concatenated in rank order."""
    ranks = [torch.load(f"{dump}.{r}") for r in range(world)]
    return {k: torch.cat([held[k][0] for held in ranks]) if sharded else value
            for k, (value, sharded) in ranks[0].items()}


def weights(out_dir) -> dict:
    """The model of the run's newest checkpoint (the one a resume would start from)."""
    newest = checkpoint_to_resume(str(out_dir))
    return read_distributed(newest) if os.path.isdir(newest) else load_checkpoint(newest)["model"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, script: str, cfg, *args: str) -> list[subprocess.Popen]:
    """``script`` (given ``repr`` of ``cfg``'s fields and ``args``) as ``world`` torchrun-like gloo ranks."""
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, "-c", script, repr(fields), *args],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for r in range(world)]


def ended(procs: list[subprocess.Popen], timeout: float = 60) -> list[str]:
    """The outputs of ``procs``, which must all exit on their own within ``timeout`` seconds (else
    ``subprocess.TimeoutExpired``, and a rank left waiting in a collective is killed)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()


def finished(procs: list[subprocess.Popen], timeout: float = 60) -> list[str]:
    """The outputs of ``procs``, which must all exit 0 within ``timeout`` seconds (:func:`ended`)."""
    outputs = ended(procs, timeout)
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return outputs


def processes(world: int, cfg, dump=None) -> dict | None:
    """Run ``cfg`` on ``world`` gloo processes; the final whole weights when ``dump`` (a path)."""
    procs = spawn(world, WORKER, cfg, *([str(dump)] if dump else []))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return _assembled(dump, world) if dump else None


INTERRUPTIBLE = textwrap.dedent("""
    import os, sys, torch
    torch.set_num_threads(1)
    from geomuon.pretrain.train import TrainConfig, TrainingInterrupted, train
    try:
        train(TrainConfig(**eval(sys.argv[1])))
    except TrainingInterrupted as stop:
        print(f"interrupted at step {stop.step}", flush=True)
    os._exit(0)
""")


def test_a_signal_to_one_ddp_rank_stops_every_rank_at_the_same_step(tmp_path):
    # the ranks agree on stopping by an all-reduce read back to the host, once every log_every
    # steps (not every step: on a GPU each read waits for the device); a SIGTERM to rank 1 alone
    # stops both ranks at one such step, checkpointed there with the losses of every step before
    cfg = config(tmp_path / "run", parallel="ddp", strategy="adamw", steps=5000, eval_every=5000, log_every=4)
    procs = spawn(2, INTERRUPTIBLE, cfg)
    log, deadline = tmp_path / "run" / "log.jsonl", time.time() + 120
    while time.time() < deadline and not (log.exists() and '"step": 8,' in log.read_text()):
        time.sleep(0.01)
    assert all(p.poll() is None for p in procs), "the run ended before it could be interrupted"
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    steps = [int(re.search(r"interrupted at step (\d+)", out).group(1)) for out in outputs]
    stop = steps[0]
    # right after a step whose losses came to the host: step - 1 a multiple of log_every
    assert steps[1] == stop and (stop - 1) % 4 == 0 and 8 < stop < 5000, outputs
    folder = dict((step, path) for step, path in dcp_folders(str(tmp_path / "run")))[stop]
    assert sorted(read_record(folder)["losses"]) == list(range(stop))  # every step's loss, none pending


NAN_AT_SIX = textwrap.dedent("""
    import math, os, sys, torch
    torch.set_num_threads(1)
    from geomuon.pretrain import train as training
    plain = training.evaluate

    def evaluate(model, evaluation, autocast):  # rank 0 evaluates; at step 6 it sees a non-finite loss
        metrics = plain(model, evaluation, autocast)
        return {**metrics, "val_loss": math.nan} if evaluation.step == 6 else metrics

    training.evaluate = evaluate
    result = training.train(training.TrainConfig(**eval(sys.argv[1])))
    print(f"diverged {result.diverged} after step {result.last_step}", flush=True)
    os._exit(0)
""")


def test_a_divergence_found_at_an_evaluation_stops_every_rank(tmp_path):
    # only rank 0 evaluates: the ranks agree on its verdict, so none goes on alone into the next
    # step's collectives (the run would hang) or skips the checkpoint its peers write
    outputs = finished(spawn(2, NAN_AT_SIX, config(tmp_path / "run", parallel="ddp", strategy="adamw")))
    assert all("diverged True after step 6" in out for out in outputs), outputs


DISK_FULL_AT_THE_SECOND_CHECKPOINT = textwrap.dedent("""
    import errno, os, sys, torch
    torch.set_num_threads(1)
    from torch.distributed.checkpoint import FileSystemWriter
    from geomuon.pretrain.train import RunWriteError, TrainConfig, train
    failing_rank, part = sys.argv[2:]
    write_tensors, write_record, saves = FileSystemWriter.write_data, torch.save, []

    def disk_full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def tensors(writer, plan, planner):  # DCP writing this rank's share of the tensors
        saves.append(plan)
        if part == "tensors" and os.environ["RANK"] == failing_rank and len(saves) == 2:
            disk_full()
        return write_tensors(writer, plan, planner)

    def record(payload, file, *args, **kwargs):  # rank 0 alone writes the plain data, after the tensors
        if part == "record" and len(saves) == 2 and getattr(file, "name", "").endswith("run.pt"):
            disk_full()
        return write_record(payload, file, *args, **kwargs)

    FileSystemWriter.write_data, torch.save = tensors, record
    try:
        train(TrainConfig(**eval(sys.argv[1])))
    except RunWriteError as err:
        print(f"RunWriteError: {err.strerror}", flush=True)
        stopped = err  # kept to os._exit: freeing it frees the run's DDP module and with it the gloo
        # group, whose destructor can deadlock on the GIL with its own thread (seen 1 in ~10)
    os._exit(0)
""")


@pytest.mark.parametrize("failing_rank, part", [("1", "tensors"), ("0", "record")])
def test_a_full_disk_on_one_rank_stops_every_rank_with_the_previous_checkpoint_intact(tmp_path, failing_rank, part):
    # a write that failed under torchrun had surfaced as DCP's CheckpointException (a traceback
    # naming no folder or what to do) and left dcp-step<N>.tmp taking the space; rank 0's failure
    # to write the plain data left the other ranks waiting in a barrier
    cfg = config(tmp_path / "run", parallel="ddp", strategy="adamw", steps=4, eval_every=2)
    outputs = finished(spawn(2, DISK_FULL_AT_THE_SECOND_CHECKPOINT, cfg, failing_rank, part))
    folder, previous = (os.path.join(cfg.out_dir, f"dcp-step0000000{step}") for step in (4, 2))
    expected = (f"RunWriteError: checkpoint {folder!r} could not be written (No space left on device on rank "
                f"{failing_rank}); {previous!r} still holds the previous checkpoint: make room and continue with "
                "--resume")
    assert all(expected in out for out in outputs), outputs
    assert dcp_folders(cfg.out_dir) == [(2, previous)] and not os.path.exists(folder + ".tmp")
    assert read_record(previous)["step"] == 2 and read_distributed(previous)  # intact


def test_a_ddp_run_warns_of_no_deprecated_collective(tmp_path):
    # every rank of every DDP run had printed torch's FutureWarning "all_gather_into_tensor is
    # deprecated" (the owners' hand-out, OwnerGather; a torch without all_gather_single does not
    # deprecate it); control: the run trained
    outputs = finished(spawn(2, WORKER, config(tmp_path / "run", parallel="ddp", steps=2, warmup_steps=0,
                                               eval_every=2)))
    assert not any("deprecated" in out for out in outputs), outputs
    assert dcp_folders(str(tmp_path / "run"))  # its checkpoint


def relative_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


def identical(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# fp32 kernels throughout; a run on w processes takes the mean of w per-rank batch means, a
# few ulps (c u, c ~ 4, u = 2^-24) from the full-batch mean, carried through 12 steps whose
# maps amplify a relative error by at most: Muon's polar factor, the momentum's condition
# number (~1e2 for these small matrices); Manifold Muon's Gram-path dualizer
# Z (Z^T Z + delta)^(-1/2), its slope delta^(-1/2) times the input scale sigma_max with
# delta = sqrt(n) eps t >= sqrt(n) eps sigma_max^2, so (sqrt(n) eps)^(-1/2) = 1.2e3 for
# n = 32 and eps = 2^-23; AdamW's 1/sqrt(v) is smooth away from v = 0. Errors add over the
# steps: 12 * 4 * 1.2e3 * u ~ 3.5e-3 of each tensor's largest entry. Resumes and loads are
# compared bit for bit.
TOLERANCE = 3.5e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process throughout; FSDP2 on 2 processes throughout. Each folder keeps its
    checkpoints of steps HALF and STEPS."""
    root = tmp_path_factory.mktemp("runs")
    train(config(root / "single"))
    processes(2, config(root / "fsdp", parallel="fsdp"))
    return root


def halfway(run, copy):
    """A copy of the run folder ``run`` as it was after HALF steps (its last checkpoint removed)."""
    shutil.copytree(run, copy)
    (half, _), (_, last) = dcp_folders(str(copy))
    assert half == HALF
    shutil.rmtree(last)
    return copy


def last(run) -> str:
    return dcp_folders(str(run))[-1][1]


def test_fsdp_pretrain_matches_one_process(runs, tmp_path):
    assert relative_difference(weights(runs / "fsdp"), weights(runs / "single")) < TOLERANCE
    # negative control: the same comparison tells a run with another seed apart
    train(config(tmp_path / "other", seed=1))
    assert relative_difference(weights(tmp_path / "other"), weights(runs / "single")) > 10 * TOLERANCE


def test_fsdp_checkpoint_is_sharded_and_resumes_bitwise(runs, tmp_path):
    folder = last(runs / "fsdp")
    assert sorted(f for f in os.listdir(folder) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert any(k.endswith("/dual_correction") for k in read_distributed(folder, "optimizer/"))
    split = halfway(runs / "fsdp", tmp_path / "split")
    processes(2, config(split, parallel="fsdp", resume=True))
    assert [s for s, _ in dcp_folders(str(split))] == [HALF, STEPS]
    # model and optimizer state (momentum shards, warm starts, step counts), bit for bit
    assert identical(read_distributed(last(split), ""), read_distributed(folder, ""))
    with open(split / "log.jsonl") as a, open(runs / "fsdp" / "log.jsonl") as b:
        assert [_untimed(x) for x in a] == [_untimed(x) for x in b]
    # negative control: the comparison sees one step of difference
    assert not identical(read_distributed(last(split), ""), read_distributed(dcp_folders(str(split))[0][1], ""))


def _untimed(line: str) -> dict:
    return {k: v for k, v in json.loads(line).items() if k != "time"}


def test_two_process_checkpoint_loads_and_trains_on_one_process(runs, tmp_path):
    split = halfway(runs / "fsdp", tmp_path / "on_one")
    saved = read_distributed(last(split))
    loaded = train(config(split, resume=True, stop_after=HALF))  # no step: the load alone
    assert identical(dict(loaded.model.state_dict()), saved)
    assert train(config(split, resume=True)).last_step == STEPS
    assert os.path.isfile(split / "ckpt.pt")  # one process writes the single-file format
    assert relative_difference(weights(split), weights(runs / "single")) < TOLERANCE


def test_two_process_checkpoint_loads_on_four_processes(runs, tmp_path):
    split = halfway(runs / "fsdp", tmp_path / "on_four")
    saved = read_distributed(last(split))
    for parallel in ("fsdp", "ddp"):  # no step: the load alone
        loaded = processes(4, config(split, parallel=parallel, resume=True, stop_after=HALF), tmp_path / "w.pt")
        assert identical(loaded, saved), parallel


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_process_checkpoint_trains_on_four_processes(runs, tmp_path, parallel):
    split = halfway(runs / "fsdp", tmp_path / "on_four")
    processes(4, config(split, parallel=parallel, resume=True))
    assert relative_difference(weights(split), weights(runs / "single")) < TOLERANCE


def test_ddp_checkpoint_resumes_bitwise(tmp_path):
    processes(2, config(tmp_path / "ddp", parallel="ddp"))
    split = halfway(tmp_path / "ddp", tmp_path / "split")
    processes(2, config(split, parallel="ddp", resume=True))
    # each rank saved the optimizer state of the parameters it owns: all of it, once
    assert identical(read_distributed(last(split), ""), read_distributed(last(tmp_path / "ddp"), ""))


def test_damaged_or_foreign_checkpoint_folder_is_named(runs, tmp_path):
    split = halfway(runs / "fsdp", tmp_path / "damaged")
    folder = last(split)
    other = config(split, n_layer=1)
    model, assignment = build(other, load_data(other.data), torch.device("cpu"))
    with pytest.raises(ValueError, match=f"{folder}.*for another model or strategy"):
        load_distributed(folder, model, assignment)
    os.remove(os.path.join(folder, "__1_0.distcp"))
    # with what to do (it had stopped at "damaged or missing")
    with pytest.raises(ValueError, match=f"{folder}.* has no __1_0.distcp; "
                                         "(no previous checkpoint exists|the previous checkpoint .* is complete)"):
        train(config(split, resume=True))
    os.remove(os.path.join(folder, ".metadata"))
    with pytest.raises(ValueError, match=f"{folder}.*has no .metadata.*no previous checkpoint"):
        train(config(split, resume=True))


def _flip_byte(path, offset: int | None = None) -> None:
    """Flip a byte of the file at ``path``: at ``offset``, by default its middle one."""
    offset = os.path.getsize(path) // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x42]))


def test_a_damaged_byte_in_a_tensor_file_is_refused_and_the_previous_checkpoint_offered(runs, tmp_path, capsys):
    # DCP reads raw tensor bytes unchecked: a flipped byte in a shard had loaded as a weight (a
    # resume trained on from it, val_loss 15 for 4), and the retention rule then removed the good
    # checkpoint before it; now every file's size and CRC-32 are in the record and checked first
    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp", run)
    folder, shard = last(run), os.path.join(last(run), "__1_0.distcp")
    intact = read_distributed(folder, "")
    _flip_byte(shard)
    with pytest.raises(DamagedCheckpoint, match=f"{folder}.* __1_0.distcp that fails its CRC-32 check"):
        read_distributed(folder)
    offered = (f"{folder}.* __1_0.distcp that fails its CRC-32 check.*; the previous checkpoint "
               f".*dcp-step0000000{HALF}' \\(step {HALF}\\) is complete: remove")
    with open(run / "log.jsonl", "a") as f:  # logged after the last checkpoint, by a run killed then
        f.write('{"kind": "train", "step": 12, "loss": 4.0}\n')
    log = (run / "log.jsonl").read_text()
    with pytest.raises(ValueError, match=offered):  # one process resuming the folder
        train(config(run, resume=True))
    assert "resumed from" not in capsys.readouterr().out  # (it had been said before the refusal)
    assert (run / "log.jsonl").read_text() == log  # not rewritten from the refused checkpoint
    procs = spawn(2, WORKER, config(run, parallel="fsdp", resume=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode != 0 and re.search(offered, out) for p, out in zip(procs, outputs)), outputs
    assert [s for s, _ in dcp_folders(str(run))] == [HALF, STEPS]  # nothing trained, nothing removed
    # negative control: the byte put back, the same checks pass and read the checkpoint written
    _flip_byte(shard)
    assert identical(read_distributed(folder, ""), intact)


def _resume_with(patch: str, after: str = "") -> str:
    """The script of each rank: ``patch`` (code run first, with ``parallel``, ``os`` and ``sys``
    imported), a resume of the run (``TrainConfig(**argv[1])``), how the resume ended ("resumed",
    or "refused: <message>"), then ``after``."""
    return textwrap.dedent("""
        import os, sys, torch
        torch.set_num_threads(1)
        from geomuon.pretrain import parallel
        from geomuon.pretrain.train import TrainConfig, train
    """) + textwrap.dedent(patch) + textwrap.dedent("""
        try:
            train(TrainConfig(**eval(sys.argv[1])))
            print("resumed", flush=True)
        except ValueError as err:
            print(f"refused: {err}", flush=True)
    """) + textwrap.dedent(after) + "os._exit(0)\n"


# Each rank: a resume of the run, then the files of the folder argv[2] that it summed (file_sum: the
# sizes and CRC-32s a load checks) and how the resume ended.
SUMMED = _resume_with("""
    folder, summed, plain = sys.argv[2], [], parallel.file_sum

    def file_sum(path):
        if os.path.dirname(path) == folder:  # (not the folder a resume writes, nor the previous one)
            summed.append(os.path.basename(path))
        return plain(path)

    parallel.file_sum = file_sum
""", after="""
    print(f"summed {sorted(summed)!r}", flush=True)
""")


def _summed(output: str) -> list[str]:
    return ast.literal_eval(re.search(r"summed (\[.*\])", output).group(1))


def _fsdp_resume(runs, tmp_path):
    """A copy of the finished FSDP run, and the settings of its resume under FSDP that loads the
    last checkpoint and trains nothing (the load alone): ``(run, cfg)``."""
    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp", run)
    return run, config(run, parallel="fsdp", resume=True, stop_after=STEPS)


def test_each_rank_checks_its_share_of_a_checkpoint_and_every_rank_refuses_a_damaged_one(runs, tmp_path):
    # every rank had summed every file of the checkpoint at a resume (world size times its bytes
    # read); as at the save, each rank now checks a share, and the ranks agree on the verdict
    run, cfg = _fsdp_resume(runs, tmp_path)
    folder = last(run)
    listed = sorted(read_record(folder)["files"])
    outputs = finished(spawn(2, SUMMED, cfg, folder))
    shares = [_summed(out) for out in outputs]
    assert all("resumed" in out for out in outputs), outputs
    # every listed file read once, by one rank
    assert sorted(shares[0] + shares[1]) == listed and all(shares), shares
    # a file rank 1 alone checks, damaged: rank 0, which does not read it, refuses it by name too
    (theirs,) = set(shares[1]) - {".metadata"}
    _flip_byte(os.path.join(folder, theirs))
    outputs = finished(spawn(2, SUMMED, cfg, folder))
    offered = (f"refused: distributed checkpoint '{folder}' has a {theirs} that fails its CRC-32 check .*; the "
               f"previous checkpoint .*dcp-step0000000{HALF}' \\(step {HALF}\\) is complete")
    assert all(re.search(offered, out) for out in outputs), outputs
    assert [_summed(out) for out in outputs] == shares, outputs
    assert [s for s, _ in dcp_folders(str(run))] == [HALF, STEPS]  # nothing trained, nothing removed


def _agreed_refusal(outputs: list[str]) -> str:
    """The refusal every rank printed ("refused: ..."), asserted the same on every rank."""
    refusals = [re.search(r"refused: .*", out).group(0) for out in outputs]
    assert len(set(refusals)) == 1, refusals
    return refusals[0]


def test_the_previous_checkpoint_a_refusal_offers_is_checked_in_shares_and_every_rank_refuses_alike(runs, tmp_path):
    # to offer the previous checkpoint, every rank had summed every file of it (world size times its
    # bytes read); as at a load, each rank now checks a share there, and the ranks agree on the verdict
    run, cfg = _fsdp_resume(runs, tmp_path)
    (_, previous), (_, folder) = dcp_folders(str(run))
    listed = sorted(read_record(previous)["files"])
    shard = os.path.join(folder, "__0_0.distcp")
    _flip_byte(shard)  # refused by the load of the newest folder
    outputs = finished(spawn(2, SUMMED, cfg, previous))
    refused, shares = _agreed_refusal(outputs), [_summed(out) for out in outputs]
    assert re.search(f"{re.escape(folder)}' has a __0_0.distcp that fails its CRC-32 check .*; the previous "
                     f"checkpoint {re.escape(repr(previous))} \\(step {HALF}\\) is complete", refused), refused
    # every listed file of the previous folder read once, by one rank
    assert sorted(shares[0] + shares[1]) == listed and all(shares), shares
    # the newest record gone (refused as it is read, before the load) and the previous folder damaged in
    # a file rank 1 alone checks: rank 0, which does not read it, says it is damaged too
    os.remove(os.path.join(folder, "run.pt"))
    (theirs,) = set(shares[1]) - {".metadata"}
    _flip_byte(os.path.join(previous, theirs))
    outputs = finished(spawn(2, SUMMED, cfg, previous))
    refused = _agreed_refusal(outputs)
    assert re.search(f"{re.escape(folder)}' has no run.pt; the previous checkpoint {re.escape(repr(previous))} is "
                     "damaged too", refused), refused
    assert [_summed(out) for out in outputs] == shares, outputs
    assert [s for s, _ in dcp_folders(str(run))] == [HALF, STEPS]  # nothing trained, nothing removed


# Each rank: a resume of the run in which rank 1 alone cannot read the record (run.pt) of the folder
# argv[2], or its .metadata when argv[3] says so (an I/O error on its machine), then how the resume ended.
UNREADABLE_ON_RANK_1 = _resume_with("""
    from torch.distributed.checkpoint import FileSystemReader
    folder, what = sys.argv[2], sys.argv[3]
    unreadable, plain, plain_metadata = os.path.join(folder, "run.pt"), parallel.load_checked, \
        FileSystemReader.read_metadata

    def failing_on_rank_1():
        if os.environ["RANK"] == "1":
            raise OSError(5, "Input/output error")

    def load_checked(path):
        if path == unreadable and what == "run.pt":
            failing_on_rank_1()
        return plain(path)

    def read_metadata(reader):
        if os.fspath(reader.path) == folder and what == ".metadata":
            failing_on_rank_1()
        return plain_metadata(reader)

    parallel.load_checked, FileSystemReader.read_metadata = load_checked, read_metadata
""")


@pytest.mark.parametrize("unreadable", ["newest", "previous", "newest .metadata"])
def test_a_record_only_one_rank_cannot_read_is_refused_alike_by_every_rank(runs, tmp_path, unreadable):
    # the rank whose read of run.pt failed raised (newest: it went on to check the previous folder)
    # while the other went on into its next collective: newest, both waited until killed; previous,
    # rank 0 died of gloo's "Connection reset by peer"; the load's read of .metadata likewise left the
    # other rank in DCP's collectives. Both reads are now part of the agreed verdict.
    run, cfg = _fsdp_resume(runs, tmp_path)
    (_, previous), (_, folder) = dcp_folders(str(run))
    offered = f"the previous checkpoint {re.escape(repr(previous))} \\(step {HALF}\\) is complete"
    what = ".metadata" if unreadable.endswith(".metadata") else "run.pt"
    if unreadable == "newest":
        failing, refused = folder, f"has an unreadable run.pt \\(\\[Errno 5\\] Input/output error\\); {offered}"
    elif unreadable == "previous":  # the newest refused on every rank; rank 1 cannot read the previous one's record
        os.remove(os.path.join(folder, "run.pt"))
        failing = previous
        refused = f"has no run.pt; the previous checkpoint {re.escape(repr(previous))} is damaged too"
    else:
        failing, refused = folder, f"has an unreadable .metadata \\(\\[Errno 5\\] Input/output error\\); {offered}"
    # a rank left waiting is killed at the timeout, and the test fails
    agreed = _agreed_refusal(finished(spawn(2, UNREADABLE_ON_RANK_1, cfg, failing, what)))
    assert re.search(f"refused: distributed checkpoint {re.escape(repr(folder))} {refused}", agreed), agreed
    # negative control: no rank failing to read, the newest folder loads (newest) or the previous is offered
    outputs = finished(spawn(2, UNREADABLE_ON_RANK_1, cfg, str(tmp_path / "none"), what))
    assert all(("resumed" in out) if unreadable != "previous" else re.search(offered, out) for out in outputs), outputs


# Each rank: a resume of the run in which rank 1 alone cannot read the single-file checkpoint argv[2]
# (an I/O error on its machine: neither its step nor the whole file), how the resume ended, then how
# many times this rank read the previous checkpoint (ckpt.prev.pt).
CKPT_UNREADABLE_ON_RANK_1 = _resume_with("""
    unreadable, plain, previous = sys.argv[2], torch.load, []

    def load(f, *args, **kwargs):
        if f == unreadable and os.environ["RANK"] == "1":
            raise OSError(5, "Input/output error")
        if str(f).endswith("ckpt.prev.pt"):
            previous.append(f)
        return plain(f, *args, **kwargs)

    torch.load = load
""", after="""
    print(f"previous read {len(previous)} times", flush=True)
""")


@pytest.mark.parametrize("folder_touched", [False, True])
def test_a_ckpt_pt_only_one_rank_cannot_read_is_refused_alike_by_every_rank(runs, tmp_path, folder_touched):
    # every rank chose the checkpoint and read it on its own. Rank 1, unable to read ckpt.pt's step,
    # compared it by time: with the older folder touched after it, it chose that folder and waited in
    # the record's collective while rank 0 loaded ckpt.pt (step 12), until killed; with the folder
    # untouched, it raised the refusal alone and rank 0 died of gloo's "Connection closed by peer".
    # Rank 0 now chooses for every rank, the ranks agree on the verdict, and rank 0 alone reads the
    # previous checkpoint the refusal offers.
    run = halfway(runs / "fsdp", tmp_path / "run")
    train(config(run, resume=True))  # one process: ckpt.pt at step STEPS, beside dcp-step HALF
    ckpt = os.path.join(run, "ckpt.pt")
    shutil.copy(ckpt, os.path.join(run, "ckpt.prev.pt"))
    if folder_touched:
        _touch(last(run))
    cfg = config(run, parallel="fsdp", resume=True, stop_after=STEPS)  # the load alone
    # a rank left waiting is killed at the timeout, and the test fails
    outputs = finished(spawn(2, CKPT_UNREADABLE_ON_RANK_1, cfg, ckpt))
    refused = _agreed_refusal(outputs)
    assert re.search(f"refused: checkpoint {re.escape(repr(ckpt))} is truncated or corrupt \\(\\[Errno 5\\] "
                     f"Input/output error\\); the previous checkpoint .*ckpt.prev.pt' \\(step {STEPS}\\) loads",
                     refused), refused
    assert ["previous read 1 times" in outputs[0], "previous read 0 times" in outputs[1]] == [True, True], outputs
    # negative control: no rank failing to read, both ranks resume from ckpt.pt
    outputs = finished(spawn(2, CKPT_UNREADABLE_ON_RANK_1, cfg, str(tmp_path / "none")))
    assert all("resumed" in out for out in outputs) and f"resumed from {ckpt} at step {STEPS}" in outputs[0], outputs


# Each rank: from_rank_0 of a value, an exception, a result that cannot be pickled and an exception
# that cannot be unpickled, each outcome printed as "case: value" or "case: Type: message".
FROM_RANK_0 = textwrap.dedent("""
    import os, threading, torch.distributed as dist
    from geomuon.pretrain.parallel import from_rank_0
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class TwoArguments(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    def value():
        return {"path": "ckpt.pt", "rank": rank}

    def refused():
        raise ValueError(f"refused on rank {rank}")

    def lock():
        return threading.Lock()

    def two_arguments():
        raise TwoArguments(1, 2)

    for case, fn in (("value", value), ("refused", refused), ("lock", lock), ("two_arguments", two_arguments)):
        try:
            print(f"{case}: {from_rank_0(fn, True)}", flush=True)
        except Exception as err:
            print(f"{case}: {type(err).__name__}: {err}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_from_rank_0_gives_every_rank_rank_0s_value_or_refusal(tmp_path):
    # rank 0 alone computes; every rank returns its value or raises its exception. A result that
    # cannot be pickled had raised pickle's TypeError on rank 0 alone, before the broadcast the other
    # ranks then waited in until the process group's timeout (the test's join fails on such a wait)
    ranks = [out.splitlines() for out in finished(spawn(2, FROM_RANK_0, config(tmp_path)))]
    for lines in ranks:
        assert "value: {'path': 'ckpt.pt', 'rank': 0}" in lines  # rank 0's, not this rank's
        assert "refused: ValueError: refused on rank 0" in lines
        assert any(line.startswith("lock: RuntimeError: rank 0's result cannot be sent to the other ranks (")
                   for line in lines), lines
    assert "two_arguments: TwoArguments: 1/2" in ranks[0]  # rank 0 raises its own
    assert any(line.startswith("two_arguments: RuntimeError: rank 0's result cannot be read on this rank (")
               for line in ranks[1]), ranks[1]


# Each rank: a resume of the run in which rank 1 alone cannot stat the folder argv[2] (os.path.isdir
# answers False there), then how the resume ended.
FOLDER_UNSEEN_ON_RANK_1 = _resume_with("""
    unseen, plain = sys.argv[2], os.path.isdir

    def isdir(path):
        return False if os.fspath(path) == unseen and os.environ["RANK"] == "1" else plain(path)

    os.path.isdir = isdir
""")


def test_every_rank_resumes_from_the_folder_rank_0_chose(runs, tmp_path):
    # rank 0 chose the checkpoint, yet each rank asked on its own whether it is a folder: rank 1,
    # whose stat failed, read it as a single file and paired its collectives with rank 0's others
    # (rank 0 refused, rank 1 waited until killed). Rank 0 now says both
    run, cfg = _fsdp_resume(runs, tmp_path)
    newest = last(run)
    outputs = finished(spawn(2, FOLDER_UNSEEN_ON_RANK_1, cfg, newest))
    assert all("resumed" in out for out in outputs) and f"resumed from {newest} at step {STEPS}" in outputs[0], outputs


def test_a_resume_reads_the_record_of_its_distributed_checkpoint_once(runs, tmp_path, monkeypatch):
    # the resume read run.pt (its zip checked entry by entry, then unpickled) to check the run's
    # settings, and the load read it again
    split = halfway(runs / "fsdp", tmp_path / "once")
    read = []
    monkeypatch.setattr("geomuon.pretrain.parallel.load_checked", lambda path: read.append(path) or load_checked(path))
    train(config(split, resume=True, stop_after=HALF))  # no step: the load alone
    assert read == [os.path.join(last(split), "run.pt")], read


def test_a_checkpoint_whose_record_lists_no_files_still_loads_and_a_lost_shard_is_named(runs, tmp_path):
    # checkpoints written before the record listed its files' sums load unchecked; a tensor file
    # DCP then cannot read had raised DCP's bare CheckpointException from read_distributed
    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp", run)
    folder = last(run)
    record = load_checked(os.path.join(folder, "run.pt"))
    assert set(record.pop("files")) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    torch.save(record, os.path.join(folder, "run.pt"))
    assert identical(read_distributed(folder, ""), read_distributed(last(runs / "fsdp"), ""))
    os.truncate(os.path.join(folder, "__1_0.distcp"), 16)
    with pytest.raises(DamagedCheckpoint, match=f"{folder}.*could not be read"):
        read_distributed(folder)


# Each rank: the command `geomuon pretrain` of the run, the rank of argv[2] unable to read its data
# (a ValueError, as the loader refuses a file; with argv[3] "OSError", an OSError of its machine)
COMMAND = textwrap.dedent("""
    import os, shlex, sys, torch
    torch.set_num_threads(1)
    from geomuon.cli import entry
    from geomuon.pretrain import train as training
    from geomuon.pretrain.config import command_line
    error = OSError if sys.argv[3:] == ["OSError"] else ValueError

    def load_data(spec, vocab_size):
        raise error(f"data {spec}: no such file on rank {os.environ['RANK']}")

    if os.environ["RANK"] == sys.argv[2]:  # this rank's copy of the data is gone (its own machine's)
        training.load_data = load_data
    sys.argv = shlex.split(command_line("geomuon pretrain", training.TrainConfig(**eval(sys.argv[1]))))
    entry()
""")


def test_under_torchrun_a_refusal_is_printed_once(tmp_path):
    # every rank had printed the same `geomuon pretrain: …` line
    cfg = config(tmp_path / "empty", parallel="ddp", strategy="adamw", resume=True)
    procs = spawn(2, COMMAND, cfg, "none")
    outputs = ended(procs)
    assert [p.returncode for p in procs] == [2, 2], outputs
    said = "geomuon pretrain: --resume (resume=True): --out-dir (out_dir)"
    assert outputs[0].count(said) == 1 and "geomuon pretrain:" not in outputs[1], outputs


@pytest.mark.parametrize("failing, error", [("1", "ValueError"), ("0", "ValueError"), ("1", "OSError")])
def test_a_rank_that_cannot_load_its_data_says_so_and_every_rank_stops_at_once(tmp_path, failing, error):
    # each rank loaded its data alone, then the ranks gathered their data's identities: a rank whose
    # load failed left, and the others waited in that gather (gloo until the rank's socket closed,
    # NCCL until its timeout). It now sends its failure in that gather: it raises its own error (a
    # refusal of its data, which it prints), the others a refusal naming it (printed once, by rank 0)
    procs = spawn(2, COMMAND, config(tmp_path / "run", parallel="ddp", strategy="adamw"), failing, error)
    outputs = ended(procs)  # every rank on its own: none is killed
    own = f"data embedded: no such file on rank {failing}"
    named = (f"geomuon pretrain: rank {failing} could not read its data (rank {failing}: {own}); give every process "
             "a readable copy of its --data (data)\n")
    if error == "OSError":  # not a refusal: the command line leaves it to Python's traceback, and exit status 1
        assert [p.returncode for p in procs] == [2, 1] and f"OSError: {own}" in outputs[1], outputs
    else:
        assert [p.returncode for p in procs] == [2, 2], outputs
        mine = outputs[int(failing)]
        said = f"{'[rank 1] ' if failing == '1' else ''}geomuon pretrain: {own}\n"
        assert mine.count(said) == 1 and mine.count("geomuon pretrain:") == 1, outputs
    if failing == "1":
        assert outputs[0].count(named) == 1 and outputs[0].count("geomuon pretrain:") == 1, outputs
    else:  # rank 0's own refusal is the one line: rank 1 prints none
        assert "geomuon pretrain:" not in outputs[1], outputs
    assert not os.path.exists(tmp_path / "run")  # nothing was written


@pytest.mark.parametrize("refused", ["context", "resume"])
def test_a_refusal_of_the_data_the_ranks_agreed_on_is_printed_once(tmp_path, refused):
    # once the ranks hold the same data, its later refusals (build's check of the context, a resume
    # on other data) are raised alike by every rank: they had been refusals of each rank's own data,
    # printed by every rank ("[rank 1] geomuon pretrain: …" beside rank 0's line)
    text = tmp_path / "text.txt"
    cfg = config(tmp_path / "run", parallel="ddp", strategy="adamw", steps=2, warmup_steps=0, eval_every=2,
                 data=f"text:{text}")
    if refused == "context":
        text.write_text("abc" * 10)  # both splits shorter than one window of block_size + 1 tokens
        said = f"geomuon pretrain: data text:{text}: the train split has 27 tokens, fewer than"
    else:
        text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
        train(replace(cfg, parallel="none"))  # the run, on one process
        text.write_text("the quick brown fox jumps over the lazy cat. " * 40)
        cfg = replace(cfg, resume=True)
        said = f"geomuon pretrain: --data text:{text}: the data differs from the data the run was trained on"
    procs = spawn(2, COMMAND, cfg, "none")
    outputs = ended(procs)
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert outputs[0].count(said) == 1 and outputs[0].count("geomuon pretrain:") == 1, outputs
    assert "geomuon pretrain:" not in outputs[1], outputs


def _touch(path) -> None:
    later = time.time() + 100
    os.utime(path, (later, later))


def test_a_resume_starts_from_the_checkpoint_of_the_later_step_whatever_the_file_times(tmp_path, capsys):
    # the newer file time had decided: after a copy, touch or extraction an older ckpt.pt won over
    # a later distributed checkpoint, and its steps were trained again (the log rewritten)
    run = tmp_path / "run"
    cfg = config(run, strategy="adamw", eval_every=3)
    train(replace(cfg, stop_after=3))  # ckpt.pt at step 3
    finished(spawn(2, WORKER, replace(cfg, parallel="ddp", resume=True, stop_after=6)))  # dcp-step00000006
    folder = os.path.join(run, "dcp-step00000006")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    _touch(copy / "ckpt.pt")
    assert checkpoint_to_resume(str(copy)) == os.path.join(copy, "dcp-step00000006")
    assert train(replace(cfg, out_dir=str(copy), resume=True, stop_after=6)).last_step == 6
    assert f"resumed from {os.path.join(copy, 'dcp-step00000006')} at step 6" in capsys.readouterr().out
    # the other way round: a ckpt.pt of a later step than the folder touched after it
    train(replace(cfg, resume=True, stop_after=9))  # one process, from the folder: ckpt.pt at step 9
    _touch(folder)
    assert checkpoint_to_resume(str(run)) == os.path.join(run, "ckpt.pt")


def test_fsdp_trains_a_mixture_of_experts_when_an_expert_gets_no_tokens_on_a_rank(tmp_path):
    # 2 windows of 64 tokens per rank: within these steps an expert of cpu-moe gets no token on a
    # rank. It had been skipped there, so its parameters had no gradient on that rank, and FSDP2's
    # reduce-scatter of the block's gradients had buffers of different sizes on the two ranks: a
    # gloo abort (SIGABRT). Every expert runs now, an empty one giving a zero gradient.
    processes(2, config(tmp_path / "moe", model="cpu-moe", parallel="fsdp", batch_size=4, block_size=None, steps=6,
                        warmup_steps=1, eval_every=3))
    assert [s for s, _ in dcp_folders(str(tmp_path / "moe"))] == [3, 6]


def test_folder_holding_a_distributed_checkpoint_is_a_run(tmp_path):
    (tmp_path / "dcp-step00000006").mkdir()
    with pytest.raises(ValueError, match="already holds a run .*dcp-step00000006"):
        resolve_out_dir(config(tmp_path))
    assert resolve_out_dir(config(tmp_path, resume=True)) == str(tmp_path)
    (tmp_path / "dcp-step00000006").rename(tmp_path / "dcp-step00000006.tmp")  # unfinished: not a run
    assert resolve_out_dir(config(tmp_path)) == str(tmp_path)



def test_train_leaves_a_process_group_the_caller_initialized(tmp_path, monkeypatch):
    # train() under torchrun on a group the caller set up must not destroy it: it had, and the
    # caller's next collective failed with "Default process group has not been initialized".
    # One process, a world of one (--parallel ddp with MASTER_ADDR set runs the DDP path).
    import torch.distributed as dist

    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1", RANK="0",
                            LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    cfg = config(tmp_path / "own", parallel="ddp", strategy="adamw", steps=2, warmup_steps=0, eval_every=2)
    train(cfg)  # control: the group train() creates, it destroys
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        train(replace(cfg, out_dir=str(tmp_path / "caller")))
        assert dist.is_initialized()
        total = torch.ones(1)
        dist.all_reduce(total)  # the caller's group still works
        assert total.item() == 1.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_folder_rank_0_claimed_is_released_when_its_broadcast_fails(tmp_path, monkeypatch, command):
    # rank 0 claims the folder (creates and locks it), then broadcasts it to the other ranks: a broadcast
    # that fails (a peer gone) must not leave this process holding the lock, nor an empty folder behind
    from geomuon.pretrain import compare
    from geomuon.pretrain import train as training
    from geomuon.pretrain.train import RunFolderClaim

    def broadcast(value, together):
        value()  # rank 0's claim, then a broadcast that fails
        raise RuntimeError("a peer is gone")

    def run(out_dir):
        cfg = config(out_dir, strategy="adamw", steps=2, warmup_steps=0, eval_every=2)
        with pytest.raises(RuntimeError, match="a peer is gone"):
            train(cfg) if command == "train" else compare.compare(cfg, ["adamw"], [0])

    monkeypatch.setattr(training, "from_rank_0", broadcast)
    run(tmp_path / "cmp-{time}")
    assert os.listdir(tmp_path) == []  # the fresh folder the template gave, removed again
    os.mkdir(tmp_path / "run")
    run(tmp_path / "run")
    RunFolderClaim(str(tmp_path / "run")).release()  # unlocked: this process claims it again


# Each rank: a comparison (the Python API of `geomuon compare`) of one run; once both ranks have
# trained it, and before either releases its claim, rank 0 writes what the comparisons' parent
# folder holds (what a comparison killed there would leave behind).
COMPARISON = textwrap.dedent("""
    import json, os, sys, time, torch
    torch.set_num_threads(1)
    from geomuon.pretrain import compare
    from geomuon.pretrain.train import TrainConfig
    cfg, shared = TrainConfig(**eval(sys.argv[1])), sys.argv[2]
    parent, trained = os.path.dirname(cfg.out_dir), compare.train

    def wait_for(*names):
        while not all(os.path.exists(os.path.join(shared, name)) for name in names):
            time.sleep(0.05)

    def train_then_list(cfg, data, sharing):
        result = trained(cfg, data, sharing=sharing)
        open(os.path.join(shared, f"trained.{os.environ['RANK']}"), "w").close()
        wait_for("trained.0", "trained.1")
        if os.environ["RANK"] == "0":
            listing = {name: sorted(os.listdir(os.path.join(parent, name))) for name in os.listdir(parent)}
            with open(os.path.join(shared, "listing.json.tmp"), "w") as f:
                json.dump(listing, f)
            os.replace(os.path.join(shared, "listing.json.tmp"), os.path.join(shared, "listing.json"))
        wait_for("listing.json")
        return result

    compare.train = train_then_list
    summaries = compare.compare(cfg, ["adamw"], [0])
    print(f"run folder {summaries[0].result.out_dir}", flush=True)
    os._exit(0)
""")


def test_a_torchrun_comparison_makes_one_folder_rank_0s(tmp_path):
    # every rank had resolved the {time} template and created a fresh folder of its own (rank 1 the
    # "-2" of rank 0's, or a later second's): left empty while the runs wrote to rank 0's, left
    # behind when the comparison was killed, and the runs' folder was "-2" when rank 1 won the race
    cfg = config(tmp_path / "runs" / "cmp-{time}", parallel="ddp", strategy="adamw", steps=2, warmup_steps=0,
                 eval_every=2)
    outputs = finished(spawn(2, COMPARISON, cfg, str(tmp_path)))
    with open(tmp_path / "listing.json") as f:
        during = json.load(f)
    (folder,) = os.listdir(tmp_path / "runs")
    assert during == {folder: [".lock", "adamw-s0"]}, during
    assert re.fullmatch(r"cmp-\d{8}-\d{6}", folder), folder  # the template's first name: no other was taken
    assert sorted(os.listdir(tmp_path / "runs" / folder)) == [".lock", "adamw-s0"]
    assert all(f"run folder {tmp_path / 'runs' / folder / 'adamw-s0'}" in out for out in outputs), outputs


# Each rank: a run on data it loaded itself, then whether it hashed that data (TokenData.identity is
# a cached property) and how many times it recorded a segment's provenance (running git).
HASHED_WHERE_NEEDED = textwrap.dedent("""
    import os, sys, torch
    torch.set_num_threads(1)
    from geomuon.pretrain import train as training
    recorded, plain = [], training.segment_provenance

    def segment_provenance(*args):
        recorded.append(None)
        return plain(*args)

    training.segment_provenance = segment_provenance
    cfg = training.TrainConfig(**eval(sys.argv[1]))
    data = training.load_run_data(cfg)
    training.train(cfg, data)
    print(f"rank {os.environ['RANK']}: hashed {'identity' in data.__dict__}, provenance {len(recorded)}", flush=True)
    os._exit(0)
""")


def test_only_rank_0_runs_git_and_every_rank_hashes_its_data(tmp_path):
    # git had run on every rank for the record that rank 0 alone writes. Every rank hashes the data
    # it read (on several machines each reads files of its own): a fresh run compares the ranks'
    # data (rank 1 on other text had trained silently, or aborted in gloo), a resume each rank's
    # with the checkpoint's
    cfg = config(tmp_path / "run", parallel="ddp", strategy="adamw", steps=4, eval_every=2, stop_after=2)
    fresh = finished(spawn(2, HASHED_WHERE_NEEDED, cfg))
    assert "rank 0: hashed True, provenance 1" in fresh[0] and "rank 1: hashed True, provenance 0" in fresh[1], fresh
    resumed = finished(spawn(2, HASHED_WHERE_NEEDED, replace(cfg, stop_after=4, resume=True)))
    assert "rank 0: hashed True, provenance 1" in resumed[0] and "rank 1: hashed True, provenance 0" in resumed[1], \
        resumed


# Each rank: a run on the data of argv[2 + its rank] (each rank reads its own copy of the data: a
# launcher script that gives each rank its own --data, or files of its own machine).
OWN_DATA = _resume_with("""
    fields = eval(sys.argv[1])
    fields["data"] = sys.argv[2 + int(os.environ["RANK"])]
    sys.argv[1] = repr(fields)
""")


@pytest.mark.parametrize("other", ["same characters", "another vocabulary"])
def test_a_fresh_run_whose_ranks_read_different_data_is_refused_alike_on_every_rank(tmp_path, other):
    # a fresh run never compared the ranks' data (a resume did, against the checkpoint): ranks of
    # one vocabulary trained on different text, and ranks of two had aborted gloo in the model's
    # first broadcast ("Received data size doesn't match expected size"; NCCL hangs)
    text = "the quick brown fox jumps over the lazy dog. " * 40
    mine, theirs = tmp_path / "a.txt", tmp_path / "b.txt"
    mine.write_text(text)
    theirs.write_text(text[::-1] if other == "same characters" else text + "!")
    cfg = config(tmp_path / "run", parallel="ddp", strategy="adamw", steps=2, warmup_steps=0, eval_every=2)
    outputs = finished(spawn(2, OWN_DATA, cfg, f"text:{mine}", f"text:{theirs}"))
    refusals = [re.search(r"refused: (.*)", out) for out in outputs]
    assert all(refusals) and refusals[0].group(1) == refusals[1].group(1), outputs
    said = refusals[0].group(1)
    assert said.startswith(f"rank 1 read other data than rank 0's text:{mine} (rank 1: ") and \
        said.endswith("give every process the same --data (data) file contents"), said
    # negative control: the same contents, read from another path on rank 1, train ("resumed": the
    # script's word for a run that ended without a refusal)
    copy = tmp_path / "copy.txt"
    copy.write_text(text)
    cfg = replace(cfg, out_dir=str(tmp_path / "same"))
    assert all("resumed" in out for out in finished(spawn(2, OWN_DATA, cfg, f"text:{mine}", f"text:{copy}")))


def test_a_checkpoint_keeping_no_data_identity_is_judged_alike_on_every_rank(tmp_path):
    # a checkpoint written before runs recorded their data's sha256 is compared by the --data spec each
    # rank was given (a path of its own machine): rank 1, given another path to the same text, had
    # refused alone and rank 0 died in the model's broadcast. Control: the same spec on both resumes
    text = "the quick brown fox jumps over the lazy dog. " * 40
    mine, copy = tmp_path / "a.txt", tmp_path / "b.txt"
    mine.write_text(text)
    copy.write_text(text)
    cfg = config(tmp_path / "run", parallel="ddp", strategy="adamw", steps=4, warmup_steps=0, eval_every=2,
                 data=f"text:{mine}", stop_after=2)
    train(replace(cfg, parallel="none"))
    ckpt = os.path.join(cfg.out_dir, "ckpt.pt")
    payload = load_checkpoint(ckpt)
    save_checkpoint(ckpt, {k: v for k, v in payload.items() if k != "data"})  # as older versions wrote it
    resume = replace(cfg, resume=True, stop_after=4)
    outputs = finished(spawn(2, OWN_DATA, resume, f"text:{mine}", f"text:{copy}"))
    # alike on both ranks but for the --data each names at its head
    refusals = [re.search(r"refused: --data \S+: (.*)", out) for out in outputs]
    assert all(refusals) and refusals[0].group(1) == refusals[1].group(1), outputs
    assert f"(data spec on rank 1: 'text:{mine}' → 'text:{copy}', and the checkpoint keeps no sha256" in \
        refusals[0].group(1)
    assert all("resumed" in out for out in finished(spawn(2, OWN_DATA, resume, f"text:{mine}", f"text:{mine}")))


# Each rank: the command `geomuon compare` of argv[1]'s options (those `compare` takes); with more
# arguments, on the data of argv[2 + its rank].
COMPARE_COMMAND = textwrap.dedent("""
    import os, shlex, sys, torch
    torch.set_num_threads(1)
    from geomuon.cli import entry
    from geomuon.pretrain.compare import COMPARE_DEFAULTS
    from geomuon.pretrain.config import command_line
    from geomuon.pretrain.train import TrainConfig
    fields = eval(sys.argv[1])
    if len(sys.argv) > 2:
        fields["data"] = sys.argv[2 + int(os.environ["RANK"])]
    cfg = TrainConfig(**fields)
    sys.argv = shlex.split(command_line("geomuon compare --strategies adamw", cfg, exclude=("strategy", "seed"),
                                        defaults=COMPARE_DEFAULTS))
    entry()
""")


def test_under_torchrun_a_comparisons_refusal_is_printed_once(tmp_path):
    # every rank had printed the same `geomuon compare: …` line (`geomuon pretrain` prints it on rank 0)
    cfg = config(tmp_path / "empty", parallel="ddp", strategy="adamw", resume=True)
    procs = spawn(2, COMPARE_COMMAND, cfg)
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert outputs[0].count("geomuon compare: ") == 1 and "geomuon compare:" not in outputs[1], outputs


def test_a_resumed_comparison_whose_ranks_read_different_data_is_refused_once_on_every_rank(tmp_path):
    # compare checked each checkpoint against each rank's data before any run (and its data check)
    # started: rank 1, on other text, raised a refusal it did not print (a data refusal, rewrapped as
    # a plain one) and rank 0 went on into the first run's collectives, where gloo killed it.
    # Control: the same data on both ranks resumes the comparison
    text = "the quick brown fox jumps over the lazy dog. " * 40
    mine, theirs = tmp_path / "a.txt", tmp_path / "b.txt"
    mine.write_text(text)
    theirs.write_text(text[::-1])
    cfg = config(tmp_path / "cmp", parallel="ddp", strategy="adamw", steps=4, warmup_steps=0, eval_every=2,
                 stop_after=2, data=f"text:{mine}")
    finished(spawn(2, COMPARE_COMMAND, cfg, f"text:{mine}", f"text:{mine}"))
    resumed = replace(cfg, resume=True, stop_after=4)
    procs = spawn(2, COMPARE_COMMAND, resumed, f"text:{mine}", f"text:{theirs}")
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert outputs[0].count("geomuon compare: rank 1 read other data than rank 0's") == 1, outputs
    assert "geomuon compare:" not in outputs[1], outputs
    finished(spawn(2, COMPARE_COMMAND, resumed, f"text:{mine}", f"text:{mine}"))


def test_a_ranks_own_data_refusal_is_one_write_naming_the_rank(monkeypatch):
    # each rank that refuses its data says so, and ranks writing at once had interleaved their
    # lines (print writes the message and its newline apart): one write of the whole line, and the
    # rank named where it is not rank 0; a refusal every rank raises alike is rank 0's to say
    from geomuon.pretrain.train import DataRefusal, say_refusal
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Stderr", (), {"write": lambda self, text: writes.append(text)})())
    say_refusal("pretrain", DataRefusal("data x: unreadable"), 1)
    say_refusal("pretrain", DataRefusal("data y: unreadable"), 0)
    say_refusal("compare", ValueError("alike"), 1)
    say_refusal("compare", ValueError("alike"), 0)
    assert writes == ["[rank 1] geomuon pretrain: data x: unreadable\n", "geomuon pretrain: data y: unreadable\n",
                      "geomuon compare: alike\n"], writes
