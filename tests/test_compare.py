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
                                           ("--divergence-margin", "-0.5"), ("--divergence-margin", "nan")])
def test_compare_rejects_bad_options_before_running(tmp_path, capsys, option, value):
    assert cli(["compare", option, value, "--out-dir", str(tmp_path / "c")]) == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit):  # not an integer: argparse refuses it, naming the option
        cli(["compare", "--seeds", "a", "--out-dir", str(tmp_path / "c")])
    assert "--seeds" in capsys.readouterr().err
