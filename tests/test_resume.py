"""Checkpoints: a killed run resumes to the uninterrupted losses; damage is reported."""

import json
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import replace

import pytest
import torch

from geomuon.cli import main as cli
from geomuon.pretrain.train import (RunLog, RunWriteError, TrainConfig, TrainingInterrupted,
                                    load_checkpoint, previous_checkpoint, read_log, save_checkpoint, train)

STEPS = 400  # the schedule; the runs below stop long before its end


def config(out_dir, **overrides):
    strategy = overrides.get("strategy", "hetero")
    # 3 dual steps where Manifold Muon runs (another strategy refuses the option it would ignore)
    dual_steps = None if TrainConfig(strategy=strategy, dual_steps=3).unused_options([strategy]) else 3
    base = dict(model="cpu-tiny", strategy=strategy, steps=STEPS, batch_size=4, block_size=32,
                eval_every=1000, eval_batches=1, ckpt_every=3, warmup_steps=5, dual_steps=dual_steps,
                out_dir=str(out_dir), progress=False, print_table=False)
    return TrainConfig(**{**base, **overrides})


def test_killed_run_resumes_with_identical_losses(tmp_path):
    cfg = config(tmp_path / "killed")
    assert cfg.dual_steps == 3  # the default strategy's runs take their dual steps (not silently dropped)
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    # same thread count as this process: CPU reductions are bit-reproducible only then
    script = ("import sys, torch; torch.set_num_threads(int(sys.argv[2])); from geomuon.pretrain.train import *; "
              "train(TrainConfig(**eval(sys.argv[1])))")
    proc = subprocess.Popen([sys.executable, "-c", script, repr(fields), str(torch.get_num_threads())],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ckpt = tmp_path / "killed" / "ckpt.pt"
    # killed once its second checkpoint is there (3 to 10 s on 2 cores, the whole 400 steps 15 to 50 s);
    # the time allowed only bounds a hung run. A bound of 120 s could pass on a loaded 2-core machine, and the
    # run was then killed whatever it had written: before its first checkpoint, a failure at
    # load_checkpoint ("does not exist") that named no cause
    deadline = time.time() + 900
    while not os.path.exists(previous_checkpoint(str(ckpt))) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-run, possibly mid-write: the atomic write must cope
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert os.path.exists(previous_checkpoint(str(ckpt))), "the run wrote no second checkpoint in 900 s"
    killed_at = load_checkpoint(str(ckpt))["step"]
    assert 0 < killed_at < STEPS
    stop = killed_at + 4
    resumed = train(config(tmp_path / "killed", resume=True, stop_after=stop))
    uninterrupted = train(config(tmp_path / "whole", stop_after=stop))
    remaining = range(killed_at, stop)
    assert [resumed.losses[s] for s in remaining] == [uninterrupted.losses[s] for s in remaining]
    for name, value in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_a_finished_run_read_back_reports_the_time_it_trained(tmp_path):
    # a comparison resumed after its runs finished reads them back: the wall time had then been
    # the checkpoint's (taken before its writing) where the fresh run's included the writing
    cfg = config(tmp_path / "run", strategy="adamw", stop_after=4)
    fresh = train(cfg)
    recorded = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["wall_time"]
    again = train(config(tmp_path / "run", strategy="adamw", stop_after=4, resume=True))
    assert fresh.wall_time == recorded == again.wall_time


def test_a_checkpoint_records_what_ran_each_segment_of_its_run(tmp_path):
    # the configuration alone had said device "auto" and named no code: a run could not be said
    # to have been reproduced. Each segment (the start, every resume) records its own.
    from geomuon import __version__
    from geomuon.pretrain.provenance import code_fingerprint, git_commit

    train(config(tmp_path / "run", strategy="adamw", stop_after=3, device="auto"))
    first = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["provenance"]
    train(config(tmp_path / "run", strategy="adamw", stop_after=6, device="auto", resume=True))
    both = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["provenance"]
    assert both[:1] == first and [segment["first_step"] for segment in both] == [0, 3]
    for segment in both:
        # resolved, not the option's "auto" (train's rule: CUDA where there is one)
        assert segment["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
        assert (segment["geomuon"], segment["torch"], segment["world_size"]) == (__version__, torch.__version__, 1)
        assert (segment["commit"], segment["code"]) == (git_commit(), code_fingerprint())


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
    # options that change the run from the next step on (they had been taken, or ignored
    # while the checkpoint recorded them for the whole run)
    for option, value in (("grad_clip", 0.01), ("dual_steps", 0), ("direction_dtype", "fp32")):
        with pytest.raises(ValueError, match=rf"different run configuration \({option}: "):
            train(config(tmp_path / "a", steps=8, resume=True, **{option: value}))
    train(config(tmp_path / "b", steps=8, stop_after=3, strategy="lipschitz"))  # w_max reaches the soft cap
    with pytest.raises(ValueError, match=r"different run configuration \(w_max: "):
        train(config(tmp_path / "b", steps=8, resume=True, strategy="lipschitz", w_max=3.0))


def test_a_shape_option_given_with_the_configs_own_value_resumes(tmp_path):
    # --n-embd 32 on cpu-tiny (whose width is 32), given on one side only, had been refused as
    # "n_embd: None → 32": the options were compared as typed, not by the model they build.
    # Control: another width is refused, as a changed option (not as another geomuon version)
    train(config(tmp_path / "a", steps=8, stop_after=2))
    assert train(config(tmp_path / "a", steps=8, stop_after=3, resume=True, n_embd=32)).last_step == 3
    train(config(tmp_path / "b", steps=8, stop_after=2, n_embd=32, block_size=None))  # the config's 64, and 32 given
    assert train(config(tmp_path / "b", steps=8, stop_after=3, resume=True, block_size=64)).last_step == 3
    with pytest.raises(ValueError, match=r"--resume with a different run configuration \(n_embd: 32 → 64\); use the "
                                         r"original settings"):
        train(config(tmp_path / "a", steps=8, resume=True, n_embd=64))


def test_resume_with_other_validation_windows_is_refused(tmp_path):
    # the evaluations after the resume had been scored on other windows than those before it: a
    # step in the val-loss curve that training did not make
    train(config(tmp_path / "a", steps=8, stop_after=2))
    for option, value in (("val_seed", 5), ("eval_batches", 2), ("final_eval_batches", 3)):
        with pytest.raises(ValueError, match=rf"different run configuration \({option}: "):
            train(config(tmp_path / "a", steps=8, resume=True, **{option: value}))
    assert train(config(tmp_path / "a", steps=8, stop_after=3, resume=True)).last_step == 3  # the same run resumes


def test_resume_on_other_data_or_another_model_is_refused_by_name(tmp_path):
    # only the --data spec had been compared: an edited file resumed silently on other text, and a
    # grown vocabulary ended in load_state_dict's RuntimeError traceback
    from geomuon.pretrain.data import embedded_corpus

    corpus = tmp_path / "corpus.txt"
    text = embedded_corpus()[:20_000]
    corpus.write_text(text)
    run = dict(data=f"text:{corpus}", steps=8)
    train(config(tmp_path / "a", stop_after=2, **run))
    corpus.write_text("\n".join(reversed(text.split("\n"))))  # the same characters, another text
    with pytest.raises(ValueError, match=rf"--data text:{corpus}: the data differs from the data the run was trained "
                                         r"on \(tokens sha256: \w+… → \w+…\); restore the data"):
        train(config(tmp_path / "a", resume=True, **run))
    corpus.write_text(text + "é")
    with pytest.raises(ValueError, match=r"\(characters added: 'é'; vocab size: \d+ → \d+; val tokens: "):
        train(config(tmp_path / "a", resume=True, **run))
    corpus.write_text(text)
    ckpt = str(tmp_path / "a" / "ckpt.pt")
    payload = load_checkpoint(ckpt)
    # a model the config builds differently now (another geomuon version's configuration)
    save_checkpoint(ckpt, {**payload, "model_config": {**payload["model_config"], "n_embd": 48}})
    with pytest.raises(ValueError, match=r"the checkpoint's model differs from the one --config cpu-tiny builds now "
                                         r"\(n_embd: 48 → 32\); resume with the geomuon version that wrote it"):
        train(config(tmp_path / "a", resume=True, **run))
    # the same configuration, other tensors (another version's model code)
    save_checkpoint(ckpt, {**payload, "model": {k: v for k, v in payload["model"].items() if k != "wpe.weight"}})
    with pytest.raises(ValueError, match=rf"checkpoint '{ckpt}' does not fit the model \(.*wpe.weight"):
        train(config(tmp_path / "a", resume=True, **run))
    save_checkpoint(ckpt, payload)
    assert train(config(tmp_path / "a", resume=True, stop_after=3, **run)).last_step == 3


def test_the_same_data_read_from_another_path_resumes_and_other_data_is_still_refused(tmp_path, monkeypatch):
    # the --data spec had been compared as a string: the corpus given by an absolute path, through a
    # link or after a move was refused. The tokens decide; each segment's provenance names the file read.
    import numpy as np

    from geomuon.pretrain.data import embedded_corpus, load_data

    monkeypatch.chdir(tmp_path)
    root = os.path.realpath(tmp_path)  # what provenance records: links resolved
    text = embedded_corpus()[:20_000]
    (tmp_path / "corpus.txt").write_text(text)
    run = dict(strategy="adamw", steps=8)
    straight = train(config(tmp_path / "straight", stop_after=4, data="text:corpus.txt", **run))
    out = tmp_path / "a"
    train(config(out, stop_after=1, data="text:corpus.txt", **run))
    (tmp_path / "moved").mkdir()
    os.replace(tmp_path / "corpus.txt", tmp_path / "moved" / "corpus.txt")
    os.symlink(tmp_path / "moved" / "corpus.txt", tmp_path / "link.txt")
    moved = f"{root}/moved/corpus.txt"
    for stop, spec in ((2, f"text:{moved}"), (3, "text:link.txt"), (4, "shakespeare:moved/corpus.txt:nocheck")):
        resumed = train(config(out, stop_after=stop, resume=True, data=spec, **run))
    assert resumed.losses == straight.losses  # bit for bit: the batches of the uninterrupted run
    provenance = load_checkpoint(str(out / "ckpt.pt"))["provenance"]
    assert [segment["data"] for segment in provenance] == [f"text:{root}/corpus.txt", f"text:{moved}",
                                                           f"text:{moved}", f"shakespeare:{moved}"]
    # negative controls: other content under any path, or another tokenization, is refused by name
    tokens = load_data("text:link.txt")  # the same tokens as GPT-2 shards: another vocabulary and dtype
    (tmp_path / "shards").mkdir()
    for split in ("train", "val"):
        getattr(tokens, split).astype(np.uint16).tofile(tmp_path / "shards" / f"{split}.bin")
    (tmp_path / "edited.txt").write_text(text[:-1] + ("a" if text[-1] != "a" else "b"))  # same characters
    (tmp_path / "longer.txt").write_text(text + text[:100])
    for spec, change in (("text:edited.txt", r"tokens sha256: \w+… → \w+…"),
                         ("text:longer.txt", r"train tokens: 18000 → 18090; val tokens: 2000 → 2010;"),
                         ("tokens:shards", r"tokenization: characters → GPT-2 tokens; vocab size: \d+ → 256;"),
                         ("embedded", r"characters added: .*train tokens: 18000 → \d+;")):
        # (where the run last read its data, as its provenance records it: absolute, links resolved)
        refused = (rf"^--data {spec}: the data differs from the data the run was trained on, read from "
                   rf"shakespeare:{re.escape(os.path.realpath(moved))} \({change}.*restore the data")
        with pytest.raises(ValueError, match=refused) as refusal:
            train(config(out, stop_after=5, resume=True, data=spec, **run))
        # no DataRefusal (one rank's own load): under torchrun the ranks have agreed on their data
        # first, so every rank refuses it alike, and rank 0 alone prints it
        assert type(refusal.value) is ValueError
    # a checkpoint that keeps no data identity (written before it did): only the spec can be compared
    payload = load_checkpoint(str(out / "ckpt.pt"))
    save_checkpoint(str(out / "ckpt.pt"), {k: v for k, v in payload.items() if k != "data"})
    with pytest.raises(ValueError, match=r"\(data spec: 'shakespeare:moved/corpus.txt:nocheck' → 'text:link.txt', "
                                         r"and the checkpoint keeps no sha256"):
        train(config(out, stop_after=5, resume=True, data="text:link.txt", **run))
    assert train(config(out, stop_after=5, resume=True, data="shakespeare:moved/corpus.txt:nocheck",
                        **run)).last_step == 5


def test_a_file_that_is_not_a_run_checkpoint_is_named(tmp_path):
    # a torch file with a "model" entry (saved by hand, or another tool's) had ended in KeyError: 'config'
    (tmp_path / "a").mkdir()
    ckpt = tmp_path / "a" / "ckpt.pt"
    torch.save({"model": {"w": torch.zeros(3)}}, ckpt)
    with pytest.raises(ValueError, match=rf"checkpoint '{ckpt}' is not the checkpoint of a geomuon pretrain run \(it "
                                         r"has no 'optimizer', 'step', 'config', 'losses', 'evals'\); move it out"):
        train(config(tmp_path / "a", resume=True))


def test_a_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    # a step whose loss and gradient norm are finite can still leave weights that are not (hetero
    # at --lr 1e20 had): they had been written as the checkpoint, the run reported diverged=False,
    # and resuming it failed; here the third step's update poisons one weight
    import math

    from geomuon.optimizers.assign import assign

    def poisoned_third_step(model, hyper):
        assignment = assign(model, "adamw", hyper)
        weight, steps = model.h[0].mlp.c_fc.weight, []
        optimizer = next(opt for opt in assignment.optimizers.values()
                         if any(p is weight for group in opt.param_groups for p in group["params"]))

        def poison(*_):
            steps.append(None)
            if len(steps) == 3:
                weight.data[0, 0] = math.nan

        optimizer.register_step_post_hook(poison)
        return assignment

    out = tmp_path / "a"
    result = train(config(out, strategy="adamw", ckpt_every=2, stop_after=3), build_assignment=poisoned_third_step)
    assert result.diverged
    saved = load_checkpoint(str(out / "ckpt.pt"))
    assert saved["step"] == 2 and all(v.isfinite().all() for v in saved["model"].values())
    last = _records(out / "log.jsonl")[-1]
    assert last == {"kind": "diverged", "step": 2, "nonfinite_parameters": ["h.0.mlp.c_fc.weight"]}


def test_a_missing_checkpoint_says_what_to_do_with_the_folder(tmp_path):
    # a run killed before its first checkpoint leaves a log: --resume had said "start without
    # --resume", and without it the folder "already holds a run": only --overwrite works
    (tmp_path / "log.jsonl").write_text("{}\n")
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="stopped before its first checkpoint; start it again with --overwrite"):
        load_checkpoint(path)
    save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "step": 4})
    save_checkpoint(path, {"model": {"w": torch.ones(3)}, "step": 8})
    os.remove(path)  # the newest lost, the previous one kept: it is named
    with pytest.raises(ValueError, match=r"does not exist; the previous checkpoint .*\(step 4\) loads: move it over"):
        load_checkpoint(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="does not exist; start without --resume"):
        load_checkpoint(str(empty / "ckpt.pt"))


@pytest.mark.parametrize("there", [False, True])
def test_a_resume_into_a_folder_holding_no_run_is_refused_before_the_data_is_read(tmp_path, monkeypatch, there):
    # it had read the data and built the model before load_checkpoint refused "ckpt.pt does not exist"
    import geomuon.pretrain.train as training

    def read(cfg):
        raise AssertionError("the data was read before the refusal")

    monkeypatch.setattr(training, "load_run_data", read)
    out = tmp_path / "run"
    if there:
        out.mkdir()
    said = "holds no run" if there else "does not exist"
    with pytest.raises(ValueError, match=rf"^--resume \(resume=True\): --out-dir \(out_dir\) '{re.escape(str(out))}' "
                                         rf"{said}, so there is no run to continue; start without --resume"):
        train(config(out, resume=True))
    assert out.exists() == there  # nothing created
    # negative control: a folder holding a run's log (killed before its first checkpoint) passes this
    # check, and load_checkpoint says what to do with it after the data was read
    out.mkdir(exist_ok=True)
    (out / "log.jsonl").write_text("{}\n")
    with pytest.raises(AssertionError, match="the data was read"):
        train(config(out, resume=True))


def test_flipped_bytes_inside_a_checkpoint_are_reported_by_its_crc(tmp_path):
    # a tensor's bytes changed in place: the zip archive stays readable and torch.load took
    # the damaged weights; every entry's CRC-32 is checked first
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": {"w": torch.arange(1000.0)}, "step": 1})
    save_checkpoint(path, {"model": {"w": torch.arange(1000.0) * 2}, "step": 2})
    with zipfile.ZipFile(path) as archive:  # the tensor's entry: the largest (stored, not compressed)
        entry = max(archive.infolist(), key=lambda info: info.file_size)
    with open(path, "r+b") as f:
        f.seek(entry.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(entry.header_offset + 30 + name_length + extra_length + 100)  # into the tensor's bytes
        word = f.read(4)
        f.seek(-4, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in word))
    assert torch.load(path, weights_only=True)["step"] == 2  # the damage torch.load does not see
    with pytest.raises(ValueError, match=rf"'{path}' is truncated or corrupt \(its entry '.*' fails its CRC check.*"
                                         r"\(step 1\) loads"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------- interrupts

GEOMUON = [sys.executable, "-m", "geomuon.cli"]
# AdamW state (moments, step counts) is resumed too; 40 steps of the tiny model take ~1 s
SMALL = ["--config", "cpu-tiny", "--strategy", "adamw", "--steps", "40", "--batch-size", "4", "--block-size", "32",
         "--eval-every", "8", "--eval-batches", "1", "--warmup-steps", "3", "--log-every", "1", "--adamw-lr", "3e-3",
         "--no-progress", "--no-print-table"]
# the subprocess uses this process's thread count: CPU reductions are bit-reproducible only then
SAME_THREADS = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))


def _start(args):
    return subprocess.Popen([*GEOMUON, "pretrain", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=SAME_THREADS)


def _signal_after_step(proc, log_path, step, signum):
    """Send ``signum`` once ``log.jsonl`` shows a train record at ``step`` or later."""
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        if os.path.exists(log_path):
            if any(r["kind"] == "train" and r["step"] >= step for r in read_log(log_path)):  # the run writes on
                break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signum)
    return proc.communicate(timeout=60)


def _records(path):
    """The log's records with their wall-clock times blanked (the only values that differ)."""
    records = [json.loads(line) for line in open(path)]
    return [{k: (None if k == "time" else v) for k, v in r.items()} for r in records]


def test_sigint_saves_and_the_printed_command_resumes_bit_identically(tmp_path, capsys):
    """A real SIGINT to a running ``geomuon pretrain``: exit 130, a checkpoint at the
    interrupted step (the only one before the end: ``--ckpt-every 1000``), one line with
    the command; that command finishes the run, whose
    weights and log equal an uninterrupted run's bit for bit (times aside)."""
    out = tmp_path / "interrupted"
    proc = _start([*SMALL, "--ckpt-every", "1000", "--out-dir", str(out)])  # no scheduled checkpoint before 40
    _, err = _signal_after_step(proc, out / "log.jsonl", 3, signal.SIGINT)
    assert proc.returncode == 130, err
    line = err.strip().splitlines()[-1]
    step = int(re.match(r"interrupted at step (\d+); resume with: (.*)$", line).group(1))
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:2] == ["geomuon", "pretrain"] and "--resume" in command
    saved = load_checkpoint(str(out / "ckpt.pt"))
    assert saved["step"] == step and 3 < step < 40  # the interrupt wrote it
    # the printed command, through the same command line, in this process
    assert cli(command[1:]) == 0
    assert f"resumed from {out / 'ckpt.pt'} at step {step}" in capsys.readouterr().out
    whole = tmp_path / "whole"
    assert cli(["pretrain", *SMALL, "--ckpt-every", "1000", "--out-dir", str(whole)]) == 0
    final, expected = (load_checkpoint(str(d / "ckpt.pt")) for d in (out, whole))
    assert final["step"] == expected["step"] == 40
    for name, value in expected["model"].items():
        assert torch.equal(final["model"][name], value), name
    assert _records(out / "log.jsonl") == _records(whole / "log.jsonl")


def _signal_at_evaluation(step, signum):
    """An ``extra_metrics`` hook that sends this process ``signum`` at the evaluation of
    ``step`` — a real signal, delivered while :func:`train`'s handler is installed."""
    def hook(model, evaluation):
        if evaluation.step == step:
            signal.raise_signal(signum)
        return {}
    return hook


def test_sigterm_before_the_first_checkpoint_still_leaves_one(tmp_path):
    cfg = config(tmp_path / "run", strategy="adamw", eval_every=3, ckpt_every=100)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as stop:
        train(cfg, extra_metrics=_signal_at_evaluation(3, signal.SIGTERM))
    assert (stop.value.step, stop.value.exit_code) == (3, 143)
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["step"] == 3  # the scheduled one was at 100
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler is gone with it


def _sigterm_after_step(count, before_signal=lambda model: None):
    """A ``build_assignment`` hook: AdamW whose ``count``-th ``step()`` ends with
    ``before_signal(model)`` and a real SIGTERM."""
    from geomuon.optimizers.assign import assign

    def build(model, hyper):
        assignment = assign(model, "adamw", hyper)
        plain_step, calls = assignment.step, []

        def step():
            plain_step()
            calls.append(None)
            if len(calls) == count:
                before_signal(model)
                signal.raise_signal(signal.SIGTERM)

        assignment.step = step
        return assignment

    return build


def test_a_signal_between_loss_logs_checkpoints_the_loss_of_every_step(tmp_path):
    # losses come to the host every log_every steps; a signal during step 5 (steps 4 and 8 are
    # logged) stops before step 6 and the checkpoint holds the losses of steps 0-5, step 5's too
    cfg = config(tmp_path / "run", strategy="adamw", log_every=4, ckpt_every=100)
    with pytest.raises(TrainingInterrupted) as stop:
        train(cfg, build_assignment=_sigterm_after_step(6))
    assert stop.value.step == 6
    saved = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert saved["step"] == 6 and sorted(saved["losses"]) == list(range(6))


def test_a_signal_after_weights_went_non_finite_reports_no_checkpoint(tmp_path):
    # the step before the signal leaves a NaN weight (its loss and gradient were finite): the
    # checkpoint at the signal is refused, and the interruption must say so instead of
    # pointing at a checkpoint that holds no such step
    def poison(model):
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")

    cfg = config(tmp_path / "run", strategy="adamw", ckpt_every=100)
    with pytest.raises(TrainingInterrupted) as stop:
        train(cfg, build_assignment=_sigterm_after_step(4, poison))
    assert stop.value.step == 4 and not stop.value.saved
    assert "no checkpoint was written" in str(stop.value) and "checkpoint in" not in str(stop.value)
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_resumed_log_has_the_fields_and_order_of_an_uninterrupted_one(tmp_path):
    """Stopped between evaluations with the loss logged every 3 steps, then resumed: the
    records, every field and their order, are those of one uninterrupted run (the old
    rebuild dropped lr_factor/grad_norm and put each evaluation before its step's loss)."""
    kw = dict(strategy="adamw", steps=20, eval_every=4, ckpt_every=0, log_every=3)
    train(config(tmp_path / "split", **kw, stop_after=10))
    train(config(tmp_path / "split", **kw, resume=True))
    train(config(tmp_path / "whole", **kw))
    split, whole = _records(tmp_path / "split" / "log.jsonl"), _records(tmp_path / "whole" / "log.jsonl")
    assert [list(r) for r in split] == [list(r) for r in whole] and split == whole
    assert [r["step"] for r in whole if r["kind"] == "train"] == [0, 3, 6, 9, 12, 15, 18]


def test_a_full_disk_while_checkpointing_names_the_file_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    # a full disk had raised a bare "[Errno 28]" naming nothing and left ckpt.pt.tmp (a partial
    # file taking the space a retry needs); now the error names the checkpoint and whether the
    # one before is intact, and the partial file is gone
    import errno

    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": {"w": torch.ones(2)}, "step": 1})
    write = torch.save

    def disk_full(payload, file, *args, **kwargs):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(RunWriteError, match=rf"checkpoint '{re.escape(path)}' could not be written "
                                                   r"\(No space left on device\); .* still holds the previous"):
        save_checkpoint(path, {"model": {"w": torch.zeros(2)}, "step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    monkeypatch.setattr(torch, "save", write)
    assert load_checkpoint(path)["step"] == 1  # the earlier checkpoint, untouched
    with pytest.raises(RunWriteError, match=r"no earlier checkpoint exists"):
        monkeypatch.setattr(torch, "save", disk_full)
        save_checkpoint(str(tmp_path / "other.pt"), {"model": {}, "step": 1})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    # the command line says it in one line and exits 1 (it had printed a traceback)
    out = tmp_path / "run"
    assert cli(["pretrain", *SMALL, "--steps", "8", "--eval-every", "2", "--out-dir", str(out)]) == 1
    assert f"geomuon pretrain: checkpoint '{out / 'ckpt.pt'}' could not be written" in capsys.readouterr().err
    assert not (out / "ckpt.pt.tmp").exists()


def test_a_signal_at_a_checkpointed_step_keeps_the_checkpoint_before_it(tmp_path):
    # the signal lands at the evaluation of step 4, whose checkpoint is then written; the stop
    # before step 5's training had written step 4 a second time, so ckpt.prev.pt became a copy
    # of it and the step 2 checkpoint was gone
    cfg = config(tmp_path / "run", strategy="adamw", eval_every=2, ckpt_every=2)
    with pytest.raises(TrainingInterrupted) as stop:
        train(cfg, extra_metrics=_signal_at_evaluation(4, signal.SIGINT))
    assert stop.value.step == 4 and stop.value.saved
    newest = str(tmp_path / "run" / "ckpt.pt")
    assert load_checkpoint(newest)["step"] == 4
    assert load_checkpoint(previous_checkpoint(newest))["step"] == 2
    # resumed and stopped before its first step (a signal while its optimizers are built): the
    # folder still holds steps 4 and 2
    from geomuon.optimizers.assign import assign

    def build_then_signal(model, hyper):
        assignment = assign(model, "adamw", hyper)
        signal.raise_signal(signal.SIGINT)
        return assignment

    with pytest.raises(TrainingInterrupted) as again:
        train(replace(cfg, resume=True), build_assignment=build_then_signal)
    assert again.value.step == 4 and again.value.saved
    assert load_checkpoint(previous_checkpoint(newest))["step"] == 2


def test_a_full_disk_while_logging_names_the_log(tmp_path):
    # a log line that could not be written had raised a bare "[Errno 28]" naming no file
    import errno

    class FullDisk:  # a buffered file on a full disk: its close flushes the line again, and fails
        def write(self, text=None):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        close = flush = write

    path = str(tmp_path / "log.jsonl")
    log = RunLog(path, [{"kind": "train", "step": 0, "loss": 1.0}])
    log.file.close()
    log.file = FullDisk()
    with pytest.raises(RunWriteError, match=rf"log '{re.escape(path)}' could not be written \(No space left on "
                                            r"device\); a resume rewrites it .* --resume"):
        try:
            log.write({"kind": "train", "step": 1, "loss": 0.5})
        finally:
            log.close()  # as the run closes its log: it had raised a bare OSError over the RunWriteError


def test_a_log_line_cut_short_by_a_kill_is_left_out_and_the_resume_rewrites_it(tmp_path):
    # a run killed while writing a log line leaves it cut short (no newline): read_log had raised
    # a bare JSONDecodeError naming no file; it reads the complete records, as a resume keeps them
    kw = dict(strategy="adamw", steps=4, eval_every=2, ckpt_every=2, log_every=1, warmup_steps=1)
    train(config(tmp_path / "split", **kw, stop_after=2))
    log = tmp_path / "split" / "log.jsonl"
    complete = read_log(log)
    with open(log, "a") as f:
        f.write('{"kind": "train", "step": 2, "lo')
    assert read_log(log) == complete
    train(config(tmp_path / "split", **kw, resume=True))
    train(config(tmp_path / "whole", **kw))
    assert _records(log) == _records(tmp_path / "whole" / "log.jsonl")


@pytest.mark.parametrize("damaged, problem", [(b'{"kind": "train" "step": 2}\n', "Expecting ',' delimiter: column 18"),
                                              (b"\xff\xfe{}\n", "not UTF-8"), (b"\n", "Expecting value"),
                                              (b"[1, 2]\n", "a JSON list, not an object")])
def test_a_damaged_log_line_is_named_with_what_to_do(tmp_path, damaged, problem):
    # anything but a last line cut short is damage: a ValueError naming the file and the line
    path = tmp_path / "log.jsonl"
    RunLog(str(path), [{"kind": "train", "step": s, "loss": 1.0} for s in range(3)]).close()
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2] + [damaged] + lines[2:]))
    with pytest.raises(ValueError, match=rf"log '{re.escape(str(path))}': line 3 is not a JSON record "
                                         rf"\({re.escape(problem)}.*\); .* with --resume"):
        read_log(str(path))
