"""``geomuon compare``: the verdict, the table and the figures."""

import dataclasses
import math
import os
import re
import subprocess

import matplotlib.image
import matplotlib.pyplot
import pytest

from geomuon.cli import main as cli
from geomuon.pretrain import compare as compare_module
from geomuon.pretrain.compare import RunSummary, results_table, summary_line, verdict
from geomuon.pretrain.config import TrainConfig
from geomuon.pretrain.train import TrainResult, read_log


def result(val_losses, diverged=False, last_step=0):
    return TrainResult("x", evals=[{"step": i, "val_loss": v} for i, v in enumerate(val_losses)], diverged=diverged,
                       last_step=last_step)


def test_verdict_flags_non_finite_and_unrecovered_growth():
    assert verdict(result([4.0, 3.0, 2.9]), 0.5) == (2.9, 2.9, False)
    assert verdict(result([4.0, 3.0, 3.6]), 0.5)[2]  # 0.6 nats above the best: diverged
    assert not verdict(result([4.0, 3.0, 3.4]), 0.5)[2]
    final, best, diverged = verdict(result([4.0, math.nan]), 0.5)
    assert math.isnan(final) and best == 4.0 and diverged
    assert verdict(result([4.0, 3.0], diverged=True), 0.5)[2]  # stopped on a non-finite loss


def test_a_run_stopped_before_its_schedules_end_is_not_judged_by_its_growth():
    # --stop-after 10 of --steps 20: a last val loss 0.6 nats above the best is no growth that does
    # not recover yet (the rest of the schedule may bring it down); it had been called diverged
    rising = [4.0, 3.0, 3.6]
    assert verdict(result(rising, last_step=10), 0.5, steps=20) == (3.6, 3.0, False)
    assert verdict(result(rising, last_step=20), 0.5, steps=20)[2]  # control: the schedule ran, diverged
    assert verdict(result(rising, last_step=10), 0.5)[2]  # control: no schedule given, taken as run
    # stopped early on a non-finite loss, or a non-finite val loss: diverged all the same
    assert verdict(result([4.0, 3.0], diverged=True, last_step=10), 0.5, steps=20)[2]
    assert verdict(result([4.0, math.nan], last_step=10), 0.5, steps=20)[2]


def test_compare_cli_prints_table_and_writes_figures(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = cli(["compare", "--strategies", "adamw,hetero", "--seeds", "0", "--config", "cpu-tiny",
                "--steps", "6", "--batch-size", "2", "--block-size", "16", "--eval-every", "3",
                "--eval-batches", "1", "--warmup-steps", "1", "--dual-steps", "2", "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    # every row of the table is what its run's log.jsonl holds: the last and the smallest val loss
    rows = [line.split() for line in printed[printed.index("strategy"):].splitlines()[2:4]]
    for strategy, seed, final, best, diverged, _ in rows:
        losses = [r["val_loss"] for r in read_log(out / f"{strategy}-s{seed}" / "log.jsonl") if r["kind"] == "eval"]
        assert [final, best, diverged] == [f"{losses[-1]:.4f}", f"{min(losses):.4f}", "no"]
    assert sorted(row[0] for row in rows) == ["adamw", "hetero"]
    for name in ("loss.png", "sigma_max.png", "attention_logits.png"):
        assert f"figure: {out / name}" in printed
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not blank
    assert (out / "hetero-s0" / "log.jsonl").is_file()


def test_compare_rejects_unknown_strategy_before_running(tmp_path, capsys):
    assert cli(["compare", "--strategies", "hetero,nope", "--out-dir", str(tmp_path / "c")]) == 2
    assert "--strategies 'nope' is unknown" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_an_fp32_direction_with_torch_muon_is_refused_before_any_run(tmp_path, capsys):
    # torch.optim.Muon computes in bf16 whatever it is asked: assign refuses fp32, but only when
    # the torch_muon run is built, after the comparison's earlier strategies had trained
    assert cli(["compare", "--strategies", "adamw,torch_muon", "--direction-dtype", "fp32",
                "--out-dir", str(tmp_path / "c")]) == 2
    assert "--direction-dtype fp32 cannot apply to --strategy torch_muon" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_results_table_columns():
    table = results_table([RunSummary("hetero", 0, 3.25, 3.2, False, 12.3, result([3.25]))])
    assert table.splitlines()[0].split() == ["strategy", "seed", "final", "val", "loss", "best", "val", "loss",
                                             "diverged", "wall", "time"]
    assert "3.2500" in table and "12.3s" in table and "no" in table


@pytest.mark.parametrize("option, value", [("--seeds", ""), ("--seeds", "-1"), ("--strategies", ""),
                                           ("--divergence-margin", "-0.5"), ("--divergence-margin", "nan"),
                                           # twice: refused only after the first run had trained
                                           ("--seeds", "0,0"), ("--strategies", "adamw,hetero,adamw")])
def test_compare_rejects_bad_options_before_running(tmp_path, capsys, option, value):
    assert cli(["compare", option, value, "--out-dir", str(tmp_path / "c")]) == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit):  # not an integer: argparse refuses it, naming the option
        cli(["compare", "--seeds", "a", "--out-dir", str(tmp_path / "c")])
    assert "--seeds" in capsys.readouterr().err


SMALL = ["--config", "cpu-tiny", "--steps", "6", "--batch-size", "2", "--block-size", "16", "--eval-every", "3",
         "--eval-batches", "1", "--warmup-steps", "1", "--no-progress"]


def test_a_second_comparison_in_the_same_folder_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli(["compare", "--strategies", "adamw", *SMALL]) == 0 and cli(["compare", "--strategies", "adamw", *SMALL]) == 0
    first, second = sorted((tmp_path / "runs").iterdir())  # the default folder is fresh each time
    log = (first / "adamw-s0" / "log.jsonl").read_bytes()
    capsys.readouterr()
    assert cli(["compare", "--strategies", "unconstrained", *SMALL, "--out-dir", str(first)]) == 2
    err = capsys.readouterr().err
    assert "already holds a comparison" in err and "--resume" in err and "--overwrite" in err
    assert (first / "adamw-s0" / "log.jsonl").read_bytes() == log
    assert not (first / "unconstrained-s0").exists()


def test_a_resumed_comparison_with_a_changed_option_trains_no_run(tmp_path, capsys):
    # each run's identity had been checked inside its own train(): a run new to the comparison,
    # listed first, trained to the end before the changed option was refused at the next run
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(out)]) == 0
    capsys.readouterr()
    changed = [*SMALL, "--steps", "12", "--resume", "--out-dir", str(out)]  # the last --steps counts
    assert cli(["compare", "--strategies", "unconstrained,adamw", *changed]) == 2
    err = capsys.readouterr().err
    # named by the run's checkpoint: which of a comparison's runs differs had not been said
    assert f"geomuon compare: '{out / 'adamw-s0' / 'ckpt.pt'}': --resume with a different run configuration " \
           "(steps: 6 → 12)" in err
    assert not (out / "unconstrained-s0").exists()  # refused before the first run started


def test_a_resumed_comparison_reads_its_data_from_another_path_but_not_other_data(tmp_path, monkeypatch, capsys):
    # the --data spec had been compared as a string: a comparison resumed with the corpus moved (or
    # spelled by another path) was refused; its tokens decide, as for one run (check_same_run)
    from geomuon.pretrain.data import embedded_corpus

    monkeypatch.chdir(tmp_path)
    text = embedded_corpus()[:20_000]
    (tmp_path / "corpus.txt").write_text(text)
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--stop-after", "3", "--data", "text:corpus.txt",
                "--out-dir", str(out)]) == 0
    (tmp_path / "moved").mkdir()
    os.replace(tmp_path / "corpus.txt", tmp_path / "moved" / "corpus.txt")
    (tmp_path / "edited.txt").write_text(text[::-1])  # the same characters and lengths, other tokens
    capsys.readouterr()
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--data", "text:edited.txt", "--resume",
                "--out-dir", str(out)]) == 2  # negative control
    assert (f"'{out / 'adamw-s0' / 'ckpt.pt'}': --data text:edited.txt: the data differs from the data the run was "
            f"trained on, read from text:{os.path.realpath(tmp_path / 'corpus.txt')} (tokens sha256: "
            ) in capsys.readouterr().err  # (where it was read from when trained: an absolute path)
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--data", f"text:{tmp_path / 'moved' / 'corpus.txt'}",
                "--resume", "--out-dir", str(out)]) == 0
    assert max(read_log(out / "adamw-s0" / "log.jsonl"), key=lambda r: r["step"])["step"] == 6  # trained to the end


def test_a_resume_that_leaves_out_runs_of_the_folder_is_refused_before_any_run(tmp_path, capsys):
    # a resume naming fewer strategies or seeds than the folder holds had redrawn its figures and
    # table from those alone: the other runs vanished from them without a word
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw,unconstrained", "--seeds", "0,1", *SMALL, "--out-dir", str(out)]) == 0
    capsys.readouterr()
    held = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    for strategies, seeds, left_out in (("adamw", "0,1", "unconstrained-s0, unconstrained-s1"),
                                        ("adamw,unconstrained", "1", "adamw-s0, unconstrained-s0")):
        assert cli(["compare", "--strategies", strategies, "--seeds", seeds, *SMALL, "--resume",
                    "--out-dir", str(out)]) == 2
        assert (f"geomuon compare: --resume (resume=True): {str(out)!r} holds runs that --strategies (strategies) "
                f"and --seeds (seeds) leave out ({left_out}): the figures and the table") in capsys.readouterr().err
        assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == held  # nothing touched
    # control: a resume naming every run (in another order) reads them all back, into one table
    assert cli(["compare", "--strategies", "unconstrained,adamw", "--seeds", "1,0", *SMALL, "--resume",
                "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("resumed from ") == 4 and printed.strip().splitlines()[-1].startswith("compare: 4 runs, ")


def test_an_overwrite_that_leaves_out_runs_of_the_folder_is_refused_before_any_run(tmp_path, capsys):
    # --overwrite naming fewer strategies had replaced those runs and left the others beside them:
    # the "continue" command the new comparison printed was then refused (runs it leaves out), and
    # naming them too was refused as well (their checkpoints of another schedule)
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw,unconstrained", *SMALL, "--out-dir", str(out)]) == 0
    capsys.readouterr()
    held = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--overwrite", "--out-dir", str(out)]) == 2
    assert (f"geomuon compare: --overwrite (overwrite=True): {str(out)!r} holds runs that --strategies (strategies) "
            "and --seeds (seeds) leave out (unconstrained-s0): --overwrite replaces the runs it names"
            ) in capsys.readouterr().err
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == held  # nothing touched
    # control: naming every run replaces the comparison
    assert cli(["compare", "--strategies", "unconstrained,adamw", *SMALL, "--overwrite", "--out-dir", str(out)]) == 0


@pytest.mark.parametrize("held", ["nothing", "figures", "missing"])
def test_a_resume_into_a_folder_holding_no_run_is_refused_as_pretrain_refuses_it(tmp_path, capsys, held):
    # an empty folder, or one of figures whose runs are gone, had started a fresh comparison under
    # --resume (geomuon pretrain refuses a resume into a folder holding no run)
    out = tmp_path / "cmp"
    if held != "missing":
        out.mkdir()
    if held == "figures":
        (out / "loss.png").write_bytes(b"png")
    said = {"missing": "does not exist, so there is no comparison to continue; start without --resume",
            "nothing": "holds no run, so there is no comparison to continue; start without --resume",
            # (without --resume it is refused as holding a comparison: the way out is --overwrite)
            "figures": "holds the figures of a comparison (loss.png) but none of its runs, so there is no comparison "
                       "to continue; replace them with --overwrite"}[held]
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--resume", "--out-dir", str(out)]) == 2
    assert f"geomuon compare: --resume (resume=True): --out-dir (out_dir) {str(out)!r} {said}" in \
        capsys.readouterr().err
    assert out.exists() == (held != "missing")  # nothing created, nothing written
    assert sorted(p.name for p in out.rglob("*")) == (["loss.png"] if held == "figures" else [])


def test_an_interrupted_comparison_resumes_with_the_printed_command(tmp_path, monkeypatch, capsys):
    """SIGINT (a real one, sent at the second run's step-3 evaluation) stops ``compare``
    with exit 130 and a command; that command reads the finished run back without
    retraining it, finishes the second from its checkpoint, and prints the table."""
    import shlex
    import signal

    real_train, calls = compare_module.train, []

    def train_interrupting_the_second_run(cfg, data, sharing):
        calls.append(cfg.strategy)
        def hook(model, evaluation):
            if calls == ["adamw", "unconstrained"] and evaluation.step == 3:
                signal.raise_signal(signal.SIGINT)
            return {}
        return real_train(cfg, data, extra_metrics=hook, sharing=sharing)

    monkeypatch.setattr(compare_module, "train", train_interrupting_the_second_run)
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw,unconstrained", *SMALL, "--out-dir", str(out)]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(rf"interrupted at step 3 of {out / 'unconstrained-s0'}; resume with: geomuon compare ", line)
    finished = (out / "adamw-s0" / "ckpt.pt").read_bytes()
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert cli(command[1:]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {out / 'adamw-s0' / 'ckpt.pt'} at step 6" in printed
    assert f"resumed from {out / 'unconstrained-s0' / 'ckpt.pt'} at step 3" in printed
    assert re.search(r"^unconstrained +0 +\d\.\d{4}", printed, re.MULTILINE)  # its row of the table
    assert (out / "adamw-s0" / "ckpt.pt").read_bytes() == finished  # read back, not trained again
    assert printed.strip().splitlines()[-1].startswith("compare: 2 runs, ")


def test_compare_shows_progress_per_run_and_overall_and_ends_with_a_summary(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = [a for a in SMALL if a != "--no-progress"]
    assert cli(["compare", "--strategies", "adamw,unconstrained", *args, "--out-dir", str(out)]) == 0
    captured = capsys.readouterr()
    assert "compare: 100%" in captured.err and "2/2" in captured.err  # the overall bar, in runs
    assert "adamw s0" in captured.err and "unconstrained s0" in captured.err  # each run's bar
    last = captured.out.strip().splitlines()[-1]
    assert re.match(r"compare: 2 runs, 0 diverged, \d+s; best final val loss \d\.\d{4} \(\w+ s0, step 6\); "
                    rf"runs and figures in {re.escape(str(out))}$", last)


def run_summary(strategy, seed, val_losses, stopped=False):
    final, best, diverged = verdict(result(val_losses, diverged=stopped), 0.5)
    return RunSummary(strategy, seed, final, best, diverged, 1.0, result(val_losses, diverged=stopped))


def test_the_summary_line_names_no_diverged_run_as_best():
    # a run stopped on a non-finite loss keeps the val loss of its last evaluation before it
    # (2.0 here, at step 1), below every finished run's: it had been named the best run
    stopped = run_summary("adamw", 0, [4.0, 2.0], stopped=True)
    blown_up = run_summary("unconstrained", 0, [4.0, 3.0, 3.0, 1e9])
    finished = run_summary("hetero", 0, [4.0, 3.5, 3.25])
    line = summary_line([stopped, blown_up, finished], 10.0, None)
    assert line == "compare: 3 runs, 2 diverged, 10s; best final val loss 3.2500 (hetero s0, step 2)"
    assert summary_line([stopped, blown_up], 10.0, None) == (
        "compare: 2 runs, 2 diverged, 10s; no run finished without diverging")


def test_the_table_and_summary_of_stopped_runs_call_their_val_loss_the_last_one_and_name_the_step():
    # runs that --stop-after stopped at step 10 of 20 had been shown under "final val loss"
    def summaries(last_step):
        runs = [("adamw", result([4.0, 3.0, 3.3], last_step=last_step)),
                ("hetero", result([4.0, 3.5, 3.25], last_step=last_step))]
        return [RunSummary(name, 0, *verdict(run, 0.5, 20), 1.0, run, 20) for name, run in runs]

    stopped = summaries(10)
    assert results_table(stopped).splitlines()[0].split()[2:5] == ["last", "val", "loss"]
    assert summary_line(stopped, 10.0, "cmp") == ("compare: 2 runs, 0 diverged, 10s; stopped at step 10 of 20 "
                                                  "(--stop-after); best last val loss 3.2500 (hetero s0, step 2); "
                                                  "runs and figures in cmp")
    finished = summaries(20)  # control: the schedule ran, the output as it was
    assert results_table(finished).splitlines()[0].split()[2:5] == ["final", "val", "loss"]
    assert summary_line(finished, 10.0, "cmp") == ("compare: 2 runs, 0 diverged, 10s; best final val loss 3.2500 "
                                                   "(hetero s0, step 2); runs and figures in cmp")


def test_a_stopped_comparison_prints_the_command_that_continues_it_to_the_end(tmp_path, capsys):
    import shlex

    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw,unconstrained", *SMALL, "--stop-after", "4",
                "--out-dir", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert next(line for line in lines if line.startswith("strategy")).split()[2:5] == ["last", "val", "loss"]
    # stopped at step 4, last evaluated at step 3 (--eval-every 3): both named
    assert re.match(r"compare: 2 runs, 0 diverged, \d+s; stopped at step 4 of 6 \(--stop-after\); best last val "
                    rf"loss \d\.\d{{4}} \(\w+ s0, step 3\); runs and figures in {re.escape(str(out))}$", lines[-1])
    assert lines[-2].startswith("continue the runs to step 6 with: geomuon compare ")
    command = shlex.split(lines[-2].split(" with: ", 1)[1])
    assert "--resume" in command and "--stop-after" not in command
    assert cli(command[1:]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # control: the continued comparison ran its schedule, and says so as a comparison run in one go does
    assert next(line for line in lines if line.startswith("strategy")).split()[2:5] == ["final", "val", "loss"]
    assert not any(line.startswith("continue the runs") for line in lines)
    assert re.match(r"compare: 2 runs, 0 diverged, \d+s; best final val loss \d\.\d{4} \(\w+ s0, step 6\); "
                    rf"runs and figures in {re.escape(str(out))}$", lines[-1])


def test_figures_give_each_module_one_colour_and_each_seed_one_line_style(tmp_path, monkeypatch):
    """Every line of a per-module panel is told apart by (colour = module, style = seed), the
    same in every panel. The colour cycle had been restarted per line: a module's seed-1 line
    took the next module's colour, and past ten lines two modules shared one."""
    modules, strategies, seeds = [f"h.{i}.w" for i in range(11)], ["adamw", "hetero"], [0, 1]

    def value(strategy, seed, module):  # a distinct curve per line, so each line names its run
        return 1 + strategies.index(strategy) + seed / 10 + modules.index(module) / 1000

    summaries = []
    for strategy in strategies:
        for seed in seeds:
            evals = [{"step": step, "val_loss": 3.0, "attn_logit": {"h.0.attn": 1.0},
                      "sigma_max": {m: value(strategy, seed, m) * (1 + step) for m in modules}} for step in (0, 1)]
            run = TrainResult("x", losses={0: 3.0, 1: 2.9}, evals=evals)
            summaries.append(RunSummary(strategy, seed, 3.0, 3.0, False, 1.0, run))
    figures = {}

    def keep(fig, out_dir, name):  # instead of writing and closing: the figure's lines are read below
        figures[name] = fig
        return name

    monkeypatch.setattr(compare_module, "_save", keep)
    compare_module.plot(summaries, str(tmp_path))

    looks = {}  # (module, seed) -> {(colour, style)} over both panels
    for ax, strategy in zip(figures["sigma_max.png"].axes, strategies):
        for line in ax.get_lines():
            (seed, module), = [(s, m) for s in seeds for m in modules
                               if line.get_ydata()[0] == value(strategy, s, m)]
            looks.setdefault((module, seed), set()).add((line.get_color(), str(line.get_linestyle())))
    assert len(looks) == len(modules) * len(seeds) and all(len(look) == 1 for look in looks.values())
    colours = {module: {c for (m, _), look in looks.items() if m == module for c, _ in look} for module in modules}
    styles = {seed: {s for (_, sd), look in looks.items() if sd == seed for _, s in look} for seed in seeds}
    assert all(len(c) == 1 for c in colours.values()) and len(set.union(*colours.values())) == len(modules)
    assert all(len(s) == 1 for s in styles.values()) and len(set.union(*styles.values())) == len(seeds)
    legend = figures["sigma_max.png"].axes[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [*modules, "seed 0", "seed 1"]
    for fig in figures.values():
        matplotlib.pyplot.close(fig)
    # more seeds than line styles: all solid (one bundle per colour), never two seeds sharing a style
    many = [RunSummary("adamw", seed, 3.0, 3.0, False, 1.0, None) for seed in range(7)]
    assert compare_module._seed_styles(many) == dict.fromkeys(range(7), "-")


# ----------------------------------------------------------------------------- provenance (git_commit)


def test_git_commit_says_dirty_or_unknown_rather_than_clean(tmp_path):
    """``git_commit`` of a checkout: the bare hash only when ``git status`` says the tracked
    files are clean; a failed ``git status`` (here a corrupt index) had read as clean."""
    from geomuon.pretrain.provenance import git_commit

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "page.md").write_text("old\n")
    git("add", "."), git("commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "docs" / "results" / "page.md").write_text("new\n")  # a results page: not the measured code
    assert git_commit(repo=tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(repo=tmp_path) == f"{head}-dirty"
    (tmp_path / ".git" / "index").write_bytes(b"corrupt")
    assert git_commit(repo=tmp_path).startswith(f"{head}-unknown-tree (git status: ")


def test_an_interrupt_of_a_diverged_run_promises_no_checkpoint(tmp_path, monkeypatch, capsys):
    # TrainingInterrupted(saved=False): the run had diverged and wrote nothing at the signal; the
    # line had read "interrupted at step 3 of …" as if step 3 were checkpointed
    import signal

    from geomuon.pretrain.train import TrainingInterrupted

    def interrupted(cfg, data, sharing):
        raise TrainingInterrupted(3, signal.SIGINT, cfg.out_dir, saved=False)

    monkeypatch.setattr(compare_module, "train", interrupted)
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(out)]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"interrupted at step 3 of {out / 'adamw-s0'}, which had diverged: no checkpoint was "
                           "written (the run restarts from its last finite checkpoint, if any, else from step 0); "
                           "resume with: geomuon compare ")


def test_an_option_is_refused_only_when_no_strategy_of_the_comparison_takes_it(tmp_path, capsys):
    # one refusal before any run: --dual-steps reaches Manifold Muon, which neither strategy has
    assert cli(["compare", "--strategies", "adamw,unconstrained", "--dual-steps", "3",
                "--out-dir", str(tmp_path / "c")]) == 2
    assert "--dual-steps 3 would be ignored" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    # --lr reaches the unconstrained run's Muon: the comparison's AdamW run shares the option
    base = TrainConfig(lr=0.05)
    assert base.unused_options(["adamw"]) and not base.unused_options(["adamw", "unconstrained"])
    for strategy in ("adamw", "unconstrained"):
        dataclasses.replace(base, strategy=strategy).validate(sharing=["adamw", "unconstrained"])


def test_an_empty_out_dir_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    # "" is the current directory, which os.path.isdir("") denies: the check for an earlier
    # comparison was skipped and a second `--out-dir ''` comparison wrote its figures over the first's
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.png").write_bytes(b"an earlier comparison's figure")
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", ""]) == 2
    assert "--out-dir '' names no folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
    assert (tmp_path / "loss.png").read_bytes() == b"an earlier comparison's figure"


def test_a_resumed_run_without_its_checkpoint_keeps_the_previous_one(tmp_path, capsys):
    # a run folder holding ckpt.prev.pt but no ckpt.pt had started afresh under --resume,
    # overwriting the one checkpoint of the run left; now load_checkpoint says what to do
    out = tmp_path / "cmp"
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(out)]) == 0
    run = out / "adamw-s0"
    (run / "ckpt.pt").unlink()
    kept = (run / "ckpt.prev.pt").read_bytes()
    capsys.readouterr()
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(run / 'ckpt.pt')!r} does not exist" in err and "(step 3) loads: move it over" in err
    assert (run / "ckpt.prev.pt").read_bytes() == kept and not (run / "ckpt.pt").exists()


def test_comparisons_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch, capsys):
    """A templated --out-dir was only resolved, not claimed, until the first run started: a
    comparison started in the same second took the same folder (in parallel launches its runs
    were refused as "in use" or it wrote its figures over the other's). Here the other
    comparison claims the folder while this one checks its runs."""
    import os

    real_validate, other = TrainConfig.validate, []

    def validate_while_another_comparison_starts(cfg, *args, **kwargs):
        if cfg.out_dir is not None and os.path.basename(cfg.out_dir) == "adamw-s0" and not other:
            other.append(os.path.dirname(cfg.out_dir))  # the folder the template gave this comparison
            os.makedirs(os.path.join(other[0], "hetero-s0"))  # the other one's first run, in progress
            open(os.path.join(other[0], "hetero-s0", ".lock"), "w").close()
        return real_validate(cfg, *args, **kwargs)

    monkeypatch.setattr(TrainConfig, "validate", validate_while_another_comparison_starts)
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(tmp_path / "cmp-{time}")]) == 0
    root = capsys.readouterr().out.strip().splitlines()[-1].split("runs and figures in ")[1]
    assert root != other[0] and sorted(os.listdir(root)) == sorted([".lock", "adamw-s0", *compare_module.FIGURES])
    assert os.listdir(other[0]) == ["hetero-s0"]  # nothing of this comparison in the other's folder


def test_a_fresh_folder_is_removed_when_the_comparison_stops_before_writing(tmp_path, capsys):
    # the templated folder is created when the comparison's options pass; bad data refused after
    # that leaves nothing behind
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--data", f"text:{tmp_path / 'missing.txt'}",
                "--out-dir", str(tmp_path / "cmp-{time}")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_comparison_folder_with_a_literal_brace_is_one_folder(tmp_path, capsys):
    # c{{b}} names the folder c{b}: the comparison had resolved it and then handed c{b}/adamw-s0 to
    # its runs as a template, refused with "not a folder template (KeyError: 'b')"
    named = str(tmp_path / "c{{b}}")
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", named]) == 0
    folder = tmp_path / "c{b}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c{b}"] and (folder / "adamw-s0" / "ckpt.pt").is_file()
    assert capsys.readouterr().out.strip().endswith(f"runs and figures in {folder}")
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", named]) == 2  # the same folder: refused
    assert f"{str(folder)!r} already holds a comparison" in capsys.readouterr().err


def test_comparison_refusals_name_the_python_spelling_of_each_option(tmp_path):
    # compare(base, strategies, seeds) had been told "--seeds lists 0 more than once" and "continue it
    # with --resume", flags a Python caller does not write
    from geomuon.pretrain.compare import compare

    base = TrainConfig(model="cpu-tiny", out_dir=str(tmp_path / "cmp"), progress=False, print_table=False)
    with pytest.raises(ValueError, match=r"^--seeds \(seeds\) lists 0 more than once"):
        compare(base, ["adamw"], [0, 0])
    (tmp_path / "cmp" / "adamw-s0").mkdir(parents=True)
    (tmp_path / "cmp" / "adamw-s0" / "log.jsonl").write_text("")  # an earlier comparison's run
    with pytest.raises(ValueError, match=r"^--out-dir \(out_dir\) '.*cmp' already holds a comparison \(adamw-s0/log"
                                         r".*continue it with --resume \(resume=True\), replace it with --overwrite "
                                         r"\(overwrite=True\)"):
        compare(base, ["adamw"], [0])


def test_a_comparison_into_a_folder_another_comparison_is_running_in_is_refused(tmp_path, capsys):
    # two comparisons started together into one --out-dir had both passed the check for an
    # earlier comparison (no run files yet), trained side by side and written their figures
    # over each other's; a comparison now holds its folder while it runs
    import os

    from geomuon.pretrain.train import RunFolderClaim

    folder = tmp_path / "cmp"
    running = RunFolderClaim(str(folder))  # what the other comparison holds while it trains
    assert cli(["compare", "--strategies", "unconstrained", *SMALL, "--out-dir", str(folder)]) == 2
    assert f"--out-dir (out_dir) {str(folder)!r} is in use by another run" in capsys.readouterr().err
    assert os.listdir(folder) == [".lock"]  # nothing of the refused comparison
    running.release()
    assert not folder.exists()  # the claim created it and nothing was written


def test_only_rank_0_of_a_torchrun_comparison_prints_the_table_and_writes_the_figures(tmp_path, monkeypatch, capsys):
    # the other ranks evaluate nothing: each had printed a table reading every run as diverged (val
    # loss nan) and written figures of no evaluation into the files rank 0 was writing
    folder = tmp_path / "cmp"
    run = TrainResult(str(folder / "adamw-s0"), losses={0: 4.0}, evals=[])  # what a rank > 0 gets back
    monkeypatch.setattr(compare_module, "compare", lambda *args: [RunSummary("adamw", 0, math.nan, math.nan, True,
                                                                             0.1, run)])
    monkeypatch.setenv("RANK", "1")
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(folder)]) == 0
    assert capsys.readouterr().out == "" and not folder.exists()
    monkeypatch.setenv("RANK", "0")  # control: rank 0 prints and plots
    folder.mkdir()
    assert cli(["compare", "--strategies", "adamw", *SMALL, "--out-dir", str(folder)]) == 0
    assert "adamw     0     nan" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == sorted(compare_module.FIGURES)
