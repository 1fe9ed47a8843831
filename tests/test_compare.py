"""``geomuon compare``: the verdict, the table and the figures."""

import math

import matplotlib.image
import pytest

from geomuon.cli import main as cli
from geomuon.pretrain.compare import results_table, verdict
from geomuon.pretrain.train import TrainResult


def result(val_losses, diverged=False):
    return TrainResult("x", evals=[{"step": i, "val_loss": v} for i, v in enumerate(val_losses)], diverged=diverged)


def test_verdict_flags_non_finite_and_unrecovered_growth():
    assert verdict(result([4.0, 3.0, 2.9]), 0.5) == (2.9, 2.9, False)
    assert verdict(result([4.0, 3.0, 3.6]), 0.5)[2]  # 0.6 nats above the best: diverged
    assert not verdict(result([4.0, 3.0, 3.4]), 0.5)[2]
    final, best, diverged = verdict(result([4.0, math.nan]), 0.5)
    assert math.isnan(final) and best == 4.0 and diverged
    assert verdict(result([4.0, 3.0], diverged=True), 0.5)[2]  # stopped on a non-finite loss


def test_compare_cli_prints_table_and_writes_figures(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = cli(["compare", "--strategies", "adamw,hetero", "--seeds", "0", "--config", "cpu-tiny",
                "--steps", "6", "--batch-size", "2", "--block-size", "16", "--eval-every", "3",
                "--eval-batches", "1", "--warmup-steps", "1", "--dual-steps", "2", "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    table = printed[printed.index("strategy"):]
    assert "adamw" in table and "hetero" in table and "final val loss" in table
    for name in ("loss.png", "sigma_max.png", "attention_logits.png"):
        assert f"figure: {out / name}" in printed
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not blank
    assert (out / "hetero-s0" / "log.jsonl").is_file()


def test_compare_rejects_unknown_strategy_before_running(tmp_path, capsys):
    assert cli(["compare", "--strategies", "hetero,nope", "--out-dir", str(tmp_path / "c")]) == 2
    assert "--strategies 'nope' is unknown" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_results_table_columns():
    from geomuon.pretrain.compare import RunSummary

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
    assert "--resume with a different run configuration (steps: 6 → 12)" in capsys.readouterr().err
    assert not (out / "unconstrained-s0").exists()  # refused before the first run started


def test_an_interrupted_comparison_resumes_with_the_printed_command(tmp_path, monkeypatch, capsys):
    """SIGINT (a real one, sent at the second run's step-3 evaluation) stops ``compare``
    with exit 130 and a command; that command reads the finished run back without
    retraining it, finishes the second from its checkpoint, and prints the table."""
    import re
    import shlex
    import signal

    from geomuon.pretrain import compare as compare_module

    real_train, calls = compare_module.train, []

    def train_interrupting_the_second_run(cfg, data):
        calls.append(cfg.strategy)
        def hook(model, evaluation):
            if calls == ["adamw", "unconstrained"] and evaluation.step == 3:
                signal.raise_signal(signal.SIGINT)
            return {}
        return real_train(cfg, data, extra_metrics=hook)

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


import re  # noqa: E402
